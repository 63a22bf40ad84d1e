"""A run's checkpoints folder: the order of its saves, the one `resume` takes, and which ones `keep_last` keeps."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Collection
from pathlib import Path

import torch.distributed as dist

from ..utils import files as files_
from .failures import CheckpointWriteError, failure_line
from .marker import CHECKPOINT, MARKER, find_damage, is_complete, read_marker, refuse_damaged
from .untrusted import open_in

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
    try:
        with open_in(d, MARKER) as f:  # a regular file of the folder, no link followed
            meta = json.loads(f.read(1 << 24))
    except (OSError, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == "hf3d" else None


def _ours(d: Path) -> bool:
    """Whether the checkpoint folder `d` is this run's own save: made here, not a copy, a move or a folder of an
    earlier hf3d (which recorded no identity)."""
    return files_.origin(d) == "here"


def _not_ours(d: Path) -> str:
    """Why the checkpoint folder `d` is not this run's own (not `_ours`), in a few words."""
    where = files_.origin(d)
    if where == "elsewhere":
        return f"it is a copy or a move of a checkpoint made in another folder (its {files_.OWNER_FILE} names another)"
    if where == "legacy":
        return "an earlier hf3d wrote it without recording where, so hf3d cannot tell it from a copy"
    return f"it has no {files_.OWNER_FILE} (written before hf3d marked its folders)"


def next_sequence(root: Path) -> int:
    """The `sequence` of a checkpoint published now under root: one past the newest save's (copies from
    elsewhere, whose numbers belong to another run, left out)."""
    ours = [d for _, d in step_dirs(root) if files_.origin(d) != "elsewhere"]
    return 1 + max((_hf3d_marker(d).get("sequence") or 0 for d in ours), default=0)


def _say(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, file=sys.stderr)


def find_resume(root: Path) -> Path | None:
    """The checkpoint `checkpoint.resume: auto` takes under a run's checkpoints folder: the most recently saved
    (`step_dirs`' order) complete, undamaged one of this run's own (`_ours`); only when there is none, the most
    recent of the others (copies, moves, folders of an earlier hf3d), with one line saying so. A newer one
    that is not the run's own is passed over with one line naming it, never silently. None when the folder
    holds none at all. A damaged one is passed over with one warning line naming its file. Folders that
    exist but are all incomplete or damaged are an error, never a silent restart. Collective under a
    process group (see `find_damage`)."""
    complete = step_dirs(root)
    candidates = [d for _, d in reversed(complete) if _ours(d)] + [d for _, d in reversed(complete) if not _ours(d)]
    for i, d in enumerate(candidates):
        problem = find_damage(d, read_marker(d))
        if problem is None:
            _say_passed_over(d, [n for _, n in complete], candidates[:i])
            return d
        instead = f"trying {candidates[i + 1].name}" if i + 1 < len(candidates) else "no older checkpoint"
        _say(f"hf3d: warning: skipping the damaged checkpoint {d}: {problem}; {instead}")
    partial = sorted(d.name for d in root.iterdir() if d.name.startswith("step_")) if root.is_dir() else []
    if partial:
        which = "every complete one is damaged" if complete else "none is complete"
        raise ValueError(
            f"{root} holds checkpoint folders but {which} ({', '.join(partial)}); "
            "resume from a checkpoint path explicitly, or set checkpoint.resume=none to start over"
        )
    return None


def _say_passed_over(chosen: Path, order: list[Path], damaged: list[Path]) -> None:
    """One line when `resume: auto` takes a checkpoint that is not the run's own, or passes over a newer one
    that is not (`order`: every complete one, oldest save first; `damaged`: those already said)."""
    newer = [d for d in order[order.index(chosen) + 1 :] if d not in damaged and not _ours(d)]
    if not _ours(chosen):
        _say(
            f"hf3d: warning: resuming from {chosen}, which is not this run's own save: {_not_ours(chosen)}; "
            "checkpoint.keep_last never deletes it"
        )
    elif newer:
        more = f" (and {len(newer) - 1} more)" if len(newer) > 1 else ""
        _say(
            f"hf3d: warning: not resuming from {newer[-1]}{more}, saved after {chosen.name} by its marker: "
            f"{_not_ours(newer[-1])}; resuming from this run's newest, {chosen}; to resume from it, set "
            f"checkpoint.resume={newer[-1]}"
        )


