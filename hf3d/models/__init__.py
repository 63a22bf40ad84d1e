"""One adapter per model family; everything outside this package is model-agnostic."""

from .common import DecoderAdapter, TPContext
from .llama import LlamaAdapter
from .qwen2 import Qwen2Adapter
from .qwen3 import Qwen3Adapter
from .smollm3 import SmolLM3Adapter

ADAPTERS: dict[str, type[DecoderAdapter]] = {
    t: cls for cls in (LlamaAdapter, Qwen2Adapter, Qwen3Adapter, SmolLM3Adapter) for t in cls.model_types
}


def get_adapter(model_type: str) -> DecoderAdapter:
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported by hf3d; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]()


__all__ = ["ADAPTERS", "DecoderAdapter", "TPContext", "get_adapter"]
