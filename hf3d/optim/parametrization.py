"""Spectral µP: initialisation scales and AdamW learning rates from each HF parameter's fan-in and fan-out.

Why: under standard parametrization (SP: every matrix drawn at the config's `initializer_range`, one lr for
all) the best lr shifts with width and the logits grow with it, so an lr tuned on a narrow proxy does not
carry to the wide model. µP (Yang et al. 2022, "Tensor Programs V", µTransfer) scales init and lr per layer
so that every layer's features move by Θ(1) per step at any width; Yang, Simon and Bernstein (2023, "A
spectral condition for feature learning", arXiv 2310.17813) state it for one matrix W [fan_out, fan_in]:
‖W‖ and ‖ΔW‖ (spectral norms) should be Θ(√(fan_out / fan_in)). Their Parametrization 1 meets it with

    init std σ = Θ(1/√fan_in · min(1, √(fan_out/fan_in)))       lr (SGD) η = Θ(fan_out/fan_in)

and for Adam, whose update of a rank-one gradient is a sign matrix of spectral norm η·√(fan_in·fan_out),
with η = Θ(1/fan_in). hf3d trains with AdamW, so it takes the Adam form.

How hf3d applies it (the rules, written down in docs/mup.md with their sources):
- the user names a base width d0 (the proxy's hidden_size); m = hidden_size / d0. The base model is the
  same model with every width-like dimension divided by m; the rules give the ratio of each quantity to
  the base model's, so at m = 1 µP is SP exactly, and a proxy trained with SP at d0 hands its lr on.
- each dimension of a parameter either grows with width (hidden, heads x head_dim, intermediate sizes,
  per-expert matrices) or is a fixed count (the vocabulary, the number of experts, the shared-expert gate's
  1); the family's adapter says which (`DecoderAdapter.fan_axes`: the only model-specific part). With
  a, b = 1 when fan-in, fan-out grow and 0 when fixed, the Θ-statements above become exponents of m:
      init std × m^(-a/2 + min(0, (b - a)/2))          AdamW lr × m^(-a)
  hidden matrices (1, 1): std × m^-1/2, lr × 1/m; the token embedding (0, 1), a lookup from a one-hot:
  std and lr unchanged; readouts (1, 0), the untied head, MoE routers and the shared-expert gate: std ×
  1/m, lr × 1/m; vectors (norm weights, biases; fan-in 1): unchanged (norms stay ones, biases zeros).
  The min() is taken in the width limit (Θ), where a fixed count against a growing one is 0 or ∞.
- tied embeddings: one tensor is both the embedding and the readout. It keeps the embedding's rule, and
  the readout's extra factor 1/m becomes a gain in front of the head (µTransfer's output multiplier), held
  by the final norm's weight: init ones/m, lr × 1/m. logits = W_E (g ⊙ norm(h)), so a gain on g is a
  gain on the logits, and the model stays a stock HF model (no multiplier outside its weights).
- the output multiplier (`mup_output_multiplier`, µTransfer's output_mult): a gain α on the logits that the
  user tunes on the proxy with the lr. Adam's step does not depend on the gradient's scale, so a gain α on a
  layer's output acts as that layer's weight and lr both times α (up to Adam's eps and the clipping norm;
  weight decay follows the group's lr, as for every µP group). It is carried by the readout's weight like the
  1/m above: the untied head's init and lr × α, or, tied, the final norm's weight at α/m. α = 1 is stock's.
- weight decay: neither paper gives a rule for it; the coefficient stays the user's, and torch's AdamW
  multiplies it by the group's lr, so the per-step decay follows the µP lr.
- the attention scale stays stock's 1/√head_dim: µP's 1/head_dim matters only when head_dim grows with
  width, and a proxy of the same head_dim (width by heads) keeps it constant.

A parameter's rule comes from its HF name and global shape only, so it is the same on every mesh (tp
slices, pp stages, ZeRO-1 fragments, and a resume at another mesh). Init is stock's draw times the init
scale (stock draws every matrix N(0, initializer_range)): applied to from-scratch models only; loaded
weights are kept as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..parallel.config import check_parametrization


@dataclass(frozen=True)
class Rule:
    """What µP does to one HF parameter: stock init times `init_scale`, the optimizer's lr times `lr_scale`."""

    init_scale: float
    lr_scale: float
    fan_axes: tuple[bool, bool]  # (fan-in grows with width, fan-out grows with width)


