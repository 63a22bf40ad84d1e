"""The ZeRO-0/1/2 optimizer (fp32 master fragments, the wrapped torch optimizer, global-norm clipping);
`build_optimizer` (hf3d/optim/build.py) picks it, ZeRO-3's (hf3d/optim/sharded.py) or the Muon hybrid.

Built after Megatron-Core's distributed optimizer, which is kept apart from its DDP grad buffers in the
same way: the gradient path (fp32 main gradients in buckets, hooks, the overlapped reduction over each
parameter's group) lives in hf3d/optim/grad_buffer.py, one `GradBuffer` per reduction group; this module owns
the step. For the elements a rank steps (its ZeRO shard of every bucket of every buffer, or all of
them under ZeRO-0) it keeps fp32 master weights and the wrapped optimizer's state, clips by the global
norm, steps them with the reduced gradient, writes the masters back into the model-dtype parameters and
asks each buffer to gather the updated shards. Under ZeRO-2 the gradient itself is kept only for the shard.

The grad norm counts each element once: pieces a rank does not own (layout.Piece.owner), vocab padding
and the shards of other ranks are masked out, and one all-reduce over the world sums the squares.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.expert import is_expert
from ..parallel.layout import get_pieces
from ..parallel.mesh import expert_data_parallel_group, replicate_group, shard_group
from .base import ParallelOptimizer, merge_ranges, no_decay_names, owned_runs, tied_embedding_group
from .grad_buffer import Bucket, GradBuffer

__all__ = ["BucketedOptimizer", "ParallelOptimizer", "no_decay_names", "reduction_groups"]

ZERO_BUBBLE_SCHEDULES = ("zbv", "dualpipev")  # weight grads written outside AccumulateGrad


def reduction_groups(pmodel, params: list[nn.Parameter]) -> list[tuple[dist.ProcessGroup, list[nn.Parameter], object]]:
    """[(group, params, replicate group or None)]: the process group over which each parameter's gradient is
    summed and its optimizer state sharded. A parameter is replicated over the data-parallel ranks, and over the
    context-parallel ranks, which each saw other tokens of the same rows: the group is dp x cp (under HSDP the
    dp_shard neighbours x cp, whose shards are then summed over the replicate group). An expert of a MoE layer
    lives on one rank of each expert group and already got the tokens of the whole group by the all-to-all: its
    group is the ranks holding the same experts (hf3d.parallel.mesh)."""
    mesh = pmodel.mesh
    experts = [p for p in params if is_expert(p)]
    if not experts or pmodel.pcfg.ep == 1:
        return [(shard_group(mesh), params, replicate_group(mesh))]
    dense = [p for p in params if not is_expert(p)]
    return [(shard_group(mesh), dense, replicate_group(mesh)), (expert_data_parallel_group(mesh), experts, None)]


class BucketedOptimizer(ParallelOptimizer):
    """Wraps a torch optimizer class with ZeRO-0/1/2 over dp (dp x cp under context parallelism) and
    global-norm clipping over the mesh, its gradients in hf3d's buckets (hf3d/optim/grad_buffer.py)."""

    def __init__(
        self,
        pmodel,
        optimizer_cls,
        *,
        zero_stage: int,
        max_grad_norm: float | None,
        bucket_size: int,
        overlap_grad_reduce: bool,
        dp_collective: str,
        exclude_from_weight_decay: bool | Callable[[str, torch.Tensor], bool],
        optimizer_kwargs: dict,
    ):
        self.pmodel, self.zero_stage, self.max_grad_norm = pmodel, zero_stage, max_grad_norm
        self.dp_collective = dp_collective
        self.overlap = overlap_grad_reduce and pmodel.pcfg.pp_schedule not in ZERO_BUBBLE_SCHEDULES
        named = pmodel.unique_parameters()
        self.names = {id(p): n for n, p in named}
        params = [p for _, p in named if p.requires_grad]
        self.device = params[0].device
        self.param_dtype = params[0].dtype
        self.buffers = self._build_buffers(pmodel, params, bucket_size)
        grad_end = 0
        for buf in self.buffers:
            grad_end = buf.lay_out_grads(grad_end)
        self.main_grad = torch.zeros(grad_end, dtype=torch.float32, device=self.device)
        self._flat_range: dict[int, tuple[int, int]] = {}  # id(param) -> its global [start, stop)
        for buf in self.buffers:
            self._flat_range.update(buf.attach(self.main_grad, overlap=self.overlap))
        self._bucket_of: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self._norm_views = self._norm_grads()
        # -- fp32 master fragments and the wrapped optimizer --
        for buf in self.buffers:
            buf.flatten_params(self.param_dtype, self.device)
        self._build_master()
        grouped, with_no_decay = self._grouped(exclude_from_weight_decay)
        self._wrap(pmodel, optimizer_cls, optimizer_kwargs, grouped, with_no_decay=with_no_decay)

    def _build_buffers(self, pmodel, params: list[nn.Parameter], bucket_size: int) -> list[GradBuffer]:
        return self._buffers_for(pmodel, params, bucket_size, self.zero_stage)

    def _buffers_for(
        self, pmodel, params: list[nn.Parameter], bucket_size: int, zero_stage: int, base: int = 0
    ) -> list[GradBuffer]:
        """One GradBuffer per reduction group, buckets in backward order (last layers first), from flat offset
        `base` on; tied embeddings held on two pipeline ranks in deferred buckets of their own."""
        tied_group = tied_embedding_group(pmodel)

        def tied(p) -> bool:
            is_source = tied_group is not None and any(
                piece.hf_name == "model.embed_tokens.weight" for piece in get_pieces(p)
            )
            return getattr(p, "hf3d_tied_copy", False) or is_source

        buffers = []
        for group, members, replicas in reduction_groups(pmodel, params):
            buf = GradBuffer(
                [p for p in reversed(members) if not tied(p)],
                group,
                base=base,
                bucket_size=bucket_size,
                zero_stage=zero_stage,
                collective=self.dp_collective,
                deferred=[p for p in members if tied(p)],
                tp_group=pmodel.mesh.get_group("tp"),
                tied_group=tied_group,
                replicate_group=replicas,
                hf_shapes=pmodel.hf_shapes,
                uses=_uses_per_step(pmodel),
            )
            buffers.append(buf)
            base = buf.end
        return buffers

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket of every buffer, in main_grad order."""
        return [b for buf in self.buffers for b in buf.buckets]

    def _my_shard(self, b: Bucket) -> tuple[int, int]:
        return b.buffer.shard(b)

    def written_range(self, param: nn.Parameter) -> tuple[int, int]:
        """This rank's ZeRO shard of param's bucket (under HSDP, on the first replica of each shard only)."""
        b = self._bucket_of[id(param)]
        return self._my_shard(b) if b.buffer.replica == 0 else (0, 0)

    def _norm_grads(self) -> list[torch.Tensor]:
        """Views of the reduced gradient this rank adds to the grad norm: its owned elements (pieces it owns,
        not vocab padding) inside the ranges it counts (hf3d/optim/grad_buffer.py's norm_spans)."""
        views = []
        for b in self.buckets:
            owned = []
            for p in b.params:
                start = self._flat_range[id(p)][0]
                owned += [(start + a, start + z) for a, z in owned_runs(p)]
            spans = b.buffer.norm_spans(b)
            ranges = merge_ranges([(max(a, lo), min(z, hi)) for lo, hi in spans for a, z in owned if a < hi and lo < z])
            views += [b.buffer.grad(b, a, z) for a, z in ranges]
        return views

    def _build_master(self) -> None:
        """fp32 master fragments for the elements this rank steps. With fp32 parameters the master is
        the parameter's own storage (a view): no second copy, no write-back."""
        self._aliased = self.param_dtype == torch.float32
        self._masters: list[tuple[nn.Parameter, torch.Tensor, int, int]] = []  # (param, master, lo, hi)
        self._grads: list[torch.Tensor] = []  # the reduced gradient of each master
        for b in self.buckets:
            lo, hi = b.buffer.stepped_range(b)
            for p in b.params:
                start, end = self._flat_range[id(p)]
                a, z = max(start, lo), min(end, hi)
                if a >= z:
                    continue
                flat = p.detach().view(-1)[a - start : z - start]
                master = flat if self._aliased else flat.float().clone()
                self._masters.append((p, master, a, z))
                self._grads.append(b.buffer.grad(b, a, z))

    # -- gradient path -----------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        super().start_step(num_microbatches)
        for buf in self.buffers:
            buf.start_step(num_microbatches)

    def finish_grad_sync(self) -> None:
        """Collect any gradients the hooks did not take, run the remaining collectives, wait."""
        for buf in self.buffers:
            buf.finish()

    def microbatch_done(self) -> None:
        """ZeRO-2: the reductions of the micro-batch land before the next forward (no full bucket held through it)."""
        for buf in self.buffers:
            buf.land()

    def _scale_grads(self, coef: torch.Tensor) -> None:
        self.main_grad.mul_(coef)

    def _write_back(self) -> None:
        """The updated masters into this rank's parameters, then every rank's shards into all of them."""
        if not self._aliased:
            for p, master, a, z in self._masters:
                b = self._bucket_of[id(p)]
                if b.param_data is None:
                    s = self._flat_range[id(p)][0]
                    p.data.view(-1)[a - s : z - s].copy_(master)
                else:
                    b.param_data[a - b.offset : z - b.offset].copy_(master)
        for buf in self.buffers:
            buf.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.main_grad.zero_()
        for _, master, _, _ in self._masters:
            master.grad = None
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    # -- reporting ---------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank by each part of the training state. main_grads: the fp32 gradients the
        step keeps (under ZeRO-2 this rank's shards, plus grad_bucket: the largest bucket a micro-batch fills)."""
        params = sum(p.numel() * p.element_size() for b in self.buckets for p in b.params)
        master = 0 if self._aliased else sum(m.numel() * m.element_size() for _, m, _, _ in self._masters)
        report = {"params": params, "main_grads": self.main_grad.numel() * 4}
        if self.zero_stage == 2:
            report["grad_bucket"] = max((b.numel for b in self.buckets), default=0) * 4
        report |= {"master_weights": master, "optimizer_state": self._state_bytes()}
        report["total"] = sum(report.values())
        return report


def _uses_per_step(pmodel) -> dict[int, int]:
    """How many backward passes per micro-batch reach each parameter (a tied embedding used by two
    stage chunks on one rank is reached twice)."""
    uses: dict[int, int] = {}
    for stage in pmodel.stages:
        for p in {id(q): q for q in stage.parameters()}.values():
            uses[id(p)] = uses.get(id(p), 0) + 1
    if pmodel.pcfg.pp == 1:
        return {k: 1 for k in uses}
    return uses
