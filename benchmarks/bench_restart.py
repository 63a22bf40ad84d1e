"""A worker's death under `--max-restarts`: the time from the kill to the next finished step, and the steps lost.

`hf3d train --nproc-per-node 2 --max-restarts K` of the tiny run (tp=1, dp=2, a checkpoint every --every steps);
rank 1 is SIGKILLed (as the OOM killer does) K times, each time a few steps past a checkpoint. metrics.jsonl is
watched every 10 ms: a step's time is when its record appears.
- restart latency: kill → the first record after it (the agent notices, restarts both workers, they import, build,
  load the newest checkpoint and train one step);
- steps lost: the steps trained before the kill that the resumed run trains again (kill step - checkpoint step);
- beside them the run's steady step time and its start-up (launch → step 1) for scale.

    python benchmarks/bench_restart.py [--kills 3]      # ~2 min on 2 cores
    python benchmarks/bench_restart.py --quick          # one kill; results/quick/
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import psutil

TINY = ["parallel.tp=1", "run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=1", "evals.tasks=[]",
        "samples.prompts=[]", "run.sample_prompt=null", "run.save_final=false"]  # fmt: skip


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def measure(kills: int, every: int, steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="hf3d-restart-")) / "run"
    cmd = [sys.executable, "-m", "hf3d", "train", str(C.REPO / "examples/configs/tiny-smollm.yaml"), "--set", *TINY,
           f"run.steps={steps}", f"checkpoint.every={every}", "checkpoint.keep_last=1", f"run.output_dir={out}",
           "--nproc-per-node", "2", "--max-restarts", str(kills)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=C.REPO, env=C.child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    targets = [every * (i + 1) + every // 2 for i in range(kills)]  # half-way between two checkpoints
    rows, pending, startup = [], None, None
    while proc.poll() is None:
        records, now = _records(out / "metrics.jsonl"), time.perf_counter()
        resumed = [r for r in records if "resumed_from" in r]
        if records and startup is None:
            startup = now - t0
        if pending is None and targets and records and records[-1]["step"] >= targets[0]:
            victim = next(w for w in psutil.Process(proc.pid).children() if w.environ().get("RANK") == "1")
            pending = {"kill_after_step": records[-1]["step"], "resumes": len(resumed), "t": time.perf_counter()}
            victim.send_signal(signal.SIGKILL)
            targets.pop(0)
        elif pending is not None and len(resumed) > pending["resumes"]:  # the resumed run's first step
            first, killed = resumed[-1]["step"], pending["kill_after_step"]
            rows.append({"kill_after_step": killed, "resumed_at_step": first, "steps_lost": killed - (first - 1),
                         "latency_s": now - pending["t"]})  # fmt: skip
            pending = None
        time.sleep(0.01)
    err = proc.stderr.read().decode(errors="replace")
    records = _records(out / "metrics.jsonl")
    assert proc.returncode == 0, C.tail(err)
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and len(rows) == kills, (rows, C.tail(err))
    shutil.rmtree(out.parent, ignore_errors=True)
    steady = [r["step_time_s"] for r in records if "resumed_from" not in r and r["step"] > 1]
    return {"kills": rows, "startup_s": startup, "steady_step_s": C.median(steady)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--every", type=int, default=6, help="checkpoint every N steps")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    kills = 1 if args.quick else args.kills
    steps = args.every * (kills + 1) + args.every // 2 + 2
    data = {"env": C.env_info(), "args": vars(args), "steps": steps, **measure(kills, args.every, steps)}
    data["latency_s"] = C.median([r["latency_s"] for r in data["kills"]])
    data["steps_lost"] = C.median([r["steps_lost"] for r in data["kills"]])
    table = C.md_table(["killed after step", "resumed at step", "steps lost", "kill → next step (s)"],
                       [[r["kill_after_step"], r["resumed_at_step"], r["steps_lost"], r["latency_s"]]
                        for r in data["kills"]])  # fmt: skip
    body = (f"{table}\n\nMedian: {data['latency_s']:.1f} s from the kill to the next finished step, "
            f"{data['steps_lost']:g} steps lost; start-up (launch → step 1) {data['startup_s']:.1f} s, "
            f"steady step {data['steady_step_s']:.3f} s.")  # fmt: skip
    print(C.write_results("restart", "A worker's death under --max-restarts (tiny run, dp=2, CPU)", body, data,
                          quick=args.quick))  # fmt: skip


if __name__ == "__main__":
    main()
