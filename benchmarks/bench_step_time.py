"""Step time and peak memory: hf3d at tp=pp=dp=1 against stock transformers + torch.optim.AdamW, fp32 CPU.

Both sides live in ONE process, start from the same HF checkpoint, see the same batch and use the same
optimizer settings (AdamW lr 1e-4, wd 0.1, betas (0.9, 0.95); stock clips with clip_grad_norm_(1.0), hf3d with
max_grad_norm=1.0). After warm-up rounds, each round runs one step of every side in rotated order; the table
gives the median step time (forward + backward, then clip + step + zero_grad) and the ratio hf3d / stock
(target ≤ 0.95x), with the ratio of the fastest steps (the least disturbed by other load) beside it.
`--compile` adds hf3d with compiled decoder layers (`parallelize(..., compile=True)`) to the same rounds
(results/step_time_compile). Peak memory: each side alone in a fresh process, MEMORY_STEPS steps, VmHWM
above the RSS after the imports (target hf3d ≤ 1.0x stock).

    python benchmarks/bench_step_time.py [--threads 1] [--compile]    # ~2-4 min on 2 cores
    python benchmarks/bench_step_time.py --quick                       # smoke; results/quick/
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import _common as C
import torch

LR, WD, BETAS, CLIP = 1e-4, 0.1, (0.9, 0.95), 1.0
MEMORY_STEPS = 3


class Stock:
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, betas=BETAS)

    def fwd_bwd(self, ids):
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def opt_step(self):
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class HF3D:
    def __init__(self, model_dir, compile: bool = False):
        hf3d = C.import_hf3d()
        pcfg = hf3d.ParallelConfig(tp=1, pp=1, dp=1)
        self.model = hf3d.parallelize(model_dir, pcfg, dtype=torch.float32, attn_implementation="sdpa", compile=compile)
        self.opt = hf3d.build_optimizer(
            self.model, torch.optim.AdamW, lr=LR, weight_decay=WD, betas=BETAS, max_grad_norm=CLIP
        )

    def fwd_bwd(self, ids):
        return self.model.train_step(ids, ids)

    def opt_step(self):
        self.opt.step()
        self.opt.zero_grad()


SIDES = {"stock": Stock, "hf3d": HF3D, "hf3d compiled": lambda d: HF3D(d, compile=True)}


def timed_step(side, ids) -> dict:
    gc.collect()
    t0 = time.perf_counter()
    loss = side.fwd_bwd(ids)
    t1 = time.perf_counter()
    side.opt_step()
    t2 = time.perf_counter()
    return {"wall": t2 - t0, "fwd_bwd_wall": t1 - t0, "opt_wall": t2 - t1, "loss": float(loss)}


def memory_worker(args) -> None:
    """One side alone in this process: VmHWM above the post-import RSS, after the load and over the steps."""
    import transformers  # noqa: F401  (the same imports on every side)

    C.import_hf3d()
    base = C.proc_status()["VmRSS"]
    side = SIDES[args.memory_worker](args.model_dir)
    loaded = C.proc_status()["VmHWM"] - base
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    for _ in range(MEMORY_STEPS):
        side.fwd_bwd(ids)
        side.opt_step()
    print(json.dumps({"load_peak": loaded, "peak": C.proc_status()["VmHWM"] - base}))


def measure_memory(args, model_dir: str) -> dict:
    out = {}
    flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "seq", "batch", "threads")]
    for name in ("stock", "hf3d"):
        proc = C.python_subprocess(
            Path(__file__), [*flags, "--memory-worker", name, "--model-dir", model_dir], env=C.MALLOC_ENV
        )
        if proc.returncode:
            raise SystemExit(f"memory worker {name} failed:\n{C.tail(proc.stdout + proc.stderr)}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, short rounds; results go to results/quick/")
    for name, default in (("hidden", 256), ("layers", 4), ("heads", 8), ("kv-heads", 4), ("inter", 1024)):
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("vocab", 8192), ("seq", 256), ("batch", 8), ("warmup", 3), ("repeats", 20)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--compile", action="store_true", help="add hf3d with compiled layers (results/step_time_compile)")
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        return memory_worker(args)
    if args.quick:
        args.warmup, args.repeats, args.layers, args.seq, args.batch = 1, 3, 2, 128, 4
    env = C.env_info()
    cfg = C.llama_config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.inter,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    shapes = f"{C.shape_str(cfg)}; batch {args.batch} x seq {args.seq}; fp32; sdpa; AdamW, clip {CLIP}"
    names = ["stock", "hf3d"] + (["hf3d compiled"] if args.compile else [])
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        n_params = C.save_model_dir(cfg, Path(tmp), dtype=torch.float32)
        sides = {name: SIDES[name](tmp) for name in names}
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        samples: dict[str, list[dict]] = {name: [] for name in names}
        first = {}
        for r in range(args.warmup + args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated: no side always first
                s = timed_step(sides[name], ids)
                first.setdefault(name, s)
                if r >= args.warmup:
                    samples[name].append(s)
            if r >= args.warmup:
                print(
                    f"round {r - args.warmup + 1}/{args.repeats}: "
                    + "  ".join(f"{n} {samples[n][-1]['wall']:.3f}s" for n in names),
                    flush=True,
                )
        del sides
        memory = measure_memory(args, tmp)

    keys = ("wall", "fwd_bwd_wall", "opt_wall")
    result = {
        k: {n: {"median": C.median([s[k] for s in samples[n]]), "min": min(s[k] for s in samples[n])} for n in names}
        for k in keys
    }
    for k in keys:
        r = result[k]
        r["ratio_hf3d_over_stock"] = r["hf3d"]["median"] / r["stock"]["median"]
        r["ratio_of_minima"] = r["hf3d"]["min"] / r["stock"]["min"]
        if args.compile:
            r["ratio_compiled_over_eager"] = r["hf3d compiled"]["median"] / r["hf3d"]["median"]
    mem_ratio = memory["hf3d"]["peak"] / memory["stock"]["peak"]
    labels = {"wall": "step", "fwd_bwd_wall": "  forward + backward", "opt_wall": "  clip + step + zero_grad"}
    rows = [
        [
            f"{labels[k]}, s (median)",
            *(result[k][n]["median"] for n in names),
            f"{result[k]['ratio_hf3d_over_stock']:.3f}x",
        ]
        for k in keys
    ]
    rows.append(
        ["fastest step, s", *(result["wall"][n]["min"] for n in names), f"{result['wall']['ratio_of_minima']:.3f}x"]
    )
    rows.append(["first step, s (compile included)", *(first[n]["wall"] for n in names), ""])
    rows.append(["first-step loss", *(f"{first[n]['loss']:.6f}" for n in names), ""])
    rows += [
        [
            f"peak RSS, {label}, MiB (alone)",
            C.mib(memory["stock"][k]),
            C.mib(memory["hf3d"][k]),
            *([""] if args.compile else []),
            f"{memory['hf3d'][k] / memory['stock'][k]:.3f}x",
        ]
        for label, k in (("the load", "load_peak"), (f"{MEMORY_STEPS} steps", "peak"))
    ]
    ratio = result["wall"]["ratio_hf3d_over_stock"]
    body = (
        f"Shapes: {shapes}; {n_params:,} parameters; {args.warmup} warm-up + {args.repeats} timed rounds, one step "
        f"of each side per round, order rotating; load average {env['load_avg_1m_at_start']} on {env['cpu_count']} "
        f"cores.\n\n" + C.md_table(["", *names, "hf3d / stock"], rows) + "\n\n"
        f"**hf3d / stock median step time {ratio:.3f}x** ({C.verdict(ratio, 0.95)}); fastest steps "
        f"{result['wall']['ratio_of_minima']:.3f}x; **peak RSS {mem_ratio:.3f}x** ({C.verdict(mem_ratio, 1.0)})."
    )
    if args.compile:
        body += f" hf3d compiled / eager: {result['wall']['ratio_compiled_over_eager']:.3f}x median step time."
    print("\n" + body)
    data = dict(env=env, shapes=shapes, n_params=n_params, args=vars(args), result=result, first=first)
    data.update(samples=samples, memory=memory, memory_ratio_hf3d_over_stock=mem_ratio)
    name = "step_time" + ("_compile" if args.compile else "") + (f"_threads{args.threads}" if args.threads else "")
    title = "Step time: hf3d (tp=pp=dp=1) vs stock transformers"
    print(f"\nwrote {C.write_results(name, title, body, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
