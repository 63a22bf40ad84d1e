"""The precision of the optimizer's per-element state: fp32 (torch's), bf16 moments, or torchao's 8-bit AdamW.

The fp32 master weights stay in every option; only the state the optimizer keeps between steps shrinks:
- "bf16": each state tensor (AdamW's exp_avg and exp_avg_sq, SGD's momentum, Muon's momentum_buffer) is kept in bf16.
  torch's element-wise optimizers compute in their state's dtype and refuse a bf16 state beside an fp32 master, so
  the step runs one master at a time on fp32 copies of its state (its own kernel; the update is torch's) and rounds
  them back to bf16 after it: one fragment's fp32 state is the most held beyond the bf16 state. Muon computes its
  momentum from the gradient's dtype, so it is handed the gradient in bf16 and keeps its momentum there (its
  Newton-Schulz runs in bf16 anyway).
- "8bit": torchao's AdamW8bit (Adam8bit for Adam) over the same fragments: block-wise quantised moments (256
  elements a block), dequantised inside its step. Fragments under 4096 elements keep fp32 state (torchao's rule).

Checkpoints and state dicts hold every state in fp32 under the same keys whatever the option (hf3d/optim/state.py
reads a lower-precision state through an fp32 copy and writes one back through `settle`), so a run resumes under
another option: its state is rounded to the new precision.
"""

from __future__ import annotations

import torch

STATE_PRECISIONS = ("fp32", "bf16", "8bit")
EIGHT_BIT = {"AdamW": "AdamW8bit", "Adam": "Adam8bit"}  # torch's class -> torchao's 8-bit twin


def check(precision: str, optimizer_cls, *, muon: bool) -> None:
    """One line for a precision the optimizer cannot take."""
    if precision not in STATE_PRECISIONS:
        raise ValueError(f"state_precision must be one of {', '.join(STATE_PRECISIONS)}, got {precision!r}")
    if precision == "8bit" and (muon or optimizer_cls.__name__ not in EIGHT_BIT):
        name = "Muon" if muon else optimizer_cls.__name__
        raise ValueError(
            f"state_precision='8bit' is torchao's AdamW8bit / Adam8bit; {name} has no 8-bit state in hf3d: use "
            "'bf16' (or 'fp32')"
        )


def eight_bit_class(optimizer_cls):
    """torchao's 8-bit twin of torch's AdamW or Adam."""
    try:
        import torchao.optim as ao
    except ImportError:
        raise ValueError("state_precision='8bit' needs torchao (pip install torchao)") from None
    return getattr(ao, EIGHT_BIT[optimizer_cls.__name__])


def is_plain_fp32(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.float32


@torch.no_grad()
def step_with_bf16_state(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()` with its per-element state kept in bf16: each master stepped alone on fp32 copies."""
    for group in optimizer.param_groups:
        params = group["params"]
        try:
            for p in params:
                if p.grad is None:
                    continue
                st = optimizer.state[p]
                low = {k: v for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
                st.update({k: v.float() for k, v in low.items()})
                group["params"] = [p]
                optimizer.step()
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        st[k] = low[k].copy_(v) if k in low else v.bfloat16()
        finally:
            group["params"] = params


def nbytes(t: torch.Tensor) -> int:
    """Bytes a state tensor holds: a tensor subclass (torchao's 8-bit state) by its inner tensors."""
    if type(t) is torch.Tensor:
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(nbytes(getattr(t, n)) for n in names)


def new_state(optimizer, like: torch.Tensor, key: str, precision: str) -> torch.Tensor:
    """A zero state tensor for `like` (a master) as the optimizer keeps it, to be filled by a load."""
    if precision == "8bit" and hasattr(optimizer, "_new_buffer"):
        return optimizer._new_buffer(like, key == "exp_avg")  # torchao's own factory: 8-bit above its size rule
    return torch.zeros_like(like, dtype=torch.bfloat16 if precision == "bf16" else like.dtype)


def readable(t: torch.Tensor) -> torch.Tensor:
    """An fp32 view of a state tensor for a checkpoint or a state dict: the tensor itself, or an fp32 copy."""
    if is_plain_fp32(t):
        return t
    return t.dequantize().float() if hasattr(t, "dequantize") else t.float()
