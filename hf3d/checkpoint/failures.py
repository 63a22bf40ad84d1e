"""A checkpoint write that fails on any rank raises one CheckpointWriteError on every rank, naming the rank and
what to do; nothing is published."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from ..utils import files as files_
from ..utils.faults import is_communication_error, one_line
from .marker import CHECKPOINT


class CheckpointWriteError(ValueError):
    """A checkpoint could not be written; raised on every rank, after the staging folder is removed."""


class RankFailure(OSError):
    """A failure on some rank, raised on every rank that learns of it: "rank N: <that rank's one line>"."""


def failure_line(e: BaseException) -> str:
    if isinstance(e, RankFailure):
        return str(e)
    if isinstance(e, CheckpointException):  # DCP: {rank: (exception, traceback)}; the first says it
        rank, (e, _) = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {failure_line(e)}"
    return one_line(e)


def on_every_rank(fn) -> None:
    """Run fn on every rank; an exception on any of them is raised on all (as an OSError carrying
    that rank's one-line message), so no rank goes on to wait in the next collective."""
    msg = None
    try:
        fn()
    except Exception as e:
        msg = f"rank {dist.get_rank()}: {failure_line(e)}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, msg)
    failed = [m for m in everyone if m is not None]
    if failed:
        raise RankFailure(failed[0])


def refuse_write(e: BaseException, final: Path, tmp: Path) -> NoReturn:
    if is_communication_error(e):  # a peer is gone: nothing left to agree with
        raise e
    if dist.get_rank() == 0:
        try:
            files_.remove_dir(tmp, CHECKPOINT)
        except (OSError, ValueError):
            pass  # left unmarked: never loaded, and the next save of this step replaces it
    raise CheckpointWriteError(
        f"could not write the checkpoint {final} ({failure_line(e)}); nothing was published and the "
        f"checkpoints already in {final.parent} are unchanged: {_remedy(e)}, then resume"
    ) from None


_UNSHARED = "though rank 0 made it"  # must_see's words, which _remedy answers


def must_see(tmp: Path) -> None:
    """Every rank writes into the staging folder rank 0 made: a rank that does not see it saves under
    another path, or on a disk of its own machine that rank 0's is not."""
    if not tmp.is_dir():
        raise FileNotFoundError(f"{tmp} is not there on this rank, {_UNSHARED}")


def _remedy(e: BaseException) -> str:
    """What to do about a failed write: a path that is not a writable folder, or (anything else: a full
    disk shows up as ENOSPC, EFBIG or a short write inside torch.save) room on the disk."""
    text = f"{e} {failure_line(e)}"
    if _UNSHARED in text:
        return "give every rank the same checkpoint path, on a file system that every machine of the job shares"
    if any(s in text for s in ("Not a directory", "Permission denied", "Read-only file system", "Is a directory")):
        return "check that the output folder is a folder this user can write, or write to another folder"
    return "make room on that disk, or write to another folder"
