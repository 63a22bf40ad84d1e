"""ZeRO-3: the weights sharded over data parallelism by PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

hf3d owns no all-gather engine: FSDP2 shards each parameter along dim 0 over the shard mesh (dp, dp x cp under
context parallelism, the (replicate, shard) mesh under HSDP; a MoE layer's experts over the ranks holding the same
experts), all-gathers a group before its forward (prefetching the next), reshards it after, gathers it again for
backward and reduce-scatters its gradient (a weight whose projections all train in FP8 under the tensorwise recipe
as float8 values and scales: hf3d/parallel/fp8_gather.py). `apply_fsdp` runs after the tensor-parallel swap, FP8
and compile, per pipeline stage and bottom-up:

- every decoder layer is one group; a MoE layer's grouped experts a group of their own (ep > 1: another mesh);
- the stage's embedding, final norm and lm_head are one group (a tied embedding and head share one Parameter);
  the head's chunked loss (`fused_loss_terms`), called after the stage's forward, is registered as a forward
  method, so it gathers the head as a forward would (FSDP2's chunked-loss case). At pp = 1 the group stays
  gathered from the step's first forward to the optimizer step, which reshards every group (`reshard_all`): the
  head's backward comes first and the embedding's last, and FSDP2 resharded the group between them, gathering it
  again for the embedding's gradient (two all-gathers of the largest group per micro-batch, one a step now, for
  no memory: the group is gathered at the peak, the turn from forward to backward, anyway);
- the StageModule is the root, holding no parameter of its own: every call into a stage (train_step, the
  pipeline schedule, evaluation, decoding) enters through it. Under a pipeline schedule the stage is the
  schedule's module itself, so torch.distributed.pipelining runs FSDP2 its own way: gradients accumulate
  unsharded over the micro-batches and are reduce-scattered once, after the stage's last backward.

Reshard after forward: at pp = 1 a decoder layer is resharded after its forward and gathered again for its
backward (ZeRO-3's memory). Under pipelining it stays gathered from its first forward to the step's gradient
reduction: the schedule keeps a stage gathered through its backwards anyway (torch.distributed.pipelining's FSDP2
path), so resharding after each forward would only add an all-gather per micro-batch; and zbv / dualpipev need
it, since their backward is split into an input pass and a weight pass that finds the weight gradients through
the stage's registered parameters, which must then be the gathered ones the forward used (resharded, both
schedules ran 1-30 % off in grad norm).

Precision: the sharded parameters stay fp32 (they are the master weights) and FSDP2 casts a gathered group to the
model dtype for compute and reduces gradients in fp32 (`MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`).
Gradients are summed, not averaged: each micro-batch's loss is already divided by the global token count
(`set_gradient_divide_factor(1)`, with sum-only collectives: gloo has neither AVG nor PREMUL_SUM).

FSDP2's sharded parameter is a DTensor whose global shape is this rank's tensor-parallel shape, so hf3d's layout
pieces (hf3d/parallel/layout.py) still describe it; they are copied onto it. A rank's shard is rows [r0, r1) of
that shape (`torch.chunk`'s split: the last ranks may hold fewer rows, or none), one contiguous run of the
row-major elements, which is how checkpoints, the optimizer and the grad norm address it (`local_shard`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .fp8_gather import Fp8Gathered, fp8_gather_specs, gather_in_fp8
from .layout import get_pieces
from .mesh import expert_fsdp_mesh, fsdp_mesh

REDUCE_DTYPE = torch.float32  # gradients are reduced in fp32 whatever the compute dtype
GRADIENT_DIVIDE_FACTOR = 1.0  # summed over the shard group, not averaged (the loss is already the global mean)
PREFETCH_AHEAD = 1  # the layer whose gather a layer's forward (backward) starts: the next (previous) one

# what hf3d records on its parameters (hf3d/parallel/layout.py, tensor.py, expert.py, models/common.py)
LAYOUT_ATTRIBUTES = ("hf3d_pieces", "hf3d_tied_copy", "hf3d_tp_partial_grad", "hf3d_expert")
HEAD_FORWARD_METHODS = ("fused_loss_terms",)  # lm_head methods that read its weight outside forward


def apply_fsdp(pmodel, *, compute_dtype: torch.dtype) -> list[list[nn.Module]]:
    """Shard every parameter of this rank through FSDP2 (module docstring); returns the FSDP groups (each a list
    of modules, the stage roots among them), in the order they were sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh, expert_mesh = fsdp_mesh(pmodel.mesh), expert_fsdp_mesh(pmodel.mesh)
    cast = None if compute_dtype == torch.float32 else compute_dtype
    policy = MixedPrecisionPolicy(param_dtype=cast, reduce_dtype=REDUCE_DTYPE)
    saved = _layout_attributes(pmodel.hf_model)
    fp8_specs = fp8_gather_specs(pmodel.hf_model)
    sharded: list[list[nn.Module]] = []

    def shard(module, on, *, reshard: bool):
        fully_shard(module, mesh=on, mp_policy=policy, reshard_after_forward=reshard)
        sharded.append(module if isinstance(module, list) else [module])

    per_layer = pmodel.pcfg.pp == 1  # reshard after forward (the module docstring says why)
    for stage in pmodel.stages:
        for layer in stage.layers:
            experts = _experts(layer)
            if experts is not None and pmodel.pcfg.ep > 1:
                shard(experts, expert_mesh, reshard=per_layer)
            shard(layer, mesh, reshard=per_layer)
        if per_layer:
            _prefetch(list(stage.layers), ep=pmodel.pcfg.ep)
        ends = [m for m in (stage.embed_tokens, stage.norm, stage.lm_head) if m is not None]
        if ends:
            # used at both ends of the stage: kept gathered from the forward to the backward
            shard(ends, mesh, reshard=False)
            if per_layer:  # and to the optimizer step (above)
                ends[0].set_reshard_after_backward(False)
        if stage.lm_head is not None:
            for method in HEAD_FORWARD_METHODS:
                register_fsdp_forward_method(stage.lm_head, method)
        shard(stage, mesh, reshard=False)
    for group in sharded:
        group[0].set_gradient_divide_factor(GRADIENT_DIVIDE_FACTOR)  # group[0] holds the group's FSDP state
        group[0].set_force_sum_reduction_for_comms(True)
    gather_in_fp8(pmodel.hf_model, fp8_specs)
    pmodel.fsdp_layout, pmodel.fp8_gathered = saved, list(fp8_specs)
    restore_layout_attributes(pmodel.hf_model, saved)
    return sharded


