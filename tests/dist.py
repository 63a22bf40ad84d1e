"""Run a function on N gloo processes on this CPU (a free port each time, no retries)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    """Run fn(*args) on world_size processes; an exception on any rank fails the caller."""
    mp.spawn(_worker, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)
