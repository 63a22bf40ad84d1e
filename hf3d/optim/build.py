"""`build_optimizer`: the one way in. It picks the optimizer for the model's zero stage and the class: ZeRO-0/1/2 over
hf3d's gradient buffers (hf3d/optim/zero.py), ZeRO-3 over FSDP2's shards (hf3d/optim/sharded.py), or the Muon hybrid
(hf3d/optim/muon.py); and the precision of the optimizer's state (hf3d/optim/precision.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import precision
from .base import ParallelOptimizer
from .zero import BucketedOptimizer

__all__ = ["build_optimizer"]

# torch optimizers whose update of an element depends on the whole tensor (factored moments,
# closures): they cannot run on the flat fp32 fragments that ZeRO and tensor parallelism produce
WHOLE_TENSOR_OPTIMIZERS = ("Adafactor", "LBFGS", "SparseAdam")


def build_optimizer(
    pmodel,
    optimizer_cls=torch.optim.AdamW,
    *,
    zero_stage: int | None = None,
    max_grad_norm: float | None = 1.0,
    bucket_size: int = 2**22,
    overlap_grad_reduce: bool = True,
    dp_collective: str = "auto",
    exclude_from_weight_decay: bool | Callable[[str, torch.Tensor], bool] = False,
    state_precision: str = "fp32",
    **optimizer_kwargs,
) -> ParallelOptimizer:
    """Wrap a torch optimizer class for a ParallelModel.

    The optimizer must update every element independently of the others (AdamW, Adam, SGD, ...):
    it steps flat fp32 fragments of the parameters. torch's whole-tensor optimizers are refused.

    zero_stage: 0 (replicated optimizer, all-reduced grads), 1 (state and fp32 master weights on
    1/dp of the elements), 2 (the fp32 gradients too) or 3 (the weights too: the model must have been built with
    ParallelConfig(zero_stage=3), which shards it through FSDP2); default from the ParallelConfig. bucket_size:
    elements per gradient bucket (ZeRO 0-2). dp_collective (ZeRO-1/2's gradient reduction and parameter
    gather): "reduce_scatter" (reduce-scatter + all-gather), "all_to_all" (all-to-all + local sum, then one
    broadcast per shard: the same bytes, faster on gloo), "all_reduce" (all-reduce of the gradients and of the
    zero-padded parameters: twice the bytes) or "auto" (on gloo all_to_all, and all_reduce under ZeRO-2,
    whose in-place reduction needs no receive buffer; reduce_scatter elsewhere).
    exclude_from_weight_decay: False decays every parameter (torch.optim.AdamW over model.parameters());
    True leaves biases and norm weights undecayed and decays the rest, embeddings included (the
    transformers Trainer's rule, see `no_decay_names`); or a rule `(runtime_name, param) -> bool`
    picking the parameters without decay (hf3d.Trainer passes the Trainer's own). state_precision: the
    per-element state's "fp32" (torch's), "bf16" (moments kept in bf16, stepped in fp32) or "8bit" (torchao's
    AdamW8bit / Adam8bit in place of AdamW / Adam); the fp32 master weights stay (hf3d/optim/precision.py).
    Other keyword arguments go to optimizer_cls. Classes with a fused kernel
    (AdamW, Adam, SGD, Adagrad) get `fused=True` unless `fused` or `foreach` is given: one kernel over
    this rank's flat fp32 fragments (AdamW over 8.4M elements on one CPU thread: 5.4 ms, torch's
    default per-tensor loop 18.7 ms).
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    precision.check(state_precision, optimizer_cls, muon=issubclass(optimizer_cls, torch.optim.Muon))
    if state_precision == "8bit":
        optimizer_cls = precision.eight_bit_class(optimizer_cls)
    opt = _build(
        pmodel,
        optimizer_cls,
        zero_stage=zero_stage,
        max_grad_norm=max_grad_norm,
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap_grad_reduce,
        dp_collective=dp_collective,
        exclude_from_weight_decay=exclude_from_weight_decay,
        optimizer_kwargs=optimizer_kwargs,
    )
    opt.state_precision = state_precision
    if getattr(opt.optimizer, "owns_state_precision", False):  # the Muon hybrid steps each part at it
        opt.optimizer.state_precision = state_precision
    return opt


