"""Llama and SmolLM / SmolLM2 (GQA, optional attention and MLP biases)."""

from .common import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    model_types = ("llama",)
