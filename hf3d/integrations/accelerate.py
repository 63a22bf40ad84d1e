"""accelerate as a front end: `hf3d.prepare(acc, pmodel, opt, sched, dl)` (DESIGN decision 10).

accelerate knows data parallelism only: `acc.prepare(pmodel)` would wrap the model in DDP, whose
first broadcast overwrites other tensor-parallel ranks' shards, and whose dataloader split would give
tp/pp peers different rows. hf3d does its own parallelism, so `prepare` hands accelerate objects
that are already marked prepared (`_is_accelerate_prepared`: no DDP, no `.to()`, no autocast), shards
the dataloader over dp only, and hooks `save_state`/`load_state` to hf3d's sharded checkpoint, which
every rank writes and any mesh reads. The model and optimizer are not registered with accelerate:
its own save would write rank 0's shard only. The scheduler and dataloader are, so accelerate saves
their position as usual, next to the `hf3d/` checkpoint folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.load import load_checkpoint
from ..checkpoint.save import save_checkpoint
from ..parallel.sharding import launch_settings, mesh_settings, mismatches, sharding_settings

CHECKPOINT_SUBDIR = "hf3d"


def check_accelerator(acc, pmodel) -> None:
    """Refuse Accelerator settings that would fight hf3d's own parallelism, one line each. FSDP2 and a
    ParallelismConfig map onto hf3d's zero stage and mesh (hf3d/parallel/sharding.py): the model must have been
    built with what they ask for (`hf3d.ParallelConfig.from_env()` reads it from the launch)."""
    from accelerate.utils import DistributedType

    foreign = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.MEGATRON_LM: "Megatron-LM"}
    if acc.distributed_type in foreign:
        raise ValueError(
            f"the Accelerator runs {foreign[acc.distributed_type]}, but hf3d does its own tensor/pipeline/data "
            "parallelism; launch without the DeepSpeed/Megatron-LM plugin"
        )
    wanted, where = fsdp_request(acc)
    check_request(pmodel, wanted, where)
    if acc.gradient_accumulation_steps > 1:
        raise ValueError(
            f"gradient_accumulation_steps={acc.gradient_accumulation_steps}: hf3d accumulates inside each step; "
            "use Accelerator(gradient_accumulation_steps=1) and hf3d.ParallelConfig(num_microbatches=...)"
        )
    if acc.mixed_precision == "fp16":
        raise ValueError("mixed_precision='fp16' is not supported by hf3d; use 'bf16' or 'no'")
    if acc.mixed_precision == "bf16" and pmodel.param_dtype != torch.bfloat16:
        raise ValueError(
            "Accelerator(mixed_precision='bf16') with an fp32 hf3d model: hf3d does not autocast; parallelize "
            "with dtype=torch.bfloat16 instead (fp32 master weights and gradients are kept)"
        )
    world = dist.get_world_size()
    if acc.num_processes != world:
        raise ValueError(
            f"the Accelerator sees {acc.num_processes} process(es) but {world} were launched; on CPU build it "
            "with Accelerator(cpu=True) (accelerate reports a single process on CPU otherwise)"
        )


def fsdp_request(acc) -> tuple[dict, str]:
    """The ParallelConfig fields the Accelerator's FSDP plugin and ParallelismConfig ask for, or on a CPU (where
    accelerate runs MULTI_CPU and keeps no FSDP plugin) the launch's fsdp_config; and where they come from."""
    plugin = getattr(getattr(acc, "state", None), "fsdp_plugin", None)
    pc = getattr(acc, "parallelism_config", None)
    sizes = None
    if pc is not None:
        names = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
        sizes = {n: int(getattr(pc, f"{n}_size", 1) or 1) for n in names}
    if plugin is not None:
        where = "the Accelerator's FSDP plugin"
        wanted = sharding_settings(
            version=plugin.fsdp_version,
            reshard_after_forward=plugin.reshard_after_forward is not False,
            cpu_offload=_offloads(plugin.cpu_offload),
            activation_checkpointing=bool(plugin.activation_checkpointing),
            sizes=sizes,
            where=where,
        )
        return wanted, where
    if sizes is not None:
        where = "the Accelerator's parallelism_config"
        return mesh_settings(sizes, where=where), where
    return launch_settings(os.environ), "the accelerate launch config (fsdp_config)"


def check_request(pmodel, wanted: dict, where: str) -> None:
    """The model must have been built with what an FSDP configuration asks for (`wanted`, ParallelConfig fields)."""
    bad = mismatches(pmodel.pcfg, wanted)
    if bad:
        raise ValueError(
            f"{where} asks for {', '.join(bad)}: build the model with those settings (hf3d.ParallelConfig.from_env() "
            "reads them from the launch, from_env(training_args=args) from TrainingArguments; hf3d train: the "
            "parallel section), or run without that FSDP config"
        )


def _offloads(policy) -> bool:
    """accelerate's cpu_offload: a bool, FSDP1's CPUOffload or FSDP2's CPUOffloadPolicy (an OffloadPolicy: none)."""
    if isinstance(policy, bool) or policy is None:
        return bool(policy)
    return type(policy).__name__ == "CPUOffloadPolicy" or bool(getattr(policy, "offload_params", False))


def _mark(obj):
    obj._is_accelerate_prepared = True
    return obj


def _optim_step(opt) -> int:
    everyone = [0] * dist.get_world_size()
    dist.all_gather_object(everyone, opt.num_steps if opt is not None else 0)
    return max(everyone)


def prepare(acc, pmodel, optimizer=None, scheduler=None, dataloader=None):
    """Hand hf3d's model, optimizer, LR scheduler and dataloader to an Accelerator.

    Returns (pmodel, optimizer, scheduler, dataloader), leaving out the ones passed as None. The
    dataloader yields per-dp-replica batches: dp rank d takes the d-th of every dp consecutive
    batches, and every tp/pp peer of a replica gets the same batch. The scheduler steps exactly once
    per `sched.step()`. `acc.save_state(d)` / `acc.load_state(d)` are collective and write / read
    hf3d's sharded checkpoint under `d/hf3d`, loadable at any mesh."""
    from accelerate.data_loader import prepare_data_loader

    check_accelerator(acc, pmodel)
    _mark(pmodel)
    if optimizer is not None:
        _mark(optimizer)
    out = [pmodel, optimizer]
    if scheduler is not None:
        out.append(acc.prepare(_mark(scheduler)))  # registered: accelerate saves its position
    if dataloader is not None:
        shard = prepare_data_loader(
            dataloader,
            acc.device,
            num_processes=pmodel.dp_size,
            process_index=pmodel.dp_rank,
            put_on_device=True,
            dispatch_batches=False,  # each replica iterates its own copy: dispatching would split over tp/pp too
        )
        out.append(acc.prepare(_mark(shard)))

    def save_hook(models, weights, output_dir) -> None:
        step = _optim_step(optimizer)
        save_checkpoint(Path(output_dir) / CHECKPOINT_SUBDIR, pmodel, optimizer, step=step)

    def load_hook(models, input_dir) -> None:
        load_checkpoint(Path(input_dir) / CHECKPOINT_SUBDIR, pmodel, optimizer)

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    kept = tuple(o for o in out if o is not None)
    return kept if len(kept) > 1 else pmodel
