"""One comparison for every numeric check of the tests: `assert_close`.

Python's `max` keeps its first value when a NaN is compared (`max(1e-7, nan) == 1e-7`), and `zip` stops at
the shorter side, so `max(rel(a, b) for a, b in zip(got, want)) <= tol` passes a run whose losses turned
NaN after the first step, or a run that stopped early. `assert_close` fails on any non-finite value on
either side, on any difference in length or shape, and on any element above the tolerance, naming the
worst element and its index.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _tensor(x) -> torch.Tensor:
    if torch.is_tensor(x):
        return x.detach().to("cpu", torch.float64)
    return torch.tensor(x, dtype=torch.float64)


def _pairs(got, want, what: str):
    """(label, got, want) per tensor: one pair for numbers, lists and tensors, one per key of `want` for
    dicts (name -> tensor); `got` must hold every key of `want`."""
    if isinstance(want, Mapping):
        missing = sorted(set(want) - set(got))
        assert not missing, f"{what}: missing {missing[:5]}"
        return [(f"{what}[{k!r}]", _tensor(got[k]), _tensor(want[k])) for k in want]
    return [(what, _tensor(got), _tensor(want))]


def assert_close(got, want, *, rtol: float = 0.0, atol: float = 0.0, what: str = "value") -> float:
    """Assert |got - want| <= atol + rtol * |want| element-wise, every value finite on both sides, and the
    same length and shape. got/want: numbers, lists of numbers, tensors, or dicts name -> tensor (checked
    over want's keys). Returns the worst error in the tolerance's own terms: relative when only rtol is
    given, absolute otherwise (for a tolerance comment's "measured" figure)."""
    assert rtol > 0 or atol > 0, "give rtol or atol"
    worst = 0.0
    for label, g, w in _pairs(got, want, what):
        assert g.shape == w.shape, f"{label}: shape {tuple(g.shape)} vs {tuple(w.shape)} (got {g}, want {w})"
        for side, t in (("got", g), ("want", w)):
            bad = (~torch.isfinite(t)).flatten().nonzero()
            if len(bad):
                i = _index(t, int(bad[0]))
                raise AssertionError(f"{_at(label, i)}: {side} is not finite (got {g[i].item()}, want {w[i].item()})")
        if g.numel() == 0:
            continue
        diff = (g - w).abs()
        rel = torch.where(diff == 0, 0.0, diff / w.abs())
        excess = (diff - (atol + rtol * w.abs())).flatten()
        k = int(excess.argmax())
        if excess[k] > 0:
            i = _index(g, k)
            raise AssertionError(
                f"{_at(label, i)}: got {g[i].item()!r}, want {w[i].item()!r}: |Δ| {diff[i].item():.3g} "
                f"(relative {rel[i].item():.3g}) > atol {atol:g} + rtol {rtol:g} * |want|"
            )
        worst = max(worst, float((rel if atol == 0 else diff).max()))
    return worst


def _index(t: torch.Tensor, flat: int) -> tuple[int, ...]:
    """The index of element `flat` of t, as a tuple that indexes t (and prints as (i, j))."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape))


def _at(label: str, i: tuple[int, ...]) -> str:
    return f"{label}[{', '.join(map(str, i))}]" if i else label
