"""torch.distributed start-up and the ("pp", "dp", "tp") device mesh."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelConfig


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> None:
    """Start the default process group from the launcher's environment (torchrun, accelerate).

    A plain `python script.py` with no launcher runs as a world of one process.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_mesh(pcfg: ParallelConfig) -> DeviceMesh:
    """Validate the degrees against the world size and build the named mesh."""
    world_size = dist.get_world_size()
    pcfg.resolve(world_size)
    return init_device_mesh(device_type(), (pcfg.pp, pcfg.dp, pcfg.tp), mesh_dim_names=("pp", "dp", "tp"))


def on_rank0(fn) -> None:
    """Run fn on global rank 0 only; an OSError or ValueError there is raised as a ValueError on every
    rank, so no rank is left waiting in the next collective."""
    msg = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except (OSError, ValueError) as e:
            msg[0] = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
    dist.broadcast_object_list(msg, src=0)
    if msg[0] is not None:
        raise ValueError(msg[0])
