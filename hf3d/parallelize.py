"""Build a ParallelModel: stock skeleton on meta -> swap to TP modules -> keep this rank's stages
-> materialise -> read only this rank's slices. The order follows STYLE: swap before loading,
then load through the sharded reader, never a full state dict into a swapped model."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .checkpoint.entries import SHAPE_FIELDS
from .hf.folders import model_files, resolve_model_dir
from .hf.load import SafetensorsSource, StateDictSource
from .model import ParallelModel
from .models import EPContext, TPContext, get_adapter
from .optim.parametrization import ScaledSource, model_parametrization
from .parallel.attention import AUTO, flash_attn_installed, resolve_attn_implementation
from .parallel.compile import check_compile, compile_layers, resolve_compile
from .parallel.config import ParallelConfig, check_attn_implementation
from .parallel.context import CPContext, check_attention
from .parallel.expert import RouterStats, check_load_balance
from .parallel.fp8 import FP8Config, apply_fp8, as_fp8_config
from .parallel.fp8_gather import fp8_gather_specs
from .parallel.fsdp import apply_fsdp
from .parallel.init_weights import InitSource, has_weights
from .parallel.layout import get_pieces
from .parallel.mesh import build_mesh, device_type, expert_group, init_distributed
from .parallel.rng import DropoutRNG
from .parallel.stage import StageModule, layer_costs, split_layers, stage_ranks
from .utils.compat import check_fp8_rowwise, check_pipeline_schedule, check_zero_stage


def parallelize(
    model_or_path: PreTrainedModel | str | os.PathLike,
    pcfg: ParallelConfig | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = AUTO,
    config_overrides: dict | None = None,
    moe_load_balance: str = "aux_loss",
    moe_bias_rate: float = 1e-3,
    fp8: FP8Config | str | dict | None = None,
    compile: bool | None = None,
) -> ParallelModel:
    """Split a stock transformers causal LM over the ("pp", "dp", "cp", "tp") mesh.

    model_or_path: a stock model instance, an HF directory, or a Hub id. A local directory with a
    config.json and no weights is initialised from scratch, sharded (hf3d/parallel/init_weights.py): the weights of
    `torch.manual_seed(seed); AutoModelForCausalLM.from_config(config, dtype=torch.float32)`, at any mesh.
    seed: the seed of that initialisation (ignored when weights are loaded).
    dtype: parameter and activation dtype (fp32 master weights live in the optimizer; under ZeRO-3 the fp32 shards
    are the master weights, and FSDP2 casts each gathered layer to `dtype` for compute).
    attn_implementation: any key of HF's attention registry ("sdpa", "eager", "flex_attention",
    "flash_attention_2" when installed), or "auto": sdpa on CPU; on CUDA flash_attention_2 when
    flash-attn is installed, else sdpa (hf3d/parallel/attention.py; pass "flex_attention" for packed rows there,
    as sdpa builds a dense mask from restarting position ids).
    config_overrides: values set on the HF config before the model is built, and exported with it by
    `save_pretrained` (long-context knobs): `rope_theta`; `rope_scaling` or its transformers 5 name
    `rope_parameters` (a dict with `rope_type` and that type's keys, e.g. {"rope_type": "linear",
    "factor": 2.0}: it replaces the RoPE settings, keeping rope_theta unless it names one; llama3, yarn and
    longrope scale from the config's max_position_embeddings before any override of it); any other
    attribute of the config, such as `max_position_embeddings`. Attributes that shape the weights
    (hidden_size, vocab_size, ...) can change only when initialising from a config-only directory.
    fp8: None/"off", "tensorwise" or "rowwise" (torchao's float8 recipes), or an hf3d.FP8Config (which
    projections to keep in high precision): the decoder layers' projections train in FP8 (hf3d/parallel/fp8.py).
    compile: compile each decoder layer of this rank with torch.compile, in place, after the swap
    (hf3d/parallel/compile.py); "auto": on with CUDA where compile runs, off on a CPU; None takes `pcfg.compile`.
    """
    pcfg = pcfg or ParallelConfig()
    fp8 = as_fp8_config(fp8)
    compile = pcfg.compile if compile is None else compile
    check_attn_implementation(attn_implementation)
    check_load_balance(moe_load_balance, moe_bias_rate)
    init_distributed()
    attn_implementation = resolve_attn_implementation(
        attn_implementation, device_type(), document_masking=False, flash_available=flash_attn_installed(), cp=pcfg.cp
    )
    config, source, tokenizer_dir = _open(model_or_path)
    if tokenizer_dir is not None:
        model_files(tokenizer_dir)  # a link to a file outside the folder is refused now, not at the first save
    if config_overrides:
        config = override_config(config, config_overrides, loading_weights=source is not None)
    compile, _ = resolve_compile(compile, device_type(), config)
    adapter = _checked_adapter(config, pcfg, attn_implementation, compile)
    check_fp8_rowwise(fp8.recipe, fp8.emulate, device_type())
    mesh = build_mesh(pcfg)
    device = (
        torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    )
    stored = torch.float32 if pcfg.zero_stage == 3 else dtype  # ZeRO-3: fp32 shards, cast by FSDP2 for compute
    ctx, cp, rng = _rank_contexts(mesh, pcfg, stored, device)
    ep = _expert_context(config, adapter, mesh, pcfg, moe_load_balance, moe_bias_rate)
    plan = _stage_plan(config, adapter, pcfg, mesh.get_local_rank("pp"))
    hf_model, hf_shapes = _swapped_skeleton(
        config, adapter, plan, ctx=ctx, ep=ep, attn=attn_implementation, dtype=stored, split_tie=pcfg.zero_stage == 3
    )
    fp8_projections = apply_fp8(hf_model, fp8, hf_shapes, tp_group=ctx.group, cp_group=cp.group)
    parametrization = model_parametrization(pcfg, config, hf_shapes, adapter)
    init_scales = parametrization.init_scales()
    _fill(hf_model, config, adapter, source, seed=seed, dtype=stored, device=device, init_scales=init_scales)
    del source
    pmodel = _assemble(
        hf_model, config, pcfg, plan, mesh=mesh, cp=cp, rng=rng, hf_shapes=hf_shapes, tokenizer_dir=tokenizer_dir
    )
    if compile:
        compile_layers([layer for stage in pmodel.stages for layer in stage.layers])
    pmodel.compute_dtype, pmodel.router_stats, pmodel.parametrization = dtype, ep.stats, parametrization
    pmodel.fp8, pmodel.fp8_projections = fp8, fp8_projections
    pmodel.fsdp_modules = apply_fsdp(pmodel, compute_dtype=dtype) if pcfg.zero_stage == 3 else []
    return pmodel


def _checked_adapter(config, pcfg: ParallelConfig, attn_implementation: str, compile: bool):
    """The model family's adapter, once the mesh, the attention and compile are known to fit this config."""
    if compile:
        check_compile(device_type(), config)
    check_pipeline_schedule(pcfg.pp_schedule, pcfg.pp)
    check_zero_stage(pcfg.zero_stage)
    adapter = get_adapter(config.model_type)
    adapter.check_tp(config, pcfg.tp)
    adapter.check_ep(config, pcfg.ep)
    check_attention(attn_implementation, pcfg.cp)
    return adapter


