"""Scaling: tokens/s and peak memory per rank as a Llama-shaped model grows, at tp=2 and at pp=2; weak
scaling over dp 1 -> 2 -> 4; and how much of a dp step is communication.

(1) Model sizes along hidden 256 -> 1024 and layers 4 -> 16 (head_dim 64, kv heads = heads/2 so tp=2 is
    valid, inter ~ 8/3 hidden, vocab 8192, untied, fp32, sdpa). Each mode is one torchrun job of 2
    processes (gloo, one thread each) that runs the sizes one after another: tp=2 with one micro-batch,
    pp=2 with 1f1b and 4 micro-batches of one row, the same global batch. Tokens/s = global batch tokens /
    median step time (the slower rank's time of each step). Peak memory per rank = VmHWM − the RSS
    before the model was built, over the timed steps (VmHWM reset after the first step, glibc's mmap
    threshold fixed — see bench_memory_model.py), next to benchmarks/memory_model.py's prediction.
    The exponents are least-squares slopes of log tokens/s and log peak memory against log params.
(2) dp = 1, 2, 4 with fixed rows per dp rank (weak scaling), ZeRO-1 AdamW, the dp collective hf3d picks
    on gloo (all_to_all). 4 processes on 2 cores oversubscribe the CPU: dp=4 measures sharing as much
    as scaling. Communication is measured three ways in the same processes, steps interleaved:
    (a) "exposed": wall time inside `opt.finish_grad_sync` (waits for the bucket collectives that
        overlap the backward) and `opt._write_back` (the ZeRO-1 param gather) of a normal step;
    (b) "no-op": the same step with every collective on the dp group replaced by a no-op; real − no-op
        is the whole cost of dp communication, including CPU time gloo's threads take from the backward;
    (c) "sync": a second model built with overlap_grad_reduce=False, where every grad collective runs
        inside finish_grad_sync, so that time plus the all-gather is the collectives' own duration.

    python benchmarks/bench_scaling.py            # 4 sizes x (tp=2, pp=2) + dp 1/2/4 (~5-6 min on 2 cores)
    python benchmarks/bench_scaling.py --quick    # smoke: 2 tiny sizes, dp 1/2; results/quick/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import memory_model as MM
from bench_memory_model import reset_peak_rss, trim, warm_up

SCRIPT = Path(__file__).resolve()
SIZES = [(256, 4), (512, 8), (768, 12), (1024, 16)]  # (hidden, layers)
QUICK_SIZES = [(64, 2), (128, 2)]
VOCAB = 8192
LR, WD, CLIP = 1e-4, 0.1, 1.0


def size_config(hidden: int, layers: int, *, head_dim: int = 64, vocab: int = VOCAB):
    heads = hidden // head_dim
    return C.llama_config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        intermediate_size=-(-8 * hidden // 3 // 128) * 128,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )


# =================================================================================================
# workers (under torchrun)
# =================================================================================================
def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _batch(spec, dp_rank: int, dp: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (spec["global_rows"], spec["seq"]), generator=g)
    rows = spec["global_rows"] // dp
    return ids[dp_rank * rows : (dp_rank + 1) * rows]


def worker_sizes(spec) -> dict:
    """One mode (tp=2 or pp=2) over every model size, one after another in the same processes."""
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()

    tp, pp, m = spec["tp"], spec["pp"], spec["microbatches"]

    def pcfg():
        return hf3d.ParallelConfig(tp=tp, pp=pp, num_microbatches=m, pp_schedule="1f1b")

    warm_up(spec["tiny"], pcfg())
    out = []
    for model_dir in spec["models"]:
        trim()
        base = C.proc_status()["VmRSS"]
        pmodel = hf3d.parallelize(model_dir, pcfg(), seed=0)
        opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=LR, weight_decay=WD, max_grad_norm=CLIP)
        ids = _batch(spec, 0, 1, pmodel.config.vocab_size)
        times, losses = [], []
        for i in range(spec["warmup"] + spec["steps"]):
            if i == spec["warmup"]:
                trim()
                reset_peak_rss()
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(float(pmodel.train_step(ids, ids)))
            opt.step()
            opt.zero_grad()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
        peak = C.proc_status()["VmHWM"] - base
        out.append({"times": times, "peak_bytes": peak, "losses": losses, "pp_rank": pmodel.pp_rank})
        del pmodel, opt
    return {"ranks": _gather(out)}


class NoOpDP:
    """While active, collectives on the dp group return at once without communicating."""

    OPS = ("all_reduce", "reduce_scatter_single", "all_gather_single", "all_to_all_single", "broadcast")

    def __init__(self):
        import torch.distributed as dist

        self.active, self.group = False, None

        class _Done:
            def wait(self, *a, **k):
                return True

        for op in self.OPS:
            orig = getattr(dist, op)

            def wrapped(*args, _orig=orig, **kwargs):
                if self.active and kwargs.get("group") is self.group:
                    return _Done() if kwargs.get("async_op") else None
                return _orig(*args, **kwargs)

            setattr(dist, op, wrapped)


def worker_dp(spec) -> dict:
    """Weak scaling at this world's dp, and three measures of dp communication (module docstring)."""
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()

    noop = NoOpDP()
    built = {}
    for name, overlap in (("real", True), ("sync", False)):
        pmodel = hf3d.parallelize(spec["models"][0], hf3d.ParallelConfig(), seed=0)
        opt = hf3d.build_optimizer(
            pmodel, torch.optim.AdamW, lr=LR, weight_decay=WD, max_grad_norm=CLIP, overlap_grad_reduce=overlap
        )
        clock = {"comm": 0.0}
        for meth in ("finish_grad_sync", "_write_back"):
            orig = getattr(opt, meth)

            def timed(*a, _orig=orig, _clock=clock, **k):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    _clock["comm"] += time.perf_counter() - t0

            setattr(opt, meth, timed)
        built[name] = (pmodel, opt, clock)
    noop.group = built["real"][0].mesh.get_group("dp")
    dp, dp_rank = built["real"][0].dp_size, built["real"][0].dp_rank
    ids = _batch(spec, dp_rank, dp, built["real"][0].config.vocab_size)
    variants = ["real", "noop", "sync"] if dp > 1 else ["real"]
    rec = {v: {"step": [], "comm": []} for v in variants}
    for r in range(spec["warmup"] + spec["steps"]):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            pmodel, opt, clock = built["sync" if v == "sync" else "real"]
            noop.active = v == "noop"
            clock["comm"] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            pmodel.train_step(ids, ids)
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            noop.active = False
            if r >= spec["warmup"]:
                rec[v]["step"].append(dt)
                rec[v]["comm"].append(clock["comm"])
    return {"ranks": _gather(rec), "dp": dp, "collective": built["real"][1].dp_collective}


