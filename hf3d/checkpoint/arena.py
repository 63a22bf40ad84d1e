"""The host memory an async save copies the state into, and the copy.

`Arena`: one block for every box a rank writes, each box at a page boundary. It is a memfd (Linux), so the
writer process maps the same pages from the handle it is sent: a memfd is not a file under /dev/shm, whose
size a container often caps at 64 MiB. On a GPU the block is pinned (cudaHostRegister), so device-to-host
copies into it run asynchronously. Where there is no memfd, the block is private and the writing stays in
the training process (`Arena.shareable`).

`BoxStager` copies exactly the boxes a save writes into the arena, in a thread of its own, on a stream of its
own on a GPU. DCP's DefaultStager copies whole storages: at dp=2 under ZeRO-1 a rank's parameter shard is a
view of the whole flat buffer, so it copied 432 MiB per rank for 324 MiB written. The arena is kept from one
save to the next, and made anew only when the boxes change: pinning GiBs takes seconds, which the first
save paid for on an H200 (a 14-15 s stall) until `prepare_async_save` made it before.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from .checksums import PAGE


def lower_thread_priority() -> None:
    """Give the calling (background) thread the lowest CPU priority, where the OS allows it per thread
    (Linux: a thread id is a PRIO_PROCESS target). Elsewhere, or when refused, it keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class Arena:
    """`nbytes` of host memory, zeroed: a memfd's pages where the system has memfds (`fd`, which the writer
    process maps), else private pages; pinned when `pin` (a GPU's staging) and CUDA agrees."""

    def __init__(self, nbytes: int, *, pin: bool):
        size = max(nbytes, PAGE)  # a map may not be empty (a rank that writes nothing)
        self.fd: int | None = None
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("hf3d-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        else:
            self.map = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = pin and _register(self.tensor)
        if not self.pinned:
            self.tensor.zero_()  # the pages exist before the first copy needs them (registering made them)

    @property
    def shareable(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Unpin and close the handle; the pages go once nothing maps them (the old views may still)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _register(t: torch.Tensor) -> bool:
    """Pin `t`'s pages for CUDA; False where CUDA refuses (the copies are then synchronous, and correct)."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 1)) == 0  # 1: portable
    except (RuntimeError, AttributeError):
        return False


class BoxStager:
    """Stages a state dict of hf3d's checkpoint entries (each with `copied(into)`: the same entry over copies of
    its boxes) in a thread of its own, into the arena; returns the future of the staged dict. On a GPU the
    copies go on a stream of their own, after the work already queued on the current stream (the last update of
    the parameters)."""

    def __init__(self):
        self.on_gpu = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.on_gpu else None
        self.arena: Arena | None = None
        self.places: dict[tuple, tuple[int, torch.Size, torch.dtype]] = {}  # (key, offsets): (start, shape, dtype)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf3d-staging")

    def reserve(self, state_dict: dict) -> None:
        """Make the arena for the boxes of `state_dict`, unless the one there fits them already."""
        places, end = {}, 0
        for key, entry in state_dict.items():
            for offsets, box in entry.boxes.items():
                places[(key, offsets)] = (end, box.shape, entry.dtype)
                end += -(-box.numel() * entry.dtype.itemsize // PAGE) * PAGE
        if self.arena is not None and places == self.places:
            return
        if self.arena is not None:
            self.arena.release()
        self.arena, self.places = Arena(end, pin=self.on_gpu), places

    def staged(self, state_dict: dict) -> dict:
        """The entries of `state_dict` over their places in the arena (reserved for them)."""

        def into(key: str, offsets, box: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            start, shape, _ = self.places[(key, offsets)]
            nbytes = shape.numel() * dtype.itemsize
            return self.arena.tensor[start : start + nbytes].view(dtype).view(shape)

        return {key: entry.copied(lambda *a, key=key: into(key, *a)) for key, entry in state_dict.items()}

    def stage(self, entries: Callable[[], dict]) -> Future:
        """Copy the state dict `entries()` makes (in the staging thread, from the state as it is now)."""
        queued = None
        if self.on_gpu:
            queued = torch.cuda.Event()
            queued.record()
        return self.executor.submit(self._copy, entries, queued)

    def _copy(self, entries: Callable[[], dict], queued) -> dict:
        lower_thread_priority()
        state_dict = entries()
        self.reserve(state_dict)  # new boxes (another mesh's, the optimizer's first state): a new arena
        staged = self.staged(state_dict)
        dst = [t for entry in staged.values() for t in entry.boxes.values()]
        src = [t for entry in state_dict.values() for t in entry.boxes.values()]
        with torch.no_grad(), torch.cuda.stream(self.stream) if self.on_gpu else nullcontext():
            if queued is not None:
                self.stream.wait_event(queued)
            # one call for every box: the GIL is let go for all of the copies, not taken back between them
            if dst:  # a rank may write nothing (a save without an optimizer, at dp > 1), and take part all the same
                torch._foreach_copy_(dst, src, non_blocking=self.on_gpu)
            if self.on_gpu:
                self.stream.synchronize()
        return staged
