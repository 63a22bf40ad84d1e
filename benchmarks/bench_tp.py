"""Tensor parallelism: hf3d at tp=2 vs transformers' own tensor parallelism at tp=2, fp32, 2 processes.

Both sides load the same stock Llama-shaped checkpoint (8 query / 4 KV heads, untied) saved once into a
temporary folder, see the same batch on both ranks (tensor parallelism has one replica) and use the same
optimizer settings: AdamW(lr=1e-4, wd=0.1, betas=(0.9, 0.95)), gradient clipping at 1.0.

- hf3d: `hf3d.parallelize(dir, ParallelConfig(tp=2), dtype=float32, attn_implementation="sdpa")`,
  `hf3d.build_optimizer(...)`; a step is `train_step(ids, labels)`, `opt.step()`, `opt.zero_grad()`.
- transformers: `AutoModelForCausalLM.from_pretrained(dir, dtype=float32, attn_implementation="sdpa",
  distributed_config=DistributedConfig(tp_size=2))` (the model's own `base_model_tp_plan`, DTensor
  params), `torch.optim.AdamW` on its parameters; a step is `model(input_ids=ids, labels=ids).loss`,
  backward, clip 1.0, step, `zero_grad(set_to_none=True)`. `torch.nn.utils.clip_grad_norm_` raises on
  that model (its parameters mix DTensors and plain tensors: the RMSNorm weights stay plain); when it does,
  the same clipping is done in two groups: `get_total_norm` of the DTensor grads (a DTensor whose
  `full_tensor()` is the global norm) and of the plain grads, combined, then `clip_grads_with_norm_` on
  each group with that total norm. What happened is recorded in the results.

Tokens/s: both sides in the SAME 2 processes, steps interleaved (order alternating each round) after a
warm-up, a barrier before each step; a step's time is the slower rank's. Peak memory: each side alone in a
fresh 2-process job (worker mode of this script), the same steps, glibc's mmap threshold fixed
(MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ = 65536, as in bench_memory_model.py): VmHWM above the
process's own baseline after the imports and the gloo init, worst rank. Targets: hf3d / transformers step
time <= 0.7x, peak RSS per rank <= 0.85x.

    python benchmarks/bench_tp.py            # full (~2-4 min on 2 cores)
    python benchmarks/bench_tp.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
LR, WD, BETAS, CLIP = 1e-4, 0.1, (0.9, 0.95), 1.0
TARGET_TIME, TARGET_MEM = 0.7, 0.85
LOSS_RTOL = 1e-5
SIDES = ("hf3d", "transformers")


# =================================================================================================
# workers (run under torchrun)
# =================================================================================================
def _batch(spec):
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    return ids, ids.clone()  # the same rows on both ranks: tensor parallelism has one replica


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class MixedClip:
    """Gradient clipping at `max_norm` for a model whose parameters mix DTensors and plain tensors.

    Tries `torch.nn.utils.clip_grad_norm_` first; if it raises (`aten._foreach_norm` refuses a mix of
    torch.Tensor and DTensor), clips in two groups with the same global norm from then on.
    """

    def __init__(self, params, max_norm: float):
        from torch.distributed.tensor import DTensor

        self.params, self.max_norm = list(params), max_norm
        self.dtensor = [p for p in self.params if isinstance(p, DTensor)]
        self.plain = [p for p in self.params if not isinstance(p, DTensor)]
        self.mode, self.error = None, None

    def __call__(self):
        import torch

        if self.mode in (None, "clip_grad_norm_"):
            try:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
                self.mode = "clip_grad_norm_"
                return _full(norm)
            except RuntimeError as e:
                if self.mode is not None:
                    raise
                self.mode, self.error = "two groups (DTensor grads, plain grads)", f"{type(e).__name__}: {e}"
        return self._two_groups()

    def _two_groups(self):
        import torch
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        groups = [[p for p in g if p.grad is not None] for g in (self.dtensor, self.plain)]
        groups = [g for g in groups if g]
        norms = [_full(get_total_norm([p.grad for p in g], 2.0)) for g in groups]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        for g in groups:
            clip_grads_with_norm_(g, self.max_norm, total)
        return total

    def info(self) -> dict:
        return {
            "mode": self.mode,
            "clip_grad_norm_error": self.error,
            "dtensor_params": len(self.dtensor),
            "plain_params": len(self.plain),
        }


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def worker_tp(spec) -> dict:
    """mode 'both' interleaves hf3d and transformers TP steps (throughput); 'hf3d' / 'transformers' alone (memory)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    hf3d = C.import_hf3d()  # imported in every mode so the baselines match

    mode = spec["mode"]
    mem = {"baseline": C.proc_status()}
    ids, labels = _batch(spec)
    sides, info = {}, {}
    if mode in ("both", "hf3d"):
        pmodel = hf3d.parallelize(
            spec["ckpt"], hf3d.ParallelConfig(tp=2), dtype=torch.float32, attn_implementation="sdpa"
        )
        mem["model loaded"] = C.proc_status()
        opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=LR, weight_decay=WD, betas=BETAS, max_grad_norm=CLIP)
        mem["optimizer built"] = C.proc_status()
        assert (pmodel.pcfg.tp, pmodel.pcfg.pp, pmodel.dp_size) == (2, 1, 1), pmodel.pcfg

        def hf3d_step():
            loss = pmodel.train_step(ids, labels)
            norm = opt.step()
            opt.zero_grad()
            return loss, norm

        sides["hf3d"] = hf3d_step
    if mode in ("both", "transformers"):
        model = AutoModelForCausalLM.from_pretrained(
            spec["ckpt"],
            dtype=torch.float32,
            attn_implementation="sdpa",
            distributed_config=DistributedConfig(tp_size=2),
        )
        model.train()
        mem["model loaded"] = C.proc_status()
        params = list(model.parameters())
        topt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, betas=BETAS)
        clip = MixedClip(params, CLIP)
        mem["optimizer built"] = C.proc_status()
        assert getattr(model, "tp_size", None) == 2, getattr(model, "tp_size", None)

        def transformers_step():
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            norm = clip()
            topt.step()
            topt.zero_grad(set_to_none=True)
            return loss.detach(), norm

        sides["transformers"] = transformers_step
        info["transformers"] = {
            "tp_size": model.tp_size,
            "tp_plan": {k: str(v) for k, v in (getattr(model, "_tp_plan", None) or {}).items()},
            "param_types": sorted({type(p).__name__ for p in params}),
        }
    times = {k: [] for k in sides}
    losses = {k: [] for k in sides}
    norms = {k: [] for k in sides}
    names = list(sides)
    for r in range(spec["warmup"] + spec["repeats"]):
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            loss, norm = sides[name]()
            dt = time.perf_counter() - t0
            if r >= spec["warmup"]:
                times[name].append(dt)
            losses[name].append(float(loss))
            norms[name].append(float(norm))
        if r == 0:
            mem["after step 1"] = C.proc_status()
    mem["end"] = C.proc_status()
    try:  # what is live, not what glibc keeps cached from freed activations and temporaries
        import ctypes

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mem["end, after malloc_trim(0)"] = C.proc_status()
    except OSError:
        mem["end, after malloc_trim(0)"] = mem["end"]
    state = {}
    if "hf3d" in sides:
        state["hf3d"] = opt.memory_report()
    if "transformers" in sides:
        info["transformers"]["clip"] = clip.info()
        n = sum(_local(p).numel() for p in params)
        st = sum(
            _local(t).numel() * _local(t).element_size()
            for s in topt.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        state["transformers"] = {
            "params": 4 * n,
            "grads": 0,  # set_to_none: no gradient is held between steps (4 B/param while one is)
            "optimizer_state": st,
            "total": 4 * n + st,
            "local_params": n,
        }
    return {
        "times": _gather(times),
        "mem": _gather(mem),
        "losses": _gather(losses),
        "grad_norms": norms,
        "state_bytes": _gather(state),
        "info": info,
    }


def run_worker(kind: str, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the one default group: hf3d and transformers both use it when it exists
    try:
        fn = {"tp": worker_tp}[kind]
        result = fn(spec)
        if dist.get_rank() == 0:
            Path(spec["out"]).write_text(json.dumps(result, default=str))
        dist.barrier()
        C.leave_distributed()
    finally:
        dist.destroy_process_group()


# =================================================================================================
# orchestration and report
# =================================================================================================
def launch(
    kind: str, nproc: int, spec: dict, tmp: Path, tag: str, timeout: float, env: dict | None = None
) -> tuple[dict | None, str]:
    spec = dict(spec, out=str(tmp / f"{kind}-{tag}.json"))
    t0 = time.perf_counter()
    try:
        proc = C.torchrun(SCRIPT, nproc, ["--worker", kind, "--spec", json.dumps(spec)], timeout=timeout, env=env)
    except Exception as e:  # TimeoutExpired: a hang
        return None, f"{type(e).__name__}: {e}"
    print(f"  [{kind} {tag}] {nproc} processes, {time.perf_counter() - t0:.1f}s, rc {proc.returncode}", flush=True)
    out = Path(spec["out"])
    if proc.returncode != 0 or not out.exists():
        return None, C.tail(proc.stderr, 30)
    return json.loads(out.read_text()), ""


def report_throughput(both: dict, tokens: int) -> tuple[str, dict]:
    # one step's time = the slower rank's time
    step = {n: [max(ts[n][i] for ts in both["times"]) for i in range(len(both["times"][0][n]))] for n in SIDES}
    med = {n: C.median(v) for n, v in step.items()}
    fastest = {n: min(v) for n, v in step.items()}
    tps = {n: tokens / med[n] for n in med}
    ratio, ratio_min = med["hf3d"] / med["transformers"], fastest["hf3d"] / fastest["transformers"]
    data = {
        "median_step_s": med,
        "p25_step_s": {n: C.quantile(v, 0.25) for n, v in step.items()},
        "p75_step_s": {n: C.quantile(v, 0.75) for n, v in step.items()},
        "fastest_step_s": fastest,
        "tokens_per_s": tps,
        "ratio_hf3d_over_transformers": ratio,
        "ratio_of_fastest": ratio_min,
        "tokens_per_s_ratio": tps["hf3d"] / tps["transformers"],
        "samples": step,
    }
    rows = [
        [
            n if n == "hf3d" else "transformers TP",
            f"{med[n]:.4f} [{C.quantile(step[n], 0.25):.4f}, {C.quantile(step[n], 0.75):.4f}]",
            f"{fastest[n]:.4f}",
            f"{tps[n]:,.0f}",
        ]
        for n in SIDES
    ]
    rows.append(
        [
            "hf3d / transformers",
            f"**{ratio:.3f}x**",
            f"{ratio_min:.3f}x",
            f"{tps['hf3d'] / tps['transformers']:.3f}x",
        ]
    )
    table = C.md_table(
        ["side (same 2 processes, interleaved)", "step s, median [p25, p75]", "fastest step s", "tokens/s"], rows
    )
    verdict = (
        f"**hf3d / transformers step time (median) = {ratio:.3f}x** (target ≤ {TARGET_TIME}x: "
        f"{'met' if ratio <= TARGET_TIME else 'NOT met'}); ratio of the fastest steps {ratio_min:.3f}x."
    )
    return table + "\n\n" + verdict, data


def memory_of(res: dict, side: str) -> dict:
    ranks = res["mem"]
    i = max(range(len(ranks)), key=lambda k: ranks[k]["end"]["VmHWM"] - ranks[k]["baseline"]["VmHWM"])
    worst, base = ranks[i], ranks[i]["baseline"]
    return {
        "worst_rank": i,
        "peak": worst["end"]["VmHWM"],
        "peak_above": worst["end"]["VmHWM"] - base["VmHWM"],
        "anon_end_above": worst["end"]["RssAnon"] - base["RssAnon"],
        "baseline": base["VmHWM"],
        "all_ranks_peak_above": [m["end"]["VmHWM"] - m["baseline"]["VmHWM"] for m in ranks],
        "state": res["state_bytes"][i][side],
        "phases": worst,
    }


def report_memory(alone: dict, steps: int) -> tuple[str, dict]:
    data = {s: (memory_of(alone[s], s) if alone.get(s) else None) for s in SIDES}
    if not all(data.values()):
        return f"memory jobs failed: {[k for k, v in data.items() if not v]}", data
    h, t = data["hf3d"], data["transformers"]
    ratio = h["peak_above"] / t["peak_above"]
    data["ratio_peak_above_hf3d_over_transformers"] = ratio
    rows = [
        ["peak RSS (VmHWM), worst rank", C.mib(h["peak"]), C.mib(t["peak"]), f"{h['peak'] / t['peak']:.3f}x"],
        [
            "peak RSS above the process's own baseline (imports + gloo init), worst rank",
            C.mib(h["peak_above"]),
            C.mib(t["peak_above"]),
            f"**{ratio:.3f}x**",
        ],
        [
            "private RSS (RssAnon) at the end, above baseline",
            C.mib(h["anon_end_above"]),
            C.mib(t["anon_end_above"]),
            f"{h['anon_end_above'] / t['anon_end_above']:.3f}x",
        ],
        [
            "training-state tensors between steps (hf3d `memory_report`: params + fp32 main grads + AdamW; "
            "transformers: local params + AdamW, grads freed by `zero_grad(set_to_none=True)`)",
            C.mib(h["state"]["total"]),
            C.mib(t["state"]["total"]),
            f"{h['state']['total'] / t['state']['total']:.3f}x",
        ],
        ["(phases below: RSS / peak RSS / private RSS, each above baseline)", "", "", ""],
    ]
    for phase in ("model loaded", "optimizer built", "after step 1", "end", "end, after malloc_trim(0)"):
        cells = []
        for side in SIDES:
            w = data[side]["phases"]
            b = w["baseline"]
            cells.append(
                f"{C.mib(w[phase]['VmRSS'] - b['VmRSS']):.1f} / {C.mib(w[phase]['VmHWM'] - b['VmHWM']):.1f} / "
                f"{C.mib(w[phase]['RssAnon'] - b['RssAnon']):.1f}"
            )
        rows.append([f"  {phase}", *cells, ""])
    table = C.md_table(["metric (MiB)", "hf3d tp=2", "transformers TP tp=2", "hf3d / transformers"], rows)
    verdict = (
        f"**hf3d / transformers peak RSS above baseline = {ratio:.3f}x** (target ≤ {TARGET_MEM}x: "
        f"{'met' if ratio <= TARGET_MEM else 'NOT met'})."
    )
    return (
        f"Peak memory, each side alone in a fresh 2-process job ({steps} steps, "
        f"{', '.join(f'{k}={v}' for k, v in C.MALLOC_ENV.items())}):\n\n" + table + "\n\n" + verdict
    ), data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run; results go to results/quick/")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="rows per step (the same rows on both tp ranks)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10, help="timed interleaved rounds")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps of each side alone in the memory jobs")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per torchrun job")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args.worker, json.loads(args.spec))
    if args.quick:
        args.hidden, args.layers, args.inter, args.vocab = 64, 2, 128, 1024
        args.seq, args.batch, args.warmup, args.repeats, args.memory_steps = 32, 2, 1, 2, 2

    import torch

    env = C.env_info()
    env["worker_threads"] = 1
    cfg = C.llama_config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.inter,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    t_all = time.perf_counter()
    data = {"env": env, "args": vars(args), "targets": {"step_time": TARGET_TIME, "peak_rss": TARGET_MEM}}
    body = []
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmpdir:
        tmp = Path(tmpdir)
        ckpt = tmp / "model"
        n_params = C.save_model_dir(cfg, ckpt, dtype=torch.float32)
        data["n_params"] = n_params
        shapes = (
            f"{C.shape_str(cfg)}; {n_params:,} params; batch {args.batch} x seq {args.seq} (the same rows on "
            f"both tp ranks); fp32; sdpa; AdamW(lr={LR}, wd={WD}, betas={BETAS}), clip {CLIP}"
        )
        print("shapes:", shapes, flush=True)
        body.append(f"Shapes: {shapes}. gloo on CPU, 1 thread per process, 2 processes launched with torchrun.")
        spec = {
            "ckpt": str(ckpt),
            "vocab": args.vocab,
            "seq": args.seq,
            "batch": args.batch,
            "warmup": args.warmup,
            "repeats": args.repeats,
        }
        print("hf3d tp=2 and transformers TP tp=2, interleaved in the same 2 processes", flush=True)
        both, err = launch("tp", 2, dict(spec, mode="both"), tmp, "both", args.timeout)
        if both is None:
            print(f"  FAILED:\n{err}", flush=True)
            data.setdefault("failures", {})["both"] = err
        alone = {}
        print("peak memory: each side alone in a fresh 2-process job", flush=True)
        for side in SIDES:
            s = dict(spec, mode=side, warmup=0, repeats=args.memory_steps)
            alone[side], err = launch("tp", 2, s, tmp, side, args.timeout, env=C.MALLOC_ENV)
            if alone[side] is None:
                print(f"  FAILED:\n{err}", flush=True)
                data.setdefault("failures", {})[side] = err

    first = None
    if both is not None:
        tokens = args.batch * args.seq
        t, d = report_throughput(both, tokens)
        data["throughput"] = d
        info = both["info"]["transformers"]
        data["transformers_info"] = info
        first = {n: both["losses"][0][n][0] for n in SIDES}
        first_norm = {n: both["grad_norms"][n][0] for n in SIDES}
        rel = abs(first["hf3d"] - first["transformers"]) / abs(first["transformers"])
        rel_norm = abs(first_norm["hf3d"] - first_norm["transformers"]) / abs(first_norm["transformers"])
        rank_spread = max(abs(r[n][0] - first[n]) for r in both["losses"] for n in SIDES)
        data["first_step"] = {
            "loss": first,
            "loss_rel_diff": rel,
            "grad_norm": first_norm,
            "grad_norm_rel_diff": rel_norm,
            "loss_max_diff_between_ranks": rank_spread,
        }
        clip = info["clip"]
        clip_note = (
            f"`torch.nn.utils.clip_grad_norm_` raised on the transformers TP model ({clip['dtensor_params']} "
            f"DTensor and {clip['plain_params']} plain parameters): `{clip['clip_grad_norm_error'][:160]}`. "
            "It is clipped instead in two groups with one global norm: `get_total_norm` of the DTensor grads "
            "(`.full_tensor()`) and of the plain grads, combined, then `clip_grads_with_norm_` on each group."
            if clip["clip_grad_norm_error"]
            else "`torch.nn.utils.clip_grad_norm_` worked on the transformers TP model's parameters."
        )
        body.append(
            f"## Step time, {args.repeats} interleaved rounds after {args.warmup} warm-up\n\n"
            + t
            + f"\n\nSame start: first-step loss hf3d {first['hf3d']:.6f}, transformers {first['transformers']:.6f} "
            f"(relative difference {rel:.1e}, must be ≤ {LOSS_RTOL:.0e}); pre-clip grad norm hf3d "
            f"{first_norm['hf3d']:.6f}, transformers {first_norm['transformers']:.6f} ({rel_norm:.1e}). "
            f"transformers API: `AutoModelForCausalLM.from_pretrained(dir, distributed_config="
            f"DistributedConfig(tp_size=2))`, tp_size {info['tp_size']}, parameter types {info['param_types']}. "
            + clip_note
        )
    if alone:
        t, d = report_memory(alone, args.memory_steps)
        data["memory"] = d
        body.append("## Peak memory per rank\n\n" + t)
    if data.get("failures"):
        body.append("## Failures\n\n" + "\n\n".join(f"{k}:\n```\n{v}\n```" for k, v in data["failures"].items()))
    data["wall_s"] = time.perf_counter() - t_all
    body_md = "\n\n".join(body)
    print("\n" + body_md)
    path = C.write_results(
        "tp", "Tensor parallelism: hf3d tp=2 vs transformers' own TP", body_md, data, quick=args.quick
    )
    print(f"\nwrote {path} ({data['wall_s']:.0f}s)")
    if data.get("failures"):
        return 1
    if first is not None:
        rel = data["first_step"]["loss_rel_diff"]
        assert rel <= LOSS_RTOL, f"first-step losses differ: {first} (relative {rel:.2e} > {LOSS_RTOL})"
    return 0


if __name__ == "__main__":
    sys.exit(main())
