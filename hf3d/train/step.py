"""One step of a run: the batch, train_step, the optimizer's one host read, the metrics record; the health of a
step (non-finite, spikes), stop signals agreed over ranks, and evaluation."""

from __future__ import annotations

import collections
import contextlib
import math
import signal
import time

import torch
import torch.distributed as dist

from ..parallel.expert import load_imbalance
from ..plan.cost import flops_per_token
from .build import Run
from .config import RunConfig
from .lr_schedules import base_lr
from .memory_check import measuring
from .metrics import peak_memory_bytes
from .metrics import throughput as throughput_metrics
from .watchdog import FORWARD, OPTIMIZER, Watchdog


def evaluate(pmodel, pipe) -> dict[str, float]:
    """The token-mean cross-entropy over the held-out batches of the data pipeline (all dp ranks' rows) as
    `eval_loss`, with its `eval_ppl`, on every rank. With rows of several sources, also each source's token mean
    over its own rows as `eval_loss/<source>`, from the same forward."""
    was_training = pmodel.training
    pmodel.eval()
    names = pipe.eval_names
    groups = len(names) if len(names) > 1 else 0
    sums = torch.zeros(2, max(groups, 1), dtype=torch.float64)  # [loss sum, targets] per source
    for b, source_ids in zip(pipe.eval_batches(), pipe.eval_sources()):
        by = {"groups": source_ids, "num_groups": groups} if groups else {}
        s, n = pmodel.eval_loss(b["input_ids"], shift_labels=b["shift_labels"], position_ids=b["position_ids"], **by)
        sums += torch.stack([s, n]).view(2, -1).double().cpu()
    pmodel.train(was_training)
    loss_sum, count = sums.sum(1).tolist()
    out = {"eval_loss": loss_sum / max(count, 1.0)}
    out["eval_ppl"] = float(torch.tensor(out["eval_loss"]).exp())
    for name, (s, n) in zip(names, sums.T.tolist()) if groups else ():
        if n:  # a source the eval rows never drew has no loss of its own
            out[f"eval_loss/{name}"] = s / n
    return out


DOWNSTREAM = "downstream/average/acc_norm"  # a record with downstream scores has this key
MAX_SOURCES_ON_LINE = 4  # more sources' eval losses would not fit a readable log line


def downstream_due(evals, step: int, steps: int) -> bool:
    """Whether the downstream tasks run after `step` (1-based): every `evals.every` steps and at the end."""
    return bool(evals.every and step % evals.every == 0) or (evals.at_end and step == steps)


def downstream(run: Run, step: int) -> dict:
    """The downstream scores after `step`, as metrics.jsonl keys; rank 0 writes <output_dir>/evals/step_<N>/
    results.json (and the samples with evals.log_samples), as `hf3d eval` writes them."""
    from ..evaluation.command import write_results

    results = run.evaluator.run(progress=False)
    if run.rank0:
        write_results(run.out / "evals" / f"step_{step}", results, run.evaluator.cfg, step=step)
    return results.metrics()


def samples(run: Run, step: int) -> list[dict]:
    """Text from the samples.prompts at the training mesh after `step`: {step, prompt, generated_ids, text}
    each, in the prompts' order, on every rank."""
    from ..generation.command import generate_texts

    cfg = run.cfg.samples
    records = generate_texts(run.pmodel, run.tokenizer, cfg.prompts, **cfg.options())
    return [{"step": step, **r} for r in records]


def one_step(run: Run, step: int, health: StepHealth, stop: StopSignal, watch: Watchdog) -> tuple[dict, int]:
    """One optimizer step: batch, forward + backward, update, lr; returns its metrics record and the
    stop signal the ranks agreed on (0: none). One host sync: the loss, the z-loss, the stop flag and
    the out-of-vocabulary flag are read with the grad norm inside opt.step(). `watch` is told its phases."""
    from tqdm.auto import tqdm

    cfg, pmodel, opt, pipe = run.cfg, run.pmodel, run.opt, run.pipe
    run.rope.enter(step)  # a stage with other RoPE settings: the model's change in place
    run.flops_per_token = flops_per_token(pmodel.config, pipe.seq_len(step), run.mlp_costs)
    lr = base_lr(opt)
    t0 = time.perf_counter()
    watch.begin(step + 1)
    batch = pipe.next_batch(step)
    data_s = time.perf_counter() - t0
    watch.enter(FORWARD)
    with measuring(run) if step == run.start else contextlib.nullcontext():  # the first step, beside the plan
        loss = pmodel.train_step(
            batch["input_ids"],
            shift_labels=batch["shift_labels"],
            position_ids=batch["position_ids"],
            z_loss=cfg.optim.z_loss,
        )
    watch.enter(OPTIMIZER)
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
    watch.finished()
    return record, int(values["stop"])


def log_line(record: dict, steps: int) -> str:
    line = (
        f"step {record['step']}/{steps}: loss {record['loss']:.4f} lr {record['lr']:.2e} "
        f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_sec']:.0f}"
    )
    if "eval_loss" in record:
        line += f" eval_loss {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f}"
        by_source = [(k[len("eval_loss/") :], v) for k, v in record.items() if k.startswith("eval_loss/")]
        if 0 < len(by_source) <= MAX_SOURCES_ON_LINE:
            line += "; " + ", ".join(f"{name} {v:.4f}" for name, v in by_source)
        elif by_source:
            line += f"; {len(by_source)} sources' losses in metrics.jsonl"
        line += ")"
    if DOWNSTREAM in record:
        prefix, suffix = "downstream/", "/acc_norm"
        tasks = [k[len(prefix) : -len(suffix)] for k in record if k.startswith(prefix) and k.endswith(suffix)]
        scores = " ".join(f"{t} {record[prefix + t + suffix]:.3f}" for t in tasks if t != "average")
        line += f" | acc_norm {scores} (average {record[DOWNSTREAM]:.3f})"
    return line


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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class StopSignal:
    """SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (preemption as SLURM sends it, Ctrl-C, a launcher forwarding any
    of them) end the run cleanly: the handler only records the signal; in each step, after the backward, the
    ranks agree (one max all-reduce, so a signal that reached one rank stops all; its result is read in the
    step's one host sync), then save a checkpoint of that step and exit with 128 + the signal number (143 for
    SIGTERM, 130 for SIGINT, 138 for SIGUSR1, 140 for SIGUSR2). A signal that comes later in a step stops the
    next one. `checkpoint.resume: auto` then continues exactly."""

    def __init__(self, device: torch.device):
        self.device, self.received = device, 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.received = signum

    def agree(self) -> torch.Tensor:
        """The largest signal number any rank received (0: none), as a device tensor: no host sync."""
        flag = torch.full((), self.received, dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag
