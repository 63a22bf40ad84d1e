"""A pipeline stage: a contiguous run of the stock model's layers, run the way HF runs them.

The stage owns no weights of its own; it points at modules of the stock HF model (which keeps
its stock parameter names) and reproduces the stock forward: embedding (first stage), rotary
cos/sin recomputed from position ids (every stage; the rotary module holds only buffers),
HF's mask builders (full and sliding window, per `config.layer_types`), the decoder layers,
and the final norm + lm_head (last stage), which returns this rank's vocab shard of logits.

Activation recompute wraps a layer's call, while grad is enabled, in non-reentrant
`torch.utils.checkpoint`: the layer keeps only its inputs and runs its forward again (its tensor-
parallel collectives included, in the same order on every tp rank) when backward reaches it. With
attention dropout, the recomputed forward draws the first forward's masks again (hf3d/parallel/rng.py).

Selective recompute is the same checkpoint with PyTorch's op-level policy
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`, `selective_policy`): the forward keeps the
outputs of the matmuls and attention kernels (SAVED_OPS), the expensive ops, and backward runs everything
else again, the cheap element-wise ops, norms, rotary, SwiGLU and eager attention's softmax, with the kept
outputs handed back in place of the kernels. The tensor- and context-parallel collectives inside a layer
are recomputed, not kept. Keeping one would be wrong: hf3d's collectives write into a buffer in place
(c10d's all_reduce_, all_gather into a preallocated output) and the layer reads that buffer, not the op's
return value, so a recomputed forward that takes the kept result and skips the op reads an unreduced
buffer. Recomputing them is deadlock-free for the reason full recompute is: every rank of a tp or cp group
recomputes the same layer at the same point of the same backward, and the recomputed forward issues its
collectives in the first forward's order, so each group runs the same collectives in the same order on
every rank. The random ops (attention dropout) are recomputed too, under the replayed generator state.
Measured at tp2: keeping the all-reduces instead moved the grad norm by 1e-3 relative, silently.

A compiled layer (hf3d/parallel/compile.py) runs under the same policy, which then sees the compiled code's
extern kernels, not its fused ones: the attention kernel's outputs are kept, and the matmuls, which inductor
writes into buffers of its own (mm with out=, recomputed since a kept result would not fill the buffer), run
again with the rest (measured on CPU at tp2: the losses and grad norms of full recompute under compile).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .attention import is_flash, varlen_kwargs
from .context import CPContext
from .segments import Segments, tree_masks

# what selective recompute keeps: the matmuls and every attention kernel this torch has (aten.linear reaches
# the dispatcher as mm / addmm; it is listed for a backend that keeps it whole)
_SAVED_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS = frozenset(getattr(torch.ops.aten, name) for name in _SAVED_NAMES if hasattr(torch.ops.aten, name))


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the output of a matmul or attention kernel (SAVED_OPS), recompute every other op. An overload that
    writes into a tensor it is given (out=, in place) is recomputed: a kept result would not write it."""
    packet = getattr(op, "overloadpacket", None)
    if packet in SAVED_OPS and not op._schema.is_mutable:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


