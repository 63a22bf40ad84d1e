"""What the tests that launch `hf3d train` as a user does share: a free port, a run's metrics records, and the tiny
run that multi-node, restarted and preempted runs are compared with (its settings, and its losses on one process:
the `tiny_losses` fixture of conftest.py, run once per session)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/configs/tiny-smollm.yaml"  # relative to ROOT, where the runs start (as sbatch is told to)
STEPS = 12  # every compared run: the lr schedule depends on run.steps
TINY = ["parallel.tp=1", "run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=1", "evals.tasks=[]"]
TINY += ["samples.prompts=[]", "run.sample_prompt=null", "run.save_final=false", "run.log_every=1"]
TINY += [f"run.steps={STEPS}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_records(out: Path) -> list[dict]:
    """<out>/metrics.jsonl as records; [] before the run has written it."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def one_process_losses(out: Path) -> list[float]:
    """The tiny run on one process, never interrupted: its steps' losses."""
    cmd = [sys.executable, "-m", "hf3d", "train", CONFIG, "--set", *TINY, f"run.output_dir={out}", "checkpoint.every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in metrics_records(out)]
