"""The DCP storage writer of hf3d's checkpoints (training saves, async saves and `convert from-hf`).

DCP's own FileSystemWriter (torch 2.13) computes a CRC-32 of every record inside torch.save (which
torch.load never checks), fsyncs the file only once it is whole, and leaves the marker's CRC-32 to a
second pass that reads every file back. `OneFileWriter` writes a rank's items into one file in the
plan's order, in the layout DCP stores them (each item torch.saved, or its bytes, at an offset the
metadata records: DCP's reader and hf3d's read it), with:
- no record CRC: the marker's CRC-32 covers the file;
- the file's CRC-32 computed in a thread from the page cache while the next items are written, and each
  written block handed to the disk at once (`checksums.RunningFile`), so the fsync at the end finds most
  of the file on disk;
- each item released before the next is asked for (the planner may make it on demand);
- with `direct` (training checkpoints, sync and async), the file is written with O_DIRECT from two
  page-aligned buffers (`checksums.DirectFile`): no page cache to allocate and fill (a tensor of 1 MiB or
  more is placed so that DirectFile writes it from its own memory, without a copy: `_save_tensor`). Measured
  at pp=2 (8 layers, 324 MiB per rank, this VM): the buffered write took 1.3-3.4 CPU seconds of kernel time on the
  rank whose step leaves a core idle (0.1-0.7 on the other), and a synchronous save blocked 2.1-5.5 s;
  with O_DIRECT, 0.03 CPU s of kernel time and 1.0-1.2 s. from-hf keeps the buffered write: its output
  is read again soon (to-hf, the first load), and there it was faster (1.9x vs 2.2x a raw copy);
- a tensor of a layout (dtype, shape, ...) torch.saved before written as the bytes torch.save wrote then,
  around its own storage's (`_SavedBytes`): no pickling per item;
- with `sync=False` (from-hf), no fsync: the file is left to the page cache, as save_pretrained leaves
  its files;
- every write of a save whose items were all replayed so recorded (`program`), so that the model's next async
  save, if nothing moved, writes them again without DCP (`replay`). Measured at dp=2 (8 layers, 324 MiB per
  rank, async saves with nothing beside them): 55-58 ms of CPU per save and rank instead of 86-94, of which
  DCP's planning, pickling and collectives and the per-item Python were about 30 ms.
`file_table()` waits for the fsync (if any) and gives {file name: {"size", "crc32"}}, as the marker
records it.

`dcp_debug_records_off()` is worn around hf3d's calls into DCP (see there).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.utils.serialization import config as serialization_config

from .checksums import PAGE, DirectFile, open_checksummed

ALIGN = 64  # each item ends padded to this boundary (one written from memory then starts at its storage's
# offset in a page: its data lies in a mapping of the file as aligned as in the memory it came from)


class OneFileWriter(FileSystemWriter):
    """A FileSystemWriter for one save: one file per rank, checksummed as it is written (see the module)."""

    def __init__(self, path: str | Path, *, direct: bool = False, sync: bool = True, record: bool = False):
        super().__init__(path, single_file_per_rank=True, sync_files=sync)
        self.direct = direct  # `sync` is FileSystemWriter's sync_files
        self.record = record  # keep `program` (an async save's, for the model's next one)
        self._written: dict[str, Future] = {}  # file name: its {"size", "crc32"} once on disk
        self.read: Future = Future()
        """Done once write_data has read every item (they are in the file or its buffers), or failed."""

    program: tuple[str, list] | None = None
    """After write_data, when every item's record was replayed (`_SavedBytes`): the file's name and every
    write into it, in order (bytes copied, consecutive ones merged; a storage's memory by reference), which
    `replay` writes again."""
    finished: tuple | None = None  # on the coordinator: what DCP's finish got (metadata, every rank's results)
    failure: BaseException | None = None  # a replay's error, raised by file_table

    def write_data(self, plan, planner):
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        out = self._open(Path(self.path) / name)
        out = _Tape(out) if self.record else out
        results, recorded, replayed = [], _SAVED.recorded, _SAVED.replayed
        try:
            with _without_record_crc():
                for item in plan.items:
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        start = out.tell()
                        out.write(data.getbuffer())
                    else:
                        start = _save_tensor(data, out)
                    del data
                    length = out.tell() - start
                    info = _StorageInfo(name, start, length)
                    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
                    out.write(bytes(-out.tell() % ALIGN))
                    out.add()
            self._written[name] = out.finish()
            if self.record and out.pieces is not None and _SAVED.replayed - replayed == len(plan.items):
                self.program = (name, out.pieces) if _SAVED.recorded == recorded else None
        except BaseException:
            out.abandon()
            raise
        finally:
            self.read.set_result(None)
        done = torch.futures.Future()
        done.set_result(results)
        return done

    def _open(self, path: Path):
        return open_checksummed(path, direct=self.direct, sync=self.sync_files)

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.finished = (metadata, results)

    def replay(self, program: tuple[str, list], finished: tuple | None) -> None:
        """Write this rank's file as `program` recorded it, reading each storage's memory now, in this thread
        (and, with `finished`, DCP's metadata file, as DCP's finish writes it). A save whose entries, and
        every box's place in memory, equal those of the save `program` came from writes the same bytes as
        write_data would, without DCP's planning, pickling and collectives."""
        name, pieces = program
        try:
            out = open_checksummed(Path(self.path) / name, direct=self.direct, sync=self.sync_files, inline=True)
            try:
                for piece in pieces:
                    out.write(piece)
                self._written[name] = out.finish()
            except BaseException:
                out.abandon()
                raise
        finally:
            self.read.set_result(None)
        if finished is not None:
            metadata, results = finished
            self.reset()  # a save id of its own
            super().finish(copy.copy(metadata), results)

    def file_table(self) -> dict[str, dict[str, int]]:
        """{name: {"size", "crc32"}} of the files this rank wrote, once they are on disk (raises the write's
        error, if its fsync failed)."""
        if self.failure is not None:
            raise self.failure
        return {name: written.result() for name, written in self._written.items()}


class Rehearsal(OneFileWriter):
    """A save that writes nothing: DCP plans it over the entries given (every rank, collectively), and this
    rank's `program` and, on the coordinator, `finished` come out as a real save's would, for `replay` to write
    into any folder later. No folder is made or read. An entry whose torch.save layout was never seen in this
    process is recorded, not replayed: the program is then None, and a second rehearsal gives it."""

    def __init__(self):
        super().__init__("rehearsal", direct=True, record=True)  # the path is never touched

    def _open(self, path: Path):
        return _Counter()

    def prepare_local_plan(self, plan):
        return plan  # FileSystemWriter's makes the folder and looks for a checkpoint in it

    def finish(self, metadata, results) -> None:
        self.finished = (metadata, results)


class _Counter:
    """What a DirectFile's writer sees of it (its position, the padding that puts a large write in phase with
    its pages), with nothing written: a rehearsal's file."""

    from_memory = DirectFile.from_memory
    phase_padding = DirectFile.phase_padding

    def __init__(self):
        self._pos = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def add(self) -> None:
        pass

    def finish(self) -> Future:
        done: Future = Future()
        done.set_result({"size": self._pos, "crc32": 0})
        return done

    def abandon(self) -> None:
        pass


def _save_tensor(t: torch.Tensor, out) -> int:
    """torch.save `t` into `out`; returns where the item starts. Into a DirectFile, a storage of `from_memory`
    bytes or more goes to the disk from its own memory: the item starts at the storage's offset in its page,
    and torch.save puts each record on a page boundary of the item (storage_alignment), so the storage's
    bytes reach DirectFile.write in phase with the file. That costs up to a page of padding per record
    (5 records) and before the item: 2 MiB in a 324 MiB file of 8 layers of SmolLM2-135M. (torch's
    storage_alignment is process-wide: a torch.save elsewhere meanwhile pads its records too.)"""
    storage = t.untyped_storage()
    direct = hasattr(getattr(out, "out", out), "phase_padding")  # a DirectFile (or a rehearsal's); maybe taped
    if not direct or storage.device.type != "cpu" or storage.nbytes() < out.from_memory:
        start = out.tell()
        _SAVED.save(t, out)
        return start
    out.write(bytes(out.phase_padding(storage.data_ptr())))
    start = out.tell()
    with serialization_config.patch({"save.storage_alignment": PAGE}):
        _SAVED.save(t, out)
    return start


class _Tape:
    """`out`, recording every write (`pieces`): bytes as copies (consecutive ones merged), a storage's memory
    (the numpy array `_storage_bytes` gives) by reference. Bytes of more than `small` in one write are a
    storage torch.save wrote itself (a layout recorded): the save cannot be replayed, and the tape stops
    (`pieces` None) rather than keep a copy of them."""

    small = 1 << 16

    def __init__(self, out):
        self.out, self.pieces = out, []

    def __getattr__(self, name):
        return getattr(self.out, name)

    def write(self, data) -> int:
        if self.pieces is None:
            pass
        elif not isinstance(data, np.ndarray) and memoryview(data).nbytes > self.small:
            self.pieces = None
        elif isinstance(data, np.ndarray):
            self.pieces.append(data)
        elif self.pieces and isinstance(self.pieces[-1], bytearray):
            self.pieces[-1] += memoryview(data).cast("B")
        else:
            self.pieces.append(bytearray(memoryview(data).cast("B")))
        return self.out.write(data)


class _SavedBytes:
    """torch.save of a plain tensor alone on its storage, replayed: with the record CRC off, every byte torch.save
    writes but the storage's own depends only on the tensor's layout (dtype, shape, strides, storage size,
    requires_grad) and torch's save settings. The first torch.save of each layout is recorded as the bytes
    before and after the storage's; the next tensor of that layout is written as those bytes around its
    storage: 3 writes instead of about 40, and no pickling. Measured at dp=2 (8 layers of SmolLM2-135M, 129
    items per rank and save, async): the writer's torch.save calls took 0.083-0.096 CPU s per save and rank,
    the replays 0.034-0.036 (tests/test_checkpoint.py checks the replayed bytes against torch.save's own)."""

    limit = 4096  # layouts kept (a few dozen per model); past this the table starts again

    def __init__(self):
        self.table: dict[tuple, tuple[bytes, bytes]] = {}
        self.recorded = self.replayed = 0

    def save(self, t: torch.Tensor, out) -> None:
        key = _layout(t)
        if key is None:
            torch.save(t, out)
            return
        saved = self.table.get(key)
        if saved is None:
            self._record(t, out, key)
            return
        head, tail = saved
        self.replayed += 1
        out.write(head)
        out.write(_storage_bytes(t.untyped_storage()))
        out.write(tail)

    def _record(self, t: torch.Tensor, out, key: tuple) -> None:
        self.recorded += 1
        recording = _Recording(out, t.untyped_storage())
        torch.save(t, recording)
        if len(recording.parts) != 2:
            return
        if len(self.table) >= self.limit:
            self.table.clear()
        self.table[key] = (bytes(recording.parts[0]), bytes(recording.parts[1]))


def _layout(t: torch.Tensor) -> tuple | None:
    """What torch.save writes of `t` besides its storage's bytes; None where that is more than its layout (a
    subclass, Python attributes, a sparse, quantized or conjugate tensor, another device) or where the record
    CRC (which covers the storage's bytes) is on."""
    plain = type(t) is torch.Tensor and not t.__dict__ and t.layout == torch.strided and t.device.type == "cpu"
    if not plain or t.is_quantized or t.is_conj() or t.is_neg() or torch.serialization.get_crc32_options():
        return None
    storage = t.untyped_storage()
    alignment = serialization_config.save.storage_alignment
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), storage.nbytes(), t.requires_grad, alignment)


