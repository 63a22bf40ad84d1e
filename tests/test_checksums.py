"""hf3d/checkpoint/checksums.py: the marker's CRC-32s equal zlib's over the same bytes, whole files, ranges at odd
offsets, and files checksummed block by block while they are written."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from hf3d.checkpoint import checksums


@pytest.fixture()
def data():
    return os.urandom(3 * 4096 + 123)


def test_whole_file_and_ranges(tmp_path, data, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert checksums.crc32_file(path) == zlib.crc32(data)
    monkeypatch.setattr(checksums, "WINDOW", 4096)  # several mappings per range, none page-aligned at its start
    for start, stop in [(0, len(data)), (1, 4097), (4095, 9000), (5000, len(data)), (7, 7)]:
        assert checksums.crc32_range(path, start, stop, 99) == zlib.crc32(data[start:stop], 99), (start, stop)
    assert checksums.crc32_file(tmp_path / "f.bin") == zlib.crc32(data)


def test_running_file_follows_the_writer(tmp_path, data, monkeypatch):
    monkeypatch.setattr(checksums, "BLOCK", 1000)  # blocks that start and end off the page boundaries
    out = checksums.RunningFile(tmp_path / "g.bin")
    for i in range(0, len(data), 700):
        out.f.write(data[i : i + 700])
        out.add()
    got = out.finish().result()
    assert got == {"size": len(data), "crc32": zlib.crc32(data)}
    assert out.f.closed and (tmp_path / "g.bin").read_bytes() == data


def test_a_skipped_block_changes_the_sum(tmp_path, data, monkeypatch):
    """Mutation: a writer that does not hand a block over before writing on gets a sum that differs."""
    monkeypatch.setattr(checksums, "BLOCK", 1000)
    out = checksums.RunningFile(tmp_path / "h.bin")
    out.f.write(data[:2000])
    out.add()
    out._handed += 10  # ten bytes never checksummed
    out.f.write(data[2000:])
    got = out.finish().result()
    assert got["crc32"] != zlib.crc32(data)


def test_direct_file_writes_and_sums_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "DIRECT_BUFFER", 2 * 4096)  # several hand-overs, a partial last buffer
    data = os.urandom(5 * 4096 + 1234)
    out = checksums.open_checksummed(tmp_path / "d.bin", direct=True)
    assert isinstance(out, checksums.DirectFile)
    for i in range(0, len(data), 3000):
        assert out.write(memoryview(data[i : i + 3000])) == len(data[i : i + 3000])
        out.flush()
    assert out.tell() == len(data)
    assert out.finish().result() == {"size": len(data), "crc32": zlib.crc32(data)}
    assert (tmp_path / "d.bin").read_bytes() == data  # cut back to its length after the padded last write


def test_a_large_write_in_phase_goes_to_disk_from_its_memory(tmp_path, monkeypatch, direct_writes_from_memory):
    """A large write whose bytes lie at the file position's offset in a page skips the buffers (its whole
    pages are written from the caller's memory); one out of phase is copied. The file and its CRC-32 are the
    same bytes either way."""
    monkeypatch.setattr(checksums, "DIRECT_BUFFER", 4 * 4096)
    monkeypatch.setattr(checksums.DirectFile, "from_memory", 2 * 4096)
    from_memory = direct_writes_from_memory
    memory = np.frombuffer(os.urandom(11 * 4096), np.uint8)[123:]  # starts 123 bytes into a page, or past it
    out = checksums.open_checksummed(tmp_path / "m.bin", direct=True)
    out.write(bytes(range(200)))
    out.write(bytes(out.phase_padding(memory.ctypes.data)))  # the buffer is partly filled
    head = bytes(range(200)) + bytes(out.tell() - 200)
    out.write(memory)  # in phase: from memory
    out.write(memory[1:])  # one byte out of phase: copied
    data = head + memory.tobytes() + memory[1:].tobytes()
    assert out.finish().result() == {"size": len(data), "crc32": zlib.crc32(data)}
    assert (tmp_path / "m.bin").read_bytes() == data
    pages = (len(memory) - (-memory.ctypes.data % 4096)) // 4096 * 4096
    assert from_memory == [pages]


def test_direct_file_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    def refuse(self, path, **kwargs):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(checksums.DirectFile, "__init__", refuse)
    out = checksums.open_checksummed(tmp_path / "e.bin", direct=True)
    assert isinstance(out, checksums.RunningFile)
    out.write(b"abc")
    assert out.finish().result() == {"size": 3, "crc32": zlib.crc32(b"abc")}


def test_an_earlier_direct_write_error_reaches_finish_and_abandon_closes_the_file(tmp_path, monkeypatch):
    """A buffer whose write fails in the thread: the next hand-over (here finish) raises its error, and
    abandon() (what the writer calls then) closes the descriptor."""
    monkeypatch.setattr(checksums, "DIRECT_BUFFER", 4096)

    def disk_full(self, i, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checksums.DirectFile, "_write_buffer", disk_full)
    out = checksums.open_checksummed(tmp_path / "full.bin", direct=True)
    out.write(os.urandom(4096 + 100))  # one full buffer handed over, its write fails
    with pytest.raises(OSError, match="No space left"):
        out.finish()
    out.abandon()
    with pytest.raises(OSError):
        os.fstat(out.fd)


@pytest.fixture()
def dcp_logger():
    """DCP's logger as torch sets it up (level DEBUG, NullHandlers only), whatever ran before and whatever the
    test runner attached for the test's call (pytest 9.2 adds its capture handler to loggers that do not
    propagate, like this one); put back after."""
    import logging

    from torch.distributed.checkpoint import logger as dcp_logger_module

    logger = dcp_logger_module._dcp_logger
    level, handlers = logger.level, list(logger.handlers)

    def as_torch_sets_it_up():
        logger.setLevel(logging.DEBUG)
        logger.handlers = [logging.NullHandler()]
        return logger

    try:
        yield as_torch_sets_it_up
    finally:
        logger.setLevel(level)
        logger.handlers = handlers


def test_dcp_debug_records_are_off_only_while_nothing_would_hear_them(dcp_logger):
    """hf3d's DCP calls raise DCP's logger to INFO while its only handlers are NullHandlers, and put it back;
    a logger someone gave a handler keeps its level and gets its records."""
    import logging

    from hf3d.checkpoint.writer import dcp_debug_records_off

    logger = dcp_logger()
    with dcp_debug_records_off():
        assert not logger.isEnabledFor(logging.DEBUG)
        assert logger.isEnabledFor(logging.WARNING)
    assert logger.level == logging.DEBUG
    heard = []
    handler = logging.Handler()
    handler.emit = heard.append
    logger.addHandler(handler)
    try:
        with dcp_debug_records_off():
            logger.debug("kept")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in heard] == ["kept"]


def test_the_dcp_logger_switch_ends_as_it_began_when_threads_overlap(dcp_logger):
    """An async save's writer thread and the training thread wear the same switch of DCP's (process-wide)
    logger: whichever leaves first, the level stays raised until the last one leaves, then is what it was."""
    import logging
    import threading

    from hf3d.checkpoint.writer import dcp_debug_records_off

    logger = dcp_logger()
    entered, release = threading.Event(), threading.Event()

    def other():
        with dcp_debug_records_off():
            entered.set()
            release.wait()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        entered.wait()
        with dcp_debug_records_off():  # enters second, leaves first
            assert logger.level == logging.INFO
            release.set()
            thread.join()
            assert logger.level == logging.INFO  # the other thread left; this one is still inside
        assert logger.level == logging.DEBUG
    finally:
        release.set()
