"""`ParallelModel.save_pretrained`: the sharded model written as one stock HF directory.

Who writes. Only dp rank 0's replica (its cp rank 0) takes part; each exported tensor lives on one pipeline stage, split
over that stage's tp ranks (or whole on one of them).

- One writer, rank 0, when pp = 1 or when the model fits in one file (a single model.safetensors cannot
  be split between writers): the other ranks send rank 0 their pieces, tensor by tensor, in its write
  order. The files are byte-identical to transformers' own save of the same weights.
- One writer per pipeline stage otherwise (a sharded export at pp > 1): the stage's first tp rank
  assembles its stage's tensors from the pieces its tp group sends it, and writes them into its own
  shard files, numbered across stages (`hf.plan_writer_shards`); nothing crosses stages, and the stages
  write at the same time. Rank 0 then writes the index, config and tokenizer files. The shards are cut
  per stage, so their boundaries differ from those of transformers' save; the tensors do not. This
  needs the staging folder on a filesystem every writer sees; rank 0 leaves a probe file there, and if
  any writer cannot see it the export falls back to the single writer.

Either way the files go into a staging folder that replaces out_dir once complete, no rank ever holds
more than one full tensor, and a writer's failure (a full disk, an unwritable folder) is raised on every
rank instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import copy
import os
import uuid

import torch
import torch.distributed as dist

from ..parallel import fsdp
from ..parallel.layout import get_pieces
from ..utils import files
from .folders import PROBE_PREFIX
from .load import TensorSpec
from .save import (
    DEFAULT_MAX_SHARD_BYTES,
    finish_hf_dir,
    plan_shards,
    plan_writer_shards,
    staging_dir,
    start_staging,
    write_hf_dir,
    write_order,
    write_shard,
)


@torch.no_grad()
def save_hf(
    pmodel,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: dict[str, bytes] | None = None,
) -> None:
    """Collective: write an HF directory (safetensors + config.json + generation config and tokenizer
    files if known, + `extra_files` from rank 0) that stock `AutoModelForCausalLM.from_pretrained` loads (see
    the module docstring for which ranks write). An existing out_dir is replaced only when hf3d made it and it
    holds nothing but an HF export's files; any other is refused on every rank."""
    mine = _owned_pieces(pmodel)
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, {name: list(ranges) for name, ranges in mine.items()})
    tied = pmodel.config.tie_word_embeddings
    specs = [
        TensorSpec(n, s, pmodel.param_dtype)
        for n, s in pmodel.hf_shapes.items()
        if not (tied and n == "lm_head.weight")
    ]
    sources = export_sources(table, specs)
    exporter = _Exporter(pmodel, specs, sources, mine, extra_files)
    plans = stage_plans(pmodel.mesh.mesh, specs, sources, max_shard_bytes)
    if plans is not None and _staging_is_shared(out_dir, list(plans)):
        _raise_everywhere(exporter.write_by_stage(staging_dir(out_dir), plans), out_dir)
        error = None
        if dist.get_rank() == 0:
            plan = [entry for writer in sorted(plans) for entry in plans[writer]]
            error = _attempt(lambda: exporter.finish(out_dir, plan))
    else:
        error = exporter.write_on_rank0(out_dir, max_shard_bytes) if dist.get_rank() == 0 else None
        if dist.get_rank() != 0:
            exporter.send_all(0, write_order(specs, max_shard_bytes), group=None)
    _raise_everywhere(error, out_dir)


def _owned_pieces(pmodel) -> dict[str, dict[tuple[int, int, int], torch.Tensor]]:
    """{hf name: {(dim, start, stop): tensor}}: the pieces this rank exports, on the first copy over dp x cp: views
    of its parameters, or under ZeRO-3 copies taken while each FSDP group is gathered in turn (collective)."""
    mine: dict[str, dict[tuple[int, int, int], torch.Tensor]] = {}

    def take(param, tensor: torch.Tensor, copy: bool) -> None:
        if not pmodel.exports(param):
            return
        for p in get_pieces(param):
            if p.owner:
                piece = p.local(tensor).detach()
                mine.setdefault(p.hf_name, {})[(p.dim, p.hf_start, p.hf_stop)] = piece.clone() if copy else piece

    if not pmodel.fsdp_modules:
        for _, param in pmodel.unique_parameters():
            take(param, param, copy=False)
        return mine
    fsdp.reshard_all(pmodel)  # the sharded parameters carry the layout: none may be left gathered
    for group in fsdp.units(pmodel):
        with fsdp.gathered_parameters(pmodel, group) as pairs:
            for param, full in pairs:
                take(param, full, copy=True)
    return mine