def _rank_contexts(mesh, pcfg: ParallelConfig, dtype: torch.dtype, device) -> tuple[TPContext, CPContext, DropoutRNG]:
    """This rank's tensor- and context-parallel groups, and its dropout generator (seeded by its mesh position)."""
    cp = CPContext(mesh.get_group("cp"), mesh.get_local_rank("cp"), pcfg.cp)
    ranks = ("pp", "dp", "cp", "tp")
    rng = DropoutRNG(tuple(mesh.get_local_rank(d) for d in ranks), device)
    tp = TPContext(mesh.get_group("tp"), mesh.get_local_rank("tp"), pcfg.tp, pcfg.sequence_parallel, dtype, rng)
    return tp, cp, rng


@dataclass(frozen=True)
class StagePlan:
    """Which decoder layers each pipeline stage holds, and which of the stages this rank runs."""

    layer_split: list[list[int]]  # decoder layers of every stage
    owners: list[int]  # the pp rank running each stage
    mine: list[int]  # the stages this pp rank runs

    @property
    def layers(self) -> list[int]:
        return [i for s in self.mine for i in self.layer_split[s]]

    @property
    def first(self) -> bool:
        return 0 in self.mine

    @property
    def last(self) -> bool:
        return len(self.layer_split) - 1 in self.mine


def _stage_plan(config, adapter, pcfg: ParallelConfig, pp_rank: int) -> StagePlan:
    layer_split = split_layers(pcfg.num_stages, *layer_costs(config, adapter.mlp_costs(config)))
    owners = stage_ranks(pcfg.num_stages, pcfg.pp, pcfg.pp_schedule)
    mine = [s for s in range(pcfg.num_stages) if owners[s] == pp_rank]
    return StagePlan(layer_split, owners, mine)


