"""The README's main command, run as written: the embedded default `hf3d train` on 2 processes.

Runs `hf3d train --nproc-per-node 2 examples/configs/tiny-smollm.yaml` from the repository
root (into a temporary output dir, so `outputs/` is left alone) and records what a user sees: the wall
time, the first and last training loss, the eval losses, the downstream scores, the log lines, the
checkpoints and files written, the generated sample, and the loss curve (copied to
results/default_run_loss_curve.png for the README).

    python benchmarks/bench_default_run.py            # the full default run (200 steps)
    python benchmarks/bench_default_run.py --quick    # 10 steps; results/quick/
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import _common as C

CONFIG = "examples/configs/tiny-smollm.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps, results/quick/")
    args = ap.parse_args()
    env = C.env_info()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        settings = [f"run.output_dir={out}"]
        if args.quick:
            settings += ["run.steps=10", "optim.warmup_steps=2", "data.eval.every=5", "checkpoint.every=5"]
        proc, wall = C.hf3d_train(CONFIG, settings)
        if proc.returncode != 0:
            sys.exit(f"the default run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        evals = [[r["step"], r["eval_loss"]] for r in records if "eval_loss" in r]
        downstream = [  # [step, {task: acc_norm}] of each downstream evaluation, the average among the tasks
            [
                r["step"],
                {k.split("/")[1]: v for k, v in r.items() if k.startswith("downstream/") and k.endswith("/acc_norm")},
            ]
            for r in records
            if "downstream/average/acc_norm" in r
        ]
        data = {
            "env": env,
            "command": "hf3d train --nproc-per-node 2 " + CONFIG,
            "quick": args.quick,
            "wall_s": wall,
            "steps": records[-1]["step"],
            "first_loss": records[0]["loss"],
            "last_loss": records[-1]["loss"],
            "min_loss": min(r["loss"] for r in records),
            "eval_losses": evals,
            "downstream_acc_norm": downstream,
            "log_lines": [
                x.strip() for x in proc.stdout.splitlines() + proc.stderr.splitlines() if x.startswith("step ")
            ],
            "tokens": records[-1]["consumed_tokens"],
            "median_tokens_per_sec": sorted(r["tokens_per_sec"] for r in records)[len(records) // 2],
            "checkpoints": sorted(p.name for p in (out / "checkpoints").glob("step_*")),
            "outputs": sorted(p.name for p in out.iterdir()),
            "final_files": sorted(p.name for p in (out / "final").iterdir()),
            "sample": (out / "sample.txt").read_text().strip(),
            "mesh_samples": [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()],
            "progress_bar_shown": "train: 100%" in proc.stderr,
        }
        results_dir = C.RESULTS / "quick" if args.quick else C.RESULTS
        results_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / "loss_curve.png", results_dir / "default_run_loss_curve.png")
    body = C.md_table(
        ["steps", "wall", "loss first → last", "eval loss (step: value)", "checkpoints"],
        [
            [
                str(data["steps"]),
                f"{wall:.0f} s",
                f"{data['first_loss']:.3f} → {data['last_loss']:.3f}",
                ", ".join(f"{s}: {v:.3f}" for s, v in evals),
                ", ".join(data["checkpoints"]),
            ]
        ],
    )
    body += f"\n\n![loss curve](default_run_loss_curve.png)\n\nSample (`ROMEO:`):\n\n```\n{data['sample']}\n```"
    path = C.write_results(
        "default_run", "The README's main command: the embedded default run", body, data, quick=args.quick
    )
    print(
        f"wrote {path}: {data['steps']} steps in {wall:.0f} s, loss {data['first_loss']:.3f} -> {data['last_loss']:.3f}"
    )


if __name__ == "__main__":
    main()
