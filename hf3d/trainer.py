"""`hf3d train`: a YAML config -> parallel model + ZeRO optimizer -> steps -> metrics and an HF export.

Each config section is its own small dataclass, validated where it is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from .checkpoint import finish_save, is_complete, load_checkpoint, resolve_resume, save_checkpoint
from .config import ParallelConfig
from .data import BatchIterator, DataConfig, packed_rows
from .metrics import MetricsWriter, device_peak_flops, flops_per_token, peak_memory_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """Which stock HF model to train."""

    path: str = "examples/models/tiny-smollm"
    """HF directory, Hub id, or hf3d checkpoint (its weights only; `hf3d convert from-hf` makes one).
    A directory with config.json but no weights starts from scratch."""
    dtype: str = "float32"
    """Parameter/activation dtype: float32 or bfloat16 (fp32 master weights either way)."""
    attn_implementation: str = "sdpa"
    """sdpa, eager, flex_attention, or flash_attention_2 (when installed)."""
    init_seed: int = 0
    """Seed of the from-scratch initialisation."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    bucket_size: int = 2**22
    """Elements per gradient bucket (data-parallel communication unit)."""
    exclude_from_weight_decay: bool = True
    """No decay for norms, biases and embeddings."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError("optim.lr must be > 0 and optim.warmup_steps >= 0")


@dataclass
class RunConfig:
    """The loop itself."""

    steps: int = 200
    global_batch: int = 16
    """Rows per optimizer step over all dp ranks (each row is data.seq_len tokens)."""
    output_dir: str = "outputs/tiny-smollm"
    log_every: int = 10
    seed: int = 0
    save_final: bool = True
    """Write an HF directory to <output_dir>/final at the end."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers accelerate logs every step to (tensorboard, wandb, trackio, ...), under
    <output_dir>; metrics.jsonl is written either way."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.global_batch < 1:
            raise ValueError("run.steps and run.global_batch must be positive")
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]


@dataclass
class CheckpointConfig:
    """Training checkpoints under <output_dir>/checkpoints/step_<N>/ (any mesh can resume them)."""

    every: int = 100
    """Steps between checkpoints; 0 turns checkpointing off. The last step is always saved (when on)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each save. 0 keeps all."""
    resume: str = "auto"
    """auto: the newest complete checkpoint of this output_dir, or a fresh start when there is none;
    none: always start fresh; or a path to a step_<N> folder or to a checkpoints folder."""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"checkpoint.every must be a number of steps >= 0, got {self.every!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last must be >= 0 (0 keeps all), got {self.keep_last!r}")
        self.resume = str(self.resume)


@dataclass
class ExportConfig:
    """What happens to the final HF directory (<output_dir>/final, written when run.save_final)."""

    push_to_hub: str | None = None
    """A Hub repo id (NAMESPACE/NAME) to upload the final directory to, with a model card; the token
    comes from HF_TOKEN or `hf auth login`."""
    private: bool = False
    """Create the Hub repo private."""
    license: str = "apache-2.0"
    """License named in the model card."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(tp=2))
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self) -> None:
        if self.export.push_to_hub and not self.run.save_final:
            raise ValueError("export.push_to_hub needs run.save_final=true (the final directory is what is pushed)")

    @classmethod
    def from_yaml(cls, path: str | None, overrides: list[str] = ()) -> TrainConfig:
        raw = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"config file {path!r} does not exist")
            raw = yaml.safe_load(p.read_text()) or {}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or "." not in key:
                raise ValueError(f"--set expects section.key=value, got {item!r}")
            section, name = key.split(".", 1)
            raw.setdefault(section, {})[name] = yaml.safe_load(value)
        sections = {f.name: f for f in dataclasses.fields(cls)}
        built = {}
        for section, values in raw.items():
            if section not in sections:
                raise ValueError(f"unknown config section {section!r}; sections: {', '.join(sections)}")
            sub_cls = type(sections[section].default_factory())
            known = {f.name for f in dataclasses.fields(sub_cls)}
            unknown = set(values or {}) - known
            if unknown:
                raise ValueError(
                    f"unknown key(s) {', '.join(sorted(unknown))} in section {section!r}; "
                    f"known: {', '.join(sorted(known))}"
                )
            built[section] = sub_cls(**_as_numbers(section, sub_cls(), values or {}))
        return cls(**built)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _as_numbers(section: str, defaults, values: dict) -> dict:
    """YAML reads `3e-4` (no dot) as a string: take numbers written that way where the field is a number."""
    out = dict(values)
    for key, value in values.items():
        default = getattr(defaults, key)
        if isinstance(value, str) and isinstance(default, int | float) and not isinstance(default, bool):
            try:
                out[key] = type(default)(float(value)) if isinstance(default, float) else int(value)
            except ValueError:
                raise ValueError(f"{section}.{key} must be a number, got {value!r}") from None
    return out


def lr_at(step: int, cfg: OptimConfig, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _load_model(cfg: ModelConfig, pcfg: ParallelConfig):
    """The parallel model. A weightless HF directory is initialised from its config by `parallelize`
    itself: every rank draws the stock init in stock order and keeps only its own slices, so the
    model equals `torch.manual_seed(init_seed); from_config(config, dtype=torch.float32)` (then cast
    to model.dtype) at any mesh."""
    from . import parallelize

    return parallelize(
        cfg.path,
        pcfg,
        seed=cfg.init_seed,
        dtype=DTYPES[cfg.dtype],
        attn_implementation=cfg.attn_implementation,
    )


def _report_memory(opt, out: Path, rank0: bool) -> None:
    """Every rank's training-state bytes, printed and written to <output_dir>/memory.json."""
    from tqdm.auto import tqdm

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, opt.memory_report())
    if rank0:
        (out / "memory.json").write_text(json.dumps(reports, indent=1))
        for r, rep in enumerate(reports):
            parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in rep.items())
            tqdm.write(f"hf3d: rank {r} training state (MiB): {parts}")


