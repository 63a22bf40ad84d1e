"""Tensor-parallel rewrite shared by the Llama-style decoders (Llama/SmolLM, Qwen2, Qwen3, SmolLM3).

The stock HF model stays the model: only `self_attn`, `mlp`, `embed_tokens` and `lm_head`
are swapped for tensor-parallel modules, in place, under their stock names. Each family file
says what differs (biases, per-head q/k norms, NoPE layers); this file owns the head bookkeeping.

Head layout (DESIGN decision 2): rank r of t holds query heads [r*h/t, (r+1)*h/t) and KV
heads [r*g/t, (r+1)*g/t), fused as [q_r; k_r; v_r]. With HF's grouping (query head i reads KV
head i // (h/g)) no permutation is needed. When t > g, KV head r // (t/g) is replicated over
t/g ranks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..parallel.context import CPMask, context_attention
from ..parallel.layout import Piece, concat_pieces, set_pieces, shard_range, whole
from ..parallel.rng import DropoutRNG
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead


@dataclass
class TPContext:
    """This rank's place in the tensor-parallel group, passed to every swap."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    sequence_parallel: bool = False
    dtype: torch.dtype | None = None
    rng: DropoutRNG | None = None
    """This rank's tensor-parallel dropout stream (hf3d/parallel/rng.py): attention dropout draws from it."""


def mark_tp_partial(param: nn.Parameter, ctx: TPContext) -> None:
    """The gradient of a replicated parameter that each tp rank computes from only part of the data."""
    if ctx.size > 1:
        param.hf3d_tp_partial_grad = True


