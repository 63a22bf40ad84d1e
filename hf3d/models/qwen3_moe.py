"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with sparse MoE blocks (no shared expert); layers in
`mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense MLP."""

from .moe import MoEAdapter


class Qwen3MoeAdapter(MoEAdapter):
    model_types = ("qwen3_moe",)
