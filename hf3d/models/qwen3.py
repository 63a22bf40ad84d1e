"""Qwen3: per-head q_norm / k_norm before RoPE (the stock modules, kept; their gradients are summed
over tp since each rank sees only its heads); heads * head_dim may differ from hidden_size."""

from .common import DecoderAdapter


class Qwen3Adapter(DecoderAdapter):
    model_types = ("qwen3",)