class _RMSNorm(torch.autograd.Function):
    """Stock RMSNorm, `weight * (x * rsqrt(mean(x²) + eps)).to(dtype)` in fp32, with its own backward.

    The forward is stock's ops in stock's order, so the output is bit for bit stock's. Autograd would
    save x, x·rsqrt (and its fp32 copy under bf16) and run about ten elementwise kernels backward;
    this saves x and the per-token rsqrt, and backward is the closed-form derivative in six."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.float32)
        rsqrt = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rsqrt)
        return weight * (x32 * rsqrt).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rsqrt = ctx.saved_tensors
        normed = x.to(torch.float32) * rsqrt
        grad_w = (grad * normed.to(x.dtype)).flatten(0, -2).sum(0)
        g = (grad * weight).to(torch.float32)
        # d/dx of x·rsqrt(mean(x²)): rsqrt · (g − normed · mean(g · normed))
        grad_x = (g - normed * (g * normed).mean(-1, keepdim=True)).mul_(rsqrt)
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    """The stock RMSNorm module's place and Parameter (the same object: its HF name and pieces stay),
    with the forward of `_RMSNorm`. Llama, Qwen2 and Qwen3 share that norm, line for line."""

    def __init__(self, stock: nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = stock.weight, stock.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class _Rotary(torch.autograd.Function):
    """Stock rotary embedding of q and k (stock's own function runs the forward), with a backward that
    writes each gradient in place, where autograd splits, negates, pads and adds the rotate_half's
    pieces: g·cos, then ± the halves of g·sin swapped. Values are equal too."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, rope):
        ctx.save_for_backward(cos.unsqueeze(1), sin.unsqueeze(1))
        return rope(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        out = []
        for g in (grad_q, grad_k):
            half = g.shape[-1] // 2
            g_sin = g * sin
            dx = g * cos
            dx[..., :half] += g_sin[..., half:]
            dx[..., half:] -= g_sin[..., :half]
            out.append(dx)
        return out[0], out[1], None, None, None


class TPAttention(nn.Module):
    """Attention over this rank's heads; projections fused, everything else HF's own."""

    def __init__(self, stock: nn.Module, prefix: str, ctx: TPContext):
        super().__init__()
        qkv_bias, o_bias = stock.q_proj.bias is not None, stock.o_proj.bias is not None
        config = stock.config
        self.config, self.layer_idx = config, stock.layer_idx
        self.head_dim, self.scaling = stock.head_dim, stock.scaling
        self.attention_dropout, self.is_causal = stock.attention_dropout, True
        self.rng = ctx.rng
        self.sliding_window = getattr(stock, "sliding_window", None)
        self.use_rope = bool(getattr(stock, "use_rope", True))  # stock's per-layer flag (SmolLM3 NoPE: 0)
        h, g, t, r = config.num_attention_heads, config.num_key_value_heads, ctx.size, ctx.rank
        q0, q1 = shard_range(h, t, r)
        if t <= g:
            (k0, k1), kv_owner, kv_partial = shard_range(g, t, r), True, False
        else:
            per_kv = t // g
            k0 = r // per_kv
            k1, kv_owner, kv_partial = k0 + 1, r % per_kv == 0, True
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        d = self.head_dim
        module = sys.modules[type(stock).__module__]
        self._apply_rotary: Callable = module.apply_rotary_pos_emb
        self._eager: Callable = module.eager_attention_forward
        width = (self.num_heads + 2 * self.num_kv_heads) * d
        sp = ctx.sequence_parallel
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, width, bias=qkv_bias, group=ctx.group, sequence_parallel=sp, dtype=ctx.dtype
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * d,
            config.hidden_size,
            bias=o_bias,
            group=ctx.group,
            sequence_parallel=sp,
            dtype=ctx.dtype,
        )
        for kind in ("weight", "bias") if qkv_bias else ("weight",):
            q = concat_pieces([(f"{prefix}.q_proj.{kind}", q0 * d, q1 * d)], dim=0)
            kv = concat_pieces(
                [(f"{prefix}.k_proj.{kind}", k0 * d, k1 * d), (f"{prefix}.v_proj.{kind}", k0 * d, k1 * d)],
                dim=0,
                owner=kv_owner,
                partial_grad=kv_partial,
            )
            kv = [_shift(p, q[-1].local_stop) for p in kv]
            set_pieces(getattr(self.qkv_proj, kind), q + kv)
        set_pieces(self.o_proj.weight, [Piece(f"{prefix}.o_proj.weight", 1, q0 * d, q1 * d, 0, (q1 - q0) * d)])
        if o_bias:
            set_pieces(self.o_proj.bias, whole(f"{prefix}.o_proj.bias", config.hidden_size, owner=r == 0))
        self.q_norm = self.k_norm = None
        if hasattr(stock, "q_norm"):  # Qwen3: RMSNorm over head_dim of each head, before RoPE
            self.q_norm, self.k_norm = RMSNorm(stock.q_norm), RMSNorm(stock.k_norm)
            for name in ("q_norm", "k_norm"):
                w = getattr(self, name).weight
                set_pieces(w, whole(f"{prefix}.{name}.weight", d, owner=r == 0))
                mark_tp_partial(w, ctx)  # each rank sees only its own heads

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        qkv = self.qkv_proj(hidden_states)  # [b, s, (hq + 2 hkv) * d], s full even under SP
        input_shape = qkv.shape[:-1]
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = (x.reshape(*input_shape, -1, d) for x in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, heads_local, s, d]
        cos, sin = position_embeddings
        if not self.use_rope:  # a NoPE layer (SmolLM3): q and k as projected
            pass
        elif cos.requires_grad or sin.requires_grad or cos.shape[-1] != d:
            q, k = self._apply_rotary(q, k, cos, sin)
        else:  # the families here share stock's full-width rotate-half RoPE
            q, k = _Rotary.apply(q, k, cos, sin, self._apply_rotary)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        dropout = self.attention_dropout if self.training else 0.0
        if isinstance(attention_mask, CPMask):  # context parallel: keys and values of the whole sequence
            attention = functools.partial(context_attention, attention)
        # masks over this rank's heads come from its own stream (hf3d/parallel/rng.py); no dropout, no RNG work
        with self.rng.fork() if dropout and self.rng is not None else contextlib.nullcontext():
            out, weights = attention(
                self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **extra, **kwargs
            )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


def _shift(p: Piece, by: int) -> Piece:
    return Piece(
        p.hf_name, p.dim, p.hf_start, p.hf_stop, p.local_start + by, p.local_stop + by, p.owner, p.partial_grad
    )


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up from the fused [..., 2i] gate/up projection.

    Saves only that projection (stock autograd also keeps silu(gate), one more [tokens, i] buffer per
    layer) and writes both halves' gradients straight into one [..., 2i] buffer, where autograd would
    make two and concatenate them. The arithmetic is stock's (aten's silu_backward, the same products),
    so the values are bit for bit those of `act_fn(gate) * up`."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # dynamo breaks on out= into a strided half; inductor fuses the cat
            return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)
        out = torch.empty_like(gate_up)
        d_gate, d_up = out.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return out


