"""Mixture-of-experts layers of the stock Qwen MoE classes (Qwen3-MoE, Qwen2-MoE), split over tp and ep.

Stock keeps a layer's experts as two 3-D parameters, `experts.gate_up_proj [E, 2I, H]` and
`experts.down_proj [E, H, I]`, and saves them per expert (`experts.<k>.{gate,up,down}_proj.weight`).
hf3d's names are the saved ones, so checkpoints move between ep degrees and `convert to-hf` writes
stock's files. This rank holds its ep rank's E/ep experts, and of each the tp rank's slice of the
intermediate dimension (expert tensor parallelism), as 3-D stacks whose slabs are pieces of the
per-expert tensors: `gate_up [E/ep, 2I/tp, H]` (gate rows, then up rows) and `down [E/ep, H, I/tp]`.

The router (`gate`, stock's fp32 softmax, top-k, renormalised when `norm_topk_prob`) runs on this rank's
tokens. The tokens, with the router's weights and choices, enter the tensor-parallel region like any
column-parallel input (replicated, or gathered under sequence parallelism); each expert's output is
then a partial sum over the intermediate slices, reduced over tp like a row-parallel output. Qwen2-MoE's
shared expert is a tensor-parallel MLP with its sigmoid gate beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from ..parallel.expert import Dispatch, RouterStats, grouped_mm, mark_expert
from ..parallel.layout import Piece, set_pieces, shard_range, whole
from ..parallel.tensor import copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq
from .common import TPMLP, DecoderAdapter, TPContext, _SwiGLU, mark_tp_partial

EXPERT_NAME = re.compile(r"^(?P<layer>.+\.experts)\.(?P<k>\d+)\.(?P<part>gate|up|down)_proj\.weight$")


@dataclass
class EPContext:
    """This rank's place in the expert group, and the model's router statistics."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    stats: RouterStats | None = None


