"""`hf3d train`: a YAML config -> parallel model + ZeRO optimizer -> steps -> metrics and an HF export.

Each config section is its own small dataclass, validated where it is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from .config import ParallelConfig
from .data import BatchIterator, DataConfig, packed_rows
from .metrics import MetricsWriter, device_peak_flops, flops_per_token, peak_memory_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """Which stock HF model to train."""

    path: str = "examples/models/tiny-smollm"
    """HF directory or Hub id. A directory with config.json but no weights starts from scratch."""
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

    def __post_init__(self) -> None:
        if self.steps < 1 or self.global_batch < 1:
            raise ValueError("run.steps and run.global_batch must be positive")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(tp=2))
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

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
            built[section] = sub_cls(**(values or {}))
        return cls(**built)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_at(step: int, cfg: OptimConfig, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _load_model(cfg: ModelConfig, pcfg: ParallelConfig):
    """The parallel model; a weightless HF directory is initialised from its config (same seed on
    every rank, so every rank draws the same full weights and keeps its own slices)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import parallelize

    path = Path(cfg.path)
    has_weights = any(path.glob("*.safetensors")) if path.is_dir() else True
    if has_weights:
        return parallelize(cfg.path, pcfg, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation)
    torch.manual_seed(cfg.init_seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model.config._name_or_path = str(path)  # so the export carries the tokenizer files
    return parallelize(model, pcfg, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation)


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
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from . import build_optimizer

    pmodel = _load_model(cfg.model, cfg.parallel)
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
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        p = cfg.parallel
        print(f"hf3d: mesh pp={p.pp} dp={p.dp} tp={p.tp}; {rows.shape[0]} rows of {cfg.data.seq_len} tokens")
    metrics = MetricsWriter(out, enabled=rank0)
    tokens_per_step = cfg.run.global_batch * cfg.data.seq_len
    peak = device_peak_flops()
    fpt = flops_per_token(pmodel.config, cfg.data.seq_len)
    record: dict = {}
    bar = tqdm(range(cfg.run.steps), disable=not rank0, desc="train", dynamic_ncols=True)
    for step in bar:
        lr = lr_at(step, o, cfg.run.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        ids = next(batches)
        loss = pmodel.train_step(ids, ids)
        grad_norm = opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
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
        metrics.write(record)
        if step == 0:  # optimizer state exists from the first step on
            _report_memory(opt, out, rank0)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        if rank0 and (step + 1) % cfg.run.log_every == 0:
            bar.write(f"step {step + 1}: loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} lr {lr:.2e}")
    if cfg.run.save_final:
        pmodel.save_pretrained(out / "final")
        if rank0:
            print(f"hf3d: wrote {out / 'final'} (load it with AutoModelForCausalLM.from_pretrained)")
    return record
