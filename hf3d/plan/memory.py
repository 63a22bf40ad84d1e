"""Each rank's bytes for one mesh: the training state from its parameters and the zero stage, the activations
from the trace of one micro-batch per stage times what the pipeline schedule keeps in flight.

The training state follows hf3d's optimizer (hf3d/optim/zero.py, grad_buffer.py, sharded.py) arithmetically:
- ZeRO-0/1/2: the parameters in the model dtype; fp32 gradients for every element in flat buckets (matrices
  first, then vectors, each bucket closed once it reaches `bucket_size` elements and padded to a multiple of
  the shard group), under ZeRO-2 only the rank's 1/shard of each bucket plus the largest bucket while a
  micro-batch fills it; fp32 master weights for the elements the rank steps (all of them at ZeRO-0, its shard
  at 1 and 2), none when the parameters are fp32 themselves (they are their own masters); the optimizer's
  state (AdamW: two moments) on the same elements, in fp32, bf16 or torchao's 8 bits (+ a scale per 256).
- ZeRO-3 (FSDP2): fp32 shards (the master weights), their fp32 gradients and the state on 1/shard of every
  parameter, and the weights gathered at the step's peak, in the compute dtype (in float8, with a scale per
  projection, where FP8 gathers them): the stage's embedding, norm and head with two layers at pp = 1 (the one
  computing, the next prefetched), every stage of the rank under a pipeline (gathered from the first forward to
  the gradients' reduction: hf3d/parallel/fsdp.py).
The shard group is dp x cp for dense parameters (dp_shard x cp under HSDP) and dp / ep x cp for experts.

Activations: one micro-batch's bytes on each stage (hf3d/plan/trace.py) times the micro-batches the schedule
holds at its peak on that rank: one without pipelining (each micro-batch's backward follows its forward);
under 1f1b, stage s of pp holds min(m, pp - s) (its warm-up forwards); under afab all m; under
interleaved-1f1b the peak of torch's own order of forwards and backwards for the rank (the schedule's
`_calculate_single_rank_operations`), each stage's micro-batches counted at that stage's bytes.
"""

from __future__ import annotations

import dataclasses
import types

from ..optim.grad_buffer import cut_buckets
from ..parallel.fp8 import FP8Config
from .trace import RankParams

STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0 + 4.0 / 256}  # per state element (8-bit: + a scale per 256)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a run does per step, for the plan: rows of seq_len tokens per step over all dp ranks."""

    seq_len: int
    global_batch: int  # rows per optimizer step, over every dp rank
    dtype_bytes: int = 2  # the compute / parameter dtype (bf16 2, fp32 4)
    optimizer_states: int = 2  # state tensors per element (AdamW 2, SGD with momentum 1)
    state_precision: str = "fp32"
    bucket_size: int = 2**22
    target: str = "cuda"  # whose attention kernel the trace keeps ("cuda" or "cpu")
    packed: bool = True  # rows of packed documents (position ids restart), as hf3d train packs them by default
    attn: str = "auto"  # model.attn_implementation; the planner resolves "auto" per mesh as a run does
    flash: bool = False  # flash-attn is installed where the run goes ("auto" picks it on CUDA)
    compiled: bool = False  # the run compiles its layers ("auto" on CUDA then picks flex attention for packed rows)
    fp8: FP8Config | None = None  # the run's FP8 (under ZeRO-3 some weights are gathered in float8)


@dataclasses.dataclass
class RankMemory:
    """Bytes on one rank; `total` is what must fit."""

    weights: int
    master: int
    grads: int
    state: int
    activations: int
    gathered: int = 0  # ZeRO-3: the weights gathered at once at the step's peak (compute dtype or float8)

    @property
    def state_total(self) -> int:
        """Weights + master + gradients + optimizer state (+ ZeRO-3's gathered weights)."""
        return self.weights + self.master + self.grads + self.state + self.gathered

    @property
    def total(self) -> int:
        return self.state_total + self.activations

    def as_dict(self) -> dict[str, int]:
        d = dataclasses.asdict(self)
        return d | {"total": self.total}


