"""A run before its first step: the checks that need no weights, the model, the data pipeline, the optimizer and
the accelerate front end; the resume (only what the checkpoint section asks for); what the run prints at start."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..checkpoint.load import load_checkpoint
from ..checkpoint.marker import is_complete
from ..checkpoint.rotation import clean_leftovers, later_saves, resolve_resume
from ..checkpoint.save import PendingCheckpoint
from ..evaluation.evaluator import Evaluator, load_tasks
from ..models import get_adapter
from ..parallel.attention import flash_attn_installed, resolve_attn_implementation
from ..parallel.compile import resolve_compile
from ..parallel.mesh import device_type, on_rank0
from ..parallel.rng import seed_streams
from ..utils import files
from ..utils.faults import RunState, store_barrier
from .agreement import check_config, check_data
from .checks import check_launch, check_run
from .config import DTYPES, ModelConfig, TrainConfig
from .lr_schedules import base_lr, build_lr_scheduler
from .memory_check import plan_line, plan_run
from .metrics import (
    available_trackers,
    device_peak_flops,
    tracker_install_hint,
)
from .rope_stages import StageRoPE


def _load_model(cfg: ModelConfig, pcfg, document_masking: bool, moe, precision):
    """The parallel model. A weightless HF directory is initialised from its config by `parallelize`
    itself: every rank draws the stock init in stock order and keeps only its own slices, so the
    model equals `torch.manual_seed(init_seed); from_config(config, dtype=torch.float32)` (then cast
    to model.dtype) at any mesh."""
    from ..parallelize import parallelize

    pmodel = parallelize(
        cfg.path,
        pcfg,
        seed=cfg.init_seed,
        dtype=DTYPES[cfg.dtype],
        attn_implementation=resolve_attn_implementation(
            cfg.attn_implementation,
            device_type(),
            document_masking=document_masking,
            flash_available=flash_attn_installed(),
            cp=pcfg.cp,
            compiled=pcfg.compile,
        ),
        config_overrides=cfg.overrides() or None,
        moe_load_balance=moe.load_balance,
        moe_bias_rate=moe.bias_update_rate,
        fp8=precision.fp8_config(),
    )
    if is_complete(cfg.path):  # start from a checkpoint's weights: step 0, fresh optimizer
        load_checkpoint(cfg.path, pmodel)
    return pmodel


def _model_config(cfg: ModelConfig):
    from transformers import AutoConfig

    if not Path(cfg.path).exists() and (cfg.path.startswith((".", "/", "~")) or cfg.path.count("/") > 1):
        raise ValueError(
            f"model.path {cfg.path!r} does not exist: give an HF model directory, an hf3d checkpoint or a Hub id "
            "(NAMESPACE/NAME)"
        )
    try:
        return AutoConfig.from_pretrained(cfg.path)
    except OSError as e:
        raise ValueError(
            f"model.path {cfg.path!r} is neither a local model directory (with config.json) nor a Hub model id "
            f"that can be reached: {str(e).splitlines()[0]}"
        ) from None


MEMORY_LABELS = {  # opt.memory_report()'s keys, as the start line names them
    "params": "weights",
    "master_weights": "fp32 master weights",
    "main_grads": "fp32 gradients",
    "grad_bucket": "+ a bucket in flight",
    "gathered_unit": "+ gathered at the peak",
    "optimizer_state": "optimizer state",
    "total": "total",
}


def report_memory(opt, out: Path, rank0: bool, write) -> None:
    """Every rank's training-state bytes written to <output_dir>/memory.json, and one line of them at the start: each
    part's MiB per rank (a range where the ranks differ, as pipeline stages do), under the run's zero stage."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, opt.memory_report())
    if not rank0:
        return
    files.write_file(out / "memory.json", json.dumps(reports, indent=1), replace=True)
    parts = []
    for key, label in MEMORY_LABELS.items():
        values = [rep.get(key, 0) / 2**20 for rep in reports]
        if key in reports[0] and (max(values) > 0 or key in ("params", "main_grads", "optimizer_state")):
            lo, hi = min(values), max(values)
            parts.append(f"{label} {lo:.2f}" + ("" if f"{lo:.2f}" == f"{hi:.2f}" else f"-{hi:.2f}"))
    head = f"hf3d: training state per rank (MiB, ZeRO-{opt.zero_stage}; each rank's in memory.json): "
    write(head + ", ".join(parts))


