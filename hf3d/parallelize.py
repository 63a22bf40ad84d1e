"""Build a ParallelModel: stock skeleton on meta -> swap to TP modules -> keep this rank's stages
-> materialise -> read only this rank's slices. The order follows STYLE: swap before loading,
then load through the sharded reader, never a full state dict into a swapped model."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .config import ParallelConfig
from .hf import SafetensorsSource, StateDictSource, resolve_model_dir
from .init import InitSource, has_weights
from .layout import get_pieces
from .mesh import build_mesh, device_type, init_distributed
from .model import ParallelModel
from .models import TPContext, get_adapter
from .stage import StageModule, layer_costs, split_layers, stage_ranks


def parallelize(
    model_or_path: PreTrainedModel | str | os.PathLike,
    pcfg: ParallelConfig | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> ParallelModel:
    """Split a stock transformers causal LM over the ("pp", "dp", "tp") mesh.

    model_or_path: a stock model instance, an HF directory, or a Hub id. A local directory with a
    config.json and no weights is initialised from scratch, sharded (hf3d/init.py): the weights of
    `torch.manual_seed(seed); AutoModelForCausalLM.from_config(config, dtype=torch.float32)`, at any mesh.
    seed: the seed of that initialisation (ignored when weights are loaded).
    dtype: parameter and activation dtype (fp32 master weights live in the optimizer).
    attn_implementation: any key of HF's attention registry ("sdpa", "eager", "flex_attention",
    "flash_attention_2" when installed).
    """
    pcfg = pcfg or ParallelConfig()
    init_distributed()
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
    adapter = get_adapter(config.model_type)
    adapter.check_tp(config, pcfg.tp)
    mesh = build_mesh(pcfg)
    device = (
        torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    )

    tp_group = mesh.get_group("tp")
    ctx = TPContext(tp_group, mesh.get_local_rank("tp"), pcfg.tp, pcfg.sequence_parallel, dtype)
    pp_rank = mesh.get_local_rank("pp")

    layer_split = split_layers(pcfg.num_stages, *layer_costs(config))
    owners = stage_ranks(pcfg.num_stages, pcfg.pp, pcfg.pp_schedule)
    my_stages = [s for s in range(pcfg.num_stages) if owners[s] == pp_rank]
    has_first, has_last = 0 in my_stages, pcfg.num_stages - 1 in my_stages

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    hf_shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    base = hf_model.model
    keep = [i for s in my_stages for i in layer_split[s]]
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in keep})  # stock names: model.layers.<i>
    for i in keep:
        adapter.swap_layer(base.layers[str(i)], f"model.layers.{i}", ctx)
    tied = bool(config.tie_word_embeddings)
    base.embed_tokens = adapter.make_embedding(config, ctx) if has_first else None
    if has_last:
        adapter.swap_final_norm(base.norm, ctx)
        shared = base.embed_tokens.weight if (tied and has_first) else None
        hf_model.lm_head = adapter.make_lm_head(config, ctx, tied_weight=shared)
    else:
        base.norm, hf_model.lm_head = None, None

    _materialize(hf_model, device)
    with torch.device(device):
        base.rotary_emb = type(base.rotary_emb)(config=config)  # buffers are computed, not loaded
    if source is None:  # fp32 draws, cast per tensor by _load_pieces
        pieces = [piece for p in hf_model.parameters() for piece in get_pieces(p)]
        source = InitSource(config, seed=seed, pieces=pieces)
    _load_pieces(hf_model, source, dtype)
    del source

    stages = [
        StageModule(hf_model, layer_split[s], first=s == 0, last=s == pcfg.num_stages - 1, stage_index=s)
        for s in my_stages
    ]
    return ParallelModel(
        hf_model,
        stages,
        mesh=mesh,
        pcfg=pcfg,
        hf_shapes=hf_shapes,
        tokenizer_dir=tokenizer_dir,
        stage_owners=owners,
        layer_split=layer_split,
    )


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Give the stock parameters still on meta real (uninitialised) storage, keeping their hf3d
    layout attributes and any sharing (`Module.to_empty` would create new Parameter objects)."""
    done: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
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
            p.local(param).copy_(source.get(p.hf_name, p.dim, p.hf_start, p.hf_stop).to(dtype))
        param.requires_grad_(True)