def _shard_groups(pcfg) -> tuple[int, int]:
    """(dense shard group size, expert shard group size)."""
    shard = (pcfg.dp_shard or pcfg.dp) * pcfg.cp
    return shard, pcfg.dp // pcfg.ep * pcfg.cp


def _buckets(params: list[tuple[int, bool, bool]], *, bucket_size: int, shard: int) -> list[int]:
    """Padded elements of each gradient bucket, as grad_buffer.GradBuffer cuts them (`cut_buckets`)."""
    cut = cut_buckets([(n, matrix) for n, matrix, _ in params], bucket_size=bucket_size)
    return [-(-sum(params[i][0] for i in members) // shard) * shard for members in cut]


def training_state(trace: RankParams, pcfg, job: Job, *, zero_stage: int) -> RankMemory:
    """Weights, fp32 master, fp32 gradients and optimizer state on this rank (activations 0)."""
    shard, expert_shard = _shard_groups(pcfg)
    if pcfg.ep == 1:
        groups = [(shard, trace.params)]
    else:
        groups = [(shard, [p for p in trace.params if not p[2]]), (expert_shard, [p for p in trace.params if p[2]])]
    if zero_stage == 3:
        elements = sum(-(-n // g) for g, ps in groups for n, _, _ in ps)
        return RankMemory(4 * elements, 0, 4 * elements, _state(elements, job), 0, gathered=trace.gathered)
    buckets = [(g, _buckets(ps, bucket_size=job.bucket_size, shard=g)) for g, ps in groups]
    padded = sum(sum(b) for _, b in buckets)
    stepped = padded if zero_stage == 0 else sum(sum(b) // g for g, b in buckets)
    grads = 4 * padded
    if zero_stage == 2:
        grads = 4 * stepped + 4 * max((max(b, default=0) for _, b in buckets), default=0)
    master = 0 if job.dtype_bytes == 4 else 4 * stepped
    return RankMemory(trace.param_bytes, master, grads, _state(stepped, job), 0)


def _state(elements: int, job: Job) -> int:
    per = STATE_BYTES[job.state_precision]
    return int(job.optimizer_states * elements * per)


def in_flight(pcfg, pp_rank: int) -> dict[int, int] | list[dict[int, int]]:
    """Micro-batches of each stage this pp rank holds at once, at the schedule's peak: a dict for single-stage
    schedules; for interleaved-1f1b every moment of torch's order (the caller weighs them by bytes)."""
    m, pp = pcfg.num_microbatches, pcfg.pp
    if pp == 1:
        return {0: 1}
    if pcfg.pp_schedule == "afab":
        return {pp_rank: m}
    if pcfg.pp_schedule == "1f1b":
        return {pp_rank: min(m, pp - pp_rank)}
    if pcfg.pp_schedule == "interleaved-1f1b":
        return _interleaved_moments(pcfg, pp_rank)
    raise ValueError(
        f"the plan follows the afab, 1f1b and interleaved-1f1b schedules, not {pcfg.pp_schedule!r}: plan the "
        "mesh under interleaved-1f1b for an estimate"
    )


def _interleaved_moments(pcfg, pp_rank: int) -> list[dict[int, int]]:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    m, pp, v = pcfg.num_microbatches, pcfg.pp, pcfg.virtual_stages
    rounds = max(1, m // pp)
    fake = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=pp)
    fake._n_microbatches = m
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, pp_rank)
    live: dict[int, int] = {}
    moments = []
    for a in actions:
        if a is None:
            continue
        if a.computation_type == _ComputationType.FORWARD:
            live[a.stage_index] = live.get(a.stage_index, 0) + 1
            moments.append(dict(live))
        else:
            live[a.stage_index] -= 1
    return moments


def peak_activations(stage_bytes: dict[int, int], pcfg, pp_rank: int) -> int:
    """The rank's activation bytes at its schedule's peak, from one micro-batch's bytes on each of its stages."""
    held = in_flight(pcfg, pp_rank)
    moments = held if isinstance(held, list) else [held]
    return max(sum(stage_bytes[s] * k for s, k in moment.items()) for moment in moments)