@contextlib.contextmanager
def _entered(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _composed(*context_fns):
    """One checkpoint `context_fn` from several: the forward contexts entered together, the recompute ones
    together."""

    def context_fn():
        pairs = [fn() for fn in context_fns]
        return _entered(*(forward for forward, _ in pairs)), _entered(*(again for _, again in pairs))

    return context_fn


class StageModule(nn.Module):
    def __init__(
        self,
        hf_model: nn.Module,
        layer_ids: list[int],
        *,
        first: bool,
        last: bool,
        stage_index: int,
        recompute: list[str] | None = None,
        cp: CPContext | None = None,
        dropout_rng=None,
        activation_offload: bool = False,
    ):
        super().__init__()
        base = hf_model.model
        self.config = hf_model.config
        self.stage_index, self.layer_ids = stage_index, list(layer_ids)
        self.first, self.last = first, last
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleList([base.layers[str(i)] for i in layer_ids])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = hf_model.lm_head if last else None
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        self.layer_types = [types[i] for i in layer_ids]
        # each layer's recompute: "none", "full" or "selective" (ParallelConfig.recompute_kind)
        self.recompute = list(recompute) if recompute is not None else ["none"] * len(self.layers)
        assert len(self.recompute) == len(self.layers) and set(self.recompute) <= {"none", "full", "selective"}
        self.cp = cp if cp is not None and cp.active else None
        self.dropout_rng = dropout_rng  # when the layers draw dropout masks: recompute replays them
        self.activation_offload = activation_offload  # ParallelConfig.activation_offload

    def forward(self, x: torch.Tensor, *chain: torch.Tensor, position_ids: torch.Tensor, carry=None, **options):
        """`run(x, position_ids, **options)`. Under a pipeline schedule (hf3d/parallel/pipeline.py) the stage is the
        schedule's module itself, so that FSDP2's root is what the schedule runs: `chain` then holds the router
        statistics of a MoE model's load-balancing loss that travel with the activations, and `carry` the
        RouterStats that continues them, and the stage returns (its output, the statistics)."""
        if carry is None:
            return self.run(x, position_ids, **options)
        carry.start(chain[0] if chain else None, x.device)
        out = self.run(x, position_ids, **options)
        return out, carry.stop().clone()  # a node of this stage's own, even with no MoE layer here

    def run(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        head: bool = True,
        segments: Segments | None = None,
        decode=None,
    ) -> torch.Tensor:
        """x: token ids [b, s] (first stage) or hidden states [b, s(/tp under SP), h].

        Returns hidden states, or [b, s, V/tp] logits on the last stage; head=False stops the last
        stage after its final norm (the caller runs the lm_head itself). Under cp, s is this rank's
        S/cp tokens and position_ids are the FULL [b, S] ones (the masks need every token's).
        segments: rows whose units share a context (hf3d.parallel.segments; scoring), over the full rows.
        decode: a step of KV-cached decoding (hf3d.generation): `decode.cache` goes to the layers and
        `decode.masks(stage, probe, position_ids)` builds their masks, whole rows on every cp rank; unless
        `decode.split_over_cp` (a prefill), which runs this rank's cp share under the cp masks.
        With `activation_offload` on CUDA, the tensors the forward saves for backward wait in host memory."""
        offload = self.activation_offload and torch.is_grad_enabled() and x.device.type == "cuda"
        with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext():
            return self._run(x, position_ids, head, segments, decode)

    def _run(self, x, position_ids, head, segments, decode) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.first else x
        cp = self.cp if decode is None or decode.split_over_cp else None
        full_positions = position_ids
        if cp is not None:
            position_ids = cp.local_positions(position_ids)
        b, s = position_ids.shape
        shape_probe = hidden.new_empty((b, s, 1))  # the mask builders read batch, seq, dtype, device
        if decode is not None and cp is None:
            masks = decode.masks(self, shape_probe, position_ids)
        elif cp is not None:
            masks = {kind: cp.masks(self.config, kind, full_positions, hidden.dtype, segments) for kind in self.kinds}
        elif segments is not None:
            masks = tree_masks(self.config, self.kinds, position_ids, segments, hidden.dtype)
        else:
            masks = {kind: self._packed_mask(kind, shape_probe, position_ids) for kind in self.kinds}
        position_embeddings = self.rotary_emb(shape_probe, position_ids=position_ids)
        # flash builds no mask (masks are None): the documents reach the kernel as varlen boundaries
        packed = is_flash(self.config._attn_implementation) and decode is None
        extra = varlen_kwargs(position_ids) if packed else {}
        if decode is not None:
            extra["cache"] = decode.cache
        for layer, kind, again in zip(self.layers, self.layer_types, self.recompute):
            kwargs = dict(attention_mask=masks[kind], position_ids=position_ids, **extra)
            kwargs["position_embeddings"] = position_embeddings
            if again != "none" and torch.is_grad_enabled():
                context_fn = self._context_fn(layer, again)
                hidden = checkpoint(layer, hidden, use_reentrant=False, context_fn=context_fn, **kwargs)
            else:
                hidden = layer(hidden, **kwargs)
        if self.last:
            hidden = self.norm(hidden)
            return self.lm_head(hidden) if head else hidden
        return hidden

    def _context_fn(self, layer: nn.Module, recompute: str):
        """The checkpoint's `context_fn` for `layer`: selective recompute's policy, and the replay of the first
        forward's dropout masks when the layer draws them; both together when both apply."""
        fns = [_selective_contexts] if recompute == "selective" else []
        if self.dropout_rng is not None and layer.training:
            fns.append(self.dropout_rng.recompute_context)
        return _composed(*fns) if fns else noop_context_fn

    @property
    def kinds(self) -> set[str]:
        """The attention kinds of this stage's layers (full_attention, sliding_attention)."""
        return set(self.layer_types)

    def _packed_mask(self, kind: str, shape_probe: torch.Tensor, position_ids: torch.Tensor):
        """Stock's mask for a layer of `kind`: causal (or the sliding window), documents apart where the
        position ids restart."""
        build = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        return build(
            config=self.config, inputs_embeds=shape_probe, attention_mask=None, cache=None, position_ids=position_ids
        )


def layer_costs(config, mlp_costs: list[float] | None = None) -> tuple[float, list[float], float]:
    """The parameters a token meets as the balance measure: (embedding, each layer, lm_head).

    mlp_costs: each layer's MLP cost when the layers differ (a MoE family's adapter gives the router, the
    top-k experts a token runs through and a shared expert); default a dense SwiGLU MLP in every layer."""
    h, inter = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = mlp_costs if mlp_costs is not None else [3.0 * h * inter] * config.num_hidden_layers
    vocab = h * config.vocab_size
    return float(vocab), [float(attn + c) for c in mlp], float(vocab)


def split_layers(num_stages: int, embed_cost: float, costs: list[float], head_cost: float) -> list[list[int]]:
    """Contiguous layer ranges, one per stage, each non-empty, minimising the most loaded stage
    (embedding counted on the first, lm_head on the last)."""
    n = len(costs)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} pipeline stages for a model with {n} decoder layers: each stage needs at least "
            f"one layer; lower pp (or virtual_stages) to at most {n} stages in all"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(stage: int, i: int, j: int) -> float:
        extra = (embed_cost if stage == 0 else 0.0) + (head_cost if stage == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: smallest max-load placing layers [0, j) on stages [0, s)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], load(s - 1, i, j))
                if value < best[s][j] - 1e-9:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        bounds.append(list(range(i, j)))
        j = i
    return bounds[::-1]


def stage_ranks(num_stages: int, pp: int, schedule: str) -> list[int]:
    """Which pipeline rank runs each stage: round robin, or a V for zbv / dualpipev."""
    if schedule in ("zbv", "dualpipev"):
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]
