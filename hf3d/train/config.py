"""The `hf3d train` YAML: one small dataclass per section, each validated where it is built.

    model        which stock HF model, its dtype and attention, long-context overrides
    data         sources, stages and mixtures, packing, document masking, eval split (hf3d/data)
    parallel     tp / pp / dp / cp / ep, schedule, micro-batches, recompute, compile, µP (hf3d.ParallelConfig)
    optim        AdamW, weight decay, clipping, z-loss, and the lr schedule (hf3d/train/lr_schedules.py)
    run          steps, batch, output dir, logging, trackers
    checkpoint   how often to save, what to keep, what to resume and which parts of it
    export       the final HF directory's Hub upload
    moe          mixture-of-experts models: how the expert load is balanced
    precision    FP8 matmuls with torchao (hf3d/parallel/fp8.py); the parameter dtype is model.dtype
    evals        downstream multiple-choice tasks scored during the run (hf3d/evaluation)
    samples      text generated at the training mesh from fixed prompts during the run (hf3d/generation)

Checks that need more than one section (batch vs dp and micro-batches, seq_len vs the model's
positions, data stages vs the run and its lr decay) live in `check_run`, which runs before anything
is loaded or written.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..data import DataConfig
from ..evaluation.config import TaskEvalConfig
from ..parallel.config import DTYPE_NAMES, ParallelConfig, check_attn_implementation, check_cp_seq_len
from ..utils import files
from ..utils.configfile import build_section, key_of, set_value
from .lr_schedules import ScheduleConfig, decay_start_step, describe_schedule

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class ModelConfig:
    """Which stock HF model to train."""

    path: str = "examples/models/tiny-smollm"
    """HF directory, Hub id, or hf3d checkpoint (its weights only; `hf3d convert from-hf` makes one).
    A directory with config.json but no weights starts from scratch."""
    dtype: str = "float32"
    """Parameter/activation dtype: float32 or bfloat16 (fp32 master weights either way)."""
    attn_implementation: str = "auto"
    """auto, sdpa, eager, flex_attention, or flash_attention_2 (when installed). auto: sdpa on CPU; on
    CUDA flash_attention_2 when flash-attn is installed (packed documents as varlen boundaries), else
    flex_attention with data.document_masking (a block mask), else sdpa (hf3d/parallel/attention.py)."""
    init_seed: int = 0
    """Seed of the from-scratch initialisation."""
    rope_theta: float | None = None
    """Override the RoPE base (long-context continued pretraining); written into the exported config."""
    rope_scaling: dict | None = None
    """Override the RoPE scaling, e.g. {rope_type: linear, factor: 2.0}; written into the exported config."""
    max_position_embeddings: int | None = None
    """Override the model's maximum sequence length; written into the exported config. Data stages may
    change these three from their start step on (data.stages[].rope_theta, ...)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def overrides(self) -> dict:
        keys = ("rope_theta", "rope_scaling", "max_position_embeddings")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class OptimConfig(ScheduleConfig):
    """AdamW (fp32 state, ZeRO-1 sharded over dp) and its learning-rate schedule."""

    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    bucket_size: int = 2**22
    """Elements per gradient bucket (data-parallel communication unit)."""
    exclude_from_weight_decay: bool | list[str] = True
    """true: the transformers Trainer's rule, as hf3d.Trainer and build_optimizer(exclude_from_weight_decay=
    True) apply it: no decay for biases and norm weights, decay for everything else, embeddings and lm_head
    included; false: decay everything; or a list of name patterns (fnmatch, e.g. ["*norm*", "*.bias",
    "model.embed_tokens.*"]) matched against parameter names (the HF names; fused projections are named
    qkv_proj / gate_up_proj)."""
    z_loss: float = 0.0
    """Coefficient of the z-loss (PaLM): z · mean log²(sum of exp of the logits); 0 turns it off. The
    logged loss stays the cross-entropy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.betas = tuple(self.betas)
        if self.z_loss < 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("optim.z_loss, optim.weight_decay and optim.max_grad_norm must be >= 0")

    def no_decay_rule(self):
        """What build_optimizer takes for exclude_from_weight_decay."""
        if isinstance(self.exclude_from_weight_decay, bool):
            return self.exclude_from_weight_decay
        patterns = list(self.exclude_from_weight_decay)
        return lambda name, param: any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass
class RunConfig:
    """The loop itself."""

    steps: int = 200
    """Optimizer steps of the whole run (a resumed run stops at the same step)."""
    global_batch: int = 16
    """Rows per optimizer step over all dp ranks (each row is data.seq_len tokens)."""
    output_dir: str = "outputs/tiny-smollm"
    log_every: int = 10
    """Steps between log lines (the progress bar updates every step)."""
    seed: int = 0
    """Seed of dropout and any other randomness in the step (the data order has data.seed)."""
    save_final: bool = True
    """Write an HF directory to <output_dir>/final at the end."""
    sample_prompt: str | None = None
    """When set, the final model writes a short sample from this prompt into the log and the output dir."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers accelerate logs every step to (tensorboard, trackio, wandb, ... or all),
    under <output_dir>; the ones not installed are named in one warning and skipped. metrics.jsonl
    is written either way."""
    collective_timeout_s: float = 600.0
    """How long a rank waits in a collective for a peer before failing (a hung or dead peer). Under nccl
    it is also how long a rank whose peer died can wait before NCCL's watchdog ends it (SIGABRT)."""
    on_nonfinite: str = "skip"
    """A step whose loss or gradient norm is inf/NaN: skip (no update, counted as skipped_steps in
    metrics.jsonl) or stop (at once, naming the step and the first parameter with a non-finite gradient)."""
    max_consecutive_skips: int = 5
    """Stop when this many steps in a row were skipped (the run is diverging, not hiccuping)."""
    spike_factor: float = 3.0
    """Warn in the log when a step's loss exceeds this many times the mean of the previous 50 steps'
    (a warning, not a stop); 0 turns it off."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms): bit-reproducible runs for a
    seed, at some speed cost on GPU. CPU fp32 runs are bit-reproducible either way."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.global_batch < 1:
            raise ValueError("run.steps and run.global_batch must be positive")
        if self.log_every < 1:
            raise ValueError(f"run.log_every must be >= 1, got {self.log_every}")
        if self.on_nonfinite not in ("skip", "stop"):
            raise ValueError(f"run.on_nonfinite must be skip or stop, got {self.on_nonfinite!r}")
        if self.max_consecutive_skips < 1 or self.spike_factor < 0:
            raise ValueError("run.max_consecutive_skips must be >= 1 and run.spike_factor >= 0 (0: off)")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"run.collective_timeout_s must be > 0, got {self.collective_timeout_s}")


@dataclass
class CheckpointPushConfig:
    """YAML `checkpoint.push_to_hub`: each checkpoint (or every N-th) uploaded to the Hub while the run goes on,
    as a stock HF folder (the checkpoint converted, as `hf3d convert to-hf` converts it) on a branch of its own,
    `step_<N>`, by rank 0 in the background (hf3d/train/hub_push.py). A failed push is one warning line and
    a `hub_push_error` in metrics.jsonl; the run goes on, and its checkpoint is kept until a push of it
    succeeds (the next resume tries again). The end of the run waits at most timeout_s for the pushes left."""

    repo: str = ""
    """The Hub repo id, NAMESPACE/NAME (created when missing); the token comes from HF_TOKEN or `hf auth login`."""
    every: int = 1
    """Push every N-th checkpoint: those at multiples of N·checkpoint.every steps, and the last step's. 1: each."""
    private: bool = True
    """Create the repo private (an existing repo keeps its setting)."""
    timeout_s: float = 1800.0
    """The most one checkpoint's push retries for, and the most the end of the run waits for the pushes left:
    those not done by then are named, their checkpoints kept for the next resume to push."""
    request_timeout_s: float = 120.0
    """How long one Hub request may wait for an answer, or go without moving a byte, before it fails (and is
    retried while timeout_s allows)."""

    def __post_init__(self) -> None:
        from ..hf.hub import check_repo_id

        for key in ("timeout_s", "request_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"checkpoint.push_to_hub.{key} must be a number of seconds > 0, got {value!r}")

        if not self.repo:
            raise ValueError("checkpoint.push_to_hub.repo is missing: give the Hub repo, e.g. my-user/my-run")
        check_repo_id(self.repo, where="checkpoint.push_to_hub.repo")
        if self.every < 1:
            raise ValueError(f"checkpoint.push_to_hub.every must be >= 1 (1 pushes each save), got {self.every!r}")


@dataclass
class CheckpointConfig:
    """Training checkpoints under <output_dir>/checkpoints/step_<N>/ (any mesh can resume them).

    Initialising from HF weights (model.path) is separate from resuming: a resume restores what the
    four load_* switches say. Continued pretraining from another run's checkpoint with a fresh
    optimizer and a re-warmed lr: resume: PATH, load_optimizer/load_scheduler/load_step/
    load_data_position: false (or give the checkpoint as model.path, which loads its weights only)."""

    every: int = 100
    """Steps between checkpoints; 0 turns checkpointing off. The last step is always saved (when on)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each save. 0 keeps all."""
    resume: str = "auto"
    """auto: the newest complete checkpoint of this output_dir, or a fresh start when there is none;
    none: always start fresh; or a path to a step_<N> folder or to a checkpoints folder."""
    load_optimizer: bool = True
    """Restore the AdamW moments (and fp32 masters) of the checkpoint resumed."""
    load_scheduler: bool = True
    """Restore the lr schedule's position; false restarts it (warm-up again) over the steps left."""
    load_step: bool = True
    """Restore the step counter; false counts from 0 again (run.steps more steps)."""
    load_data_position: bool = True
    """Restore where each data source was (and the tokens consumed); false starts the data over."""
    async_: bool = False
    """YAML `async`. true: a save returns at once; the state is copied (into host buffers kept for the run,
    pinned memory on a GPU) beside the next forward and backward, whose optimizer update waits for the copy,
    and the files, the checksums and the marker are written in the background; `latest` and keep_last follow
    there. The next save, the end of the run and a stop signal wait for it. A kill during the write publishes
    nothing, as with false."""
    push_to_hub: CheckpointPushConfig | None = None
    """Upload checkpoints to the Hub as the run goes (repo, every, private): see CheckpointPushConfig."""
    drop_pending_pushes: bool = False
    """true: forget the checkpoints an earlier run of this output_dir left waiting for a Hub push (recorded in
    hub_pending.json), so that keep_last may delete them; false keeps them (and push_to_hub pushes them)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be a number of steps >= 0, got {self.every!r}")
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last must be >= 0 (0 keeps all), got {self.keep_last!r}")
        if self.push_to_hub is not None and self.every == 0:
            raise ValueError("checkpoint.push_to_hub needs checkpoints: set checkpoint.every to a number of steps > 0")

    def push_due(self, step: int, last_step: int) -> bool:
        """Whether the checkpoint saved at `step` is pushed (checkpoint.push_to_hub)."""
        push = self.push_to_hub
        return push is not None and (step % (push.every * self.every) == 0 or step == last_step)


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
class MoEConfig:
    """Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE); ignored for dense ones."""

    load_balance: str = "aux_loss"
    """aux_loss: stock's load-balancing loss, weighted by the model config's router_aux_loss_coef, when its
    output_router_logits is true; bias: aux-loss-free balancing, a per-expert bias on the router's scores for
    the top-k pick, moved after every step towards the mean load (saved in checkpoints, not exported); none."""
    bias_update_rate: float = 1e-3
    """How far each step moves an expert's bias (load_balance: bias)."""

    def __post_init__(self) -> None:
        from ..parallel.expert import check_load_balance

        check_load_balance(self.load_balance, self.bias_update_rate, ("moe.load_balance", "moe.bias_update_rate"))


