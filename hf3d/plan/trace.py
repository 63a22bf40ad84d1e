"""One rank of a mesh, traced on the meta device: the parameters it holds and the activations one micro-batch
leaves on each of its pipeline stages.

The rank's model is hf3d's own (`parallelize.meta_model`: the same tensor-parallel swap, stage split, expert
split and vocab padding as a run), built on the meta device in a fake world of the mesh's size
(torch's "fake" process-group backend: every collective returns at once, shapes intact). One micro-batch runs
forward through each stage and the loss under `ActivationMeter`, the same meter a run is measured with, so no
formula stands between hf3d's code and the figure. Nothing is computed and nothing allocated, so an 8B model
at 64k tokens traces in a second on a laptop.

Four places of a real forward read data that meta tensors do not have, and the trace stands in for them:
- the attention kernel: on meta, `scaled_dot_product_attention` takes its math path, which keeps the
  [heads, q, k] probabilities no fused kernel keeps; the trace calls the fused kernel of the target device
  (CPU's flash kernel, or CUDA's flash kernel: flash_attention_2 keeps the same out + logsumexp);
- the masks: sdpa and eager attention over packed rows (position ids that restart, as `hf3d train` packs
  documents) get a [b, 1, q, k] bool mask per attention kind; unpacked rows and flash attention get none;
- context parallelism's chunk masks: sdpa and eager get an additive mask in the compute dtype for each of the
  rank's two query chunks over its causal prefix of keys, packed or not (a chunk at an offset cannot take sdpa's
  causal shortcut), flash none;
- a MoE layer's token exchange: the routing is data, so the trace sends every expert its even share
  (tokens x top_k / experts), the load that balancing aims at.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..models import moe as moe_module
from ..parallel import context as cp_context
from ..parallel import expert as expert_module
from ..parallel.attention import DENSE_MASK_ATTENTION
from ..parallel.expert import is_expert
from ..parallel.fsdp import gathered_bytes
from .meter import ActivationMeter

META = torch.device("meta")


@dataclasses.dataclass
class RankParams:
    """The parameters one rank holds and the decoder layers of each of its stages."""

    params: list[tuple[int, bool, bool]]  # (elements, a matrix, an expert's) of each parameter, in the model's order
    param_bytes: int  # the parameters as the rank stores them
    gathered: int  # ZeRO-3: bytes of the weights gathered at once at the step's peak (parallel.fsdp.gathered_bytes)
    stages: dict[int, list[int]]  # stage index -> its decoder layers


@dataclasses.dataclass
class Activations:
    """One row's activation bytes by part, at one tp x cp x ep and recompute: what the embedding's output keeps,
    what each stage's masks and position embeddings keep, each decoder layer, and the head + loss (fused: the
    chunked head of pp = 1 and 1f1b; plain: logits)."""

    embed: int
    shared: int
    layers: list[int]
    head: dict[bool, tuple[int, int]]  # fused? -> (bytes per row, bytes per micro-batch)

    def stage(self, layers: list[int], *, first: bool, last: bool, fused: bool, rows: int) -> int:
        """A micro-batch's bytes on a stage: the parts it runs (its input from the previous stage is the pipeline's
        buffer, not counted)."""
        out = rows * (self.shared + sum(self.layers[i] for i in layers) + (self.embed if first else 0))
        if last:
            per_row, per_batch = self.head[fused]
            out += rows * per_row + per_batch
        return out


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """A fake default process group: this process plays `rank` of `world`."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _kernel(target: str):
    """F.scaled_dot_product_attention as the target device's fused kernel runs it (what it keeps for backward)."""

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # the fused kernels read grouped KV heads as they are (enable_gqa): no repeated copies are kept
        if target == "cuda":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    return attention


class _EvenDispatch(expert_module.Dispatch):
    """Dispatch with every expert given its even share of the assignments (no host read of the routing)."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int, group):
        self.group = None if expert_module._trivial(group) else group
        ep = 1 if self.group is None else dist.get_world_size(self.group)
        self.num_tokens, self.k = top_k_index.shape
        self.num_local = num_experts // ep
        n = self.num_tokens * self.k
        self.order = torch.empty(n, dtype=torch.long, device=top_k_index.device)
        self.rows = torch.empty(n, dtype=torch.long, device=top_k_index.device)
        share = n // ep
        self.send = self.recv = None if self.group is None else [share] * ep
        self.tokens_per_expert = torch.empty(self.num_local, dtype=torch.long, device=top_k_index.device)
        self.regroup = None if self.group is None else torch.empty(share * ep, dtype=torch.long, device=META)


@contextlib.contextmanager
def _stand_ins(target: str, dense_masks: bool, b: int, s: int):
    """The four stand-ins of the module docstring, for the length of a trace."""

    def mask(q: int, k: int):
        return torch.empty(b, 1, q, k, dtype=torch.bool, device=META) if dense_masks else None

    def chunk_mask(config, kind, fn, *, q_length: int, kv_length: int, dtype, **_):
        if config._attn_implementation not in DENSE_MASK_ATTENTION:
            return None
        return torch.empty(b, 1, q_length, kv_length, dtype=dtype, device=META)

    saved = (F.scaled_dot_product_attention, cp_context.find_packed_sequence_indices, cp_context.interface_mask)
    saved_dispatch, saved_mm = moe_module.Dispatch, moe_module.grouped_mm
    F.scaled_dot_product_attention = _kernel(target)
    cp_context.find_packed_sequence_indices = lambda position_ids: None
    cp_context.interface_mask = chunk_mask
    moe_module.Dispatch = _EvenDispatch
    # torch's grouped GEMM has no fp32 meta kernel; one matmul over all rows keeps what it keeps (x, the weights)
    moe_module.grouped_mm = lambda x, weight, offsets: x @ weight[0].t()
    try:
        yield lambda kind, probe, position_ids: mask(s, s)
    finally:
        F.scaled_dot_product_attention, cp_context.find_packed_sequence_indices, cp_context.interface_mask = saved
        moe_module.Dispatch, moe_module.grouped_mm = saved_dispatch, saved_mm


def trace_params(config, pcfg, *, rank: int, dtype: torch.dtype, fp8=None) -> RankParams:
    """`rank`'s parameters under the mesh `pcfg` (its world: tp x pp x dp x cp, dp set): the same whatever the
    attention kernel. fp8: the run's FP8Config (ZeRO-3 gathers some weights in float8)."""
    from ..parallelize import meta_model

    with fake_world(rank, pcfg.tp * pcfg.pp * pcfg.dp * pcfg.cp):
        pmodel = meta_model(config, pcfg, dtype=dtype, attn="sdpa", fp8=fp8)
    params = [p for _, p in pmodel.unique_parameters()]
    shapes = [(p.numel(), p.dim() > 1, is_expert(p)) for p in params]
    stored = sum(p.numel() * p.element_size() for p in params)
    stages = {st.stage_index: list(st.layer_ids) for st in pmodel.stages}
    return RankParams(shapes, stored, gathered_bytes(pmodel), stages)


