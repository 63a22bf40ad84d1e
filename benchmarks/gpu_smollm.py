"""One GPU, SmolLM2-360M shape, bf16, seq 2048: hf3d vs stock transformers + fused AdamW, side by side.

Rows (each built fresh, timed with CUDA events after warm-up steps, peak `torch.cuda.max_memory_allocated`):
stock and hf3d with sdpa; with flash_attention_2 when the flash-attn package imports (the script tries a
wheel-only `pip install flash-attn` first and runs sdpa only when that fails, saying so); and with
activation recompute — stock via `model.gradient_checkpointing_enable()`, hf3d via
`ParallelConfig(recompute="full")`. tokens/s, MFU = tokens/s × hf3d.metrics.flops_per_token
(6N + 12·L·h·s) / the device's dense bf16 peak (hf3d.metrics.PEAK_FLOPS), peak memory.

Both sides start from the same weights (a seeded stock init saved as an HF directory) and see the same
batch. Stock: bf16 parameters, `torch.optim.AdamW(fused=True)` on them (bf16 moments), clip 1.0. hf3d:
bf16 parameters with fp32 main grads, fp32 master weights and fp32 moments (ZeRO-1 layout at dp=1,
fused AdamW on the fp32 master fragments, `dp_collective="reduce_scatter"`), clip 1.0 — so hf3d holds
more optimizer state by design (18 vs 8 bytes per parameter).

The CUDA path is exercised, never skipped: the process group is nccl (a world of one GPU also
initialises nccl); all_reduce, reduce_scatter_single and all_gather_single run on it and are checked.
At dp=1 hf3d itself issues no dp collective, so the reduce-scatter path inside hf3d's optimizer is
built (`build_optimizer(dp_collective="reduce_scatter")`) but reduces nothing; the direct nccl calls
above are the collective check. Without CUDA the script stops with a message (exit 2), or exits 0 with
`--skip-without-gpu` (the CPU smoke test); it never falls back to CPU.

Anchors: nanotron reports 44-47 % MFU on one 8×H100 node; picotron ~50 % for SmolLM-1.7B on 8×H100.
Target here: ≥ 50 % MFU on one GPU.

    python benchmarks/gpu_smollm.py                          # < 5 min on one H100/H200, install included
    python benchmarks/gpu_smollm.py --quick --skip-without-gpu   # smoke (4 layers, seq 512; exits 0 on CPU)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import subprocess
import sys
import tempfile
import time
import traceback

import _common as C

SMOLLM2_360M = C.SMOLLM2_360M
LR, WD, BETAS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, seq 512, 2 timed steps; results/quick/")
    ap.add_argument("--skip-without-gpu", action="store_true", help="exit 0 (not 2) when CUDA is missing")
    ap.add_argument("--no-install", action="store_true", help="do not try to pip-install flash-attn")
    ap.add_argument("--batch", type=int, default=8, help="rows per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=270, help="skip rows not started by this many seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.warmup, args.steps = 512, 1, 2
    return args


def try_flash_attn(allow_install: bool) -> dict:
    """Import flash_attn; if missing, try a wheel-only install (never a source build) with a time limit."""
    info = {"installed": False, "version": None, "install": "not attempted"}
    try:
        info["version"] = importlib.import_module("flash_attn").__version__
        info["installed"] = True
        return info
    except ImportError:
        pass
    if not allow_install:
        info["install"] = "skipped (--no-install)"
        return info
    cmd = [sys.executable, "-m", "pip", "install", "--only-binary=:all:", "--retries", "0", "--timeout", "15"]
    cmd.append("flash-attn>=2.6")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        info["install"] = f"rc {proc.returncode}: {C.tail(proc.stdout + proc.stderr, 3)}"
    except subprocess.TimeoutExpired:
        info["install"] = "timed out after 90 s"
    importlib.invalidate_caches()
    try:
        info["version"] = importlib.import_module("flash_attn").__version__
        info["installed"] = True
    except ImportError:
        pass
    return info


def collective_check(torch, dist) -> dict:
    """nccl all_reduce / reduce_scatter_single / all_gather_single on this GPU, values checked."""
    world, dev = dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(4 * world, dtype=torch.float32, device=dev)
    summed = x.clone()
    dist.all_reduce(summed)
    shard = torch.empty(4, device=dev)
    dist.reduce_scatter_single(shard, x.clone())
    gathered = torch.empty(4 * world, device=dev)
    dist.all_gather_single(gathered, shard)
    torch.cuda.synchronize()
    rank = dist.get_rank()
    ok = (
        torch.equal(summed, x * world)
        and torch.equal(shard, x[4 * rank : 4 * rank + 4] * world)
        and torch.equal(gathered, x * world)
    )
    return {"backend": dist.get_backend(), "world_size": world, "ok": bool(ok)}


class Stock:
    def __init__(self, torch, model_dir, attn: str, recompute: bool):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation=attn, device_map="cuda"
        )
        self.model.train()
        self.model.config.use_cache = False
        if recompute:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, betas=BETAS, fused=True)
        self.torch = torch

    def param(self):
        return self.params[0]

    def step(self, ids):
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class HF3D:
    def __init__(self, torch, model_dir, attn: str, recompute: bool):
        import hf3d

        kw = {}
        if recompute:
            kw["recompute"] = "full"
        pcfg = hf3d.ParallelConfig(tp=1, pp=1, dp=1, **kw)
        self.model = hf3d.parallelize(model_dir, pcfg, dtype=torch.bfloat16, attn_implementation=attn)
        self.opt = hf3d.build_optimizer(
            self.model,
            torch.optim.AdamW,
            lr=LR,
            weight_decay=WD,
            betas=BETAS,
            max_grad_norm=CLIP,
            dp_collective="reduce_scatter",
            fused=True,
        )

    def param(self):
        return next(self.model.parameters())

    def step(self, ids):
        loss = self.model.train_step(ids, ids)
        self.opt.step()
        self.opt.zero_grad()
        return loss


def measure(torch, side, ids, warmup: int, steps: int) -> dict:
    p = side.param()
    assert p.is_cuda and p.dtype == torch.bfloat16, (p.device, p.dtype)
    losses = [float(side.step(ids)) for _ in range(warmup)]
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_step = []
    loop_start, loop_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    loop_start.record()
    for _ in range(steps):
        begin.record()
        side.step(ids)
        end.record()
        end.synchronize()
        per_step.append(begin.elapsed_time(end) / 1e3)
    loop_end.record()
    loop_end.synchronize()
    return {"warmup_losses": losses, "step_s": per_step, "loop_s": loop_start.elapsed_time(loop_end) / 1e3}


def run_row(torch, name, cls, model_dir, attn, recompute, ids, args, cfg, peak) -> dict:
    from hf3d.metrics import flops_per_token

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    side = cls(torch, model_dir, attn, recompute)
    build_s = time.perf_counter() - t0
    m = measure(torch, side, ids, args.warmup, args.steps)
    step = C.median(m["step_s"])
    tokens = ids.numel()
    tps = tokens / step
    row = {
        "name": name,
        "attn": attn,
        "recompute": recompute,
        "build_s": build_s,
        "step_s_median": step,
        "step_s": m["step_s"],
        "loop_tokens_per_s": tokens * args.steps / m["loop_s"],
        "tokens_per_s": tps,
        "mfu": tps * flops_per_token(cfg, args.seq) / peak if peak else None,
        "peak_mem_bytes": torch.cuda.max_memory_allocated() - base,
        "first_loss": m["warmup_losses"][0],
    }
    del side
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        msg = (
            "gpu_smollm.py: CUDA is not available on this machine. This script measures hf3d's GPU path "
            "(nccl, bf16, CUDA events) only and does not fall back to CPU."
        )
        print(msg + (" Skipping (--skip-without-gpu)." if args.skip_without_gpu else ""), flush=True)
        return 0 if args.skip_without_gpu else 2

    t_start = time.perf_counter()
    fa = try_flash_attn(not args.no_install)  # before transformers caches its availability checks
    print(f"flash-attn: {fa}", flush=True)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf3d.mesh import init_distributed
    from hf3d.metrics import device_peak_flops, flops_per_token

    init_distributed()  # nccl: CUDA is available
    check = collective_check(torch, dist)
    print(f"collectives: {check}", flush=True)
    if check["backend"] != "nccl" or not check["ok"]:
        print("the nccl collective check failed", flush=True)
        return 1
    peak = device_peak_flops()
    model_cfg = dict(SMOLLM2_360M, num_hidden_layers=4) if args.quick else SMOLLM2_360M
    cfg = C.llama_config(**model_cfg)
    env = C.env_info()
    env.update(
        gpu=torch.cuda.get_device_name(),
        cuda=torch.version.cuda,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        peak_bf16_flops=peak,
        flash_attn=fa,
    )
    data = {"env": env, "args": vars(args), "collectives": check, "rows": [], "skipped": []}
    rows = data["rows"]
    with tempfile.TemporaryDirectory(prefix="gpu_smollm_") as tmp:
        torch.manual_seed(0)
        with torch.device("cuda"):
            stock = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        n_params = sum(p.numel() for p in stock.parameters())
        stock.save_pretrained(tmp)
        del stock
        torch.cuda.empty_cache()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).cuda()
        attns = ["sdpa"] + (["flash_attention_2"] if fa["installed"] else [])
        plan = [(f"{side} {a}", cls, a, False) for a in attns for side, cls in (("stock", Stock), ("hf3d", HF3D))]
        plan.append(("stock sdpa + recompute", Stock, "sdpa", True))
        plan.append(("hf3d sdpa + recompute", HF3D, "sdpa", True))
        for name, cls, attn, rec in plan:
            if time.perf_counter() - t_start > args.budget_s:
                data["skipped"].append(f"{name}: time budget of {args.budget_s:.0f} s spent")
                continue
            try:
                row = run_row(torch, name, cls, tmp, attn, rec, ids, args, cfg, peak)
            except Exception as e:  # one failing row (e.g. a kernel missing) must not hide the others
                row = {
                    "name": name,
                    "note": f"failed: {type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-2000:],
                }
                gc.collect()
                torch.cuda.empty_cache()
            print(f"  {name}: { ({k: v for k, v in row.items() if k not in ('step_s', 'trace')}) }", flush=True)
            rows.append(row)
    data.update(n_params=n_params, flops_per_token=flops_per_token(cfg, args.seq), wall_s=time.perf_counter() - t_start)
    body = report(data, cfg, args)
    print(body)
    path = C.write_results("gpu_smollm", "SmolLM2-360M shape on one GPU: hf3d vs stock", body, data, quick=args.quick)
    print(f"wrote {path} ({data['wall_s']:.0f} s)")
    dist.destroy_process_group()
    return 0


def report(data: dict, cfg, args) -> str:
    env = data["env"]
    by = {r["name"]: r for r in data["rows"]}
    table = []
    for r in data["rows"]:
        if "tokens_per_s" not in r:
            table.append([r["name"], r["note"], "", "", "", "", ""])
            continue
        ref = by.get(r["name"].replace("hf3d", "stock"))
        vs = (
            f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}x"
            if r["name"].startswith("hf3d") and ref and "tokens_per_s" in ref
            else ""
        )
        table.append(
            [
                r["name"],
                f"{r['step_s_median']:.4f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.1%}" if r["mfu"] else "n/a (unknown peak)",
                f"{r['peak_mem_bytes'] / 2**30:.2f}",
                f"{r['first_loss']:.4f}",
                vs,
            ]
        )
    md = C.md_table(
        [
            "row",
            "step s (median)",
            "tokens/s",
            "MFU",
            "peak GiB (max_memory_allocated)",
            "first loss",
            "tokens/s vs stock",
        ],
        table,
    )
    fa = env["flash_attn"]
    fa_line = (
        f"flash-attn {fa['version']}" if fa["installed"] else f"flash-attn not installed ({fa['install']}): sdpa only"
    )
    skipped = ("\n\nSkipped: " + "; ".join(data["skipped"])) if data["skipped"] else ""
    peak = env["peak_bf16_flops"]
    peak_txt = f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "unknown (no MFU)"
    return (
        f"{env['gpu']}, CUDA {env['cuda']}, nccl {env['nccl']}; {fa_line}. Model: {C.shape_str(cfg)}, "
        f"{data['n_params']:,} params, bf16; batch {args.batch} × seq {args.seq}; {args.warmup} warm-up + "
        f"{args.steps} timed steps (CUDA events). Model FLOPs per token {data['flops_per_token'] / 1e9:.2f} G; "
        f"device peak {peak_txt}. nccl collectives: {data['collectives']}.\n\n"
        f"{md}\n\nTarget ≥ 50 % MFU (nanotron 44-47 %, picotron ~50 % on 8×H100). Stock keeps bf16 AdamW moments; "
        f"hf3d keeps fp32 main grads, master weights and moments.{skipped}"
    )


if __name__ == "__main__":
    sys.exit(main())
