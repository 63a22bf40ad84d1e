"""FP8 training of the tensor-parallel linears with torchao's float8 casts and scaled matmuls.

`parallelize(..., fp8="tensorwise" | "rowwise")` gives each decoder-layer ColumnParallelLinear and
RowParallelLinear an `Fp8Linear`. Its matmuls are torchao's (`torchao.float8`: Float8TrainingTensor, its
casts and its `torch._scaled_mm` dispatch, or the emulated matmul); what hf3d adds is where the scales come
from, so that they are those torchao computes on the stock, unfused, unsharded layers:

- Each stock projection keeps its own scales. A fused runtime weight (q|k|v, gate|up) is cut back into its
  stock pieces (hf3d.parallel.layout) and every piece runs its own float8 matmul: q, k and v each take their own
  amax, as three stock Float8Linears do. The input of the three is the same tensor, so its scale is too.
- A scale is global where torchao's is. A cast whose amax runs over a dim this rank holds only part of
  (the output dim of a column-parallel weight and of its output gradient; the input dim of a row-parallel
  weight and of its input; the tokens under context parallelism) all-reduces that amax with MAX over the
  group that splits the dim, as torchao's amax over a sharded DTensor does. Under tensorwise scaling every
  cast of a split tensor reduces; under rowwise scaling only the casts whose rows run along the split dim.
- Scales follow the tokens of one forward: each micro-batch casts its own activations and gradients, so a
  step of m micro-batches equals torchao's model run on the same m micro-batches with gradient accumulation.

What stays in high precision: the output head (not a tensor-parallel linear; its logits feed the loss),
the embedding, norms, a MoE layer's router and its experts (grouped matmuls), every stock projection whose
dims are not multiples of 16 (torch._scaled_mm's rule), the ones `keep` names, and, with `auto_filter`,
the ones torchao's size rule for the recipe leaves out (`_auto_filter_for_recipe`, as torchtitan uses it).
Parameters, ZeRO-1 master weights, gradients, checkpoints and exports never hold an fp8 tensor: a run can
switch FP8 on or off at a resume. Under ZeRO-3, FSDP2 gathers a weight whose projections all train in FP8 under
the tensorwise recipe as those projections' float8 values and scales (hf3d/parallel/fp8_gather.py), which
`_Float8GatheredMatmul` reads; FP8 all-gather of ZeRO-1 parameters is not built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .fp8_gather import Fp8Gathered
from .layout import get_pieces
from .tensor import ColumnParallelLinear, RowParallelLinear

RECIPES = ("off", "tensorwise", "rowwise")
SCALED_MM_MULTIPLE = 16  # torch._scaled_mm wants both dims of each operand divisible by this


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(
            "fp8 training needs torchao (pip install 'hf3d[fp8]', or pip install torchao>=0.18); "
            f"importing it failed: {e}"
        ) from None
    return float8


def speed_note(recipe: str, *, device_type: str, compiled: bool, hidden_size: int) -> str | None:
    """One line where `recipe` ran slower than bf16 in this project's measurements, for the run's start; None
    where it did not (or it was not measured). Measured on one H200 (torch 2.11, step time against bf16's at the
    same compile setting): eager FP8 1.9-2.2x bf16's step at SmolLM2-1.7B's width; compiled at hidden 2048,
    tensorwise 1.10x bf16's speed and rowwise 0.93x, at hidden 960 rowwise 0.58x. On a CPU fp8 matmuls have no
    tensor cores (2.7-3.1x bf16's step on the embedded default run)."""
    if recipe == "off":
        return None
    if device_type != "cuda":
        return (
            f"precision.fp8={recipe} on {device_type} is slower than bf16 (no fp8 tensor cores: 2.7-3.1x bf16's "
            "step in this project's CPU runs); use it here to check numbers, not for speed"
        )
    if not compiled:
        return (
            f"precision.fp8={recipe} without compiled layers took 1.9-2.2x bf16's step on an H200 (torchao's "
            "casts run as kernels of their own): set parallel.compile: true, or leave it to auto"
        )
    if recipe == "rowwise" and hidden_size <= 2048:
        return (
            f"precision.fp8=rowwise ran slower than bf16 at this width (hidden {hidden_size}) on an H200: 0.58x "
            "bf16's speed at hidden 960, 0.93x at 2048, where tensorwise ran 1.10x: use tensorwise"
        )
    return None


@dataclass
class FP8Config:
    """Which linears train in FP8, and with which torchao recipe."""

    recipe: str = "off"
    """"off", "tensorwise" (one scale per tensor; torchao's default recipe) or "rowwise" (one scale per row,
    powers of two; torchao's ROWWISE recipe)."""
    keep: list[str] = field(default_factory=list)
    """Stock module names to keep in high precision: a projection whose name contains one of these strings
    (e.g. "mlp.down_proj", "layers.0.") stays in the parameter dtype, like torchtitan's filter_fqns."""
    auto_filter: bool = False
    """Also keep the projections torchao's size rule for the recipe expects to run slower in FP8 (on H100):
    tensorwise keeps K <= 4096 and N <= 1024; rowwise keeps N <= 2048, K <= 1024, or N <= 4096 and K <= 2048."""
    emulate: bool = False
    """torchao's emulated matmul (fp8 values, high-precision matmul) instead of torch._scaled_mm."""
    all_gather: bool = True
    """Under ZeRO-3 and the tensorwise recipe, FSDP2 gathers the weights whose projections all train in FP8 as
    float8 values and scales (hf3d/parallel/fp8_gather.py); False gathers them in the compute dtype."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if isinstance(self.keep, str) or not all(isinstance(k, str) and k for k in self.keep):
            raise ValueError(f"fp8 keep must be a list of module-name substrings, got {self.keep!r}")
        self.keep = list(self.keep)
        if not isinstance(self.all_gather, bool):
            raise ValueError(f"fp8 all_gather must be true or false, got {self.all_gather!r}")
        if self.enabled and importlib.util.find_spec("torchao") is None:
            raise ValueError(
                f"fp8 {self.recipe!r} needs torchao, which is not installed: pip install 'hf3d[fp8]' "
                "(or torchao>=0.18), or set fp8 off"
            )

    @property
    def enabled(self) -> bool:
        return self.recipe != "off"

    def converts(self, fqn: str, shape: tuple[int, ...]) -> bool:
        """Whether the stock projection `fqn` with weight `shape` ([out, in]) trains in FP8."""
        if not self.enabled or fqn.split(".")[-1] == "lm_head" or any(k in fqn for k in self.keep):
            return False
        if len(shape) != 2 or any(d % SCALED_MM_MULTIPLE for d in shape):
            return False
        if self.auto_filter:
            probe = nn.Linear(shape[1], shape[0], bias=False, device="meta")
            return _torchao_float8().float8_linear_utils._auto_filter_for_recipe(self.recipe, [])(probe, fqn)
        return True

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """The same rule for torchao's `convert_to_float8_training(stock_model, module_filter_fn=...)`."""
        return isinstance(module, nn.Linear) and self.converts(fqn, tuple(module.weight.shape))

    def torchao_config(self):
        float8 = _torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(config, emulate=True) if self.emulate else config


def as_fp8_config(fp8) -> FP8Config:
    """parallelize's `fp8` argument: None, a recipe name, a dict of FP8Config fields or an FP8Config."""
    if fp8 is None or fp8 is False:
        return FP8Config()
    if isinstance(fp8, FP8Config):
        return fp8
    if isinstance(fp8, str):
        return FP8Config(recipe=fp8)
    if isinstance(fp8, dict):
        known = [f.name for f in dataclasses.fields(FP8Config)]
        unknown = set(fp8) - set(known)
        if unknown:
            raise ValueError(f"unknown fp8 setting(s) {sorted(unknown)}; known: {', '.join(known)}")
        return FP8Config(**fp8)
    raise TypeError(f"fp8 must be None, a recipe name, a dict or an hf3d.FP8Config, got {type(fp8).__name__}")


@dataclass(frozen=True)
class _Split:
    """The dims of one matmul's operands that ranks hold only part of, and the groups that split them.

    Dims are 0 or -1 of the 2-D operands torchao's matmul sees: input [tokens, in], weight_t [in, out],
    grad_output [tokens, out] (an input of [batch, seq, in] has its tokens in dims 0 and 1, its -1 the same)."""

    input: tuple[tuple[int, dist.ProcessGroup], ...] = ()
    weight_t: tuple[tuple[int, dist.ProcessGroup], ...] = ()
    grad_output: tuple[tuple[int, dist.ProcessGroup], ...] = ()


def _cast(hp: torch.Tensor, cast_config, *, role, dim: int, split, config, mm_config):
    """torchao's dynamic cast of `hp` (hp_tensor_to_float8_dynamic), its amax reduced over every group that
    splits a dim the amax runs over. dim: the dim torchao scales across under axiswise scaling."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    if cast_config.scaling_type is ScalingType.DISABLED:
        return hp
    granularity = cast_config.scaling_granularity
    axis = get_maybe_axiswise_dim(dim, granularity)
    amax = tensor_to_amax(hp, scaling_granularity=granularity, axiswise_dim=axis)
    for split_dim, group in split:
        if granularity is ScalingGranularity.TENSORWISE or split_dim == dim:
            amax = amax.contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax_to_scale(amax, cast_config.target_dtype, config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(hp, scale, cast_config.target_dtype, mm_config, role, axis)


class _Float8Matmul(torch.autograd.Function):
    """input @ weight_t in float8, as torchao's matmul_with_hp_or_float8_args computes it from high-precision
    arguments (same six casts, same three matmuls), with the amaxes of split dims reduced (`_Split`)."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp_t, config, mm_config, split: _Split):
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(input_hp, weight_hp_t)
        ctx.config, ctx.mm_config, ctx.split = config, mm_config, split
        common = dict(config=config, mm_config=mm_config)
        input_fp8 = _cast(
            input_hp, config.cast_config_input, role=GemmInputRole.INPUT, dim=-1, split=split.input, **common
        )
        weight_fp8_t = _cast(
            weight_hp_t, config.cast_config_weight, role=GemmInputRole.WEIGHT, dim=0, split=split.weight_t, **common
        )
        shape = input_fp8.shape
        out = torch.mm(input_fp8.reshape(-1, shape[-1]), weight_fp8_t)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.float8_training_tensor import GemmInputRole

        input_hp, weight_hp_t = ctx.saved_tensors
        config, split = ctx.config, ctx.split
        cast = functools.partial(_cast, config=config, mm_config=ctx.mm_config)
        weight_cols = cast(
            weight_hp_t,
            config.cast_config_weight_for_grad_input,
            role=GemmInputRole.WEIGHT,
            dim=-1,
            split=split.weight_t,
        )
        grad_input, grad_weight = _grads(grad_output, input_hp, [weight_cols.t()], config, split, cast)
        return grad_input, grad_weight.t(), None, None, None


def _grads(grad_output, input_hp, weights: list, config, split: _Split, cast) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of `input @ cat(weights).t()` in float8 from the weights already cast ([out_i, in] each, one
    per stock projection): (grad_input, grad_weight [out, in]). Each projection's output gradient is cast on its
    own (rows for grad_input, columns for grad_weight); the per-projection input gradients are summed in autograd's
    order (last first)."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    role = GemmInputRole.GRAD_OUTPUT
    out_shape = grad_output.shape
    grad_output_2d = grad_output.reshape(-1, out_shape[-1])  # [tokens, out]
    input_2d = input_hp.reshape(-1, input_hp.shape[-1])  # [tokens, in]
    input_cols = cast(
        input_2d, config.cast_config_input_for_grad_weight, role=GemmInputRole.INPUT, dim=0, split=split.input
    )
    widths = [w.shape[0] for w in weights]
    grad_input, grad_weight = None, []
    for weight_fp8, go in reversed(list(zip(weights, grad_output_2d.split(widths, dim=-1)))):
        go_rows = cast(go, config.cast_config_grad_output, role=role, dim=-1, split=split.grad_output)
        part = torch.mm(go_rows, weight_fp8)
        grad_input = part if grad_input is None else grad_input + part
        go_cols = cast(go, config.cast_config_grad_output_for_grad_weight, role=role, dim=0, split=split.grad_output)
        grad_weight.insert(0, torch.mm(go_cols.t(), input_cols))  # [out_i, in]
    grad_weight = torch.cat(grad_weight, dim=0) if len(grad_weight) > 1 else grad_weight[0]
    return grad_input.reshape(*out_shape[:-1], input_hp.shape[-1]), grad_weight


class _Float8GatheredMatmul(torch.autograd.Function):
    """input @ weight.t() for a weight FSDP2 gathered in float8 (fp8_gather.Fp8Gathered), each stock projection
    with its own scale: `_Float8Matmul`'s casts and matmuls per projection, where the weight's two casts
    (forward, grad_input) are that one copy, as under the tensorwise recipe they are the same cast. The float8
    rows are saved for the backward as tensors (FSDP2 refills them when it gathers the layer again), not as the
    parameter, which AOTAutograd would take apart into its inner tensors."""

    @staticmethod
    def forward(ctx, input_hp, weight: Fp8Gathered, linear: Fp8Linear):
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(input_hp, weight._data, weight._scales)
        ctx.linear, ctx.dtype = linear, weight.dtype
        cast = functools.partial(_cast, config=linear.config, mm_config=linear.mm_config)
        input_fp8 = cast(
            input_hp, linear.config.cast_config_input, role=GemmInputRole.INPUT, dim=-1, split=linear.split.input
        )
        shape = input_fp8.shape
        input_2d = input_fp8.reshape(-1, shape[-1])
        outs = [torch.mm(input_2d, w.t()) for w in _gathered_pieces(weight._data, weight._scales, weight.dtype, linear)]
        out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, data, scales = ctx.saved_tensors
        linear = ctx.linear
        cast = functools.partial(_cast, config=linear.config, mm_config=linear.mm_config)
        weights = _gathered_pieces(data, scales, ctx.dtype, linear)
        grad_input, grad_weight = _grads(grad_output, input_hp, weights, linear.config, linear.split, cast)
        return grad_input, grad_weight, None


def _gathered_pieces(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, linear: Fp8Linear) -> list:
    """torchao Float8TrainingTensors [out, in] of each stock projection of a weight gathered in float8: its
    rows of `data` [out, in] with its scale."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    return [
        Float8TrainingTensor(rows, scale, dtype, linear.mm_config, GemmInputRole.WEIGHT)
        for rows, scale in zip(data.split(linear.widths, dim=0), scales.unbind())
    ]


class Fp8Linear:
    """The float8 matmul of one tensor-parallel linear, cut into its stock projections.

    widths: the local output (column-parallel) rows of each stock projection, in order; converted: whether
    each trains in FP8 (the others run F.linear in the parameter dtype); all_gather: FP8Config.all_gather."""

    def __init__(self, widths: list[int], converted: list[bool], config, split: _Split, *, all_gather: bool = False):
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.widths, self.converted, self.config, self.split = widths, converted, config, split
        self.all_gather = all_gather
        gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        self.mm_config = LinearMMConfig(
            *(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
        )

    @property
    def gathers_fp8(self) -> bool:
        """Whether ZeRO-3 gathers this weight in float8 (fp8_gather.py): asked for, every projection in FP8, and
        the weight cast once per tensor for both matmuls that read it (the tensorwise recipe)."""
        from torchao.float8.config import ScalingGranularity

        weight = self.config.cast_config_weight
        return (
            self.all_gather
            and all(self.converted)
            and weight.scaling_granularity is ScalingGranularity.TENSORWISE
            and self.config.cast_config_weight_for_grad_input == weight
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Fp8Gathered):
            y = _Float8GatheredMatmul.apply(x, weight, self)
            return y if bias is None else y + bias.to(y.dtype)
        weights = weight.split(self.widths, dim=0) if len(self.widths) > 1 else (weight,)
        biases = bias.split(self.widths, dim=0) if bias is not None and len(self.widths) > 1 else (bias,) * len(weights)
        outs = []
        for w, b, fp8 in zip(weights, biases, self.converted):
            if not fp8:
                outs.append(F.linear(x, w, b))
                continue
            y = _Float8Matmul.apply(x, w.t(), self.config, self.mm_config, self.split)
            outs.append(y if b is None else y + b.to(y.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def __repr__(self) -> str:
        return f"Fp8Linear(widths={self.widths}, converted={self.converted})"


def _stock_projections(weight: torch.Tensor, *, column: bool) -> list[tuple[str, int]]:
    """[(stock module name, local width along the runtime weight's output dim)] of a tensor-parallel weight."""
    pieces = sorted(get_pieces(weight), key=lambda p: p.local_start)
    if not column:
        assert len(pieces) == 1 and pieces[0].dim == 1, pieces
        return [(pieces[0].hf_name.removesuffix(".weight"), weight.shape[0])]
    assert all(p.dim == 0 for p in pieces), pieces
    return [(p.hf_name.removesuffix(".weight"), p.local_stop - p.local_start) for p in pieces]


def apply_fp8(
    model: nn.Module,
    cfg: FP8Config,
    hf_shapes: dict[str, tuple[int, ...]],
    *,
    tp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> list[str]:
    """Give every tensor-parallel linear of `model` an Fp8Linear; returns the stock projections converted.

    hf_shapes: the stock weights' shapes, for the filter. tp_group / cp_group: the groups that split
    weights and tokens (None or size 1: not split)."""
    if not cfg.enabled:
        return []
    config = cfg.torchao_config()
    tp = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    cp = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
    tokens = ((0, cp),) if cp is not None else ()
    converted_names = []
    for module in model.modules():
        column = isinstance(module, ColumnParallelLinear)
        if not (column or isinstance(module, RowParallelLinear)):
            continue
        projections = _stock_projections(module.weight, column=column)
        flags = [cfg.converts(name, hf_shapes[f"{name}.weight"]) for name, _ in projections]
        if not any(flags):
            continue
        converted = {f"{name}.weight" for (name, _), on in zip(projections, flags) if on}
        replicated = [p.hf_name for p in get_pieces(module.weight) if p.partial_grad and p.hf_name in converted]
        if replicated:
            raise ValueError(
                f"fp8 cannot scale {replicated[0]} at this tp: tp is larger than the number of key/value heads, "
                "so each rank holding a replicated KV head sees only part of its output gradient, and the "
                "gradient's amax is not that of the stock layer; use a tp that divides num_key_value_heads, or "
                "keep the k/v projections in high precision (fp8 keep: [k_proj, v_proj])"
            )
        if tp is None:
            split = _Split(input=tokens, grad_output=tokens)
        elif column:  # weight_t [in, out/tp]; grad_output [tokens, out/tp]
            split = _Split(input=tokens, weight_t=((-1, tp),), grad_output=((-1, tp), *tokens))
        else:  # input [tokens, in/tp]; weight_t [in/tp, out]
            split = _Split(input=((-1, tp), *tokens), weight_t=((0, tp),), grad_output=tokens)
        module.fp8 = Fp8Linear([w for _, w in projections], flags, config, split, all_gather=cfg.all_gather)
        converted_names += [name for (name, _), on in zip(projections, flags) if on]
    return converted_names
