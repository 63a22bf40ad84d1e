"""Activation bytes, measured from the tensors a step makes: what the plan predicts and what a run holds.

An activation is a tensor the forward makes and something keeps until backward: autograd's saved tensors,
recompute's kept inputs and selective recompute's saved outputs, the masks and position embeddings a stage
shares between its layers, a pipeline stage's output held for its backward, the fused head's gradients made
in its forward. `ActivationMeter` is a TorchDispatchMode: it notes every storage an op returns outside
backward that none of the op's inputs had (a view of a weight is not new), and at each turn from forward to
backward, and when it closes, sums the bytes of those still held; the largest sum is the activation peak.
Grad mode does not matter (a custom autograd function makes what it saves with grad off), so meter a
train_step, not the optimizer's step. A storage is held when someone besides the meter holds it (its use
count above the meter's one reference); those only the meter holds are dropped as it goes, so it does not
keep the step's temporaries alive for long.

It works the same on real tensors (a run, `hf3d train`'s first step) and on meta tensors (the plan's
trace, hf3d/plan/trace.py), so the prediction and the measurement count one thing.

Weights are not activations, wherever the step makes them: given the model, the storages of its parameters
(under ZeRO-3, FSDP2's gathered weights, whose buffers its first forward allocates) are not counted. Nor is a
wrapper tensor subclass's own storage (FSDP2's parameter gathered in float8): its inner tensors hold its
bytes, and count where an op makes them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

PRUNE_EVERY = 256  # ops between sweeps of the storages only the meter still holds


def _storage(param: torch.Tensor) -> int | None:
    """The storage of a parameter as ops see it: a sharded DTensor's local tensor; None for a wrapper subclass."""
    param = getattr(param, "_local_tensor", param)
    return None if is_traceable_wrapper_subclass(param) else param.untyped_storage()._cdata


def _held(storage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) > 1


class ActivationMeter(TorchDispatchMode):
    """`with ActivationMeter() as m: <forward and backward>`; then `m.peak` (bytes). `m.live()` at any time."""

    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.peak = 0
        self._in_forward = False
        self._ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        forward = torch._C._current_graph_task_id() == -1  # outside backward (grad mode aside: custom autograd
        # functions make what they save with grad off)
        if self._in_forward and not forward:
            self.peak = max(self.peak, self.live())  # the forward's activations, as backward begins
        self._in_forward = forward
        if forward:
            given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
                    s = t.untyped_storage()
                    if s._cdata not in given:  # a view or an in-place result shares its input's storage
                        self.storages.setdefault(s._cdata, s)
            self._ops += 1
            if self._ops % PRUNE_EVERY == 0:
                self._prune()
        return out

    def _prune(self) -> None:
        self.storages = {k: s for k, s in self.storages.items() if _held(s)}

    def live(self) -> int:
        """Bytes of the storages the forward made that are held now."""
        self._prune()
        weights = set() if self.model is None else {_storage(p) for p in self.model.parameters()}
        return sum(s.nbytes() for k, s in self.storages.items() if k not in weights)

    def __exit__(self, *exc):
        self.peak = max(self.peak, self.live())
        self.storages = {}
        return super().__exit__(*exc)
