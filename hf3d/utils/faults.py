"""Failures of a multi-process run: no rank outlives its launcher, no rank waits on a dead peer, and the
error that stopped the run is printed once, with the rank's mesh coordinates and the step.

- Launcher death. torchrun starts every worker in its own session, so a launcher killed by SIGKILL
  (the OOM killer, `scancel --signal=KILL`) leaves its workers running and writing. `die_with_parent`
  asks the kernel to SIGKILL this process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`).
- A rank that raises. `fail` prints one line and leaves at once with `os._exit`: a rank that
  returned normally would wait in the process group's teardown, or in the next collective, for
  peers that are themselves waiting. Its closed sockets break the peers' pending collectives (gloo
  reports "Connection closed by peer" within milliseconds), their own `fail` runs, and the job is
  down in about a second. A peer that hangs without dying is caught by the collective timeout.
  Under nccl a dead peer is not reported: the survivors stay in their collective until torchrun kills
  them, or NCCL's watchdog ends them after the timeout (SIGABRT; `mesh.backend_environment`).
- One line, not one per rank. The first rank to fail takes a key in the job's rendezvous store and
  prints; ranks that fail after it (a broken collective, or the same ValueError raised on every rank)
  stay silent. torchrun's own summary names every rank's exit code.

- A finished run. Every rank also ends with `os._exit`, once all ranks have arrived (`leave`), under
  a launcher or in one plain process: interpreter teardown with gloo's threads up can abort
  ("terminate called without an active exception", SIGABRT) and turn a finished run's 0 into 134.

Exit codes of `hf3d train`: 0 done; 1 this rank raised (a configuration or input error, or a bug);
2 bad command line; 3 a collective failed (a peer died, or the collective timed out);
4 the run hung: no rank finished a step in run.hang_timeout seconds (hf3d/train/watchdog.py);
128 + N stopped by signal N after checkpointing (130 SIGINT, 143 SIGTERM).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import NoReturn

import torch.distributed as dist

from . import files

EXIT_ERROR = 1
EXIT_COMMUNICATION = 3
EXIT_HANG = 4
EXIT_INTERRUPTED = 128 + signal.SIGINT
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# errors a user can cause: one line, no traceback
USER_ERRORS = (ValueError, TypeError, OSError)
# what gloo and the c10d stores say when a peer is gone or late
_COMMUNICATION_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo/transport",
    "nccl",
)
REPORTED_KEY = "hf3d/failure_reported"


def started_by_launcher() -> bool:
    """True under torchrun (and `accelerate launch`, which goes through torchrun's agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent (the launcher) exits; if the parent
    is already gone, die now. Returns False (and does nothing) off Linux.

    The race: a parent that died before the prctl call has already re-parented this process (to init
    or a subreaper), so no signal would ever come; the parent pid read before the call tells."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


@dataclass
class RunState:
    """Where a rank is: the trainer sets `coords` once the mesh exists and `step` as it goes, so a
    failure can say where it happened."""

    rank: int = field(default_factory=lambda: int(os.environ.get("RANK", "0")))
    coords: dict[str, int] | None = None
    """Mesh coordinates, {"pp": ., "dp": ., "cp": ., "tp": .}."""
    step: int = 0
    """The step being trained, counted from 1 as in metrics.jsonl; 0 before the first."""
    steps: bool = True
    """Whether the command trains in steps (a failure names its step); `hf3d eval` does not."""

    def locate(self, mesh) -> None:
        """Take the coordinates from the run's ("pp", "dp", "cp", "tp") DeviceMesh."""
        self.coords = {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}

    def place(self, tp: int, pp: int, world_size: int, cp: int = 1) -> None:
        """Coordinates from the degrees alone (the mesh is pp-major, tp-minor over the global ranks), for
        errors raised before the mesh exists; left unset when the degrees do not fit the world."""
        if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
            return
        dp = world_size // (tp * pp * cp)
        r = self.rank
        self.coords = {"pp": r // (dp * cp * tp), "dp": r // (cp * tp) % dp, "cp": r // tp % cp, "tp": r % tp}

    def where(self) -> str:
        coords = ", ".join(f"{k}={v}" for k, v in (self.coords or {}).items())
        at = (f" at step {self.step}" if self.step else " before the first step") if self.steps else ""
        return f"rank {self.rank}" + (f" ({coords})" if coords else "") + f" failed{at}"


def is_communication_error(e: BaseException) -> bool:
    """A collective or point-to-point operation failed: a peer died or a timeout expired."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _COMMUNICATION_SIGNS)


def _first_to_report() -> bool:
    """Take the job-wide 'reported' key in the rendezvous store; True for the first rank only. A store
    that cannot be reached (its host, rank 0 without torchrun, is gone) means another rank failed first."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))
        return store.add(REPORTED_KEY, 1) == 1
    except Exception:
        return False


def root_cause(e: BaseException) -> BaseException:
    """The error under library wrappers: torch's pipeline stages re-raise what a forward or backward
    raised as a plain RuntimeError("[Stage i] failed to run forward ...") from the original."""
    while type(e) is RuntimeError and e.__cause__ is not None:
        e = e.__cause__
    return e


def one_line(e: BaseException) -> str:
    """`Type: message` on one line (whitespace runs collapsed)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def fail(e: BaseException, state: RunState, command: str) -> int:
    """Report `e`, raised on this rank, and end the process without waiting for any peer.

    The first rank of the job to fail prints `<command>: rank R (pp=., dp=., cp=., tp=.) failed at step S:
    Type: message` (a traceback first when `e` is not an error a user can cause); later ones print
    nothing. Returns the exit code when no process group was started, so the caller can return it (an
    in-process caller lives on); otherwise leaves with `os._exit`, in a world of one too: interpreter
    teardown with gloo's threads up can abort (SIGABRT)."""
    e = root_cause(e)
    group = dist.is_available() and dist.is_initialized()
    peers = group and dist.get_world_size() > 1
    communication = is_communication_error(e)
    code = EXIT_COMMUNICATION if communication else EXIT_ERROR
    first = _first_to_report() if peers else state.rank == 0
    if state.coords is None and state.step == 0 and isinstance(e, USER_ERRORS):  # before any rank started
        line = f"{command}: error: {' '.join(str(e).split())}"
    else:
        line = f"{command}: {state.where()}: {one_line(e)}"
    tell_the_launcher(line)
    if first:
        if not isinstance(e, USER_ERRORS) and not communication:
            traceback.print_exception(e, file=sys.stderr)
        print(line, file=sys.stderr)
    if not group:
        return code
    exit_now(code)


def interrupted(command: str, state: RunState) -> int:
    """Ctrl-C (KeyboardInterrupt) where no handler of hf3d's own records it (before training's first step, in
    eval and generate): rank 0 prints one line, every rank ends with 130 at once, no traceback. Returns the code
    when no process group was started."""
    if state.rank == 0:
        before = " before the first step (nothing saved)" if state.steps and not state.step else ""
        print(f"{command}: stopped by SIGINT{before}; exit code {EXIT_INTERRUPTED}", file=sys.stderr)
    if not (dist.is_available() and dist.is_initialized()):
        return EXIT_INTERRUPTED
    exit_now(EXIT_INTERRUPTED)


def tell_the_launcher(line: str) -> None:
    """torchrun's summary of a failed job names each worker's error file as its root cause: this rank's line
    goes there (TORCHELASTIC_ERROR_FILE, one per worker, as torch's own @record writes it), so the summary that
    ends the screen carries hf3d's message instead of a pointer to torch's docs. The first rank to fail writes
    first, and torchrun takes the earliest as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": line, "timestamp": int(time.time())}
    try:
        files.write_file(path, json.dumps(record))
    except OSError:  # one is there already (torch's own handler wrote it): it says what happened
        pass


def exit_now(code: int) -> NoReturn:
    """os._exit with `code`, stdout and stderr flushed first."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def store_barrier(name: str, _count=[0]) -> None:  # noqa: B006 - one counter per process: each barrier its own key
    """Every rank waits until all have arrived, through the rendezvous store: no collective timeout
    applies, so one rank may work alone (tokenise, export, upload) for as long as it takes."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    _count[0] += 1
    store = dist.distributed_c10d._get_default_store()
    key = f"hf3d/barrier/{name}/{_count[0]}"
    store.add(key, 1)
    while store.add(key, 0) < dist.get_world_size():
        time.sleep(0.2)


def leave(code: int) -> NoReturn:
    """End this process now with `code` once every rank has arrived: output flushed, then os._exit,
    so no interpreter teardown runs with gloo's threads up (it can abort and turn `code` into 134).
    Files the run wrote are closed by then; nothing else is left to flush.

    Rank 0 leaves last: without torchrun's agent it hosts the rendezvous store, and the others poll
    that store until they have seen everyone arrive."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        store_barrier("leave")
        store = dist.distributed_c10d._get_default_store()
        store.add("hf3d/left", 1)  # this rank is done with the store
        if dist.get_rank() == 0:
            while store.add("hf3d/left", 0) < dist.get_world_size():
                time.sleep(0.05)
    exit_now(code)


def finish(code: int = 0) -> NoReturn:
    """The last call of a script that trains with hf3d on several processes (an accelerate loop, the
    Trainer): every rank waits for the others, then exits with `code` without interpreter teardown,
    which with gloo's threads up can abort a finished run (SIGABRT, exit 134). Close loggers and files
    first: atexit handlers do not run. Without a process group it is `sys.exit(code)`, unless a launcher
    started several processes and the group is already gone (accelerate's `end_training` destroys it):
    then no barrier is left to wait in, and the process still leaves without the teardown."""
    if not (dist.is_available() and dist.is_initialized()):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            exit_now(code)
        raise SystemExit(code)
    leave(code)