def _storage_bytes(storage: torch.UntypedStorage):
    """The storage's bytes as a buffer over its memory (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


class _Recording:
    """A file for torch.save that passes every write on to `out` and keeps the bytes written before and after
    the one write from `storage`'s memory (`parts` has two items when there was exactly one such write: a
    storage torch.save copied, or wrote in pieces, is not replayed)."""

    def __init__(self, out, storage: torch.UntypedStorage):
        self.out, self.storage = out, (storage.data_ptr(), storage.nbytes())
        self.parts: list[bytearray] = [bytearray()]

    def write(self, data) -> int:
        n = self.out.write(data)
        view = memoryview(data).cast("B")
        if len(view) == self.storage[1] > 0 and np.frombuffer(view, np.uint8).ctypes.data == self.storage[0]:
            self.parts.append(bytearray())
        else:
            self.parts[-1] += view
        return n

    def flush(self) -> None:
        self.out.flush()


_SAVED = _SavedBytes()


class _ProcessWide:
    """A process-wide setting changed for the length of a `with`, from any thread (an async save's writer runs
    beside the training thread's saves and loads): the first to enter applies the change, the last to leave
    undoes it, so the setting never ends up as a thread that left early found it."""

    def __init__(self, apply: Callable[[], Callable[[], None] | None]):
        self._apply = apply  # changes the setting; returns what undoes it, or None when it changed nothing
        self._lock = threading.Lock()
        self._depth = 0
        self._undo: Callable[[], None] | None = None

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._depth == 0:
                self._undo = self._apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._undo is not None:
                    self._undo()
                    self._undo = None


@contextlib.contextmanager
def _without_record_crc():
    """torch.save computes a CRC-32 of every record it writes; torch.load does not check it. (torch's
    serialization config is per thread: another thread's torch.save keeps its record CRCs.)"""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _dcp_debug_off() -> Callable[[], None] | None:
    from torch.distributed.checkpoint import logger as dcp_logger_module

    logger = getattr(dcp_logger_module, "_dcp_logger", None)
    unheard = (
        isinstance(logger, logging.Logger)
        and logger.level < logging.INFO
        and all(isinstance(h, logging.NullHandler) for h in logger.handlers)
    )
    if not unheard:
        return None
    before = logger.level
    logger.setLevel(logging.INFO)
    return lambda: logger.setLevel(before)


dcp_debug_records_off = _ProcessWide(_dcp_debug_off)
"""DCP (torch 2.13) wraps its steps, and the state_dict() of every top-level entry of a saved dict, in a
logger that makes two DEBUG records per call for a NullHandler: 2 x 272 records, 15 ms of a 250 ms
from-hf here. While nothing but NullHandlers would receive them, the logger's level is raised to INFO for
the call (warnings and errors still pass); a logger someone gave a handler is left alone."""
