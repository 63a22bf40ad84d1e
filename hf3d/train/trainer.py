"""`hf3d train`: a YAML config (hf3d/train/config.py) -> parallel model, data pipeline, ZeRO optimizer and
lr schedule -> steps, evaluation, checkpoints, metrics -> an HF export, a loss curve and a model card.

The order of a run: every check that needs no data or weights (check_run) -> model -> data (tokenised
once per node, cached) -> optimizer -> resume (only the parts the checkpoint section asks for) ->
the output directory is created, the resolved config printed and saved -> steps.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import NoReturn

from ..checkpoint.rotation import finish_save, prune_saves, step_dirs
from ..checkpoint.save import prepare_async_save, save_checkpoint
from ..parallel.mesh import on_rank0
from ..utils.faults import RunState, is_communication_error, leave, root_cause
from .build import Run, announce, build_run, report_memory, resume_run
from .config import TrainConfig
from .finish import finish_run, training_summary
from .hub_push import CheckpointPusher, pending_checkpoints
from .memory_check import report as report_plan
from .metrics import (
    MetricsWriter,
)
from .step import (
    DOWNSTREAM,
    StepHealth,
    StopSignal,
    downstream,
    downstream_due,
    evaluate,
    log_line,
    one_step,
    samples,
)
from .watchdog import Watchdog

__all__ = ["TrainConfig", "train"]


def train(cfg: TrainConfig, state: RunState | None = None) -> dict:
    """Run training; returns the last step's metrics."""
    from tqdm.auto import tqdm

    state = state or RunState()
    run, derived, missing = build_run(cfg, state)
    resume_run(run)
    announce(run, derived, missing)
    r = cfg.run
    resumed_at = run.start if run.resume_from is not None else None
    metrics = MetricsWriter(run.out, enabled=run.rank0, resume_step=resumed_at)
    texts = MetricsWriter(run.out, enabled=run.rank0 and bool(cfg.samples.prompts), resume_step=resumed_at,
                          name="samples.jsonl")  # fmt: skip
    eval_batches = run.pipe.eval_batches()
    record: dict = {}
    bar = tqdm(total=r.steps, initial=run.start, disable=not run.rank0, desc="train", unit="step", dynamic_ncols=True)
    stop = StopSignal(run.pmodel.device)
    health = StepHealth(r, skipped=int(run.saved.get("skipped_steps", 0)) if run.start else 0)
    if run.rank0 and cfg.checkpoint.push_to_hub is not None:  # uploads in the background, rank 0 only
        run.pusher = CheckpointPusher(cfg.checkpoint.push_to_hub, run.out, drop=cfg.checkpoint.drop_pending_pushes)
    elif run.rank0:  # what an earlier run left waiting for a push is kept all the same
        run.hub_pins = pending_checkpoints(run.out, drop=cfg.checkpoint.drop_pending_pushes, say=tqdm.write)
    watch = Watchdog.for_run(run, state).start()  # run.hang_timeout
    for step in range(run.start, r.steps):
        state.step = step + 1
        try:
            record, signum = one_step(run, step, health, stop, watch)
            if step == run.start and run.resume_from is not None:  # the loss curve marks where a run resumed
                record["resumed_from"] = str(run.resume_from)
            if step == run.start and cfg.checkpoint.async_ and cfg.checkpoint.every:
                with watch.long("checkpoint save"):
                    prepare_async_save(run.pmodel, run.opt)  # the optimizer's state exists: stage buffers now
            if eval_batches and ((step + 1) % run.pipe.eval_every == 0 or step + 1 == r.steps):
                with watch.long("evaluation"):
                    record.update(evaluate(run.pmodel, run.pipe))
            if run.evaluator is not None and downstream_due(cfg.evals, step + 1, r.steps):
                with watch.long("downstream evaluation"):
                    record.update(downstream(run, step + 1))
            if run.pusher is not None:  # what the background pushes did since the last record
                record.update(run.pusher.take_news())
            metrics.write(record)  # before the checkpoint: a kill after its publication loses no step's record
            with watch.long("samples"):
                _record_samples(run, step, record, texts)  # so are the step's samples and the trackers' log
            with watch.long("checkpoint save"):
                _checkpoint_and_stop(run, step, record, health, signum, bar)
        except Exception as e:
            watch.stop()
            _let_the_write_finish(run, e)
            raise
        if step == run.start:  # optimizer state exists from the first step on
            report_memory(run.opt, run.out, run.rank0, tqdm.write)
            report_plan(run, tqdm.write)
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_sec']:.0f}")
        bar.update(1)
        if run.rank0 and ((step + 1) % r.log_every == 0 or "eval_loss" in record or DOWNSTREAM in record):
            tqdm.write(log_line(record, r.steps))
    watch.stop()  # the end of the run (export, pushes) is not watched
    bar.close()
    for tracker in run.acc.trackers:  # not acc.end_training(): it would also end torch.distributed
        tracker.finish()
    run.rope.enter(r.steps - 1)  # a run complete at its resume exports the last stage's settings too
    finish_run(cfg, run.pmodel, run.out, metrics.path, record, run.rank0)
    if run.pusher is not None:
        _finish_pushes(run, stop)
    return record


