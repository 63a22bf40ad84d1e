"""The CRC-32s the checkpoint marker records, and the disk writes of the files they cover.

- `crc32_file(path)` checksums a whole file over mappings of its pages (no copy into a buffer); `crc32_open` the
  same of a file already open (a checkpoint's, opened by `untrusted.open_in`).
- `RunningFile` checksums a file while it is being written: the writer hands over each written block
  (`add`); a background thread starts that block's disk write (Linux's sync_file_range, so the fsync at the
  end finds most of the file on disk) and folds it into the CRC-32 from the page cache. `finish()` fsyncs
  and closes the file in that thread, and its future gives the file's {"size", "crc32"}. Unsynced
  (`sync=False`, `convert from-hf`), it only checksums and closes.

`DirectFile` does the same with O_DIRECT (training checkpoints): the bytes gather in page-aligned buffers
that a thread checksums and writes, so the kernel neither allocates page cache for the file nor copies
into it. A large write whose bytes lie at the same offset in their page as the file's position goes to
the disk from the caller's memory, past the buffers (`phase_padding` says how far to pad for that).
Where the file system refuses O_DIRECT, `open_checksummed` falls back to RunningFile.

Both are `_CheckedFile`s: write / tell / flush as a file, `add()` after each item, `finish()` once.

The CRC-32 is ISA-L's (the isal package) where it imports: zlib's values at 3.2x its speed here (8.6 vs
2.6 GB/s on one core), with the GIL released, as zlib's is.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..utils import files

try:
    from isal.isal_zlib import crc32 as _crc32_update
except ImportError:  # a platform without an isal wheel: the same values, slower
    _crc32_update = zlib.crc32

WINDOW = 1 << 24  # the most of a file mapped at once while it is checksummed
BLOCK = 32 << 20  # RunningFile hands each block of this many written bytes to its thread


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; do not wait


def start_writeback(fd: int, start: int, stop: int) -> None:
    """Start the disk write of bytes [start, stop) of `fd` without waiting for it (a no-op but on Linux)."""
    if _SYNC_FILE_RANGE is not None and stop > start:
        _SYNC_FILE_RANGE(fd, start, stop - start, _SYNC_FILE_RANGE_WRITE)


def crc32_open(f, start: int, stop: int, crc: int = 0) -> int:
    """`crc` extended over bytes [start, stop) of the open file `f`, read through mappings of at most WINDOW bytes."""
    pos = start
    while pos < stop:
        first = pos - pos % mmap.ALLOCATIONGRANULARITY
        length = min(stop, first + WINDOW) - first
        with mmap.mmap(f.fileno(), length, offset=first, access=mmap.ACCESS_READ) as pages:
            with memoryview(pages) as view:
                crc = _crc32_update(view[pos - first :], crc)
        pos = first + length
    return crc


def crc32_range(path: Path, start: int, stop: int, crc: int = 0) -> int:
    """`crc` extended over bytes [start, stop) of a file hf3d is writing or just wrote (never read through a link;
    a checkpoint's files are checked through `untrusted.open_in` and `crc32_open`)."""
    with files.open_read(path) as f:
        return crc32_open(f, start, stop, crc)


def crc32_file(path: Path) -> int:
    """CRC-32 of a whole file (never read through a link)."""
    return crc32_range(path, 0, os.lstat(path).st_size)


class _Inline:
    """An executor that runs each task at once, in the caller's thread (a file written by a thread that has
    nothing else to do: each hand-over to a second thread would wait for that thread to get a core)."""

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)
        return done

    def shutdown(self, wait: bool = True) -> None:
        pass