@dataclass
class PrecisionConfig:
    """FP8 training of the decoder layers' projections (hf3d/parallel/fp8.py; needs torchao: pip install
    'hf3d[fp8]')."""

    fp8: str | bool = "off"
    """off, tensorwise or rowwise (torchao's recipes). The output head, embeddings, norms and a MoE layer's
    router and experts stay in model.dtype; checkpoints never hold fp8 tensors, so a resume may switch it.
    YAML reads a bare `off` as false: that is "off" too."""
    fp8_keep: list[str] = field(default_factory=list)
    """Projections to keep in model.dtype: each entry a substring of the stock module name ("mlp.down_proj")."""
    fp8_auto_filter: bool = False
    """Also keep those torchao's size rule for the recipe expects to be slower in FP8 (small K and N)."""
    fp8_emulate: bool = False
    """torchao's emulated matmul instead of torch._scaled_mm (for checking numbers, not for speed)."""

    def __post_init__(self) -> None:
        if self.fp8 is False:  # `fp8: off` in YAML (1.1 reads off as false)
            self.fp8 = "off"
        elif self.fp8 is True:
            raise ValueError("precision.fp8 must be off, tensorwise or rowwise, got true (YAML's on / yes / true)")
        self.fp8_config()  # refuses an unknown recipe or a malformed keep list here, before anything loads

    def fp8_config(self):
        from ..parallel.fp8 import FP8Config

        try:
            return FP8Config(self.fp8, list(self.fp8_keep), self.fp8_auto_filter, self.fp8_emulate)
        except ValueError as e:
            raise ValueError(f"precision.{e}".replace("precision.fp8 keep", "precision.fp8_keep")) from None


