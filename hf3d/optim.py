"""Data parallelism: FP32 main gradients in buckets, ZeRO-1 sharded optimizer, global-norm clipping.

Built after Megatron-Core's distributed optimizer. Every parameter's gradient lands in one
contiguous fp32 buffer (`main_grad` views), split into buckets laid out in backward order and
padded to a multiple of dp. A post-accumulate-grad hook adds each micro-batch's (bf16/fp16/fp32)
gradient into the buffer and frees it. When the last micro-batch has filled every gradient of
a bucket, the bucket's data-parallel collective starts asynchronously while backward continues:
for ZeRO-1 a reduce-scatter (dp_collective "reduce_scatter", or on gloo "all_to_all": every rank
receives each rank's copy of its own shard and sums them), for ZeRO-0 an all-reduce.

ZeRO-1: dp rank d owns the d-th 1/dp of every bucket. For the parameter fragments inside its
shard it keeps fp32 master weights and the wrapped torch optimizer's state, steps them with the
reduced gradient, and the updated values are gathered back into the model's parameters, which
are views of one flat buffer per bucket when dp > 1 (so the gather lands in place): an all-gather
after a reduce-scatter; with "all_to_all", one broadcast per owner of its shard; with
"all_reduce", an all-reduce of the buffer with the other ranks' shards zeroed (exact: x + 0 = x).
On gloo, 2 processes, 32 MiB of fp32: all_to_all 16 ms, broadcasts of the two halves 12 ms,
all_reduce 31 ms, all_gather 48 ms, reduce_scatter 60 ms; "auto" picks all_to_all there.

Gradients that one tp rank computes only in part (per-head q/k norms, norms under sequence
parallelism, replicated KV heads) are summed over tp, and tied embeddings held on two pipeline
ranks are summed over the pair, before the data-parallel reduction. The grad norm counts each
element once: pieces a rank does not own (layout.Piece.owner) and vocab padding are masked out.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import hf_boxes
from .layout import get_pieces, shard_range

ZERO_BUBBLE_SCHEDULES = ("zbv", "dualpipev")  # weight grads written outside AccumulateGrad
# torch optimizers whose update of an element depends on the whole tensor (factored moments,
# closures): they cannot run on the flat fp32 fragments that ZeRO and tensor parallelism produce
WHOLE_TENSOR_OPTIMIZERS = ("Adafactor", "LBFGS", "SparseAdam", "Muon")


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offset: int  # into the flat buffers
    numel: int  # padded to a multiple of dp
    deferred: bool = False  # tied across pipeline ranks: reduced at step time, not from hooks
    pending: int = 0
    work: object = None
    param_data: torch.Tensor | None = None  # flat model-dtype storage the params view (zero 1, dp > 1)


class ParallelOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer class with ZeRO-0/1 over dp and global-norm clipping over the mesh.

    It is a torch.optim.Optimizer whose `param_groups` and `state` are the wrapped optimizer's own
    (over this rank's fp32 master fragments), so LR schedulers and accelerate drive the real step."""

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
        mesh = pmodel.mesh
        self.dp_group, self.tp_group = mesh.get_group("dp"), mesh.get_group("tp")
        self.dp_size, self.dp_rank = pmodel.dp_size, pmodel.dp_rank
        self.tp_size = pmodel.pcfg.tp
        self.dp_collective = dp_collective
        self.overlap = overlap_grad_reduce and pmodel.pcfg.pp_schedule not in ZERO_BUBBLE_SCHEDULES
        self.tied_group = _tied_embedding_group(pmodel)
        named = pmodel.unique_parameters()
        self.names = {id(p): n for n, p in named}
        params = [p for _, p in named if p.requires_grad]
        self.device = params[0].device
        self.param_dtype = params[0].dtype

        # -- buckets in backward order (last layers first), tied-across-pp params on their own --
        tied = [p for p in params if getattr(p, "hf3d_tied_copy", False) or self._is_tied_source(p)]
        plain = [p for p in reversed(params) if not any(p is t for t in tied)]
        self.buckets: list[_Bucket] = []
        offset = 0
        for group, deferred in ((plain, False), (tied, True)):
            current: list[nn.Parameter] = []
            for p in group:
                current.append(p)
                if sum(q.numel() for q in current) >= bucket_size:
                    offset = self._add_bucket(current, offset, deferred)
                    current = []
            if current:
                offset = self._add_bucket(current, offset, deferred)
        self.main_grad = torch.zeros(offset, dtype=torch.float32, device=self.device)
        owned: list[tuple[int, int]] = []  # flat ranges whose gradient this rank counts in the norm
        self._bucket_of: dict[int, _Bucket] = {}
        self._flat_range: dict[int, tuple[int, int]] = {}  # id(param) -> its [start, stop) in main_grad
        self._uses = _uses_per_step(pmodel)
        for b in self.buckets:
            start = b.offset
            for p in b.params:
                p.main_grad = self.main_grad[start : start + p.numel()].view(p.shape)
                self._bucket_of[id(p)] = b
                self._flat_range[id(p)] = (start, start + p.numel())
                owned += [(start + a, start + z) for a, z in _owned_runs(p)]
                start += p.numel()

        # what this rank adds to the grad norm: its owned elements inside the gradients it reduces
        if self.zero_stage == 1:
            spans = [self._my_shard(b) for b in self.buckets]
        else:  # zero 0: every dp rank holds the same full gradients; dp rank 0 counts them
            spans = [(0, offset)] if self.dp_rank == 0 else []
        self._norm_ranges = _merge(
            [(max(a, lo), min(z, hi)) for lo, hi in spans for a, z in owned if a < hi and lo < z]
        )
        # -- fp32 master fragments and the wrapped optimizer --
        self._build_master(exclude_from_weight_decay)
        try:
            self.optimizer = optimizer_cls(self._param_groups, **optimizer_kwargs)
        except TypeError as e:
            raise TypeError(f"{optimizer_cls.__name__} rejected the optimizer arguments {optimizer_kwargs}: {e}") from e
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params] if self.overlap else []
        self._step_started = False
        self.last_step_skipped = False
        self.last_grad_norm: torch.Tensor | None = None
        # torch.optim.Optimizer's bookkeeping (hooks, step patching), over the very same group dicts
        torch.optim.Optimizer.__init__(self, self.optimizer.param_groups, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        pmodel.grad_sync = self

    # ---------------------------------------------------------------------------------------------
    def _is_tied_source(self, p) -> bool:
        """The embedding whose tied lm_head copy lives on another pipeline rank."""
        return self.tied_group is not None and any(
            piece.hf_name == "model.embed_tokens.weight" for piece in get_pieces(p)
        )

    def _add_bucket(self, params, offset, deferred) -> int:
        n = sum(p.numel() for p in params)
        padded = -(-n // self.dp_size) * self.dp_size
        self.buckets.append(_Bucket(list(params), offset, padded, deferred))
        return offset + padded

    def _my_shard(self, b: _Bucket) -> tuple[int, int]:
        lo, hi = shard_range(b.numel, self.dp_size, self.dp_rank)
        return b.offset + lo, b.offset + hi

    def _build_master(self, exclude_from_weight_decay) -> None:
        """fp32 master fragments for the elements this rank steps. With fp32 parameters the master is
        the parameter's own storage (a view): no second copy, no write-back."""
        self._aliased = self.param_dtype == torch.float32
        decay, no_decay = [], []
        self._masters: list[tuple[nn.Parameter, torch.Tensor, int, int]] = []  # (param, master, lo, hi)
        for b in self.buckets:
            lo, hi = self._my_shard(b) if self.zero_stage == 1 else (b.offset, b.offset + b.numel)
            # params become views of one flat buffer so the all-gather lands in place; with one dp rank
            # there is no all-gather, and the copy would only hold the parameters twice for a moment
            if self.zero_stage == 1 and self.dp_size > 1:
                b.param_data = torch.zeros(b.numel, dtype=self.param_dtype, device=self.device)
            start = b.offset
            for p in b.params:
                end = start + p.numel()
                if b.param_data is not None:
                    view = b.param_data[start - b.offset : end - b.offset]
                    view.copy_(p.detach().flatten())
                    p.data = view.view(p.shape)
                a, z = max(start, lo), min(end, hi)
                if a < z:
                    flat = p.detach().view(-1)[a - start : z - start]
                    master = flat if self._aliased else flat.float().clone()
                    self._masters.append((p, master, a, z))
                    name = self.names[id(p)]
                    if callable(exclude_from_weight_decay):
                        excluded = exclude_from_weight_decay(name, p)
                    else:
                        excluded = exclude_from_weight_decay and (
                            p.dim() < 2 or "embed_tokens" in name or "lm_head" in name
                        )
                    (no_decay if excluded else decay).append(master)
                start = end
        self._param_groups = [{"params": decay}]
        if no_decay or callable(exclude_from_weight_decay):  # a rule: the same groups on every rank
            self._param_groups.append({"params": no_decay, "weight_decay": 0.0})

    # -- gradient path -----------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        if self._step_started:
            raise RuntimeError(
                "train_step was called twice without opt.step(); call opt.step() and "
                "opt.zero_grad() after each train_step"
            )
        self._step_started = True
        for b in self.buckets:
            b.pending = sum(self._uses.get(id(p), 1) * num_microbatches for p in b.params)

    def _on_grad(self, p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0 and not b.deferred:
            self._launch(b)

    def _sync_partial_tp(self, b: _Bucket) -> None:
        if self.tp_size == 1:
            return
        for p in b.params:
            if getattr(p, "hf3d_tp_partial_grad", False):
                dist.all_reduce(p.main_grad, group=self.tp_group)
            for piece in get_pieces(p):
                if piece.partial_grad:  # replicated KV heads: sum over the ranks holding the same rows
                    span = piece.hf_stop - piece.hf_start
                    full = torch.zeros((self._hf_rows(piece), *p.main_grad.shape[1:]), device=self.device)
                    full.narrow(0, piece.hf_start, span).copy_(piece.local(p.main_grad))
                    dist.all_reduce(full, group=self.tp_group)
                    piece.local(p.main_grad).copy_(full.narrow(0, piece.hf_start, span))

    def _hf_rows(self, piece) -> int:
        return self.pmodel.hf_shapes[piece.hf_name][0]

    def _launch(self, b: _Bucket) -> None:
        self._sync_partial_tp(b)
        if b.deferred and self.tied_group is not None:
            for p in b.params:
                dist.all_reduce(p.main_grad, group=self.tied_group)
        if self.dp_size == 1:
            b.work = None
            return
        flat = self.main_grad[b.offset : b.offset + b.numel]
        if self.zero_stage != 1 or self.dp_collective == "all_reduce":
            b.work = (dist.all_reduce(flat, group=self.dp_group, async_op=True), None, 0, 0)
            return
        lo, hi = self._my_shard(b)
        if self.dp_collective == "reduce_scatter":
            out = torch.empty(hi - lo, device=self.device)
            b.work = (dist.reduce_scatter_single(out, flat, group=self.dp_group, async_op=True), out, lo, hi)
            return
        # all_to_all: each rank receives every rank's copy of its own shard, and sums them: a
        # reduce-scatter that gloo runs faster than its reduce_scatter or all_reduce. At most two buckets'
        # receive buffers are alive: the previous one is summed before this one starts.
        for other in self.buckets:
            if other.work is not None and other.work[1] is not None:
                self._complete(other)
        out = torch.empty(self.dp_size, hi - lo, device=self.device)
        b.work = (dist.all_to_all_single(out, flat, group=self.dp_group, async_op=True), out, lo, hi)

    def _complete(self, b: _Bucket) -> None:
        work, out, lo, hi = b.work
        work.wait()
        if out is None:  # all-reduced in place
            b.work = None
            return
        if self.dp_collective == "all_to_all":
            torch.sum(out, dim=0, out=self.main_grad[lo:hi])
        else:
            self.main_grad[lo:hi].copy_(out)
        b.work = None

    def finish_grad_sync(self) -> None:
        """Collect any gradients the hooks did not take, run the remaining collectives, wait."""
        for b in self.buckets:
            for p in b.params:
                if p.grad is not None:
                    p.main_grad.add_(p.grad)
                    p.grad = None
        for b in self.buckets:
            if b.work is None and (b.deferred or not self.overlap or b.pending != 0):
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                self._complete(b)

    # -- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over tp x pp x dp, every element counted once."""
        sq = torch.zeros((), device=self.device)
        for lo, hi in self._norm_ranges:
            g = self.main_grad[lo:hi]
            sq += g.dot(g)
        dist.all_reduce(sq)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor:
        """Reduce gradients, clip to max_grad_norm, step the shard, sync params. Returns the
        pre-clip global grad norm (also kept as last_grad_norm); a non-finite norm skips the update
        (step_was_skipped). `closure` is not supported: hf3d computes the loss in train_step."""
        if closure is not None:
            raise ValueError("ParallelOptimizer.step takes no closure: run pmodel.train_step or pmodel(**batch) first")
        self.finish_grad_sync()
        norm = self.grad_norm()
        self.last_grad_norm = norm
        self.last_step_skipped = not math.isfinite(norm.item())
        if self.last_step_skipped:
            warnings.warn(f"grad norm is {norm.item()}: optimizer step skipped", stacklevel=2)
            self._step_started = False
            return norm
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            self.main_grad.mul_(coef)
        for _p, master, lo, hi in self._masters:
            master.grad = self.main_grad[lo:hi]
        self.optimizer.step()
        self._write_back()
        self._step_started = False
        return norm

    def _write_back(self) -> None:
        if not self._aliased:
            for p, master, a, z in self._masters:
                b = self._bucket_of[id(p)]
                if b.param_data is None:
                    s = self._flat_range[id(p)][0]
                    p.data.view(-1)[a - s : z - s].copy_(master)
                else:
                    b.param_data[a - b.offset : z - b.offset].copy_(master)
        if self.zero_stage == 0 or self.dp_size == 1:
            return
        if self.dp_collective == "all_to_all":
            # every rank broadcasts its updated shard into the others' parameter buffers, in place
            works = []
            for b in self.buckets:
                for src in range(self.dp_size):
                    lo, hi = shard_range(b.numel, self.dp_size, src)
                    works.append(dist.broadcast(b.param_data[lo:hi], group=self.dp_group, group_src=src, async_op=True))
            for w in works:
                w.wait()
            return
        for b in self.buckets:
            lo, hi = self._my_shard(b)
            if self.dp_collective == "all_reduce":
                # gloo: an all-reduce of the buffer with every other rank's shard zeroed is faster than its
                # all_gather, and exact (x + 0 = x)
                b.param_data[: lo - b.offset].zero_()
                b.param_data[hi - b.offset :].zero_()
                dist.all_reduce(b.param_data, group=self.dp_group)
            else:
                shard = b.param_data[lo - b.offset : hi - b.offset].clone()
                dist.all_gather_single(b.param_data, shard, group=self.dp_group)

    def nonfinite_parameters(self) -> list[str]:
        """Collective: the parameters whose reduced gradient of this step holds an inf or NaN, on any
        rank, in model order (runtime names: fused projections are qkv_proj / gate_up_proj). Call it
        after a skipped step, before zero_grad, to say where a non-finite gradient came from."""
        local = {self.names[id(p)] for p, _, lo, hi in self._masters if not torch.isfinite(self.main_grad[lo:hi]).all()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(local))
        bad = set().union(*everyone)
        return [name for name in self.names.values() if name in bad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.main_grad.zero_()
        for _, master, _, _ in self._masters:
            master.grad = None
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    # -- state dict: HF names and global offsets, independent of the mesh ---------------------------
    def state_keys(self) -> list[str]:
        """Names of the wrapped optimizer's per-element state on this rank (exp_avg, ...)."""
        return sorted(
            {k for st in self.optimizer.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        )

    @property
    def num_steps(self) -> int:
        """Updates applied so far, as the wrapped optimizer counts them (0 before the first)."""
        steps = [int(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        return max(steps, default=0)

    def group_settings(self) -> list[dict]:
        """Each parameter group's hyperparameters (lr, betas, weight_decay, ...), without its tensors."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _state_boxes(self, keys, *, create: bool):
        """(key, hf_name, hf_offsets, sizes, view) over this rank's master fragments: "master" and the
        wrapped optimizer's per-element state; `create` makes zero state where there is none yet."""
        for p, master, a, z in self._masters:
            s = self._flat_range[id(p)][0]
            st = self.optimizer.state[master] if create else self.optimizer.state.get(master, {})
            sources = {"master": master}
            for k in keys:
                if create and k not in st:
                    st[k] = torch.zeros_like(master)
                sources[k] = st[k]
            for key, flat in sources.items():
                for name, off, size, view in hf_boxes(p, flat, a - s, a - s, z - s, owned_only=False):
                    yield key, name, off, size, view

    def state_dict(self) -> dict:
        """{"state": {hf_name: {key: [(hf_offsets, tensor), ...]}}, "step": n, "param_groups": [...]}: the
        boxes of global HF tensors this rank steps (its ZeRO shard), "master" (fp32 master weights) and
        the wrapped optimizer's per-element state (exp_avg, ...). No collective and no full tensors: the
        dicts of all ranks together cover every element, and `load_state_dict` reads any mesh's boxes."""
        out: dict[str, dict] = {}
        for key, name, off, _, view in self._state_boxes(self.state_keys(), create=False):
            out.setdefault(name, {}).setdefault(key, []).append((off, view.clone()))
        return {"state": out, "step": self.num_steps, "param_groups": self.group_settings()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load state_dict() output of any mesh (the "state" of several ranks merged: lists joined)."""
        keys = sorted({k for per_name in state_dict["state"].values() for k in per_name} - {"master"})
        for key, name, off, size, view in self._state_boxes(keys, create=True):
            covered = 0
            for soff, chunk in state_dict["state"].get(name, {}).get(key, []):
                lo = [max(o, so) for o, so in zip(off, soff)]
                hi = [min(o + n, so + c) for o, n, so, c in zip(off, size, soff, chunk.shape)]
                if any(a >= b for a, b in zip(lo, hi)):
                    continue
                dst, src = view, chunk
                for d, (a, b) in enumerate(zip(lo, hi)):
                    dst, src = dst.narrow(d, a - off[d], b - a), src.narrow(d, a - soff[d], b - a)
                dst.copy_(src)
                covered += dst.numel()
            if covered < view.numel():
                raise ValueError(f"optimizer state has no {key!r} for part of {name!r} at offsets {off}")
        for group in self.optimizer.param_groups if keys else ():  # no state yet: the optimizer starts fresh
            # torch's own placement: fused and capturable kernels read the step on the param's device
            on_device = group.get("fused") or group.get("capturable")
            for master in group["params"]:
                if master in self.optimizer.state:
                    device = master.device if on_device else "cpu"
                    step = torch.tensor(float(state_dict["step"]), dtype=torch.float32, device=device)
                    self.optimizer.state[master]["step"] = step
        for group, saved in zip(self.optimizer.param_groups, state_dict.get("param_groups", [])):
            group.update({k: v for k, v in saved.items() if k in group})
        self._write_back()

    # -- reporting ---------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank by each part of the training state."""
        params = sum(p.numel() * p.element_size() for b in self.buckets for p in b.params)
        master = 0 if self._aliased else sum(m.numel() * m.element_size() for _, m, _, _ in self._masters)
        state = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        return {
            "params": params,
            "main_grads": self.main_grad.numel() * 4,
            "master_weights": master,
            "optimizer_state": state,
            "total": params + self.main_grad.numel() * 4 + master + state,
        }

    @property
    def step_was_skipped(self) -> bool:
        """The last step() found a non-finite grad norm and left the weights unchanged."""
        return self.last_step_skipped


def _owned_runs(p: torch.Tensor) -> list[tuple[int, int]]:
    """Flat [start, stop) runs of p's elements covered by pieces this rank owns (not replicas kept by
    another rank, not vocab padding)."""
    mask = torch.zeros(p.shape, dtype=torch.int8)
    for piece in get_pieces(p):
        if piece.owner:
            piece.local(mask).fill_(1)
    edges = torch.diff(torch.cat([mask.new_zeros(1), mask.flatten(), mask.new_zeros(1)])).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, z in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], z))
        else:
            out.append((a, z))
    return out


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


def _tied_embedding_group(pmodel):
    """For tied embeddings split over two pipeline ranks: a group {first, last} per (dp, tp) place.
    Every rank creates every group (new_group is collective)."""
    owners = pmodel.stage_owners
    if not pmodel.config.tie_word_embeddings or owners[0] == owners[-1]:
        return None
    ranks = pmodel.mesh.mesh  # [pp, dp, tp] -> global rank
    mine = None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[owners[0], d, t]), int(ranks[owners[-1], d, t])]
            g = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = g
    return mine


def build_optimizer(
    pmodel,
    optimizer_cls=torch.optim.AdamW,
    *,
    zero_stage: int | None = None,
    max_grad_norm: float | None = 1.0,
    bucket_size: int = 2**22,
    overlap_grad_reduce: bool = True,
    dp_collective: str = "auto",
    exclude_from_weight_decay: bool | Callable[[str, torch.Tensor], bool] = False,
    **optimizer_kwargs,
) -> ParallelOptimizer:
    """Wrap a torch optimizer class for a ParallelModel.

    The optimizer must update every element independently of the others (AdamW, Adam, SGD, ...):
    it steps flat fp32 fragments of the parameters. torch's whole-tensor optimizers are refused.

    zero_stage: 0 (replicated optimizer, all-reduced grads) or 1 (state and fp32 master weights on
    1/dp of the elements); default from the ParallelConfig. bucket_size: elements per gradient
    bucket. dp_collective (ZeRO-1's gradient reduction and parameter gather): "reduce_scatter"
    (reduce-scatter + all-gather), "all_to_all" (all-to-all + local sum, then one broadcast per
    shard: the same bytes, faster on gloo), "all_reduce" (all-reduce of the gradients and of the
    zero-padded parameters: twice the bytes) or "auto" (all_to_all on gloo, reduce_scatter elsewhere).
    exclude_from_weight_decay: True for no decay on norms, biases and embeddings, or a rule
    `(runtime_name, param) -> bool` picking the parameters without decay (hf3d.Trainer passes
    transformers' own). Other keyword arguments go to optimizer_cls. Classes with a fused kernel
    (AdamW, Adam, SGD, Adagrad) get `fused=True` unless `fused` or `foreach` is given: one kernel over
    this rank's flat fp32 fragments (AdamW over 8.4M elements on one CPU thread: 5.4 ms, torch's
    default per-tensor loop 18.7 ms).
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    if optimizer_cls.__module__.startswith("torch.optim") and optimizer_cls.__name__ in WHOLE_TENSOR_OPTIMIZERS:
        raise ValueError(
            f"{optimizer_cls.__name__} updates each parameter as a whole tensor, but hf3d steps flat fp32 "
            "fragments of parameters (ZeRO shards, tensor-parallel slices); use an element-wise optimizer "
            "such as AdamW, Adam, SGD, Adagrad or RMSprop"
        )
    zero_stage = pmodel.pcfg.zero_stage if zero_stage is None else zero_stage
    if zero_stage not in (0, 1):
        raise ValueError(f"zero_stage must be 0 or 1, got {zero_stage!r}")
    if not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size!r}")
    fusable = "fused" in inspect.signature(optimizer_cls.__init__).parameters and pmodel.device.type in ("cpu", "cuda")
    if fusable and not {"fused", "foreach"} & optimizer_kwargs.keys():
        optimizer_kwargs["fused"] = True
    if dp_collective == "auto":
        dp_collective = "all_to_all" if dist.get_backend() == "gloo" else "reduce_scatter"
    if dp_collective not in ("reduce_scatter", "all_reduce", "all_to_all"):
        raise ValueError(
            f"dp_collective must be 'reduce_scatter', 'all_reduce', 'all_to_all' or 'auto', got {dp_collective!r}"
        )
    return ParallelOptimizer(
        pmodel,
        optimizer_cls,
        zero_stage=zero_stage,
        max_grad_norm=max_grad_norm,
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap_grad_reduce,
        dp_collective=dp_collective,
        exclude_from_weight_decay=exclude_from_weight_decay,
        optimizer_kwargs=optimizer_kwargs,
    )