class _CheckedFile:
    """A file being written whose CRC-32 and disk write follow the writer, in one background thread.

    The caller writes through write / tell (flush as torch.save asks), calls `add()` after each item and
    `finish()` once, after its last write; `abandon()` instead after a failed write. Subclasses hand the
    written bytes over (`_hand_rest`) and end the file in the thread (`_sync_and_close`)."""

    def __init__(self, path: Path, thread_name: str, *, inline: bool = False):
        self.path = Path(path)
        self._pool = _Inline() if inline else ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._crc = 0

    def add(self) -> None:
        pass

    def finish(self) -> Future:
        """Hand over the rest, then fsync and close the file in the thread; the future's result is
        {"size", "crc32"} once the file is on disk (or the write's error). An earlier block's write error
        may be raised here instead."""
        self._hand_rest()
        done = self._pool.submit(self._sync_and_close)
        self._pool.shutdown(wait=False)
        return done

    def abandon(self) -> None:
        """After a failed write (or finish): wait for the thread and close the file."""
        self._pool.shutdown(wait=True)
        self._close()

    def _hand_rest(self) -> None:
        raise NotImplementedError

    def _sync_and_close(self) -> dict[str, int]:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class RunningFile(_CheckedFile):
    """Buffered writes; a thread starts each block's disk write and checksums it from the page cache.
    With `sync=False` the file is left to the page cache: no block's write is started and finish does
    not fsync (the CRC-32 is the same)."""

    def __init__(self, path: Path, *, sync: bool = True):
        super().__init__(path, "hf3d-crc")
        self.f = open(self.path, "xb")  # noqa: SIM115 (closed by finish's task in the thread); new, no link followed
        self.sync = sync
        self._handed = 0  # bytes handed to the thread so far

    def write(self, data) -> int:
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def add(self) -> None:
        if self.f.tell() - self._handed >= BLOCK:
            self._hand_rest()

    def _hand_rest(self) -> None:
        pos = self.f.tell()
        self.f.flush()
        self._pool.submit(self._block, self._handed, pos)
        self._handed = pos

    def _block(self, start: int, stop: int) -> None:
        if self.sync:
            start_writeback(self.f.fileno(), start, stop)
        self._crc = crc32_range(self.path, start, stop, self._crc)

    def _close(self) -> None:
        self.f.close()

    def _sync_and_close(self) -> dict[str, int]:
        try:
            if self.sync:
                os.fsync(self.f.fileno())
        finally:
            self.f.close()
        return {"size": self._handed, "crc32": self._crc}


PAGE = 4096  # O_DIRECT's alignment of buffers, offsets and lengths (a page; block devices ask <= this)
DIRECT_BUFFER = 8 << 20  # each of DirectFile's two buffers
SMALL_WRITE = 1 << 12  # DirectFile copies a write of at most this many bytes with the mmap, not numpy


