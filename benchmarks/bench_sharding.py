"""Sharded gradients and weights on CPU: what each rank holds at ZeRO-1, 2 and 3, and the step time they cost.

Memory, dp=4 (4 gloo processes): a SmolLM2-135M-shaped Llama (its first --layers layers, fp32, AdamW, gradient
buckets of --bucket elements) trains 3 steps at each zero stage. During the last step every rank samples what it
holds (before each decoder layer's forward, when each layer's backward begins, and after the step), from the run's
own tensors, each storage counted once: the weights (the parameters registered on the model now: whole, FSDP2's
shards, or a group gathered for compute), the fp32 gradients (ZeRO-0/1/2's flat gradient tensor and the buckets a
micro-batch fills under ZeRO-2, or every parameter's `.grad`: FSDP2's sharded gradients and those of a gathered
group), and the optimizer state (the wrapped optimizer's tensors and fp32 masters that are not the parameters
themselves). Reported: after the step, before zero_grad (what a rank keeps between backward and the next step)
and the largest sample (the peak), beside the
arithmetic they should equal for N parameters at dp ranks: ZeRO-1 4N + 4N + 8N/dp bytes; ZeRO-2 gradients 4N/dp
(+ one bucket while a micro-batch fills it: the largest, since a parameter is never split over buckets); ZeRO-3
4N/dp + 4N/dp + 8N/dp (+ the groups gathered for compute). Targets as the issue put them: ZeRO-3's weights +
gradients + state at most 0.3x ZeRO-1's (the arithmetic gives 0.4x at dp=4 with fp32 weights: (4+4+8)/4 over
4 + 4 + 8/4, i.e. 2/(dp + 1): at most 0.3x from dp = 6 on); ZeRO-2's gradients at most 1/dp + one bucket.

Speed, dp=2 (2 processes, one thread each): the three stages built side by side in the same processes, steps
interleaved in rotated order, median step time of the slowest rank (regression guards on this CPU, not targets of
the design: ZeRO-2 within 1.1x ZeRO-1, ZeRO-3 within 1.3x).

    python benchmarks/bench_sharding.py [--layers 4] [--bucket 1048576] [--rounds 8]   # ~5 min on 2 cores
    python benchmarks/bench_sharding.py --quick                                         # 1 layer; results/quick/
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import _common as C

STAGES = (1, 2, 3)
TARGET_ZERO3 = 0.3  # weights + gradients + optimizer state per rank, over ZeRO-1's
TARGET_SPEED = {2: 1.1, 3: 1.3}  # step time over ZeRO-1's


def held(pm, opt) -> dict[str, int]:
    """Bytes this rank holds now, by role, each storage once (the module docstring)."""
    import torch

    seen: set[int] = set()

    def size(t) -> int:
        if t is None:
            return 0
        t = getattr(t, "_local_tensor", t)  # a DTensor: its local shard
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    params = [p for _, p in pm.hf_model.named_parameters()]  # as registered now: no resharding
    out = {"weights": sum(size(p) for p in params)}
    grads = sum(size(p.grad) for p in params)
    if hasattr(opt, "main_grad"):  # hf3d's own gradient buffers (ZeRO-0/1/2)
        grads += size(opt.main_grad)
        for b in opt.buckets:
            grads += size(b.staging) + (size(b.work[1]) if b.work is not None else 0)
    out["gradients"] = grads
    masters = sum(size(m) for _, m, _, _ in opt._masters)  # ZeRO-3: the fp32 shards (of a gathered group too)
    if opt.zero_stage == 3:
        out["weights"] += masters
        masters = 0
    state = sum(size(t) for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim())
    out["optimizer_state"] = state + masters
    out["total"] = sum(out.values())
    return out


def _sampling(pm, opt, samples: list) -> list:
    """Hooks that sample `held` before each decoder layer's forward, when its backward begins and, for parameters
    that are not FSDP2's, once each gradient has been taken into its bucket."""
    handles = []

    def on_output(_module, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda g: samples.append(held(pm, opt)))

    for stage in pm.stages:
        for layer in stage.layers:
            handles.append(layer.register_forward_pre_hook(lambda *_: samples.append(held(pm, opt))))
            handles.append(layer.register_forward_hook(on_output))
    for _, p in pm.hf_model.named_parameters():  # after hf3d's own hook has taken the gradient (ZeRO-0/1/2)
        if not hasattr(p, "_local_tensor"):
            handles.append(p.register_post_accumulate_grad_hook(lambda _p: samples.append(held(pm, opt))))
    return handles


