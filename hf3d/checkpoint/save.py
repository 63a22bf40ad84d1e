"""`save_checkpoint`: every rank writes its boxes in parallel, synchronously or in the background, and rank 0
publishes the folder atomically once every rank's files are on disk."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ..parallel.mesh import on_rank0
from ..utils import files as files_
from .async_save import BackgroundSaver, Replay, everywhere, signature
from .entries import DTYPE_NAMES, SavePlanner, entries_of, optim_description, optim_keys, state_entries
from .failures import CheckpointWriteError, RankFailure, failure_line, must_see, on_every_rank, refuse_write
from .marker import CHECKPOINT, file_table, staging_dir, write_marker
from .rotation import next_sequence
from .writer import OneFileWriter, dcp_debug_records_off


def _rng_state(pmodel) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if pmodel.dropout_rng is not None:
        state["dropout"] = pmodel.dropout_rng.state_dict()
    return state


def save_checkpoint(
    path: str | os.PathLike,
    pmodel,
    opt=None,
    *,
    step: int,
    extra: dict | None = None,
    async_: bool = False,
    after_publish: Callable[[], None] | None = None,
) -> Path | PendingCheckpoint:
    """Collective: write a training checkpoint of `pmodel` (and `opt`) at `path`, atomically.

    Every rank writes only what it owns (its tp slices, its pipeline stages, its ZeRO shard), under
    HF names and global offsets, so any mesh can load it. `extra` is a dict of the caller's state
    (an LR scheduler or anything with `state_dict()`, data position, counters), saved from rank 0.
    Returns the checkpoint folder. `after_publish` runs on rank 0 once the folder is published.

    A write that fails on any rank (a full disk, a folder that cannot be created) raises one
    CheckpointWriteError (a ValueError) on every rank, naming the path; the staging folder is removed
    and nothing is published, so the checkpoints already there (and `latest`) are unchanged. A peer
    that dies mid-save leaves the staging folder unmarked: never loaded, replaced by the next save.

    async_=True returns a PendingCheckpoint at once: the big files are written in the background while
    training goes on (the next update of `opt` waits until this rank's write has read the state, on a
    GPU until it is copied to the host; without `opt` the call returns once a copy is taken), and the
    checksums, the marker, the rename and `after_publish` follow them there, with the same atomicity.
    Its `result()` (collective) waits and returns the folder or raises as above; the next save or load of
    this model waits for it first, so two saves never overlap."""
    final = Path(path)
    tmp = staging_dir(final)
    wait_for_checkpoint(pmodel)
    # a folder hf3d did not make, at the path or its staging path, is refused before anything is written
    on_rank0(lambda: (files_.check_replaceable(final, CHECKPOINT), files_.check_replaceable(tmp, CHECKPOINT)))
    try:
        pending = _save(final, tmp, pmodel, opt, step=step, extra=extra, async_=async_, after_publish=after_publish)
    except (Exception, CheckpointException) as e:
        refuse_write(e, final, tmp)
    return final if pending is None else pending


@dataclasses.dataclass
class PendingCheckpoint:
    """A checkpoint being written in the background (`save_checkpoint(..., async_=True)`)."""

    path: Path
    """The folder it is published as."""
    future: Future
    """This rank's part: its files written and checksummed, then (rank 0) the marker, the rename and
    after_publish."""
    published: threading.Event
    """Set on rank 0 once the folder is published (before after_publish)."""
    waited: bool = False
    """Whether result() or join() has been called (the next save then need not wait again)."""

    def done(self) -> bool:
        """Whether this rank's part has finished (no collective)."""
        return self.future.done()

    def result(self) -> Path:
        """Collective: wait until the checkpoint is published and return its folder; a failure on any
        rank raises one CheckpointWriteError on every rank (the staging folder removed)."""
        error = self.future.exception()
        mine = None if error is None else f"rank {dist.get_rank()}: {failure_line(error)}"
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, self.published.is_set()))
        self.waited = True
        failed = [m for m, _ in everyone if m is not None]
        # rank 0's word, not the folder's: a checkpoint published before at the same path is no sign of
        # this one, and rank 0 removes the staging folder while the others look
        if failed and everyone[0][1]:
            raise CheckpointWriteError(f"{self.path} was published, but what follows it failed: {failed[0]}")
        if failed:
            refuse_write(OSError(failed[0]), self.path, staging_dir(self.path))
        return self.path

    def join(self) -> str | None:
        """Wait for this rank's part alone (no collective: for a rank on its way out with an error, whose
        peers may not be waiting); returns its failure in one line, or None."""
        error = self.future.exception()
        self.waited = True
        return None if error is None else failure_line(error)


