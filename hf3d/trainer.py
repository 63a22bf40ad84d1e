"""`hf3d train`: a YAML config (hf3d/train_config.py) -> parallel model, data pipeline, ZeRO optimizer and
lr schedule -> steps, evaluation, checkpoints, metrics -> an HF export, a loss curve and a model card.

The order of a run: every check that needs no data or weights (check_run) -> model -> data (tokenised
once per node, cached) -> optimizer -> resume (only the parts the checkpoint section asks for) ->
the output directory is created, the resolved config printed and saved -> steps.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import yaml

from . import files
from .attention import flash_attn_installed, resolve_attn_implementation
from .checkpoint import (
    PendingCheckpoint,
    finish_save,
    is_complete,
    load_checkpoint,
    prepare_async_save,
    resolve_resume,
    save_checkpoint,
)
from .compile import resolve_compile
from .expert_parallel import load_imbalance
from .faults import RunState, is_communication_error, leave, root_cause, store_barrier
from .hub import SUMMARY_FILE
from .mesh import device_type, on_rank0
from .metrics import (
    MetricsWriter,
    available_trackers,
    device_peak_flops,
    flops_per_token,
    peak_memory_bytes,
    tracker_install_hint,
)
from .metrics import throughput as throughput_metrics
from .models import get_adapter
from .rng import seed_streams
from .rope_stages import StageRoPE
from .schedules import build_lr_scheduler
from .train_config import DTYPES, ModelConfig, RunConfig, TrainConfig, check_run

__all__ = ["TrainConfig", "train"]


def _load_model(cfg: ModelConfig, pcfg, document_masking: bool, moe, precision):
    """The parallel model. A weightless HF directory is initialised from its config by `parallelize`
    itself: every rank draws the stock init in stock order and keeps only its own slices, so the
    model equals `torch.manual_seed(init_seed); from_config(config, dtype=torch.float32)` (then cast
    to model.dtype) at any mesh."""
    from . import parallelize

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


def _report_memory(opt, out: Path, rank0: bool, write) -> None:
    """Every rank's training-state bytes, printed and written to <output_dir>/memory.json."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, opt.memory_report())
    if rank0:
        files.write_file(out / "memory.json", json.dumps(reports, indent=1), replace=True)
        for r, rep in enumerate(reports):
            write(f"hf3d: rank {r} training state (MiB): " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in rep.items()))


def evaluate(pmodel, batches: list[dict]) -> float:
    """The token-mean cross-entropy over the held-out batches (all dp ranks' rows), on every rank."""
    was_training = pmodel.training
    pmodel.eval()
    loss_sum = count = 0.0
    for b in batches:
        s, n = pmodel.eval_loss(b["input_ids"], shift_labels=b["shift_labels"], position_ids=b["position_ids"])
        loss_sum, count = loss_sum + float(s), count + float(n)
    pmodel.train(was_training)
    return loss_sum / max(count, 1.0)


@dataclasses.dataclass
class _Run:
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
    flops_per_token: float = 0.0
    peak_flops: float | None = None  # of one device, when known (MFU)
    rope: StageRoPE | None = None  # the model's RoPE settings follow the data stages


def train(cfg: TrainConfig, state: RunState | None = None) -> dict:
    """Run training; returns the last step's metrics."""
    from tqdm.auto import tqdm

    state = state or RunState()
    run, derived, missing = _build(cfg, state)
    _resume(run)
    _announce(run, derived, missing)
    r = cfg.run
    metrics = MetricsWriter(run.out, enabled=run.rank0, resume_step=run.start if run.resume_from is not None else None)
    eval_batches = run.pipe.eval_batches()
    record: dict = {}
    bar = tqdm(total=r.steps, initial=run.start, disable=not run.rank0, desc="train", unit="step", dynamic_ncols=True)
    stop = StopSignal(run.pmodel.device)
    health = StepHealth(r, skipped=int(run.saved.get("skipped_steps", 0)) if run.start else 0)
    for step in range(run.start, r.steps):
        state.step = step + 1
        try:
            record, signum = _step(run, step, health, stop)
            if step == run.start and cfg.checkpoint.async_ and cfg.checkpoint.every:
                prepare_async_save(run.pmodel, run.opt)  # the optimizer's state exists: stage buffers now
            if eval_batches and ((step + 1) % run.pipe.eval_every == 0 or step + 1 == r.steps):
                record["eval_loss"] = evaluate(run.pmodel, eval_batches)
                record["eval_ppl"] = float(torch.tensor(record["eval_loss"]).exp())
            metrics.write(record)  # before the checkpoint: a kill after its publication loses no step's record
            _checkpoint_and_stop(run, step, record, health, signum)
        except Exception as e:
            _let_the_write_finish(run, e)
            raise
        if run.trackers:
            run.acc.log(record, step=step + 1)
        if step == run.start:  # optimizer state exists from the first step on
            _report_memory(run.opt, run.out, run.rank0, tqdm.write)
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_sec']:.0f}")
        bar.update(1)
        if run.rank0 and ((step + 1) % r.log_every == 0 or "eval_loss" in record):
            tqdm.write(_log_line(record, r.steps))
    bar.close()
    for tracker in run.acc.trackers:  # not acc.end_training(): it would also end torch.distributed
        tracker.finish()
    run.rope.enter(r.steps - 1)  # a run complete at its resume exports the last stage's settings too
    _finish(cfg, run.pmodel, run.out, metrics.path, record, run.rank0)
    return record