def resolve_resume(spec: str, root: Path) -> Path | None:
    """checkpoint.resume: "auto" (`find_resume` under root, or None), "none", or a path to a `step_<N>` folder
    (refused when damaged) or to a checkpoints folder. Collective under a process group (every rank calls
    it)."""
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


def later_saves(root: Path, start: int, resumed: Path | None) -> list[Path]:
    """This run's own complete checkpoints under root at steps past `start` (`resumed` aside): saves of another
    trajectory when the run goes on from step `start`, which its saves would replace as it reaches their steps
    and keep_last would rotate away. A copy from elsewhere is not among them: hf3d never deletes one."""
    return [d for step, d in step_dirs(root) if step > start and d != resumed and _ours(d)]


def clean_leftovers(root: Path) -> None:
    """What killed saves and removals left under a run's checkpoints folder, cleaned: trash folders and replaced
    `step_<N>.old` ones gone (`files.sweep`), a `step_<N>.old` whose `step_<N>` is missing (a publish without
    renameat2 killed between its two renames) back at its name, and this run's own staging folders
    `step_<N>.tmp` gone. Rank 0, at the start of a run, before any save. What cannot be cleaned (a folder
    this user may not change) is said in one line, and the run goes on: nothing there blocks it."""
    try:
        files_.sweep(root, CHECKPOINT)
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            if _REPLACED.match(d.name) and _ours(d) and not os.path.lexists(d.with_name(d.stem)):
                files_.rename_new(d, d.with_name(d.stem))
            elif (_REPLACED.match(d.name) or d.name.endswith(".tmp") and STEP_DIR.match(d.name[:-4])) and _ours(d):
                if files_.refusal(d, CHECKPOINT) is None:
                    files_.remove_dir(d, CHECKPOINT)
    except OSError as e:
        print(f"hf3d: warning: could not clean what an interrupted save left in {root} ({e})", file=sys.stderr)


def finish_save(
    root: Path,
    keep_last: int,
    published: Path,
    *,
    told: set[Path] | None = None,
    pinned: Collection[Path] = (),
) -> None:
    """After the checkpoint `published` under root is published (fsynced): point `latest` at it, then drop the
    oldest of this run's own saves beyond keep_last (0 keeps all). Rank 0 only.

    Kept: `published` (the newest save, and the one `checkpoint.resume: auto` chooses) and the newest
    keep_last - 1 other saves of this run whose files still have the sizes their markers record; the rest
    go, the damaged ones among them. So a save never leaves fewer undamaged checkpoints than keep_last
    allows, and never removes the only good one. Only what hf3d made here is deleted, and only when it
    holds nothing but the files hf3d wrote (`files.refusal`): a copy or a move from elsewhere, a folder of an
    earlier hf3d and a folder holding a file of the user's are kept, each said in one line, once per folder
    when the caller keeps `told` (the folders said so far). Links are never followed: a `latest` that is a
    link is refused, not written through. `pinned`: checkpoints kept for now beyond keep_last (a Hub push
    still converting them), counted in no keep_last; a later call drops them."""
    try:
        files_.write_file(root / "latest", published.name + "\n", replace=True, sync=True)
    except (OSError, ValueError) as e:
        raise CheckpointWriteError(
            f"could not update {root / 'latest'} ({failure_line(e)}); the checkpoint {published} itself is "
            "complete and checkpoint.resume=auto finds it: fix that, then resume"
        ) from None
    prune_saves(root, keep_last, published, told=told, pinned=pinned)


def prune_saves(
    root: Path, keep_last: int, newest: Path, *, told: set[Path] | None = None, pinned: Collection[Path] = ()
) -> None:
    """keep_last's half of `finish_save`: `newest` and keep_last - 1 other undamaged saves of this run are kept
    (and `pinned`), the rest of this run's own saves deleted. Rank 0 only."""
    if keep_last <= 0:
        return
    kept = 1
    for _, d in reversed(step_dirs(root)):
        if d == newest or d in pinned:
            continue
        problem = _not_ours(d) if not _ours(d) else None
        if problem is None and kept < keep_last and find_damage(d, read_marker(d), checksums=False) is None:
            kept += 1
            continue
        problem = problem or files_.refusal(d, CHECKPOINT)
        if problem is None:
            files_.remove_dir(d, CHECKPOINT)
        elif told is None or d not in told:
            print(f"hf3d: warning: checkpoint.keep_last keeps {d}: {problem}; delete it yourself once it is not needed",
                  file=sys.stderr)  # fmt: skip
            if told is not None:
                told.add(d)