class DirectFile(_CheckedFile):
    """O_DIRECT writes from two page-aligned buffers: the writer fills one while the thread checksums and
    writes the other. Bytes leave a buffer when it is full, at finish, or before a write from memory, so
    flush does nothing.

    The bytes are copied into a buffer by numpy, which lets go of the GIL for the copy (a slice assignment
    into the mmap keeps it): an asynchronous save writes from a background thread, and the training step
    beside it needs the GIL between its ops. Writes of at most SMALL_WRITE bytes (torch.save's headers and
    pickles: about 5,000 per save of 130 items) are copied by the mmap: numpy's set-up costs more than they do.

    A write of at least `from_memory` bytes that lie at the file position's offset in a page (the caller pads
    the file for that: `phase_padding`) is not copied: its first bytes fill the buffer up to a page
    boundary, the buffer is handed over, and the whole pages that follow are checksummed and written from
    the caller's memory (the call returns once they are on disk: the caller may free them then). Measured
    at dp=2 (8 layers of SmolLM2-135M, 324 MiB per rank, an async save with nothing beside it): the copy into
    the buffers took 0.10-0.12 of the 0.26-0.34 CPU s a save cost each rank; without it, 0.22-0.27."""

    from_memory = 1 << 20  # a write of at least this many bytes, in phase with the file, skips the buffers

    def __init__(self, path: Path, *, inline: bool = False):
        super().__init__(path, "hf3d-direct", inline=inline)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT  # a new file
        self.fd = os.open(self.path, flags, 0o644)
        self._bufs = [mmap.mmap(-1, DIRECT_BUFFER) for _ in range(2)]  # anonymous maps: page-aligned
        self._arrays = [np.frombuffer(buf, np.uint8) for buf in self._bufs]  # released before the maps close
        self._cur, self._fill, self._pos = 0, 0, 0
        self._in_flight: Future | None = None

    def phase_padding(self, address: int) -> int:
        """The zero bytes to write so that the file position lies at `address`'s offset in its page."""
        return (address - self._pos) % PAGE

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        n = len(data)
        if n <= SMALL_WRITE and self._fill + n < DIRECT_BUFFER:  # most of torch.save's writes: headers, pickles
            self._bufs[self._cur][self._fill : self._fill + n] = data
            self._fill += n
            self._pos += n
            return n
        view = np.frombuffer(data, np.uint8)
        if n >= self.from_memory and self.phase_padding(view.ctypes.data) == 0:
            return self._write_from_memory(view)
        return self._copy(view)

    def _write_from_memory(self, view: np.ndarray) -> int:
        head = -self._pos % PAGE
        pages = (len(view) - head) // PAGE * PAGE
        self._copy(view[:head])
        if self._fill:
            self._hand_rest()  # ends on a page boundary: the buffers always start on one
        self._in_flight = self._pool.submit(self._write_view, view[head : head + pages])
        self._in_flight.result()  # the bytes are the caller's: on disk before it may change or free them
        self._pos += pages
        self._copy(view[head + pages :])
        return len(view)

    def _copy(self, view: np.ndarray) -> int:
        done = 0
        while done < len(view):
            take = min(len(view) - done, DIRECT_BUFFER - self._fill)
            self._arrays[self._cur][self._fill : self._fill + take] = view[done : done + take]
            self._fill += take
            done += take
            if self._fill == DIRECT_BUFFER:
                self._hand_rest()
        self._pos += len(view)
        return len(view)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def _hand_rest(self) -> None:
        if self._in_flight is not None:
            self._in_flight.result()  # the other buffer is free again (or its write's error is raised)
        self._in_flight = self._pool.submit(self._write_buffer, self._cur, self._fill)
        self._cur, self._fill = 1 - self._cur, 0

    def _write_buffer(self, i: int, length: int) -> None:
        buf = self._bufs[i]
        with memoryview(buf) as view:
            self._crc = _crc32_update(view[:length], self._crc)
            padded = -(-length // PAGE) * PAGE  # the last buffer's tail: cut by finish
            view[length:padded] = bytes(padded - length)
            self._write_all(view[:padded])

    def _write_view(self, view: np.ndarray) -> None:
        self._crc = _crc32_update(view, self._crc)
        self._write_all(memoryview(view))

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.write(self.fd, view[done:])

    def _close(self) -> None:
        os.close(self.fd)

    def _sync_and_close(self) -> dict[str, int]:
        try:
            self._in_flight.result()
            os.ftruncate(self.fd, self._pos)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self._arrays = None  # a map with a view of it open cannot close
            for buf in self._bufs:
                buf.close()
        return {"size": self._pos, "crc32": self._crc}


def open_checksummed(path: Path, *, direct: bool, sync: bool = True, inline: bool = False) -> _CheckedFile:
    """A DirectFile where asked for and the file system takes O_DIRECT (Linux), else a RunningFile (left
    unsynced with `sync=False`; a DirectFile always syncs). `inline`: a DirectFile checksums and writes in
    the caller's thread."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return DirectFile(path, inline=inline)
        except OSError as e:  # a file system without O_DIRECT (EINVAL), which may have created the file
            if e.errno == errno.EEXIST:
                raise
            if os.path.lexists(path):
                files.remove_file(path)
    return RunningFile(path, sync=sync)
