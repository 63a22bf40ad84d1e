"""What a rank holds at ZeRO-1, 2 and 3 (dp=4, and the totals at dp=8), and the step time they cost (dp=2), on CPU.

A SmolLM2-135M-shaped Llama (4 layers, fp32, AdamW, 1M-element buckets) trains at each stage. Memory: in the third
step every rank samples what it holds from the run's own tensors, each storage once (weights: the parameters as
registered now; fp32 gradients: hf3d's flat tensor and filling buckets, or every .grad; optimizer state), before each
layer's forward, as its backward begins, as each gradient enters a bucket, and after the step; the figures after the
step stand beside the arithmetic for N parameters (ZeRO-1 4N + 4N + 2N bytes, ZeRO-2 4N + N + 2N, ZeRO-3 N + N + 2N);
ZeRO-3's peak weights (a prefetched layer's all-gather counted) beside hf3d's count: shards + fsdp.gathered_bytes.
Targets as the issue set them: ZeRO-3 at most 0.3x ZeRO-1 (the arithmetic is 2/(dp + 1): 0.4x at dp=4, so the
same run at dp=8, 2/9, shows the ratio where the arithmetic allows 0.3x); ZeRO-2's
peak gradients at most 1/dp + one bucket (its largest, as a parameter is never split, plus the norms' small one).
Speed: the three stages side by side, steps interleaved in rotated order, median of the slowest rank (guards only).

    python benchmarks/bench_sharding.py [--quick]    # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import _common as C

STAGES, KEYS, BUCKET = (1, 2, 3), ("weights", "gradients", "optimizer_state"), 2**20


def held(pm, opt) -> dict[str, int]:
    import torch

    seen: set[int] = set()

    def size(t) -> int:  # a storage counted once; a DTensor by its shard
        s = None if t is None else getattr(t, "_local_tensor", t).untyped_storage()
        if s is None or s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    params, masters = [p for _, p in pm.hf_model.named_parameters()], [m for _, m, _, _ in opt._masters]
    weights = sum(map(size, params)) + (sum(map(size, masters)) if opt.zero_stage == 3 else 0)  # ZeRO-3: shards
    groups = [g[0]._get_fsdp_state()._fsdp_param_group for g in getattr(pm, "fsdp_modules", [])]  # ZeRO-3's gathers
    weights += sum(size(g._all_gather_result.all_gather_output) for g in groups if g and g._all_gather_result)
    grads = sum(size(p.grad) for p in params) + size(getattr(opt, "main_grad", None))
    grads += sum(size(b.staging) + size(b.work and b.work[1]) for b in getattr(opt, "buckets", []))
    state = [t for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    out = dict(zip(KEYS, (weights, grads, sum(map(size, state + masters)))))
    return out | {"total": sum(out.values())}


def _sampled(pm, opt, samples: list) -> list:
    def take(*_) -> None:
        samples.append(held(pm, opt))

    def at_backward(_module, _inputs, output) -> None:  # a forward hook returning nothing keeps the output
        output.register_hook(take)

    plain = [p for p in pm.hf_model.parameters() if not hasattr(p, "_local_tensor")]  # FSDP2's take no such hook
    handles = [p.register_post_accumulate_grad_hook(take) for p in plain]
    for layer in (layer for stage in pm.stages for layer in stage.layers):
        handles += [layer.register_forward_pre_hook(take), layer.register_forward_hook(at_backward)]
    return handles


def _record(pm, opt, samples: list) -> dict:
    """After the step and the peak of the samples, with what the arithmetic needs: N and the buckets."""
    from hf3d.parallel.fsdp import gathered_bytes  # ZeRO-3: what hf3d counts as gathered at the peak

    buckets = getattr(opt, "buckets", [])
    return {
        "counted_peak_weights": samples[-1]["weights"] + gathered_bytes(pm),
        "after": samples[-1],
        "peak": {k: max(x[k] for x in samples) for k in samples[-1]},
        "numel": sum(p.numel() for p in pm.hf_model.parameters()),
        "bucket": max((b.numel for b in buckets), default=0),  # the largest: a parameter is never split
        "vectors": sum(b.numel for b in buckets if all(p.dim() <= 1 for p in b.params)),  # norm weights, biases
    }


def worker(model_dir: str, out: str, memory: bool, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()
    torch.set_num_threads(1)
    g, rec = torch.Generator().manual_seed(0), {"times": {s: [] for s in STAGES}}
    pcfgs = {s: hf3d.ParallelConfig(zero_stage=s, num_microbatches=2 if memory else 1) for s in STAGES}
    pms = {s: hf3d.parallelize(model_dir, pcfg) for s, pcfg in pcfgs.items()}
    opts = {s: hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4, bucket_size=BUCKET) for s, pm in pms.items()}
    for r in range(3 if memory else rounds + 1):  # speed: round 0 warms up
        for s in STAGES[r % 3 :] + STAGES[: r % 3]:
            pm, opt, samples = pms[s], opts[s], []
            handles = _sampled(pm, opt, samples) if memory and r == 2 else []
            ids = torch.randint(0, pm.config.vocab_size, (4, 128), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step(ids, ids)
            opt.step()
            rec["times"][s].append(time.perf_counter() - t0)
            if handles:  # after the step, before zero_grad: the gradients are still held
                samples.append(held(pm, opt))
                rec[s] = _record(pm, opt, samples)
            for h in handles:
                h.remove()
            opt.zero_grad()
    C.write_rank(out, rec)


def _memory_rows(worst: dict, n: int, counted: int) -> list[list]:
    arith = {1: (4, 4, 2), 2: (4, 1, 2), 3: (1, 1, 2)}  # bytes per parameter at dp=4, in KEYS order
    rows = []
    for s in STAGES:
        for when in ("after", "peak"):
            m = worst[s][when]
            cells = [f"{C.mib(m[k]):.1f}" + (f" ({C.mib(a * n):.1f})" if when == "after" else "")
                     for k, a in zip(KEYS, arith[s])]  # fmt: skip
            cells[0] += f" ({C.mib(counted):.1f} counted)" if (s, when) == (3, "peak") else ""
            rows.append(
                [f"ZeRO-{s}", "after the step" if when == "after" else "peak", *cells, f"{C.mib(m['total']):.1f}"]
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 layer, 2 rounds: a smoke run")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL", "MEMORY", "ROUNDS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.out, args.worker[1] == "1", int(args.worker[2]))
    import torch

    cfg = C.llama_config(**{**C.SMOLLM2_135M, "num_hidden_layers": 1 if args.quick else 4})
    rounds, work = 2 if args.quick else 8, Path(tempfile.mkdtemp(prefix="bench_sharding_"))
    d = {"env": C.env_info(), "model": C.shape_str(cfg), "bucket": BUCKET, "rounds": rounds}
    try:
        d["params"] = C.save_model_dir(cfg, work / "model", dtype=torch.float32)
        model = str(work / "model")
        mem = C.run_workers(Path(__file__), 4, ["--worker", model, "1", str(rounds)], work / "memory")
        mem8 = C.run_workers(Path(__file__), 8, ["--worker", model, "1", str(rounds)], work / "memory8")
        speed = C.run_workers(Path(__file__), 2, ["--worker", model, "0", str(rounds)], work / "speed")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    worst = {s: {w: {k: max(r[str(s)][w][k] for r in mem) for k in (*KEYS, "total")} for w in ("after", "peak")}
             for s in STAGES}  # fmt: skip
    n, z2 = mem[0]["1"]["numel"], mem[0]["2"]
    med = {s: C.median([max(r["times"][str(s)][i] for r in speed) for i in range(1, rounds + 1)]) for s in STAGES}
    d["memory"] = {
        "worst_rank": worst,
        "numel": n,
        "zero3_over_zero1": worst[3]["after"]["total"] / worst[1]["after"]["total"],
        "zero2_peak_gradients": worst[2]["peak"]["gradients"],
        "zero2_bound": n + 4 * (z2["bucket"] + z2["vectors"]),  # 4N/dp bytes + the two buckets
        "zero2_largest_bucket": z2["bucket"],
        "zero2_vector_buckets": z2["vectors"],
        "zero3_peak_weights": worst[3]["peak"]["weights"],
        "zero3_counted_peak_weights": (z3 := max(r["3"]["counted_peak_weights"] for r in mem)),
        "dp8_totals": (t8 := {s: max(r[str(s)]["after"]["total"] for r in mem8) for s in STAGES}),
        "dp8_zero3_over_zero1": t8[3] / t8[1],
    }
    d["speed"] = {"median_step_s": med, "over_zero1": {s: med[s] / med[1] for s in STAGES}}
    body = f"Model: {d['model']} ({d['params'] / 1e6:.1f}M params, fp32, AdamW), buckets of {BUCKET:,} elements.\n\n"
    body += f"## Memory per rank at dp=4 (the worst rank; in brackets the arithmetic for N = {n:,})\n\n"
    body += C.md_table(["stage", "when", *(f"{k} MiB" for k in KEYS), "total MiB"], _memory_rows(worst, n, z3))
    body += f"\n\nAt dp=8 after the step (the worst rank): ZeRO-1 {C.mib(t8[1]):.1f} MiB, ZeRO-2 {C.mib(t8[2]):.1f}, "
    body += f"ZeRO-3 {C.mib(t8[3]):.1f} ({C.mib(2 * n):.1f}): ZeRO-3 / ZeRO-1 {t8[3] / t8[1]:.3f}x (arithmetic 2/9)."
    body += f"\n\n## Step time at dp=2 (median of {rounds} interleaved rounds, slowest rank)\n\n"
    body += C.md_table(
        ["stage", "median step s", "over ZeRO-1"], [[f"ZeRO-{s}", med[s], med[s] / med[1]] for s in STAGES]
    )
    print(C.write_results("sharding", "Sharded gradients and weights (ZeRO-1/2/3), CPU", body, d, quick=args.quick))
    print(body)


if __name__ == "__main__":
    main()