def trace_activations(
    config, pcfg, *, seq_len: int, dtype: torch.dtype, target: str = "cpu", packed: bool = True, attn: str = "sdpa"
) -> Activations:
    """One row through the whole model as one stage on rank 0 of `pcfg` without pipelining (pp 1, dp = ep), the
    meter read between its parts: a layer keeps the same bytes on whichever stage it runs. `attn` is the kernel
    the run builds; flash and flex attention trace as sdpa without masks (what they keep: out + logsumexp)."""
    from ..parallelize import meta_model

    flat = dataclasses.replace(
        pcfg, pp=1, dp=pcfg.ep, dp_shard=None, pp_schedule="1f1b", num_microbatches=1, virtual_stages=1
    )
    masked = attn in DENSE_MASK_ATTENTION
    with fake_world(0, flat.tp * flat.dp * flat.cp):
        pmodel = meta_model(config, flat, dtype=dtype, attn=attn if masked else "sdpa")
        with _stand_ins(target, packed and masked, 1, seq_len) as packed_mask:
            stage = pmodel.stages[0]
            stage._packed_mask = packed_mask
            marks = _trace_stage(pmodel, stage, seq_len)
            heads = {fused: [_trace_head(pmodel, stage, seq_len, rows, fused) for rows in (1, 2)] for fused in (0, 1)}
    embed, shared = marks[0], marks[1] - marks[0]
    layers = [marks[i + 2] - marks[i + 1] for i in range(len(stage.layers))]
    # the head's bytes per row, and per micro-batch whatever its rows (the fused head's weight gradient)
    head = {bool(f): (two - one, 2 * one - two) for f, (one, two) in heads.items()}
    return Activations(embed, shared, layers, head)


def _inputs(pmodel, s: int, rows: int = 1):
    local = s // pmodel.pcfg.cp
    positions = torch.zeros(rows, s, dtype=torch.long, device=META)
    stats = pmodel.router_stats
    if stats is not None:
        stats.start_step(META)
        stats.rows, stats.coef = rows * s, 0.0
        stats.start(None, META)
    targets = torch.zeros(rows, local, dtype=torch.long, device=META)
    return local, positions, targets, torch.ones((), device=META)


def _trace_stage(pmodel, stage, s: int) -> list[int]:
    """Live bytes after the embedding, before the first layer and after each layer, for one row."""
    local, positions, _, _ = _inputs(pmodel, s)
    x = torch.zeros(1, local, dtype=torch.long, device=META)
    marks: list[int] = []
    with ActivationMeter() as meter:
        hooks = [stage.embed_tokens.register_forward_hook(lambda *_: marks.append(meter.live()))]
        hooks.append(stage.layers[0].register_forward_pre_hook(lambda *_: marks.append(meter.live())))
        hooks += [layer.register_forward_hook(lambda *_: marks.append(meter.live())) for layer in stage.layers]
        stage(x, position_ids=positions, head=False)
        for h in hooks:
            h.remove()
        return marks


def _trace_head(pmodel, stage, s: int, rows: int, fused: bool) -> int:
    """Bytes the final norm, the head and the loss keep for `rows` rows (the last layer's output not counted):
    fused, the chunked head (its weight's gradient made in the forward); plain, the logits, which a pipeline
    schedule holds as the micro-batch's output until its backward."""
    local, _, targets, count = _inputs(pmodel, s, rows)
    pcfg = pmodel.pcfg
    tokens = local // pcfg.tp if pcfg.sequence_parallel else local
    hidden = torch.empty(rows, tokens, pmodel.config.hidden_size, dtype=pmodel.compute_dtype, device=META)
    hidden.requires_grad_(True)
    with ActivationMeter() as meter:
        kept = [stage.norm(hidden)]
        if fused:
            kept.append(stage.lm_head.fused_loss_terms(kept[0], targets, count)[0])
        else:
            kept.append(stage.lm_head(kept[0]))
            kept.append(stage.lm_head.loss_terms(kept[1].flatten(0, 1), targets.flatten(), count)[0])
        del kept[0]  # the norm's output: saved by the head only if it needs it
        return meter.live()  # the logits and the loss in `kept` hold the graph until here
