"""Muon (hf3d/optim/muon.py: torch.optim.Muon on the whole hidden matrices, AdamW on the rest) against AdamW on CPU:
what its step costs, and what it buys on the README's default run.

Cost (regression guards, no targets): a SmolLM2-135M-shaped Llama (4 layers, fp32; 12 query / 4 KV heads of 48 for
its 9 / 3 of 64, the same parameters, as tp2 must divide the heads) on 2 processes at tp2 and at dp2
(ZeRO-1), `build_optimizer(pm, torch.optim.Muon, lr=0.02, momentum=0.95, weight_decay=0.1, adamw=dict(lr=3e-3,
betas=(0.9, 0.95), weight_decay=0.1), max_grad_norm=1.0)` beside `build_optimizer(pm, torch.optim.AdamW, lr=3e-3,
betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)`, in the same processes, steps interleaved in rotated order:
the time of `opt.step()` alone (after `train_step`), median of the slowest rank; the bytes handed to torch.distributed
collectives (broadcast, all_reduce, all_gather*, reduce_scatter*, all_to_all*: numel x element size of every tensor
passed, inputs and outputs both) during `opt.step()` and over the whole step (train_step included), per rank; the
per-rank bytes of `opt.memory_report()`; each also with lower-precision states (`state_precision`: bf16 for both,
torchao's 8-bit for AdamW), stepped in the same rounds.
Benefit: the default run (`examples/configs/tiny-smollm.yaml` through `hf3d train`, 2 processes; downstream evals,
samples and checkpoints off, which leaves the losses bit-identical) with AdamW at optim.lr 1.5e-3, 3e-3, 6e-3 (min_lr
lr/10, as the config's 3e-3 → 3e-4) and Muon at optim.muon.lr 0.01, 0.02, 0.04 (AdamW's part at the config's lr): the
held-out loss (the last eval_loss in metrics.jsonl) at the same final step, each optimizer's best lr beside the other's.
µP with Muon, on bench_mup.py's tiny Llama (spectral µP, one thread per run, two runs at a time): its coordinate check
(widths 64-1024, base 64, 5 steps at Muon lr 1e-2, AdamW's part at 3e-3), the per-layer activation and update RMS
spread across widths; and a proxy pair (base 128, widths 128 and 512, output multiplier 4, 300 steps of 8 x 32
tokens, seed 0) with AdamW at lr 1.5e-3, 3e-3, 6e-3 and Muon at 0.01, 0.02, 0.04: each one's best lr and held-out loss
per width.

    python benchmarks/bench_muon.py [--quick]    # ~17 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SIDES = ("adamw", "muon", "adamw-bf16", "adamw-8bit", "muon-bf16")  # optimizer[-state precision]
CLASSES, MESHES, CONFIG = {"adamw": "AdamW", "muon": "Muon"}, ("tp2", "dp2"), "examples/configs/tiny-smollm.yaml"
COLLECTIVES = (
    "broadcast all_reduce all_gather all_gather_into_tensor all_gather_single reduce_scatter reduce_scatter_tensor "
    "reduce_scatter_single all_to_all all_to_all_single"
).split()
GRID = {"adamw": (1.5e-3, 3e-3, 6e-3), "muon": (0.01, 0.02, 0.04)}
MEMORY = ("optimizer_state", "master_weights", "total")


@contextlib.contextmanager
def counted(into: dict):
    """Every torch.distributed collective of COLLECTIVES called inside: {name: bytes of the tensors passed}."""
    import torch
    import torch.distributed as dist

    def nbytes(x) -> int:
        if torch.is_tensor(x):
            return x.numel() * x.element_size()
        return sum(map(nbytes, x)) if isinstance(x, list | tuple) else 0

    def wrap(name, fn):
        def call(*args, **kw):
            into[name] = into.get(name, 0) + nbytes(args) + nbytes(list(kw.values()))
            return fn(*args, **kw)

        return call

    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield into
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def worker(model_dir: str, mesh: str, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()
    torch.set_num_threads(1)
    pcfg = hf3d.ParallelConfig(tp=2) if mesh == "tp2" else hf3d.ParallelConfig(dp=2, zero_stage=1)
    pms = {s: hf3d.parallelize(model_dir, pcfg) for s in SIDES}
    adamw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    muon = dict(lr=0.02, momentum=0.95, weight_decay=0.1, adamw=adamw)
    opts = {}
    for s in SIDES:  # "adamw", "muon", or either with "-<state precision>"
        name, _, precision = s.partition("-")
        kw = dict(adamw if name == "adamw" else muon, max_grad_norm=1.0, state_precision=precision or "fp32")
        opts[s] = hf3d.build_optimizer(pms[s], getattr(torch.optim, CLASSES[name]), **kw)
    g, rec = torch.Generator().manual_seed(0), {s: {"times": []} for s in SIDES}
    for r in range(rounds + 1):  # round 0 warms up (and makes the optimizer state)
        ids = torch.randint(0, pms["adamw"].config.vocab_size, (4, 128), generator=g)
        for s in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
            step, whole = {}, {}
            with counted(whole):
                pms[s].train_step(ids, ids)
            dist.barrier()
            t0 = time.perf_counter()
            with counted(step):
                opts[s].step()
            rec[s]["times"].append(time.perf_counter() - t0)
            rec[s]["step_bytes"] = step
            rec[s]["whole_bytes"] = {k: whole.get(k, 0) + step.get(k, 0) for k in whole.keys() | step.keys()}
            opts[s].zero_grad()
    for s in SIDES:
        rec[s]["memory"] = opts[s].memory_report()
    rec["muon_matrices"] = sum(len(mg.whole) for mg in opts["muon"].matrices)
    C.write_rank(out, rec)


def cost(cfg, rounds: int) -> dict:
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench_muon_"))
    try:
        out = {"params": C.save_model_dir(cfg, work / "model", dtype=torch.float32)}
        for mesh in MESHES:
            recs = C.run_workers(Path(__file__), 2, ["--worker", str(work / "model"), mesh, str(rounds)], work / mesh)
            m = {"muon_matrices_stepped": [r["muon_matrices"] for r in recs]}
            for s in SIDES:
                m[s] = {
                    "median_step_s": C.median([max(r[s]["times"][i] for r in recs) for i in range(1, rounds + 1)]),
                    "step_bytes": [sum(r[s]["step_bytes"].values()) for r in recs],
                    "whole_step_bytes": [sum(r[s]["whole_bytes"].values()) for r in recs],
                    "step_bytes_by_collective": [r[s]["step_bytes"] for r in recs],
                    "memory": [r[s]["memory"] for r in recs],
                }
            m["muon_over_adamw"] = m["muon"]["median_step_s"] / m["adamw"]["median_step_s"]
            out[mesh] = m
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def train(side: str, lr: float, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        settings = [f"run.output_dir={tmp}/run", "evals.tasks=[]", "samples.prompts=[]", "checkpoint.every=0"]
        adamw = [f"optim.lr={lr}", f"optim.min_lr={lr / 10}"]  # the config's 3e-3 → 3e-4, scaled
        settings += ["optim.name=muon", f"optim.muon.lr={lr}"] if side == "muon" else adamw
        if quick:
            settings += ["run.steps=10", "optim.warmup_steps=2", "data.eval.every=5"]
        proc, wall = C.hf3d_train(CONFIG, settings)
        if proc.returncode != 0:
            sys.exit(f"hf3d train {' '.join(settings[4:])} failed (exit {proc.returncode}):\n{C.tail(proc.stderr, 40)}")
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_loss" in r][-1]
    return {"lr": lr, "eval_loss": last["eval_loss"], "eval_step": last["step"], "steps": records[-1]["step"],
            "last_loss": records[-1]["loss"], "wall_s": wall, "settings": settings[1:]}  # fmt: skip


# -- µP with Muon: the coordinate check and a proxy pair (bench_mup.py's tiny Llama, data and pool) -----------------
MUP = dict(coord=dict(widths=[64, 128, 256, 512, 1024], base=64, steps=5, lr=1e-2, batch=8, seq=64),
           pair=dict(widths=[128, 512], base=128, steps=300, batch=8, seq=32, alpha=4.0,
                     lrs={"adamw": (1.5e-3, 3e-3, 6e-3), "muon": (0.01, 0.02, 0.04)}))  # fmt: skip
MUP_QUICK = dict(coord=dict(widths=[32, 64], base=32, steps=2, lr=1e-2, batch=2, seq=16),
                 pair=dict(widths=[32, 64], base=32, steps=4, batch=2, seq=16, alpha=4.0,
                           lrs={"adamw": (3e-3,), "muon": (0.02,)}))  # fmt: skip


def mup_build(root, width: int, base: int, side: str, lr: float, clip, alpha: float = 1.0):
    """bench_mup's model at `width` under spectral µP (base width `base`), with AdamW at `lr`, or Muon at `lr` and
    AdamW's part at bench_mup's proxy best (3e-3)."""
    import bench_mup as M
    import torch

    import hf3d

    pcfg = hf3d.ParallelConfig(parametrization="spectral_mup", mup_base_width=base, mup_output_multiplier=alpha)
    pm = hf3d.parallelize(M.model_dir(root, width), pcfg, seed=0)
    kw = dict(lr=lr, betas=M.BETAS, weight_decay=0.0)
    if side == "muon":
        kw = dict(lr=lr, weight_decay=0.0, adamw=dict(kw, lr=3e-3))
    return pm, hf3d.build_optimizer(pm, getattr(torch.optim, CLASSES[side]), max_grad_norm=clip, **kw)


def mup_coord_run(task: tuple) -> tuple:
    """bench_mup's coordinate check of one width, with Muon (constant lr, no clipping)."""
    import bench_mup as M

    width, c = task
    train, held = M.token_rows(c["seq"])
    probe = held[: c["batch"]]
    with tempfile.TemporaryDirectory() as tmp:
        pm, opt = mup_build(Path(tmp), width, c["base"], "muon", c["lr"], None)
        start = M.outputs(pm, probe)
        rec = {k: {"activation": [M.rms(v)], "update": [0.0]} for k, v in start.items()}
        for step in range(c["steps"]):
            rows = train[step * c["batch"] : (step + 1) * c["batch"]]
            pm.train_step(rows, rows)
            opt.step()
            opt.zero_grad()
            for k, v in M.outputs(pm, probe).items():
                rec[k]["activation"].append(M.rms(v))
                rec[k]["update"].append(M.rms(v - start[k]))
    return width, rec


