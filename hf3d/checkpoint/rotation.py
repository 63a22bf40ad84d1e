"""A run's checkpoints folder: the order of its saves, the one `resume` takes, and which ones `keep_last` keeps."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch.distributed as dist

from ..utils import files as files_
from .failures import CheckpointWriteError, failure_line
from .marker import MARKER, find_damage, is_complete, read_marker, refuse_damaged

# -- a run's checkpoints folder -------------------------------------------------------------------
STEP_DIR = re.compile(r"^step_(\d+)$")


_REPLACED = re.compile(r"^step_(\d+)\.old$")  # files.publish_dir's without renameat2: what a publish replaces


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete `step_<N>` checkpoints under root, (step, folder), in the order they were saved, oldest first:
    by the `sequence` their markers record (checkpoints of hf3d before it recorded one count as older than any
    that has one), then by step. A resumed run that rolled back (`checkpoint.resume: PATH`, `load_step: false`)
    or saved off its cadence writes checkpoints of lower steps after higher ones: the newest save is the one
    the run is at. Only real folders count: a symlink named step_<N> is not a checkpoint hf3d wrote, so it is
    neither resumed from nor pruned. A `step_<N>.old` counts as step_<N> where that is missing: a publish that
    had to move the checkpoint it replaces aside (no atomic swap on that file system) was killed before the
    new one took its name."""
    found = []
    for d in root.iterdir() if root.is_dir() else []:
        m = STEP_DIR.match(d.name) or _REPLACED.match(d.name)
        if m and d.name.endswith(".old") and os.path.lexists(d.with_name(d.stem)):
            continue
        meta = _hf3d_marker(d) if m and not d.is_symlink() and d.is_dir() else None
        if meta is not None:
            sequence = meta.get("sequence")
            found.append((sequence if isinstance(sequence, int) else 0, int(m.group(1)), d))
    return [(step, d) for _, step, d in sorted(found)]


def _hf3d_marker(d: Path) -> dict | None:
    """The marker of the folder `d` when it is hf3d's (a regular file, not a link), else None."""
    marker = d / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == "hf3d" else None


def next_sequence(root: Path) -> int:
    """The `sequence` of a checkpoint published now under root: one past the newest save's."""
    return 1 + max((_hf3d_marker(d).get("sequence") or 0 for _, d in step_dirs(root)), default=0)


def find_resume(root: Path) -> Path | None:
    """The most recently saved complete, undamaged checkpoint under a run's checkpoints folder (`step_dirs`'
    order); None when the folder
    holds none at all. A damaged one is passed over with one warning line naming its file. Folders that
    exist but are all incomplete or damaged are an error, never a silent restart. Collective under a
    process group (see `find_damage`)."""
    complete = step_dirs(root)
    for i, (_, d) in enumerate(reversed(complete)):
        problem = find_damage(d, read_marker(d))
        if problem is None:
            return d
        if not dist.is_initialized() or dist.get_rank() == 0:
            instead = f"trying {complete[-i - 2][1].name}" if i + 1 < len(complete) else "no older checkpoint"
            print(f"hf3d: warning: skipping the damaged checkpoint {d}: {problem}; {instead}", file=sys.stderr)
    partial = sorted(d.name for d in root.iterdir() if d.name.startswith("step_")) if root.is_dir() else []
    if partial:
        which = "every complete one is damaged" if complete else "none is complete"
        raise ValueError(
            f"{root} holds checkpoint folders but {which} ({', '.join(partial)}); "
            "resume from a checkpoint path explicitly, or set checkpoint.resume=none to start over"
        )
    return None


def resolve_resume(spec: str, root: Path) -> Path | None:
    """checkpoint.resume: "auto" (newest complete and undamaged under root, or None), "none", or a path
    to a `step_<N>` folder (refused when damaged) or to a checkpoints folder. Collective under a process
    group (every rank calls it)."""
    if spec == "none":
        return None
    if spec == "auto":
        return find_resume(root)
    path = Path(spec)
    if is_complete(path):
        refuse_damaged(path, read_marker(path))
        return path
    if path.is_dir() and not STEP_DIR.match(path.name):
        found = find_resume(path)
        if found is not None:
            return found
    raise ValueError(f"checkpoint.resume={spec!r} is neither a complete checkpoint nor a folder of them")


def finish_save(root: Path, keep_last: int, published: Path) -> None:
    """After the checkpoint `published` under root is published (fsynced): point `latest` at it, then drop the
    oldest saves beyond keep_last (0 keeps all). Rank 0 only.

    Kept: `published` (the newest save, and the one `checkpoint.resume: auto` chooses) and the newest
    keep_last - 1 other saves whose files still have the sizes their markers record; the rest go, the
    damaged ones among them. So a save never leaves fewer undamaged checkpoints than keep_last allows, and
    never removes the only good one. Only what hf3d made is deleted: real `step_<N>` folders directly under
    root, holding hf3d's owner file (`files.OWNER_FILE`); one without it (written before hf3d marked its
    folders) is kept, with one warning line. Links are never followed: a `latest` that is a link is
    refused, not written through."""
    try:
        files_.write_file(root / "latest", published.name + "\n", replace=True, sync=True)
    except (OSError, ValueError) as e:
        raise CheckpointWriteError(
            f"could not update {root / 'latest'} ({failure_line(e)}); the checkpoint {published} itself is "
            "complete and checkpoint.resume=auto finds it: fix that, then resume"
        ) from None
    if keep_last <= 0:
        return
    kept = 1
    for _, d in reversed(step_dirs(root)):
        if d == published:
            continue
        if kept < keep_last and find_damage(d, read_marker(d), checksums=False) is None:
            kept += 1
            continue
        if not files_.owned(d):
            print(
                f"hf3d: warning: keeping {d} past checkpoint.keep_last: it has no {files_.OWNER_FILE} (written "
                "before hf3d marked its folders); delete it yourself once it is not needed",
                file=sys.stderr,
            )
            continue
        files_.remove_dir(d)