@dataclasses.dataclass
class Run:
    """What the phases of one `hf3d train` run share."""

    cfg: TrainConfig
    pmodel: object
    opt: object
    pipe: object
    acc: object
    out: Path
    rank0: bool
    trackers: list
    sched: object = None
    start: int = 0
    saved: dict = dataclasses.field(default_factory=dict)
    mlp_costs: list | None = None  # each layer's MLP parameters a token meets, for the FLOPs (MoE layers differ)
    resume_from: Path | None = None
    saved_to: Path | None = None
    pending: PendingCheckpoint | None = None  # checkpoint.async: the save being written in the background
    schedule_change: str | None = None  # the resume line when run.steps changed (_schedule_change)
    later_saves_line: str | None = None  # said at start when checkpoint.replace_later_steps lets it replace some
    flops_per_token: float = 0.0
    peak_flops: float | None = None  # of one device, when known (MFU)
    rope: StageRoPE | None = None  # the model's RoPE settings follow the data stages
    evaluator: object = None  # evals: the downstream tasks, tokenised and packed once (hf3d/evaluation)
    tokenizer: object = None  # the model folder's (samples: text generated during the run)
    told: set = dataclasses.field(default_factory=set)  # the checkpoints rotation said it keeps (once each)
    pusher: object = None  # checkpoint.push_to_hub, rank 0: hub_push.CheckpointPusher
    hub_pins: frozenset = frozenset()  # without it: checkpoints an earlier run left waiting for a push (rank 0)
    plan: list | None = None  # rank 0: the memory plan of the run's mesh, each pipeline rank's bytes (memory_check)
    meter: object = None  # the first step's activation meter (on a CPU)


