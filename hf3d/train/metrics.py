"""Per-step metrics: metrics.jsonl on the main process, throughput, MFU, memory."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from ..utils import files

# dense bf16 peak FLOP/s per device, from the vendors' data sheets
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12}


def device_peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_bytes() -> int:
    """Peak accelerator memory on CUDA (max_memory_allocated), else this process's own peak resident set.

    On Linux that is VmHWM of /proc/self/status: ru_maxrss survives fork + exec, so a child process
    (a torchrun worker, a subprocess) can report its parent's larger peak instead of its own. ru_maxrss
    is the fallback where /proc is absent (macOS reports it in bytes, Linux in KiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes; None where there is no /proc or no such field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    value, unit = line.split()[1:3]
                    return int(value) * 1024 if unit == "kB" else int(value)
    except (OSError, ValueError, IndexError):
        pass
    return None


def throughput(
    tokens: int, seconds: float, world_size: int, flops_per_token: float, peak: float | None = None
) -> dict[str, float]:
    """Throughput of `tokens` (all ranks together) processed in `seconds` by `world_size` devices.

    Keys: tokens_per_sec, tokens_per_sec_per_device, tflops (achieved model TFLOP/s per device, from
    `flops_per_token`), and mfu (tflops / the device's peak) only when `peak` (FLOP/s per device,
    `device_peak_flops()`) is known."""
    if seconds <= 0 or world_size < 1:
        raise ValueError(f"throughput needs seconds > 0 and world_size >= 1, got {seconds} and {world_size}")
    tokens_per_sec = tokens / seconds
    per_device = tokens_per_sec / world_size
    out = {
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": per_device,
        "tflops": per_device * flops_per_token / 1e12,
    }
    if peak:
        out["mfu"] = per_device * flops_per_token / peak
    return out


_PIP_NAMES = {"comet_ml": "comet-ml", "aim": "'aim<4'"}  # accelerate supports aim below 4 only


def available_trackers(requested: list[str] | str) -> tuple[list[str], list[str]]:
    """(usable, missing): the requested experiment trackers (accelerate's `log_with` names) split by
    whether accelerate finds them installed, by accelerate's own checks, in the order asked.

    "all" means what it means to accelerate: every installed tracker (none is then missing). An
    unknown name is a ValueError listing the valid ones."""
    from accelerate import tracking
    from accelerate.utils import LoggerType

    requested = [requested] if isinstance(requested, str) else list(requested)
    valid = [t.value for t in LoggerType]
    unknown = [name for name in requested if name not in valid]
    if unknown:
        raise ValueError(f"unknown experiment tracker {', '.join(map(repr, unknown))}: choose from {', '.join(valid)}")
    installed = [t.value for t in tracking.get_available_trackers()]
    if "all" in requested:
        return installed, []
    names = list(dict.fromkeys(requested))
    return [n for n in names if n in installed], [n for n in names if n not in installed]


def tracker_install_hint(missing: list[str]) -> str:
    """One warning line for trackers that were asked for but are not installed."""
    pip = " ".join(_PIP_NAMES.get(name, name) for name in missing)
    return f"hf3d: not logging to {', '.join(missing)}: not installed (pip install {pip})"


class MetricsWriter:
    """Appends JSON objects with a `step` to <output_dir>/metrics.jsonl (or `name`: samples.jsonl) on the main
    process, the file closed after every write.

    A fresh run empties the file. A run resumed at step N keeps the records of steps 1..N and drops
    later ones (steps the interrupted run did after its last checkpoint, which are trained again)."""

    def __init__(self, output_dir: Path, enabled: bool, resume_step: int | None = None, name: str = "metrics.jsonl"):
        self.enabled = enabled
        self.path = Path(output_dir) / name
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    break  # a line cut short by the interruption ends what is kept
        files.write_file(self.path, "".join(kept), replace=True)

    def write(self, record: dict) -> None:
        if self.enabled:
            with files.append_to(self.path) as f:
                f.write((json.dumps(record) + "\n").encode())