@dataclass
class EvalsConfig(TaskEvalConfig):
    """Downstream multiple-choice scores during the run, at the training mesh (hf3d/evaluation): in
    metrics.jsonl as downstream/<task>/<acc|acc_norm|acc_norm_token> and downstream/average/..., on the log
    line, in the trackers and in the loss curve's lower panel. Rows are data.seq_len tokens, batches a
    training micro-batch's rows (compiled layers see the training shape)."""

    every: int = 0
    """Steps between evaluations; 0: only at the end (evals.at_end)."""
    at_end: bool = True
    """Also evaluate after the last step."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as e:  # the YAML key, not the command line's flag
            msg = str(e)
            raise ValueError(
                msg.replace("the evaluation's ", "evals.") if "the evaluation's " in msg else f"evals.tasks: {msg}"
            ) from None
        if self.every < 0:
            raise ValueError(f"evals.every must be a number of steps >= 0 (0: only at the end), got {self.every}")

    def active(self, steps: int) -> bool:
        """Whether a run of `steps` steps scores the tasks at all (every N <= steps, or at the end)."""
        return bool(self.tasks) and (0 < self.every <= steps or self.at_end)


@dataclass
class SamplesConfig:
    """Text generated at the training mesh from fixed prompts during the run (hf3d/generation): one line per
    prompt in <output_dir>/samples.jsonl ({step, prompt, generated_ids, text}), on the log, in the trackers."""

    prompts: list[str] = field(default_factory=list)
    every: int = 0
    """Steps between samples; 0: only at the end (samples.at_end)."""
    at_end: bool = True
    max_new_tokens: int = 32
    do_sample: bool = False
    """Greedy unless true (or a temperature, top_k or top_p is set)."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    """Sampling seed: a prompt draws the same tokens at any mesh."""

    def __post_init__(self) -> None:
        if isinstance(self.prompts, str):
            self.prompts = [self.prompts]
        if any(not isinstance(p, str) or not p for p in self.prompts):
            raise ValueError("samples.prompts must be non-empty strings")
        if self.every < 0 or self.max_new_tokens < 1:
            raise ValueError("samples.every must be >= 0 (0: only at the end) and samples.max_new_tokens >= 1")

    def due(self, step: int, steps: int) -> bool:
        """Whether the prompts are sampled after `step` (1-based)."""
        return bool(self.prompts) and (bool(self.every and step % self.every == 0) or (self.at_end and step == steps))

    def options(self) -> dict:
        """ParallelModel.generate's options."""
        warpers = {k: getattr(self, k) for k in ("temperature", "top_k", "top_p") if getattr(self, k) is not None}
        sample = self.do_sample or bool(warpers)
        return {"max_new_tokens": self.max_new_tokens, "do_sample": sample, **warpers, "seed": self.seed}


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
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise ValueError(f"unknown config section {section!r}; {hint}sections: {', '.join(fields)}")
            sub_cls = type(fields[section].default_factory())
            try:
                built[section] = build_section(sub_cls, values, section)
            except ValueError as e:  # messages of classes used outside YAML name the YAML key here
                msg = str(e).replace(f"{sub_cls.__name__}.", f"{section}.")
                raise ValueError(msg.replace("unknown pp_schedule", "unknown parallel.pp_schedule")) from None
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


RUN_FILES = (
    "metrics.jsonl",
    "samples.jsonl",
    "config.yaml",
    "loss_curve.png",
    "sample.txt",
    "memory.json",
    "checkpoints/latest",
    "hub_push",
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
