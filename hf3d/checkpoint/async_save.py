"""DCP saves that return at once: the files are written in the background while training goes on.

`torch.distributed.checkpoint.async_save` stages the state dict (gives the write a state the training step
cannot change under it), then plans and writes it in a thread of its own, with collectives on the process
group it is given. That group is a gloo group made for the checkpoints alone: the training step keeps the
model's groups, so the two never queue behind each other (and nccl, which async_save refuses for the
background collectives, is never asked).

What holds the state still until it is read depends on where it lives:
- On a CPU, with an optimizer, nothing is copied: the write reads the live tensors, and the optimizer's
  next update waits until this rank's write has read all of them (`OneFileWriter.read`, through
  `ParallelOptimizer.wait_before_update`). The write runs beside the next step's forward and backward.
  A copy took 0.09 of the 0.41-0.48 CPU s a save cost each rank at dp=2 (8 layers of SmolLM2-135M), on
  cores the training step already uses, and kept a host copy of the rank's state (324 MiB there) for the
  whole run. The price: the update waits for the write itself (its disk writes too) where the step left
  it too little idle time to finish before (`bench_checkpoint.py` measures the stall).
- On a GPU, and for a save without an optimizer (nothing to hold back), hf3d's `BoxStager` copies exactly
  the boxes this rank writes, in a thread, into host buffers kept from one save to the next (pinned
  memory on a GPU); the update (or the save itself, without an optimizer) waits for that copy only.
  DCP's DefaultStager copies whole storages: at dp=2 under ZeRO-1 a rank's parameter shard is a view of
  the whole flat buffer, so it copied 432 MiB per rank for 324 MiB written, before the save returned.

The background threads (the staging copy, DCP's writer and hf3d's completion) run at the lowest CPU
priority: the training step keeps its cores, and the background takes the time the step leaves idle
(collective waits, data loading). What the update still waits for is finished with the cores the step
leaves idle then.

What comes after the files (hf3d's checksums, marker, rename, `latest`, pruning) is the caller's `then`,
run on this rank once its own write has finished: on the coordinator (rank 0) that is after every rank's
files are on disk, since DCP's save returns there only when all ranks have reported their writes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from .writer import dcp_debug_records_off


def lower_thread_priority() -> None:
    """Give the calling (background) thread the lowest CPU priority, where the OS allows it per thread
    (Linux: a thread id is a PRIO_PROCESS target). Elsewhere, or when refused, it keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class BoxStager(AsyncStager):
    """Stages a state dict of hf3d's checkpoint entries (each with `copied(into)`: the same entry over copies of
    its boxes) in a thread of its own, into buffers kept per (entry, box) from one save to the next; returns
    the future of the staged dict. On a GPU the copies go to pinned memory on a stream of their own, after the
    work already queued on the current stream (the last update of the parameters)."""

    _synchronize_after_execute = False  # the caller waits on the future (the optimizer's next update)

    def __init__(self):
        self.on_gpu = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.on_gpu else None
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf3d-staging")

    def reserve(self, state_dict: dict) -> None:
        """The host buffers of every box of `state_dict` (entries as `stage` takes them), made now: the copy of
        a later stage() of the same entries finds them (pinned memory takes seconds to make on a GPU)."""
        for key, entry in state_dict.items():
            for offsets, box in entry.boxes.items():
                self.buffers[(key, offsets)] = torch.empty(box.shape, dtype=entry.dtype, pin_memory=self.on_gpu)

    def stage(self, state_dict: dict) -> Future:
        queued = None
        if self.on_gpu:
            queued = torch.cuda.Event()
            queued.record()
        return self.executor.submit(self._copy, state_dict, queued)

    def _copy(self, state_dict: dict, queued) -> dict:
        lower_thread_priority()
        used: dict[tuple, torch.Tensor] = {}
        boxes: list[torch.Tensor] = []

        def into(key: str, offsets, box: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            buf = self.buffers.get((key, offsets))
            if buf is None or buf.shape != box.shape or buf.dtype != dtype:
                buf = torch.empty(box.shape, dtype=dtype, pin_memory=self.on_gpu)
            used[(key, offsets)] = buf
            boxes.append(box)
            return buf

        staged = {key: entry.copied(lambda *a, key=key: into(key, *a)) for key, entry in state_dict.items()}
        with torch.no_grad(), torch.cuda.stream(self.stream) if self.on_gpu else nullcontext():
            if queued is not None:
                self.stream.wait_event(queued)
            # one call for every box: the GIL is let go for all of the copies, not taken back between them
            if boxes:  # a rank may write nothing (a save without an optimizer, at dp > 1), and take part all the same
                torch._foreach_copy_(list(used.values()), boxes, non_blocking=self.on_gpu)
            if self.on_gpu:
                self.stream.synchronize()
        self.buffers = used  # what this save did not use (another mesh's or a weights-only save's) is let go
        return staged


class _Unstaged(AsyncStager):
    """The state dict as it is: the write reads the live tensors (the caller holds them still)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> Future:
        same: Future = Future()
        same.set_result(state_dict)
        return same


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
    """One per model: the checkpoints' gloo group, the stager of the saves that copy (its host buffers are
    reused from one save to the next, and kept for as long as the model lives: the memory such saves cost)
    and the save in flight, if any. Made collectively: every rank, in the same order."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.plans_key = f"hf3d-{next(_SAVERS)}"  # DCP keeps this model's save plans under it
        self.stager: BoxStager | None = None  # made by the first save that copies
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf3d-checkpoint")
        self.pending: Future | None = None
        self.replay: Replay | None = None  # the last save, where the next one may write as it did
        self.replays = 0  # saves written by replay_save (tests read it)
        self.checkpoint = None  # the caller's handle on the save in flight (a checkpoint.PendingCheckpoint)

    def reserve(self, state: dict) -> None:
        """Make the stager and its host buffers for `state` before the first save that copies (BoxStager.reserve)."""
        if self.stager is None:
            self.stager = BoxStager()
        self.stager.reserve(state)

    def save(
        self, state: dict, writer, planner, then: Callable[[], None] | None, *, copy: bool
    ) -> tuple[Future, Future]:
        """Write `state` with `writer` (hf3d's OneFileWriter for the checkpoint's folder), then run `then`, all in
        the background; with `copy`, from a staged copy. Returns two futures: the first is done once nothing in
        `state` is read any more (the staging copy taken, or without `copy` this rank's write having read every
        tensor, or the save having failed before it); until then nothing in `state` may change. The second is
        the whole save's (its exception is this rank's failure). The previous save must be finished."""
        assert self.pending is None or self.pending.done(), "two checkpoint saves may not overlap"
        if copy and self.stager is None:
            self.stager = BoxStager()
        with dcp_debug_records_off():  # the foreground part: the entries' state_dict() calls
            response = dcp.async_save(
                state,
                storage_writer=writer,
                planner=planner,
                process_group=self.group,
                async_stager=self.stager if copy else _Unstaged(),
            )

        def complete() -> None:
            lower_thread_priority()
            try:
                response.upload_completion.result()
            finally:  # a save that failed before its write began (planning) releases the state too
                if not writer.read.done():
                    writer.read.set_result(None)
            if then is not None:
                then()

        self.pending = self.executor.submit(complete)
        return (response.staging_completion if copy else writer.read), self.pending

    def replay_save(self, writer, replay: Replay, then: Callable[[], None]) -> tuple[Future, Future]:
        """Write as the save `replay` recorded (`writer.replay`), in the background, then run `then`; returns
        the futures `save` returns. Every rank must replay, or none (the caller agrees on it)."""

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
