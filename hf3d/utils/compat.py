"""What differs between the torch releases hf3d supports (2.11 to the newest), in one place.

1. Two renamed collectives. torch 2.13 calls the flat all-gather and reduce-scatter `dist.all_gather_single` /
`dist.reduce_scatter_single` and deprecates the older names; torch before 2.13 has only
`dist.all_gather_into_tensor` / `dist.reduce_scatter_tensor`, with the same arguments (output, input, op=,
group=, async_op=). hf3d calls `all_gather_single` / `reduce_scatter_single` below, which run whichever this torch
has under the newer name, else the older. The function is looked up on torch.distributed at each call, as a call
to `dist.all_gather_single` would be: a test or tool that swaps `dist.<name>` sees hf3d's calls. Under
torch.compile dynamo inlines these wrappers and maps the collective they reach onto its functional collective as
it does a direct call: the same graph, no break (tests/test_compat.py, on 2.11 and 2.13).

2. `all_reduce_copy`: an all-reduce into a new tensor that torch.compile differentiates on every release. On torch
2.11, dynamo traced an autograd.Function whose forward all-reduces, in place, a tensor it made (a clone of its
input) so that no gradient reached the input (measured: zero input gradient through hf3d.parallel.tensor's
_ReduceFromTP with aot_eager and inductor; compiled tp=2 training off eager from step 2); 2.13 is right. Before
2.13, under compile, it runs the functional all-reduce instead (right on 2.11 and 2.13); otherwise, and always on
2.13, what _ReduceFromTP ran before: a contiguous clone all-reduced in place.

3. Not worked around: torch.distributed.pipelining before 2.13 cannot run the V schedules (zbv, dualpipev) on
hf3d's layers. Its zero-bubble weight pass builds GradientEdges on the autograd nodes that consume the weights
and reads their `_input_metadata` after the stage's output is gone; a custom autograd.Function's node (hf3d's
RMSNorm, SwiGLU, rotary, tensor-parallel functions) is then freed ("Attribute '_input_metadata' is invalid for
this instance of _C._FunctionBase"), a built-in one is not. On gloo its warm-up also sends to the rank's own
stage ("Pair is not connected"). `BEFORE_2_13` is what a caller checks to refuse them.

4. FP8 rowwise on a CPU: before 2.13 the CPU `torch._scaled_mm` takes per-tensor scales only (`check_fp8_rowwise`).

5. ZeRO-3: before 2.13 FSDP2 reduced the gradients of a grouped `fully_shard([embedding, norm, head])` wrongly when
the head runs outside the group's forward, as hf3d's chunked-loss head does (pytorch#180428, in 2.13's release
notes); `check_zero_stage` refuses the stage there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

BEFORE_2_13 = TorchVersion(torch.__version__) < (2, 13)

# the name each collective has in this torch: the newer where it exists (no deprecation warning), else the older
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

if BEFORE_2_13:
    from torch.distributed import _functional_collectives as _funcol


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """`dist.all_gather_single` (torch 2.13+) or `dist.all_gather_into_tensor` (older): every rank's
    `input_tensor` concatenated along dim 0 into `output_tensor`."""
    return getattr(dist, ALL_GATHER)(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=None, group=None, async_op=False):
    """`dist.reduce_scatter_single` (torch 2.13+) or `dist.reduce_scatter_tensor` (older): `input` reduced over
    the group with `op` (torch's default, a sum, when None), and this rank's 1/size of it along dim 0 into
    `output`."""
    fn = getattr(dist, REDUCE_SCATTER)
    if op is None:  # torch's own default, as a call without op= gets
        return fn(output, input, group=group, async_op=async_op)
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_reduce_copy(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over `group`, in a new contiguous tensor; `x` is left as it was (see the module, 2)."""
    if BEFORE_2_13 and torch.compiler.is_compiling():
        return _funcol.all_reduce(x.contiguous(), "sum", group)
    out = x.clone().contiguous()
    dist.all_reduce(out, group=group)
    return out


def check_pipeline_schedule(schedule: str, pp: int, key: str = "pp_schedule") -> None:
    """Refuse the V schedules on a torch that cannot run them on hf3d's layers (see the module, 3)."""
    if BEFORE_2_13 and pp > 1 and schedule in ("zbv", "dualpipev"):
        raise ValueError(
            f"{key}={schedule!r} needs torch 2.13 or later: torch {torch.__version__}'s pipelining cannot run its "
            "split backward on hf3d's layers; use '1f1b' or 'interleaved-1f1b', or upgrade torch"
        )


def check_zero_stage(zero_stage: int, key: str = "zero_stage") -> None:
    """Refuse ZeRO-3 before torch 2.13: its FSDP2 reduced the gradients of a grouped `fully_shard([..., head])` whose
    head runs outside the group's forward (hf3d's chunked-loss head) wrongly (fixed by pytorch#180428, in 2.13)."""
    if BEFORE_2_13 and zero_stage == 3:
        raise ValueError(
            f"{key}=3 needs torch 2.13 or later: torch {torch.__version__}'s FSDP2 reduces the gradients of a head "
            "run outside its group's forward wrongly (fixed in 2.13); use zero_stage 2 (gradients and optimizer "
            "state sharded), or upgrade torch"
        )


def check_fp8_rowwise(recipe: str, emulate: bool, device_type: str) -> None:
    """Refuse FP8 rowwise through torch._scaled_mm on a CPU before torch 2.13, whose CPU kernel takes only
    per-tensor scales (an internal assert deep in the first matmul otherwise)."""
    if BEFORE_2_13 and recipe == "rowwise" and not emulate and device_type == "cpu":
        raise ValueError(
            f"fp8='rowwise' on a CPU needs torch 2.13 or later (torch {torch.__version__}'s CPU _scaled_mm takes "
            "per-tensor scales only): use FP8Config('rowwise', emulate=True) (precision.fp8_emulate: true) there"
        )