def stage_plans(grid: torch.Tensor, specs: list[TensorSpec], sources: dict, max_shard_bytes: int) -> dict | None:
    """{writer rank: [(file name, tensors)]}, one writer per pipeline stage (its dp 0, tp 0 rank), each
    writing the tensors its stage owns; None when rank 0 writes everything (pp = 1, or one file).
    grid: the mesh's tensor of global ranks, pp first."""
    pp = grid.shape[0]
    if pp == 1 or len(plan_shards(specs, max_shard_bytes)) == 1:
        return None
    stage_of = {r: p for p in range(pp) for r in grid[p].reshape(-1).tolist()}
    per_stage: list[list[TensorSpec]] = [[] for _ in range(pp)]
    for s in specs:
        stages = {stage_of[src] for src, *_ in sources[s.name]}
        assert len(stages) == 1, f"export: {s.name} is split across pipeline stages {sorted(stages)}"
        per_stage[stages.pop()].append(s)
    plans = plan_writer_shards(per_stage, max_shard_bytes)
    return {int(grid[p].reshape(-1)[0]): plans[p] for p in range(pp)}


def _staging_is_shared(out_dir, writers: list[int]) -> bool:
    """Rank 0 creates the staging folder with a probe file of a fresh name in it; True when every
    writer sees the probe (one filesystem). False also when rank 0 cannot create it: the single-writer
    path then meets the same error and reports it."""
    tmp, probe = staging_dir(out_dir), [None]
    if dist.get_rank() == 0:
        try:
            start_staging(out_dir)
            probe[0] = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            files.write_file(tmp / probe[0], b"")
        except (OSError, ValueError):  # the single-writer path meets the same error and reports it
            probe[0] = None
    dist.broadcast_object_list(probe, src=0)
    sees = [None] * dist.get_world_size()
    seen = probe[0] is not None and (dist.get_rank() not in writers or (tmp / probe[0]).exists())
    dist.all_gather_object(sees, seen)
    if dist.get_rank() == 0 and probe[0] is not None:
        files.remove_file(tmp / probe[0])
    return all(sees)


def _attempt(fn) -> BaseException | None:
    try:
        fn()
    except (OSError, ValueError) as e:
        return e
    return None


