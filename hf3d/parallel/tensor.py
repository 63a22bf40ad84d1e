"""Tensor-parallel layers built from small autograd collectives (Megatron-LM style).

Each collective is a pair: what the forward does and its adjoint in the backward
(identity <-> all-reduce, all-gather <-> reduce-scatter, split <-> all-gather). Layers hold
plain tensors of this rank's slice; which slice of which HF parameter they hold is recorded
separately (hf3d.parallel.layout), so the layers know nothing about checkpoints.

Sequence parallelism (Korthikanti et al., 2022) swaps the identity/all-reduce pair around
each tensor-parallel block for all-gather/reduce-scatter along the sequence dim, so norms
and residuals between the blocks hold 1/tp of the sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..utils import compat

SEQ_DIM = 1  # activations are [batch, seq, hidden]
IGNORE_INDEX = -100  # a target that takes no loss (HF and torch cross-entropy)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((world * x0.shape[0], *x0.shape[1:]))
    compat.all_gather_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()  # activations leave stages by p2p, which wants contiguous


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    if x0.shape[0] % world:
        raise ValueError(f"dim {dim} of size {x0.shape[0]} cannot be split over {world} tensor-parallel ranks")
    out = x0.new_empty((x0.shape[0] // world, *x0.shape[1:]))
    compat.reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"dim {dim} of size {x.shape[dim]} cannot be split over {world} tensor-parallel ranks"
            + ("; with sequence_parallel the sequence length must be a multiple of tp" if dim == SEQ_DIM else "")
        )
    return x.chunk(world, dim=dim)[rank].contiguous()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return compat.all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    """all-gather along dim; backward: reduce-scatter (reduce=True) or split."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def _trivial(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h]; backward reduce-scatters (the input feeds tp-sharded math)."""
    return x if _trivial(group) else _GatherAlong.apply(x, group, SEQ_DIM, True)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """partial [b, s, h] -> summed [b, s/tp, h]; backward all-gathers."""
    return x if _trivial(group) else _ReduceScatterAlong.apply(x, group, SEQ_DIM)


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """replicated [b, s, ...] -> this rank's [b, s/tp, ...]; backward all-gathers."""
    return x if _trivial(group) else _SplitAlong.apply(x, group, SEQ_DIM)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[..., n/tp] -> [..., n]; backward keeps this rank's slice."""
    return x if _trivial(group) else _GatherAlong.apply(x, group, x.dim() - 1, False)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local, W split along its output rows; no communication of y."""

    fp8 = None  # hf3d.parallel.fp8.Fp8Linear when this projection trains in FP8

    def __init__(self, in_features, out_features_local, *, bias, group, sequence_parallel=False, dtype=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features_local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features_local, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        if self.fp8 is not None:
            return self.fp8(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b, W split along its input columns; partial sums reduced over tp."""

    fp8 = None  # hf3d.parallel.fp8.Fp8Linear when this projection trains in FP8

    def __init__(self, in_features_local, out_features, *, bias, group, sequence_parallel=False, dtype=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features_local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.hf3d_tp_partial_grad = True  # each rank adds it to its own sequence shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.fp8 is None else self.fp8(x, self.weight, None)
        y = reduce_scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n_local) of a (padded) vocabulary; other ids contribute zeros."""

    def __init__(self, num_local, hidden, *, vocab_start, padding_idx, group, sequence_parallel=False, dtype=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start, self.num_local = vocab_start, num_local
        local_pad = None
        if padding_idx is not None and vocab_start <= padding_idx < vocab_start + num_local:
            local_pad = padding_idx - vocab_start
        self.local_padding_idx = local_pad
        self.weight = nn.Parameter(torch.empty(num_local, hidden, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
        if _trivial(self.group):
            return out
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.group) if self.sequence_parallel else reduce_from_tp(out, self.group)


LOSS_CHUNK_ELEMENTS = 1 << 21  # logits per chunk of the fused head: 8 MiB in fp32
LOSS_CHUNK_MIN_ROWS = {"cpu": 256, "cuda": 2048}
"""The fewest tokens per chunk of the fused head, per device type (an accelerator not listed takes cuda's).
On a CPU fewer rows make the head's matmuls slow. On an H200 (SmolLM2-360M, 8 x 2048 tokens, compiled) 256
rows made 64 chunks per step, each a small matmul, fp32 softmax passes and a [vocab, hidden] temporary
added into the weight's gradient: hf3d ran at 0.78x stock; at 2048 rows, 0.98x (at 1.7B: 0.88x -> 0.95x).
A chunk of 2048 rows over 49152 columns is 400 MB of fp32 logits, against stock's whole [tokens, vocab]."""


def loss_chunk_rows(device_type: str, num_local_columns: int) -> int:
    """Tokens per chunk of the fused head on `device_type` over `num_local_columns` of the vocabulary."""
    fewest = LOSS_CHUNK_MIN_ROWS.get(device_type, LOSS_CHUNK_MIN_ROWS["cuda"])
    return max(fewest, LOSS_CHUNK_ELEMENTS // max(num_local_columns, 1))


class _FusedHeadLoss(torch.autograd.Function):
    """lm_head matmul + cross-entropy (+ z-loss) over chunks of tokens, gradients computed in the forward.

    The [tokens, vocab] logits never exist at once: each chunk's logits become that chunk's losses and
    its gradient (softmax - one-hot, and the z-loss term) at once, which is folded into the gradients
    of the hidden states and of the weight before the next chunk. Backward only scales the two by the
    incoming gradient. Over a vocab split across tp ranks, each chunk's row max and (sum exp, target
    logit) are all-reduced; the hidden states' gradient is this rank's partial sum, which the caller's
    copy_to_tp / gather_seq reduces in its backward."""

    @staticmethod
    def forward(ctx, x, weight, targets, num_tokens, z_loss, vocab_start, vocab_size, group, ignore_index):
        n, v_local = x.shape[0], weight.shape[0]
        ctx.weight_dtype = weight.dtype
        split = not _trivial(group)
        rows = loss_chunk_rows(x.device.type, v_local)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        sums = torch.zeros(2, dtype=torch.float32, device=x.device)  # [cross-entropy, lse^2] over tokens
        padded = vocab_start + v_local > vocab_size
        for s0 in range(0, n, rows):
            xc, tc = x[s0 : s0 + rows], targets[s0 : s0 + rows]
            logits = (xc @ weight.t()).float()
            if padded:  # padded columns take no probability
                logits[:, vocab_size - vocab_start :] = float("-inf")
            kept = tc != ignore_index
            local_t = tc - vocab_start
            mine = kept & (local_t >= 0) & (local_t < v_local)
            local_t = local_t.clamp(0, v_local - 1).unsqueeze(-1)
            row_max = logits.max(dim=-1).values
            if split:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            logits.sub_(row_max.unsqueeze(-1))
            picked = logits.gather(-1, local_t).squeeze(-1).masked_fill_(~mine, 0.0)
            logits.exp_()
            both = torch.stack([logits.sum(dim=-1), picked])
            if split:
                dist.all_reduce(both, group=group)
            sum_exp, target_logit = both.unbind()
            lse = sum_exp.log()  # of the shifted logits
            sums[0] += (lse - target_logit).masked_fill_(~kept, 0.0).sum()
            lse.add_(row_max)
            sums[1] += lse.square().masked_fill_(~kept, 0.0).sum()
            # d(objective)/d(logits) = (softmax * (1 + 2 z lse) - one_hot) / num_tokens on kept tokens
            scale = kept.to(torch.float32) / num_tokens
            factor = scale * (1.0 + 2.0 * z_loss * lse) if z_loss else scale
            logits.mul_((factor / sum_exp).unsqueeze(-1))
            logits.scatter_add_(-1, local_t, -(scale * mine).unsqueeze(-1))
            g = logits.to(x.dtype)
            torch.mm(g, weight, out=grad_x[s0 : s0 + rows])
            if g.dtype == torch.float32:
                grad_w.addmm_(g.t(), xc)
            else:
                grad_w += g.t() @ xc
        ctx.save_for_backward(grad_x, grad_w)
        ce, lse_sq = (sums / num_tokens).unbind()
        z = z_loss * lse_sq if z_loss else torch.zeros_like(ce)
        ctx.mark_non_differentiable(ce, z)
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, grad, _ce, _z):
        grad_x, grad_w = ctx.saved_tensors
        if grad.device.type != "cpu" or grad.item() != 1.0:
            grad_x.mul_(grad.to(grad_x.dtype))
            grad_w.mul_(grad)
        return grad_x, grad_w.to(ctx.weight_dtype), *([None] * 7)


class VocabParallelLMHead(nn.Module):
    """Column-parallel output projection over the padded vocabulary; returns local logits.

    `weight` may be the embedding's own Parameter (tied embeddings on one rank).
    """

    def __init__(
        self,
        num_local,
        hidden,
        *,
        vocab_start,
        vocab_size,
        group,
        sequence_parallel=False,
        weight: nn.Parameter | None = None,
        dtype=None,
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start, self.num_local, self.vocab_size = vocab_start, num_local, vocab_size
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(num_local, hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_logits(x)

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocab shard of the logits: forward without the module's hooks, for a head whose weight is
        at hand already, gathered by its stage's forward under ZeRO-3 (hf3d/parallel/fsdp.py; a call through the
        hooks alone, outside any stage, would leave FSDP2's group half-run)."""
        x = gather_seq(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        return F.linear(x, self.weight)

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[..., V/tp (padded)] -> [..., V] on every rank."""
        return gather_last_dim(local_logits, self.group)[..., : self.vocab_size]

    def token_losses(
        self,
        local_logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int = IGNORE_INDEX,
        *,
        return_lse: bool = False,
    ):
        """Cross-entropy per token over a vocab split across tp ranks; 0 where target == ignore_index.

        local_logits [N, V_local], targets [N] (global ids). Never materialises full-vocab logits.
        return_lse: also return each token's log-sum-exp of the logits [N] (0 where ignored), which the
        z-loss squares; the cross-entropy computes it anyway.
        """
        ignored = targets == ignore_index
        if _trivial(self.group):
            if not return_lse:  # one rank holds the whole vocabulary: stock cross-entropy, as fast as HF's
                return F.cross_entropy(local_logits.float(), targets, ignore_index=ignore_index, reduction="none")
            logits = local_logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
            return (lse - picked).masked_fill(ignored, 0.0), lse.masked_fill(ignored, 0.0)
        logits = local_logits.float()
        cols = torch.arange(self.num_local, device=logits.device) + self.vocab_start
        if self.vocab_start + self.num_local > self.vocab_size:  # padded columns take no probability
            logits = logits.masked_fill(cols >= self.vocab_size, float("-inf"))
        with torch.no_grad():
            row_max = logits.max(dim=-1).values
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)
        shifted = logits - row_max.unsqueeze(-1)
        log_sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), self.group).log()  # of the shifted logits
        local_t = targets - self.vocab_start
        mine = (local_t >= 0) & (local_t < self.num_local)
        picked = shifted.gather(-1, local_t.clamp(0, self.num_local - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = reduce_from_tp(picked.masked_fill(~mine, 0.0), self.group)
        losses = (log_sum_exp - target_logit).masked_fill(ignored, 0.0)
        if not return_lse:
            return losses
        return losses, (log_sum_exp + row_max).masked_fill(ignored, 0.0)

    def loss_terms(
        self, local_logits: torch.Tensor, targets: torch.Tensor, num_tokens: torch.Tensor, *, z_loss: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(objective to backpropagate, cross-entropy part, z-loss part), each a sum over these tokens divided
        by `num_tokens` (the global count of non-ignored targets). The parts come back detached.

        z-loss (PaLM): z_loss * logsumexp(logits)^2 per non-ignored token; it only enters the objective."""
        if z_loss == 0.0:
            ce = self.token_losses(local_logits, targets).sum() / num_tokens
            return ce, ce.detach(), torch.zeros((), device=ce.device)
        losses, lse = self.token_losses(local_logits, targets, return_lse=True)
        ce = losses.sum() / num_tokens
        z = z_loss * lse.square().sum() / num_tokens
        return ce + z, ce.detach(), z.detach()

    def fused_loss_terms(
        self, hidden: torch.Tensor, targets: torch.Tensor, num_tokens: torch.Tensor, *, z_loss: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`loss_terms(self(hidden), ...)` without the [tokens, vocab] logits: the matmul and the loss run
        chunk by chunk (_FusedHeadLoss). hidden [b, s(/tp under SP), h], targets [b, s]."""
        x = gather_seq(hidden, self.group) if self.sequence_parallel else copy_to_tp(hidden, self.group)
        return _FusedHeadLoss.apply(
            x.flatten(0, 1),
            self.weight,
            targets.flatten(),
            num_tokens,
            float(z_loss),
            self.vocab_start,
            self.vocab_size,
            self.group,
            IGNORE_INDEX,
        )
