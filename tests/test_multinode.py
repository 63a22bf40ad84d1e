"""Two "nodes" on one machine: two torchrun agents (2 processes each) meeting through a c10d
rendezvous, as the SLURM example launches them. `hf3d train` at tp=2 x dp=2 across them gives
the losses of the same run on one node with 4 processes, bit for bit (CPU, fp32, gloo)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "-m",
    "hf3d",
    "train",
    "examples/configs/tiny-smollm.yaml",
    "--set",
    "parallel.tp=2",
    "run.steps=3",
    "run.global_batch=4",
    "data.seq_len=32",
    "optim.warmup_steps=1",
    "checkpoint.every=0",
    "run.save_final=false",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_node_launch_matches_one_node(tmp_path):
    one = tmp_path / "one-node"
    proc = subprocess.run(
        _torchrun("--standalone", "--nproc-per-node", "4", *ARGS, f"run.output_dir={one}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    two = tmp_path / "two-nodes"
    port = _free_port()
    agents = [
        subprocess.Popen(
            _torchrun(
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "hf3d-test",
                *ARGS,
                f"run.output_dir={two}",
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
    assert len(_losses(one)) == 3
    assert _losses(two) == _losses(one)
