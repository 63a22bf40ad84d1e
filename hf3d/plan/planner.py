"""The plan of one mesh: every pipeline rank's bytes (one rank stands for the tp x dp x cp ranks of its stage,
which hold the same shapes) and the step's cost.

Traces (hf3d/plan/trace.py) are kept by what shapes them. A rank's parameters: tp, pp, its pp rank and the
schedule's stages, ep, and the zero stage (ZeRO-3 stores fp32 shards); dp does not change them, so they are
traced in the smallest world that has the mesh's groups (dp = ep). Activations: one row through the whole
model, part by part, at each tp x cp x ep, sequence parallelism and recompute; a stage's bytes are its parts'
sum, and a micro-batch's its rows times one row's (every activation is per row).
"""

from __future__ import annotations

import dataclasses

import torch

from ..parallel.attention import resolve_attn_implementation
from ..parallel.config import ParallelConfig
from ..parallel.pipeline import FUSED_HEAD_SCHEDULES
from .cost import Device, StepCost, step_cost
from .memory import Job, RankMemory, peak_activations, training_state
from .trace import Activations, RankParams, trace_activations, trace_params


@dataclasses.dataclass
class MeshPlan:
    pcfg: ParallelConfig
    micro_batch: int  # rows per micro-batch
    ranks: list[RankMemory]  # one per pipeline rank
    cost: StepCost
    fits: bool | None = None  # against the device memory, when one is given

    @property
    def peak(self) -> int:
        return max(r.total for r in self.ranks)

    def as_dict(self) -> dict:
        p = self.pcfg
        mesh = dict(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, dp_shard=p.dp_shard, zero_stage=p.zero_stage)
        mesh |= dict(pp_schedule=p.pp_schedule if p.pp > 1 else None, num_microbatches=p.num_microbatches)
        mesh |= dict(recompute=p.recompute, sequence_parallel=p.sequence_parallel)
        cost = dataclasses.asdict(self.cost)
        return dict(mesh=mesh, micro_batch=self.micro_batch, ranks=[r.as_dict() for r in self.ranks], cost=cost)


class Planner:
    """Plans meshes of one model and job; traces once per distinct shape set."""

    def __init__(self, config, job: Job, *, adapter, device: Device | None = None, nnodes: int = 1):
        self.config, self.job, self.adapter = config, job, adapter
        self.device, self.nnodes = device or Device(), nnodes
        self._params: dict[tuple, RankParams] = {}
        self._activations: dict[tuple, Activations] = {}
        self.dtype = {2: torch.bfloat16, 4: torch.float32}[job.dtype_bytes]

    def params(self, pcfg: ParallelConfig, pp_rank: int) -> RankParams:
        """The parameters of pipeline rank `pp_rank` (coordinates (pp_rank, 0, 0, 0)); dp does not change them."""
        key = (pcfg.tp, pcfg.pp, pcfg.ep, pcfg.pp_schedule, pcfg.virtual_stages, pcfg.zero_stage == 3, pp_rank)
        if key not in self._params:
            small = dataclasses.replace(pcfg, dp=pcfg.ep, dp_shard=None)
            rank = pp_rank * pcfg.ep * pcfg.cp * pcfg.tp
            self._params[key] = trace_params(self.config, small, rank=rank, dtype=self.dtype, fp8=self.job.fp8)
        return self._params[key]

    def attention(self, pcfg: ParallelConfig) -> str:
        """The attention kernel a run of this job builds on `pcfg`: the run's own rule (`resolve_attn_implementation`),
        so "auto" is flash attention on CUDA where flash-attn is installed, sdpa under context parallelism."""
        job = self.job
        return resolve_attn_implementation(
            job.attn, job.target, document_masking=job.packed, flash_available=job.flash, cp=pcfg.cp,
            compiled=job.compiled,
        )  # fmt: skip

    def activations(self, pcfg: ParallelConfig) -> Activations:
        attn = self.attention(pcfg)
        key = (pcfg.tp, pcfg.cp, pcfg.ep, pcfg.sequence_parallel, pcfg.recompute, attn)
        if key not in self._activations:
            job = self.job
            self._activations[key] = trace_activations(
                self.config, pcfg, seq_len=job.seq_len, dtype=self.dtype, target=job.target, packed=job.packed,
                attn=attn,
            )  # fmt: skip
        return self._activations[key]

    def plan(self, pcfg: ParallelConfig) -> MeshPlan:
        """`pcfg` with dp set and num_microbatches dividing the per-rank rows."""
        rows = self.job.global_batch // pcfg.dp // pcfg.num_microbatches
        ranks = []
        acts = self.activations(pcfg)
        fused = pcfg.pp == 1 or pcfg.pp_schedule in FUSED_HEAD_SCHEDULES
        last = pcfg.num_stages - 1
        for r in range(pcfg.pp):
            held = self.params(pcfg, r)
            mem = training_state(held, pcfg, self.job, zero_stage=pcfg.zero_stage)
            per_stage = {
                s: acts.stage(layers, first=s == 0, last=s == last, fused=fused, rows=rows)
                for s, layers in held.stages.items()
            }
            mem.activations = peak_activations(per_stage, pcfg, r)
            ranks.append(mem)
        elements = sum(n for n, _, _ in self.params(pcfg, 0).params)
        mlp = self.adapter.mlp_costs(self.config)
        cost = step_cost(
            self.config, pcfg, self.job, mlp_costs=mlp, param_elements=elements, device=self.device, nnodes=self.nnodes
        )
        return MeshPlan(pcfg, rows, ranks, cost)
