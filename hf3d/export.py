"""`ParallelModel.save_pretrained`: the sharded model written as one stock HF directory."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from .hf import DEFAULT_MAX_SHARD_BYTES, TensorSpec, write_hf_dir, write_order
from .layout import get_pieces


@torch.no_grad()
def save_hf(pmodel, out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Collective: write an HF directory (safetensors + config.json + generation config and tokenizer
    files if known) that stock `AutoModelForCausalLM.from_pretrained` loads.

    Streams tensor by tensor: every rank walks the HF names in the writer's order; for each one, the
    ranks owning pieces of it (dp rank 0's replica) send them to rank 0, which assembles that one
    tensor, writes it and drops it. No rank ever holds more than one full tensor."""
    rank = dist.get_rank()
    mine: dict[str, dict[tuple[int, int, int], torch.Tensor]] = {}  # name -> (dim, start, stop) -> view
    if pmodel.dp_rank == 0:
        for _, param in pmodel.unique_parameters():
            for p in get_pieces(param):
                if p.owner:
                    mine.setdefault(p.hf_name, {})[(p.dim, p.hf_start, p.hf_stop)] = p.local(param).detach()
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, {name: list(ranges) for name, ranges in mine.items()})
    tied = pmodel.config.tie_word_embeddings
    dtype = pmodel.param_dtype
    specs = [TensorSpec(n, s, dtype) for n, s in pmodel.hf_shapes.items() if not (tied and n == "lm_head.weight")]
    sources = export_sources(table, specs)

    error = None
    if rank != 0:
        for name in write_order(specs, max_shard_bytes):
            for src, *key in sources[name]:
                if src == rank:
                    dist.send(mine[name][tuple(key)].contiguous(), dst=0)
    else:
        shapes = {s.name: s.shape for s in specs}
        received = set()

        def piece(name: str, dim: int, start: int, stop: int) -> torch.Size:
            shape = list(shapes[name])
            shape[dim] = stop - start
            return torch.Size(shape)

        def produce(name: str) -> torch.Tensor:
            full = torch.empty(shapes[name], dtype=dtype)
            for src, dim, start, stop in sources[name]:
                region = full.narrow(dim, start, stop - start)
                if src == 0:
                    region.copy_(mine[name][(dim, start, stop)])
                else:
                    buf = torch.empty(region.shape, dtype=dtype, device=pmodel.device)
                    dist.recv(buf, src=src)
                    region.copy_(buf)
            received.add(name)
            return full

        config = copy.deepcopy(pmodel.config)
        config.dtype = dtype
        try:
            write_hf_dir(out_dir, specs, produce, config, src_dir=pmodel.tokenizer_dir, max_shard_bytes=max_shard_bytes)
        except (OSError, ValueError) as e:  # the disk, not the peers: take what they still send, then tell them
            error = e
            for name in write_order(specs, max_shard_bytes):
                for src, dim, start, stop in sources[name] if name not in received else ():
                    if src != 0:
                        dist.recv(
                            torch.empty(piece(name, dim, start, stop), dtype=dtype, device=pmodel.device), src=src
                        )
    # the end of the export for every rank: rank 0's failure (a full disk, an unwritable folder) is
    # raised everywhere instead of leaving the senders waiting in the next collective
    outcome = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise ValueError(f"rank 0 could not write the HF directory {out_dir}: {outcome[0]}")


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
