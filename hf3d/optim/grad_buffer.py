"""FP32 main gradients in buckets, reduced over one process group as soon as backward fills them.

Built after Megatron-Core's DDP grad buffers. A `GradBuffer` holds the parameters whose gradients are
summed over one group (today the data-parallel replicas; expert parameters will get a buffer of their
own). Every parameter's gradient lands in a contiguous fp32 range (`main_grad` views of one flat
tensor that the optimizer allocates for all its buffers), split into buckets laid out in backward
order and padded to a multiple of the group size. A post-accumulate-grad hook adds each micro-batch's
(bf16/fp16/fp32) gradient into the buffer and frees it. When the last micro-batch has filled every
gradient of a bucket, the bucket's collective starts asynchronously while backward continues: for
ZeRO-1 a reduce-scatter (collective "reduce_scatter", or on gloo "all_to_all": every rank receives
each rank's copy of its own shard and sums them), for ZeRO-0 (or "all_reduce") an all-reduce.

Under ZeRO-1, rank d of the group owns the d-th 1/size of every bucket (`shard`). The parameters
are then views of one flat model-dtype buffer per bucket, so that `gather_params` lands the updated
shards in place: an all-gather after a reduce-scatter; with "all_to_all", one broadcast per owner of
its shard; with "all_reduce", an all-reduce of the buffer with the other ranks' shards zeroed (exact:
x + 0 = x). On gloo, 2 processes, 32 MiB of fp32: all_to_all 16 ms, broadcasts of the two halves
12 ms, all_reduce 31 ms, all_gather 48 ms, reduce_scatter 60 ms; "auto" picks all_to_all there.

Under ZeRO-2 the flat fp32 tensor holds only this rank's shard of every bucket (`grad_offset`), where the
micro-batches' reduced gradients accumulate. A bucket's full gradient exists only while one micro-batch fills
it (`staging`, allocated at its first gradient and freed once its reduction has landed): each bucket is
reduced once per micro-batch, as DeepSpeed's stage 2 does, and before a bucket opens the reduction in flight
is completed, so one bucket (plus a collective's receive buffer) is the most a rank holds beyond its shards.
Sums are linear: a bucket reduced in several parts gives the same total.

Under HSDP (`replicate_group`) the shards are then all-reduced over the ranks holding copies of them.

Gradients that one tp rank computes only in part (per-head q/k norms, norms under sequence
parallelism, replicated KV heads) are summed over tp, and tied embeddings held on two pipeline
ranks are summed over the pair (`deferred` buckets, reduced at step time), before the group's
reduction.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.layout import get_pieces, shard_range
from ..utils import compat


def cut_buckets(sizes: list[tuple[int, bool]], *, bucket_size: int) -> list[list[int]]:
    """The gradient buckets of parameters given as (numel, is_matrix) in backward order: each bucket's members, as
    indices into `sizes`. The matrices first, then the vectors (norm weights, biases) in buckets of their own; a
    bucket closes once its members' elements reach `bucket_size`. Sizes only, so that hf3d/plan cuts the same."""
    # a layer's norms are registered after its projections but reached by backward among them (post-attention norm)
    # or after them (input norm), so in the matrices' buckets they would hold a bucket open while the next fills
    # (two full buckets, ZeRO-2)
    out = []
    for matrices in (True, False):
        current, filled = [], 0
        for i, (numel, is_matrix) in enumerate(sizes):
            if is_matrix != matrices:
                continue
            current.append(i)
            filled += numel
            if filled >= bucket_size:
                out.append(current)
                current, filled = [], 0
        if current:
            out.append(current)
    return out


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offset: int  # into the flat main-gradient tensor
    numel: int  # padded to a multiple of the group size
    buffer: GradBuffer
    deferred: bool = False  # tied across pipeline ranks: reduced at step time, not from hooks
    pending: int = 0
    work: object = None
    param_data: torch.Tensor | None = None  # flat model-dtype storage the params view (zero >= 1, size > 1)
    grad_offset: int = 0  # where the bucket's gradient starts in the flat tensor: offset, or its shard's (zero 2)
    staging: torch.Tensor | None = None  # zero 2: the bucket's gradient while a micro-batch fills it
    per_launch: int = 0  # gradients (param x use) per reduction: a micro-batch's (zero 2) or the step's


