"""Context parallelism: each sequence split over the cp ranks, attention still over the whole sequence.

Layout (causal load balance, as Megatron and torchtitan's head-tail balancer): a sequence of S tokens
is cut into 2*cp chunks of c = S / (2*cp); cp rank r holds chunk r, then chunk 2*cp-1-r, as one local
sequence of 2c tokens. Under a causal mask chunk i costs about i+1 blocks of keys, so every rank gets
(r+1) + (2*cp-r) = 2*cp+1 blocks. Every rank of a dp replica receives the FULL rows; the model slices
tokens, targets and position ids itself (`CPContext.split`). Each token keeps its position id as
given, so RoPE sees true positions and document restarts survive the cut. The full position ids reach
every stage, which builds the masks from them.

Attention: K and V (after RoPE, this tp rank's KV heads only) are all-gathered over cp and put back in
sequence order; each of the rank's two query chunks then runs the stock attention interface
(`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`, sdpa or eager) on the causal prefix of keys [0, end of the
chunk), with the mask that transformers' own mask interface (`ALL_MASK_ATTENTION_FUNCTIONS`) builds
from the same mask function stock composes: causal (or sliding window), and with packed documents the
document mask over the full position ids. The backward of the gather is a reduce-scatter over cp.

Why all-gather and not a ring: a ring of K/V blocks needs each block's log-sum-exp to merge partial
softmaxes, and HF's attention interface returns none (sdpa and eager return the output only), so a
ring could not use the stock kernels. With GQA the gathered K/V are small: per layer and row
2 * S * kv_heads_local * head_dim elements, counted in `CPContext.kv_bytes` (the bytes each rank
receives, forward gather plus backward reduce-scatter).

Loss and gradients (hf3d.model, hf3d.optim): each rank's token-loss sum is divided by the token count
of the FULL rows over the global batch, so summing over cp, dp and micro-batches gives the exact global
mean. Parameters are replicated over cp and each rank saw other tokens: their gradients are summed
over dp x cp, and ZeRO-1 shards over dp x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.masking_utils import (
    and_masks,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    remap_positions_for_packed_sequence,
)

from ..utils import compat
from .attention import DENSE_MASK_ATTENTION
from .segments import Segments, interface_mask, layer_mask_function, tree_mask_function

SEQ_DIM = 1  # tokens, targets, position ids and activations are [batch, seq, ...]
# attention implementations that run a query chunk at an offset into the sequence: their mask interface
# takes q/kv lengths and offsets. flash_attention_* sees only a 2D padding mask and a causal flag, which
# cannot say where a chunk starts. flex_attention on CPU (torch 2.13, no compiler) was measured wrong
# here already at cp=1 on a packed batch (max |Δlogits| 0.15 vs stock sdpa) and NaN at cp=2, and has no
# CPU backward, so it is refused until it can be checked on a GPU.
CP_ATTENTION = DENSE_MASK_ATTENTION


def check_attention(impl: str, cp: int) -> None:
    """Refuse an attention implementation that cannot run context-parallel (one line)."""
    if cp > 1 and impl not in CP_ATTENTION:
        raise ValueError(
            f"cp={cp} cannot run with attn_implementation={impl!r}: context parallelism runs each query chunk "
            "at its offset into the sequence through sdpa or eager (flash_attention_* takes no such offset, "
            "flex_attention is not verified there); load the model with attn_implementation='sdpa' or 'eager', "
            "or use cp=1"
        )


def head_tail_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that cp rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's 2c tokens of a full-sequence tensor: chunk r, then chunk 2cp-1-r."""
    c = x.shape[dim] // (2 * cp)
    assert c * 2 * cp == x.shape[dim], f"sequence of {x.shape[dim]} does not cut into {2 * cp} chunks"
    return torch.cat([x.narrow(dim, i * c, c) for i in head_tail_chunks(cp, rank)], dim=dim)


