"""From-scratch initialisation, sharded: stock `from_config` values, one full tensor at a time.

Goal: `parallelize(config_only_dir, pcfg, seed=s)` holds exactly the weights of
`torch.manual_seed(s); AutoModelForCausalLM.from_config(config, dtype=torch.float32)`, bit for
bit, at every mesh, while no rank ever holds more than its own share plus one full tensor.

How stock draws (transformers 5): construction draws first, because torch's own leaf modules
run `reset_parameters()` in `__init__` (nn.Linear: kaiming-uniform weight and bias, nn.Embedding:
normal); at the end of each PreTrainedModel's `__init__`, `post_init` walks its subtree children
first (`smart_apply`, each nested PreTrainedModel with its own `_init_weights`) and calls
`_init_weights` once per module (normal for Linear/Embedding plus a zeroed padding row, zeros
for biases, ones for norms). So LlamaModel is built and initialised before `lm_head` is even
built; a tied `lm_head` is drawn twice too, and only then tied to the embedding.

`InitSource` replays that walk on a meta skeleton of the stock class. Each module's own tensors
are made real for just that module, drawn by the stock code itself (`reset_parameters`,
`_init_weights`) from a private copy of the CPU generator seeded like `torch.manual_seed`
(the caller's global RNG is left alone), sliced to what this rank needs, and dropped.
Construction draws are only replayed to advance the stream: each parameter's value must be fully
written by `_init_weights` (checked: tensors start as NaN). The walk is lazy, driven by `get`,
so a rank that loads in stock order keeps at most a few slices ahead, and it stops at the
last tensor this rank needs (a tied lm_head's draws are never made).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from .layout import Piece

# HF's weight file names; not *.pt: an hf3d training checkpoint (DCP + rng_<rank>.pt) has a
# config.json too, and `hf3d train` starts from one by initialising and then loading it. An index claims weights:
# the ones it names are read (hf3d/hf/load.py `weights_files`) or refused, never silently initialised
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "tf_model*.h5",
    "flax_model*.msgpack",
    "model.ckpt*",
    "*.gguf",
)


def has_weights(model_dir: Path) -> bool:
    """Whether an HF directory holds weights of any format (only safetensors can be read)."""
    return any(any(Path(model_dir).glob(p)) for p in WEIGHT_PATTERNS)


class InitSource:
    """`get(name, dim, start, stop)` like `SafetensorsSource`, over a seeded stock initialisation.

    pieces: every slice this rank will ask for; the rest is drawn and dropped. Values are fp32
    whatever `config.dtype` says (stock `from_config(config, dtype=torch.float32)`); the caller casts.
    """

    def __init__(self, config, *, seed: int, pieces: Iterable[Piece]):
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        self._wanted: dict[str, set[tuple[int, int, int]]] = {}
        for p in pieces:
            self._wanted.setdefault(p.hf_name, set()).add((p.dim, p.hf_start, p.hf_stop))
        self._ready: dict[tuple[str, int, int, int], torch.Tensor] = {}
        gen = torch.Generator()
        gen.manual_seed(seed)
        self._rng_state = gen.get_state()
        self._stream = self._stock_order(skeleton)

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        key = (name, dim, start, stop)
        while key not in self._ready:
            hf_name, full = next(self._stream, (None, None))
            assert hf_name is not None, f"{name} was not announced in pieces, or is not a stock parameter"
            for d, s, e in self._wanted.pop(hf_name, ()):
                whole = s == 0 and e == full.shape[d]
                self._ready[(hf_name, d, s, e)] = full if whole else full.narrow(d, s, e - s).clone()
            if not self._wanted:  # all drawn: free the walk's last tensor now, not at garbage collection
                self._stream.close()
        return self._ready.pop(key)

    def _stock_order(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full fp32 value) in the order stock initialises them, until none is wanted."""
        names = {id(m): prefix for prefix, m in model.named_modules()}
        done: set[int] = set()
        for module, tensors in self._replay(model, done):
            for pname, t in tensors.items():
                name = f"{names[id(module)]}.{pname}".lstrip(".")
                if t.sum().isnan():  # NaN in, NaN out; no full-size temporary
                    raise ValueError(
                        f"hf3d cannot initialise {name} from scratch: the stock _init_weights of "
                        f"{type(model).__name__} leaves it (partly) unset. Save the model with "
                        "save_pretrained and point at that directory instead"
                    )
                yield name, t

    def _replay(self, module: nn.Module, done: set[int]) -> Iterator[tuple[nn.Module, dict[str, torch.Tensor]]]:
        """Mirror `module.__init__`: children are built in order, a torch leaf module draws in
        `reset_parameters`, a PreTrainedModel ends with post_init's pass over its subtree."""
        for child in module.children():
            yield from self._replay(child, done)
        if type(module).__module__.startswith("torch.nn.") and hasattr(module, "reset_parameters"):
            with _real(module, fill=None), self._rng(), torch.no_grad():
                module.reset_parameters()
        if isinstance(module, PreTrainedModel):
            for sub, owner in _children_first(module, module):
                if id(sub) in done:  # stock: `_is_hf_initialized`, set by a nested post_init
                    continue
                done.add(id(sub))
                with _real(sub, fill=math.nan) as tensors:
                    with self._rng(), torch.no_grad():
                        owner._init_weights(sub)
                    yield sub, tensors

    @contextmanager
    def _rng(self):
        """Draw from this source's own generator state through the global CPU generator, which
        the stock init code uses; the caller's global state is restored afterwards."""
        saved = torch.get_rng_state()
        torch.set_rng_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = torch.get_rng_state()
            torch.set_rng_state(saved)


def _children_first(module: nn.Module, owner: PreTrainedModel) -> Iterator[tuple[nn.Module, PreTrainedModel]]:
    """Stock `smart_apply` order: children first, each nested PreTrainedModel with its own init."""
    for child in module.children():
        yield from _children_first(child, child if isinstance(child, PreTrainedModel) else owner)
    yield module, owner


@contextmanager
def _real(module: nn.Module, *, fill: float | None):
    """This module's own parameters and buffers as real CPU tensors (the skeleton's dtype, fp32),
    only for the block; yields the parameters (detached) by their local name."""
    saved_p, saved_b = dict(module._parameters), dict(module._buffers)

    def real(t: torch.Tensor) -> torch.Tensor:
        if fill is None or not t.is_floating_point():
            return torch.empty(t.shape, dtype=t.dtype)
        return torch.full(t.shape, fill, dtype=t.dtype)

    try:
        for n, p in saved_p.items():
            if p is not None:
                module._parameters[n] = nn.Parameter(real(p), requires_grad=False)
        for n, b in saved_b.items():
            if b is not None:
                module._buffers[n] = real(b)
        yield {n: p.detach() for n, p in module._parameters.items() if p is not None}
    finally:
        module._parameters.update(saved_p)
        module._buffers.update(saved_b)