class TPMLP(nn.Module):
    """SwiGLU MLP with gate/up fused into one column-parallel projection."""

    def __init__(self, stock: nn.Module, prefix: str, ctx: TPContext):
        super().__init__()
        bias = stock.gate_proj.bias is not None
        hidden, inter = stock.hidden_size, stock.intermediate_size
        i0, i1 = shard_range(inter, ctx.size, ctx.rank)
        self.act_fn = stock.act_fn
        self.fused_silu = type(stock.act_fn) in (SiLUActivation, nn.SiLU)  # other activations: plain autograd
        sp = ctx.sequence_parallel
        self.gate_up_proj = ColumnParallelLinear(
            hidden, 2 * (i1 - i0), bias=bias, group=ctx.group, sequence_parallel=sp, dtype=ctx.dtype
        )
        self.down_proj = RowParallelLinear(
            i1 - i0, hidden, bias=bias, group=ctx.group, sequence_parallel=sp, dtype=ctx.dtype
        )
        for kind in ("weight", "bias") if bias else ("weight",):
            set_pieces(
                getattr(self.gate_up_proj, kind),
                concat_pieces([(f"{prefix}.gate_proj.{kind}", i0, i1), (f"{prefix}.up_proj.{kind}", i0, i1)], dim=0),
            )
        set_pieces(self.down_proj.weight, [Piece(f"{prefix}.down_proj.weight", 1, i0, i1, 0, i1 - i0)])
        if bias:
            set_pieces(self.down_proj.bias, whole(f"{prefix}.down_proj.bias", hidden, owner=ctx.rank == 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_silu:
            return self.down_proj(_SwiGLU.apply(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def valid_tp_sizes(config) -> list[int]:
    h, g = config.num_attention_heads, config.num_key_value_heads
    return [
        t for t in range(1, h + 1) if h % t == 0 and (g % t == 0 or t % g == 0) and config.intermediate_size % t == 0
    ]


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


class DecoderAdapter:
    """How one family's stock modules become tensor-parallel ones.

    Biases are read off the stock modules (Qwen2 hard-codes q/k/v bias and no o_proj bias;
    Llama and Qwen3 follow `attention_bias`), so a family only overrides what is structural.
    """

    model_types: tuple[str, ...] = ()
    final_norm_name = "model.norm.weight"
    """The norm in front of the head: under µP with tied embeddings it carries the readout's gain."""
    head_name = "lm_head.weight"
    """The untied head: under µP a readout, which also carries the output multiplier."""

    def check_tp(self, config, tp: int) -> None:
        valid = valid_tp_sizes(config)
        if tp not in valid:
            raise ValueError(
                f"tp={tp} does not fit this {config.model_type} model: {config.num_attention_heads} query "
                f"heads, {config.num_key_value_heads} KV heads, intermediate size {config.intermediate_size}. "
                f"tp must divide the query heads and the intermediate size, and divide or be a multiple of "
                f"the KV heads. Valid tp values: {', '.join(map(str, valid))}"
            )

    def swap_layer(self, layer: nn.Module, prefix: str, ctx: TPContext, ep=None) -> None:
        """ep: the expert-parallel context (hf3d/models/moe.py), for families with MoE blocks."""
        layer.self_attn = TPAttention(layer.self_attn, f"{prefix}.self_attn", ctx)
        layer.mlp = self.swap_mlp(layer.mlp, f"{prefix}.mlp", ctx, ep)
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, RMSNorm(getattr(layer, name)))
            w = getattr(layer, name).weight
            set_pieces(w, whole(f"{prefix}.{name}.weight", w.shape[0], owner=ctx.rank == 0))
            if ctx.sequence_parallel:
                mark_tp_partial(w, ctx)

    def swap_mlp(self, mlp: nn.Module, prefix: str, ctx: TPContext, ep) -> nn.Module:
        return TPMLP(mlp, prefix, ctx)

    def fan_axes(self, name: str, shape: tuple[int, ...], config) -> tuple[bool, bool]:
        """(fan-in grows with width, fan-out grows with width) of the HF parameter `name` of global `shape`, for
        µP (hf3d/optim/parametrization.py). A weight [out, in] maps in -> out; the token embedding [vocab,
        hidden] is a lookup from a one-hot over the vocabulary, whose size is fixed; the head maps the width
        to the vocabulary (a readout); a vector (norm weight, bias) has a fan-in of 1."""
        if len(shape) == 1 or name == "model.embed_tokens.weight":
            return False, True
        if name == self.head_name:
            return True, False
        return True, True

    def check_ep(self, config, ep: int) -> None:
        if ep > 1:
            raise ValueError(
                f"ep={ep} needs a mixture-of-experts model; this {config.model_type} model has no experts (use ep=1)"
            )

    def moe_layers(self, config) -> list[int]:
        return []

    def mlp_costs(self, config) -> list[float] | None:
        """Each layer's MLP cost for the pipeline split (hf3d.parallel.stage.layer_costs); None: all dense and alike."""
        return None

    def disk_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Stock's in-memory {name: shape} -> the names and shapes stock saves (the same for dense families)."""
        return shapes

    def wrap_source(self, source, config, *, saved: bool):
        return source

    def source_pieces(self, pieces: list, config) -> list:
        return pieces

    def swap_final_norm(self, norm: nn.Module, ctx: TPContext) -> RMSNorm:
        set_pieces(norm.weight, whole(self.final_norm_name, norm.weight.shape[0], owner=ctx.rank == 0))
        if ctx.sequence_parallel:
            mark_tp_partial(norm.weight, ctx)
        return RMSNorm(norm)

    def make_embedding(self, config, ctx: TPContext) -> VocabParallelEmbedding:
        v0, v1 = shard_range(padded_vocab(config.vocab_size, ctx.size), ctx.size, ctx.rank)
        emb = VocabParallelEmbedding(
            v1 - v0,
            config.hidden_size,
            vocab_start=v0,
            padding_idx=config.pad_token_id,
            group=ctx.group,
            sequence_parallel=ctx.sequence_parallel,
            dtype=ctx.dtype,
        )
        set_pieces(emb.weight, _vocab_pieces("model.embed_tokens.weight", config.vocab_size, v0, v1, owner=True))
        return emb

    def make_lm_head(self, config, ctx: TPContext, *, tied_weight: nn.Parameter | None) -> VocabParallelLMHead:
        """tied_weight: the embedding Parameter when it lives on this rank. A tied lm_head whose
        embedding lives on another pipeline rank is a copy: exported and counted there, not here."""
        v0, v1 = shard_range(padded_vocab(config.vocab_size, ctx.size), ctx.size, ctx.rank)
        head = VocabParallelLMHead(
            v1 - v0,
            config.hidden_size,
            vocab_start=v0,
            vocab_size=config.vocab_size,
            group=ctx.group,
            sequence_parallel=ctx.sequence_parallel,
            weight=tied_weight,
            dtype=ctx.dtype,
        )
        if tied_weight is None:
            tied = config.tie_word_embeddings
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
            set_pieces(head.weight, _vocab_pieces(name, config.vocab_size, v0, v1, owner=not tied))
            if tied:
                head.weight.hf3d_tied_copy = True
        return head


def _vocab_pieces(name: str, vocab: int, v0: int, v1: int, *, owner: bool) -> list[Piece]:
    stop = min(v1, vocab)
    return [] if stop <= v0 else [Piece(name, 0, v0, stop, 0, stop - v0, owner)]
