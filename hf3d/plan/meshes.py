"""The meshes a job allows on N ranks, and one line for a mesh that cannot exist for the model.

A mesh is tp x pp x dp x cp = N with: tp a size the heads and the MLP split into (the family adapter's check), at
most a node; pp stages at most the decoder layers (2 chunks per rank under interleaved-1f1b); cp with 2 x cp (x tp
under sequence parallelism) dividing seq_len, and an attention kernel cp can run (sdpa or eager, what `auto` picks
under cp; flash and flex attention only at cp = 1, as a run refuses them); ep dividing dp and the experts; the
global batch split evenly over dp and its micro-batches. Sequence parallelism is on wherever tp > 1 (it only saves
memory). For each mesh the plan tries the zero stages 1-3, recompute none / selective / full, the pipeline schedules
1f1b and interleaved-1f1b, and every micro-batch count, keeping per mesh the fastest that fits.
"""

from __future__ import annotations

import dataclasses

from ..parallel.attention import AUTO
from ..parallel.config import ParallelConfig
from ..parallel.context import check_attention

ZERO_STAGES = (1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved-1f1b")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_mesh(config, adapter, pcfg: ParallelConfig, *, seq_len: int, global_batch: int, attn: str = AUTO) -> None:
    """One line (ValueError) for a mesh this model or job cannot have: heads, layers, experts, tokens, rows, and
    the attention kernel `attn` under context parallelism."""
    adapter.check_tp(config, pcfg.tp)
    if attn != AUTO:  # auto picks sdpa under cp
        check_attention(attn, pcfg.cp)
    adapter.check_ep(config, pcfg.ep)
    if pcfg.num_stages > config.num_hidden_layers:
        raise ValueError(
            f"pp={pcfg.pp} x virtual_stages={pcfg.virtual_stages} = {pcfg.num_stages} pipeline stages for a model "
            f"with {config.num_hidden_layers} decoder layers: each stage needs at least one layer; lower pp"
        )
    need = 2 * pcfg.cp * (pcfg.tp if pcfg.sequence_parallel else 1)
    if seq_len % need:
        raise ValueError(f"seq_len {seq_len} is not a multiple of {need} (2 x cp{' x tp' * pcfg.sequence_parallel})")
    rows = pcfg.dp * pcfg.num_microbatches
    if global_batch % rows:
        raise ValueError(
            f"global batch {global_batch} rows do not split over dp={pcfg.dp} x num_microbatches="
            f"{pcfg.num_microbatches}; use a global batch that is a multiple of {rows}"
        )


def candidate_meshes(
    config, adapter, *, world: int, seq_len: int, global_batch: int, gpus_per_node: int, attn: str = AUTO
):
    """Every mesh (without zero stage, recompute and micro-batches) the job allows on `world` ranks."""
    experts = getattr(config, "num_experts", 0) or 0
    out = []
    for tp in divisors(world):
        if tp > gpus_per_node:
            continue
        for cp in divisors(world // tp):
            for pp in divisors(world // tp // cp):
                dp = world // (tp * pp * cp)
                for ep in [e for e in divisors(dp) if experts and experts % e == 0] or [1]:
                    for schedule in SCHEDULES if pp > 1 else ("1f1b",):
                        pcfg = _mesh(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, pp_schedule=schedule)
                        if pcfg is not None and _allowed(config, adapter, pcfg, seq_len, global_batch, attn):
                            out.append(pcfg)
    return out


def _mesh(**kw) -> ParallelConfig | None:
    try:
        return ParallelConfig(sequence_parallel=kw["tp"] > 1, **kw)
    except ValueError:
        return None


def _allowed(config, adapter, pcfg, seq_len, global_batch, attn) -> bool:
    try:
        check_mesh(config, adapter, pcfg, seq_len=seq_len, global_batch=global_batch, attn=attn)
    except ValueError:
        return False
    return True


def variants(pcfg: ParallelConfig, *, global_batch: int):
    """The zero stages, recompute options and micro-batch counts to try on one mesh, micro-batches fewest first."""
    rows = global_batch // pcfg.dp
    rounds = pcfg.pp if pcfg.pp > 1 else 1
    counts = [m for m in divisors(rows) if m % rounds == 0]
    for zero in ZERO_STAGES:
        for recompute in RECOMPUTES:
            for m in counts:
                try:
                    yield dataclasses.replace(pcfg, zero_stage=zero, recompute=recompute, num_microbatches=m)
                except ValueError:
                    continue
