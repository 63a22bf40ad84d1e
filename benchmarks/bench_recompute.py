"""Activation recompute: the memory a training step saves and the time it costs, one process, fp32 CPU.

`ParallelConfig(recompute=...)` with "none", "every_2" and "full" on a SmolLM2-135M-shaped model cut to
a few layers (hidden 576, 9/3 heads, inter 1536, vocab 49152, tied), initialised from a config-only
directory (the same seed, so every mode trains the same weights), AdamW. Each mode runs in its own fresh
process, with MALLOC_MMAP_THRESHOLD_=65536 so that RSS follows live allocations rather than glibc's
history, and the modes rotate order over the repeats.

Per process: one warm-up step (creates the optimizer state), `malloc_trim`, then for each measured step
the kernel's peak RSS is reset (`/proc/self/clear_refs` 5: VmHWM := VmRSS) just before `train_step`;
"peak above rest" = VmHWM after forward + backward − RSS before it: the activations (and the loss head's
buffers, which recompute does not touch) measured by the kernel, not computed. The losses of every mode
must be equal: recompute changes no number.

Time is measured apart, in ONE process that switches the stages' recompute flags (the ones
`ParallelConfig.recompute` sets) between steps, modes rotated over rounds, so that other load on the
machine falls on every mode alike: `train_step` (forward + backward) wall time, median and fastest.

    python benchmarks/bench_recompute.py            # 6 layers, 2 x 1024 tokens, 2 repeats (~5-6 min)
    python benchmarks/bench_recompute.py --quick    # tiny model; results/quick/
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
MODES = ("none", "every_2", "full")
QUICK_MODEL = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=1024
)


def _rss(key: str = "VmRSS") -> int:
    return C.proc_status()[key]


def timing_worker(args) -> None:
    """Every mode in one process, rotated per round: train_step wall times."""
    import torch

    hf3d = C.import_hf3d()

    pm = hf3d.parallelize(args.dir, hf3d.ParallelConfig(), seed=0)
    flags = {m: hf3d.ParallelConfig(recompute=m) for m in MODES}
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, pm.config.vocab_size, (args.rows, args.seq + 1), generator=g)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            for st in pm.stages:
                st.recompute = [flags[mode].recomputes(i) for i in st.layer_ids]
            t0 = time.perf_counter()
            pm.train_step(w[:, :-1], shift_labels=w[:, 1:])
            if r:  # round 0 warms up
                times[mode].append(time.perf_counter() - t0)
            pm.zero_grad(set_to_none=True)
    Path(args.out).write_text(json.dumps(times))


def worker(args) -> None:
    import torch

    hf3d = C.import_hf3d()

    pm = hf3d.parallelize(args.dir, hf3d.ParallelConfig(recompute=args.worker), seed=0)
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0)
    vocab = pm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.rows, args.seq + 1), generator=g) for _ in range(args.steps + 1)]
    libc = ctypes.CDLL("libc.so.6")
    rec = {"mode": args.worker, "losses": [], "peak_above_rest": []}
    for i, w in enumerate(batches):
        ids, targets = w[:, :-1], w[:, 1:]
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        rest = _rss()
        loss = pm.train_step(ids, shift_labels=targets)
        peak = _rss("VmHWM") - rest
        opt.step()
        opt.zero_grad()
        if i == 0:  # warm-up: the optimizer state is created here
            continue
        rec["losses"].append(loss.item())
        rec["peak_above_rest"].append(peak)
    rec["rest_rss"] = _rss()
    Path(args.out).write_text(json.dumps(rec))


def run_mode(mode: str, cfg_dir: Path, out: Path, args) -> dict:
    cmd = [
        "--worker",
        mode,
        "--dir",
        str(cfg_dir),
        "--out",
        str(out),
        "--rows",
        str(args.rows),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
    ]
    proc = C.python_subprocess(SCRIPT, cmd, env=C.MALLOC_ENV, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} worker failed:\n{C.tail(proc.stdout)}\n{C.tail(proc.stderr)}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one repeat; results go to results/quick/")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rows", type=int, default=2, help="rows per step (one micro-batch)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2, help="measured steps after the warm-up step, per process")
    ap.add_argument("--repeats", type=int, default=2, help="processes per mode, modes in rotating order")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (one step per mode each) after a warm-up round")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", choices=(*MODES, "timing"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        timing_worker(args) if args.worker == "timing" else worker(args)
        return 0
    if args.quick:
        args.layers, args.seq, args.repeats, args.steps, args.rounds = 2, 128, 1, 1, 1
    shape = dict(C.SMOLLM2_135M, num_hidden_layers=args.layers, **(QUICK_MODEL if args.quick else {}))
    cfg = C.llama_config(**shape)
    env = C.env_info()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_dir = Path(tmp) / "config-only"
        cfg.save_pretrained(cfg_dir)  # no weights: hf3d initialises from the seed, sharded, in every worker
        for r in range(args.repeats):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                runs[mode].append(run_mode(mode, cfg_dir, Path(tmp) / f"{mode}-{r}.json", args))
                print(f"repeat {r} {mode}: {runs[mode][-1]['peak_above_rest']}", file=sys.stderr)
        times = run_mode("timing", cfg_dir, Path(tmp) / "timing.json", args)

    summary = {}
    for mode in MODES:
        peaks = [p for rec in runs[mode] for p in rec["peak_above_rest"]]
        summary[mode] = {
            "peak_above_rest_max": max(peaks),
            "peak_above_rest_median": C.median(peaks),
            "train_step_s": C.median(times[mode]),
            "train_step_s_min": min(times[mode]),
        }
    base = summary["none"]
    for mode in MODES:
        s = summary[mode]
        s["memory_ratio"] = s["peak_above_rest_median"] / base["peak_above_rest_median"]
        s["saved_bytes"] = base["peak_above_rest_median"] - s["peak_above_rest_median"]
        s["train_step_time_ratio"] = s["train_step_s"] / base["train_step_s"]
        s["train_step_time_ratio_of_minima"] = s["train_step_s_min"] / base["train_step_s_min"]
    losses = {m: [rec["losses"] for rec in runs[m]] for m in MODES}
    same = all(losses[m] == losses["none"] for m in MODES)

    rows = [
        [
            m,
            C.mib(summary[m]["peak_above_rest_median"]),
            C.mib(summary[m]["peak_above_rest_max"]),
            f"{summary[m]['memory_ratio']:.2f}x",
            C.mib(summary[m]["saved_bytes"]),
            summary[m]["train_step_s"],
            f"{summary[m]['train_step_time_ratio']:.2f}x",
            summary[m]["train_step_s_min"],
            f"{summary[m]['train_step_time_ratio_of_minima']:.2f}x",
        ]
        for m in MODES
    ]
    headers = [
        "recompute",
        "peak above rest, MiB (median)",
        "(max)",
        "/ none",
        "saved MiB",
        "train_step s (median)",
        "/ none",
        "train_step s (fastest)",
        "/ none",
    ]
    n_steps = args.repeats * args.steps
    body = (
        f"Shape: {C.shape_str(cfg)}; {args.rows} x {args.seq} tokens per step, one micro-batch; fp32; sdpa; "
        f"AdamW. Memory: one process per mode and repeat ({args.repeats} repeats x {args.steps} measured steps = "
        f"{n_steps} steps per mode, after one warm-up step each). Time: one process, {args.rounds} rounds "
        f"of one step per mode in rotating order, after a warm-up round.\n\n"
        + C.md_table(headers, rows)
        + f"\n\n**Peak RSS of forward + backward above the RSS at rest: every_2 "
        f"{summary['every_2']['memory_ratio']:.2f}x, full {summary['full']['memory_ratio']:.2f}x of no recompute; "
        f"train_step time {summary['every_2']['train_step_time_ratio']:.2f}x and "
        f"{summary['full']['train_step_time_ratio']:.2f}x (fastest steps: "
        f"{summary['every_2']['train_step_time_ratio_of_minima']:.2f}x and "
        f"{summary['full']['train_step_time_ratio_of_minima']:.2f}x).** What stays under full recompute is "
        f"each layer's input, one layer's activations while it runs again, and the fused output head's "
        f"gradient buffers (its [vocab, hidden] weight gradient and one chunk of logits). "
        f"Losses equal across modes: {same}."
    )
    data = {
        "env": env,
        "args": vars(args),
        "shape": shape,
        "summary": summary,
        "losses_equal": same,
        "runs": runs,
        "times": times,
    }
    title = "Activation recompute: memory saved and time cost"
    path = C.write_results("recompute", title, body, data, quick=args.quick)
    print(body)
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