def wait_for_checkpoint(pmodel) -> Path | None:
    """Collective: wait for the model's checkpoint still being written in the background, if any (see
    PendingCheckpoint.result); returns its folder."""
    saver = getattr(pmodel, "_background_saver", None)
    pending = None if saver is None else saver.checkpoint
    if pending is None or pending.waited:
        return None
    return pending.result()


def _save(final: Path, tmp: Path, pmodel, opt, *, step: int, extra: dict | None, async_: bool, after_publish):
    rank = dist.get_rank()

    on_rank0(lambda: files_.make_dir(tmp, CHECKPOINT))  # a leftover of hf3d's own is replaced
    on_every_rank(lambda: must_see(tmp))
    keys = None if opt is None else optim_keys(opt)
    meta = {
        "kind": "training" if opt is not None else "weights",
        "step": int(step),
        "dtype": DTYPE_NAMES[pmodel.param_dtype],
        "model_type": pmodel.config.model_type,
        "parallel": dataclasses.asdict(pmodel.pcfg),
        "world_size": dist.get_world_size(),
        "optim": optim_description(opt, keys),
    }

    published = threading.Event()

    def publish_now(files: dict | None = None) -> None:
        order = {"sequence": next_sequence(final.parent)}
        write_marker(tmp, {**meta, **order, "files": files} if files else {**meta, **order})
        files_.publish_dir(tmp, final, CHECKPOINT)
        published.set()
        if after_publish is not None:
            after_publish()

    if not async_:
        writer = OneFileWriter(tmp, direct=True)  # O_DIRECT, each rank's file checksummed as it is written
        with dcp_debug_records_off():  # a failure on any rank raises on all
            dcp.save(entries_of(pmodel, opt, keys), storage_writer=writer, planner=SavePlanner())

        def own_files() -> dict:  # the data file on disk first (its write's error, if any, is the one told)
            table = writer.file_table()
            _save_new(_rng_state(pmodel), tmp / f"rng_{rank}.pt")
            return {**table, **file_table(tmp, only=f"rng_{rank}.pt")}

        tables = _gather_file_tables(own_files, group=None, everywhere=True)
        on_rank0(lambda: (_write_small_files(tmp, pmodel, extra), publish_now(tables)))
        return None
    # the entries of a save that copies are made by its staging thread: they are the same views every time,
    # and a 360M model has 870 of them (13 of the 18 ms its save held the training thread here)
    entries = functools.partial(entries_of, pmodel, opt, keys)
    return _save_async(final, tmp, pmodel, opt, entries, extra, publish_now, published)


def _save_async(final: Path, tmp: Path, pmodel, opt, entries, extra, publish_now, published):
    """_save's background half: the small files now, then the model and optimizer state (`entries()` makes
    them) in the model's BackgroundSaver (from a copy, or from the live state: `_copies`); rank 0 publishes
    (`publish_now`) once every rank's files are written. Returns the PendingCheckpoint."""
    rank = dist.get_rank()
    # the small files first, in the foreground (the RNG states, the data position and the config change
    # as soon as training goes on); the background then writes the model and optimizer state
    on_every_rank(lambda: _save_new(_rng_state(pmodel), tmp / f"rng_{rank}.pt"))
    on_rank0(lambda: _write_small_files(tmp, pmodel, extra))
    saver = _background_saver(pmodel)
    rng = f"rng_{rank}.pt"  # written above

    def publish(written: Callable[[], dict]) -> None:  # every rank, once its own file is written
        tables = _gather_file_tables(lambda: {**written(), **file_table(tmp, only=rng)}, saver.group)
        if rank == 0:
            publish_now(tables)

    if _copies(pmodel, opt):
        released, future = saver.save_copied(entries, tmp, then=publish)
    else:
        released, future = _save_live(saver, entries(), tmp, publish)
    if opt is not None:
        opt.wait_before_update(released)  # the write (or the copy) runs beside the next forward and backward
    else:
        wait([released])  # nothing here to hold back whatever changes the parameters next
    saver.checkpoint = PendingCheckpoint(final, future, published)
    return saver.checkpoint


