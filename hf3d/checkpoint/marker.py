"""A checkpoint folder's marker, written last: what makes the folder complete, and the size and CRC-32 of every
other file in it, which `find_damage` checks before a load."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch.distributed as dist

from ..hf.folders import is_model_file
from ..utils import files as files_
from .checksums import crc32_file, crc32_open
from .untrusted import open_in, size_of

MARKER = "hf3d_checkpoint.json"


FORMAT_VERSION = 1


_CHECKPOINT_FILE = re.compile(r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|rng_\d+\.pt|extra\.pt|config\.json")


def is_checkpoint_file(name: str) -> bool:
    """Whether `name` is a file hf3d writes into a checkpoint folder (a staged one too): DCP's, the RNG states,
    the caller's extra, the marker, the HF config and the files that travel with the weights."""
    return name in (MARKER, MARKER + ".part") or bool(_CHECKPOINT_FILE.fullmatch(name)) or is_model_file(name)


def _listed(folder: Path) -> set[str] | None:
    """The files the marker of a complete checkpoint lists (and the marker), or None (no marker, or one
    written before markers listed files)."""
    try:
        with open_in(folder, MARKER) as f:
            listed = json.loads(f.read()).get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return {*listed, MARKER} if isinstance(listed, dict) else None


CHECKPOINT = files_.Kind("checkpoint", is_checkpoint_file, _listed)
"""A checkpoint folder and its staging folder: what `save_checkpoint`, `convert from-hf` and rotation may
replace or delete."""


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
    try:
        with open_in(path, MARKER) as f:
            meta = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(
            f"{path / MARKER} is damaged ({type(e).__name__}: {' '.join(str(e).split())}); this checkpoint cannot be "
            "trusted: resume from another one (checkpoint.resume: PATH) or delete this folder"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != "hf3d" or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path / MARKER} is not an hf3d checkpoint of format version {FORMAT_VERSION}")
    return meta


def staging_dir(final: Path) -> Path:
    """Where a checkpoint destined for `final` is written before the rename."""
    return final.with_name(final.name + ".tmp")


def write_marker(tmp: Path, meta: dict) -> None:
    """The last file written into a staged checkpoint: `meta`, plus the size and CRC-32 of every other
    file already there (what `find_damage` checks). Files `meta["files"]` already lists (checksummed by
    the ranks that wrote them) are taken as given."""
    given = meta.get("files") or {}
    files = {**file_table(tmp, skip=set(given)), **given}
    meta = {"format": "hf3d", "version": FORMAT_VERSION, **meta, "files": dict(sorted(files.items()))}
    files_.write_file(tmp / MARKER, json.dumps(meta, indent=1), replace=True)


def file_table(folder: Path, skip: set[str] = frozenset(), only: str = "*") -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files under `folder` matching `only`, but the marker, the owner file (which says
    whose folder it is, not what the checkpoint holds) and `skip`."""
    mine = (MARKER, files_.OWNER_FILE)
    files = (p for p in sorted(folder.rglob(only)) if p.is_file() and not p.name.startswith(mine))
    files = (p for p in files if p.relative_to(folder).as_posix() not in skip)
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "crc32": crc32_file(p)} for p in files}


def _size(folder: Path, name: str) -> int | str:
    """The size of the file `name` of the checkpoint folder `folder`, opened as every reader opens it
    (`untrusted.open_in`: in the folder, through real folders, not a link); or why it cannot be read."""
    try:
        with open_in(folder, name) as f:
            return size_of(f)
    except FileNotFoundError:
        return f"{name} is missing"
    except (OSError, ValueError):
        return (
            f"{name} is a link or not a regular file, or lies below a link or outside the folder (hf3d reads no file "
            "of a checkpoint through a link)"
        )


def _crc32(folder: Path, name: str) -> int | None:
    """The CRC-32 of the file `name` of the checkpoint folder `folder` (opened as `_size` opens it), or None."""
    try:
        with open_in(folder, name) as f:
            return crc32_open(f, 0, size_of(f))
    except (OSError, ValueError):
        return None


def find_damage(path: Path, meta: dict, *, checksums: bool = True, collective: bool = True) -> str | None:
    """What is wrong with the files of the complete checkpoint at `path` (`meta`: its marker), in a few
    words naming the first damaged file; None when every file has the size and CRC-32 its marker records.
    A file that is a link, or lies in a folder that is one, is damaged. A marker that records no files (written
    before hf3d recorded them) is verified for what can be: every file of a checkpoint's names in the folder is
    a regular file, not a link (the `.metadata` is then checked against the files' sizes when it is read:
    `reader.check_storage`).

    Under a process group every rank must call this: each checksums its share of the files and the
    verdicts are gathered, so all ranks return the same answer. Sizes are checked by every rank;
    `checksums=False` checks only them (no file is read). `collective=False`: this process checks every file
    alone, whatever process group there is (a conversion in a thread of rank 0 while the ranks train)."""
    files = meta.get("files")
    if not isinstance(files, dict):
        ours = (p.name for p in sorted(path.iterdir()) if is_checkpoint_file(p.name))
        return next((s for s in (_size(path, n) for n in ours) if isinstance(s, str)), None)
    names, files = sorted(files), {n: r if isinstance(r, dict) else {} for n, r in files.items()}
    for name in names:
        size = _size(path, name)
        if isinstance(size, str):
            return size
        if size != files[name].get("size"):
            return f"{name} has {size} bytes where {files[name].get('size')} were written"
    if not checksums:
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective and dist.is_initialized() else (0, 1)
    bad = [n for n in names[rank::world] if _crc32(path, n) != files[n].get("crc32")]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, bad)
        bad = sorted(n for b in everyone for n in b)
    return f"{bad[0]} does not match the checksum written with it" if bad else None


def refuse_damaged(
    path: Path, meta: dict, *, checksums: bool = True, problem: str | None = None, collective: bool = True
) -> None:
    """Raise the one-line refusal of a damaged checkpoint: `problem` when given, else `find_damage`'s."""
    problem = problem or find_damage(path, meta, checksums=checksums, collective=collective)
    if problem is not None:
        raise ValueError(
            f"checkpoint {path} is damaged: {problem}; use another checkpoint (an older step_<N>) or delete this folder"
        )