class GroupedExperts(nn.Module):
    """This rank's experts of one MoE layer as two 3-D stacks, `gate_up [E/ep, 2I/tp, H]` and `down [E/ep, H, I/tp]`,
    run as grouped matmuls over the rows sorted by expert."""

    def __init__(self, stock_experts: nn.Module, prefix: str, ctx: TPContext, *, first: int, count: int):
        super().__init__()
        hidden, inter = stock_experts.hidden_dim, stock_experts.intermediate_dim
        self.fused_silu = type(stock_experts.act_fn) in (SiLUActivation, nn.SiLU)
        self.act_fn = stock_experts.act_fn
        i0, i1 = shard_range(inter, ctx.size, ctx.rank)
        n = i1 - i0
        self.gate_up = nn.Parameter(torch.empty(count, 2 * n, hidden, dtype=ctx.dtype))
        self.down = nn.Parameter(torch.empty(count, hidden, n, dtype=ctx.dtype))
        gate_up, down = [], []
        for e in range(count):
            name = f"{prefix}.experts.{first + e}"
            gate_up += [
                Piece(f"{name}.gate_proj.weight", 0, i0, i1, 0, n, stack=e),
                Piece(f"{name}.up_proj.weight", 0, i0, i1, n, 2 * n, stack=e),
            ]
            down.append(Piece(f"{name}.down_proj.weight", 1, i0, i1, 0, n, stack=e))
        set_pieces(self.gate_up, gate_up)
        set_pieces(self.down, down)
        mark_expert(self.gate_up)
        mark_expert(self.down)

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        gate_up = grouped_mm(rows, self.gate_up, offsets)
        if self.fused_silu:
            act = _SwiGLU.apply(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.act_fn(gate) * up
        return grouped_mm(act, self.down, offsets)


class TPMoE(nn.Module):
    """A stock sparse MoE block (router, experts, optional shared expert) over tp and ep."""

    def __init__(self, stock: nn.Module, prefix: str, ctx: TPContext, ep: EPContext):
        super().__init__()
        router, experts = stock.gate, stock.experts
        self.num_experts, self.top_k = router.num_experts, router.top_k
        self.norm_topk_prob = router.norm_topk_prob
        self.tp_group, self.sequence_parallel = ctx.group, ctx.sequence_parallel
        self.ep, self.layer = ep, int(prefix.split(".")[2])  # prefix: model.layers.<i>.mlp
        self.router = router.weight  # stock's Parameter: its name and pieces stay
        set_pieces(self.router, whole(f"{prefix}.gate.weight", self.num_experts, owner=ctx.rank == 0))
        if ctx.sequence_parallel:
            mark_tp_partial(self.router, ctx)  # each tp rank routes its own part of the sequence
        per_rank = self.num_experts // ep.size
        self.first_expert = ep.rank * per_rank
        # a module of their own: ZeRO-3 shards them over the ranks holding the same experts (hf3d/parallel/fsdp.py)
        self.grouped_experts = GroupedExperts(experts, prefix, ctx, first=self.first_expert, count=per_rank)
        self.shared_expert = self.shared_expert_gate = None
        if getattr(stock, "shared_expert", None) is not None:  # Qwen2-MoE
            self.shared_expert = TPMLP(stock.shared_expert, f"{prefix}.shared_expert", ctx)
            self.shared_expert_gate = stock.shared_expert_gate.weight
            set_pieces(self.shared_expert_gate, whole(f"{prefix}.shared_expert_gate.weight", 1, owner=ctx.rank == 0))
            if ctx.sequence_parallel:
                mark_tp_partial(self.shared_expert_gate, ctx)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stock's router on x [T, h]: (top-k weights in x's dtype, top-k expert ids), each [T, k]."""
        logits = F.linear(x, self.router)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        stats = self.ep.stats
        if stats is not None and stats.bias is not None:  # aux-loss-free balancing: the bias moves the picks only
            index = stats.pick(self.layer, probs, self.top_k)
            weights = probs.gather(-1, index)
        else:
            weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if stats is not None:
            # stock's load-balancing loss takes a softmax of the logits of its own, whose backward adds to the
            # router's at the logits; run whenever the loss is on, so that recompute saves what the forward did
            stats.tally(self.layer, F.softmax(logits, dtype=torch.float, dim=-1) if stats.aux else probs, index)
        return weights.to(logits.dtype), index

    # Under regional compile (hf3d/parallel/compile.py) the block runs eager, one graph break per MoE layer: at
    # ep > 1 the all-to-all's split sizes are read on the host (the layer's only host sync; none at ep = 1), and
    # torch 2.13's meta function of torch._grouped_mm refuses fp32.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        weights, index = self.route(x.reshape(-1, h))
        weights, index = weights.view(b, s, -1), index.view(b, s, -1)
        if self.sequence_parallel:
            tokens, weights = gather_seq(x, self.tp_group), gather_seq(weights, self.tp_group)
            index = gather_seq(index, self.tp_group)
        else:
            tokens, weights = copy_to_tp(x, self.tp_group), copy_to_tp(weights, self.tp_group)
        dispatch = Dispatch(index.reshape(-1, self.top_k), self.num_experts, self.ep.group)
        rows = dispatch.send_tokens(tokens.reshape(-1, h))
        out = dispatch.combine(self.grouped_experts(rows, dispatch.tokens_per_expert), weights.reshape(-1, self.top_k))
        out = out.view(b, -1, h)
        out = reduce_scatter_seq(out, self.tp_group) if self.sequence_parallel else reduce_from_tp(out, self.tp_group)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out


def is_moe_block(module: nn.Module) -> bool:
    return hasattr(module, "experts") and hasattr(module, "gate")


class MoEAdapter(DecoderAdapter):
    """The Qwen MoE families: dense layers as the shared rewrite, sparse blocks as TPMoE."""

    # the widths split over tp besides the dense ones, and why (a family without the field skips it)
    TP_SPLIT = {
        "moe_intermediate_size": "each expert's intermediate dimension is split over tp",
        "shared_expert_intermediate_size": "the shared expert is split over tp like a dense MLP",
    }

    def fan_axes(self, name: str, shape: tuple[int, ...], config) -> tuple[bool, bool]:
        """The router (`mlp.gate`, hidden -> num_experts) and the shared expert's gate (hidden -> 1) map the
        width to a fixed count, as the head does: readouts. An expert is a hidden matrix of its own."""
        if name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight")):
            return True, False
        return super().fan_axes(name, shape, config)

    def check_tp(self, config, tp: int) -> None:
        super().check_tp(config, tp)
        for field, why in self.TP_SPLIT.items():
            width = getattr(config, field, None)
            if width is not None and width % tp:
                raise ValueError(f"tp={tp} does not divide this {config.model_type} model's {field} {width}: {why}")

    def check_ep(self, config, ep: int) -> None:
        if config.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide this {config.model_type} model's {config.num_experts} experts: each "
                f"expert-parallel rank holds num_experts / ep of them; use an ep that divides {config.num_experts}"
            )

    def swap_mlp(self, mlp: nn.Module, prefix: str, ctx: TPContext, ep: EPContext | None) -> nn.Module:
        return TPMoE(mlp, prefix, ctx, ep) if is_moe_block(mlp) else TPMLP(mlp, prefix, ctx)

    def moe_layers(self, config) -> list[int]:
        """The decoder layers with a sparse block (stock's rule)."""
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers)
        return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]

    def mlp_costs(self, config) -> list[float]:
        """A sparse layer costs what a token runs through: the router, its top-k experts and a shared expert;
        the dense layers cost their MLP."""
        h, moe = config.hidden_size, set(self.moe_layers(config))
        sparse = h * config.num_experts + 3.0 * h * config.moe_intermediate_size * config.num_experts_per_tok
        sparse += 3.0 * h * getattr(config, "shared_expert_intermediate_size", 0)
        dense = 3.0 * h * config.intermediate_size
        return [sparse if i in moe else dense for i in range(config.num_hidden_layers)]

    def disk_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Stock's in-memory {name: shape} -> the saved one: fused experts become per-expert tensors."""
        out = {}
        for name, shape in shapes.items():
            if name.endswith(".experts.gate_up_proj"):
                e, two_i, h = shape
                for k in range(e):
                    out[f"{name[: -len('gate_up_proj')]}{k}.gate_proj.weight"] = (two_i // 2, h)
                    out[f"{name[: -len('gate_up_proj')]}{k}.up_proj.weight"] = (two_i // 2, h)
            elif name.endswith(".experts.down_proj"):
                e, h, i = shape
                for k in range(e):
                    out[f"{name[: -len('down_proj')]}{k}.down_proj.weight"] = (h, i)
            else:
                out[name] = shape
        return out

    def wrap_source(self, source, config, *, saved: bool):
        """A reader of saved names over a source of stock's in-memory ones (an instance, a from-scratch
        init); a saved directory is read as it is, unless it holds the fused tensors."""
        return FusedExperts(source, config.moe_intermediate_size, config.num_experts, saved=saved)

    def source_pieces(self, pieces: list[Piece], config) -> list[Piece]:
        """What to announce to a source of in-memory names: a per-expert piece asks for its whole fused tensor."""
        out = []
        for p in pieces:
            m = EXPERT_NAME.match(p.hf_name)
            if m is None:
                out.append(p)
                continue
            fused = _fused_name(m)
            out.append(Piece(fused, 0, 0, config.num_experts, 0, config.num_experts))
        return out


def _fused_name(m: re.Match) -> str:
    return f"{m['layer']}.{'down_proj' if m['part'] == 'down' else 'gate_up_proj'}"


class FusedExperts:
    """`get` of saved per-expert names, cut from the fused tensors of a source that holds stock's
    in-memory names (whole fused tensors are read once each, one at a time)."""

    def __init__(self, source, inter: int, num_experts: int, *, saved: bool):
        self.source, self.inter, self.num_experts, self.saved = source, inter, num_experts, saved
        self._fused: tuple[str | None, torch.Tensor | None] = (None, None)

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        m = EXPERT_NAME.match(name)
        if m is None or (self.saved and name in self.source.entries):
            return self.source.get(name, dim, start, stop)
        fused = _fused_name(m)
        if self._fused[0] != fused:
            self._fused = (None, None)  # drop the previous one first
            full = self._whole(fused)
            self._fused = (fused, full)
        t = self._fused[1][int(m["k"])]
        if m["part"] == "gate":
            t = t[: self.inter]
        elif m["part"] == "up":
            t = t[self.inter :]
        return t.narrow(dim, start, stop - start)

    def _whole(self, fused: str) -> torch.Tensor:
        if self.saved:
            if fused not in self.source.entries:
                raise ValueError(f"neither per-expert tensors nor {fused!r} are in the checkpoint")
            return self.source.tensor(fused)
        return self.source.get(fused, 0, 0, self.num_experts)