def _experts(layer: nn.Module) -> nn.Module | None:
    return getattr(getattr(layer, "mlp", None), "grouped_experts", None)


def _prefetch(layers: list[nn.Module], *, ep: int) -> None:
    """FSDP2's explicit prefetch, one layer ahead: a layer's forward starts the gather of the next layer (and of
    its experts, a group of their own at ep > 1), its backward that of the previous one."""

    def groups(layer):
        experts = _experts(layer)
        return [layer] + ([experts] if experts is not None and ep > 1 else [])

    for i, layer in enumerate(layers):
        if i + PREFETCH_AHEAD < len(layers):
            layer.set_modules_to_forward_prefetch(groups(layers[i + PREFETCH_AHEAD]))
        if i - PREFETCH_AHEAD >= 0:
            layer.set_modules_to_backward_prefetch(groups(layers[i - PREFETCH_AHEAD]))


def _layout_attributes(model: nn.Module) -> dict[tuple[str, str], dict]:
    """{(module name, parameter name): hf3d's attributes} of every parameter, by where it is registered."""
    out = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            attrs = {a: getattr(p, a) for a in LAYOUT_ATTRIBUTES if hasattr(p, a)}
            if attrs:
                out[(mname, pname)] = attrs
    return out


def restore_layout_attributes(model: nn.Module, saved: dict) -> None:
    """hf3d's attributes onto FSDP2's sharded parameters, which replaced the originals under the same names (and
    are replaced again by a `module.to()`, which swaps a DTensor parameter's contents and drops its attributes)."""
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            for attr, value in saved.get((mname, pname), {}).items():
                setattr(p, attr, value)


def is_sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def gathered_at_peak(pmodel, count: Callable[[nn.Parameter], int] = torch.numel) -> int:
    """Elements of the weights ZeRO-3 holds gathered at once at the step's peak, by the rules above: under
    pipelining every parameter of the rank; at pp = 1 the stage's ends and a layer beside the one it prefetches
    (the largest 1 + PREFETCH_AHEAD layers). Read on a sharded model or on one before `apply_fsdp` (the plan's).
    count: what one parameter counts for (its elements; `gathered_bytes` its bytes)."""
    params = {id(p): p for stage in pmodel.stages for p in stage.parameters()}
    total = sum(count(p) for p in params.values())
    if pmodel.pcfg.pp > 1:
        return total
    layers = sorted(sum(count(p) for p in layer.parameters()) for st in pmodel.stages for layer in st.layers)
    return total - sum(layers) + sum(layers[-(1 + PREFETCH_AHEAD) :])


