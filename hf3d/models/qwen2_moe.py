"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with sparse MoE blocks that add a dense shared expert,
scaled per token by a sigmoid gate."""

from .moe import MoEAdapter


class Qwen2MoeAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)
