"""The `data` config section: sources, stages of weighted mixtures, packing and the eval split.

Everything here is checked when the section is built (on every rank, before any file is read), so
a mistake in the YAML stops the run with one line naming the key. Checks that need the data (a text
field that does not exist, a source shorter than one window) or the run (`total_steps`) happen in
`DataPipeline`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..utils.configfile import build_section

KINDS = ("auto", "json", "parquet", "text", "hub", "datatrove")


@dataclass
class SourceConfig:
    """One source of documents: a file, folder or glob of files, a Hub dataset, or datatrove shards."""

    path: str = ""
    """A local .jsonl/.json/.parquet/.txt file, a folder or glob of such files, a Hub dataset id, or a
    folder of datatrove token shards (.ds with .ds.index and .ds.metadata)."""
    kind: str = "auto"
    """auto | json | parquet | text | hub | datatrove. auto: by file suffix; a folder holding .ds files
    is datatrove, otherwise by the suffix of its files; a path that does not exist locally is a Hub id."""
    text_field: str = "text"
    """The column holding each document's text (json, parquet, hub). A .txt file is one document."""
    split: str = "train"
    """Dataset split to read (Hub datasets; local files always form the split `train`)."""
    subset: str | None = None
    """Hub dataset configuration (load_dataset's `name`), e.g. `sample-10BT`."""
    name: str | None = None
    """Label of this source in logs, consumed-token counts and checkpoints; default: derived from
    the path (file stem, folder name, Hub id). The same name in two stages is the same source."""
    weight: float = 1.0
    """Mixture weight within its stage (weights are normalised over the stage)."""
    streaming: bool = False
    """Hub/local HF datasets only: read the dataset once as a stream instead of through datasets' arrow
    cache (the tokens are still cached as flat arrays)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("a data source needs `path`: a file, folder, glob, Hub dataset id or datatrove folder")
        if self.kind not in KINDS:
            raise ValueError(f"data source {self.path!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.weight < 0:
            raise ValueError(f"data source {self.label!r}: weight must be >= 0, got {self.weight}")
        if self.streaming and self.kind == "datatrove":
            raise ValueError(f"data source {self.label!r}: streaming applies to HF datasets, not datatrove shards")

    @property
    def label(self) -> str:
        """`name`, or a name derived from the path."""
        if self.name:
            return self.name
        path = self.path.rstrip("/")
        if any(c in path for c in "*?["):
            parts = [p for p in Path(path).parts if not any(c in p for c in "*?[")]
            return parts[-1] if parts else path
        p = Path(path)
        if p.suffix in (".jsonl", ".json", ".parquet", ".txt"):
            return p.stem
        if p.exists():
            return p.name
        return path + (f":{self.subset}" if self.subset else "")

    def spec(self) -> tuple:
        """What identifies the data (not its weight): two sources with one label must agree on it."""
        return (self.path, self.kind, self.text_field, self.split, self.subset)


@dataclass
class StageConfig:
    """A stage of training: from `start_step` on, rows are drawn from this weighted mixture, at this
    stage's seq_len, and the model runs with its RoPE settings (a long-context stage; what a stage
    does not give it keeps from the stages before it)."""

    start_step: int = 0
    """Steps done before this stage: 0 for the first stage, later ones in increasing order. A stage with
    start_step s starts at step s + 1 (steps count from 1 in the log and metrics.jsonl)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """The mixture: each row of a global batch comes from one source, drawn by weight."""
    name: str | None = None
    """Label in logs; default `stage<i>`."""
    seq_len: int | None = None
    """Tokens per row from this stage on; default: the previous stage's (the first stage's: data.seq_len).
    The rows per step stay run.global_batch, so the tokens per step change with it."""
    rope_theta: float | None = None
    """The model's RoPE base from this stage on (as model.rope_theta; kept by later stages that give none)."""
    rope_scaling: dict | None = None
    """The model's RoPE scaling from this stage on (as model.rope_scaling), e.g. {rope_type: yarn, factor: 4.0}."""
    max_position_embeddings: int | None = None
    """The model's maximum sequence length from this stage on (as model.max_position_embeddings)."""

    def model_overrides(self) -> dict:
        """The model settings this stage gives (a resolved stage: also those it keeps from earlier stages)."""
        keys = ("rope_theta", "rope_scaling", "max_position_embeddings")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class EvalConfig:
    """Held-out data, evaluated every `every` steps: either a separate source (`path`) or the last
    `fraction` of the windows of the first stage's sources (never trained on)."""

    path: str | None = None
    """Held-out data, a source spec as in data.sources[].path."""
    kind: str = "auto"
    """Kind of `path` (see data.sources[].kind)."""
    text_field: str = "text"
    """Text column of `path`."""
    split: str = "train"
    """Split of `path` when it is a Hub dataset, e.g. `validation`."""
    subset: str | None = None
    """Hub configuration of `path`."""
    fraction: float = 0.0
    """Instead of `path`: hold out this last fraction of every first-stage source's windows."""
    every: int = 0
    """Steps between evaluations; 0 turns evaluation off."""
    batches: int = 1
    """Global batches per evaluation."""
    batch: int | None = None
    """Rows per eval batch over all dp ranks; default: the training global batch."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"data.eval.every must be >= 0 (0: off), got {self.every}")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"data.eval.fraction must be in [0, 1), got {self.fraction}")
        if self.path and self.fraction:
            raise ValueError("data.eval: give either path (held-out data) or fraction (held out of training), not both")
        if self.every and not self.path and not self.fraction:
            raise ValueError(
                "data.eval.every is set but there is no eval data: set data.eval.path or data.eval.fraction"
            )
        if self.batches < 1:
            raise ValueError(f"data.eval.batches must be >= 1, got {self.batches}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"data.eval.batch must be >= 1, got {self.batch}")

    def source(self) -> SourceConfig | None:
        """The held-out source named by `path` (None in fraction mode)."""
        if not self.path:
            return None
        return SourceConfig(
            path=self.path,
            kind=self.kind,
            text_field=self.text_field,
            split=self.split,
            subset=self.subset,
            name="eval",
        )


@dataclass
class DataConfig:
    """Where the training text comes from, how it is mixed over the run, and how it is packed.

    The data is `stages` when given, else `sources` as one stage, else the single source `path`."""

    path: str = "examples/data/shakespeare.jsonl"
    """Single-source shorthand (used when neither `sources` nor `stages` is given)."""
    text_field: str = "text"
    """Text column of `path`."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture used for the whole run (one stage starting at step 0)."""
    stages: list[StageConfig] = field(default_factory=list)
    """Mixtures that change over the run (e.g. an annealing stage at the end)."""
    seq_len: int = 128
    """Tokens per training row; windows of seq_len + 1 tokens give inputs and shifted labels. Stages may
    give their own (data.stages[].seq_len); evaluation always reads rows of data.seq_len."""
    seed: int = 0
    """Seed of the window order and of the mixture draws."""
    document_masking: bool = True
    """Position ids restart at each document and no label crosses into the next document, so no
    token attends to (or predicts) another document. Off: positions 0..seq_len-1, every label kept."""
    num_proc: int = 1
    """Processes for tokenisation (datasets' map), on one rank per node."""
    cache_dir: str | None = None
    """Where tokenised sources are kept (and datasets' own cache when set); default:
    `<HF datasets cache>/hf3d-tokens`."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation data."""

    def __post_init__(self) -> None:
        self.sources = [_built(SourceConfig, s, f"data.sources[{i}]") for i, s in enumerate(self.sources)]
        self.stages = [_built(StageConfig, s, f"data.stages[{i}]") for i, s in enumerate(self.stages)]
        for i, stage in enumerate(self.stages):
            stage.sources = [
                _built(SourceConfig, s, f"data.stages[{i}].sources[{j}]") for j, s in enumerate(stage.sources)
            ]
        self.eval = _built(EvalConfig, self.eval, "data.eval")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {self.seq_len}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc must be >= 1, got {self.num_proc}")
        if self.sources and self.stages:
            raise ValueError("data: give sources (one mixture) or stages (mixtures over the run), not both")
        stages = self.resolved_stages()
        _check_stages(stages)
        first = {s.label for s in stages[0].sources}
        for i, stage in enumerate(stages if self.eval.every and self.eval.fraction else ()):
            for s in stage.sources:
                if s.label in first and stage.seq_len != self.seq_len:
                    raise ValueError(
                        f"data.eval.fraction holds out the tail of each first-stage source in rows of data.seq_len="
                        f"{self.seq_len}, but data.stages[{i}] reads {s.label!r} at seq_len {stage.seq_len}: "
                        "use data.eval.path for the held-out data"
                    )

    def resolved_stages(self) -> list[StageConfig]:
        """The stages this config describes, named (single-source and one-mixture shorthands expanded),
        each with its seq_len and the model settings it runs with (those given by an earlier stage carry on)."""
        if self.stages:
            stages = self.stages
        elif self.sources:
            stages = [StageConfig(start_step=0, sources=self.sources)]
        else:
            stages = [StageConfig(start_step=0, sources=[SourceConfig(path=self.path, text_field=self.text_field)])]
        out, seq_len, model = [], self.seq_len, {}
        for i, s in enumerate(stages):
            seq_len = s.seq_len if s.seq_len is not None else seq_len
            model = {**model, **s.model_overrides()}
            out.append(dataclasses.replace(s, name=s.name or f"stage{i}", seq_len=seq_len, **model))
        return out


