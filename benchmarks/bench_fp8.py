"""FP8 training against bf16 on the embedded default run: final loss, curves, step time.

Runs the README's default (`examples/configs/tiny-smollm.yaml`, 200 steps, tp=2 on 2 processes) with
model.dtype=bfloat16, then the same with precision.fp8 set to each of torchao's recipes, and compares the
final training loss (mean of the last 10 steps, which evens out the batch-to-batch noise), the last eval
loss, and the median step time. Target: the FP8 runs end within 2 % of the bf16 run's loss. On this CPU the
step time is not a target (fp8 matmuls here are torch._scaled_mm's CPU kernel, no tensor cores).

    python benchmarks/bench_fp8.py            # 200 steps each
    python benchmarks/bench_fp8.py --quick    # 10 steps; results/quick/
    python benchmarks/bench_fp8.py --emulate  # fp8 runs with precision.fp8_emulate=true (CPUs where
                                              # torch._scaled_mm takes a slow path)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import _common as C

CONFIG = "examples/configs/tiny-smollm.yaml"
RUNS = {"bf16": [], "fp8 tensorwise": ["precision.fp8=tensorwise"], "fp8 rowwise": ["precision.fp8=rowwise"]}
TARGET = 0.02  # |final loss / bf16's - 1|
TAIL = 10  # steps averaged for the final loss


def _plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    panel = {"curves": {name: ([s for s, _ in pts], [v for _, v in pts]) for name, pts in curves.items()}}
    title = "embedded default run, bf16 vs FP8 (torchao recipes), tp=2"
    panel.update(xlabel="step", ylabel="training loss", title=title)
    C.line_panels([panel], path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps, results/quick/")
    ap.add_argument("--emulate", action="store_true", help="fp8 runs through torchao's emulated matmul")
    args = ap.parse_args()
    env = C.env_info()
    rows, curves = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            out = Path(tmp) / name.replace(" ", "-")
            settings = [f"run.output_dir={out}", "model.dtype=bfloat16", "checkpoint.every=0", *extra]
            if args.emulate and extra:
                settings.append("precision.fp8_emulate=true")
            if args.quick:
                settings += ["run.steps=10", "optim.warmup_steps=2", "data.eval.every=5"]
            proc, wall = C.hf3d_train(CONFIG, settings)
            if proc.returncode != 0:
                sys.exit(f"the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in records if "loss" in r]
            curves[name] = [(r["step"], r["loss"]) for r in train]
            tail = [r["loss"] for r in train[-TAIL:]]
            evals = [r["eval_loss"] for r in records if "eval_loss" in r]
            rows[name] = {
                "wall_s": wall,
                "final_loss": sum(tail) / len(tail),
                "last_eval_loss": evals[-1] if evals else None,
                "median_step_s": C.median([r["step_time_s"] for r in train[1:]]),
                "fp8_line": next((ln for ln in (proc.stdout + proc.stderr).splitlines() if "hf3d: fp8" in ln), ""),
            }
    results_dir = C.RESULTS / "quick" if args.quick else C.RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    _plot(curves, results_dir / "fp8_loss_curves.png")
    base = rows["bf16"]
    table = []
    for name, r in rows.items():
        ratio = r["final_loss"] / base["final_loss"]
        r["loss_vs_bf16"] = ratio
        r["meets_target"] = abs(ratio - 1) <= TARGET
        table.append(
            [
                name,
                f"{r['final_loss']:.4f}",
                f"{ratio:.4f}x" + ("" if name == "bf16" else (" (meets ≤ 2 %)" if r["meets_target"] else " (MISSES)")),
                C.fmt(r["last_eval_loss"], 4) if r["last_eval_loss"] is not None else "-",
                f"{r['median_step_s']:.3f}",
                f"{r['median_step_s'] / base['median_step_s']:.2f}x",
            ]
        )
    body = C.md_table(
        ["run", f"final loss (mean of last {TAIL})", "/ bf16", "last eval loss", "median step s", "step / bf16"], table
    )
    if args.emulate:
        body += "\n\nThe fp8 runs used `precision.fp8_emulate=true`: torchao's emulated fp8 matmul (the same casts and "
        body += "scales, the product in high precision), not torch._scaled_mm."
    body += "\n\n![loss curves](fp8_loss_curves.png)\n\n" + "\n".join(
        f"- {name}: `{r['fp8_line']}`" for name, r in rows.items() if r["fp8_line"]
    )
    command = "torchrun --nproc-per-node 2 -m hf3d train " + CONFIG
    data = {"env": env, "command": command, "runs": rows, "emulate": args.emulate}
    path = C.write_results("fp8", "FP8 (torchao) vs bf16 on the embedded default run", body, data, quick=args.quick)
    print(f"wrote {path}: " + ", ".join(f"{n} {r['final_loss']:.4f}" for n, r in rows.items()))


if __name__ == "__main__":
    main()
