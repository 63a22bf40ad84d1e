"""FP8 all-gather under ZeRO-3: FSDP2 gathers a tensor-parallel linear's weight as the float8 bytes its matmul reads.

Which weights: those of the tensor-parallel linears whose stock projections all train in FP8 under torchao's
tensorwise recipe (`FP8Config.all_gather`, on by default). Under that recipe the forward and the input-gradient
matmul read the same float8 weight, so one gathered copy serves both; under rowwise they cast the weight along
different dims and no single copy does (torchao gathers only tensorwise weights in float8 too).

What is gathered: each stock projection of the weight (q, k and v of a fused one) cast with its own tensorwise
scale, as hf3d/parallel/fp8.py casts the gathered weight: the amax of the projection's rows on this rank, reduced
with MAX over the shard group and over tp (which splits the weight too), is the amax of the whole stock weight,
so the scale and the float8 values are those of a cast after a gather in fp32. One byte per element crosses the
wire instead of the compute dtype's two or four. With a bf16 compute dtype the cast runs from the fp32 shard
(one rounding) where the gather in bf16 rounds twice.

How: FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather` on the sharded local tensor).
After `fully_shard`, the local tensor of such a weight's DTensor is retyped an `Fp8GatherShard`: the same fp32
storage, whose ops give plain tensors, so that the optimizer, checkpoints and the grad norm read it as before (a
subclass given before `fully_shard` would not survive it: FSDP2 makes its Parameter by detaching the DTensor, which
rebuilds the local tensor at the dispatch level). FSDP2's lazy init, at the first forward, looks for the hooks on
each local tensor again, as it does for tensors changed after `fully_shard`. The gathered parameter is an
`Fp8Gathered`: a wrapper reporting the compute dtype and the weight's shape, holding the float8 rows and the
scales, read by Fp8Linear alone. Its gradient is a plain tensor in the compute dtype, reduced by FSDP2 like any
other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class GatherSpec:
    """How one weight's rows are cast: bounds[i]:bounds[i + 1] are the rows of its i-th stock projection (of the
    tensor-parallel weight); groups, besides the shard group, hold the rest of each projection (tp)."""

    bounds: tuple[int, ...]
    groups: tuple[dist.ProcessGroup, ...]
    float8_dtype: torch.dtype
    round_scales_to_power_of_2: bool


class Fp8GatherShard(torch.Tensor):
    """A weight's fp32 storage, typed so that FSDP2 gathers it through the two hooks below."""

    hf3d_gather: GatherSpec
    __torch_function__ = torch._C._disabled_torch_function_impl  # its ops give plain tensors

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows [r0, r0 + local) of the weight, each projection's cast with its global scale; padded to
        FSDP2's chunk (ceil(rows / ranks) rows). Collective: a MAX all-reduce of the projections' amaxes."""
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale

        spec, axis = self.hf3d_gather, mesh.ndim - 1  # the shard axis is the last (HSDP: replicate, shard)
        local = self.as_subclass(torch.Tensor)  # [local rows, cols]
        chunk = -(-outer_size[0] // mesh.size(axis))
        r0 = min(mesh.get_local_rank(axis) * chunk, outer_size[0])
        rows = [(max(a, r0) - r0, min(z, r0 + local.shape[0]) - r0) for a, z in zip(spec.bounds, spec.bounds[1:])]
        amax = torch.zeros(len(rows), dtype=torch.float32, device=local.device)
        for i, (lo, hi) in enumerate(rows):
            if lo < hi:
                amax[i] = local[lo:hi].abs().max()
        max_over(amax, (mesh.get_group(axis), *spec.groups))
        scales = amax_to_scale(amax, spec.float8_dtype, spec.round_scales_to_power_of_2)
        data = torch.zeros(chunk, *outer_size[1:], dtype=spec.float8_dtype, device=local.device)
        for i, (lo, hi) in enumerate(rows):
            if lo < hi:
                data[lo:hi] = hp_tensor_and_scale_to_float8(local[lo:hi], scales[i], spec.float8_dtype)._data
        return (data,), scales

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs  # [ranks * chunk, cols], FSDP2's buffer, refilled in place by the next gather
        if out is not None:
            out._scales = metadata
            return None
        return Fp8Gathered(data, metadata, param_dtype), (data,)


def max_over(amax: torch.Tensor, groups) -> None:
    """amax, in place, the largest of each element over every group (the shard group first)."""
    for group in groups:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def _typed(tensor: torch.Tensor, spec: GatherSpec) -> Fp8GatherShard:
    out = tensor.as_subclass(Fp8GatherShard)
    out.hf3d_gather = spec
    return out


class Fp8Gathered(torch.Tensor):
    """A weight FSDP2 gathered in float8: `_data` [rows, cols] and `_scales` [projections]; dtype and shape are
    the weight's, so that its gradient is the weight's. Only FSDP2 (as_strided, detach), the pipeline schedules'
    weight pass (a view of the whole) and Fp8Linear touch it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)
        out._data, out._scales = data, scales
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["_data", "_scales"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8Gathered(inner["_data"], inner["_scales"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten.detach.default:
            return Fp8Gathered(args[0]._data, args[0]._scales, args[0].dtype)
        if func is aten.as_strided.default:  # FSDP2 cuts the padded rows off
            return Fp8Gathered(args[0]._data.as_strided(*args[1:]), args[0]._scales, args[0].dtype)
        if func is aten.view.default and tuple(args[1]) == tuple(args[0].shape):  # zbv's view_as(t) finds t's grad node
            return Fp8Gathered(args[0]._data.view(args[1]), args[0]._scales, args[0].dtype)
        raise NotImplementedError(
            f"{func} on a weight FSDP2 gathered in fp8: only hf3d's FP8 matmul reads it (FP8Config(all_gather=False), "
            "precision.fp8_all_gather: false, gathers it in the compute dtype)"
        )

    def __repr__(self) -> str:
        return f"Fp8Gathered(shape={tuple(self.shape)}, dtype={self.dtype}, scales={self._scales.tolist()})"


def fp8_gather_specs(model: nn.Module) -> dict[str, GatherSpec]:
    """{module name: how its weight is cast} of every linear whose Fp8Linear gathers in float8."""
    specs = {}
    for name, module in model.named_modules():
        linear = getattr(module, "fp8", None)
        if linear is not None and linear.gathers_fp8:
            config = linear.config.cast_config_weight
            bounds = tuple(sum(linear.widths[:i]) for i in range(len(linear.widths) + 1))
            groups = tuple(group for _, group in linear.split.weight_t)
            specs[name] = GatherSpec(bounds, groups, config.target_dtype, linear.config.round_scales_to_power_of_2)
    return specs


def gather_in_fp8(model: nn.Module, specs: dict[str, GatherSpec]) -> None:
    """After `fully_shard`, before the first forward: the weights of `specs` gathered in float8 from then on
    (FSDP2's lazy init looks for the hooks on each sharded local tensor again)."""
    for name, spec in specs.items():
        weight = model.get_submodule(name).weight
        weight._local_tensor = _typed(weight._local_tensor, spec)
