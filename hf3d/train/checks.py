"""The checks of a `hf3d train` config that need more than one section (batch vs dp and micro-batches, seq_len vs the
model's positions, data stages vs the run and its lr decay): `check_launch` before anything is looked up,
`check_run` once the model's config is known; both before anything is loaded or written."""

from __future__ import annotations

import re
from pathlib import Path

from ..data import DataConfig
from ..parallel.config import check_attn_implementation, check_cp_seq_len
from ..utils import files
from .config import TrainConfig
from .lr_schedules import decay_start_step, describe_schedule

RUN_FILES = (
    "metrics.jsonl",
    "samples.jsonl",
    "config.yaml",
    "loss_curve.png",
    "sample.txt",
    "memory.json",
    "checkpoints/latest",
    "hub_push",
    "hub_pending.json",
    files.RUN_FILE,
)
"""The files `hf3d train` writes (and replaces) in its output folder, and the folder checkpoint.push_to_hub converts
checkpoints into."""


def check_launch(cfg: TrainConfig, *, world_size: int) -> int:
    """The checks that need neither the model's config nor any data, run first (before a Hub lookup of the model):
    the launch against the mesh, the batch against dp and micro-batches, each stage's rows against cp, the output
    folder. Returns dp."""
    p, r = cfg.parallel, cfg.run
    check_attn_implementation(cfg.model.attn_implementation, "model.attn_implementation")
    from ..utils.compat import check_pipeline_schedule, check_zero_stage

    check_pipeline_schedule(p.pp_schedule, p.pp, key="parallel.pp_schedule")
    check_zero_stage(p.zero_stage, key="parallel.zero_stage")
    files.check_output(r.output_dir, "run.output_dir", folder=True)  # before the work, not at its first write
    if r.save_final:  # the export at the end replaces only an earlier export there
        from ..hf.folders import EXPORT, check_output_dir

        check_output_dir(Path(r.output_dir) / "final", EXPORT)
    if cfg.checkpoint.push_to_hub is not None:  # before the run, not at its first checkpoint
        from huggingface_hub import get_token

        if not get_token():
            raise ValueError(
                "checkpoint.push_to_hub needs a Hugging Face token and none was found: run `hf auth login`, or "
                "`export HF_TOKEN=...` with a write token"
            )
    for name in RUN_FILES:  # what the run writes beside its checkpoints: never through a link
        files.refuse_link(Path(r.output_dir) / name)
    dp = _check_world(cfg, world_size)
    m = p.num_microbatches
    if r.global_batch % (dp * m):
        raise ValueError(
            f"run.global_batch={r.global_batch} is not divisible by dp·num_microbatches = {dp}·{m} = {dp * m}: "
            f"use a multiple of {dp * m}"
        )
    for i, stage in enumerate(cfg.data.resolved_stages()):
        if cfg.data.stages and cfg.data.stages[i].seq_len is not None:  # a stage's own length cuts over cp too
            sp = p.sequence_parallel
            check_cp_seq_len(stage.seq_len, cp=p.cp, tp=p.tp, sequence_parallel=sp, where=f"data.stages[{i}].seq_len")
    return dp


def check_run(cfg: TrainConfig, *, world_size: int, model_config) -> list[str]:
    """Checks across sections, before anything is loaded or written; returns the derived values to
    print at start (tokens per step and in all, the lr decay window, data stages against it)."""
    p, r = cfg.parallel, cfg.run
    _check_model_fits(cfg, model_config)  # first: no other number of processes would help
    dp = check_launch(cfg, world_size=world_size)
    m = p.num_microbatches
    stages = cfg.data.resolved_stages()
    for i, stage in enumerate(stages):
        _check_stage_model(cfg, i, stage, model_config)
    seq = stages[0].seq_len
    ends = [s.start_step for s in stages[1:]] + [r.steps]
    total = sum(
        r.global_batch * s.seq_len * (max(s.start_step, min(end, r.steps)) - s.start_step)
        for s, end in zip(stages, ends)
    )
    tokens = r.global_batch * seq
    lines = [
        f"tokens per step: {tokens:,} ({r.global_batch} rows of {seq} over dp={dp}, {m} micro-batches of "
        f"{r.global_batch // dp // m} rows per rank); tokens in all: {total:,} over {r.steps} steps"
    ]
    lines += describe_schedule(cfg.optim, r.steps)
    from ..parallel.compile import resolve_compile
    from ..parallel.fp8 import speed_note
    from ..parallel.mesh import device_type

    compiled, why = resolve_compile(p.compile, device_type(), model_config)
    if p.compile == "auto":
        lines.append(f"parallel.compile: {why}")
    note = speed_note(
        cfg.precision.fp8, device_type=device_type(), compiled=compiled, hidden_size=model_config.hidden_size
    )
    if note is not None:
        lines.append(f"warning: {note}")
    return lines + _stage_lines(cfg, stages)