def _build(
    pmodel,
    optimizer_cls,
    *,
    zero_stage,
    max_grad_norm,
    bucket_size,
    overlap_grad_reduce,
    dp_collective,
    exclude_from_weight_decay,
    optimizer_kwargs: dict,
) -> ParallelOptimizer:
    if optimizer_cls.__module__.startswith("torch.optim") and optimizer_cls.__name__ in WHOLE_TENSOR_OPTIMIZERS:
        raise ValueError(
            f"{optimizer_cls.__name__} updates each parameter as a whole tensor, but hf3d steps flat fp32 "
            "fragments of parameters (ZeRO shards, FSDP2's dim-0 shards under zero_stage=3, tensor-parallel "
            "slices); use an element-wise optimizer such as AdamW, Adam, SGD, Adagrad or RMSprop"
        )
    zero_stage = _check_zero_stage(pmodel, zero_stage)
    if not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size!r}")
    if issubclass(optimizer_cls, torch.optim.Muon):
        from .muon import build_muon

        return build_muon(
            pmodel,
            zero_stage=zero_stage,
            optimizer_kwargs=optimizer_kwargs,
            max_grad_norm=max_grad_norm,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            dp_collective=_dp_collective(dp_collective, zero_stage),
            exclude_from_weight_decay=exclude_from_weight_decay,
        )
    fusable = "fused" in inspect.signature(optimizer_cls.__init__).parameters and pmodel.device.type in ("cpu", "cuda")
    if fusable and not {"fused", "foreach"} & optimizer_kwargs.keys():
        optimizer_kwargs["fused"] = True
    if zero_stage == 3:
        from .sharded import ShardedOptimizer

        return ShardedOptimizer(
            pmodel,
            optimizer_cls,
            max_grad_norm=max_grad_norm,
            exclude_from_weight_decay=exclude_from_weight_decay,
            optimizer_kwargs=optimizer_kwargs,
        )
    return BucketedOptimizer(
        pmodel,
        optimizer_cls,
        zero_stage=zero_stage,
        max_grad_norm=max_grad_norm,
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap_grad_reduce,
        dp_collective=_dp_collective(dp_collective, zero_stage),
        exclude_from_weight_decay=exclude_from_weight_decay,
        optimizer_kwargs=optimizer_kwargs,
    )


def _dp_collective(dp_collective: str, zero_stage: int) -> str:
    if dp_collective == "auto":
        gloo = dist.get_backend() == "gloo"
        dp_collective = ("all_reduce" if zero_stage == 2 else "all_to_all") if gloo else "reduce_scatter"
    if dp_collective not in ("reduce_scatter", "all_reduce", "all_to_all"):
        raise ValueError(
            f"dp_collective must be 'reduce_scatter', 'all_reduce', 'all_to_all' or 'auto', got {dp_collective!r}"
        )
    return dp_collective


def _check_zero_stage(pmodel, zero_stage) -> int:
    """The stage to build: the ParallelConfig's unless given; ZeRO-3 exactly when the model was sharded by it."""
    built = pmodel.pcfg.zero_stage
    zero_stage = built if zero_stage is None else zero_stage
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if (zero_stage == 3) != (built == 3):
        if built == 3:
            raise ValueError(
                f"zero_stage={zero_stage} for a model built with ParallelConfig(zero_stage=3): its weights are "
                "sharded; leave build_optimizer's zero_stage unset, or build the model with the stage you want"
            )
        raise ValueError(
            "zero_stage=3 shards the weights, which happens when the model is built: pass "
            "hf3d.ParallelConfig(zero_stage=3) to hf3d.parallelize and leave build_optimizer's zero_stage unset"
        )
    if zero_stage == 0 and pmodel.pcfg.shard_size < pmodel.pcfg.dp:
        raise ValueError(
            f"zero_stage=0 with dp_shard={pmodel.pcfg.dp_shard}: zero 0 shards nothing; use zero_stage 1 or 2"
        )
    return zero_stage