def _build(cfg: TrainConfig, state: RunState) -> tuple[_Run, list[str], list[str]]:
    """Checks, then the model, the data pipeline, the optimizer and the accelerate front end."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from . import build_optimizer, prepare
    from .data import DataPipeline
    from .mesh import init_distributed

    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first call
        torch.use_deterministic_algorithms(True)
    init_distributed(cfg.run.collective_timeout_s)
    base_config = _model_config(cfg.model)  # before any RoPE override: each stage's settings apply to it
    derived = check_run(cfg, world_size=dist.get_world_size(), model_config=base_config)
    # "auto" becomes what runs (the resolved config records it; the derived values say why)
    cfg.parallel.compile, _ = resolve_compile(cfg.parallel.compile, device_type(), base_config)
    pmodel = _load_model(cfg.model, cfg.parallel, cfg.data.document_masking, cfg.moe, cfg.precision)
    state.locate(pmodel.mesh)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pmodel.tokenizer_dir or cfg.model.path)
    pipe = DataPipeline(
        cfg.data,
        tokenizer,
        global_batch=cfg.run.global_batch,
        dp_rank=pmodel.dp_rank,
        dp_size=pmodel.dp_size,
        total_steps=cfg.run.steps,
        local_main=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        barrier=lambda: store_barrier("data"),
    )
    o = cfg.optim
    opt = build_optimizer(
        pmodel,
        torch.optim.AdamW,
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm or None,
        bucket_size=o.bucket_size,
        exclude_from_weight_decay=o.no_decay_rule(),
    )
    pmodel.deferred_checks = True  # a bad id is read in opt.step()'s one host sync (hf3d/model.py)
    out = Path(cfg.run.output_dir)
    trackers, missing = available_trackers(cfg.run.report_to)
    # the loop is an accelerate loop: trackers, and the same refusals as any hf3d.prepare user
    acc = Accelerator(cpu=pmodel.device.type == "cpu", log_with=trackers or None, project_dir=str(out))
    pmodel, opt = prepare(acc, pmodel, opt)
    run = _Run(cfg, pmodel, opt, pipe, acc, out, rank0=dist.get_rank() == 0, trackers=trackers)
    run.mlp_costs = get_adapter(pmodel.config.model_type).mlp_costs(pmodel.config)
    run.peak_flops = device_peak_flops()
    run.rope = StageRoPE(cfg, pmodel, pipe, base_config, tqdm.write if run.rank0 else None)
    return run, derived, missing


def _resume(run: _Run) -> None:
    """Only the parts of the checkpoint that the checkpoint section asks for; then the lr schedule."""
    cfg, opt = run.cfg, run.opt
    o, r, c = cfg.optim, cfg.run, cfg.checkpoint
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
    for group in opt.param_groups:  # the schedule's peak lr, whatever the checkpoint's groups held
        group["lr"] = o.lr
        group.pop("initial_lr", None)
    if run.start > r.steps:
        raise ValueError(
            f"the run resumed from {run.resume_from} is already at step {run.start}, past run.steps={r.steps}: raise "
            "run.steps to train further, or set checkpoint.resume: none to start over"
        )
    run.sched = build_lr_scheduler(opt, o, max(1, r.steps - offset))  # a complete run (start == steps) trains nothing
    if run.resume_from is not None and c.load_scheduler and "scheduler" in run.saved:
        run.sched.load_state_dict(run.saved["scheduler"])
        run.schedule_change = _schedule_change(run)


def _schedule_change(run: _Run) -> str | None:
    """One line when a resumed schedule's length differs from the one the checkpoint was trained under:
    the schedule is rebuilt over the new run.steps at the same position, so the lr can move at once
    (under cosine or linear it jumps; under WSD only the stable phase changes until the decay)."""
    old, new = run.saved.get("run_steps"), run.cfg.run.steps
    if old is None or old == new or run.start == new:
        return None
    before = run.saved.get("lr")
    after = run.opt.param_groups[0]["lr"]
    was = f"lr {before:.3g} at step {run.start}, " if before is not None else ""
    return (
        f"run.steps changed from {old} to {new} since the checkpoint: the {run.cfg.optim.schedule} schedule now "
        f"spans {new} steps instead of {old}: {was}lr {after:.3g} at step {run.start + 1}"
    )


def _announce(run: _Run, derived: list[str], missing: list[str]) -> None:
    """The output folder, the resolved config (printed and saved), the derived values, the trackers."""
    from tqdm.auto import tqdm

    cfg, c = run.cfg, run.cfg.checkpoint
    say = tqdm.write
    if run.rank0:
        run.out.mkdir(parents=True, exist_ok=True)
        resolved = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        files.write_file(run.out / "config.yaml", resolved, replace=True)
        say("hf3d: resolved config (also in " + str(run.out / "config.yaml") + "):\n" + resolved.rstrip())
        p = cfg.parallel
        mesh = f"pp={p.pp} dp={run.pmodel.dp_size}" + (f" ep={p.ep}" if p.ep > 1 else "") + f" cp={p.cp} tp={p.tp}"
        say(f"hf3d: mesh {mesh} on {dist.get_world_size()} processes")
        if cfg.precision.fp8 != "off":
            n = len(run.pmodel.fp8_projections)
            say(
                f"hf3d: fp8 {cfg.precision.fp8}: {n} projection(s) of this rank's layers in FP8 (torchao); the head, "
                f"embeddings, norms, routers and experts in {cfg.model.dtype}"
            )
        for line in derived + run.pipe.summary():
            say(f"hf3d: {line}")
        if missing:
            say(tracker_install_hint(missing))
        if run.resume_from is not None:
            parts = [k for k in ("optimizer", "scheduler", "step", "data_position") if getattr(c, f"load_{k}")]
            restored = ", ".join(parts) or "weights only"
            say(f"hf3d: resumed from {run.resume_from} at step {run.start} (restored: {restored})")
            if run.schedule_change:
                say(f"hf3d: {run.schedule_change}")
        if run.start == cfg.run.steps:
            say(f"hf3d: the run is complete at step {run.start} (run.steps); writing its final outputs again")
    if run.trackers:
        flat = {
            f"{sec}.{k}": v if isinstance(v, int | float | str | bool) else str(v)
            for sec, d in cfg.to_dict().items()
            for k, v in d.items()
        }
        run.acc.init_trackers("hf3d", config=flat)


def _step(run: _Run, step: int, health: StepHealth, stop: StopSignal) -> tuple[dict, int]:
    """One optimizer step: batch, forward + backward, update, lr; returns its metrics record and the
    stop signal the ranks agreed on (0: none). One host sync: the loss, the z-loss, the stop flag and
    the out-of-vocabulary flag are read with the grad norm inside opt.step()."""
    from tqdm.auto import tqdm

    cfg, pmodel, opt, pipe = run.cfg, run.pmodel, run.opt, run.pipe
    run.rope.enter(step)  # a stage with other RoPE settings: the model's change in place
    run.flops_per_token = flops_per_token(pmodel.config, pipe.seq_len(step), run.mlp_costs)
    lr = opt.param_groups[0]["lr"]
    t0 = time.perf_counter()
    batch = pipe.next_batch(step)
    data_s = time.perf_counter() - t0
    loss = pmodel.train_step(
        batch["input_ids"],
        shift_labels=batch["shift_labels"],
        position_ids=batch["position_ids"],
        z_loss=cfg.optim.z_loss,
    )
    riders = {"loss": loss, "stop": stop.agree()}
    if cfg.optim.z_loss:
        riders["z_loss"] = pmodel.last_z_loss
    if pmodel.last_aux_loss is not None:
        riders["aux_loss"] = pmodel.last_aux_loss
    load = pmodel.expert_load()
    if load is not None:  # read in the step's one host sync, not one of its own
        riders.update(load_imbalance(load, pmodel.router_stats.layers))
    opt.read_with_step(**riders)
    opt.step()
    values = opt.last_values
    run.sched.step()
    opt.zero_grad()
    elapsed = time.perf_counter() - t0
    warning = health.check(step + 1, values["loss"], values["grad_norm"], opt)
    if warning and run.rank0:
        tqdm.write(f"hf3d: {warning}")
    consumed = pipe.consumed_tokens
    tokens_per_step = cfg.run.global_batch * pipe.seq_len(step)
    record = {
        "step": step + 1,
        "loss": values["loss"],
        "lr": lr,
        "grad_norm": values["grad_norm"],
        "tokens": sum(consumed.values()),
        "consumed_tokens": sum(consumed.values()),
        **{f"consumed_tokens/{name}": n for name, n in consumed.items()},
        **throughput_metrics(tokens_per_step, elapsed, dist.get_world_size(), run.flops_per_token, run.peak_flops),
        "step_time_s": elapsed,
        "data_time_pct": 100.0 * data_s / elapsed,
        "peak_mem_bytes": peak_memory_bytes(),
        "skipped": opt.last_step_skipped,
        "skipped_steps": health.skipped,
    }
    if cfg.optim.z_loss:
        record["z_loss"] = values["z_loss"]
    if "aux_loss" in values:
        record["moe/aux_loss"] = values["aux_loss"]
    if load is not None:
        record["moe/dropped_tokens"] = 0  # dropless
        record.update({k: v for k, v in values.items() if k.startswith("moe/load_imbalance")})
    if len(pipe.stage_starts) > 1:
        record["stage"] = pipe.stage_index(step)
    return record, int(values["stop"])


def _checkpoint_and_stop(run: _Run, step: int, record: dict, health: StepHealth, signum: int) -> None:
    """A checkpoint every checkpoint.every steps, at the last step and when a stop signal came; after a
    signal, leave with 128 + its number."""
    from tqdm.auto import tqdm

    c = run.cfg.checkpoint
    if signum or (c.every and ((step + 1) % c.every == 0 or step + 1 == run.cfg.run.steps)):
        t1 = time.perf_counter()
        extra = {"scheduler": run.sched, "data": run.pipe, "tokens": record["tokens"], "skipped_steps": health.skipped}
        if run.pmodel.router_stats is not None:
            extra["moe"] = run.pmodel.router_stats
        # the schedule's length and this step's lr (a resume with another run.steps says how the lr moves),
        # and the run's record so far, which `hf3d convert to-hf` writes beside the weights for the model card
        extra.update(run_steps=run.cfg.run.steps, lr=record["lr"])
        if run.rank0:  # extra.pt is written by rank 0, the only rank that writes metrics.jsonl
            extra["training"] = training_summary(run.cfg, run.out / "metrics.jsonl", record)
        path, root = run.out / "checkpoints" / f"step_{step + 1}", run.out / "checkpoints"
        if c.async_:  # `latest` and keep_last follow the publication, in the background (rank 0)
            last = signum or step + 1 == run.cfg.run.steps
            run.pending = save_checkpoint(
                path, run.pmodel, run.opt, step=step + 1, extra=extra, async_=True,
                after_publish=lambda: finish_save(root, c.keep_last, path),
            )  # fmt: skip
            run.saved_to = run.pending.result() if last else path  # a stop or the end waits for the write
            how = "saved" if last else "started (written in the background)"
        else:
            run.saved_to = save_checkpoint(path, run.pmodel, run.opt, step=step + 1, extra=extra)
            on_rank0(lambda: finish_save(root, c.keep_last, path))
            how = "saved"
        if run.rank0:
            tqdm.write(f"hf3d: {how} {run.saved_to} in {time.perf_counter() - t1:.2f} s")
    if signum:
        code = 128 + signum
        if run.rank0:
            tqdm.write(
                f"hf3d: stopped by {signal.Signals(signum).name} after step {step + 1}; resume from {run.saved_to} "
                f"(checkpoint.resume=auto); exit code {code}"
            )
        _leave(code, run.acc)


def _let_the_write_finish(run: _Run, e: Exception) -> None:
    """A rank stopping with an error first lets a checkpoint being written in the background finish here
    (its own part, no collective), so the last checkpoint is published; not when a peer is gone, as the
    write needs every rank."""
    if run.pending is not None and not run.pending.waited and not is_communication_error(root_cause(e)):
        problem = run.pending.join()
        if problem is not None and run.rank0:
            print(f"hf3d: warning: the checkpoint {run.pending.path} was not written: {problem}", file=sys.stderr)


def _leave(code: int, acc) -> NoReturn:
    """End a stopped run at once with `code`, every rank alike, once its checkpoint is saved: trackers
    closed, then faults.leave (all ranks arrive, output flushed, no interpreter teardown)."""
    for tracker in acc.trackers:
        tracker.finish()
    leave(code)


def _log_line(record: dict, steps: int) -> str:
    line = (
        f"step {record['step']}/{steps}: loss {record['loss']:.4f} lr {record['lr']:.2e} "
        f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_sec']:.0f}"
    )
    if "eval_loss" in record:
        line += f" eval_loss {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f})"
    return line


def _finish(cfg: TrainConfig, pmodel, out: Path, metrics_path: Path, last: dict, rank0: bool) -> None:
    """The loss curve, the HF export with its record and card inputs, a sample, and the Hub upload."""
    from tqdm.auto import tqdm

    from .plots import plot_loss_curve

    curve = None
    if rank0:
        stages = [(s.start_step, s.name) for s in cfg.data.resolved_stages()]
        curve = plot_loss_curve(metrics_path, out / "loss_curve.png", title=Path(cfg.model.path).name, stages=stages)
        tqdm.write(f"hf3d: loss curve {curve}" if curve else "hf3d: no loss curve (pip install matplotlib)")
    if not cfg.run.save_final:
        return
    final = out / "final"
    record = {}  # the curve and the run's record go in with the weights: the folder appears complete
    if rank0:
        record[SUMMARY_FILE] = json.dumps(training_summary(cfg, metrics_path, last), indent=1).encode()
        if curve:
            record[curve.name] = curve.read_bytes()
    pmodel.save_pretrained(final, extra_files=record)
    if rank0:
        tqdm.write(f"hf3d: wrote {final} (load it with AutoModelForCausalLM.from_pretrained)")
        if cfg.run.sample_prompt:
            text = _sample(final, cfg.run.sample_prompt)
            files.write_file(out / "sample.txt", text + "\n", replace=True)
            tqdm.write(f"hf3d: sample from {final}:\n{text}")
    if cfg.export.push_to_hub:
        _push_final(cfg, final)


def _sample(model_dir: Path, prompt: str, max_new_tokens: int = 48) -> str:
    """A short sample of the exported model, through stock transformers (what a user of the export gets)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.random.fork_rng(devices=[]):  # the same sample for the same weights; the run's RNG untouched
        torch.manual_seed(0)
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=50, pad_token_id=tok.eos_token_id
        )
    text = tok.decode(out[0], skip_special_tokens=True)
    return text


