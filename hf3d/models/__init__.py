"""One adapter per model family; everything outside this package is model-agnostic."""

from .common import DecoderAdapter, TPContext
from .llama import LlamaAdapter
from .moe import EPContext, MoEAdapter
from .qwen2 import Qwen2Adapter
from .qwen2_moe import Qwen2MoeAdapter
from .qwen3 import Qwen3Adapter
from .qwen3_moe import Qwen3MoeAdapter
from .smollm3 import SmolLM3Adapter

FAMILIES = (LlamaAdapter, Qwen2Adapter, Qwen3Adapter, SmolLM3Adapter, Qwen3MoeAdapter, Qwen2MoeAdapter)
ADAPTERS: dict[str, type[DecoderAdapter]] = {t: cls for cls in FAMILIES for t in cls.model_types}


# mixture-of-experts families of transformers whose router is not stock Qwen's softmax top-k (hf3d/models/moe.py)
OTHER_ROUTERS = {
    "mixtral": "top-k of the logits, then a softmax over the k",
    "qwen3_next": "Qwen3-Next's, beside its linear-attention layers",
    "deepseek_v3": "grouped top-k with a sigmoid score and a correction bias",
    "olmoe": "softmax top-k without renormalisation, with its own q/k norms",
    "gpt_oss": "top-k of the logits with biases, then a softmax over the k",
}


def get_adapter(model_type: str) -> DecoderAdapter:
    if model_type in OTHER_ROUTERS:
        moe = sorted(t for t, cls in ADAPTERS.items() if issubclass(cls, MoEAdapter))
        raise ValueError(
            f"model_type {model_type!r} is a mixture-of-experts family whose router hf3d does not implement "
            f"({OTHER_ROUTERS[model_type]}); hf3d trains the MoE families {', '.join(moe)}"
        )
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported by hf3d; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]()


__all__ = ["ADAPTERS", "DecoderAdapter", "EPContext", "TPContext", "get_adapter"]