def _built(cls, value, where: str):
    """A dataclass from a YAML mapping (as `build_section` does), or the instance itself."""
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return build_section(cls, value, where)
    raise ValueError(f"{where} must be a mapping of key: value, got {type(value).__name__}")


def _check_stages(stages: list[StageConfig]) -> None:
    if stages[0].start_step != 0:
        raise ValueError(f"data.stages[0].start_step must be 0, got {stages[0].start_step}")
    for i in range(1, len(stages)):
        if stages[i].start_step <= stages[i - 1].start_step:
            raise ValueError(
                f"data.stages must be sorted by start_step: stage {i} starts at {stages[i].start_step}, "
                f"not after stage {i - 1} ({stages[i - 1].start_step})"
            )
    seen: dict[str, SourceConfig] = {}
    for i, stage in enumerate(stages):
        if not stage.sources:
            raise ValueError(f"data.stages[{i}] ({stage.name}) has no sources")
        if stage.seq_len < 2:
            raise ValueError(f"data.stages[{i}].seq_len must be at least 2, got {stage.seq_len}")
        if stage.rope_theta is not None and not stage.rope_theta > 0:
            raise ValueError(f"data.stages[{i}].rope_theta must be > 0, got {stage.rope_theta}")
        if stage.max_position_embeddings is not None and stage.max_position_embeddings < 2:
            raise ValueError(
                f"data.stages[{i}].max_position_embeddings must be at least 2, got {stage.max_position_embeddings}"
            )
        total = sum(s.weight for s in stage.sources)
        if not total > 0:
            raise ValueError(f"data.stages[{i}] ({stage.name}): source weights sum to {total}; give positive weights")
        labels = [s.label for s in stage.sources]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(
                    f"data.stages[{i}] ({stage.name}) lists source {label!r} twice; give each a distinct `name`"
                )
        for s in stage.sources:
            if s.label in seen and seen[s.label].spec() != s.spec():
                raise ValueError(
                    f"data source name {s.label!r} names two different sources ({seen[s.label].path!r} and "
                    f"{s.path!r}); give them distinct `name`s"
                )
            seen.setdefault(s.label, s)
