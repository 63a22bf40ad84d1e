"""One GPU, one process: hf3d against stock transformers compiled, every comparison a ratio of rows run side by side.

Each row is built fresh, runs warm-up steps (the compile among them), then timed steps (CUDA-synchronised wall
time, median); peak memory is `torch.cuda.max_memory_allocated` above what was allocated before the row. Both
sides of a comparison load the same weights (one seeded stock init, saved as bf16 safetensors) and see the same
batch (random tokens, labels = inputs).

(a) "stock compiled", what `Trainer(bf16=True)` does, compiled the way hf3d compiles: fp32 parameters under
    `torch.autocast("cuda", torch.bfloat16)`, `torch.optim.AdamW(fused=True)`, clip 1.0, sdpa, each decoder layer
    `.compile()`-d in place (forward with `use_cache=False`: a KV cache made each layer recompile); against hf3d
    `parallelize(ParallelConfig(tp=1, pp=1, dp=1), dtype=torch.bfloat16, compile=True)` +
    `build_optimizer(torch.optim.AdamW, fused=True)`, clip 1.0. At the SmolLM2-360M shape
    (8 x 2048 tokens) and the SmolLM2-1.7B shape (24 layers, 4 x 2048): tokens/s, MFU, peak memory.
    Targets: hf3d ≥ 1.0x stock at both shapes, 1.7B MFU ≥ 50 %, peak memory ≤ stock's.
(b) `hf3d train` (the command, a world of one process) on a SmolLM2-360M config-only model, packed documents of
    examples/data/shakespeare.jsonl (the examples' tokenizer), seq 2048, 2 micro-batches of 4 rows, an async
    checkpoint every 10 steps, no parallel.compile / attn keys. The parent reads metrics.jsonl as it grows: the
    time between two step records is a step as the user sees it. Steady step = the median of those outside the
    saves' windows; tokens/s against (a)'s stock compiled 360M row (same 8 x 2048 tokens per step; target ≥
    1.0x); the stall of every async save, the first included = Σ over the steps up to the next save of (interval
    − steady), in steps (target ≤ 0.1); a step beside a write = the worst interval of steps 2-10 after a save,
    over the steady step (target ≤ 1.05x).
(c) hf3d FP8 compiled, tensorwise and rowwise, against (a)'s hf3d bf16 compiled row at the 1.7B shape (target:
    ≥ 1.2x for the recipe docs/fp8.md recommends).
(d) MoE: a Qwen3-MoE of ~472M (hidden 1024, 12 layers, 32 experts of width 288, top-4), 4 x 2048 tokens: hf3d
    ep=1 bf16 against stock with `experts_implementation="grouped_mm"` (fp32 parameters under autocast, fused
    AdamW); both eager. Target ≥ 1.8x.
(e) hf3d ZeRO-3 (FSDP2) against (a)'s hf3d ZeRO-1 row at the 1.7B shape, compiled: at dp=1 only FSDP2's overhead
    (target ≥ 0.77x: a step within 1.3x, the CPU guard's bound), and the peak memory of fp32 shards against ZeRO-1's.

Rows run in that order of priority: (a) 360M, (b), (a) 1.7B, (e), (c), (d). A row whose estimated time no longer fits
`--budget-s` is skipped and reported as skipped; a row that fails records its error and the next one runs.
Nothing is installed: hf3d's dependencies (transformers, torchao, datasets, ...) come from the environment or
PYTHONPATH. Without CUDA the script stops (exit 2; 0 with --skip-without-gpu); `--cpu-smoke` runs every row on
the CPU at tiny shapes instead (FP8 emulated), to test the script, not to measure.

    python benchmarks/gpu.py                    # one H100/H200, ~9 min; results/gpu.{json,md}
    python benchmarks/gpu.py --quick            # 4 layers per shape, few steps; results/quick/
    python benchmarks/gpu.py --cpu-smoke        # no GPU: tiny shapes, 2 steps; results/quick/
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _common as C

os.environ.setdefault("USE_HUB_KERNELS", "0")  # offline: stock Qwen3-MoE would look for a Hub rotary kernel
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LR, WD, BETAS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1.0
SEQ = 2048
MOE = dict(
    vocab_size=49152,
    hidden_size=1024,
    intermediate_size=4096,
    moe_intermediate_size=288,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
SHAPES = {"360M": (C.SMOLLM2_360M, 8), "1.7B": (C.SMOLLM2_1_7B, 4), "moe": (MOE, 4)}  # config, rows per step
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=2048,  # the examples tokenizer has 2000 tokens
    moe_intermediate_size=32,
)
TRAIN_EVERY, TRAIN_STEPS = 10, 45  # saves at 10, 20, 30, 40 mid-run (45, the last, waits for its write)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers per shape, 3 timed steps; results/quick/")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: every row on the CPU at tiny shapes")
    ap.add_argument("--skip-without-gpu", action="store_true", help="exit 0 (not 2) when CUDA is missing")
    ap.add_argument("--budget-s", type=float, default=540, help="rows that no longer fit are skipped")
    ap.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    args.quick = args.quick or args.cpu_smoke
    if args.quick:
        args.warmup, args.steps = 1, 2 if args.cpu_smoke else 3
    return args


# -- the two sides ----------------------------------------------------------------------------------
class Stock:
    """fp32 parameters under autocast(bf16), fused AdamW, clip 1.0, sdpa, no KV cache; layers compiled in place."""

    def __init__(self, torch, model_dir, dev, *, compile: bool, **kw):
        from transformers import AutoModelForCausalLM

        self.torch, self.dev = torch, dev
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa", device_map=dev.type, **kw
        ).train()
        if compile:
            for layer in self.model.model.layers:
                layer.compile()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, betas=BETAS, fused=True)
        self.attn = self.model.config._attn_implementation

    def step(self, ids):
        with self.torch.autocast(self.dev.type, dtype=self.torch.bfloat16):
            # no KV cache in training: with one, each compiled layer recompiles for its own cache layer, and past
            # dynamo's recompile limit (8) the later layers run eager
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class HF3D:
    """parallelize(tp=pp=dp=1, bf16) + build_optimizer(AdamW, fused=True), clip 1.0."""

    def __init__(self, torch, model_dir, dev, *, compile: bool, fp8=None, zero_stage: int = 1):
        import hf3d

        pcfg = hf3d.ParallelConfig(tp=1, pp=1, dp=1, zero_stage=zero_stage)
        self.model = hf3d.parallelize(model_dir, pcfg, dtype=torch.bfloat16, compile=compile, fp8=fp8)
        self.opt = hf3d.build_optimizer(
            self.model, torch.optim.AdamW, lr=LR, weight_decay=WD, betas=BETAS, max_grad_norm=CLIP, fused=True
        )
        self.attn = self.model.config._attn_implementation  # "auto" picked it (sdpa without flash-attn)

    def step(self, ids):
        loss = self.model.train_step(ids, ids)
        self.opt.step()
        self.opt.zero_grad()
        return loss


# -- rows -------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, torch, args, root: Path):
        self.torch, self.args, self.root = torch, args, root
        self.dev = torch.device("cpu" if args.cpu_smoke else "cuda")

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def config(self, shape: str):
        from transformers import Qwen3MoeConfig

        kw, rows = SHAPES[shape]
        kw = dict(kw)
        if self.args.cpu_smoke:
            kw.update({k: v for k, v in TINY.items() if k != "moe_intermediate_size" or shape == "moe"})
        elif self.args.quick:
            kw["num_hidden_layers"] = 4
        return (Qwen3MoeConfig(**kw) if shape == "moe" else C.llama_config(**kw)), rows

    def model_dir(self, shape: str) -> Path:
        """One seeded stock init of `shape`, saved once as bf16 safetensors: every row of the shape loads it."""
        path = self.root / shape
        if not path.exists():
            from transformers import AutoModelForCausalLM

            self.torch.manual_seed(0)
            with self.torch.device(self.dev):
                model = AutoModelForCausalLM.from_config(self.config(shape)[0], dtype=self.torch.float32)
            model.to("cpu", self.torch.bfloat16).save_pretrained(path)
            del model
        return path

    def batch(self, shape: str):
        cfg, rows = self.config(shape)
        seq = 64 if self.args.cpu_smoke else SEQ
        g = self.torch.Generator().manual_seed(0)
        return self.torch.randint(0, cfg.vocab_size, (rows, seq), generator=g).to(self.dev)

    def free(self) -> None:
        """Nothing of the previous row left: its compiled code and cache entries, its memory."""
        self.torch._dynamo.reset()
        self.torch._dynamo.utils.counters.clear()
        gc.collect()
        if self.dev.type == "cuda":
            self.torch.cuda.empty_cache()

    def measure(self, name: str, shape: str, make) -> dict:
        """Build a side, run warm-up and timed steps; tokens/s, MFU, peak memory, compile counters."""
        import hf3d.plan.cost
        import hf3d.train.metrics

        torch, cuda = self.torch, self.dev.type == "cuda"
        self.free()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        side = make(self.model_dir(shape))
        ids = self.batch(shape)
        build_s, warm, timed = time.perf_counter() - t0, [], []
        for i in range(self.args.warmup + self.args.steps):
            self.sync()
            t = time.perf_counter()
            loss = float(side.step(ids))
            self.sync()
            (warm if i < self.args.warmup else timed).append(time.perf_counter() - t)
            if i == 0:
                first_loss = loss
        step = C.median(timed)
        cfg = self.config(shape)[0]
        peak = None if self.args.cpu_smoke else hf3d.train.metrics.device_peak_flops()
        flops = None if shape == "moe" else hf3d.plan.cost.flops_per_token(cfg, ids.shape[1])
        counters = torch._dynamo.utils.counters
        row = dict(
            name=name,
            attn=side.attn,
            shape=shape,
            tokens_per_step=ids.numel(),
            step_s=step,
            tokens_per_s=ids.numel() / step,
            mfu=ids.numel() / step * flops / peak if peak and flops else None,
            warmup_s=warm,
            timed_s=timed,
            first_loss=first_loss,
            build_s=build_s,
            graphs=counters["stats"].get("unique_graphs", 0),
            graph_breaks=sum(counters["graph_break"].values()),
            peak_mem_bytes=torch.cuda.max_memory_allocated() - base if cuda else None,
        )
        del side
        return row

    def fp8(self, recipe: str):
        import hf3d

        return hf3d.FP8Config(recipe=recipe, emulate=self.args.cpu_smoke)  # emulated matmuls on a CPU only

    # (b)
    def train(self, name: str) -> dict:
        """`hf3d train` in a child process; the step records' arrival times read from metrics.jsonl."""
        self.free()  # the GPU is the child's
        cfg, _ = self.config("360M")
        model_dir, out = self.root / "train-model", self.root / "train-run"
        cfg.save_pretrained(model_dir)  # config only: hf3d initialises it, sharded, from the seed
        for f in (C.REPO / "examples" / "tokenizer").iterdir():
            shutil.copy(f, model_dir / f.name)
        smoke = self.args.cpu_smoke or self.args.quick
        steps, every = (8, 2) if smoke else (TRAIN_STEPS, TRAIN_EVERY)
        seq = 64 if self.args.cpu_smoke else SEQ
        yaml = self.root / "train.yaml"
        data, q = C.REPO / "examples" / "data" / "shakespeare.jsonl", lambda p: json.dumps(str(p))  # quoted
        yaml.write_text(  # no parallel.compile and no attn keys: what hf3d picks by itself is measured
            f"model: {{path: {q(model_dir)}, dtype: bfloat16}}\n"
            f"data: {{path: {q(data)}, seq_len: {seq}}}\n"
            "parallel: {tp: 1, pp: 1, num_microbatches: 2}\n"
            f"run: {{steps: {steps}, global_batch: 8, output_dir: {q(out)}, log_every: {every}, save_final: false}}\n"
            f"checkpoint: {{every: {every}, keep_last: 2, async: true, resume: none}}\n"
        )
        metrics, arrivals, buf = out / "metrics.jsonl", [], b""
        with open(self.root / "train.log", "w+") as log:
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "hf3d", "train", str(yaml)]
            env = C.child_env()  # a world of its own, one thread per process as under torchrun
            proc = subprocess.Popen(cmd, cwd=C.REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
            pos = 0
            while True:
                done = proc.poll() is not None
                if metrics.exists():
                    with open(metrics, "rb") as f:
                        f.seek(pos)
                        chunk = f.read()
                    now, pos = time.perf_counter(), pos + len(chunk)
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    arrivals += [(now - t0, json.loads(line)) for line in lines if line.strip()]
                if done:
                    break
                time.sleep(0.002)
            log.seek(0)
            text = log.read()
        if proc.returncode:
            raise RuntimeError(f"hf3d train exited {proc.returncode}:\n{C.tail(text, 30)}")
        # what hf3d train prints after each save_checkpoint call returns: how long it blocked the loop
        said = re.findall(r"hf3d: (?:started \(written in the background\)|saved) \S+step_(\d+) in ([0-9.]+) s", text)
        blocking = {int(step): float(s) for step, s in said}
        times = {rec["step"]: t for t, rec in arrivals}
        gaps = {s: times[s] - times[s - 1] for s in times if s - 1 in times}
        saves = [s for s in range(every, steps, every)]  # mid-run saves (the last step's waits for its write)
        near = {s + k for s in saves for k in range(1, every + 1)}
        steady = C.median([g for s, g in gaps.items() if s > 2 and s not in near] or list(gaps.values()))
        out_saves = []
        for s in saves:
            window = [gaps[j] for j in range(s + 1, min(s + every, steps) + 1) if j in gaps]
            out_saves.append(
                dict(
                    step=s,
                    stall_steps=sum(g - steady for g in window) / steady,
                    profile=[round(g / steady, 3) for g in window],
                    beside_worst=max(window[1:], default=steady) / steady,
                )
            )
        recs = [rec for _, rec in arrivals]
        return dict(
            name=name,
            shape="360M",
            tokens_per_step=8 * seq,
            steady_step_s=steady,
            tokens_per_s=8 * seq / steady,
            first_step_s=recs[0]["step_time_s"],
            launch_to_first_record_s=arrivals[0][0],
            saves=out_saves,
            save_blocking_s=blocking,
            mfu=C.median([r["mfu"] for r in recs if "mfu" in r]) if any("mfu" in r for r in recs) else None,
            peak_mem_bytes=max(r["peak_mem_bytes"] for r in recs),
            log_tail=C.tail(text, 12),
        )

    def plan(self) -> list[tuple[str, float, object]]:
        """(row name, estimated seconds on an H200, how to run it), in order of priority."""
        torch, dev = self.torch, self.dev
        sides = [  # name, estimate, shape, the side's class and its keyword arguments
            ("360M stock compiled", 35, "360M", Stock, dict(compile=True)),
            ("360M hf3d compiled", 35, "360M", HF3D, dict(compile=True)),
            ("1.7B stock compiled", 50, "1.7B", Stock, dict(compile=True)),
            ("1.7B hf3d compiled", 50, "1.7B", HF3D, dict(compile=True)),
            ("1.7B hf3d zero3 compiled", 55, "1.7B", HF3D, dict(compile=True, zero_stage=3)),
            ("1.7B hf3d fp8 tensorwise compiled", 70, "1.7B", HF3D, dict(compile=True, fp8="tensorwise")),
            ("1.7B hf3d fp8 rowwise compiled", 70, "1.7B", HF3D, dict(compile=True, fp8="rowwise")),
            ("moe stock grouped_mm", 45, "moe", Stock, dict(compile=False, experts_implementation="grouped_mm")),
            ("moe hf3d ep=1", 45, "moe", HF3D, dict(compile=False)),
        ]

        def row(name, shape, cls, kw):
            def make(model_dir):  # the FP8 config is made here: a missing torchao fails its rows only
                return cls(torch, model_dir, dev, **{**kw, **({"fp8": self.fp8(kw["fp8"])} if "fp8" in kw else {})})

            return lambda: self.measure(name, shape, make)

        out = [(name, est, row(name, shape, cls, kw)) for name, est, shape, cls, kw in sides]
        out.insert(2, ("hf3d train 360M", 120, lambda: self.train("hf3d train 360M")))
        return out


# -- the report -------------------------------------------------------------------------------------
COMPARISONS = [  # (what, row, reference row, target on the tokens/s ratio)
    ("(a) 360M: hf3d compiled / stock compiled", "360M hf3d compiled", "360M stock compiled", 1.0),
    ("(a) 1.7B: hf3d compiled / stock compiled", "1.7B hf3d compiled", "1.7B stock compiled", 1.0),
    ("(b) hf3d train / stock compiled, 360M", "hf3d train 360M", "360M stock compiled", 1.0),
    ("(c) 1.7B: FP8 tensorwise / bf16, compiled", "1.7B hf3d fp8 tensorwise compiled", "1.7B hf3d compiled", 1.2),
    ("(c) 1.7B: FP8 rowwise / bf16, compiled", "1.7B hf3d fp8 rowwise compiled", "1.7B hf3d compiled", 1.2),
    ("(d) MoE: hf3d ep=1 / stock grouped_mm", "moe hf3d ep=1", "moe stock grouped_mm", 1.8),
    ("(e) 1.7B: ZeRO-3 / ZeRO-1, dp=1", "1.7B hf3d zero3 compiled", "1.7B hf3d compiled", 0.77),
]


def ratios(rows: dict) -> list[dict]:
    out = []
    for what, name, ref, target in COMPARISONS:
        a, b = rows.get(name, {}), rows.get(ref, {})
        r = dict(what=what, row=name, reference=ref, target=target)
        if "tokens_per_s" in a and "tokens_per_s" in b:
            r["ratio"] = a["tokens_per_s"] / b["tokens_per_s"]
            if a.get("peak_mem_bytes") and b.get("peak_mem_bytes"):
                r["memory_ratio"] = a["peak_mem_bytes"] / b["peak_mem_bytes"]
        else:
            r["missing"] = "; ".join(
                f"{n}: {x.get('skipped') or x.get('error', 'not run')}"[:160]
                for n, x in ((name, a), (ref, b))
                if "tokens_per_s" not in x
            )
        out.append(r)
    return out


def report(data: dict) -> str:
    def cell(x, f):
        return "—" if x is None else f.format(x)

    rows = []
    for r in data["rows"].values():
        if "tokens_per_s" not in r:
            why = r.get("skipped") or "failed: " + " ".join(r.get("error", "").split())[:300]
            rows.append([r["name"], why, *[""] * 6])
            continue
        first = r.get("first_step_s", (r.get("warmup_s") or [None])[0])
        rows.append(
            [
                r["name"] + (f" ({r['attn']})" if r.get("attn") else ""),
                f"{r['tokens_per_s']:,.0f}",
                cell(r.get("mfu"), "{:.1%}"),
                cell(r.get("peak_mem_bytes") and r["peak_mem_bytes"] / 2**30, "{:.1f}"),
                cell(r.get("step_s", r.get("steady_step_s")), "{:.4f}"),
                cell(first, "{:.1f}"),
                cell(r.get("first_loss"), "{:.4f}"),
                cell(r.get("graphs"), "{}") + f" / {r.get('graph_breaks', '—')}",
            ]
        )
    table = C.md_table(
        ["row", "tokens/s", "MFU", "peak GiB", "step s", "first step s", "first loss", "graphs / breaks"], rows
    )
    lines = []
    for r in data["ratios"]:
        if "ratio" not in r:
            lines.append(f"- {r['what']}: not measured ({r['missing']})")
            continue
        mem = (
            f"; peak memory {r['memory_ratio']:.2f}x ({C.verdict(r['memory_ratio'], 1.0)})"
            if "memory_ratio" in r
            else ""
        )
        lines.append(
            f"- {r['what']}: **{r['ratio']:.3f}x** tokens/s ({C.verdict(r['ratio'], r['target'], at_most=False)}){mem}"
        )
    b = data["rows"].get("hf3d train 360M", {})
    if "saves" in b:
        lines.append(
            "- (b) async saves (stall in steps, target ≤ 0.1; step intervals after the save / steady): "
            + "; ".join(
                f"step {s['step']}: **{s['stall_steps']:.2f}** ({' '.join(map(str, s['profile']))})" for s in b["saves"]
            )
            + f"; worst step beside a write {max(s['beside_worst'] for s in b['saves']):.3f}x steady (target ≤ 1.05x);"
            f" save_checkpoint blocked {', '.join(f'{x:.2f}' for x in b['save_blocking_s'].values())} s; first step "
            f"{b['first_step_s']:.1f} s, launch to first record {b['launch_to_first_record_s']:.0f} s"
        )
    mfu = data["rows"].get("1.7B hf3d compiled", {}).get("mfu")
    if mfu is not None:
        lines.append(f"- (a) 1.7B hf3d bf16 MFU **{mfu:.1%}** (target ≥ 50 %: {'met' if mfu >= 0.5 else 'missed'})")
    env = data["env"]
    return (
        f"{env.get('gpu', 'CPU smoke')}, torch {env['torch']}, transformers {env['transformers']}; seq "
        f"{data['seq']}; {data['args']['warmup']} warm-up + {data['args']['steps']} timed steps per row; "
        f"{data['wall_s']:.0f} s in all.\n\n{table}\n\n" + "\n".join(lines)
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch._dynamo

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            "gpu.py: CUDA is not available on this machine; the script measures the GPU path and does not fall "
            "back to CPU (--cpu-smoke runs it at tiny shapes on the CPU)."
            + (" Skipping (--skip-without-gpu)." if args.skip_without_gpu else ""),
            flush=True,
        )
        return 0 if args.skip_without_gpu else 2
    import torch.distributed as dist

    import hf3d.train.metrics

    t_start = time.perf_counter()
    env = C.env_info()
    env["torch_has_2_13_collective_names"] = hasattr(dist, "all_gather_single")
    if torch.cuda.is_available() and not args.cpu_smoke:
        env.update(
            gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, peak_flops=hf3d.train.metrics.device_peak_flops()
        )
    data = {"env": env, "args": vars(args), "seq": 64 if args.cpu_smoke else SEQ, "rows": {}}
    wanted = [w for w in args.rows.split(",") if w]
    with tempfile.TemporaryDirectory(prefix="hf3d_gpu_") as tmp:
        bench = Bench(torch, args, Path(tmp))
        for name, est, run in bench.plan():
            if wanted and name not in wanted:
                continue
            left = args.budget_s - (time.perf_counter() - t_start)
            if not args.quick and left < est:
                data["rows"][name] = dict(
                    name=name, skipped=f"skipped: {left:.0f} s of the budget left, ~{est} s needed"
                )
            else:
                t0 = time.perf_counter()
                try:
                    data["rows"][name] = run()
                except Exception as e:  # one failing row must not hide the others
                    data["rows"][name] = dict(
                        name=name, error=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-3000:]
                    )
                data["rows"][name]["wall_s"] = time.perf_counter() - t0
            shown = {k: v for k, v in data["rows"][name].items() if k not in ("trace", "log_tail", "timed_s")}
            print(f"{name}: {json.dumps(shown, default=str)[:600]}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    data["ratios"] = ratios(data["rows"])
    data["wall_s"] = time.perf_counter() - t_start
    body = report(data)
    print("\n" + body)
    title = "One GPU: hf3d vs stock transformers compiled, `hf3d train`, FP8, MoE"
    print(f"\nwrote {C.write_results('gpu', title, body, data, quick=args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
