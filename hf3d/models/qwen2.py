"""Qwen2 / Qwen2.5: q/k/v carry a bias, o_proj does not (read off the stock modules); sliding-window
layers keep HF's per-layer mask."""

from .common import DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    model_types = ("qwen2",)