def memory_worker(model_dir: str, out: str, bucket: int) -> None:
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rec = {}
    for stage in STAGES:
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(zero_stage=stage, num_microbatches=2))
        opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4, bucket_size=bucket)
        samples: list = []
        for i in range(3):
            handles = _sampling(pm, opt, samples) if i == 2 else []
            ids = torch.randint(0, pm.config.vocab_size, (4, 128), generator=g)
            pm.train_step(ids, ids)
            opt.step()
            after = held(pm, opt)  # the gradients still held: what a rank keeps from backward to the next zero_grad
            opt.zero_grad()
            for h in handles:
                h.remove()
        peak = {k: max(s[k] for s in [*samples, after]) for k in after}
        n = sum(p.numel() for p in pm.hf_model.parameters())  # this rank's elements: the whole model at tp=pp=1
        largest = max((b.numel for b in opt.buckets), default=0) if stage < 3 else 0  # a parameter is never split
        rec[stage] = dict(after=after, peak=peak, numel=n, largest_bucket=largest, samples=len(samples))
        del pm, opt
        dist.barrier()
    C.write_rank(out, rec)


def speed_worker(model_dir: str, out: str, bucket: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()
    torch.set_num_threads(1)
    runs = {}
    for stage in STAGES:
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(zero_stage=stage))
        runs[stage] = (pm, hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4, bucket_size=bucket))
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {s: [] for s in STAGES}
    for r in range(rounds + 1):  # round 0 warms every stage up
        order = STAGES[r % 3 :] + STAGES[: r % 3]
        for stage in order:
            pm, opt = runs[stage]
            ids = torch.randint(0, pm.config.vocab_size, (4, 128), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step(ids, ids)
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if r:
                times[stage].append(time.perf_counter() - t0)
    C.write_rank(out, {"times": times})


def _memory_rows(recs: list[dict], dp: int, bucket: int) -> tuple[list, dict]:
    """Table rows and the summary: per stage the worst rank's figures, beside the arithmetic."""
    worst = {s: {w: {k: max(r[s][w][k] for r in recs) for k in recs[0][s][w]} for w in ("after", "peak")}
             for s in STAGES}  # fmt: skip
    n = recs[0][1]["numel"]
    expected = {
        1: {"weights": 4 * n, "gradients": 4 * n, "optimizer_state": 8 * n / dp},
        2: {"weights": 4 * n, "gradients": 4 * n / dp, "optimizer_state": 8 * n / dp},
        3: {"weights": 4 * n / dp, "gradients": 4 * n / dp, "optimizer_state": 8 * n / dp},
    }
    rows = []
    for s in STAGES:
        for when in ("after", "peak"):
            m = worst[s][when]
            cells = [f"{C.mib(m[k]):.1f}" + (f" ({C.mib(expected[s][k]):.1f})" if when == "after" else "")
                     for k in ("weights", "gradients", "optimizer_state")]  # fmt: skip
            rows.append([f"ZeRO-{s}", "after the step" if when == "after" else "peak in the step", *cells,
                         f"{C.mib(m['total']):.1f}"])  # fmt: skip
    zero1 = worst[1]["after"]["total"]
    summary = {
        "numel": n,
        "dp": dp,
        "bucket_elements": bucket,
        "worst_rank": worst,
        "expected_after": expected,
        "zero3_over_zero1": worst[3]["after"]["total"] / zero1,
        "zero3_over_zero1_arithmetic": sum(expected[3].values()) / sum(expected[1].values()),
        "zero3_peak_over_zero1_peak": worst[3]["peak"]["total"] / worst[1]["peak"]["total"],
        "zero2_peak_gradients": worst[2]["peak"]["gradients"],
        "zero2_largest_bucket": recs[0][2]["largest_bucket"],
        "zero2_gradient_bound": 4 * n / dp + 4 * recs[0][2]["largest_bucket"],
    }
    return rows, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=2**20, help="gradient bucket size in elements")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="1 layer, 2 rounds: a smoke run")
    ap.add_argument("--memory-worker", nargs=2, metavar=("MODEL", "BUCKET"), help=argparse.SUPPRESS)
    ap.add_argument("--speed-worker", nargs=3, metavar=("MODEL", "BUCKET", "ROUNDS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_worker:
        return memory_worker(args.memory_worker[0], args.out, int(args.memory_worker[1]))
    if args.speed_worker:
        m, b, r = args.speed_worker
        return speed_worker(m, args.out, int(b), int(r))
    import torch

    layers, rounds = (1, 2) if args.quick else (args.layers, args.rounds)
    cfg = C.llama_config(**{**C.SMOLLM2_135M, "num_hidden_layers": layers})
    data = {"env": C.env_info(), "model": C.shape_str(cfg), "bucket": args.bucket, "rounds": rounds}
    work = Path(tempfile.mkdtemp(prefix="bench_sharding_"))
    try:
        data["params"] = C.save_model_dir(cfg, work / "model", dtype=torch.float32)
        model = str(work / "model")
        recs = C.run_workers(Path(__file__), 4, ["--memory-worker", model, str(args.bucket)], work / "memory")
        recs = [{int(stage): rec for stage, rec in r.items()} for r in recs]  # JSON keys are strings
        rows, data["memory"] = _memory_rows(recs, 4, args.bucket)
        recs = C.run_workers(
            Path(__file__), 2, ["--speed-worker", model, str(args.bucket), str(rounds)], work / "speed"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    slowest = [max(r["times"][str(s)][i] for r in recs) for s in STAGES for i in range(rounds)]
    med = {s: C.median(slowest[(s - 1) * rounds : s * rounds]) for s in STAGES}
    data["speed"] = {"median_step_s": med, "over_zero1": {s: med[s] / med[1] for s in STAGES}}
    m, sp = data["memory"], data["speed"]["over_zero1"]
    headers = ["stage", "when", "weights MiB (arithmetic)", "fp32 gradients MiB", "optimizer state MiB", "total MiB"]
    body = (
        f"Model: {data['model']} ({data['params'] / 1e6:.1f}M params, fp32, AdamW), gradient buckets of "
        f"{args.bucket:,} elements, 2 micro-batches of 2 x 128 tokens per rank.\n\n"
        f"## Memory per rank at dp=4 (the worst rank; in brackets the arithmetic for N = {m['numel']:,})\n\n"
        + C.md_table(headers, rows)
        + f"\n\nZeRO-3 / ZeRO-1, weights + gradients + optimizer state after the step: {m['zero3_over_zero1']:.3f}x "
        f"(the arithmetic: {m['zero3_over_zero1_arithmetic']:.3f}x; {C.verdict(m['zero3_over_zero1'], TARGET_ZERO3)}); "
        f"at the peaks {m['zero3_peak_over_zero1_peak']:.3f}x. ZeRO-2's peak gradients "
        f"{C.mib(m['zero2_peak_gradients']):.1f} MiB against 1/dp + one bucket = "
        f"{C.mib(m['zero2_gradient_bound']):.1f} MiB (the largest bucket, {m['zero2_largest_bucket']:,} elements: a "
        "parameter is never split, and the tied embedding is larger than --bucket) "
        f"({'met' if m['zero2_peak_gradients'] <= m['zero2_gradient_bound'] else 'missed'}).\n\n"
        f"## Step time at dp=2 (median of {rounds} interleaved rounds, slowest rank, one thread per rank)\n\n"
        + C.md_table(
            ["stage", "median step s", "over ZeRO-1", "target"],
            [
                [f"ZeRO-{s}", med[s], f"{sp[s]:.3f}x", C.verdict(sp[s], TARGET_SPEED[s]) if s > 1 else "—"]
                for s in STAGES
            ],
        )  # fmt: skip
    )
    print(C.write_results("sharding", "Sharded gradients and weights (ZeRO-1/2/3), CPU", body, data, quick=args.quick))
    print(body)


if __name__ == "__main__":
    main()
