"""Parallel dimensions: one validated object that names every degree and builds the mesh."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass

from .sharding import launch_settings, training_args_settings

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the training and export dtypes, torch.<name>
PP_SCHEDULES = ("afab", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
ZERO_STAGES = (0, 1, 2, 3)
# ParallelConfig.from_env: field -> environment variable
ENV_VARS = {
    "tp": "HF3D_TP",
    "pp": "HF3D_PP",
    "dp": "HF3D_DP",
    "cp": "HF3D_CP",
    "ep": "HF3D_EP",
    "pp_schedule": "HF3D_PP_SCHEDULE",
    "num_microbatches": "HF3D_NUM_MICROBATCHES",
    "compile": "HF3D_COMPILE",
    "zero_stage": "HF3D_ZERO_STAGE",
    "dp_shard": "HF3D_DP_SHARD",
}
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}

# attention backends of transformers' registry that need a package of their own (the `gpu` extra installs it)
ATTN_PACKAGES = {"flash_attention_2": "flash_attn"}


def check_attn_implementation(name: str, key: str = "attn_implementation") -> None:
    """Refuse a backend whose package is missing, before any model is built (transformers' own refusal comes
    as a long traceback from inside the model's construction)."""
    package = ATTN_PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f'{key}={name!r} needs the {package} package, which is not installed: pip install "hf3d[gpu]" '
            "(CUDA only), or use sdpa"
        )


PARAMETRIZATIONS = ("standard", "spectral_mup")


def check_parametrization(
    parametrization, base_width, output_multiplier=1.0, *, where: str = "ParallelConfig."
) -> None:
    """One line for a parametrization that is unknown, µP without a usable base width, or an output
    multiplier that is not a positive number or comes without µP."""
    if parametrization not in PARAMETRIZATIONS:
        raise ValueError(
            f"{where}parametrization must be one of {', '.join(PARAMETRIZATIONS)}, got {parametrization!r}"
        )
    if parametrization == "standard":
        mup_keys = (("mup_base_width", base_width, None), ("mup_output_multiplier", output_multiplier, 1))
        for key, value, unset in mup_keys:
            if value != unset:
                raise ValueError(
                    f"{where}{key}={value!r} is set but {where}parametrization is 'standard': set "
                    f"parametrization: spectral_mup, or leave {key} unset"
                )
        return
    if base_width is None:
        raise ValueError(
            f"{where}parametrization 'spectral_mup' needs {where}mup_base_width: the hidden_size of the proxy "
            "model whose learning rate you transfer (the model's own hidden_size makes µP equal to standard)"
        )
    if isinstance(base_width, bool) or not isinstance(base_width, int) or base_width < 1:
        raise ValueError(f"{where}mup_base_width must be a positive integer (a hidden_size), got {base_width!r}")
    a = output_multiplier
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
        raise ValueError(
            f"{where}mup_output_multiplier must be a positive number (the gain on the logits tuned on the proxy; "
            f"1 is stock's), got {a!r}"
        )


RECOMPUTE_FORMS = '"none", "full" or "every_<k>" with k a positive integer (e.g. "every_2"), or "selective"'
# zbv / dualpipev split each backward into an input pass and weight passes, and a recomputed layer runs
# its forward again in each of them: measured 4-8 forwards per layer and micro-batch instead of 2
RECOMPUTE_SPLIT_BACKWARD = (
    "recompute is not supported with pp_schedule {schedule!r}: it splits backward into input and weight "
    "passes and each pass would run the recomputed layers' forward again; use pp_schedule '1f1b' or "
    "'interleaved-1f1b' with recompute, or recompute='none'"
)


def check_cp_seq_len(
    seq_len: int, *, cp: int, tp: int, sequence_parallel: bool, where: str = "the sequence length"
) -> None:
    """Context parallelism cuts each sequence into 2*cp chunks (and sequence parallelism each cp rank's
    S/cp tokens into tp parts): raise one line when `seq_len` does not divide."""
    if cp == 1:
        return
    need = math.lcm(2 * cp, cp * tp) if sequence_parallel else 2 * cp
    if seq_len % need:
        why = f"2*cp = {2 * cp}" + (f" and cp*tp = {cp * tp} under sequence_parallel" if sequence_parallel else "")
        raise ValueError(
            f"{where}={seq_len} is not a multiple of {need} ({why}): context parallelism cuts each sequence into "
            f"2*cp chunks; use a sequence length that is a multiple of {need}"
        )


def _check_recompute(value) -> str:
    if value is True or value is False:
        return "full" if value else "none"
    if isinstance(value, str):
        if value in ("none", "full", "selective"):
            return value
        k = value.removeprefix("every_")
        if value.startswith("every_") and k.isdecimal() and int(k) >= 1:
            return "full" if int(k) == 1 else f"every_{int(k)}"
    raise ValueError(f"ParallelConfig.recompute must be {RECOMPUTE_FORMS}, got {value!r}")


