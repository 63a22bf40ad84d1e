"""Regional compile: each decoder layer through torch.compile, in place (`ParallelConfig.compile`).

Why per layer, as torchtitan does: the decoder layers are where the time goes and they are all alike,
so dynamo traces one layer's forward (and, through AOTAutograd, its backward) and every other layer of
the same shape reuses that graph with its own parameters as inputs; a whole-model compile would trace
the pipeline schedule, the embedding and the loss too, and recompile with every stage split. The layer
is compiled with `nn.Module.compile`, which keeps the module object, its stock name and its Parameters
(their hf3d layout pieces included), so checkpoints, the optimizer, recompute and the pipeline see the
same model with or without compile. Whatever the layer holds is compiled with it: hf3d's tensor-parallel
modules and their autograd functions, a MoE block, an FP8 linear.

What dynamo sees in an hf3d layer (torch 2.13, measured with torch._dynamo.explain and the graph-break
counter; tests/test_compile.py asserts these counts):
- the tensor-parallel collectives (torch.autograd.Function around dist.all_reduce / all_gather_single /
  reduce_scatter_single on a ProcessGroup) trace into the graph, forward and backward: no break;
- hf3d's own autograd functions (RMSNorm, rotary, SwiGLU) trace whole: no break. SwiGLU's backward
  writes the two halves of its gradient into one buffer through out= in eager; dynamo refuses out= into
  a strided view (a break that sent the whole MLP back to eager), so under compile it concatenates
  instead (hf3d/models/common.py) and inductor fuses that;
- a dense Llama / Qwen2 / Qwen3 layer is then ONE graph with no break, at any tp, with or without
  sequence parallelism, recompute or pipelining (recompute wraps the compiled layer from outside:
  torch.utils.checkpoint runs the compiled forward again in backward).
Layers whose attributes differ (SmolLM3's NoPE and sliding-window layers) get a graph each. A MoE block
(hf3d/models/moe.py) runs eager inside its compiled layer, one break per MoE layer: its rows per expert are
data-dependent (15 breaks per layer when traced) and torch 2.13's meta function of torch._grouped_mm takes
only bf16. Attention dropout is refused (check_compile).
"""

from __future__ import annotations

import importlib.util

from torch import nn


def check_compile(device_type: str, model_config=None, key: str = "compile") -> None:
    """Refuse compile where torch.compile cannot run, before any model is built: dynamo unsupported by this
    Python / torch build, or no inductor backend for the device (on CPU a C++ compiler, on CUDA triton).
    Without this, the first training step fails deep inside inductor with a long traceback.

    Also refused: attention dropout (`model_config.attention_dropout` > 0). hf3d draws each rank's masks from
    its own stream by swapping the generator's state around the attention (hf3d/parallel/rng.py); dynamo breaks the
    graph there and inductor then draws the masks from its own generator (measured: grad norms 7% off eager
    in 3 steps), so the per-rank streams and recompute's replay of the masks would not be what they claim."""
    import torch._dynamo

    dropout = float(getattr(model_config, "attention_dropout", 0.0) or 0.0)
    if dropout:
        raise ValueError(
            f"{key}=True cannot run with attention_dropout={dropout:g}: hf3d's per-rank dropout streams are not "
            f"traced by torch.compile; set the model's attention_dropout to 0, or {key} to false"
        )

    if not torch._dynamo.is_dynamo_supported():
        raise ValueError(
            f"{key}=True needs torch.compile, which this Python / torch build does not support; "
            f"set {key} to false (eager runs the same model)"
        )
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                f"{key}=True on CUDA needs triton (inductor's GPU backend), which is not installed: "
                f"pip install triton, or set {key} to false"
            )
        return
    from torch._inductor import config, exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = ", ".join(str(c) for c in config.cpp.cxx if c is not None)
        raise ValueError(
            f"{key}=True on CPU needs a C++ compiler for inductor's CPU backend; none was found (tried: {tried}): "
            f"install g++ or point the CXX environment variable at one, or set {key} to false"
        ) from None


def auto_compiles(device_type: str) -> bool:
    """Whether `compile: auto` compiles on `device_type`, where the compiler can run there (`resolve_compile`
    checks that on this machine; `hf3d plan`, planning for another, takes it as given)."""
    return device_type == "cuda"


def resolve_compile(requested: bool | str, device_type: str, model_config=None) -> tuple[bool, str]:
    """Whether to compile the decoder layers, and why in a few words: `requested` itself unless it is "auto",
    which turns compile on with CUDA where it can run (`check_compile`) and off on a CPU, where eager was as
    fast here (compiled / eager 0.93x a step, with a warm-up of several seconds per layer shape). On an H200,
    compiled layers ran 1.5x eager stock, and flex_attention, which `attn: auto` picks for packed documents on
    CUDA, is meant to run compiled (eager it ran 0.58x sdpa)."""
    if requested != "auto":
        return bool(requested), "on" if requested else "off"
    if not auto_compiles(device_type):
        return False, f"off on {device_type} (auto: on with CUDA)"
    try:
        check_compile(device_type, model_config, key="parallel.compile")
    except ValueError as e:
        return False, f"off: {str(e).replace('=True', ' (auto)')}"
    return True, "on with CUDA (auto)"


def compile_layers(layers: list[nn.Module]) -> None:
    """Compile each decoder layer in place (nn.Module.compile: same object, names and Parameters).

    Not fullgraph: a layer with an unavoidable break (a data-dependent MoE dispatch) still runs, its pieces
    compiled around the break; the test counts the breaks of the dense layers so a new one fails it."""
    for layer in layers:
        layer.compile(backend="inductor")


def compiled(layer: nn.Module) -> bool:
    """Whether `layer` goes through torch.compile (compile_layers)."""
    return getattr(layer, "_compiled_call_impl", None) is not None