def train(cfg: TrainConfig) -> dict:
    """Run training; returns the last step's metrics."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from . import build_optimizer, prepare

    pmodel = _load_model(cfg.model, cfg.parallel)
    if is_complete(cfg.model.path):  # start from a checkpoint's weights: step 0, fresh optimizer
        load_checkpoint(cfg.model.path, pmodel)
    rank0 = dist.get_rank() == 0
    tokenizer = AutoTokenizer.from_pretrained(pmodel.tokenizer_dir or cfg.model.path)
    rows = packed_rows(cfg.data, tokenizer)
    batches = BatchIterator(rows, cfg.run.global_batch, pmodel.dp_rank, pmodel.dp_size)
    o = cfg.optim
    opt = build_optimizer(
        pmodel,
        torch.optim.AdamW,
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        bucket_size=o.bucket_size,
        exclude_from_weight_decay=o.exclude_from_weight_decay,
    )
    out = Path(cfg.run.output_dir)
    # the loop is an accelerate loop: trackers, and the same refusals as any hf3d.prepare user
    acc = Accelerator(cpu=pmodel.device.type == "cpu", log_with=cfg.run.report_to or None, project_dir=str(out))
    pmodel, opt = prepare(acc, pmodel, opt)
    if cfg.run.report_to:
        flat = {
            f"{sec}.{k}": v if isinstance(v, int | float | str | bool) else str(v)
            for sec, d in cfg.to_dict().items()
            for k, v in d.items()
        }
        acc.init_trackers("hf3d", config=flat)
    ckpt_root = out / "checkpoints"
    resume_from = resolve_resume(cfg.checkpoint.resume, ckpt_root)
    start = 0
    if resume_from is not None:
        state = {}
        start = load_checkpoint(resume_from, pmodel, opt, extra=state)
        if "data_position" in state:
            batches.position, batches.epoch = state["data_position"], state["data_epoch"]
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        p = cfg.parallel
        print(f"hf3d: mesh pp={p.pp} dp={p.dp} tp={p.tp}; {rows.shape[0]} rows of {cfg.data.seq_len} tokens")
        if resume_from is not None:
            print(f"hf3d: resumed from {resume_from} at step {start}")
    metrics = MetricsWriter(out, enabled=rank0, resume_step=start if resume_from is not None else None)
    tokens_per_step = cfg.run.global_batch * cfg.data.seq_len
    peak = device_peak_flops()
    fpt = flops_per_token(pmodel.config, cfg.data.seq_len)
    record: dict = {}
    every = cfg.checkpoint.every
    bar = tqdm(range(start, cfg.run.steps), disable=not rank0, desc="train", dynamic_ncols=True)
    stop = StopSignal(pmodel.device)
    for step in bar:
        lr = lr_at(step, o, cfg.run.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        ids = next(batches)
        loss = pmodel.train_step(ids, ids)
        grad_norm = opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - t0
        record = {
            "step": step + 1,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens": tokens_per_step * (step + 1),
            "tokens_per_sec": tokens_per_step / elapsed,
            "step_time_s": elapsed,
            "peak_mem_bytes": peak_memory_bytes(),
            "skipped": opt.last_step_skipped,
        }
        if peak:
            record["mfu"] = fpt * tokens_per_step / elapsed / (peak * dist.get_world_size())
        signum = stop.agreed()
        if signum or (every and ((step + 1) % every == 0 or step + 1 == cfg.run.steps)):
            t0 = time.perf_counter()
            extra = {"data_position": batches.position, "data_epoch": batches.epoch, "tokens": record["tokens"]}
            saved = save_checkpoint(ckpt_root / f"step_{step + 1}", pmodel, opt, step=step + 1, extra=extra)
            if rank0:
                finish_save(ckpt_root, cfg.checkpoint.keep_last)
            record["checkpoint_s"] = time.perf_counter() - t0
            if rank0:
                bar.write(f"hf3d: saved {saved} in {record['checkpoint_s']:.2f} s")
        metrics.write(record)
        if signum:
            code = 128 + signum
            if rank0:
                bar.write(
                    f"hf3d: stopped by {signal.Signals(signum).name} after step {step + 1}; resume from {saved} "
                    f"(checkpoint.resume=auto); exit code {code}"
                )
            raise SystemExit(code)
        if cfg.run.report_to:
            acc.log(record, step=step + 1)
        if step == start:  # optimizer state exists from the first step on
            _report_memory(opt, out, rank0)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        if rank0 and (step + 1) % cfg.run.log_every == 0:
            bar.write(f"step {step + 1}: loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} lr {lr:.2e}")
    for tracker in acc.trackers:  # not acc.end_training(): it would also end torch.distributed
        tracker.finish()
    if cfg.run.save_final:
        final = out / "final"
        pmodel.save_pretrained(final)
        if rank0:
            _write_summary(cfg, final, metrics.path, record)
            print(f"hf3d: wrote {final} (load it with AutoModelForCausalLM.from_pretrained)")
        if cfg.export.push_to_hub:
            _push_final(cfg, final)
    return record


class StopSignal:
    """SIGTERM and SIGINT (preemption, Ctrl-C, torchrun forwarding either) end the run cleanly: the
    handler only records the signal; after each step the ranks agree (one max all-reduce, so a signal
    that reached one rank stops all), save a checkpoint of that step and exit with 128 + the signal
    number (143 for SIGTERM, 130 for SIGINT). `checkpoint.resume: auto` then continues exactly."""

    def __init__(self, device: torch.device):
        self.device, self.received = device, 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.received = signum

    def agreed(self) -> int:
        flag = torch.tensor(self.received, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)


def _write_summary(cfg: TrainConfig, final: Path, metrics_path: Path, last: dict) -> None:
    """The run's record next to the exported weights (hf3d_training.json): the model card is made from it."""
    from .hub import SUMMARY_FILE

    curve = [[r["step"], r["loss"]] for r in map(json.loads, metrics_path.read_text().splitlines())]
    model_path = cfg.model.path
    from_hub = not Path(model_path).exists() and model_path.count("/") == 1
    summary = {
        "base_model": model_path if from_hub else None,
        "datasets": [cfg.data.path],
        "license": cfg.export.license,
        "hyperparameters": {
            **{k: v for k, v in dataclasses.asdict(cfg.optim).items() if k != "bucket_size"},
            "steps": cfg.run.steps,
            "global_batch": cfg.run.global_batch,
            "seq_len": cfg.data.seq_len,
            "dtype": cfg.model.dtype,
        },
        "parallel": {k: getattr(cfg.parallel, k) for k in ("tp", "pp", "dp", "pp_schedule", "num_microbatches")},
        "tokens_seen": curve[-1][0] * cfg.run.global_batch * cfg.data.seq_len if curve else 0,
        "final_loss": curve[-1][1] if curve else last.get("loss"),
        "loss_curve": curve,
    }
    (final / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))


def _push_final(cfg: TrainConfig, final: Path) -> None:
    """Rank 0 uploads; a failure is raised on every rank (no rank is left waiting)."""
    from .hub import push_to_hub
    from .mesh import on_rank0

    def push() -> None:
        url = push_to_hub(final, cfg.export.push_to_hub, private=cfg.export.private)
        print(f"hf3d: pushed {final} to {url}")

    on_rank0(push)
