"""The `hf3d train` YAML: one small dataclass per section, each validated where it is built.

    model        which stock HF model, its dtype and attention, long-context overrides
    data         sources, stages and mixtures, packing, document masking, eval split (hf3d/data)
    parallel     tp / pp / dp / cp / ep, schedule, micro-batches, recompute, activation offload, compile, µP
                 (hf3d.ParallelConfig)
    optim        AdamW, weight decay, clipping, z-loss, and the lr schedule (hf3d/train/lr_schedules.py)
    run          steps, batch, output dir, logging, trackers
    checkpoint   how often to save, what to keep, what to resume and which parts of it
    export       the final HF directory's Hub upload
    moe          mixture-of-experts models: how the expert load is balanced
    precision    FP8 matmuls with torchao (hf3d/parallel/fp8.py); the parameter dtype is model.dtype
    evals        downstream multiple-choice tasks scored during the run (hf3d/evaluation)
    samples      text generated at the training mesh from fixed prompts during the run (hf3d/generation)

The sections but data and parallel are in hf3d/train/sections.py; the checks that need more than one section
(batch vs dp and micro-batches, seq_len vs the model's positions, data stages vs the run and its lr decay) in
hf3d/train/checks.py (`check_launch`, `check_run`), which run before anything is loaded or written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..data import DataConfig
from ..parallel.config import ParallelConfig
from ..utils.configfile import build_section, key_of, other_name_hint, set_value
from .sections import (
    DTYPES,
    CheckpointConfig,
    CheckpointPushConfig,
    EvalsConfig,
    ExportConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    SamplesConfig,
)

__all__ = [
    "DTYPES", "CheckpointConfig", "CheckpointPushConfig", "EvalsConfig", "ExportConfig", "ModelConfig", "MoEConfig",
    "OptimConfig", "PrecisionConfig", "RunConfig", "SamplesConfig", "TrainConfig",
]  # fmt: skip


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(tp=2, compile="auto"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    evals: EvalsConfig = field(default_factory=EvalsConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)

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
            try:
                raw = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"config file {path!r} must be a mapping of sections (model:, data:, ...)")
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or "." not in key:
                raise ValueError(f"--set expects section.key=value, got {item!r}")
            *parents, name = key.split(".")
            target = raw
            for part in parents:  # data.eval.every: nested sections
                target = target.setdefault(part, {})
                if not isinstance(target, dict):
                    raise ValueError(f"--set {item!r}: {part!r} is not a mapping in the config file")
            target[name] = set_value(item, value)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        built = {}
        for section, values in raw.items():
            if section not in fields:
                import difflib

                near = difflib.get_close_matches(str(section), list(fields), n=1, cutoff=0.5)
                hint = other_name_hint(section, "") or (f"did you mean {near[0]!r}? " if near else "")
                raise ValueError(f"unknown config section {section!r}; {hint}sections: {', '.join(fields)}")
            built[section] = build_section(type(fields[section].default_factory()), values, section)
        if "parallel" not in built:
            built["parallel"] = ParallelConfig(tp=2, compile="auto")
        elif "compile" not in (raw.get("parallel") or {}):  # a run takes the fast path unless told otherwise
            built["parallel"] = dataclasses.replace(built["parallel"], compile="auto")
        return cls(**built)

    def to_dict(self) -> dict:
        """The sections as YAML takes them back (a field named after a Python keyword under its YAML key)."""
        return {
            section: {key_of(k): v for k, v in values.items()} if isinstance(values, dict) else values
            for section, values in dataclasses.asdict(self).items()
        }