def _check_model_fits(cfg: TrainConfig, model_config) -> None:
    """parallel.compile, tp and ep against the model, before the world size: launching another number of
    processes would not help."""
    p = cfg.parallel
    if p.compile is True:
        from ..parallel.compile import check_compile
        from ..parallel.mesh import device_type

        check_compile(device_type(), model_config, key="parallel.compile")
    try:
        from ..models import get_adapter

        adapter = get_adapter(model_config.model_type)
        adapter.check_tp(model_config, p.tp)
        adapter.check_ep(model_config, p.ep)
    except ValueError as e:
        raise ValueError(f"parallel.{e}" if str(e).startswith(("tp=", "ep=")) else str(e)) from None
    if p.mup_base_width is not None and p.mup_base_width > model_config.hidden_size:
        raise ValueError(
            f"parallel.mup_base_width={p.mup_base_width} is larger than the model's hidden_size="
            f"{model_config.hidden_size}: the base width is the narrow proxy's hidden_size; use a value <= "
            f"{model_config.hidden_size}"
        )


def _check_world(cfg: TrainConfig, world_size: int) -> int:
    """dp, once the launched processes fit tp·pp·dp·cp and ep fits dp."""
    p = cfg.parallel
    tp_pp = p.tp * p.pp * p.cp
    if world_size % tp_pp or (p.dp is not None and p.dp * tp_pp != world_size):
        dp = "dp" if p.dp is None else f"dp={p.dp}"
        raise ValueError(
            f"world size {world_size} is not tp·pp·{dp}·cp = {p.tp}·{p.pp}·{p.dp or '?'}·{p.cp}: launch "
            f"tp·pp·dp·cp processes (e.g. hf3d train --nproc-per-node {tp_pp * (p.dp or 1)}) or change "
            "parallel.tp/pp/dp/cp"
        )
    dp = world_size // tp_pp
    if dp % p.ep:
        raise ValueError(
            f"parallel.ep={p.ep} does not divide dp={dp}: expert-parallel groups are made of dp ranks; use an ep "
            f"that divides {dp}, or launch more processes"
        )
    check_cp_seq_len(cfg.data.seq_len, cp=p.cp, tp=p.tp, sequence_parallel=p.sequence_parallel, where="data.seq_len")
    return dp


def _stage_lines(cfg: TrainConfig, stages) -> list[str]:
    """One start-of-run line per later data stage: where it starts against the lr decay, and what changes."""
    r, seq = cfg.run, stages[0].seq_len
    decay = decay_start_step(cfg.optim, r.steps)
    lines = []
    for (start, name), stage in zip(stage_starts(cfg.data), stages):  # start_step: the steps done before it
        if start >= r.steps:
            raise ValueError(
                f"data stage {name!r} (start_step {start}) would start at step {start + 1}, after the run's last "
                f"step ({r.steps}): move its start_step below run.steps or remove the stage"
            )
        if start == 0:
            continue
        if decay is None or cfg.optim.schedule != "wsd":
            where = ""
        elif start == decay:
            where = ", with the lr decay"
        else:
            where = (
                f" — {abs(start - decay)} step{'s' * (abs(start - decay) != 1)} "
                f"{'after' if start > decay else 'before'} the lr decay, which starts at step {decay + 1}"
            )
        if (stage.seq_len, stage.model_overrides()) != (seq, stages[0].model_overrides()):
            model = "".join(f", {k} {v}" for k, v in stage.model_overrides().items())
            where += f"; seq_len {stage.seq_len} ({r.global_batch * stage.seq_len:,} tokens per step){model}"
        lines.append(f"data stage {name!r} starts at step {start + 1} (start_step {start}){where}")
    return lines


def stage_model_overrides(cfg: TrainConfig, stage) -> dict:
    """The model settings a resolved data stage runs with: model.* overridden by the stage's (and earlier stages')."""
    return {**cfg.model.overrides(), **stage.model_overrides()}


def _check_stage_model(cfg: TrainConfig, i: int, stage, model_config) -> None:
    """A stage's RoPE settings make a valid config, and its rows fit the model's positions."""
    from ..parallelize import override_config

    overrides = stage_model_overrides(cfg, stage)
    where = f"data stage {stage.name!r}" if cfg.data.stages else "the model"
    try:
        config = override_config(model_config, overrides, loading_weights=False) if overrides else model_config
    except (TypeError, ValueError) as e:  # config_overrides['rope_scaling'] -> rope_scaling
        msg = re.sub(r"config_overrides\['(\w+)'\]", r"\1", str(e)).replace("config_overrides", "the RoPE settings")
        key = f"data.stages[{i}] ({stage.name})" if cfg.data.stages else "model"
        raise ValueError(f"{key}: {msg}") from None
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is None or stage.seq_len <= max_pos:
        return
    given = [j for j, s in enumerate(cfg.data.stages[: i + 1]) if s.seq_len is not None]
    key = f"data.stages[{given[-1]}].seq_len" if given else "data.seq_len"
    rope = {k: v for k, v in overrides.items() if k != "max_position_embeddings"}
    if not rope:
        raise ValueError(
            f"{key}={stage.seq_len} is longer than the model's max_position_embeddings={max_pos}"
            f"{' in ' + where if cfg.data.stages else ''} and "
            "no RoPE setting changes: shorten it, or raise max_position_embeddings with rope_theta or "
            "rope_scaling (model.* or in the stage)"
        )
    raise ValueError(
        f"{key}={stage.seq_len} is longer than the max_position_embeddings={max_pos} of {where}, which changes "
        f"RoPE ({', '.join(rope)}): set max_position_embeddings to at least {stage.seq_len} there (the exported "
        "config.json says it)"
    )


def stage_starts(data: DataConfig) -> list[tuple[int, str]]:
    return [(s.start_step, s.name) for s in data.resolved_stages()]