def to_sequence_order(parts: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
    """parts: [cp, *local] (rank j's local tensor at index j) -> the full tensor in sequence order."""
    cp = parts.shape[0]
    c = parts.shape[dim + 1] // 2
    where = {}  # chunk -> (rank, half)
    for j in range(cp):
        for half, i in enumerate(head_tail_chunks(cp, j)):
            where[i] = (j, half)
    return torch.cat([parts[where[i][0]].narrow(dim, where[i][1] * c, c) for i in range(2 * cp)], dim=dim)


def to_rank_order(full: torch.Tensor, cp: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """The inverse of to_sequence_order: [*full] -> [cp, *local]."""
    return torch.stack([split_sequence(full, cp, j, dim) for j in range(cp)])


@dataclass
class CPContext:
    """This rank's place in the context-parallel group, shared by the stages and the model."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    kv_bytes: int = 0  # bytes this rank received in K/V gathers and their reduce-scatters (a counter)

    @property
    def active(self) -> bool:
        return self.size > 1

    def split(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        return split_sequence(x, self.size, self.rank, dim) if self.active else x

    def gather(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        """All-gather this rank's local tensor over cp and return the full one in sequence order (no autograd)."""
        if not self.active:
            return x
        parts = x.new_empty((self.size, *x.shape))
        compat.all_gather_single(parts.flatten(0, 1), x.contiguous(), group=self.group)
        return to_sequence_order(parts, dim)

    def local_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The position ids of this rank's own tokens, as given (true positions, restarts kept)."""
        return self.split(position_ids)

    def masks(
        self, config, kind: str, position_ids: torch.Tensor, dtype: torch.dtype, segments: Segments | None = None
    ) -> CPMask:
        return build_masks(config, kind, position_ids, self, dtype, segments)


@dataclass
class CPMask:
    """What a stage passes its layers as `attention_mask` under cp: for each of the rank's two query
    chunks, the key length it reads (the causal prefix) and the mask over those keys."""

    ctx: CPContext
    chunk: int  # c, tokens per chunk
    kv_ends: tuple[int, int]
    masks: tuple  # one per query chunk: whatever the attention implementation's mask interface built


def mask_function(config, kind: str, position_ids: torch.Tensor, segments: Segments | None = None):
    """Stock's mask function for a layer of `kind` over the full sequence (create_causal_mask and
    create_sliding_window_causal_mask compose the same one): causal or sliding window, and with packed
    documents (position ids that restart) causal on positions within one document. With `segments`, the
    rows' units share their contexts (hf3d.parallel.segments)."""
    if segments is not None:
        return tree_mask_function(config, kind, position_ids, segments)
    fn = layer_mask_function(config, kind)
    documents = find_packed_sequence_indices(position_ids)  # [b, S] document index, None without restarts
    if documents is not None:
        fn = and_masks(remap_positions_for_packed_sequence(fn, position_ids), packed_sequence_mask_function(documents))
    return fn


def build_masks(
    config, kind: str, position_ids: torch.Tensor, ctx: CPContext, dtype: torch.dtype, segments: Segments | None = None
) -> CPMask:
    """position_ids: the FULL [b, S] position ids. Masks for this rank's two query chunks, each over keys
    [0, end of the chunk), from the attention implementation's own mask interface."""
    b, s = position_ids.shape
    c = s // (2 * ctx.size)
    fn = mask_function(config, kind, position_ids, segments)
    ends, masks = [], []
    for i in head_tail_chunks(ctx.size, ctx.rank):
        end = (i + 1) * c
        # the interface never takes sdpa's is_causal shortcut: it aligns top-left, wrong for a chunk at an offset
        mask = interface_mask(
            config, kind, fn, batch_size=b, q_length=c, q_offset=i * c, kv_length=end, dtype=dtype,
            device=position_ids.device,
        )  # fmt: skip
        ends.append(end)
        masks.append(mask)
    return CPMask(ctx, c, (ends[0], ends[1]), (masks[0], masks[1]))


class _GatherKV(torch.autograd.Function):
    """[2, b, kv_heads, 2c, d] local K/V -> [2, b, kv_heads, S, d] in sequence order; backward:
    reduce-scatter of the gradient over cp (each rank's queries read every rank's keys)."""

    @staticmethod
    def forward(ctx, kv, cp: CPContext):
        ctx.cp = cp
        parts = kv.new_empty((cp.size, *kv.shape))
        compat.all_gather_single(parts.flatten(0, 1), kv.contiguous(), group=cp.group)
        cp.kv_bytes += (cp.size - 1) * kv.numel() * kv.element_size()
        return to_sequence_order(parts, dim=3)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        parts = to_rank_order(grad, cp.size, dim=3).contiguous()  # [cp, 2, b, kv_heads, 2c, d]
        out = parts.new_empty(parts.shape[1:])
        compat.reduce_scatter_single(out, parts.flatten(0, 1), group=cp.group)
        cp.kv_bytes += (cp.size - 1) * out.numel() * out.element_size()
        return out, None


def context_attention(attention, module, q, k, v, mask: CPMask, **kwargs) -> tuple[torch.Tensor, None]:
    """q, k, v: [b, heads_local, 2c, d] after RoPE, this rank's tokens. `attention` is the stock attention
    function; kwargs are what the module would pass it (dropout, scaling, ...). Returns [b, 2c, heads, d]."""
    kv = _GatherKV.apply(torch.stack([k, v]), mask.ctx)  # [2, b, kv_heads, S, d]
    c, outs = mask.chunk, []
    for j, (end, m) in enumerate(zip(mask.kv_ends, mask.masks)):
        out, _ = attention(module, q[:, :, j * c : (j + 1) * c], kv[0, :, :, :end], kv[1, :, :, :end], m, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None
