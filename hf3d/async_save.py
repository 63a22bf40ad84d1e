"""DCP saves that return as soon as this rank's state is copied: the files are written in the background.

`torch.distributed.checkpoint.async_save` first stages the state dict (a copy the training step can no
longer change: pinned host memory on a GPU, a second host copy on CPU), then plans and writes it in a
thread of its own, with collectives on the process group it is given. That group is a gloo group made
for the checkpoints alone: the training step keeps the model's groups, so the two never queue behind
each other (and nccl, which async_save refuses for the background collectives, is never asked).

The background threads (DCP's writer and hf3d's completion) run at the lowest CPU priority: the training
step keeps its cores, and the write takes the time the step leaves idle (collective waits, data loading).

What comes after the files (hf3d's checksums, marker, rename, `latest`, pruning) is the caller's `then`,
run on this rank once its own write has finished: on the coordinator (rank 0) that is after every rank's
files are on disk, since DCP's save returns there only when all ranks have reported their writes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .writer import dcp_debug_records_off


def lower_thread_priority() -> None:
    """Give the calling (background) thread the lowest CPU priority, where the OS allows it per thread
    (Linux: a thread id is a PRIO_PROCESS target). Elsewhere, or when refused, it keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class BackgroundSaver:
    """One per model: the checkpoints' gloo group, the stager (whose host buffers are reused from one
    save to the next) and the save in flight, if any. Made collectively: every rank, in the same order.

    The stager keeps one host copy of what this rank writes for as long as the model lives: the memory
    an asynchronous checkpoint costs."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        on_gpu = torch.cuda.is_available()
        # the copy is made before save() returns (no staging thread): the next optimizer step may then
        # change the parameters at once
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=on_gpu,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=on_gpu,
            )
        )
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf3d-checkpoint")
        self.pending: Future | None = None
        self.checkpoint = None  # the caller's handle on the save in flight (a checkpoint.PendingCheckpoint)

    def save(self, state: dict, writer, planner, then: Callable[[], None] | None) -> Future:
        """Stage `state` now; write it with `writer` (a DCP StorageWriter for the checkpoint's folder) and
        then run `then` in the background. Returns the future of the whole (its exception is this rank's
        failure). The previous save must be finished."""
        assert self.pending is None or self.pending.done(), "two checkpoint saves may not overlap"
        with dcp_debug_records_off():  # the foreground part: staging and the entries' state_dict() calls
            upload = dcp.async_save(
                state, storage_writer=writer, planner=planner, process_group=self.group, async_stager=self.stager
            )

        def complete() -> None:
            lower_thread_priority()
            upload.result()
            if then is not None:
                then()

        self.pending = self.executor.submit(complete)
        return self.pending
