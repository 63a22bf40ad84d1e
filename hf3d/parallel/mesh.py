"""torch.distributed start-up and the ("pp", "dp", "cp", "tp") device mesh.

Axis order, outermost first: pp, dp, cp, tp. tp is innermost and cp next to it, so their peers are
neighbouring ranks (the same node on GPU clusters: tp, then cp, carry the most traffic per step);
pp and dp span nodes. The cp axis is always there (size 1 by default). Expert parallelism folds into
dp (or dp x cp), as in Megatron and torchtitan, and adds no world factor. The flattened ("dp", "cp")
axis, "dp_cp", is the group over which replicated parameters' gradients are reduced and ZeRO-1 shards.

Expert parallelism splits the dp axis in two, dp = edp * ep with ep inner: dp rank d is expert rank
d % ep of the expert group d // ep. The ep peers (same pp, cp and tp coordinates) exchange tokens; an
expert's copies live on the edp ranks of one expert rank, and its gradients are reduced over those
times cp ("edp_cp"). A second mesh ("pp", "edp", "ep", "cp", "tp") over the same ranks names these
groups; with ep = 1 it is not built (the expert group is trivial and edp is dp).

HSDP (`ParallelConfig.dp_shard` = K < dp) splits the dp axis the other way, dp = replicate * K with the shard
ranks inner: ZeRO shards within the K neighbouring dp ranks (times cp, "dp_shard_cp") and the shards are
replicated across the dp // K groups ("dp_replicate"). A third mesh ("pp", "dp_replicate", "dp_shard", "cp",
"tp") names them; without HSDP it is not built and the shard group is the data-parallel group.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..utils.faults import die_with_parent, started_by_launcher
from .config import ParallelConfig


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DEFAULT_TIMEOUT_S = 600.0

# NCCL's error handling, by its variable, with the older alias torch still reads. 3 (SkipCleanUp): when a
# collective fails or outlives the process group's timeout, NCCL's watchdog thread ends the process
# (SIGABRT) without first calling ncclCommAbort, which can itself hang once a peer is gone. Unset, torch
# 2.13 defaults to 3 as well (its ProcessGroupNCCL.hpp says so), but torchrun exports 1 (TearDown: abort,
# then end) when its own environment lacks it; either value bounds a survivor's wait by the timeout.
# TORCH_NCCL_BLOCKING_WAIT is left alone: it would turn the timeout into a Python exception (so
# `faults.fail` prints its line), but it makes the host wait for every collective to finish, so the
# host could no longer run ahead of the GPU.
NCCL_FAIL_FAST = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": ("3", "NCCL_ASYNC_ERROR_HANDLING")}


def backend_environment(backend: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables `init_distributed` adds to `environ` before it starts a process group on `backend`:
    for nccl, the error handling that ends a rank whose collective can never complete (a peer died)
    after the timeout instead of letting it wait; none for gloo, which reports a closed peer at once.
    A variable the user set (under either of its names) is kept as it is."""
    if backend != "nccl":
        return {}
    return {
        name: value for name, (value, alias) in NCCL_FAIL_FAST.items() if name not in environ and alias not in environ
    }