def _save_live(saver, entries, tmp: Path, publish) -> tuple[Future, Future]:
    """An async save that reads the live state (a CPU's, with an optimizer) into `tmp`: through DCP, recording
    its writes, or as the last one wrote where nothing moved since (every rank agreeing)."""
    writer = OneFileWriter(tmp, direct=True, record=True)
    now = signature(entries)
    last, saver.replay = saver.replay, None  # kept again only once this save is written
    replay = everywhere([last is not None and last.signature == now], saver.group)[0]

    def complete() -> None:  # every rank, once every rank's files are written (DCP's save returned)
        if replay:
            saver.replay = last
        elif writer.program is not None:
            saver.replay = Replay(now, writer.program, writer.finished)
        publish(writer.file_table)

    if replay:
        return saver.replay_save(writer, last, then=complete)
    planner = SavePlanner(background=True, plans_key=saver.plans_key)
    return saver.save_live(entries, writer, planner, then=complete)


def _background_saver(pmodel) -> BackgroundSaver:
    """The model's BackgroundSaver, made (collectively) by its first async save or `prepare_async_save`."""
    saver = getattr(pmodel, "_background_saver", None)
    if saver is None:
        saver = pmodel._background_saver = BackgroundSaver()
    return saver


def _copies(pmodel, opt) -> bool:
    """Whether an async save writes from a host copy of the state: on a GPU (pinned memory), and without an
    optimizer (nothing holds the parameters still). On a CPU with an optimizer the write reads the live state,
    and the next update waits for it."""
    return opt is None or pmodel.device.type != "cpu"


def prepare_async_save(pmodel, opt=None) -> None:
    """Collective: what the async saves of `pmodel` (and `opt`) need, made now rather than in the first save:
    the checkpoints' process group and, where the saves copy (`_copies`), the arena of exactly the boxes this
    rank writes (pinned memory on a GPU), the writer process and the saves' plan. Call it once the optimizer
    holds its state (after the first step). On an H200 the first async save, which made them, stalled training
    14-15 s, the later ones 0.2-1.4 steps; pinning GiBs of host memory takes seconds."""
    wait_for_checkpoint(pmodel)
    saver = _background_saver(pmodel)
    if _copies(pmodel, opt):
        saver.prepare(state_entries(pmodel, opt))


def _gather_file_tables(own_files: Callable[[], dict], group, *, everywhere: bool = False) -> dict | None:
    """Every rank's table of the files it wrote (`own_files()`: {name: {"size", "crc32"}}, once they are on
    disk), gathered on rank 0 (None elsewhere) or, with `everywhere`, on every rank, over `group`. A failure
    on any rank raises where the tables are gathered (and on that rank): no marker is written, the folder
    stays unpublished."""
    rank = dist.get_rank()
    try:
        mine = own_files()
    except Exception as e:
        mine = f"rank {rank}: {failure_line(e)}"
    if everywhere:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=group)
    if isinstance(mine, str):
        raise RankFailure(mine)
    if everyone is None:
        return None
    failed = [t for t in everyone if isinstance(t, str)]
    if failed:
        raise RankFailure(failed[0])
    return {name: entry for table in everyone for name, entry in table.items()}


def _write_small_files(tmp: Path, pmodel, extra: dict | None) -> None:
    """Rank 0's files beside DCP's: the caller's extra, the HF config and the tokenizer files."""
    from ..hf.folders import copy_model_files

    if extra is not None:
        saved = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in extra.items()}
        _save_new(saved, tmp / "extra.pt")
    pmodel.config.save_pretrained(tmp)
    if pmodel.tokenizer_dir is not None:
        copy_model_files(pmodel.tokenizer_dir, tmp)


def _save_new(obj, path: Path) -> None:
    with files_.new_file(path) as f:
        torch.save(obj, f)