def _assemble(
    hf_model, config, pcfg: ParallelConfig, plan: StagePlan, *, mesh, cp, rng, hf_shapes, tokenizer_dir
) -> ParallelModel:
    """The ParallelModel of this rank's pipeline stages over the filled, swapped model."""
    stages = [
        StageModule(
            hf_model,
            plan.layer_split[s],
            first=s == 0,
            last=s == pcfg.num_stages - 1,
            stage_index=s,
            recompute=[pcfg.recompute_kind(i) for i in plan.layer_split[s]],
            cp=cp,
            dropout_rng=rng if getattr(config, "attention_dropout", 0.0) else None,
            activation_offload=pcfg.activation_offload,
        )
        for s in plan.mine
    ]
    pmodel = ParallelModel(
        hf_model,
        stages,
        mesh=mesh,
        pcfg=pcfg,
        hf_shapes=hf_shapes,
        tokenizer_dir=tokenizer_dir,
        stage_owners=plan.owners,
        layer_split=plan.layer_split,
        cp=cp,
    )
    pmodel.dropout_rng = rng
    return pmodel


def _expert_context(config, adapter, mesh, pcfg: ParallelConfig, balance: str, rate: float) -> EPContext:
    """This rank's expert group and, when the config asks for stock's load-balancing loss
    (`output_router_logits`), the router statistics its MoE layers tally."""
    moe_layers = adapter.moe_layers(config)
    stats = None
    if moe_layers:
        shards = [mesh.get_group("tp")] if pcfg.sequence_parallel else []
        aux = bool(getattr(config, "output_router_logits", False))
        groups = [*shards, mesh.get_group("cp")]
        stats = RouterStats(config.num_experts, moe_layers, aux=aux, shard_groups=groups, balance=balance)
        stats.bias_rate = float(rate)
    return EPContext(expert_group(mesh), mesh.get_local_rank("dp") % pcfg.ep, pcfg.ep, stats)


def _open(model_or_path) -> tuple[PretrainedConfig, object | None, Path | None]:
    """(config, weight source or None for a from-scratch init, tokenizer folder) of a stock model instance,
    an HF directory or a Hub id."""
    if isinstance(model_or_path, nn.Module):
        config = copy.deepcopy(model_or_path.config)  # from_config below edits the config it is given
        source, tokenizer_dir = StateDictSource(model_or_path.state_dict()), None
        name_or_path = getattr(config, "_name_or_path", None)
        if name_or_path and Path(name_or_path).is_dir():
            tokenizer_dir = Path(name_or_path)
    else:
        model_dir = resolve_model_dir(model_or_path)
        config = AutoConfig.from_pretrained(model_dir)
        get_adapter(config.model_type)  # refuse unknown families before opening weights
        from_scratch = Path(model_or_path).is_dir() and not has_weights(model_dir)  # local dirs only
        source = None if from_scratch else SafetensorsSource(model_dir)
        tokenizer_dir = model_dir
    return config, source, tokenizer_dir


def _swapped_skeleton(
    config, adapter, plan: StagePlan, *, ctx, ep, attn: str, dtype, split_tie: bool = False
) -> tuple[nn.Module, dict[str, tuple[int, ...]]]:
    """The stock model on the meta device, pruned to this rank's decoder layers (and the embedding / final norm
    and lm_head when this rank runs the first / last stage), with the tensor- and expert-parallel modules
    swapped in under the stock names; and {saved name: shape} of the whole stock model. split_tie (ZeRO-3): a tied
    lm_head in another stage than the embedding on this rank (zbv, dualpipev) gets a copy of its own, as on
    another rank, since each stage is an FSDP2 root of its own and one Parameter cannot be sharded by two."""
    keep, first, last = plan.layers, plan.first, plan.last
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    hf_shapes = adapter.disk_shapes({k: tuple(v.shape) for k, v in hf_model.state_dict().items()})
    base = hf_model.model
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in keep})  # stock names: model.layers.<i>
    for i in keep:
        adapter.swap_layer(base.layers[str(i)], f"model.layers.{i}", ctx, ep)
    tied = bool(config.tie_word_embeddings)
    base.embed_tokens = adapter.make_embedding(config, ctx) if first else None
    if last:
        base.norm = adapter.swap_final_norm(base.norm, ctx)
        shared = base.embed_tokens.weight if (tied and first and not (split_tie and len(plan.mine) > 1)) else None
        hf_model.lm_head = adapter.make_lm_head(config, ctx, tied_weight=shared)
    else:
        base.norm, hf_model.lm_head = None, None
    return hf_model, hf_shapes