def exponents(fan_in_grows: bool, fan_out_grows: bool) -> tuple[float, float]:
    """(init std exponent, AdamW lr exponent) of the width multiplier m, from the spectral condition."""
    a, b = int(fan_in_grows), int(fan_out_grows)
    return -a / 2 + min(0.0, (b - a) / 2), float(-a)


@dataclass
class Parametrization:
    """The rules of one model: `rules[hf_name]`; standard parametrization has none (every scale 1)."""

    kind: str = "standard"
    base_width: int | None = None
    width: int | None = None
    rules: dict[str, Rule] = field(default_factory=dict)

    @property
    def multiplier(self) -> float:
        return 1.0 if self.base_width is None else self.width / self.base_width

    def rule(self, hf_name: str) -> Rule:
        return self.rules.get(hf_name, Rule(1.0, 1.0, (False, True)))

    def init_scales(self) -> dict[str, float]:
        """{hf_name: init scale} of the parameters whose stock init µP changes."""
        return {n: r.init_scale for n, r in self.rules.items() if r.init_scale != 1.0}

    def lr_scales(self) -> list[float]:
        """Every distinct lr scale of the model, largest first: the optimizer's groups, the same on every rank."""
        return sorted({r.lr_scale for r in self.rules.values()} | {1.0}, reverse=True)


def model_parametrization(pcfg, config, hf_shapes: Mapping[str, tuple[int, ...]], adapter) -> Parametrization:
    """The rules `pcfg` (an hf3d.ParallelConfig) asks for, for the model its family's adapter describes."""
    return build_parametrization(
        pcfg.parametrization,
        pcfg.mup_base_width,
        config,
        hf_shapes,
        adapter.fan_axes,
        final_norm_name=adapter.final_norm_name,
        head_name=adapter.head_name,
        output_multiplier=pcfg.mup_output_multiplier,
    )


def build_parametrization(
    kind: str,
    base_width: int | None,
    config,
    hf_shapes: Mapping[str, tuple[int, ...]],
    fan_axes: Callable[[str, tuple[int, ...], object], tuple[bool, bool]],
    *,
    final_norm_name: str,
    head_name: str = "lm_head.weight",
    output_multiplier: float = 1.0,
) -> Parametrization:
    """The rules for every HF parameter of the model (`hf_shapes`: global shapes in saved names)."""
    check_parametrization(kind, base_width, output_multiplier)
    if kind == "standard":
        return Parametrization()
    width = config.hidden_size
    if base_width > width:
        raise ValueError(
            f"mup_base_width={base_width} is larger than this model's hidden_size={width}: the base width is the "
            f"narrow proxy's hidden_size; use a value <= {width}"
        )
    m = width / base_width
    rules = {}
    for name, shape in hf_shapes.items():
        axes = fan_axes(name, tuple(shape), config)
        init_exp, lr_exp = exponents(*axes)
        rules[name] = Rule(m**init_exp, m**lr_exp, axes)
    a = float(output_multiplier)  # the proxy's gain on the logits, carried by the readout's weight (docstring)
    if getattr(config, "tie_word_embeddings", False):  # the readout's 1/m as a gain on the logits (docstring)
        rules[final_norm_name] = Rule(a / m, a / m, (False, True))
    elif head_name in rules:
        head = rules[head_name]
        rules[head_name] = Rule(head.init_scale * a, head.lr_scale * a, head.fan_axes)
    return Parametrization(kind, base_width, width, rules)


class ScaledSource:
    """A weight source (`get(name, dim, start, stop)`) whose tensors come out times their init scale."""

    def __init__(self, source, scales: Mapping[str, float]):
        self.source, self.scales = source, dict(scales)

    def get(self, name: str, dim: int, start: int, stop: int):
        t = self.source.get(name, dim, start, stop)
        scale = self.scales.get(name)
        return t if scale is None else t * scale
