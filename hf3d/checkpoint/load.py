"""`load_checkpoint`: every rank reads the boxes it needs from a checkpoint written at any mesh."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ..optim import state as optim_state
from ..parallel.fsdp import local_fragments, reshard_all
from ..parallel.layout import hf_boxes
from ..utils.jsonl import json_document
from .entries import MASTER_KEY, MODEL_PREFIX, SHAPE_FIELDS, Boxes, LoadPlanner, get_entry, optim_key
from .failures import failure_line
from .marker import read_marker, refuse_damaged
from .reader import SafeReader
from .save import wait_for_checkpoint
from .untrusted import load_small, open_in
from .writer import dcp_debug_records_off


def _load(path: Path):
    """A small file of the checkpoint (rng_<rank>.pt, extra.pt): tensors and plain values only, never read
    through a link, its archive checked before it is read (`untrusted.load_small`)."""
    return load_small(path.parent, path.name)


def _restore_rng(path: Path, meta: dict, pmodel) -> None:
    """This rank's RNG streams, when the checkpoint was written at this mesh (the same pp, dp, cp and tp
    degrees): a resumed run then draws what the uninterrupted one would. At another mesh nothing is
    restored (a saved rank's streams belong to other coordinates): the default generators keep the
    seeding they had, and the dropout stream starts afresh from its seed and the checkpoint's step, so
    the masks after the resume differ from the uninterrupted run's, with the same statistics."""
    saved_mesh = [(meta.get("parallel") or {}).get(k, 1 if k == "cp" else None) for k in ("pp", "dp", "cp", "tp")]
    same_mesh = meta.get("world_size") == dist.get_world_size() and saved_mesh == [
        pmodel.pcfg.pp,
        pmodel.dp_size,
        pmodel.cp_size,
        pmodel.pcfg.tp,
    ]
    rng = path / f"rng_{dist.get_rank()}.pt"
    state = _load(rng) if same_mesh and rng.is_file() else {}
    if state:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    ours = pmodel.dropout_rng
    if ours is not None and "dropout" in state:
        ours.load_state_dict(state["dropout"])
    elif ours is not None and meta.get("kind") == "training":
        ours.manual_seed(ours.seed if ours.seed is not None else torch.initial_seed(), step=int(meta["step"]))


def check_compatible(path: Path, config) -> None:
    """Refuse a checkpoint of another architecture or shape, naming every mismatch in one line."""
    with open_in(path, "config.json") as f:
        saved = json_document(path / "config.json", f.read())
    if not isinstance(saved, dict):
        raise ValueError(f"{path / 'config.json'} holds no JSON object; it is not a model's config")
    ours = config.to_dict()
    diffs = [
        f"{k}={saved.get(k)!r} (model has {ours.get(k)!r})"
        for k in SHAPE_FIELDS
        if k in saved or k in ours
        if saved.get(k) != ours.get(k) and not (k == "head_dim" and None in (saved.get(k), ours.get(k)))
    ]
    if diffs:
        raise ValueError(f"checkpoint {path} does not fit this model: it has {', '.join(diffs)}")


def load_checkpoint(path: str | os.PathLike, pmodel, opt=None, *, extra: dict | None = None) -> int:
    """Collective: restore `pmodel` (and `opt`) from a checkpoint written at any mesh; returns its step.

    A weights-only checkpoint (`hf3d convert from-hf`) restores the weights, leaves the optimizer
    fresh and returns 0. A damaged checkpoint (a file missing, or not of the size or checksum its
    marker records), or one whose files DCP cannot read into this model (a .metadata that lacks one of
    its weights), is refused with one ValueError on every rank. `extra`, when given, receives what
    save_checkpoint's `extra` held: objects with `load_state_dict` (an LR scheduler) are restored in
    place, other values are set in the dict.
    RNG states are restored when the checkpoint was written at this mesh (see `_restore_rng`)."""
    path = Path(path)
    wait_for_checkpoint(pmodel)
    meta = read_marker(path)
    refuse_damaged(path, meta)
    check_compatible(path, pmodel.config)
    stored = SafeReader(path).read_metadata().state_dict_metadata
    has_master = any(k.startswith(optim_key(MASTER_KEY, "")) for k in stored)
    training = meta["kind"] == "training" and opt is not None
    fragments = local_fragments(pmodel)  # the whole parameters, or ZeRO-3's fp32 shards
    # fp32 parameters are their own master weights: take them from the fp32 masters when there are some
    stored = fragments[0][2].dtype
    params_from = optim_key(MASTER_KEY, "") if has_master and stored == torch.float32 else MODEL_PREFIX
    hf_shapes = pmodel.hf_shapes
    entries: dict[str, Boxes] = {}
    masters: dict[str, Boxes] = {}  # a second pass when masters read the same keys as the parameters
    for _, p, flat, start in fragments:
        for name, off, _, view in hf_boxes(p, flat, start, start, start + flat.numel(), owned_only=False):
            get_entry(entries, params_from + name, hf_shapes, name, flat.dtype).add(off, view)
    if opt is not None:
        if training:  # before anything is read: a refused state leaves the model and optimizer as they were
            optim_state.check_group_scales(opt, meta["optim"]["param_groups"])
        keys = meta["optim"]["keys"] if training else []
        for k, name, off, _, view in optim_state.state_boxes(opt, keys, create=True, master=not opt._aliased):
            prefix = optim_key(k, "") if k != MASTER_KEY or has_master else MODEL_PREFIX
            into = masters if prefix == params_from else entries
            get_entry(into, prefix + name, hf_shapes, name, torch.float32).add(off, view)
        if keys:  # on the device torch's fused and capturable kernels read it from
            optim_state.restore_steps(opt, meta["optim"]["step"])
    with torch.no_grad(), dcp_debug_records_off():
        for part in (entries, masters):
            if part:
                try:
                    dcp.load(part, storage_reader=SafeReader(path), planner=LoadPlanner())
                except CheckpointException as e:  # DCP raises it on every rank; a BaseException
                    # the first rank's error names the cause (a key the .metadata lacks, a read that failed)
                    raise ValueError(
                        f"could not load the checkpoint {path} ({failure_line(e)}): use another checkpoint (an older "
                        "step_<N>)"
                    ) from None
    if opt is not None:
        optim_state.settle(opt)  # lower-precision states from their fp32 entries
        if hasattr(opt, "after_load"):
            opt.after_load()  # Muon's whole masters from the parameters
    reshard_all(pmodel)  # ZeRO-3: no group stays gathered with the weights from before the load
    if training:
        optim_state.restore_group_settings(opt, meta["optim"]["param_groups"])
    _restore_rng(path, meta, pmodel)
    if extra is not None and (path / "extra.pt").is_file():
        for k, v in _load(path / "extra.pt").items():
            if hasattr(extra.get(k), "load_state_dict"):
                extra[k].load_state_dict(v)
            else:
                extra[k] = v
    dist.barrier()
    return int(meta["step"]) if meta["kind"] == "training" else 0