def _fill(
    hf_model: nn.Module, config, adapter, source, *, seed: int, dtype: torch.dtype, device, init_scales: dict
) -> None:
    """Give the swapped skeleton real storage and this rank's slices: from `source`, or from stock's seeded
    init when it is None (fp32 draws, cast per tensor; times µP's init scales, hf3d/optim/parametrization.py)."""
    _materialize(hf_model, device)
    with torch.device(device):
        hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(config=config)  # computed buffers, not loaded
    if source is None:  # fp32 draws, cast per tensor by _load_pieces
        pieces = [piece for p in hf_model.parameters() for piece in get_pieces(p)]
        source = InitSource(config, seed=seed, pieces=adapter.source_pieces(pieces, config))
        source = adapter.wrap_source(source, config, saved=False)
        if init_scales:
            source = ScaledSource(source, init_scales)
    else:
        source = adapter.wrap_source(source, config, saved=isinstance(source, SafetensorsSource))
    _load_pieces(hf_model, source, dtype)


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def override_config(config: PretrainedConfig, overrides: dict, *, loading_weights: bool) -> PretrainedConfig:
    """A new config of the same class with `overrides` applied (see `parallelize`), built through the
    config's constructor so that transformers standardises and validates the RoPE settings."""
    if not isinstance(overrides, dict):
        raise TypeError(f"config_overrides must be a dict of config attributes, got {type(overrides).__name__}")
    values = config.to_dict()
    unknown = sorted(k for k in overrides if k not in values and k not in ROPE_KEYS)
    if unknown:
        verb = "is not an attribute" if len(unknown) == 1 else "are not attributes"
        raise ValueError(
            f"config_overrides: {', '.join(map(repr, unknown))} {verb} of this {config.model_type!r} "
            f"config; use rope_theta, rope_scaling, rope_parameters or one of: {', '.join(sorted(values))}"
        )
    shaping = sorted(k for k in overrides if k in SHAPE_FIELDS and overrides[k] != values.get(k))
    if shaping and loading_weights:
        raise ValueError(
            f"config_overrides: {', '.join(shaping)} would change the shape of the weights being loaded; "
            "such attributes can change only when initialising from a directory holding just config.json"
        )
    rope = copy.deepcopy(values.get("rope_parameters")) or {}
    if rope and not isinstance(next(iter(rope.values())), (int, float, str)) and any(k in overrides for k in ROPE_KEYS):
        raise ValueError("config_overrides: this config has per-layer-type RoPE settings; pass rope_parameters whole")
    for key in ("rope_parameters", "rope_scaling"):  # the new name and the old one: the same dict
        if key in overrides:
            rope = {"rope_theta": rope.get("rope_theta"), **_rope_dict(overrides[key], key)}
            if rope["rope_type"] in ("llama3", "yarn", "longrope"):  # scaled from the pretraining length
                rope.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    if "rope_theta" in overrides:
        rope["rope_theta"] = float(overrides["rope_theta"])
    values.update({k: v for k, v in overrides.items() if k not in ROPE_KEYS})
    if rope:
        values["rope_parameters"] = rope
    try:
        return type(config).from_dict(values)
    except (KeyError, ValueError, TypeError, StrictDataclassError) as e:
        reason = " ".join(str(e).split())  # one line
        raise ValueError(f"config_overrides {overrides!r} make an invalid config: {reason}") from None


RESETTABLE = (*ROPE_KEYS, "max_position_embeddings")