def run_worker(kind: str, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = {"sizes": worker_sizes, "dp": worker_dp}[kind](spec)
        if dist.get_rank() == 0:
            Path(spec["out"]).write_text(json.dumps(result, default=str))
        dist.barrier()
        C.leave_distributed()
    finally:
        dist.destroy_process_group()


# =================================================================================================
# the parent: launch, fit, plot, report
# =================================================================================================
def launch(kind: str, nproc: int, spec: dict, out: Path, timeout: float) -> tuple[dict | None, str]:
    spec = dict(spec, out=str(out))
    t0 = time.perf_counter()
    try:
        proc = C.torchrun(
            SCRIPT, nproc, ["--worker", kind, "--spec", json.dumps(spec)], timeout=timeout, env=C.MALLOC_ENV
        )
    except Exception as e:  # a hang
        return None, f"{type(e).__name__}: {e}"
    print(f"  [{out.stem}] {nproc} processes, {time.perf_counter() - t0:.0f}s, rc {proc.returncode}", flush=True)
    if proc.returncode != 0 or not out.exists():
        return None, C.tail(proc.stderr, 30)
    return json.loads(out.read_text()), ""


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    var = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / var if var else float("nan")


def summarize_sizes(res: dict, configs: list, mode: str, spec: dict) -> list[dict]:
    from hf3d.metrics import flops_per_token

    rows = []
    tokens = spec["global_rows"] * spec["seq"]
    for i, cfg in enumerate(configs):
        ranks = [r[i] for r in res["ranks"]]
        step = [max(r["times"][k] for r in ranks) for k in range(len(ranks[0]["times"]))]
        shape = MM.Shape.from_config(cfg)
        tp, pp = (2, 1) if mode == "tp" else (1, 2)
        run = MM.Run(
            tp=tp,
            pp=pp,
            microbatches=spec["microbatches"],
            rows=spec["global_rows"] // spec["microbatches"],
            seq=spec["seq"],
            schedule="1f1b",
        )
        pred = MM.predict(shape, run)
        rows.append(
            {
                "mode": mode,
                "hidden": cfg.hidden_size,
                "layers": cfg.num_hidden_layers,
                "params": shape.params(),
                "step_s": C.median(step),
                "tokens_per_s": tokens / C.median(step),
                "gflops_per_s": tokens / C.median(step) * flops_per_token(cfg, spec["seq"]) / 1e9,
                "peak_bytes_worst_rank": max(r["peak_bytes"] for r in ranks),
                "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
                "predicted_peak_worst_rank": pred["worst_total"],
                "first_loss": ranks[0]["losses"][0],
                "step_samples": step,
            }
        )
    return rows


def summarize_dp(results: dict, spec: dict) -> list[dict]:
    rows = []
    base = None
    for dp, res in sorted(results.items()):
        if res is None:
            continue
        per_rank = res["ranks"]
        out = {"dp": dp, "collective": res["collective"]}
        for v in per_rank[0]:
            step = [max(r[v]["step"][k] for r in per_rank) for k in range(len(per_rank[0][v]["step"]))]
            comm = [max(r[v]["comm"][k] for r in per_rank) for k in range(len(per_rank[0][v]["comm"]))]
            out[v] = {"step_s": C.median(step), "comm_s": C.median(comm), "samples": step}
        tokens = dp * spec["rows_per_dp"] * spec["seq"]
        out["tokens_per_s"] = tokens / out["real"]["step_s"]
        base = base or out["tokens_per_s"]
        out["efficiency"] = out["tokens_per_s"] / (dp * base)
        out["efficiency_per_core"] = out["tokens_per_s"] / (min(dp, os.cpu_count() or 1) * base)
        rows.append(out)
    return rows


def plot(rows: list[dict], slopes: dict, dp_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for mode, marker, color in (("tp", "o", "tab:blue"), ("pp", "s", "tab:orange")):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        x = [r["params"] / 1e6 for r in rs]
        axes[0].loglog(
            x,
            [r["tokens_per_s"] for r in rs],
            marker=marker,
            color=color,
            label=f"{mode}=2 (slope {slopes[mode]['tokens_per_s']:.2f})",
        )
        axes[1].loglog(
            x,
            [r["peak_bytes_worst_rank"] / 2**20 for r in rs],
            marker=marker,
            color=color,
            label=f"{mode}=2 measured (slope {slopes[mode]['peak_memory']:.2f})",
        )
        axes[1].loglog(
            x,
            [r["predicted_peak_worst_rank"] / 2**20 for r in rs],
            ls="--",
            marker=marker,
            color=color,
            mfc="none",
            label=f"{mode}=2 memory model",
        )
    axes[0].set(xlabel="parameters (M)", ylabel="tokens/s (2 processes)", title="throughput vs size")
    axes[1].set(xlabel="parameters (M)", ylabel="peak RSS per rank above baseline (MiB)", title="peak memory vs size")
    if dp_rows:
        d = [r["dp"] for r in dp_rows]
        axes[2].plot(d, [r["tokens_per_s"] for r in dp_rows], marker="o", label="measured")
        axes[2].plot(d, [dp_rows[0]["tokens_per_s"] * x for x in d], ls=":", label="linear")
        axes[2].set(xlabel="dp (fixed rows per rank)", ylabel="tokens/s", title="weak scaling (2 cores)")
        axes[2].set_xticks(d)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows, slopes, dp_rows, spec, dp_model) -> str:
    size_table = C.md_table(
        [
            "mode",
            "hidden × layers",
            "params",
            "step s (median)",
            "tokens/s",
            "GFLOP/s (2 procs)",
            "peak MiB per rank (worst)",
            "memory model MiB",
            "model error",
        ],
        [
            [
                f"{r['mode']}=2",
                f"{r['hidden']} × {r['layers']}",
                f"{r['params'] / 1e6:.1f} M",
                f"{r['step_s']:.3f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['gflops_per_s']:.1f}",
                f"{C.mib(r['peak_bytes_worst_rank']):.1f}",
                f"{C.mib(r['predicted_peak_worst_rank']):.1f}",
                f"{r['predicted_peak_worst_rank'] / r['peak_bytes_worst_rank'] - 1:+.1%}",
            ]
            for r in rows
        ],
    )
    slope_table = C.md_table(
        ["mode", "d log tokens/s / d log params", "d log peak memory / d log params"],
        [[f"{k}=2", f"{v['tokens_per_s']:.3f}", f"{v['peak_memory']:.3f}"] for k, v in slopes.items()],
    )
    dp_table = C.md_table(
        [
            "dp",
            "step s (real)",
            "tokens/s",
            "efficiency vs dp × dp=1",
            "per core (min(dp, cores))",
            "exposed comm s (a)",
            "step s with no-op dp collectives (b)",
            "comm share (real − no-op) / real",
            "collectives s, overlap off (c)",
            "share of the overlap-off step",
        ],
        [
            [
                r["dp"],
                f"{r['real']['step_s']:.3f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['efficiency']:.2f}",
                f"{r['efficiency_per_core']:.2f}",
                f"{r['real']['comm_s']:.3f}",
                f"{r['noop']['step_s']:.3f}" if "noop" in r else "—",
                f"{(r['real']['step_s'] - r['noop']['step_s']) / r['real']['step_s']:.1%}" if "noop" in r else "—",
                f"{r['sync']['comm_s']:.3f}" if "sync" in r else "—",
                f"{r['sync']['comm_s'] / r['sync']['step_s']:.1%}" if "sync" in r else "—",
            ]
            for r in dp_rows
        ],
    )
    cores = os.cpu_count() or 1
    top = max((r["dp"] for r in dp_rows), default=1)
    collective = dp_rows[0]["collective"] if dp_rows else "?"
    return f"""## Model size at tp=2 and pp=2

Global batch {spec["global_rows"]} rows × {spec["seq"]} tokens per step; tp=2 one micro-batch; pp=2 1f1b with
{spec["microbatches"]} micro-batches; {spec["warmup"]} warm-up + {spec["steps"]} timed steps per size; fp32,
ZeRO-1 AdamW, 2 processes × 1 thread, gloo. GFLOP/s uses hf3d.metrics.flops_per_token (6N + attention).

{size_table}

Fitted exponents (least squares over the {len(rows) // max(1, len(slopes))} sizes):

{slope_table}

Plot: `results/scaling.png` (log-log; dashed = benchmarks/memory_model.py).

## Weak scaling over dp and the share of communication

Model {dp_model}; {spec["rows_per_dp"]} rows × {spec["seq"]} tokens per dp rank; ZeRO-1 AdamW, dp collective
`{collective}` (hf3d's choice on gloo); {spec["warmup"]} warm-up + {spec["steps"]} timed rounds, variants
interleaved in the same processes. **{cores} CPU cores**: dp={top} runs {top} single-thread processes, so
beyond dp={cores} the CPU is oversubscribed and "efficiency" measures core sharing more than hf3d; the
per-core column divides by min(dp, cores) instead.

{dp_table}

(a) wall time inside `finish_grad_sync` + `_write_back` of a normal step (overlap on): what the step waits for;
(b) the same step with dp collectives replaced by no-ops (numerically wrong, timed only); (c) a second model with
overlap_grad_reduce=False: every grad collective runs inside finish_grad_sync."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke: two tiny sizes, dp 1 and 2; results/quick/")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-rows", type=int, default=4, help="rows per step, size sweep")
    ap.add_argument("--microbatches", type=int, default=4, help="pp=2 micro-batches")
    ap.add_argument("--rows-per-dp", type=int, default=2, help="rows per dp rank, weak scaling")
    ap.add_argument("--dp-size", default="512,8", help="hidden,layers of the dp model")
    ap.add_argument("--dps", default="1,2,4")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, json.loads(args.spec)) or 0
    sizes, head_dim = SIZES, 64
    if args.quick:
        sizes, head_dim, args.seq, args.dps, args.dp_size, args.steps = QUICK_SIZES, 32, 32, "1,2", "64,2", 1

    env = C.env_info()
    env["worker_threads"] = 1
    env.update(C.MALLOC_ENV)
    configs = [size_config(h, n, head_dim=head_dim) for h, n in sizes]
    dp_h, dp_l = (int(x) for x in args.dp_size.split(","))
    dp_cfg = size_config(dp_h, dp_l, head_dim=head_dim)
    spec = {
        "seq": args.seq,
        "global_rows": args.global_rows,
        "rows_per_dp": args.rows_per_dp,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    data = {"env": env, "args": vars(args), "failures": {}}
    t_all = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmpdir:
        tmp = Path(tmpdir)
        dirs = []
        for cfg in configs:
            d = tmp / f"h{cfg.hidden_size}-l{cfg.num_hidden_layers}"
            cfg.save_pretrained(d)  # config only: hf3d initialises its shards from the seed
            dirs.append(str(d))
        (tmp / "dp").mkdir()
        dp_cfg.save_pretrained(tmp / "dp")
        size_config(64, 4, head_dim=16, vocab=64).save_pretrained(tmp / "tiny")
        for mode, tp, pp, m in (("tp", 2, 1, 1), ("pp", 1, 2, args.microbatches)):
            s = dict(spec, models=dirs, tp=tp, pp=pp, microbatches=m, tiny=str(tmp / "tiny"))
            results[mode], err = launch("sizes", 2, s, tmp / f"sizes-{mode}.json", args.timeout)
            if results[mode] is None:
                data["failures"][f"{mode}=2"] = err
                print(err, flush=True)
        dp_res = {}
        for dp in (int(x) for x in args.dps.split(",")):
            s = dict(spec, models=[str(tmp / "dp")], global_rows=dp * args.rows_per_dp)
            dp_res[dp], err = launch("dp", dp, s, tmp / f"dp{dp}.json", args.timeout)
            if dp_res[dp] is None:
                data["failures"][f"dp={dp}"] = err
                print(err, flush=True)

    rows = []
    for mode in ("tp", "pp"):
        if results.get(mode):
            m = 1 if mode == "tp" else args.microbatches
            rows += summarize_sizes(results[mode], configs, mode, dict(spec, microbatches=m))
    slopes = {}
    for mode in ("tp", "pp"):
        rs = [r for r in rows if r["mode"] == mode]
        if len(rs) >= 2:
            p = [r["params"] for r in rs]
            slopes[mode] = {
                "tokens_per_s": fit_slope(p, [r["tokens_per_s"] for r in rs]),
                "peak_memory": fit_slope(p, [r["peak_bytes_worst_rank"] for r in rs]),
            }
    dp_rows = summarize_dp(dp_res, spec)
    data.update(sizes=rows, slopes=slopes, dp=dp_rows, wall_s=time.perf_counter() - t_all)
    out_dir = C.RESULTS / "quick" if args.quick else C.RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        plot(rows, slopes, dp_rows, out_dir / "scaling.png")
    except ImportError as e:  # matplotlib is in the dev extra
        print(f"no plot: {e} (pip install matplotlib)", flush=True)
        data["plot"] = f"not drawn: {e}"
    dp_model = f"{C.shape_str(dp_cfg)}, {MM.Shape.from_config(dp_cfg).params() / 1e6:.1f} M params"
    body = report(rows, slopes, dp_rows, dict(spec, microbatches=args.microbatches), dp_model)
    body += f"\n\nTook {data['wall_s']:.0f} s."
    if data["failures"]:
        body += "\n\n## Failures\n\n" + "\n\n".join(f"{k}:\n```\n{v}\n```" for k, v in data["failures"].items())
    print(body)
    path = C.write_results(
        "scaling", "Scaling with model size, tp=2 / pp=2, and dp weak scaling", body, data, quick=args.quick
    )
    print(f"wrote {path} and {out_dir / 'scaling.png'}")
    return 1 if data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