def _record_samples(run: Run, step: int, record: dict, texts: MetricsWriter) -> None:
    """The step's samples (when due) into samples.jsonl and the trackers' log of the step, both before the step's
    checkpoint: a stop or a kill after that checkpoint loses neither, and a resume from an earlier one writes them
    again (each writer drops the records past the step it resumes from)."""
    from tqdm.auto import tqdm

    drawn = samples(run, step + 1) if run.cfg.samples.due(step + 1, run.cfg.run.steps) else []
    for i, sample in enumerate(drawn):
        texts.write(sample)
        if run.rank0:
            tqdm.write(f"hf3d: sample {i} at step {step + 1}: {json.dumps(sample['prompt'] + sample['text'])}")
    if run.trackers:
        run.acc.log({**record, **{f"samples/{i}": s["prompt"] + s["text"] for i, s in enumerate(drawn)}}, step=step + 1)


def _finish_pushes(run: Run, stop: StopSignal) -> None:
    """Rank 0, at the end: wait for the Hub pushes left (at most their timeout, or until a stop signal, which
    ends the run with 128 + its number), then drop what keep_last kept only for those that were pushed."""
    signum = run.pusher.finish(stopped=lambda: stop.received)
    root = run.out / "checkpoints"
    saves = step_dirs(root)
    if saves:
        prune_saves(root, run.cfg.checkpoint.keep_last, saves[-1][1], told=run.told, pinned=run.pusher.pinned())
    if signum:
        leave(128 + signum)


def _checkpoint_and_stop(run: Run, step: int, record: dict, health: StepHealth, signum: int, bar) -> None:
    """A checkpoint every checkpoint.every steps, at the last step and when a stop signal came; after a
    signal, leave with 128 + its number, the progress bar closed first so the resume line is the last on
    screen."""
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
        push = run.pusher is not None and c.push_due(step + 1, run.cfg.run.steps)

        def published() -> None:  # rank 0, once the checkpoint is complete (in the background when async)
            pinned = run.pusher.pinned() if run.pusher is not None else run.hub_pins  # waiting for a Hub push
            finish_save(root, c.keep_last, path, told=run.told, pinned=pinned)
            if push:
                run.pusher.submit(path, step + 1)

        if c.async_:  # `latest` and keep_last follow the publication, in the background (rank 0)
            last = signum or step + 1 == run.cfg.run.steps
            run.pending = save_checkpoint(
                path, run.pmodel, run.opt, step=step + 1, extra=extra, async_=True,
                after_publish=published,
            )  # fmt: skip
            run.saved_to = run.pending.result() if last else path  # a stop or the end waits for the write
            how = "saved" if last else "started (written in the background)"
        else:
            run.saved_to = save_checkpoint(path, run.pmodel, run.opt, step=step + 1, extra=extra)
            on_rank0(published)
            how = "saved"
        if run.rank0:
            tqdm.write(f"hf3d: {how} {run.saved_to} in {time.perf_counter() - t1:.2f} s")
    if signum:
        code = 128 + signum
        bar.update(1)  # the step the signal stopped was trained and saved
        bar.close()
        if run.pusher is not None:  # the Hub pushes left undone, said before the resume line
            run.pusher.finish(wait=False)
        if run.rank0:
            tqdm.write(
                f"hf3d: stopped by {signal.Signals(signum).name} after step {step + 1}; resume from {run.saved_to} "
                f"(checkpoint.resume=auto); exit code {code}"
            )
        _leave(code, run.acc)


def _let_the_write_finish(run: Run, e: Exception) -> None:
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
