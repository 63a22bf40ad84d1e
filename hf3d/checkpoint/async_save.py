"""Checkpoint saves that return at once: the files are written in the background while training goes on.

The background's collectives go over a gloo group made for the checkpoints alone: the training step keeps the
model's groups, so the two never queue behind each other (and nccl is never asked to serve a second thread).
What holds the state still until it is read depends on where it lives.

Saves that copy (`BackgroundSaver.save_copied`): on a GPU, and any save without an optimizer (nothing to hold
back). `BoxStager` makes the entries (views of the state) and copies exactly the boxes this rank writes into the
arena (`arena.py`: made once, pinned on a GPU, shared with the writer process); the optimizer's next update (or
the save itself, without an optimizer) waits for that copy only. The save is planned once, not per save: a
`Rehearsal` (DCP's planning, collective, nothing written) gives this rank's writes as a program, and the writer
process (`WriterProcess`) writes each save from it. A save whose boxes moved (new entries, another arena) is
planned again first, in the background, every rank together. Where the arena cannot be shared (no memfd) or no
process can be started, the same program is written by a thread of this process instead.

Saves that read the live state (`save_live`): on a CPU with an optimizer nothing is copied. The write reads
the live tensors in a thread (DCP, or a replay of the last save's writes where nothing moved), and the
optimizer's next update waits until this rank's write has read all of them (`OneFileWriter.read`, through
`ParallelOptimizer.wait_before_update`); the write runs beside the next step's forward and backward. A copy
took 0.09 of the 0.41-0.48 CPU s a save cost each rank at dp=2 (8 layers of SmolLM2-135M), on cores the
training step already uses, and kept a host copy of the rank's state (324 MiB there) for the whole run; a
process could read only memory it shares, which the live state is not.

The background threads run at the lowest CPU priority (the writer process too): the training step keeps its
cores, and the background takes the time the step leaves idle.

What comes after the files (hf3d's checksums, marker, rename, `latest`, pruning) is the caller's `then`, run
on this rank in the saver's thread once its own write has finished; it gathers every rank's file table, so
rank 0 publishes only after every rank's files are on disk.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from .arena import BoxStager, lower_thread_priority
from .entries import SavePlanner
from .writer import OneFileWriter, Rehearsal, dcp_debug_records_off
from .writer_process import WriterProcess


@dataclasses.dataclass
class Replay:
    """A save the next one may write again: what its entries were (`signature`: names, dtypes, sizes and
    every box's place in memory), this rank's writes (OneFileWriter.program) and, on the coordinator, DCP's
    metadata and every rank's results (OneFileWriter.finished)."""

    signature: tuple
    program: tuple
    finished: tuple | None


_SAVERS = itertools.count()  # never reused in a process, unlike id(): DCP's cached plans outlive a model


class BackgroundSaver:
    """One per model: the checkpoints' gloo group, the stager of the saves that copy (its arena is reused from
    one save to the next and kept for as long as the model lives: the memory such saves cost), their plan and
    writer process, and the save in flight, if any. Made collectively: every rank, in the same order."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.plans_key = f"hf3d-{next(_SAVERS)}"  # DCP keeps this model's save plans under it
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf3d-checkpoint")
        self.pending: Future | None = None  # the last save's job
        self.checkpoint = None  # the caller's handle on the save in flight (a checkpoint.PendingCheckpoint)
        self.replay: Replay | None = None  # saves of the live state: the last one, where the next may write as it did
        self.replays = 0  # saves of the live state written by replay_save (tests read it)
        self.stager: BoxStager | None = None  # saves that copy: made by the first one, or by prepare
        self.plan: Replay | None = None  # their plan: what they write, over the arena
        self.process: WriterProcess | None = None  # and who writes it
        self.in_thread = False  # no process could be started: a thread of this process writes

    # -- saves that copy ----------------------------------------------------------------------------------
    def prepare(self, state: dict) -> None:
        """What the saves of `state` that copy need, made now rather than by the first: the arena (on this
        thread: pinning takes seconds), the writer process (its imports run meanwhile) and, in the background,
        the plan (collective: every rank calls this)."""
        if self.stager is None:
            self.stager = BoxStager()
        self.stager.reserve(state)
        self._writer()
        staged = self.stager.staged(state)

        def plan() -> None:
            lower_thread_priority()
            self.plan = self._rehearse(staged, signature(staged))

        self.executor.submit(plan)  # the first save's job comes after it, on the same thread

    def save_copied(
        self, state: Callable[[], dict], folder: Path, then: Callable[[Callable[[], dict]], None]
    ) -> tuple[Future, ...]:
        """Copy the state dict `state()` makes into the arena, then write the copy into `folder` and run `then`,
        in the background (`state()` too, in the staging thread).
        `then` gets what gives this rank's file table ({name: {"size", "crc32"}}) or raises its failure; it is
        called on every rank, whatever failed. Returns the futures `save_live` returns: the first is the copy's."""
        assert self.pending is None or self.pending.done(), "two checkpoint saves may not overlap"
        if self.stager is None:
            self.stager = BoxStager()
        staging = self.stager.stage(state)

        def job() -> None:
            lower_thread_priority()
            then(self._write_staged(staging, folder))

        self.pending = self.executor.submit(job)
        return staging, self.pending

    def _write_staged(self, staging: Future, folder: Path) -> Callable[[], dict]:
        """This rank's part of a save that copies, once its copy is taken: plan it again where its boxes moved
        (every rank together), then write it. Returns what gives its file table, or raises its failure."""
        staged, error = None, None
        try:
            staged = staging.result()
        except Exception as e:
            error = e
        now = None if staged is None else signature(staged)
        planned = now is not None and self.plan is not None and self.plan.signature == now
        everyone_staged, everyone_planned = everywhere([staged is not None, planned], self.group)
        if not everyone_staged:  # the save fails; a rank whose copy was taken tells nothing of its own
            return _raising(error) if error is not None else dict
        try:
            if not everyone_planned:
                self.plan = self._rehearse(staged, now)
            table = self._write(folder, staged)
        except Exception as e:
            return _raising(e)
        return lambda: table

    def _rehearse(self, staged: dict, sig: tuple) -> Replay:
        """Plan a save of `staged` (whose `signature` is `sig`) with DCP, writing nothing (collective); twice
        where the first recorded torch.save layouts. A program that no rank may lack, or none on every rank."""
        for _ in range(2):
            writer = Rehearsal()
            self._dcp_save(staged, writer)
            if everywhere([writer.program is not None], self.group)[0]:
                return Replay(sig, writer.program, writer.finished)
        return Replay(sig, None, None)

    def _dcp_save(self, staged: dict, writer) -> None:
        """DCP's collective save of `staged` over the checkpoints' group, through `writer` (this model's plans
        cached under its key)."""
        planner = SavePlanner(background=True, plans_key=self.plans_key)
        with dcp_debug_records_off():
            dcp.save(staged, storage_writer=writer, planner=planner, process_group=self.group)

    def _write(self, folder: Path, staged: dict) -> dict:
        """This rank's file of `staged` in `folder`, as planned: by the writer process, or where there is none
        by this thread; through DCP where the plan has no program (every rank alike)."""
        writer = OneFileWriter(folder, direct=True)
        if self.plan.program is None:
            self._dcp_save(staged, writer)
            return writer.file_table()
        process = self._writer()
        if process is not None:
            return process.write(folder, self.stager.arena, self.plan)
        writer.replay(self.plan.program, self.plan.finished)
        return writer.file_table()

    def _writer(self) -> WriterProcess | None:
        """The writer process, started where none runs (the last one died: that save failed); None where the
        arena is not shared or no process can be started (said once)."""
        if self.in_thread or not self.stager.arena.shareable:
            return None
        if self.process is not None and not self.process.alive():
            self.process = None
        if self.process is None:
            try:
                self.process = WriterProcess()
            except OSError as e:
                warnings.warn(f"hf3d: async checkpoints are written by a thread of the training process: the "
                              f"writer process could not start ({e})", stacklevel=2)  # fmt: skip
                self.in_thread = True
        return self.process

    # -- saves of the live state --------------------------------------------------------------------------
    def save_live(self, state: dict, writer, planner, then: Callable[[], None]) -> tuple[Future, Future]:
        """Write `state` with `writer` (hf3d's OneFileWriter for the checkpoint's folder), then run `then`, all in
        the background, reading the live tensors. Returns two futures: the first is done once nothing in
        `state` is read any more (this rank's write has read every tensor, or the save failed before it);
        until then nothing in `state` may change. The second is the whole save's (its exception is this rank's
        failure). The previous save must be finished."""
        assert self.pending is None or self.pending.done(), "two checkpoint saves may not overlap"
        with dcp_debug_records_off():  # the foreground part: the entries' state_dict() calls
            response = dcp.async_save(
                state, storage_writer=writer, planner=planner, process_group=self.group, async_stager=_Unstaged()
            )

        def complete() -> None:
            lower_thread_priority()
            try:
                response.upload_completion.result()
            finally:  # a save that failed before its write began (planning) releases the state too
                if not writer.read.done():
                    writer.read.set_result(None)
            then()

        self.pending = self.executor.submit(complete)
        return writer.read, self.pending

    def replay_save(self, writer, replay: Replay, then: Callable[[], None]) -> tuple[Future, Future]:
        """Write as the save `replay` recorded (`writer.replay`), in the background, then run `then`; returns
        the futures `save_live` returns. Every rank must replay, or none (the caller agrees on it)."""

        def job() -> None:
            lower_thread_priority()
            try:
                writer.replay(replay.program, replay.finished)
            except Exception as e:  # raised on every rank by `then` (file_table), as a write's error is
                writer.failure = e
            then()

        self.replays += 1
        self.pending = self.executor.submit(job)
        return writer.read, self.pending


class _Unstaged(AsyncStager):
    """The state dict as it is: the write reads the live tensors (the caller holds them still)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> Future:
        same: Future = Future()
        same.set_result(state_dict)
        return same


def _raising(error: BaseException) -> Callable[[], dict]:
    def raise_it() -> dict:
        raise error

    return raise_it


def signature(entries: dict) -> tuple:
    """What a replayed save assumes unchanged since the save it replays: every entry's name, dtype and size,
    and each box's offsets, place in memory, shape and strides (the write reads the same memory, and every
    byte around it, its padding included, is the same)."""
    return tuple(
        (key, e.dtype, e.size(), tuple((off, t.data_ptr(), t.shape, t.stride()) for off, t in e.boxes.items()))
        for key, e in entries.items()
    )


def everywhere(flags: list[bool], group) -> list[bool]:
    """Each of `flags`, true on every rank where it is true on every rank of `group` (collective)."""
    t = torch.tensor([int(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in t.tolist()]