@dataclass
class ParallelConfig:
    """How one training job is split over processes.

    The device mesh has axes ("pp", "dp", "cp", "tp"), pp outermost and tp innermost, cp next to it,
    so tensor- and context-parallel peers are neighbouring ranks (same node on GPU clusters); pp and
    dp span nodes. The world size is tp * pp * dp * cp.
    """

    tp: int = 1
    """Tensor-parallel degree: attention heads, MLP columns and the vocabulary are split tp ways."""
    pp: int = 1
    """Pipeline-parallel degree: the decoder layers are split into pp stages."""
    dp: int | None = None
    """Data-parallel degree; None means world_size // (tp * pp * cp)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: one of PP_SCHEDULES."""
    num_microbatches: int | None = None
    """Micro-batches per optimizer step (gradient accumulation, and the pipeline's micro-batches);
    None: 1 without pipelining, else the fewest the schedule runs (pp, or 2*pp for zbv/dualpipev)."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank; None: 2 for interleaved-1f1b, zbv and dualpipev, else 1.
    interleaved-1f1b takes any value >= 2 (at pp > 1), zbv and dualpipev exactly 2, afab and 1f1b 1."""
    zero_stage: int = 1
    """How much of the training state is sharded over dp (dp x cp under context parallelism; an expert's own
    group for MoE experts): 0: nothing (gradients all-reduced, optimizer replicated); 1: the optimizer state and
    fp32 master weights; 2: also the fp32 gradients, reduced into each rank's shard as backward makes them;
    3: also the weights, through PyTorch's FSDP2 (hf3d/parallel/fsdp.py), gathered layer by layer for compute."""
    dp_shard: int | None = None
    """HSDP: shard the state of `zero_stage` within groups of dp_shard neighbouring dp ranks and replicate it
    across the dp // dp_shard groups (a node shards, nodes replicate). None: shard over the whole dp."""
    sequence_parallel: bool = False
    """Shard norms and residuals along the sequence inside tensor-parallel regions."""
    cp: int = 1
    """Context-parallel degree: each sequence is cut into 2*cp chunks and cp rank r holds chunks r and
    2*cp-1-r (causal load balance); attention all-gathers keys and values over cp (hf3d.parallel.context).
    Every tp/pp/cp rank of a dp replica passes the same full rows; gradients are reduced and ZeRO-1 shards
    over dp x cp."""
    recompute: str = "none"
    """Activation recompute: "none"; "full" (every decoder layer keeps only its input and runs its
    forward again in backward); "every_<k>" (layers k-1, 2k-1, ... of the whole model, counted from 0,
    like every k-th block in torchtitan); "selective" (every decoder layer keeps its input and the outputs of
    its matmuls and attention kernels, and runs the rest of its forward again in backward: the element-wise
    ops, norms, rotary, SwiGLU, eager attention's softmax and the layer's tp / cp collectives; PyTorch's
    selective activation checkpointing, hf3d/parallel/stage.py; under `compile` only the attention kernels'
    outputs are kept). True and False mean "full" and "none"."""
    activation_offload: bool = False
    """Training on CUDA, each pipeline stage's forward moves the tensors it saves for backward to pinned host
    memory, and backward copies them back as it needs them (torch.autograd.graph.save_on_cpu): GPU memory for
    PCIe traffic. Everything the stage's autograd saves moves (the weights its matmuls save too); a layer under
    recompute keeps its own checkpoint hooks, which are the inner ones and win: it saves its input and, under
    "selective", its kept matmul and attention outputs on the GPU as before. On a CPU the activations already
    are in host memory: nothing is moved and training is the same, bit for bit."""
    ep: int = 1
    """Expert-parallel degree (MoE models): each MoE layer's experts are split ep ways over groups of ep
    neighbouring dp ranks, which exchange tokens all-to-all (hf3d.parallel.expert). ep divides dp and adds
    no world factor; an expert's parameters are replicated over the dp // ep ranks that hold it (times cp),
    and its gradients are reduced and ZeRO-1 shards there."""
    compile: bool | str = False
    """Regional compile: every decoder layer of this rank goes through torch.compile, in place, after the
    tensor-parallel swap (hf3d/parallel/compile.py); the embedding, the head, the loss and the pipeline stay eager.
    Needs inductor's backend for the device (a C++ compiler on CPU, triton on CUDA). "auto" (what `hf3d train`
    takes when the key is not written): on with CUDA where compile can run, off on a CPU
    (`compile.resolve_compile`)."""

    parametrization: str = "standard"
    """How init and learning rates scale with width: "standard" (stock init, one lr) or "spectral_mup"
    (hf3d/optim/parametrization.py): stock init and the optimizer's lr scaled per parameter from its fan-in and
    fan-out, so that an lr tuned at `mup_base_width` transfers to this width. Not a parallel degree: it is
    here because parallelize (the init) and build_optimizer (the lrs) both read it, the same on every mesh."""
    mup_base_width: int | None = None
    """spectral_mup: the hidden_size of the narrow proxy the lr was tuned on (<= the model's hidden_size)."""
    mup_output_multiplier: float = 1.0
    """spectral_mup: a gain on the logits, tuned on the proxy with the lr (µTransfer's output multiplier): the
    readout's init and lr times it at the base width (tied embeddings: the final norm's weight, which µP
    already scales by base / width). 1.0: stock's logits. The model stays stock: the gain lives in a weight."""

    def __post_init__(self) -> None:
        if self.num_microbatches is None:
            v_shaped = self.pp_schedule in ("zbv", "dualpipev")
            self.num_microbatches = 1 if self.pp == 1 else self.pp * (2 if v_shaped else 1)
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.pp_schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
        for name in ("tp", "pp", "cp", "ep", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"ParallelConfig.dp must be a positive integer or None, got {self.dp!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(
                f"unknown ParallelConfig.pp_schedule {self.pp_schedule!r}; known schedules: {', '.join(PP_SCHEDULES)}"
            )
        self.recompute = _check_recompute(self.recompute)
        if not isinstance(self.activation_offload, bool):
            raise ValueError(
                f"ParallelConfig.activation_offload must be true or false, got {self.activation_offload!r}"
            )
        if self.recompute != "none" and self.pp > 1 and self.pp_schedule in ("zbv", "dualpipev"):
            raise ValueError(RECOMPUTE_SPLIT_BACKWARD.format(schedule=self.pp_schedule))
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise ValueError(f"ParallelConfig.compile must be true, false or 'auto', got {self.compile!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.dp_shard is not None and (
            isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or self.dp_shard < 1
        ):
            raise ValueError(f"ParallelConfig.dp_shard must be a positive integer or None, got {self.dp_shard!r}")
        check_parametrization(self.parametrization, self.mup_base_width, self.mup_output_multiplier)
        if self.pp_schedule in ("zbv", "dualpipev") and self.virtual_stages != 2:
            raise ValueError(
                f"pp_schedule {self.pp_schedule!r} runs exactly 2 virtual stages per rank, got "
                f"virtual_stages={self.virtual_stages}; leave virtual_stages unset (None) or set it to 2"
            )
        if self.pp_schedule == "interleaved-1f1b" and self.pp > 1 and self.virtual_stages < 2:
            raise ValueError(
                "pp_schedule 'interleaved-1f1b' needs virtual_stages >= 2 "
                "(model chunks per pipeline rank); use '1f1b' for one chunk per rank"
            )
        if self.pp_schedule in ("afab", "1f1b") and self.virtual_stages != 1:
            raise ValueError(
                f"pp_schedule {self.pp_schedule!r} runs one stage per rank; "
                "use 'interleaved-1f1b' for virtual_stages > 1"
            )

        self._check_microbatches()

    @classmethod
    def from_env(cls, training_args=None, **overrides) -> ParallelConfig:
        """A config from the HF3D_* environment variables (ENV_VARS), for launch scripts that set the
        degrees outside the Python code, and from an FSDP2 configuration users already have: an `accelerate
        launch` whose config asks for FSDP2, or `training_args`, transformers TrainingArguments with `fsdp` set
        (their zero stage, HSDP split, tp, cp and recompute: hf3d/parallel/sharding.py). Unset or empty variables
        take the field defaults; the TrainingArguments win over accelerate's launch, HF3D_* over both, and
        keyword overrides over everything: `ParallelConfig.from_env(num_microbatches=8)`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"ParallelConfig.from_env got unknown field(s) {', '.join(unknown)}")
        fsdp = launch_settings(os.environ) | (training_args_settings(training_args) if training_args else {})
        fsdp = {k: v for k, v in fsdp.items() if k not in overrides}
        kwargs, used = dict(fsdp), [f"the FSDP2 config's {fsdp}"] if fsdp else []
        for name, var in ENV_VARS.items():
            raw = os.environ.get(var, "").strip()
            if not raw or name in overrides:
                continue
            used.append(f"{var}={raw}")
            if name == "pp_schedule":
                if raw not in PP_SCHEDULES:
                    raise ValueError(f"{var}={raw!r} is not a pipeline schedule; known: {', '.join(PP_SCHEDULES)}")
                kwargs[name] = raw
                continue
            if name == "compile":
                if raw.lower() not in (*BOOL_WORDS, "auto"):
                    raise ValueError(f"{var} must be 1 or 0 (true or false), or auto, got {raw!r}")
                kwargs[name] = BOOL_WORDS.get(raw.lower(), "auto")
                continue
            value = int(raw) if raw.lstrip("+-").isdecimal() else -1
            if name == "zero_stage":
                if value not in ZERO_STAGES:
                    raise ValueError(f"{var} must be 0, 1, 2 or 3, got {raw!r}")
            elif value < 1:
                raise ValueError(f"{var} must be a positive integer, got {raw!r}")
            kwargs[name] = value
        try:
            return cls(**kwargs, **overrides)
        except ValueError as e:
            if not used:
                raise
            raise ValueError(f"{e} (from the environment: {', '.join(used)})") from None

    def _check_microbatches(self) -> None:
        if self.pp == 1 or self.pp_schedule == "afab":
            return
        m, need = self.num_microbatches, self.num_stages if self.pp_schedule in ("zbv", "dualpipev") else self.pp
        if m < need:
            raise ValueError(
                f"pp_schedule {self.pp_schedule!r} with pp={self.pp} (virtual_stages={self.virtual_stages}) needs at "
                f"least {need} micro-batches per step, got num_microbatches={m}; raise num_microbatches to {need} "
                "or use pp_schedule='afab'"
            )
        if self.pp_schedule != "1f1b":
            rounds = max(1, m // self.pp)
            if m % rounds:
                raise ValueError(
                    f"pp_schedule {self.pp_schedule!r} runs micro-batches in rounds of pp={self.pp}: "
                    f"num_microbatches={m} must be a multiple of {rounds}; try {rounds * self.pp}"
                )

    def recomputes(self, layer_index: int) -> bool:
        """Whether decoder layer `layer_index` (global, from 0) runs its forward again in backward (whole, or
        all but its matmuls and attention under "selective")."""
        if self.recompute == "none":
            return False
        every = 1 if self.recompute in ("full", "selective") else int(self.recompute.removeprefix("every_"))
        return (layer_index + 1) % every == 0

    def recompute_kind(self, layer_index: int) -> str:
        """How decoder layer `layer_index` is recomputed: "none", "full" or "selective" (what StageModule runs)."""
        if not self.recomputes(layer_index):
            return "none"
        return "selective" if self.recompute == "selective" else "full"

    @property
    def num_stages(self) -> int:
        """Total pipeline stages (model chunks) over all pipeline ranks."""
        return self.pp * (self.virtual_stages if self.pp > 1 else 1)

    def resolve(self, world_size: int) -> ParallelConfig:
        """Fill in dp from the world size and check that tp * pp * dp * cp == world_size."""
        tp, pp, cp = self.tp, self.pp, self.cp
        if world_size % (tp * pp * cp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp * pp * cp = {tp} * {pp} * {cp} = "
                f"{tp * pp * cp}; launch tp * pp * dp * cp processes"
            )
        dp = self.dp if self.dp is not None else world_size // (tp * pp * cp)
        if tp * pp * dp * cp != world_size:
            raise ValueError(
                f"tp * pp * dp * cp = {tp} * {pp} * {dp} * {cp} = {tp * pp * dp * cp} but the world "
                f"size is {world_size}; launch exactly tp * pp * dp * cp processes or set dp=None"
            )
        if dp % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp={dp}: expert-parallel groups are made of dp ranks (ep adds no "
                f"world factor); use an ep that divides {dp}, or launch more processes"
            )
        self.dp = dp
        self._check_dp_shard()
        return self

    def _check_dp_shard(self) -> None:
        k = self.dp_shard
        if k is None or k == self.dp:
            return
        if self.dp % k:
            divisors = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
            raise ValueError(
                f"dp_shard={k} does not divide dp={self.dp}: HSDP shards within groups of dp_shard dp ranks and "
                f"replicates across dp // dp_shard of them; use one of {divisors}, or leave dp_shard unset"
            )
        if self.zero_stage == 0:
            raise ValueError(
                f"dp_shard={k} with zero_stage=0: zero 0 shards nothing; use zero_stage 1, 2 or 3 with dp_shard, "
                "or leave dp_shard unset"
            )
        if self.ep > 1:
            raise ValueError(
                f"dp_shard={k} with ep={self.ep}: HSDP is not built for expert parallelism; leave dp_shard unset "
                "(the state is sharded over the whole dp) or use ep=1"
            )

    @property
    def shard_size(self) -> int:
        """The dp ranks one shard group spans (dp_shard, or the whole dp); after `resolve`."""
        return self.dp if self.dp_shard is None else self.dp_shard
