"""The process that writes an async save's data file, beside the training process.

A save that copies (on a GPU, and any save without an optimizer) stages its boxes into the arena (a memfd the
child maps from the handle it is sent) and is planned once: a `Rehearsal` gives the rank's writes as a program
of bytes and arena ranges, and the coordinator's DCP metadata. For each save the parent sends only the folder;
the child writes the file as `OneFileWriter.replay` does (O_DIRECT, checksummed as it goes, fsynced), rank 0's
DCP metadata too, and answers the file's size and CRC-32. Nothing of the write (its Python, its checksum, its
system calls) takes the training process's GIL or its threads.

The child is started with `python -I -c` (not multiprocessing's spawn, which runs the user's script again unless
it is guarded by `if __name__ == "__main__"`): isolated, so only the interpreter's own packages and hf3d's, from
the parent's package folder, can be imported (`_CHILD_MAIN`). It runs at the lowest CPU priority and ends when
its connection does: when the parent closes it, or dies. A child that dies mid-write fails that save (its message
names the exit code); the next save starts another.

DCP's own process-based checkpointer (torch 2.13) was not used: it is one process per training process, bound
to the first process group and world it saw; it sends the staged state dict, the writer and the planner
through a pipe at every save; and it answers only DCP's metadata, so the CRC-32s hf3d's marker records could
not come back.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import weakref
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from .failures import RankFailure

# The child's main. `python -I`: neither the working directory nor PYTHONPATH nor the user's site-packages is on
# its path (a numpy.py where the user launched from would run in the writer). hf3d itself is imported from the
# parent's own package folder, by location, so nothing beside that folder can be imported in its place.
_CHILD_MAIN = """import importlib.util, os, sys
package = sys.argv[1]
spec = importlib.util.spec_from_file_location(
    "hf3d", os.path.join(package, "__init__.py"), submodule_search_locations=[package])
sys.modules["hf3d"] = hf3d = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf3d)
from hf3d.checkpoint.writer_process import serve
serve(int(sys.argv[2]))
"""


class WriterProcess:
    """The parent's end: one child per BackgroundSaver, started at once (its imports run while training goes
    on)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        package = str(Path(__file__).resolve().parents[1])  # the hf3d package this module is part of
        command = [sys.executable, "-I", "-c", _CHILD_MAIN, package, str(theirs.fileno())]
        self.child = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.arena = None  # the Arena the child maps
        self.program = None  # the program (a Replay) the child holds
        self.writes = 0
        self.close = weakref.finalize(self, _shut_down, self.conn, self.child)
        """Close the connection (the child ends once it has read what was sent before) and reap the child."""

    def alive(self) -> bool:
        return self.child.poll() is None

    def write(self, folder: Path, arena, replay) -> dict[str, dict[str, int]]:
        """Write `replay`'s program (whose memory lies in `arena`) into `folder` in the child; returns the table
        of the file it wrote ({name: {"size", "crc32"}}), or raises its failure."""
        try:
            if arena is not self.arena:
                self.conn.send(("arena", len(arena.map)))
                reduction.send_handle(self.conn, arena.fd, self.child.pid)
                self.arena, self.program = arena, None
            if replay is not self.program:
                self.conn.send(("program", _as_ranges(replay.program, arena), replay.finished))
                self.program = replay
            self.conn.send(("write", os.path.abspath(folder)))
            kind, answer = self.conn.recv()
        except (OSError, EOFError):
            code = self.child.wait()
            raise RankFailure(f"the checkpoint writer process {self.child.pid} ended with exit code {code}") from None
        self.writes += 1
        if kind == "failed":
            raise RankFailure(answer)
        return answer


def _shut_down(conn: Connection, child: subprocess.Popen) -> None:
    conn.close()
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:  # mid-write of a save nobody will publish
        child.kill()
        child.wait()


def _as_ranges(program: tuple[str, list], arena) -> tuple[str, list]:
    """The program with each piece over the arena's memory as (start, length) in the arena; bytes stay."""
    name, pieces = program
    base = arena.tensor.data_ptr()
    out = []
    for piece in pieces:
        if isinstance(piece, np.ndarray):
            start = piece.ctypes.data - base
            assert 0 <= start and start + piece.nbytes <= len(arena.map), "a piece outside the arena"
            out.append((start, piece.nbytes))
        else:
            out.append(bytes(piece))
    return name, out


def _serve(conn: Connection) -> None:
    """The child: maps the arena it is sent, keeps the program, and writes it into each folder it is sent."""
    import mmap

    from .failures import failure_line
    from .writer import OneFileWriter

    arena = program = None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "arena":
            fd = reduction.recv_handle(conn)
            arena = np.frombuffer(mmap.mmap(fd, message[1]), np.uint8)
            os.close(fd)
        elif message[0] == "program":
            name, pieces = message[1]
            program = ((name, [p if isinstance(p, bytes) else arena[p[0] : p[0] + p[1]] for p in pieces]), message[2])
        else:
            try:
                writer = OneFileWriter(message[1], direct=True)
                writer.replay(*program)
                conn.send(("written", writer.file_table()))
            except Exception as e:
                conn.send(("failed", failure_line(e)))


def serve(fd: int) -> None:
    """The child's main: at the lowest CPU priority, serve the connection on `fd` until it ends."""
    try:
        os.nice(19)
    except OSError:
        pass
    _serve(Connection(fd))
