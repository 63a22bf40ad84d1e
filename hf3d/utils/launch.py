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

Several machines: `--nnodes N|MIN:MAX --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-id ID] [--rdzv-backend B]
[--max-restarts K]` have torchrun's meaning and go to the same agent (LaunchOptions). The c10d rendezvous store lives
in the agent on the endpoint's host: if that machine goes, the survivors cannot meet again, and that is one line here
(RendezvousError), not the agent's traceback. A restart of the workers (a failure under --max-restarts, a node that
joins or leaves under MIN:MAX) is one line too. SIGUSR1 and SIGUSR2 (SLURM's `--signal`) are forwarded to the workers
as SIGTERM and SIGINT are: they save a checkpoint and end with 128 + the signal.

The agent's own log lines (shutting down workers, closing signals) are silenced; `torchrun ... -m hf3d` keeps
working as before for every torchrun option.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass

RDZV_BACKENDS = ("c10d", "etcd-v2", "static")
# what the agent forwards to the workers (torchrun's four, and the two SLURM's --signal sends)
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


@dataclass
class LaunchOptions:
    """The launch flags of `hf3d train|eval|generate`, with torchrun's meaning."""

    nproc_per_node: int = 1
    nnodes: str = "1"
    """N, or MIN:MAX for an elastic job (it goes on with as few as MIN nodes and takes nodes back up to MAX)."""
    node_rank: int = 0
    """This machine's rank among the nodes: the static backend's; c10d and etcd-v2 number nodes as they join."""
    rdzv_endpoint: str | None = None
    """HOST:PORT where the nodes meet (c10d: the agent on HOST hosts the store); none: this machine alone."""
    rdzv_id: str | None = None
    """The job's id, the same on every node (default: one per launch alone, `hf3d` across nodes)."""
    rdzv_backend: str = "c10d"
    rdzv_conf: str = ""
    """The backend's KEY=VALUE,... (torchrun's --rdzv-conf): e.g. last_call_timeout=5, join_timeout=900."""
    max_restarts: int = 0
    """Times the agent restarts the workers after a failure (each resumes from the newest checkpoint)."""

    FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend",
             "--rdzv-conf", "--max-restarts")  # fmt: skip

    def nodes(self) -> tuple[int, int]:
        """(MIN, MAX) from --nnodes, checked."""
        text = str(self.nnodes).strip()
        parts = text.split(":")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--nnodes takes N or MIN:MAX (whole numbers), got {text!r}")
        low, high = int(parts[0]), int(parts[-1])
        if not 0 < low <= high:
            raise ValueError(f"--nnodes {text}: need 1 <= MIN <= MAX")
        return low, high

    def rendezvous_configs(self) -> dict:
        """--rdzv-conf as a dict (and the node rank for the static backend)."""
        configs = {}
        for item in filter(None, (part.strip() for part in self.rdzv_conf.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--rdzv-conf takes KEY=VALUE,KEY=VALUE; {item!r} is not KEY=VALUE")
            configs[key.strip()] = value.strip()
        if self.rdzv_backend == "static":
            configs["rank"] = self.node_rank
        return configs

    def config(self):
        """torch's LaunchConfig for these options; every option checked first (one line each)."""
        from torch.distributed.launcher.api import LaunchConfig

        low, high = self.nodes()
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(f"--rdzv-backend must be one of {', '.join(RDZV_BACKENDS)}, got {self.rdzv_backend!r}")
        if not 0 <= self.node_rank < high:
            raise ValueError(f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes} (0 to {high - 1})")
        alone = high == 1 and self.rdzv_endpoint is None
        if not alone and not self.rdzv_endpoint:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node: the address of a "
                "machine that stays up for the whole job (its agent hosts the c10d store)"
            )
        if self.rdzv_backend == "static" and low != high:
            raise ValueError("--rdzv-backend static takes a fixed --nnodes N; MIN:MAX needs c10d or etcd-v2")
        if self.rdzv_backend == "etcd-v2" and not alone and importlib.util.find_spec("etcd") is None:
            raise ValueError(
                "--rdzv-backend etcd-v2 needs the python-etcd package on every node (pip install python-etcd), "
                "or use --rdzv-backend c10d"
            )
        return LaunchConfig(
            min_nodes=low,
            max_nodes=high,
            nproc_per_node=self.nproc_per_node,
            run_id=self.rdzv_id or (str(uuid.uuid4()) if alone else "hf3d"),
            rdzv_backend="c10d" if alone else self.rdzv_backend,
            rdzv_endpoint="localhost:0" if alone else self.rdzv_endpoint,
            rdzv_configs=self.rendezvous_configs(),
            max_restarts=self.max_restarts,
            signals_to_handle=FORWARDED_SIGNALS,
            shutdown_timeout=None,  # torchrun's: 30 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT; then SIGKILL
        )


def worker_argv(argv: list[str]) -> list[str]:
    """`argv` without the launch flags (`--nproc-per-node N`, `--nnodes=N`, ...): what each worker runs after
    `-m hf3d`."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in LaunchOptions.FLAGS:
            skip = True
        elif not token.startswith(tuple(f + "=" for f in LaunchOptions.FLAGS)):
            out.append(token)
    return out


class _Restarts(logging.Handler):
    """The agent's restart of the workers, as one hf3d line (its other records stay silent)."""

    def __init__(self, command: str):
        super().__init__(logging.INFO)
        self.command = command

    def emit(self, record: logging.LogRecord) -> None:
        text = str(record.msg)
        if "attempts left; will restart worker group" in text:
            _role, state, left, most = record.args
            why = f"a worker {'failed' if state == 'FAILED' else 'is unhealthy'}"
            used = int(most) - int(left) + 1
            print(f"{self.command}: {why}: restarting the workers (restart {used} of {most}); they resume from the "
                  "newest checkpoint", file=sys.stderr)  # fmt: skip
        elif "new nodes from group_rank" in text:
            print(f"{self.command}: {record.args[1]} node(s) waiting to join: restarting the workers at the new size; "
                  "they resume from the newest checkpoint", file=sys.stderr)  # fmt: skip


def _quiet_agent(command: str) -> None:
    """No agent log line on screen but a restart's: its records stop at torch.distributed.elastic."""
    import torch.distributed.elastic.agent.server.api as agent_api

    logger = logging.getLogger("torch.distributed.elastic")
    logger.propagate = False
    if not any(isinstance(h, _Restarts) for h in logger.handlers):
        logger.addHandler(_Restarts(command))
    agent_api.logger.setLevel(logging.INFO)  # its restart records (torch sets WARNING, or LOGLEVEL)


def launch(command: str, options: LaunchOptions, argv: list[str]) -> int:
    """Run `python -m hf3d ARGV` on this node's worker processes through torch's elastic agent (alone: torchrun
    --standalone's rendezvous) and return the exit code this process should end with: 0, the first failing
    worker's code, 3 when the nodes cannot meet, or 128 + N after signal N (130 for Ctrl-C). Prints a line only
    for what hf3d's workers did not say: a worker that died silently, a restart, a rendezvous that failed."""
    try:
        return _run_agent(command, options, argv)
    except KeyboardInterrupt:  # Ctrl-C before the agent set its handlers: no worker started yet
        return 128 + int(signal.SIGINT)


def _run_agent(command: str, options: LaunchOptions, argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import launch_agent

    config = options.config()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise ValueError("--nproc-per-node starts the worker processes itself: under torchrun leave it out")
    if options.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does: N processes do not each take every core
    if config.max_nodes > 1 or config.max_restarts > 0:
        # a rendezvous after the first hands out the workers' store address only to nodes that asked before
        # (torch's shared TCPStore; pytorch#135712): a node joining again waits for it until its timeout. Each
        # round's own store address, as before torch 2.5, lets a restart and a grown job meet.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _quiet_agent(command)
    _name_the_package()
    try:
        launch_agent(config, sys.executable, ["-P", "-m", "hf3d", *argv])  # -P: see _name_the_package
    except SignalException as e:  # the workers got the signal, saved and exited: their line is the last one
        return 128 + int(e.sigval)
    except RendezvousError as e:
        print(f"{command}: {_rendezvous_problem(e, options)}", file=sys.stderr)
        return 3
    except ChildFailedError as e:
        silent = _silent_deaths(command, e.failures)
        for rank, failure in silent:  # a rank that died without hf3d's line (its peers' lines are effects)
            print(f"{command}: rank {rank} {_how_it_died(failure)}", file=sys.stderr)
        code = (silent[0][1] if silent else e.get_first_failure()[1]).exitcode
        return 128 - code if code < 0 else code
    return 0


def _rendezvous_problem(e: Exception, options: LaunchOptions) -> str:
    """One line for a rendezvous that failed: which, and where the store should live."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    where = options.rdzv_endpoint or "localhost"
    if isinstance(e, RendezvousConnectionError):
        return (
            f"the rendezvous store at {where} cannot be reached: the machine that hosts it (the agent on the "
            "endpoint's host) is gone or unreachable, and the nodes left cannot meet again; give --rdzv-endpoint a "
            "machine that outlives the job's nodes (a head node), or an etcd endpoint with --rdzv-backend etcd-v2 "
            "(docs/scale-out.md)"
        )
    if isinstance(e, RendezvousTimeoutError):
        return (
            f"the nodes did not meet at {where} in time (--nnodes {options.nnodes}): start every node with the same "
            "--rdzv-endpoint and --rdzv-id, and check that the port is open between the machines"
        )
    return f"the rendezvous at {where} failed: {' '.join(str(e).split())}"


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