def _weak_hook(method):
    """A parameter hook calling the bound `method` without holding its object: a hook holds what it calls from
    the tensor's C++ side, where the garbage collector cannot follow, so a strong one would keep the buffer, its
    parameters and its process groups alive after `del model, optimizer` (and their gloo threads running into
    the interpreter's exit)."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        call = ref()
        if call is not None:
            call(p)

    return hook


def _remove(handles) -> None:
    for h in handles:
        h.remove()


class GradBuffer:
    """The buckets of the parameters reduced over `group`, at global offsets from `base` on.

    Two phases: the constructor lays the buckets out (so the optimizer can size one flat tensor for all
    its buffers), `attach` points every parameter's `main_grad` into that tensor and, with overlap,
    registers the hooks."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        base: int,
        bucket_size: int,
        zero_stage: int,
        collective: str,
        deferred: list[nn.Parameter] = (),
        tp_group: dist.ProcessGroup | None = None,
        tied_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        hf_shapes: dict[str, tuple[int, ...]] | None = None,
        uses: dict[int, int] | None = None,
    ):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.zero_stage, self.collective = zero_stage, collective
        self.replicate_group = replicate_group
        self.replica = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.tp_group, self.tied_group = tp_group, tied_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.hf_shapes, self.uses = hf_shapes or {}, uses or {}
        self.buckets: list[Bucket] = []
        offset = base
        for members, is_deferred in ((list(params), False), (list(deferred), True)):
            for cut in cut_buckets([(p.numel(), p.dim() > 1) for p in members], bucket_size=bucket_size):
                offset = self._add_bucket([members[i] for i in cut], offset, is_deferred)
        self.base, self.end = base, offset
        self.main_grad: torch.Tensor | None = None

    @property
    def sharded_grads(self) -> bool:
        return self.zero_stage == 2

    def lay_out_grads(self, grad_base: int) -> int:
        """Place each bucket's gradient in the flat tensor from `grad_base` on (all of it, or its shard under
        ZeRO-2); returns where the next buffer's start."""
        for b in self.buckets:
            b.grad_offset = grad_base
            grad_base += b.numel // self.size if self.sharded_grads else b.numel
        return grad_base

    def _add_bucket(self, params, offset: int, deferred: bool) -> int:
        n = sum(p.numel() for p in params)
        padded = -(-n // self.size) * self.size
        self.buckets.append(Bucket(list(params), offset, padded, self, deferred))
        return offset + padded

    def attach(self, main_grad: torch.Tensor, *, overlap: bool) -> dict[int, tuple[int, int]]:
        """Point each parameter's main_grad into `main_grad` (under ZeRO-2 into its bucket's staging, while there
        is one); returns {id(param): (start, stop)}, the global flat range of each parameter."""
        self.main_grad, self.overlap = main_grad, overlap
        ranges = {}
        for b in self.buckets:
            start = b.offset
            for p in b.params:
                ranges[id(p)] = (start, start + p.numel())
                start += p.numel()
            if not self.sharded_grads:
                self._point(b, main_grad[b.grad_offset : b.grad_offset + b.numel])
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if overlap:
            hook = _weak_hook(self._on_grad)
            weakref.finalize(self, _remove, [p.register_post_accumulate_grad_hook(hook) for p in self.params()])
        return ranges

    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    @staticmethod
    def _point(b: Bucket, flat: torch.Tensor | None) -> None:
        """Each parameter's main_grad: a view of the bucket's gradient `flat`, or None."""
        start = 0
        for p in b.params:
            p.main_grad = None if flat is None else flat[start : start + p.numel()].view(p.shape)
            start += p.numel()

    def grad(self, b: Bucket, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of the global range [lo, hi) of bucket b, inside this rank's stepped range."""
        start = self.shard(b)[0] if self.sharded_grads else b.offset
        return self.main_grad[b.grad_offset + lo - start : b.grad_offset + hi - start]

    def shard(self, b: Bucket) -> tuple[int, int]:
        """This rank's ZeRO-1 share of bucket b, as global [start, stop)."""
        lo, hi = shard_range(b.numel, self.size, self.rank)
        return b.offset + lo, b.offset + hi

    def stepped_range(self, b: Bucket) -> tuple[int, int]:
        """The elements of b whose update this rank computes: its shard (ZeRO-1/2) or all of b (ZeRO-0)."""
        return self.shard(b) if self.zero_stage >= 1 else (b.offset, b.offset + b.numel)

    def norm_spans(self, b: Bucket) -> list[tuple[int, int]]:
        """The reduced gradient ranges of b this rank counts in the grad norm (each element on one rank: the
        first replica of a shard under HSDP)."""
        if self.zero_stage >= 1:
            return [self.shard(b)] if self.replica == 0 else []
        return [(b.offset, b.offset + b.numel)] if self.rank == 0 else []  # every rank holds the same full grads

    def flatten_params(self, dtype: torch.dtype, device: torch.device) -> None:
        """ZeRO-1/2 over more than one rank: make each bucket's parameters views of one flat buffer, so
        that the gather lands in place. With one rank there is nothing to gather, and the copy would only
        hold the parameters twice for a moment."""
        if self.zero_stage == 0 or self.size == 1:
            return
        for b in self.buckets:
            b.param_data = torch.zeros(b.numel, dtype=dtype, device=device)
            start = 0
            for p in b.params:
                view = b.param_data[start : start + p.numel()]
                view.copy_(p.detach().flatten())
                p.data = view.view(p.shape)
                start += p.numel()

    # -- gradient path -----------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        per_step = 1 if self.sharded_grads else num_microbatches
        for b in self.buckets:
            b.per_launch = b.pending = sum(self.uses.get(id(p), 1) * per_step for p in b.params)

    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._bucket_of[id(p)]
        self._open(b)
        p.main_grad.add_(p.grad)
        p.grad = None
        b.pending -= 1
        if b.pending == 0 and self.sharded_grads:
            self._launch(b)
            b.pending = b.per_launch  # the next micro-batch's
        elif b.pending == 0 and not b.deferred:
            self._launch(b)

    def land(self) -> None:
        """ZeRO-2: wait for the reductions in flight and land them in the shards, freeing their full buckets (after
        a micro-batch's backward, so that none is held through the next forward)."""
        if self.sharded_grads:
            for b in self.buckets:
                if b.work is not None:
                    self._complete(b)

    def _open(self, b: Bucket) -> None:
        """ZeRO-2: give bucket b a zeroed full-size gradient to fill, once the reduction in flight has landed."""
        if not self.sharded_grads or b.staging is not None:
            return
        self.land()
        b.staging = torch.zeros(b.numel, dtype=torch.float32, device=self.main_grad.device)
        self._point(b, b.staging)

    def _sync_partial_tp(self, b: Bucket) -> None:
        if self.tp_size == 1:
            return
        for p in b.params:
            sum_partial_over_tp(p, p.main_grad, 0, self.tp_group, self.hf_shapes)

    def _launch(self, b: Bucket) -> None:
        if self.sharded_grads:  # ZeRO-2: one reduction in flight at a time, so one full bucket beside the filling one
            self.land()
        self._sync_partial_tp(b)
        if b.deferred and self.tied_group is not None and not self.sharded_grads:
            for p in b.params:
                dist.all_reduce(p.main_grad, group=self.tied_group)
        flat = b.staging if self.sharded_grads else self.main_grad[b.grad_offset : b.grad_offset + b.numel]
        lo, hi = self.shard(b)
        if self.size == 1:
            b.work = (None, flat if self.sharded_grads else None, lo, hi)
        elif self.zero_stage == 0 or self.collective == "all_reduce":
            b.work = (
                dist.all_reduce(flat, group=self.group, async_op=True),
                flat if self.sharded_grads else None,
                lo,
                hi,
            )
        elif self.collective == "reduce_scatter":
            out = torch.empty(hi - lo, device=flat.device)
            b.work = (compat.reduce_scatter_single(out, flat, group=self.group, async_op=True), out, lo, hi)
        else:
            # all_to_all: each rank receives every rank's copy of its own shard, and sums them: a
            # reduce-scatter that gloo runs faster than its reduce_scatter or all_reduce. At most two buckets'
            # receive buffers are alive: the previous one is summed before this one starts.
            for other in self.buckets:
                if other is not b and other.work is not None and other.work[1] is not None:
                    self._complete(other)
            out = torch.empty(self.size, hi - lo, device=flat.device)
            b.work = (dist.all_to_all_single(out, flat, group=self.group, async_op=True), out, lo, hi)
        if self.sharded_grads:  # the collective keeps the staging alive; the next micro-batch opens another
            b.staging = None
            self._point(b, None)

    def _complete(self, b: Bucket) -> None:
        """Wait for b's reduction and land it in this rank's shard: in place (ZeRO-0/1, an all-reduce), copied
        (ZeRO-1) or added to the shard's sum of earlier micro-batches (ZeRO-2, whose staging is then freed)."""
        work, out, lo, hi = b.work
        b.work = None
        if work is not None:
            work.wait()
        if out is None:  # all-reduced in place
            return
        if self.sharded_grads:
            shard = self.grad(b, lo, hi)
            if out.dim() == 2:  # all_to_all's rows: every rank's copy of this shard
                shard += out.sum(dim=0)
            else:
                shard += out if out.numel() == hi - lo else out[lo - b.offset : hi - b.offset]
        elif self.collective == "all_to_all":
            torch.sum(out, dim=0, out=self.main_grad[lo:hi])
        else:
            self.main_grad[lo:hi].copy_(out)

    def finish(self) -> None:
        """Collect any gradients the hooks did not take, run the remaining collectives, wait; then the shards
        of tied embeddings (ZeRO-2) and, under HSDP, every shard, summed over the ranks that hold copies."""
        for b in self.buckets:
            for p in b.params:
                if p.grad is not None:
                    self._open(b)
                    p.main_grad.add_(p.grad)
                    p.grad = None
            if self.sharded_grads:
                if b.staging is not None:  # filled by a micro-batch that did not complete it (or no hooks)
                    if b.work is not None:
                        self._complete(b)
                    self._launch(b)
            elif b.work is None and (b.deferred or not self.overlap or b.pending != 0):
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                self._complete(b)
        for b in self.buckets:
            if self.sharded_grads and b.deferred and self.tied_group is not None:
                dist.all_reduce(self.grad(b, *self.shard(b)), group=self.tied_group)
            if self.replicate_group is not None:
                dist.all_reduce(self.grad(b, *self.shard(b)), group=self.replicate_group)

    # -- after the step ----------------------------------------------------------------------------
    def gather_params(self) -> None:
        """ZeRO-1/2: every rank's updated shard into every rank's parameters, in place."""
        if self.zero_stage == 0 or self.size == 1:
            return
        if self.collective == "all_to_all":
            # every rank broadcasts its updated shard into the others' parameter buffers, in place
            works = []
            for b in self.buckets:
                for src in range(self.size):
                    lo, hi = shard_range(b.numel, self.size, src)
                    works.append(dist.broadcast(b.param_data[lo:hi], group=self.group, group_src=src, async_op=True))
            for w in works:
                w.wait()
            return
        for b in self.buckets:
            lo, hi = self.shard(b)
            if self.collective == "all_reduce":
                # gloo: an all-reduce of the buffer with every other rank's shard zeroed is faster than its
                # all_gather, and exact (x + 0 = x)
                b.param_data[: lo - b.offset].zero_()
                b.param_data[hi - b.offset :].zero_()
                dist.all_reduce(b.param_data, group=self.group)
            else:
                shard = b.param_data[lo - b.offset : hi - b.offset].clone()
                compat.all_gather_single(b.param_data, shard, group=self.group)


def sum_partial_over_tp(p, grad: torch.Tensor, row0: int, tp_group, hf_shapes: dict) -> None:
    """Sum, over the tp group, the parts of `grad` that each tp rank computes only in part: all of it for a
    parameter marked hf3d_tp_partial_grad (norms under sequence parallelism), the rows of replicated KV heads
    (pieces marked partial_grad) otherwise. `grad` holds rows [row0, row0 + len(grad)) of p's runtime layout (the
    whole of it, or FSDP2's shard). Every tp rank makes the same calls in the same order."""
    if getattr(p, "hf3d_tp_partial_grad", False):
        dist.all_reduce(grad, group=tp_group)
        return
    row1 = row0 + grad.shape[0]
    for piece in get_pieces(p):
        if not piece.partial_grad:  # replicated KV heads: summed over the ranks holding the same rows
            continue
        assert piece.dim == 0 and piece.stack is None, piece
        full = torch.zeros((hf_shapes[piece.hf_name][0], *grad.shape[1:]), device=grad.device)
        i0, i1 = max(piece.local_start, row0), min(piece.local_stop, row1)
        h0 = piece.hf_start + i0 - piece.local_start
        if i1 > i0:
            full.narrow(0, h0, i1 - i0).copy_(grad.narrow(0, i0 - row0, i1 - i0))
        dist.all_reduce(full, group=tp_group)
        if i1 > i0:
            grad.narrow(0, i0 - row0, i1 - i0).copy_(full.narrow(0, h0, i1 - i0))