class StepHealth:
    """Non-finite steps and loss spikes. A step whose gradient norm is inf/NaN was already left out by
    the optimizer (no update); here it is counted, explained (the first parameter whose gradient was
    non-finite), and turned into a stop by run.on_nonfinite=stop or after run.max_consecutive_skips in
    a row. A loss above spike_factor x the recent mean gets a warning line. Every rank decides alike:
    the loss and the norm are global values."""

    WINDOW = 50

    def __init__(self, run: RunConfig, skipped: int = 0):
        self.run, self.skipped, self.in_a_row = run, skipped, 0
        self.recent: collections.deque[float] = collections.deque(maxlen=self.WINDOW)

    def check(self, step: int, loss: float, grad_norm: float, opt) -> str | None:
        """A warning line, None, or a ValueError that stops the run (the last checkpoint stays)."""
        if opt.last_step_skipped:
            self.skipped += 1
            self.in_a_row += 1
            names = opt.nonfinite_parameters()  # collective: every rank skipped this step
            where = (
                f"first parameter with a non-finite gradient: {names[0]}"
                if names
                else "every gradient is finite, their norm overflowed"
            )
            what = f"step {step}: loss {loss:.6g}, grad norm {grad_norm:.6g} ({where})"
            if self.run.on_nonfinite == "stop":
                raise ValueError(
                    f"non-finite {what}; stopped by run.on_nonfinite=stop. Resume from the last checkpoint "
                    "with a lower optim.lr, or set run.on_nonfinite=skip"
                )
            if self.in_a_row >= self.run.max_consecutive_skips:
                raise ValueError(
                    f"{self.in_a_row} steps in a row had a non-finite gradient, the last {what}: the run diverges. "
                    "Resume from the last checkpoint with a lower optim.lr (or raise run.max_consecutive_skips)"
                )
            return f"warning: non-finite {what}: update skipped ({self.skipped} skipped so far)"
        self.in_a_row = 0
        warning = None
        if self.run.spike_factor and len(self.recent) >= 10 and math.isfinite(loss):
            mean = sum(self.recent) / len(self.recent)
            if loss > self.run.spike_factor * mean:
                warning = (
                    f"warning: loss spike at step {step}: {loss:.4f} > {self.run.spike_factor:g} x the mean of "
                    f"the previous {len(self.recent)} steps ({mean:.4f})"
                )
        if math.isfinite(loss):
            self.recent.append(loss)
        return warning