def build_run(cfg: TrainConfig, state: RunState) -> tuple[Run, list[str], list[str]]:
    """Checks, then the model, the data pipeline, the optimizer and the accelerate front end."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from ..data import DataPipeline
    from ..integrations.accelerate import prepare
    from ..parallel.mesh import init_distributed

    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first call
        torch.use_deterministic_algorithms(True)
    plan = plan_run(cfg, lambda: _model_config(cfg.model))  # rank 0, before the process group (a fake one of its own)
    init_distributed(cfg.run.collective_timeout_s)
    check_config(cfg)  # every node runs this config and these versions, or no rank goes on
    if not Path(cfg.model.path).exists():  # a Hub id: the checks that need no model config come before its lookup
        check_launch(cfg, world_size=dist.get_world_size())
    base_config = _model_config(cfg.model)  # before any RoPE override: each stage's settings apply to it
    derived = check_run(cfg, world_size=dist.get_world_size(), model_config=base_config)
    check_optimizer(cfg, world_size=dist.get_world_size())
    # "auto" becomes what runs (the resolved config records it; the derived values say why)
    cfg.parallel.compile, _ = resolve_compile(cfg.parallel.compile, device_type(), base_config)
    tasks = load_tasks(cfg.evals) if cfg.evals.active(cfg.run.steps) else []  # a bad file: before the model
    pmodel = _load_model(cfg.model, cfg.parallel, cfg.data.document_masking, cfg.moe, cfg.precision)
    state.locate(pmodel.mesh)
    from ..utils.tokens import load_tokenizer

    tokenizer = load_tokenizer(pmodel.tokenizer_dir or cfg.model.path)
    pipe = DataPipeline(
        cfg.data,
        tokenizer,
        global_batch=cfg.run.global_batch,
        dp_rank=pmodel.dp_rank,
        dp_size=pmodel.dp_size,
        total_steps=cfg.run.steps,
        local_main=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        barrier=lambda: store_barrier("data"),
        show_progress=dist.get_rank() == 0,  # every node's main tokenises; the job shows the bars once
    )
    check_data(pipe, tokenizer)  # and reads the same tokens
    opt = _build_optimizer(pmodel, cfg.optim, derived)
    pmodel.deferred_checks = True  # a bad id is read in opt.step()'s one host sync (hf3d/model.py)
    out = Path(cfg.run.output_dir)
    trackers, missing = available_trackers(cfg.run.report_to)
    # the loop is an accelerate loop: trackers, and the same refusals as any hf3d.prepare user
    acc = Accelerator(cpu=pmodel.device.type == "cpu", log_with=trackers or None, project_dir=str(out))
    pmodel, opt = prepare(acc, pmodel, opt)
    run = Run(cfg, pmodel, opt, pipe, acc, out, rank0=dist.get_rank() == 0, trackers=trackers)
    run.plan = plan
    run.mlp_costs = get_adapter(pmodel.config.model_type).mlp_costs(pmodel.config)
    run.peak_flops = device_peak_flops()
    run.tokenizer = tokenizer
    run.rope = StageRoPE(cfg, pmodel, pipe, base_config, tqdm.write if run.rank0 else None)
    if tasks:  # scoring rows shaped as a training micro-batch: data.seq_len tokens, a micro-batch's rows
        evals = dataclasses.replace(cfg.evals, max_length=cfg.evals.max_length or pipe.seq_len(0))
        rows = cfg.run.global_batch // pmodel.dp_size // cfg.parallel.num_microbatches
        run.evaluator = Evaluator(pmodel, tasks, tokenizer, evals, default_rows=rows)
        derived += run.evaluator.summary()
    return run, derived, missing


def resume_run(run: Run) -> None:
    """Only the parts of the checkpoint that the checkpoint section asks for; then the lr schedule."""
    cfg, opt = run.cfg, run.opt
    o, r, c = cfg.optim, cfg.run, cfg.checkpoint
    on_rank0(lambda: clean_leftovers(run.out / "checkpoints"))  # what killed saves and removals left
    run.resume_from = resolve_resume(c.resume, run.out / "checkpoints")
    seed_streams(run.pmodel, r.seed)  # per-rank dropout streams; a resume at this mesh restores them instead
    offset = 0
    if run.resume_from is not None:
        if run.pmodel.router_stats is not None:  # the expert bias of aux-loss-free balancing
            run.saved["moe"] = run.pmodel.router_stats
        step = load_checkpoint(run.resume_from, run.pmodel, opt if c.load_optimizer else None, extra=run.saved)
        run.start = step if c.load_step else 0
        offset = run.start if not c.load_scheduler else 0  # a restarted schedule spans the steps left
        if c.load_data_position and "data" in run.saved:
            run.pipe.load_state_dict(run.saved["data"])
    for group in opt.param_groups:  # the schedule's peak lr (times µP's scale), whatever the checkpoint held
        group["lr"] = peak_lr(o, group) * group.get("lr_scale", 1.0)
        group.pop("initial_lr", None)
    _refuse_replacing_later_saves(run)
    if run.start > r.steps:
        raise ValueError(
            f"the run resumed from {run.resume_from} is already at step {run.start}, past run.steps={r.steps}: raise "
            "run.steps to train further, or set checkpoint.resume: none to start over"
        )
    run.sched = _lr_scheduler(opt, o, max(1, r.steps - offset))  # a complete run (start == steps) trains nothing
    if run.resume_from is not None and c.load_scheduler and "scheduler" in run.saved:
        run.sched.load_state_dict(run.saved["scheduler"])
        run.schedule_change = _schedule_change(run)


def check_optimizer(cfg: TrainConfig, *, world_size: int) -> None:
    """optim.name: muon against the mesh, before the model loads: Muon steps whole matrices, which ZeRO-2/3 and HSDP
    cut (hf3d/optim/muon.py)."""
    o, p = cfg.optim, cfg.parallel
    if o.name != "muon":
        return
    dp = p.dp or world_size // (p.tp * p.pp * p.cp)
    hsdp = p.dp_shard is not None and p.dp_shard != dp
    if p.zero_stage >= 2 or hsdp:
        got = f"parallel.zero_stage={p.zero_stage}" + (f", parallel.dp_shard={p.dp_shard}" if hsdp else "")
        raise ValueError(
            f"optim.name: muon runs at parallel.zero_stage 0 or 1 without parallel.dp_shard (got {got}): Muon steps "
            "whole matrices, which ZeRO-2/3 and HSDP cut; set parallel.zero_stage: 1 and leave dp_shard unset, or "
            "use optim.name: adamw"
        )


def _build_optimizer(pmodel, o, derived: list[str]):
    """hf3d.build_optimizer as the optim section says: AdamW, or Muon on the hidden matrices with AdamW (optim.lr,
    betas, eps, weight_decay) on the rest; a line for the derived values names the split."""
    from ..optim.build import build_optimizer

    common = dict(
        max_grad_norm=o.max_grad_norm or None,
        bucket_size=o.bucket_size,
        exclude_from_weight_decay=o.no_decay_rule(),
        state_precision=o.state_precision,
    )
    adamw = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return build_optimizer(pmodel, torch.optim.AdamW, **adamw, **common)
    from ..optim.muon import muon_names

    m = o.muon
    try:
        opt = build_optimizer(
            pmodel,
            torch.optim.Muon,
            lr=m.lr,
            momentum=m.momentum,
            nesterov=m.nesterov,
            ns_steps=m.ns_steps,
            adjust_lr_fn=m.adjust_lr_fn,
            weight_decay=m.weight_decay,
            adamw=adamw,
            muon_params=m.params,
            **common,
        )
    except ValueError as e:  # build_optimizer's keyword, as the YAML names it
        raise ValueError(str(e).replace("muon_params", "optim.muon.params")) from None
    n = len(muon_names(pmodel, m.params))
    derived.append(
        f"optimizer: Muon (lr {m.lr:g}) on {n} matrices ({'optim.muon.params' if m.params else 'the hidden ones'}), "
        f"AdamW (optim.lr {o.lr:g}) on the other parameters; the schedule scales both lrs alike"
    )
    return opt


def peak_lr(o, group: dict) -> float:
    """The schedule's peak lr of an optimizer param group before µP's scale: optim.muon.lr for Muon's groups (they
    carry its Newton-Schulz settings), optim.lr for the others."""
    return o.muon.lr if o.name == "muon" and "ns_steps" in group else o.lr


def _lr_scheduler(opt, o, total_steps: int):
    """build_lr_scheduler's schedule as a factor on each group's own peak lr (Muon's groups peak at optim.muon.lr)."""
    return build_lr_scheduler(opt, o, total_steps, peak_of=lambda group: peak_lr(o, group))


def _mup_lines(run: Run) -> list[str]:
    """One line under parallel.parametrization: spectral_mup: the widths, the lr scales of the optimizer's groups
    and the output multiplier (nothing under standard parametrization)."""
    p = run.cfg.parallel
    if p.parametrization != "spectral_mup":
        return []
    width = run.pmodel.config.hidden_size
    scales = sorted({float(g.get("lr_scale", 1.0)) for g in run.opt.param_groups})
    o = run.cfg.optim
    lrs = f"optim.lr {o.lr:g} is" if o.name == "adamw" else f"optim.lr {o.lr:g} and optim.muon.lr {o.muon.lr:g} are"
    return [
        f"spectral µP: hidden_size {width} over mup_base_width {p.mup_base_width} ({width / p.mup_base_width:g}x); "
        f"lr scales {', '.join(f'{x:g}' for x in scales)} across {len(run.opt.param_groups)} parameter groups "
        f"({lrs} the proxy's); output multiplier {p.mup_output_multiplier:g}"
    ]


def _refuse_replacing_later_saves(run: Run) -> None:
    """A run told to go on from an earlier step than checkpoints of its own output folder (resume: PATH or none,
    load_step: false), which are another trajectory's, is refused in one line naming them, unless
    checkpoint.replace_later_steps lets it replace them. resume: auto goes on from the run's newest save: what
    lies past it is damaged (retrained) or was announced when a run went back to an earlier one."""
    c, root = run.cfg.checkpoint, run.out / "checkpoints"
    if c.resume == "auto" and c.load_step:
        return
    later = later_saves(root, run.start, run.resume_from)
    if not later:
        return
    names = ", ".join(d.name for d in later)
    frm = f"from {run.resume_from}" if run.resume_from is not None else "from the start (no checkpoint resumed)"
    if not c.replace_later_steps:
        raise ValueError(
            f"the run goes on at step {run.start + 1} {frm}, and {root} holds checkpoints of later steps from "
            f"another trajectory ({names}) that its saves would replace: set checkpoint.replace_later_steps: true "
            "to replace them as the run reaches their steps, or choose another run.output_dir"
        )
    run.later_saves_line = (
        f"checkpoint.replace_later_steps: the later checkpoints of another trajectory ({names}) are replaced as "
        "the run reaches their steps, and keep_last rotates them away with the run's older saves"
    )


def _schedule_change(run: Run) -> str | None:
    """One line when a resumed schedule's length differs from the one the checkpoint was trained under:
    the schedule is rebuilt over the new run.steps at the same position, so the lr can move at once
    (under cosine or linear it jumps; under WSD only the stable phase changes until the decay)."""
    old, new = run.saved.get("run_steps"), run.cfg.run.steps
    if old is None or old == new or run.start == new:
        return None
    before = run.saved.get("lr")
    after = base_lr(run.opt)
    was = f"lr {before:.3g} at step {run.start}, " if before is not None else ""
    return (
        f"run.steps changed from {old} to {new} since the checkpoint: the {run.cfg.optim.schedule} schedule now "
        f"spans {new} steps instead of {old}: {was}lr {after:.3g} at step {run.start + 1}"
    )


def announce(run: Run, derived: list[str], missing: list[str]) -> None:
    """The output folder, the resolved config (printed and saved), the derived values, the trackers."""
    from tqdm.auto import tqdm

    cfg, c = run.cfg, run.cfg.checkpoint
    say = tqdm.write
    if run.rank0:
        run.out.mkdir(parents=True, exist_ok=True)
        moved = files.claim_run(run.out)  # before anything is written: a moved or copied run folder is this run's
        if moved is not None:
            say(
                f"hf3d: {run.out} was moved or copied here as a whole: its {moved} checkpoint and export folder(s) "
                "are this run's own"
            )
        resolved = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        files.write_file(run.out / "config.yaml", resolved, replace=True)
        say("hf3d: resolved config (also in " + str(run.out / "config.yaml") + "):\n" + resolved.rstrip())
        p = cfg.parallel
        mesh = f"pp={p.pp} dp={run.pmodel.dp_size}" + (f" ep={p.ep}" if p.ep > 1 else "") + f" cp={p.cp} tp={p.tp}"
        say(f"hf3d: mesh {mesh} on {dist.get_world_size()} processes")
        if run.plan is not None:
            say(plan_line(run.plan))
        if cfg.precision.fp8 != "off":
            n = len(run.pmodel.fp8_projections)
            say(
                f"hf3d: fp8 {cfg.precision.fp8}: {n} projection(s) of this rank's layers in FP8 (torchao); the head, "
                f"embeddings, norms, routers and experts in {cfg.model.dtype}"
                + (
                    f"; ZeRO-3 gathers {len(run.pmodel.fp8_gathered)} weight(s) in float8"
                    if run.pmodel.fp8_gathered
                    else ""
                )
            )
        for line in derived + run.pipe.summary() + _mup_lines(run):
            say(f"hf3d: {line}")
        if missing:
            say(tracker_install_hint(missing))
        if run.resume_from is not None:
            parts = [k for k in ("optimizer", "scheduler", "step", "data_position") if getattr(c, f"load_{k}")]
            restored = ", ".join(parts) or "weights only"
            at = (
                f"{run.start} steps done, training goes on at step {run.start + 1}"
                if run.start
                else "the step count starts over at step 1"
            )
            say(f"hf3d: resumed from {run.resume_from} (restored: {restored}): {at}")
            if run.schedule_change:
                say(f"hf3d: {run.schedule_change}")
        if run.later_saves_line:
            say(f"hf3d: warning: {run.later_saves_line}")
        if run.start == cfg.run.steps:
            say(f"hf3d: the run is complete at step {run.start} (run.steps); writing its final outputs again")
    if run.trackers:
        flat = {
            f"{sec}.{k}": v if isinstance(v, int | float | str | bool) else str(v)
            for sec, d in cfg.to_dict().items()
            for k, v in d.items()
        }
        run.acc.init_trackers("hf3d", config=flat)
