"""The sections of the `hf3d train` YAML but `data` and `parallel` (hf3d/data, hf3d.ParallelConfig): one small
dataclass each, validated where it is built; hf3d/train/config.py puts them together."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from ..evaluation.config import TaskEvalConfig
from ..parallel.config import DTYPE_NAMES
from .lr_schedules import ScheduleConfig

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


OPTIMIZERS = ("adamw", "muon")
ADJUST_LR_FNS = ("original", "match_rms_adamw")


@dataclass
class MuonConfig:
    """`optim.muon` (with `optim.name: muon`): torch.optim.Muon's settings for the hidden matrices; AdamW keeps
    optim.lr, betas, eps and weight_decay for the rest (hf3d/optim/muon.py, docs/muon.md)."""

    lr: float = 0.02
    """Muon's peak learning rate; the lr schedule scales it by the same factor as optim.lr (so it ends at
    lr · optim.min_lr / optim.lr)."""
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    """Newton-Schulz iterations per step (torch takes 1 to 99)."""
    adjust_lr_fn: str | None = None
    """null (torch's "original": lr · sqrt(max(1, fan_out / fan_in))) or "match_rms_adamw" (lr · 0.2 ·
    sqrt(max(fan_out, fan_in)), Moonlight's: an update of AdamW's size, to run at AdamW's lr and weight decay)."""
    weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices; null: optim.weight_decay (the resolved config shows it)."""
    params: list[str] | None = None
    """null: the hidden matrices (fan-in and fan-out both grow with width: attention and MLP projections, each
    expert's own); or fnmatch patterns of HF parameter names (q_proj, k_proj, v_proj, gate_proj and up_proj
    apart), each picking 2-D tensors only, e.g. ["model.layers.*.mlp.*"]."""

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not self.lr > 0:
            raise ValueError(f"optim.muon.lr must be a number > 0, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"optim.muon.momentum must be in [0, 1), got {self.momentum!r}")
        if not 1 <= self.ns_steps < 100:
            raise ValueError(f"optim.muon.ns_steps must be 1 to 99 Newton-Schulz iterations, got {self.ns_steps!r}")
        if self.adjust_lr_fn not in (None, *ADJUST_LR_FNS):
            raise ValueError(
                f"optim.muon.adjust_lr_fn must be null or original (torch's default) or match_rms_adamw, got "
                f"{self.adjust_lr_fn!r}"
            )
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(
                f"optim.muon.weight_decay must be >= 0 (null: optim.weight_decay), got {self.weight_decay}"
            )
        if self.params is not None and (not self.params or not all(isinstance(x, str) and x for x in self.params)):
            raise ValueError(
                "optim.muon.params must be null (the hidden matrices) or a non-empty list of HF name patterns, e.g. "
                f"['model.layers.*.mlp.*'], got {self.params!r}"
            )


@dataclass
class OptimConfig(ScheduleConfig):
    """The optimizer (AdamW, or Muon with AdamW; fp32 state, ZeRO-1 sharded over dp) and its learning-rate
    schedule. lr, betas, eps and weight_decay are AdamW's, also under name: muon (for the parameters Muon does not
    step)."""

    name: str = "adamw"
    """adamw, or muon: torch.optim.Muon on the hidden matrices (settings in optim.muon), AdamW on the embeddings,
    head, norms, biases and routers (docs/muon.md). Muon needs parallel.zero_stage 0 or 1 and no parallel.dp_shard."""
    muon: MuonConfig | None = None
    """Muon's settings (lr, momentum, nesterov, ns_steps, adjust_lr_fn, weight_decay, params): see MuonConfig;
    only with name: muon, which fills in the defaults when it is left out."""
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
    state_precision: str = "fp32"
    """The optimizer state between steps: fp32; bf16 (AdamW's moments and Muon's momentum in bf16, stepped in
    fp32: half the bytes); 8bit (torchao's AdamW8bit, with optim.name: adamw). The fp32 master weights stay."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.state_precision not in ("fp32", "bf16", "8bit") or (
            self.state_precision == "8bit" and self.name == "muon"
        ):
            raise ValueError(
                f"optim.state_precision must be fp32, bf16 or 8bit (8bit with optim.name: adamw only: torchao's "
                f"AdamW8bit), got {self.state_precision!r}"
                + (" with optim.name: muon; use bf16" if self.state_precision == "8bit" else "")
            )
        self.betas = tuple(self.betas)
        if self.z_loss < 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("optim.z_loss, optim.weight_decay and optim.max_grad_norm must be >= 0")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name must be {' or '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.name == "adamw" and self.muon is not None:
            raise ValueError(
                "optim.muon is set but optim.name is adamw: set optim.name: muon, or remove optim.muon (or set it to "
                "null)"
            )
        if self.name == "muon":
            self.muon = self.muon or MuonConfig()
            if self.muon.weight_decay is None:  # the resolved config records what runs
                self.muon.weight_decay = self.weight_decay

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
    hang_timeout: float | str = "auto"
    """Seconds with no step finished on any rank before the run counts as hung: each rank says where it is, one line
    names the ranks that did not get as far as the others (coordinates, step, phase, the function they are in) and
    where the others wait, and every rank ends with exit code 4, which torchrun --max-restarts restarts from the last
    checkpoint (hf3d/train/watchdog.py). Not counted: the run's first step and each data stage's first (compile,
    warm-up), and any time a rank spends in evaluation, downstream evals, samples or a checkpoint save (its peers
    wait for it); the end of the run (export, pushes) is not watched. auto: 20x the longest step so far, at least
    120 s, at most 0.8x run.collective_timeout_s; a number: seconds, below run.collective_timeout_s (which would end
    the run first, exit code 3); 0: off."""
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
        if self.hang_timeout != "auto" and not (
            type(self.hang_timeout) in (float, int) and 0 <= self.hang_timeout < self.collective_timeout_s
        ):
            raise ValueError(
                f"run.hang_timeout must be auto, 0 (off) or a number of seconds below run.collective_timeout_s "
                f"({self.collective_timeout_s:g}), got {self.hang_timeout!r}"
            )


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
    replace_later_steps: bool = False
    """A run that goes on from an earlier step than checkpoints of its own output_dir (resume: PATH to an older
    checkpoint, resume: none, load_step: false) would replace them as it reaches their steps, and keep_last
    would rotate the others away: they belong to another trajectory, so the run is refused at start, naming
    them. true lets it go on and replace them (said at start)."""

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
    base_model: str | None = None
    """The Hub id the weights descend from, for the card's metadata (`base_model`), when model.path is a local
    folder that does not record it (hf3d finds it in an hf3d export or checkpoint, or a Hub id as config.json's
    _name_or_path)."""
    datasets: list[str] = field(default_factory=list)
    """Hub ids of the datasets the run trained on, for the card's metadata, when the data sources are local files
    (a source given as a Hub id is named already)."""

    def __post_init__(self) -> None:
        from ..hf.hub import check_repo_id

        if self.base_model is not None:
            check_repo_id(self.base_model, where="export.base_model")
        for i, name in enumerate(self.datasets):
            check_repo_id(name, where=f"export.datasets[{i}]")


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
    fp8_all_gather: bool = True
    """Under parallel.zero_stage 3 and the tensorwise recipe, gather the projections' weights as float8 values
    and scales (a quarter of fp32's bytes); false gathers them in model.dtype."""

    def __post_init__(self) -> None:
        if self.fp8 is False:  # `fp8: off` in YAML (1.1 reads off as false)
            self.fp8 = "off"
        elif self.fp8 is True:
            raise ValueError("precision.fp8 must be off, tensorwise or rowwise, got true (YAML's on / yes / true)")
        self.fp8_config()  # refuses an unknown recipe or a malformed keep list here, before anything loads

    def fp8_config(self):
        from ..parallel.fp8 import FP8Config

        try:
            return FP8Config(self.fp8, list(self.fp8_keep), self.fp8_auto_filter, self.fp8_emulate, self.fp8_all_gather)
        except ValueError as e:
            raise ValueError(f"precision.{e}".replace("precision.fp8 keep", "precision.fp8_keep")) from None


@dataclass
class EvalsConfig(TaskEvalConfig):
    """Downstream multiple-choice scores during the run, at the training mesh (hf3d/evaluation): in
    metrics.jsonl as downstream/<task>/<acc|acc_norm|acc_norm_token|bpb> and downstream/average/..., on the log
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
