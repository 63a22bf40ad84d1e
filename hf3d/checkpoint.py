"""Training checkpoints: torch.distributed.checkpoint (DCP) files keyed by HF names and global offsets.

A checkpoint folder holds

    .metadata, __<rank>_0.distcp   DCP: every rank writes only the boxes it owns, in parallel
    config.json                    the HF model config (+ generation_config.json, tokenizer files)
    rng_<rank>.pt                  each rank's RNG states (training checkpoints)
    extra.pt                       the caller's `extra` (scheduler, data position), from rank 0
    hf3d_checkpoint.json           written last: its presence marks the folder complete

DCP keys are `model/<hf name>` (parameters, in the training dtype), `optim/master/<hf name>`
(fp32 master weights, only when they differ from the parameters) and `optim/<state>/<hf name>`
(the wrapped optimizer's per-element state, e.g. exp_avg). Every tensor has its global, unfused,
unpadded HF shape, so a checkpoint loads on any (tp, pp, dp) and converts to HF without a mesh.
A weights-only checkpoint (`hf3d convert from-hf`) has `model/*` keys only.

Saving is atomic: files go into `<path>.tmp`, the marker is written last, then the folder is
renamed to `<path>`. A folder without the marker is never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

MARKER = "hf3d_checkpoint.json"
FORMAT_VERSION = 1
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
MASTER_KEY = "master"


def model_key(hf_name: str) -> str:
    return MODEL_PREFIX + hf_name


def optim_key(state: str, hf_name: str) -> str:
    return f"{OPTIM_PREFIX}{state}/{hf_name}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def read_marker(path: str | os.PathLike) -> dict:
    """The checkpoint's own description; refuses folders that are not complete hf3d checkpoints."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a directory")
    if not is_complete(path):
        raise ValueError(
            f"{path} is not a complete hf3d checkpoint (no {MARKER}: the save was interrupted, or this is "
            "not a checkpoint folder)"
        )
    meta = json.loads((path / MARKER).read_text())
    if meta.get("format") != "hf3d" or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path / MARKER} is not an hf3d checkpoint of format version {FORMAT_VERSION}")
    return meta


def staging_dir(final: Path) -> Path:
    """Where a checkpoint destined for `final` is written before the rename."""
    return final.with_name(final.name + ".tmp")


def write_marker(tmp: Path, meta: dict) -> None:
    """The last file written into a staged checkpoint."""
    meta = {"format": "hf3d", "version": FORMAT_VERSION, **meta}
    part = tmp / (MARKER + ".part")
    part.write_text(json.dumps(meta, indent=1))
    os.replace(part, tmp / MARKER)


def publish(tmp: Path, final: Path) -> None:
    """Replace `final` by the staged folder `tmp` (which already holds its marker)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
