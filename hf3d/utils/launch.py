"""`hf3d train --nproc-per-node N ...` (and eval, generate): hf3d starts its N worker processes itself, through
torch's elastic agent (the one torchrun runs), and owns how the run ends on screen.

Under plain torchrun a Ctrl-C ends on the agent's traceback: a terminal sends SIGINT to the launcher, the agent
turns it into a `SignalException`, forwards SIGINT to the workers (hf3d saves a checkpoint and prints where to
resume), waits for them, then raises the exception out of `torchrun`'s main and exits 1. A worker's failure ends
on torchrun's `ChildFailedError` summary, which repeats the worker's line. Here the agent runs in this process:

- Ctrl-C (or SIGTERM): the agent forwards the signal and waits for the workers to save and exit (as under
  torchrun, 30 s or TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, then SIGKILL: the same wait ends the peers of a
  failed rank); this process then prints nothing and exits 128 + the signal (130 for Ctrl-C), so the workers'
  resume line stays last.
- A worker fails: hf3d's first failing rank has printed its one line (faults.fail); this process prints nothing
  more and exits with that worker's code. A worker that died without hf3d's line (killed by a signal, the OOM
  killer) gets one line here.

The agent's own log lines (shutting down workers, closing signals) are silenced; `torchrun ... -m hf3d` keeps
working as before for multi-node runs and every torchrun option.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid


def worker_argv(argv: list[str]) -> list[str]:
    """`argv` without `--nproc-per-node N` (or `--nproc-per-node=N`): what each worker runs after `-m hf3d`."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--nproc-per-node":
            skip = True
        elif not token.startswith("--nproc-per-node="):
            out.append(token)
    return out


def _quiet_agent() -> None:
    """No agent log line on screen: its records stop at torch.distributed.elastic, which keeps them."""
    logger = logging.getLogger("torch.distributed.elastic")
    logger.propagate = False
    logger.addHandler(logging.NullHandler())


def launch(command: str, nproc: int, argv: list[str]) -> int:
    """Run `python -m hf3d ARGV` on `nproc` local worker processes (torchrun --standalone's rendezvous) and
    return the exit code this process should end with: 0, the first failing worker's code, or 128 + N after
    signal N (130 for Ctrl-C). Prints a line only for a worker that died without hf3d's own."""
    try:
        return _run_agent(command, nproc, argv)
    except KeyboardInterrupt:  # Ctrl-C before the agent set its handlers: no worker started yet
        return 128 + int(signal.SIGINT)


def _run_agent(command: str, nproc: int, argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise ValueError("--nproc-per-node starts the worker processes itself: under torchrun leave it out")
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does: N processes do not each take every core
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        shutdown_timeout=None,  # torchrun's: 30 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT; then SIGKILL
    )
    _quiet_agent()
    _name_the_package()
    try:
        launch_agent(config, sys.executable, ["-P", "-m", "hf3d", *argv])  # -P: see _name_the_package
    except SignalException as e:  # the workers got the signal, saved and exited: their line is the last one
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        silent = _silent_deaths(command, e.failures)
        for rank, failure in silent:  # a rank that died without hf3d's line (its peers' lines are effects)
            print(f"{command}: rank {rank} {_how_it_died(failure)}", file=sys.stderr)
        code = (silent[0][1] if silent else e.get_first_failure()[1]).exitcode
        return 128 - code if code < 0 else code
    return 0


def _silent_deaths(command: str, failures: dict) -> list[tuple[int, object]]:
    """The ranks that ended without hf3d's line, but those the agent itself ended with SIGTERM once another rank
    had failed with hf3d's line (its shutdown of the peers, not a death to report)."""
    silent = [(r, f) for r, f in sorted(failures.items()) if not str(f.message).startswith(command)]
    if len(silent) < len(failures):
        silent = [(r, f) for r, f in silent if f.exitcode != -int(signal.SIGTERM)]
    return silent


def _name_the_package() -> None:
    """The workers run `python -P -m hf3d`: the launch folder is not on their `sys.path`, so a `numpy.py` (or any
    module) lying there is never imported in place of the real one. Where this process found hf3d itself through
    the launch folder (`python -m hf3d` in a checkout that is not installed), the workers get that folder on
    PYTHONPATH, as this process has it."""
    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder holding hf3d/
    named = sys.path if sys.flags.safe_path else sys.path[1:]  # sys.path[0]: the launch folder, or the script's
    if home not in {os.path.abspath(p) for p in named if p}:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [home, os.environ.get("PYTHONPATH")]))


def _how_it_died(failure) -> str:
    if failure.exitcode < 0:
        return (
            f"was killed by {failure.signal_name()} (the OOM killer sends SIGKILL): nothing reported the cause; "
            "its output above may tell"
        )
    return f"exited with code {failure.exitcode} without a message: its output above may tell"