def _raise_everywhere(error: BaseException | None, out_dir) -> None:
    """Every rank learns every writer's failure: the failing rank raises its own error, the others a
    ValueError naming it."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, msg) for rank, msg in enumerate(outcomes) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise ValueError(f"rank {rank} could not write the HF directory {out_dir}: {msg}")


class _Exporter:
    """The pieces this rank owns and how to assemble whole tensors from the pieces of several ranks."""

    def __init__(self, pmodel, specs: list[TensorSpec], sources: dict, mine: dict, extra_files: dict | None):
        self.pmodel, self.specs, self.sources, self.mine = pmodel, specs, sources, mine
        self.extra_files = extra_files
        self.shapes = {s.name: s.shape for s in specs}
        self.dtype, self.device, self.rank = pmodel.param_dtype, pmodel.device, dist.get_rank()
        self.received: set[str] = set()

    def send_all(self, writer: int, names: list[str], group) -> None:
        """Send `writer` this rank's pieces of `names`, in that order."""
        for name in names:
            for src, *key in self.sources[name]:
                if src == self.rank:
                    dist.send(self.mine[name][tuple(key)].contiguous(), dst=writer, group=group)

    def produce(self, name: str, group=None) -> torch.Tensor:
        """The whole tensor `name`, from this rank's pieces and those received from its owners."""
        full = torch.empty(self.shapes[name], dtype=self.dtype)
        for src, dim, start, stop in self.sources[name]:
            region = full.narrow(dim, start, stop - start)
            if src == self.rank:
                region.copy_(self.mine[name][(dim, start, stop)])
            else:
                buf = torch.empty(region.shape, dtype=self.dtype, device=self.device)
                dist.recv(buf, src=src, group=group)
                region.copy_(buf)
        self.received.add(name)
        return full

    def drain(self, names: list[str], group=None) -> None:
        """After a failed write: take what the senders still send, so none is left waiting."""
        for name in names:
            for src, dim, start, stop in self.sources[name] if name not in self.received else ():
                if src != self.rank:
                    shape = list(self.shapes[name])
                    shape[dim] = stop - start
                    dist.recv(torch.empty(shape, dtype=self.dtype, device=self.device), src=src, group=group)

    def write_on_rank0(self, out_dir, max_shard_bytes: int) -> BaseException | None:
        config = copy.deepcopy(self.pmodel.config)
        config.dtype = self.dtype
        error = _attempt(
            lambda: write_hf_dir(
                out_dir,
                self.specs,
                self.produce,
                config,
                src_dir=self.pmodel.tokenizer_dir,
                max_shard_bytes=max_shard_bytes,
                extra_files=self.extra_files,
            )
        )
        if error is not None:  # the disk, not the peers: take what they still send, then tell them
            self.drain(write_order(self.specs, max_shard_bytes))
        return error

    def write_by_stage(self, tmp, plans: dict) -> BaseException | None:
        """This rank's part of a per-stage export into the staging folder `tmp`: a writer writes its
        files, the other ranks of its tp group send it their pieces; tp groups never reach past a stage."""
        group = self.pmodel.mesh.get_group("tp")
        produce = lambda name: self.produce(name, group)  # noqa: E731 - pieces from this stage's tp ranks
        error = None
        for writer, plan in plans.items():
            names = [s.name for _, g in plan for s in g]
            if self.rank != writer:
                self.send_all(writer, names, group)
                continue
            for fname, g in plan:
                error = error or _attempt(lambda fname=fname, g=g: write_shard(tmp / fname, g, produce))
            if error is not None:
                self.drain(names, group)
        return error

    def finish(self, out_dir, plan: list) -> None:
        config = copy.deepcopy(self.pmodel.config)
        config.dtype = self.dtype
        tmp, tokenizer_dir = staging_dir(out_dir), self.pmodel.tokenizer_dir
        finish_hf_dir(tmp, out_dir, self.specs, plan, config, src_dir=tokenizer_dir, extra_files=self.extra_files)


def export_sources(table: list[dict], specs: list[TensorSpec]) -> dict[str, list[tuple[int, int, int, int]]]:
    """{hf_name: [(rank, dim, start, stop), ...]}: which rank sends which range of each exported tensor,
    from every rank's {hf_name: [(dim, start, stop)]} of owned pieces. Checks that every element is
    covered exactly once: the pieces of a tensor tile it along one dim, without gap or overlap."""
    shapes = {s.name: s.shape for s in specs}
    sources: dict[str, list[tuple[int, int, int, int]]] = {n: [] for n in shapes}
    for rank, owned in enumerate(table):
        for name, ranges in owned.items():
            assert name in shapes, f"export: a rank owns a piece of {name!r}, which is not exported"
            sources[name] += [(rank, *r) for r in ranges]
    wrong = []
    for name, ranges in sources.items():
        ranges.sort(key=lambda r: r[2])
        dims = {r[1] for r in ranges}  # empty when no rank owns the tensor
        edges = [e for r in ranges for e in r[2:]]
        tiles = len(dims) == 1 and edges[0] == 0 and edges[-1] == shapes[name][ranges[0][1]]  # one dim, 0..size
        if not (tiles and all(edges[i] == edges[i + 1] for i in range(1, len(edges) - 1, 2))):
            wrong.append(name)
    assert not wrong, f"export covered these tensors wrongly: {wrong[:5]}"
    return sources
