"""Expert load balance over a run: the tiny Qwen3-MoE example under each `moe.load_balance`.

Runs `torchrun --nproc-per-node 2 -m hf3d train examples/configs/qwen3-moe-tiny.yaml` (dp=2, ep=2) once per
setting, aux_loss (stock's load-balancing loss, coef 0.01 in the model's config), bias (aux-loss-free, an
expert bias moved 1e-3 per step) and none, into temporary output dirs, and reads metrics.jsonl: the
imbalance (max / mean top-k picks per expert, worst layer) of every step and the training loss. The
curves go to results/moe_balance.png.

    python benchmarks/bench_moe_balance.py            # 200 steps per setting
    python benchmarks/bench_moe_balance.py --quick    # 10 steps; results/quick/
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import _common as C

CONFIG = "examples/configs/qwen3-moe-tiny.yaml"
SETTINGS = ("aux_loss", "bias", "none")


def run(balance: str, out: Path, steps: int) -> tuple[list[dict], float]:
    settings = [f"run.output_dir={out}", f"moe.load_balance={balance}", f"run.steps={steps}", "data.eval.every=0"]
    settings += ["checkpoint.every=0", "run.sample_prompt=null", "run.save_final=false"]
    if steps < 40:  # a smoke run: the example's 20 warm-up steps would leave no decay
        settings.append("optim.warmup_steps=2")
    proc, wall = C.hf3d_train(CONFIG, settings)
    if proc.returncode != 0:
        sys.exit(f"the {balance} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    def panel(key: str, ylabel: str, title: str) -> dict:
        lines = {name: ([r["step"] for r in recs], [r[key] for r in recs]) for name, recs in curves.items()}
        return {"curves": lines, "xlabel": "step", "ylabel": ylabel, "title": title}

    imbalance = panel("moe/load_imbalance", "max / mean expert load (worst layer)", "expert load imbalance")
    C.line_panels([imbalance, panel("loss", "training loss", "loss")], path, width=10, height=3.6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps per setting, results/quick/")
    args = ap.parse_args()
    steps = 10 if args.quick else 200
    env = C.env_info()
    curves, walls = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for balance in SETTINGS:
            curves[balance], walls[balance] = run(balance, Path(tmp) / balance, steps)
    tail = max(1, steps // 4)  # the last quarter of the run
    summary = {
        name: {
            "imbalance_first": records[0]["moe/load_imbalance"],
            "imbalance_last_quarter_mean": sum(r["moe/load_imbalance"] for r in records[-tail:]) / tail,
            "loss_last_quarter_mean": sum(r["loss"] for r in records[-tail:]) / tail,
            "aux_loss_last": records[-1].get("moe/aux_loss"),
            "dropped_tokens": sum(r["moe/dropped_tokens"] for r in records),
            "wall_s": walls[name],
        }
        for name, records in curves.items()
    }
    results_dir = C.RESULTS / "quick" if args.quick else C.RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    plot(curves, results_dir / "moe_balance.png")
    rows = [
        [
            name,
            s["imbalance_first"],
            s["imbalance_last_quarter_mean"],
            s["loss_last_quarter_mean"],
            s["dropped_tokens"],
            f"{s['wall_s']:.0f} s",
        ]
        for name, s in summary.items()
    ]
    body = (
        f"`torchrun --nproc-per-node 2 -m hf3d train {CONFIG}` (dp=2, ep=2), {steps} steps per setting.\n\n"
        + C.md_table(
            [
                "moe.load_balance",
                "imbalance, step 1",
                "imbalance, last quarter (mean)",
                "loss, last quarter (mean)",
                "dropped tokens",
                "wall",
            ],
            rows,
        )
        + "\n\n![expert load imbalance](moe_balance.png)"
    )
    data = {"env": env, "steps": steps, "summary": summary, "curves": curves}
    path = C.write_results("moe_balance", "Expert load balance over a run", body, data, quick=args.quick)
    print(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
