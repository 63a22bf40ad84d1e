"""DCP saves that return at once: the state is copied (staged) and the files are written in the background.

`torch.distributed.checkpoint.async_save` stages the state dict (a copy the training step can no longer
change), then plans and writes it in a thread of its own, with collectives on the process group it is
given. That group is a gloo group made for the checkpoints alone: the training step keeps the model's
groups, so the two never queue behind each other (and nccl, which async_save refuses for the background
collectives, is never asked).

The stager is hf3d's (`BoxStager`, a DCP AsyncStager): it copies exactly the boxes this rank writes, in a
thread, into host buffers kept from one save to the next (pinned memory on a GPU). DCP's DefaultStager
copies whole storages: at dp=2 under ZeRO-1 a rank's parameter shard is a view of the whole flat buffer,
so it copied 432 MiB per rank for 324 MiB written (8 layers of SmolLM2-135M), and it copied before the
save returned. The copy now runs beside the next step's forward and backward, and `ready` is the future
the optimizer's next update waits for (`ParallelOptimizer.wait_before_update`).

The background threads (the staging copy, DCP's writer and hf3d's completion) run at the lowest CPU
priority: the training step keeps its cores, and the background takes the time the step leaves idle
(collective waits, data loading). A staging copy still unfinished at the update is finished while the
step waits for it, with the cores the step leaves idle then.

What comes after the files (hf3d's checksums, marker, rename, `latest`, pruning) is the caller's `then`,
run on this rank once its own write has finished: on the coordinator (rank 0) that is after every rank's
files are on disk, since DCP's save returns there only when all ranks have reported their writes.
"""

from __future__ import annotations

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
            torch._foreach_copy_(list(used.values()), boxes, non_blocking=self.on_gpu)
            if self.on_gpu:
                self.stream.synchronize()
        self.buffers = used  # what this save did not use (another mesh's or a weights-only save's) is let go
        return staged


class BackgroundSaver:
    """One per model: the checkpoints' gloo group, the stager (whose host buffers are reused from one
    save to the next) and the save in flight, if any. Made collectively: every rank, in the same order.

    The stager keeps one host copy of what this rank writes for as long as the model lives: the memory
    an asynchronous checkpoint costs."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.stager = BoxStager()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf3d-checkpoint")
        self.pending: Future | None = None
        self.checkpoint = None  # the caller's handle on the save in flight (a checkpoint.PendingCheckpoint)

    def save(self, state: dict, writer, planner, then: Callable[[], None] | None) -> tuple[Future, Future]:
        """Stage `state` and write it with `writer` (a DCP StorageWriter for the checkpoint's folder), then run
        `then`, all in the background. Returns two futures: the staging copy's (until it is done, nothing in
        `state` may change) and the whole save's (its exception is this rank's failure). The previous save
        must be finished."""
        assert self.pending is None or self.pending.done(), "two checkpoint saves may not overlap"
        with dcp_debug_records_off():  # the foreground part: the entries' state_dict() calls
            response = dcp.async_save(
                state, storage_writer=writer, planner=planner, process_group=self.group, async_stager=self.stager
            )

        def complete() -> None:
            lower_thread_priority()
            response.upload_completion.result()
            if then is not None:
                then()

        self.pending = self.executor.submit(complete)
        return response.staging_completion, self.pending
