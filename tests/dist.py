"""Run a function on N gloo processes on this CPU (a free port each time, no retries).

The processes fork from one forkserver per test session that has imported torch, transformers and hf3d
already: a spawned process would import them again (about 8 s of CPU on this machine), which was most of
the suite's time. A worker takes the caller's environment, working directory, stdout and stderr (reopened
through /proc, so pytest's capture sees what the ranks print), not the server's."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))  # audit, beside this module
import audit  # noqa: E402
from runs import free_port as _free_port  # noqa: E402

from hf3d.utils import compat  # noqa: E402

V_SCHEDULES = ("zbv", "dualpipev")
NEEDS_2_13 = pytest.mark.skipif(compat.BEFORE_2_13, reason="hf3d refuses the V schedules before torch 2.13")


START_METHOD = "forkserver"
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.smollm3.modeling_smollm3",
    "hf3d.parallelize",
    "hf3d.train.trainer",
    "models",
    "reference",
]
mp.set_forkserver_preload(_PRELOAD)


def _caller() -> tuple[dict, str, int]:
    """What a worker takes from the test that starts it: its environment, working directory and process."""
    sys.stdout.flush()
    sys.stderr.flush()
    return dict(os.environ), os.getcwd(), os.getpid()


def _adopt(caller: tuple[dict, str, int]) -> None:
    env, cwd, pid = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd in (1, 2):  # the caller's stdout and stderr now, not the ones the server started with
        try:
            new = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(new, fd)
        os.close(new)


def _worker(rank: int, world_size: int, port: int, fn, args, caller=None) -> None:
    if caller is not None:
        _adopt(caller)
    audit.watch_in_worker()  # when the test that started this worker watches (tests/conftest.py)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(*args)  # an exception goes to mp.spawn, which fails the caller
    # every rank is done: leave without interpreter teardown, which with gloo's threads up could
    # abort a rank (SIGABRT, "terminate called without an active exception") after a passing run
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world_size: int, *args) -> None:
    """Run fn(*args) on world_size processes; an exception on any rank fails the caller."""
    mp.start_processes(
        _worker,
        args=(world_size, _free_port(), fn, args, _caller()),
        nprocs=world_size,
        join=True,
        start_method=START_METHOD,
    )


def spawn_world(fn, world_size: int, root: Path, *args) -> dict:
    """Run fn(world_size, *args, out) on world_size processes, out = root/world<N> (made here), each rank
    saving its results to out/rank<r>.pt: {rank: its results} and {"out": out}."""
    out = root / f"world{world_size}"
    out.mkdir()
    spawn(fn, world_size, world_size, *args, str(out))
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)} | {"out": out}


def start_watchdog(seconds: float) -> None:
    """A rank stuck in a collective dumps its stack and exits instead of hanging the test run."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def report(res, path: str | Path) -> None:
    """Gather every rank's measurements into `path` on rank 0 (a list indexed by rank); the barrier
    shows that no rank was left behind in a collective. Ends the watchdog."""
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(res, everyone, dst=0)
    if dist.get_rank() == 0:
        torch.save(everyone, Path(path))
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
