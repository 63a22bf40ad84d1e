"""SmolLM3: Llama-shaped (GQA, tied embeddings), but the layers whose `config.no_rope_layers` entry is 0
skip RoPE (NoPE) and, with `use_sliding_window`, the `layer_types` marked sliding attend over a window.

Both are read off each stock attention module (`use_rope`, `sliding_window`) by the shared TPAttention,
and the stage builds one mask per layer type, so nothing here overrides the shared rewrite."""

from .common import DecoderAdapter


class SmolLM3Adapter(DecoderAdapter):
    model_types = ("smollm3",)