def init_distributed(timeout_s: float | None = None) -> None:
    """Start the default process group from the launcher's environment (torchrun, accelerate).

    A plain `python script.py` with no launcher runs as a world of one process. Under torchrun every
    worker is made to die with the launcher (a SIGKILLed torchrun leaves no worker behind); a process
    started any other way keeps its parent's rules. timeout_s bounds every collective (default 10
    minutes): a rank whose peer hangs without dying raises after that long instead of waiting forever
    (gloo); under nccl the watchdog ends such a rank after that long (`backend_environment`).

    The process group hf3d starts is destroyed when the interpreter exits, unless the script did it first, so
    that gloo's worker threads of a group nothing else holds are joined while Python still runs. One left running
    into the interpreter's finalization can end a finished run with SIGABRT ("terminate called without an active
    exception", which torchrun reports as a failed worker): a thread that drops a finished collective's tensors
    takes the GIL to do it, and a thread that takes the GIL during finalization is made to exit, through C++ code
    that cannot unwind (a core dump of a benchmark worker showed it). A group the caller started is the caller's
    to destroy.
    """
    if dist.is_initialized():
        return
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"the collective timeout must be a number of seconds > 0, got {timeout_s!r}")
    if started_by_launcher():
        die_with_parent()
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(backend_environment(backend, os.environ))  # read when the process group starts
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_mesh(pcfg: ParallelConfig) -> DeviceMesh:
    """Validate the degrees against the world size and build the named mesh."""
    world_size = dist.get_world_size()
    pcfg.resolve(world_size)
    mesh = init_device_mesh(
        device_type(), (pcfg.pp, pcfg.dp, pcfg.cp, pcfg.tp), mesh_dim_names=("pp", "dp", "cp", "tp")
    )
    if pcfg.cp > 1:  # collective: every rank creates every dp x cp group; torch wants the flat mesh kept
        mesh.hf3d_dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    mesh.hf3d_experts = None
    if pcfg.ep > 1:
        shape = (pcfg.pp, pcfg.dp // pcfg.ep, pcfg.ep, pcfg.cp, pcfg.tp)
        experts = init_device_mesh(device_type(), shape, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        experts.hf3d_edp_cp = experts["edp", "cp"]._flatten("edp_cp") if pcfg.cp > 1 else None
        mesh.hf3d_experts = experts
    mesh.hf3d_hsdp = None
    if pcfg.shard_size < pcfg.dp:
        shape = (pcfg.pp, pcfg.dp // pcfg.shard_size, pcfg.shard_size, pcfg.cp, pcfg.tp)
        hsdp = init_device_mesh(device_type(), shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        shard_axis = "dp_shard"
        if pcfg.cp > 1:
            hsdp.hf3d_flat = hsdp["dp_shard", "cp"]._flatten("dp_shard_cp")  # kept, as hf3d_dp_cp is
            shard_axis = "dp_shard_cp"
        hsdp.hf3d_shard_axis = shard_axis
        mesh.hf3d_hsdp = hsdp
    return mesh


def data_parallel_group(mesh: DeviceMesh):
    """The group that reduces gradients of replicated parameters and shards ZeRO-1: dp, or dp x cp."""
    flat = getattr(mesh, "hf3d_dp_cp", None)
    return flat.get_group() if flat is not None else mesh.get_group("dp")


def shard_group(mesh: DeviceMesh):
    """The group whose ranks split the ZeRO state of replicated parameters: the data-parallel group, or under
    HSDP the dp_shard neighbours (times cp)."""
    hsdp = getattr(mesh, "hf3d_hsdp", None)
    return data_parallel_group(mesh) if hsdp is None else hsdp.get_group(hsdp.hf3d_shard_axis)


def replicate_group(mesh: DeviceMesh):
    """Under HSDP the group holding copies of the same shard (one rank per shard group); None otherwise."""
    hsdp = getattr(mesh, "hf3d_hsdp", None)
    return None if hsdp is None else hsdp.get_group("dp_replicate")


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards replicated parameters over (zero 3): dp or dp x cp; under HSDP the 2-D
    (replicate, shard) mesh, on which fully_shard shards along the second axis and replicates along the first."""
    hsdp = getattr(mesh, "hf3d_hsdp", None)
    if hsdp is not None:
        return hsdp["dp_replicate", hsdp.hf3d_shard_axis]
    flat = getattr(mesh, "hf3d_dp_cp", None)
    return flat if flat is not None else mesh["dp"]


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards expert parameters over: the ranks holding the same experts (edp, or edp x cp)."""
    experts = getattr(mesh, "hf3d_experts", None)
    if experts is None:
        return fsdp_mesh(mesh)
    return experts.hf3d_edp_cp if experts.hf3d_edp_cp is not None else experts["edp"]


def expert_group(mesh: DeviceMesh):
    """The group whose ranks exchange tokens and split each MoE layer's experts; None when ep = 1."""
    experts = getattr(mesh, "hf3d_experts", None)
    return None if experts is None else experts.get_group("ep")


def expert_data_parallel_group(mesh: DeviceMesh):
    """The group that reduces expert gradients and shards their ZeRO-1 state: the ranks holding the same
    experts (edp, or edp x cp); the data-parallel group when ep = 1."""
    experts = getattr(mesh, "hf3d_experts", None)
    if experts is None:
        return data_parallel_group(mesh)
    flat = experts.hf3d_edp_cp
    return flat.get_group() if flat is not None else experts.get_group("edp")


def on_rank0(fn) -> None:
    """Run fn on global rank 0 only; an exception there is raised on every rank (an OSError or
    ValueError as a ValueError everywhere; anything else as itself on rank 0 and as a ValueError
    naming it on the others), so no rank is left waiting in the next collective."""
    msg, error = [None], None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:
            error = e
            msg[0] = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(msg, src=0)
    if error is not None and not isinstance(error, OSError | ValueError):
        raise error
    if msg[0] is not None:
        raise ValueError(msg[0])
