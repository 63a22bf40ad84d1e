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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .attention import is_flash, varlen_kwargs
from .context import CPContext
from .segments import Segments, tree_masks


class StageModule(nn.Module):
    def __init__(
        self,
        hf_model: nn.Module,
        layer_ids: list[int],
        *,
        first: bool,
        last: bool,
        stage_index: int,
        recompute: list[bool] | None = None,
        cp: CPContext | None = None,
        dropout_rng=None,
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
        self.recompute = list(recompute) if recompute is not None else [False] * len(self.layers)
        assert len(self.recompute) == len(self.layers)
        self.cp = cp if cp is not None and cp.active else None
        self.dropout_rng = dropout_rng  # when the layers draw dropout masks: recompute replays them

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
        `decode.split_over_cp` (a prefill), which runs this rank's cp share under the cp masks."""
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
            if again and torch.is_grad_enabled():
                if self.dropout_rng is not None and layer.training:
                    kwargs["context_fn"] = self.dropout_rng.recompute_context
                hidden = checkpoint(layer, hidden, use_reentrant=False, **kwargs)
            else:
                hidden = layer(hidden, **kwargs)
        if self.last:
            hidden = self.norm(hidden)
            return self.lm_head(hidden) if head else hidden
        return hidden

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