def set_rope(pmodel: ParallelModel, overrides: dict, *, base_config: PretrainedConfig | None = None) -> None:
    """Change a built model's RoPE settings in place (a long-context stage): the config becomes
    `override_config(base_config, overrides)`, and every stage's rotary module is rebuilt from it (stock
    class; its buffers are computed, not trained). base_config: the config before any override (the
    same result whatever was applied before); default: the model's current config.

    overrides: rope_theta, rope_scaling / rope_parameters and max_position_embeddings only. The config
    object is updated in place, so every module holding it (attention, masks, save_pretrained) sees the
    new values; the weights, the optimizer and the pipeline schedule are untouched."""
    unknown = sorted(k for k in overrides if k not in RESETTABLE)
    if unknown:
        raise ValueError(f"set_rope: {', '.join(unknown)} cannot change on a built model; use {', '.join(RESETTABLE)}")
    config = pmodel.config
    new = override_config(base_config or config, overrides, loading_weights=True)
    old_values, new_values = config.to_dict(), new.to_dict()
    for key in ("rope_parameters", "max_position_embeddings", "rope_scaling", "rope_theta"):
        if key in new_values and new_values[key] != old_values.get(key):
            setattr(config, key, copy.deepcopy(new_values[key]))
    base = pmodel.hf_model.model
    with torch.device(pmodel.device):
        rotary = type(base.rotary_emb)(config=config)
    base.rotary_emb = rotary
    for stage in pmodel.stages:
        stage.rotary_emb = rotary


def _rope_dict(value, name: str) -> dict:
    if value is None:
        return {"rope_type": "default"}
    if not isinstance(value, dict):
        raise TypeError(f"config_overrides[{name!r}] must be a dict such as {{'rope_type': 'linear', 'factor': 2.0}}")
    value = dict(value)
    rope_type = value.pop("type", None) or value.get("rope_type", "default")  # "type": the older key
    known = ("default", *ROPE_INIT_FUNCTIONS)
    if rope_type not in known:
        raise ValueError(f"config_overrides[{name!r}]: unknown rope_type {rope_type!r}; known: {', '.join(known)}")
    return {**value, "rope_type": rope_type}


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Give every parameter not yet on `device` (the stock ones still on meta, hf3d's swapped-in ones built in
    host memory) real, uninitialised storage there, keeping their hf3d layout attributes and any sharing
    (`Module.to_empty` would create new Parameter objects)."""
    done: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or p.device == device:
                continue
            if id(p) not in done:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
            sub._parameters[name] = done[id(p)]


@torch.no_grad()
def _load_pieces(hf_model: nn.Module, source, dtype: torch.dtype) -> None:
    for name, param in hf_model.named_parameters():
        assert hasattr(param, "hf3d_pieces"), f"{name}: no layout recorded by the adapter"
        pieces = get_pieces(param)
        param.zero_()  # padded vocab rows stay zero
        for p in pieces:
            if hasattr(source, "read_into"):  # safetensors: straight into the parameter, no slice of its own
                source.read_into(p.hf_name, p.dim, p.hf_start, p.hf_stop, p.local(param))
            else:
                p.local(param).copy_(source.get(p.hf_name, p.dim, p.hf_start, p.hf_stop).to(dtype))
        param.requires_grad_(True)


def meta_model(
    config: PretrainedConfig, pcfg: ParallelConfig, *, dtype: torch.dtype, attn: str, fp8: FP8Config | None = None
) -> ParallelModel:
    """This rank's ParallelModel on the meta device, as `parallelize` would assemble it but never filled: the
    shapes each rank holds, for `hf3d plan` (hf3d/plan/trace.py), which runs it under a fake process group. With
    `fp8`, its projections are converted and, under ZeRO-3, `fp8_gathered` names the weights FSDP2 would gather in
    float8 (no sharding is applied)."""
    adapter = _checked_adapter(config, pcfg, attn, compile=False)
    mesh = build_mesh(pcfg)
    stored = torch.float32 if pcfg.zero_stage == 3 else dtype
    meta = torch.device("meta")
    ctx, cp, rng = _rank_contexts(mesh, pcfg, stored, meta)
    ep = _expert_context(config, adapter, mesh, pcfg, "aux_loss", 1e-3)
    plan = _stage_plan(config, adapter, pcfg, mesh.get_local_rank("pp"))
    with meta:
        hf_model, hf_shapes = _swapped_skeleton(config, adapter, plan, ctx=ctx, ep=ep, attn=attn, dtype=stored)
        hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(config=config)
    fp8 = fp8 or FP8Config()
    fp8_projections = apply_fp8(hf_model, fp8, hf_shapes, tp_group=ctx.group, cp_group=cp.group)
    pmodel = _assemble(hf_model, config, pcfg, plan, mesh=mesh, cp=cp, rng=rng, hf_shapes=hf_shapes, tokenizer_dir=None)
    pmodel.compute_dtype, pmodel.router_stats = dtype, ep.stats
    pmodel.fp8, pmodel.fp8_projections = fp8, fp8_projections
    if pcfg.zero_stage == 3:
        pmodel.fp8_gathered = list(fp8_gather_specs(hf_model))
    return pmodel
