"""The switches of issue 20 on one GPU: FP8 (torchao), compiled layers and async checkpoints, then gpu_smollm.

Each part runs on its own: a part that fails is recorded with its error and the next one runs; a part not
started within --budget-s is recorded as skipped. Parts, in order:
- fp8 parity: hf3d's FP8 step at tp=1 with 2 micro-batches against torchao's `convert_to_float8_training` on
  the stock model, gradients accumulated over the same 2 chunks of rows, fp32 master weights, AdamW, 3 steps,
  real fp8 matmuls (torch._scaled_mm): losses, grad norms and weights, per recipe; the output head stays high.
- compile parity: compiled decoder layers against eager, fp32, 3 steps: losses and grad norms.
- async checkpoint: the stall per save in steps, synchronous and `async_=True` (staged to pinned memory on a
  stream of its own), a SmolLM2-135M shape in bf16 with fp32 AdamW state; the async save restores exactly.
- fp8 speed: step time of bf16, FP8 tensorwise and rowwise, eager and compiled, a SmolLM2-1.7B-wide model
  cut to a few layers, bf16 parameters.
- gpu_smollm.py's rows (hf3d against stock, MFU) with the time left.

torch before 2.12 names two collectives that hf3d calls by their 2.13 names (`all_gather_single`,
`reduce_scatter_single`) `all_gather_into_tensor` / `reduce_scatter_tensor`, with the same arguments: where
the newer names are missing, they are set to the older functions, and the results say so.

    python benchmarks/gpu_switches.py            # about 5 min on one H100/H200
    python benchmarks/gpu_switches.py --quick    # tiny shapes, results/quick/
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _common as C

sys.path.insert(0, str(C.REPO / "tests"))  # the oracle of the parity parts is the suite's own (tests/reference.py)
from reference import BETAS, LR, WD, accumulated_steps, hf3d_run  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
TINY_VOCAB = 256
PARITY_STEPS, PARITY_BATCH, PARITY_SEQ = 3, 8, 32


def older_torch_aliases(dist) -> list[str]:
    set_here = []
    for new, old in (
        ("all_gather_single", "all_gather_into_tensor"),
        ("reduce_scatter_single", "reduce_scatter_tensor"),
    ):
        if not hasattr(dist, new):
            setattr(dist, new, getattr(dist, old))
            set_here.append(f"dist.{new} = dist.{old}")
    return set_here


def tiny_dir(torch, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = C.llama_config(**TINY, vocab_size=TINY_VOCAB, tie_word_embeddings=False, max_position_embeddings=128)
    path = root / "tiny"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def parity_batches(torch):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(PARITY_STEPS):
        ids = torch.randint(1, TINY_VOCAB, (PARITY_BATCH, PARITY_SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        out.append((ids.cuda(), labels.cuda()))
    return out


def hf3d_steps(pmodel, data) -> tuple[list[float], list[float]]:
    """hf3d's losses and grad norms under the oracle's AdamW (tests/reference.py), every row on this rank."""
    losses, norms, _ = hf3d_run(pmodel, data, slice(None))
    return losses, norms


def stock_fp8_steps(torch, model_dir, data, cfg, chunks: int):
    """torchao's FP8 stock model with the oracle's AdamW, gradients accumulated over `chunks` row chunks."""
    from torchao.float8 import convert_to_float8_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    convert_to_float8_training(model, config=cfg.torchao_config(), module_filter_fn=cfg.module_filter_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS)
    losses, norms = accumulated_steps(model, opt, data, chunks)
    return losses, norms, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def part_fp8_parity(torch, root: Path, args) -> dict:
    import hf3d

    model_dir = tiny_dir(torch, root)
    data = parity_batches(torch)
    out = {}
    for recipe in ("tensorwise", "rowwise"):
        try:
            out[recipe] = fp8_parity_of(torch, hf3d.FP8Config(recipe=recipe), model_dir, data, root)
        except Exception as e:  # one recipe's kernel missing must not hide the other's result
            out[recipe] = dict(error=f"{type(e).__name__}: {e}"[:600], trace=traceback.format_exc()[-1500:])
        gc.collect()
    return out


def fp8_parity_of(torch, cfg, model_dir: Path, data, root: Path) -> dict:
    from safetensors.torch import load_file

    import hf3d

    pmodel = hf3d.parallelize(model_dir, hf3d.ParallelConfig(num_microbatches=2), fp8=cfg)
    heads = [m for n, m in pmodel.named_modules() if n.endswith("lm_head")]
    converted = sum(getattr(m, "fp8", None) is not None for m in pmodel.modules())
    losses, norms = hf3d_steps(pmodel, data)
    pmodel.save_pretrained(root / f"fp8-{cfg.recipe}")
    got = load_file(root / f"fp8-{cfg.recipe}" / "model.safetensors")
    ref_losses, ref_norms, ref = stock_fp8_steps(torch, model_dir, data, cfg, chunks=2)
    start = load_file(model_dir / "model.safetensors")
    num = sum(float((got[k] - v).square().sum()) for k, v in ref.items() if k in got)
    den = sum(float((start[k] - v).square().sum()) for k, v in ref.items() if k in got)
    return dict(
        losses=losses,
        ref_losses=ref_losses,
        loss_rel=rel(losses, ref_losses),
        norm_rel=rel(norms, ref_norms),
        weight_max_abs=max(float((got[k] - v).abs().max()) for k, v in ref.items() if k in got),
        update_rel=(num / den) ** 0.5,
        converted_linears=converted,
        head_fp8=any(getattr(m, "fp8", None) is not None for m in heads),
    )


def part_compile_parity(torch, root: Path, args) -> dict:
    import hf3d

    model_dir = tiny_dir(torch, root)
    data = parity_batches(torch)
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        pmodel = hf3d.parallelize(model_dir, hf3d.ParallelConfig(num_microbatches=2), compile=compiled)
        t0 = time.perf_counter()
        runs[compiled] = hf3d_steps(pmodel, data) + (time.perf_counter() - t0,)
        del pmodel
    (el, en, _), (cl, cn, cs) = runs[False], runs[True]
    return dict(eager_losses=el, compiled_losses=cl, loss_rel=rel(cl, el), norm_rel=rel(cn, en), compiled_run_s=cs)


def timed_step(torch, pmodel, opt, ids) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pmodel.train_step(ids, ids)
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def part_async_checkpoint(torch, root: Path, args) -> dict:
    import hf3d

    shape = dict(C.SMOLLM2_135M, num_hidden_layers=4) if args.quick else C.SMOLLM2_135M
    model_dir = root / "ckpt-model"
    torch.manual_seed(0)
    C.save_model_dir(C.llama_config(**shape), model_dir, dtype=torch.bfloat16)
    pmodel = hf3d.parallelize(model_dir, hf3d.ParallelConfig(), dtype=torch.bfloat16)
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, weight_decay=WD, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
    for _ in range(3):
        timed_step(torch, pmodel, opt, ids)
    plain = C.median([timed_step(torch, pmodel, opt, ids) for _ in range(5)])
    out = {"step_s": plain, "sync": [], "async": []}
    for i in range(args.rounds):
        t0 = time.perf_counter()
        hf3d.save_checkpoint(root / f"sync-{i}", pmodel, opt, step=i)
        out["sync"].append((time.perf_counter() - t0) / plain)
        shutil.rmtree(root / f"sync-{i}")  # the saves write GiBs: keep one on disk at a time
        timed_step(torch, pmodel, opt, ids)
    for i in range(args.rounds):
        saved = {k: v.detach().float().cpu() for k, v in pmodel.unique_parameters()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = hf3d.save_checkpoint(root / f"async-{i}", pmodel, opt, step=i, async_=True)
        stall = time.perf_counter() - t0
        steps = 0
        while not pending.done() or steps == 0:
            stall += timed_step(torch, pmodel, opt, ids) - plain
            steps += 1
        pending.result()
        if i == 0:
            out["checkpoint_bytes"] = sum(f.stat().st_size for f in (root / "async-0").rglob("*") if f.is_file())
        else:
            shutil.rmtree(root / f"async-{i - 1}")
        out["async"].append(stall / plain)
        out.setdefault("steps_beside_write", []).append(steps)
    back = hf3d.parallelize(model_dir, hf3d.ParallelConfig(), dtype=torch.bfloat16)
    hf3d.load_checkpoint(
        root / f"async-{args.rounds - 1}", back, hf3d.build_optimizer(back, torch.optim.AdamW, lr=1e-4)
    )
    out["restored_exactly"] = all(torch.equal(saved[k], v.detach().float().cpu()) for k, v in back.unique_parameters())
    out["sync_median_steps"] = C.median(out["sync"])
    out["async_median_steps"] = C.median(out["async"])
    return out


def part_fp8_speed(torch, root: Path, args) -> dict:
    import hf3d

    layers = 2 if args.quick else 8
    shape = dict(C.SMOLLM2_1_7B, num_hidden_layers=layers)
    if args.quick:
        shape.update(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4)
    model_dir = root / "speed-model"
    torch.manual_seed(0)
    C.save_model_dir(C.llama_config(**shape), model_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
    rows = {}
    for fp8 in ("off", "tensorwise", "rowwise"):
        for compiled in (False, True):
            name = f"{'bf16' if fp8 == 'off' else 'fp8 ' + fp8}{' compiled' if compiled else ''}"
            if time.perf_counter() > args.deadline:
                rows[name] = dict(error="not started: the time budget was spent")
                continue
            try:
                torch._dynamo.reset()
                pmodel = hf3d.parallelize(
                    model_dir, hf3d.ParallelConfig(), dtype=torch.bfloat16, fp8=fp8, compile=compiled
                )
                opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, weight_decay=WD, max_grad_norm=1.0)
                t0 = time.perf_counter()
                first = [timed_step(torch, pmodel, opt, ids) for _ in range(3)]
                steps = [timed_step(torch, pmodel, opt, ids) for _ in range(args.steps)]
                rows[name] = dict(step_s=C.median(steps), warmup_s=time.perf_counter() - t0 - sum(steps), first=first)
            except Exception as e:
                rows[name] = dict(error=f"{type(e).__name__}: {e}"[:600], trace=traceback.format_exc()[-1500:])
            pmodel = opt = None
            gc.collect()
            torch.cuda.empty_cache()
            print(f"  fp8 speed {name}: {rows[name]}", flush=True)
    base = rows.get("bf16", {}).get("step_s")
    for r in rows.values():
        if base and "step_s" in r:
            r["vs_bf16_eager"] = r["step_s"] / base
    return dict(shape=C.shape_str(C.llama_config(**shape)), tokens_per_step=ids.numel(), rows=rows)


PARTS = {
    "fp8 parity": part_fp8_parity,
    "compile parity": part_compile_parity,
    "async checkpoint": part_async_checkpoint,
    "fp8 speed": part_fp8_speed,
}


def report(data: dict) -> str:
    lines = [f"{data['env'].get('gpu')}, torch {data['env'].get('torch')}, CUDA {data['env'].get('cuda')}."]
    if data["aliases"]:
        lines.append(f"Set for this older torch: {'; '.join(data['aliases'])}.")
    for name, part in data["parts"].items():
        lines.append(f"\n### {name} ({part.get('wall_s', 0):.0f} s)\n")
        if "error" in part or "skipped" in part:
            lines.append(f"{part.get('skipped') or part['error']}\n\n```\n{part.get('trace', '')}\n```")
            continue
        res = part["result"]
        if name == "fp8 parity":
            rows = [
                [
                    r,
                    f"{v['loss_rel']:.1e}",
                    f"{v['norm_rel']:.1e}",
                    f"{v['weight_max_abs']:.1e}",
                    f"{v['update_rel']:.1e}",
                    v["converted_linears"],
                    "yes" if v["head_fp8"] else "no",
                ]
                if "error" not in v
                else [r, v["error"], "", "", "", "", ""]
                for r, v in res.items()
            ]
            heads = [
                "recipe",
                "losses, max rel",
                "grad norms, max rel",
                "weights, max abs",
                "update, rel",
                "fp8 linears",
                "head in fp8",
            ]
            lines.append(C.md_table(heads, rows))
        elif name == "compile parity":
            lines.append(f"compiled vs eager: losses max rel {res['loss_rel']:.1e}, grad norms {res['norm_rel']:.1e}")
        elif name == "async checkpoint":
            lines.append(
                f"step {res['step_s']:.3f} s; checkpoint {res['checkpoint_bytes'] / 2**20:.0f} MiB; stall per save in "
                f"steps: sync {C.fmt(res['sync_median_steps'])} (rounds {', '.join(C.fmt(x) for x in res['sync'])}), "
                f"async {C.fmt(res['async_median_steps'])} (rounds {', '.join(C.fmt(x) for x in res['async'])}; "
                f"steps beside the write {res['steps_beside_write']}); async save restored exactly: "
                f"{res['restored_exactly']}"
            )
        elif name == "fp8 speed":
            rows = [
                [n, C.fmt(r.get("step_s")), C.fmt(r.get("vs_bf16_eager")), C.fmt(r.get("warmup_s")), r.get("error", "")]
                for n, r in res["rows"].items()
            ]
            lines.append(f"{res['shape']}; {res['tokens_per_step']} tokens per step\n")
            lines.append(C.md_table(["row", "step s (median)", "/ bf16 eager", "warm-up s", "error"], rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes; results/quick/")
    ap.add_argument("--budget-s", type=float, default=330, help="parts not started by then are skipped")
    ap.add_argument("--smollm-s", type=float, default=120, help="gpu_smollm.py's own budget (0: skip it)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.steps, args.rounds = 128, 2, 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_switches.py: CUDA is not available; this script measures the GPU path only", flush=True)
        return 2
    import torch.distributed as dist

    aliases = older_torch_aliases(dist)
    from hf3d.mesh import init_distributed

    init_distributed()
    t_start = time.perf_counter()
    args.deadline = t_start + args.budget_s + 90  # the rows of the last part started by then
    env = C.env_info()
    env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    data = {"env": env, "args": vars(args), "aliases": aliases, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_switches_") as tmp:
        for name, fn in PARTS.items():
            if name not in args.parts.split(","):
                continue
            if time.perf_counter() - t_start > args.budget_s:
                data["parts"][name] = {"skipped": f"not started: the {args.budget_s:.0f} s budget was spent"}
                continue
            root = Path(tmp) / name.replace(" ", "-")
            root.mkdir()
            t0 = time.perf_counter()
            try:
                part = {"result": fn(torch, root, args)}
            except Exception as e:  # a part that fails must not hide the others
                part = {"error": f"{type(e).__name__}: {e}"[:800], "trace": traceback.format_exc()[-2500:]}
            part["wall_s"] = time.perf_counter() - t0
            data["parts"][name] = part
            print(f"{name}: {part}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    data["wall_s"] = time.perf_counter() - t_start
    body = report(data)
    print(body, flush=True)
    C.write_results("gpu_switches", "Issue 20's switches on one GPU", body, data, quick=args.quick)
    if args.smollm_s > 0:
        import gpu_smollm

        dist.destroy_process_group()
        gpu_smollm.main(["--no-install", "--budget-s", str(args.smollm_s)] + (["--quick"] if args.quick else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