def mup_pair_run(task: tuple) -> tuple:
    """One (optimizer, width, lr) of the proxy pair: bench_mup's sweep run (warm-up, cosine, clip 1.0); its loss."""
    import math

    import bench_mup as M
    import torch

    side, width, lr, p = task
    train, held = M.token_rows(p["seq"], 0)
    warmup = max(1, p["steps"] // 10)

    def factor(step: int) -> float:
        t = (step - warmup) / max(1, p["steps"] - warmup)
        return (step + 1) / warmup if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    with tempfile.TemporaryDirectory() as tmp:
        pm, opt = mup_build(Path(tmp), width, p["base"], side, lr, 1.0, p["alpha"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        for step in range(p["steps"]):
            rows = train[(step * p["batch"]) % len(train) :][: p["batch"]]
            pm.train_step(rows, rows)
            opt.step()
            opt.zero_grad()
            sched.step()
        total, n = pm.eval_loss(held, labels=held)
    loss = float(total / n)
    return side, width, lr, loss if math.isfinite(loss) else None


def mup_parts(m: dict) -> dict:
    import bench_mup as M

    coord = {
        "muon": {str(w): rec for w, rec in M.in_pool(mup_coord_run, [(w, m["coord"]) for w in m["coord"]["widths"]])}
    }
    p = m["pair"]
    tasks = [(side, w, lr, p) for w in reversed(p["widths"]) for side, lrs in p["lrs"].items() for lr in lrs]
    pair: dict = {}
    for side, w, lr, loss in M.in_pool(mup_pair_run, tasks):
        pair.setdefault(side, {}).setdefault(str(w), {})[repr(lr)] = loss
    spread = M.spread(coord, "muon", "activation") | {
        f"{k} update": v for k, v in M.spread(coord, "muon", "update").items()
    }
    return dict(
        coord=coord,
        spread=spread,
        pair=pair,
        best={s: {w: M.best(c) for w, c in by_w.items()} for s, by_w in pair.items()},
    )


def _mib(xs: list) -> str:
    return " / ".join(f"{C.mib(x):.2f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 layer, 2 rounds; 10 steps, two lrs each: a smoke run")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL", "MESH", "ROUNDS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], int(args.worker[2]), args.out)
    # 12 query / 4 KV heads of 48 for SmolLM2's 9 / 3 of 64: tp2 must divide them; the same parameters
    shape = {"num_hidden_layers": 1 if args.quick else 4, "num_attention_heads": 12, "num_key_value_heads": 4}
    cfg = C.llama_config(**{**C.SMOLLM2_135M, **shape})
    rounds = 2 if args.quick else 10
    grid = {s: lrs[:: 2 if args.quick else 1] for s, lrs in GRID.items()}
    d = {"env": C.env_info(), "model": C.shape_str(cfg), "rounds": rounds, "config": CONFIG}
    d["cost"] = cost(cfg, rounds)
    d["grid"] = {s: [train(s, lr, args.quick) for lr in lrs] for s, lrs in grid.items()}
    d["best"] = {s: min(runs, key=lambda r: r["eval_loss"]) for s, runs in d["grid"].items()}
    d["muon_best_minus_adamw_best"] = d["best"]["muon"]["eval_loss"] - d["best"]["adamw"]["eval_loss"]
    d["mup"] = mup_parts(MUP_QUICK if args.quick else MUP)

    c = d["cost"]
    body = f"Model: {d['model']} ({c['params'] / 1e6:.1f}M params, fp32), 2 processes. Muon steps "
    body += f"{c['tp2']['muon_matrices_stepped'][0]} hidden matrices whole (per rank at tp2; at dp2 split between the "
    body += f"ranks as {' + '.join(map(str, c['dp2']['muon_matrices_stepped']))}), AdamW the rest.\n\n"
    body += f"## Cost of the step (median of {rounds} interleaved rounds, slowest rank; MiB per rank, rank 0 / 1)\n\n"
    rows = []
    for mesh in MESHES:
        for s in SIDES:
            m, mem = c[mesh][s], c[mesh][s]["memory"]
            ratio = f"{m['median_step_s'] / c[mesh]['adamw']['median_step_s']:.2f}x"
            rows.append([mesh, s.partition("-")[0], 1e3 * m["median_step_s"], ratio,
                         _mib(m["step_bytes"]), _mib(m["whole_step_bytes"]),
                         *(_mib([x[k] for x in mem]) for k in MEMORY), s.partition("-")[2] or "fp32"])  # fmt: skip
    heads = ["mesh", "optimizer", "opt.step() ms", "over AdamW", "collectives in opt.step() MiB",
             "collectives in the whole step MiB", *(f"{k} MiB" for k in MEMORY), "states"]  # fmt: skip
    body += C.md_table(heads, rows)
    steps = d["best"]["adamw"]["eval_step"]
    body += f"\n\n## The default run's held-out loss at step {steps} (`{CONFIG}`, `hf3d train`, 2 processes)\n\n"
    body += C.md_table(["optimizer", "best lr", f"held-out loss at step {steps}"],
                       [[s, f"{b['lr']:g}", b["eval_loss"]] for s, b in d["best"].items()])  # fmt: skip
    body += f"\n\nMuon's best minus AdamW's best: {d['muon_best_minus_adamw_best']:+.3f}.\n\nThe grid:\n\n"
    body += C.md_table(["optimizer", "lr", "held-out loss", "last training loss", "wall s"],
                       [[s, f"{r['lr']:g}", r["eval_loss"], r["last_loss"], r["wall_s"]]
                        for s, runs in d["grid"].items() for r in runs])  # fmt: skip
    mp, pair = d["mup"], (MUP_QUICK if args.quick else MUP)["pair"]
    worst = max(mp["spread"].values())
    body += "\n\n## µP with Muon (`bench_mup.py`'s tiny Llama, spectral µP, one process each)\n\n"
    body += f"Coordinate check, widths {', '.join(mp['coord']['muon'])}: the per-layer activation and update RMS "
    body += f"spread {worst:.2f}x across widths at the last step ({C.verdict(worst, 2.0)} µP's ≤ 2x).\n\n"
    body += f"Proxy pair (base width {pair['base']}, output multiplier {pair['alpha']:g}, {pair['steps']} steps, "
    body += "seed 0): each optimizer's best lr at each width and its held-out loss\n\n"
    body += C.md_table(["optimizer", *(f"width {w}: best lr, loss" for w in pair["widths"])],
                       [[s, *(f"{b[str(w)][0]:g}, {b[str(w)][1]:.4f}" for w in pair["widths"])]
                        for s, b in mp["best"].items()])  # fmt: skip
    print(C.write_results("muon", "Muon hybrid against AdamW: step cost and the default run's loss, CPU", body, d,
                          quick=args.quick))  # fmt: skip
    print(body)


if __name__ == "__main__":
    main()
