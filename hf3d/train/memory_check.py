"""`hf3d train`'s memory plan against its first step: the plan of the run's own mesh (hf3d/plan) at the start and
what the first step held, side by side, one line.

The plan is made on rank 0 before the process group starts (the plan's trace runs in a fake world of its own,
hf3d/plan/trace.py), from the model's config and the run's mesh, batch and sequence length, in a second or
two. The first step is measured on every rank: on a CPU the tensors the run holds (the optimizer's training
state from its own buffers, the activations by hf3d/plan/meter.py around the step's forward and backward), on
CUDA the allocator's peak over the step against the plan's total. The fullest rank of each is shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

MiB = 2**20
PARTS = ("weights", "master", "grads", "state", "gathered", "activations")  # RankMemory's, as the lines name them


def plan_run(cfg, model_config) -> list[dict] | None:
    """The plan of this run's mesh on rank 0 (before the process group starts): each pipeline rank's bytes, or
    None where the plan has nothing to say (another rank, a pipeline schedule it does not follow, a
    configuration the run's own checks will refuse in a moment with their line). `model_config()` reads the
    model's config."""
    if int(os.environ.get("RANK", "0")) != 0 or dist.is_initialized():
        return None
    from ..models import get_adapter
    from ..parallel.attention import flash_attn_installed
    from ..parallel.compile import resolve_compile
    from ..plan.memory import Job
    from ..plan.planner import Planner

    world = int(os.environ.get("WORLD_SIZE", "1"))
    target = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model_config = model_config()
        job = Job(
            seq_len=cfg.data.seq_len,
            global_batch=cfg.run.global_batch,
            dtype_bytes=torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size(),
            optimizer_states=1 if cfg.optim.name == "muon" else 2,
            state_precision=cfg.optim.state_precision,
            bucket_size=cfg.optim.bucket_size,
            target=target,
            packed=cfg.data.document_masking,
            attn=cfg.model.attn_implementation,  # the planner picks the kernel as the run will (flash where installed)
            flash=flash_attn_installed(),
            compiled=resolve_compile(cfg.parallel.compile, target, model_config)[0],
            fp8=cfg.precision.fp8_config(),
        )
        pcfg = dataclasses.replace(cfg.parallel, compile=False).resolve(world)
        plan = Planner(model_config, job, adapter=get_adapter(model_config.model_type)).plan(pcfg)
    except (ValueError, OSError):
        return None
    return [r.as_dict() for r in plan.ranks]


def plan_line(plan: list[dict]) -> str:
    """The start's line: the plan of the fullest rank."""
    r = max(plan, key=lambda r: r["total"])
    parts = ", ".join(
        f"{k} {r[k] / MiB:.2f}" for k in ("weights", "master", "grads", "state", "gathered", "activations")
    )
    return f"hf3d: memory plan per rank (MiB, the fullest rank): {parts}, total {r['total'] / MiB:.2f} (hf3d plan)"


def measuring(run):
    """The context the first step's forward and backward run in: on a CPU the activation meter, on CUDA a reset of
    the allocator's peak."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return contextlib.nullcontext()
    from ..plan.meter import ActivationMeter

    run.meter = ActivationMeter(run.pmodel.hf_model)
    return run.meter


def report(run, write) -> None:
    """After the first step: every rank's measurement to rank 0, and the line beside the plan (collective)."""
    state = run.opt.memory_report()["total"]
    if torch.cuda.is_available():
        mine = {"total": torch.cuda.max_memory_allocated(), "pp_rank": run.pmodel.pp_rank}
    else:
        mine = {"state": state, "activations": run.meter.peak, "pp_rank": run.pmodel.pp_rank}
        mine["total"] = state + run.meter.peak
    run.meter = None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if not run.rank0 or run.plan is None:
        return
    measured = max(everyone, key=lambda m: m["total"])
    planned = max(run.plan, key=lambda r: r["total"])
    if "state" not in measured:
        write(
            f"hf3d: memory per rank, planned / measured after step 1 (MiB, the fullest rank): total "
            f"{planned['total'] / MiB:.1f} / {measured['total'] / MiB:.1f} (the CUDA allocator's peak; `hf3d plan` "
            "breaks the plan down)"
        )
        return
    planned_state = planned["total"] - planned["activations"]
    write(
        f"hf3d: memory per rank, planned / measured after step 1 (MiB, the fullest rank): training state "
        f"{planned_state / MiB:.2f} / {measured['state'] / MiB:.2f}, activations {planned['activations'] / MiB:.2f} / "
        f"{measured['activations'] / MiB:.2f}, total {planned['total'] / MiB:.2f} / {measured['total'] / MiB:.2f}"
    )