def gathered_bytes(pmodel) -> int:
    """Bytes of the weights ZeRO-3 holds gathered at once at the step's peak (`gathered_at_peak`): one an element
    for a weight gathered in float8 (and 4 for its projections' scales), the compute dtype's size for the rest."""
    fp8 = {id(pmodel.hf_model.get_submodule(name).weight) for name in pmodel.fp8_gathered}
    size = torch.empty((), dtype=pmodel.param_dtype).element_size()

    def count(p: nn.Parameter) -> int:
        return p.numel() + 4 * len(get_pieces(p)) if id(p) in fp8 else p.numel() * size

    return gathered_at_peak(pmodel, count)


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(flat, start): the elements of `param` this rank stores, as a flat tensor holding param's row-major
    elements from `start` on: the whole parameter, or FSDP2's dim-0 shard of a sharded one (rows [r0, r1) of its
    global shape, r0 = min(rank * ceil(rows / ranks), rows))."""
    if not is_sharded(param):
        return param.detach().view(-1), 0
    local = param._local_tensor.detach()
    rows = param.shape[0]
    ranks = param.device_mesh.size(-1)  # the shard axis is the last (HSDP: replicate, shard)
    r0 = min(param.device_mesh.get_local_rank(-1) * -(-rows // ranks), rows)
    return local.view(-1), r0 * (param.numel() // rows if rows else 0)


def local_fragments(pmodel) -> list[tuple[str, nn.Parameter, torch.Tensor, int]]:
    """(name, param, flat, start) per parameter of the model: the elements this rank stores, a flat tensor holding
    param's row-major elements from `start` on (the whole parameter; under ZeRO-3 FSDP2's shard of it)."""
    return [(name, p, *local_shard(p)) for name, p in pmodel.unique_parameters()]


def first_replica(param: torch.Tensor) -> bool:
    """Whether this rank holds the first copy of its shard of `param` (HSDP replicates shards over the first axis)."""
    mesh = param.device_mesh
    return mesh.ndim == 1 or mesh.get_local_rank(0) == 0


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's shard of param's reduced gradient (fp32, flat), or None before any backward."""
    g = param.grad
    return None if g is None else g._local_tensor.view(-1)


@contextlib.contextmanager
def gathered(group: list[nn.Module]) -> Iterator[None]:
    """Collective over the group's shard mesh: its parameters gathered (unsharded) inside, in the compute dtype,
    under the stock names; resharded after."""
    group[0].unshard()
    try:
        yield
    finally:
        group[0].reshard()


@contextlib.contextmanager
def gathered_parameters(pmodel, group: list[nn.Module]) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
    """Collective over the group's shard mesh: [(sharded parameter, its gathered tensor)] of the parameters the
    group owns (not those of a group nested in it, such as a MoE layer's experts), inside; resharded after. The
    sharded parameter carries hf3d's layout; the gathered one is in the compute dtype and freed on exit (a weight
    FSDP2 gathers in float8 is gathered again from its shards, in the compute dtype)."""
    claimed = {id(p) for other in _nested_groups(pmodel, group) for m in other for p in m.parameters()}
    before = {}
    for m in group:
        for name, p in m.named_parameters():
            if id(p) not in claimed and id(p) not in before:
                before[id(p)] = (m, name, p)
    with gathered(group):
        yield [(p, _in_compute_dtype(p, m.get_parameter(name))) for m, name, p in before.values()]


def _in_compute_dtype(sharded: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    if isinstance(full, Fp8Gathered):  # collective over the shard mesh, as the gather was
        return sharded.full_tensor().to(full.dtype)
    return full


def _nested_groups(pmodel, group: list[nn.Module]) -> list[list[nn.Module]]:
    """The FSDP groups whose modules lie inside one of `group`'s modules (sharded before it, bottom-up)."""
    inside = {id(sub) for m in group for sub in m.modules() if sub is not m}
    return [g for g in pmodel.fsdp_modules if g is not group and id(g[0]) in inside]


def units(pmodel) -> list[list[nn.Module]]:
    """The FSDP groups that own parameters (every group but the stage roots), in the order they were sharded."""
    roots = {id(st) for st in pmodel.stages}
    return [g for g in pmodel.fsdp_modules if id(g[0]) not in roots]


def reshard_all(pmodel) -> None:
    """Free every gathered group (a group left gathered after a forward without backward, such as the stage's
    ends after an evaluation): the next forward gathers the shards as they are then."""
    for group in pmodel.fsdp_modules:
        group[0].reshard()