class StopSignal:
    """SIGTERM and SIGINT (preemption, Ctrl-C, torchrun forwarding either) end the run cleanly: the
    handler only records the signal; in each step, after the backward, the ranks agree (one max
    all-reduce, so a signal that reached one rank stops all; its result is read in the step's one host
    sync), then save a checkpoint of that step and exit with 128 + the signal number (143 for SIGTERM,
    130 for SIGINT). A signal that comes later in a step stops the next one. `checkpoint.resume: auto`
    then continues exactly."""

    def __init__(self, device: torch.device):
        self.device, self.received = device, 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.received = signum

    def agree(self) -> torch.Tensor:
        """The largest signal number any rank received (0: none), as a device tensor: no host sync."""
        flag = torch.full((), self.received, dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag


def training_summary(cfg: TrainConfig, metrics_path: Path, last: dict) -> dict:
    """The run's record (hf3d_training.json beside the exported weights; also in each checkpoint's extra,
    which `hf3d convert to-hf` writes out): the model card is made from it (hf3d/hub.py)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.is_file() else []
    curve = [[rec["step"], rec["loss"]] for rec in records]
    evals = [rec["eval_loss"] for rec in records if "eval_loss" in rec]
    base_model, started_from = starting_point(cfg.model.path)
    sources = sorted({s.label for stage in cfg.data.resolved_stages() for s in stage.sources})
    hyper = {k: v for k, v in dataclasses.asdict(cfg.optim).items() if k != "bucket_size"}
    summary = {
        "base_model": base_model,
        "started_from": started_from,
        "datasets": sources,
        "license": cfg.export.license,
        "hyperparameters": {
            **hyper,
            "steps": cfg.run.steps,
            "global_batch": cfg.run.global_batch,
            "seq_len": cfg.data.resolved_stages()[-1].seq_len,
            "document_masking": cfg.data.document_masking,
            "dtype": cfg.model.dtype,
        },
        "parallel": {k: getattr(cfg.parallel, k) for k in ("tp", "pp", "dp", "pp_schedule", "num_microbatches")},
        "tokens_seen": records[-1].get("consumed_tokens", 0) if records else 0,
        "final_loss": curve[-1][1] if curve else last.get("loss"),
        "loss_curve": curve,
    }
    if evals:
        summary["final_eval_loss"] = evals[-1]
    return summary


def starting_point(model_path: str) -> tuple[str | None, str | None]:
    """(the Hub id the weights descend from, or None; the local folder's name they were loaded from, or
    None). A local folder's own record names its Hub origin: an export's hf3d_training.json, a
    checkpoint's training summary, or config.json's `_name_or_path` when it is a Hub id."""
    path = Path(model_path)
    if not path.exists():
        return (model_path if model_path.count("/") == 1 else None), None
    if not (path / "model.safetensors").is_file() and not is_complete(path) and not any(path.glob("*.safetensors")):
        return None, None  # a config-only folder: initialised from scratch
    recorded: dict = {}
    if (path / SUMMARY_FILE).is_file():
        recorded = json.loads((path / SUMMARY_FILE).read_text())
    elif (path / "extra.pt").is_file():
        recorded = torch.load(path / "extra.pt", weights_only=True).get("training") or {}
    base = recorded.get("base_model")
    if base is None and (path / "config.json").is_file():
        name = json.loads((path / "config.json").read_text()).get("_name_or_path")
        base = name if isinstance(name, str) and name.count("/") == 1 and not Path(name).exists() else None
    return base, path.resolve().name


def _push_final(cfg: TrainConfig, final: Path) -> None:
    """Rank 0 uploads; a failure is raised on every rank (no rank is left waiting)."""
    from .hub import push_to_hub
    from .mesh import on_rank0

    def push() -> None:
        url = push_to_hub(final, cfg.export.push_to_hub, private=cfg.export.private)
        print(f"hf3d: pushed {final} to {url}")

    on_rank0(push)
