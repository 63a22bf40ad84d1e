"""`hf3d plan`'s memory prediction against what a run holds, rank by rank, selective recompute's cost, on CPU; and
the plans of published shapes.

Prediction: a tiny Llama (4 layers, hidden 48, GQA 6/2, tied) and a Qwen3-MoE of that shape (4 experts, top-2),
fp32 + AdamW, 2 rows of 64 tokens per micro-batch per dp rank, on each mesh of MESHES in fresh processes. Each rank
trains a warm-up step, then meters the second step's `train_step` (hf3d.plan.meter.ActivationMeter) and reads
`opt.memory_report()`; beside it, `Planner(config, Job(...)).plan(mesh)` for its pipeline rank, made offline.
Targets (the issue's): the training state within ±5 %, the activations within ±15 %, on every rank.
Selective recompute's cost: tp2 + sequence parallelism on a larger tiny Llama (hidden 256, 4 layers, 2 rows of
256 tokens) at none / selective / full, interleaved in rotated order, median of the slowest rank, with each one's
activation peak (measured and planned). CPU timings guard regressions: no target.
Published shapes: `hf3d plan` for SmolLM3-3B and an 8B Llama on 8 x 80 GB at 4k, 32k and 64k (predictions only).

    python benchmarks/bench_plan.py            # ~6 min on 2 cores
    python benchmarks/bench_plan.py --quick    # smoke: 3 meshes, 2 timed rounds of the small model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import _common as C
import torch

SEQ, ROWS, STATE_TOL, ACT_TOL = 64, 2, 0.05, 0.15
STATE_KEYS = ("params", "master_weights", "main_grads", "grad_bucket", "gathered_unit", "optimizer_state")
MESHES = {  # name: (model, processes, ParallelConfig keywords)
    "dp1 recompute none": ("llama", 1, {}),
    "dp1 recompute full": ("llama", 1, dict(recompute="full")),
    "dp1 recompute selective": ("llama", 1, dict(recompute="selective")),
    "tp2 + SP": ("llama", 2, dict(tp=2, sequence_parallel=True)),
    "pp2 1f1b, 4 mb": ("llama", 2, dict(pp=2, num_microbatches=4)),
    "pp2 interleaved-1f1b, 4 mb": ("llama", 2, dict(pp=2, pp_schedule="interleaved-1f1b", num_microbatches=4)),
    "dp2 ZeRO-1": ("llama", 2, dict(zero_stage=1)),
    "dp2 ZeRO-2": ("llama", 2, dict(zero_stage=2)),
    "dp2 ZeRO-3": ("llama", 2, dict(zero_stage=3)),
    "cp2": ("llama", 2, dict(cp=2)),
    "dp2 ep2 (Qwen3-MoE)": ("moe", 2, dict(ep=2)),
}
QUICK_MESHES = ("dp1 recompute selective", "pp2 interleaved-1f1b, 4 mb", "dp2 ep2 (Qwen3-MoE)")
RECOMPUTE = ("none", "selective", "full")
SPEED_MESH = dict(tp=2, sequence_parallel=True)


def save_models(root: Path, *, quick: bool) -> dict[str, str]:
    from transformers import Qwen3MoeConfig

    tiny = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=4, vocab_size=101, max_position_embeddings=128)
    configs = {
        "llama": C.llama_config(**tiny, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
        "moe": Qwen3MoeConfig(
            **tiny, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
            output_router_logits=True, router_aux_loss_coef=0.05, rms_norm_eps=1e-5, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "speed": C.llama_config(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=2048, num_attention_heads=8,
            num_key_value_heads=4, tie_word_embeddings=True,
        ),
    }  # fmt: skip
    if quick:
        configs["speed"] = configs["llama"]
    for name, cfg in configs.items():
        C.save_model_dir(cfg, root / name, dtype=torch.float32)
    return {name: str(root / name) for name in configs}


def _batch(pm, g, rows: int, seq: int):
    ids = torch.randint(0, pm.config.vocab_size, (rows, seq + 1), generator=g)  # [rows, seq + 1]
    return ids[:, :-1], ids[:, 1:]


def mesh_worker(model_dir: str, kw: dict, out: str) -> None:
    from hf3d.plan.meter import ActivationMeter

    hf3d = C.import_hf3d()
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**kw))
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(pm.dp_rank)  # the ranks of one dp replica read the same rows
    meter = ActivationMeter(pm.hf_model)  # its weights are not activations (ZeRO-3 gathers them in the step)
    for step in range(2):  # a warm-up step (the optimizer's state exists after it), then the metered one
        ids, targets = _batch(pm, g, ROWS * pm.pcfg.num_microbatches, SEQ)
        with meter if step else contextlib.nullcontext():
            pm.train_step(ids, shift_labels=targets)
        opt.step()
        opt.zero_grad()
    C.write_rank(out, {"activations": meter.peak, **opt.memory_report()})


def speed_worker(model_dir: str, rounds: int, seq: int, out: str) -> None:
    import torch.distributed as dist

    from hf3d.plan.meter import ActivationMeter

    hf3d = C.import_hf3d()
    torch.set_num_threads(1)
    pms = {r: hf3d.parallelize(model_dir, hf3d.ParallelConfig(**SPEED_MESH, recompute=r)) for r in RECOMPUTE}
    opts = {r: hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4) for r, pm in pms.items()}
    g, rec = torch.Generator().manual_seed(0), {"times": {r: [] for r in RECOMPUTE}, "activations": {}}
    for i in range(rounds + 2):  # round 0 warms up, round 1 is metered, the rest are timed
        for r in RECOMPUTE[i % 3 :] + RECOMPUTE[: i % 3]:
            ids, targets = _batch(pms[r], g, ROWS, seq)
            meter = ActivationMeter() if i == 1 else contextlib.nullcontext()
            dist.barrier()
            t0 = time.perf_counter()
            with meter:
                pms[r].train_step(ids, shift_labels=targets)
            opts[r].step()
            if i > 1:
                rec["times"][r].append(time.perf_counter() - t0)
            if i == 1:
                rec["activations"][r] = meter.peak
            opts[r].zero_grad()
    C.write_rank(out, rec)


def plan(model_dir: str, kw: dict, nproc: int, seq: int):
    """(the resolved mesh, hf3d plan's MeshPlan for it) at this benchmark's job."""
    from transformers import AutoConfig

    from hf3d import ParallelConfig
    from hf3d.models import get_adapter
    from hf3d.plan.memory import Job
    from hf3d.plan.planner import Planner

    cfg, pcfg = AutoConfig.from_pretrained(model_dir), ParallelConfig(**kw).resolve(nproc)
    job = Job(seq_len=seq, global_batch=ROWS * pcfg.num_microbatches * pcfg.dp, dtype_bytes=4, target="cpu",
              packed=False)  # fmt: skip
    return pcfg, Planner(cfg, job, adapter=get_adapter(cfg.model_type)).plan(pcfg)


def within(ratio: float, tol: float) -> str:
    return f"target within ±{tol:.0%}: {'met' if abs(ratio - 1) <= tol else 'missed'}"


def compare(name: str, models: dict, out: Path) -> dict:
    """Every rank of one mesh: predicted and measured bytes, and their ratios."""
    family, nproc, kw = MESHES[name]
    runs = C.run_workers(Path(__file__), nproc, ["--worker", models[family], json.dumps(kw)], out)
    pcfg, mesh_plan = plan(models[family], kw, nproc, SEQ)
    ranks = []
    for rank, m in enumerate(runs):
        p = mesh_plan.ranks[rank // (nproc // pcfg.pp)]
        measured = {"state": sum(m.get(k, 0) for k in STATE_KEYS), "activations": m["activations"]}
        predicted = {"state": p.state_total, "activations": p.activations}
        ratio = {k: predicted[k] / measured[k] for k in measured}
        ranks.append(dict(rank=rank, predicted=predicted, measured=measured, ratio=ratio, report=m, plan=p.as_dict()))
    return {"model": family, "nproc": nproc, "mesh": kw, "micro_batch": mesh_plan.micro_batch, "ranks": ranks}


def recompute_cost(models: dict, rounds: int, seq: int, work: Path) -> dict:
    """tp2 + SP at recompute none / selective / full in the same processes: step times, activation peaks."""
    from transformers import AutoConfig

    speed = C.run_workers(Path(__file__), 2, ["--speed", models["speed"], str(rounds), str(seq)], work / "speed")
    slowest = {r: [max(w["times"][r][i] for w in speed) for i in range(rounds)] for r in RECOMPUTE}  # per round
    times = {r: C.median(slowest[r]) for r in RECOMPUTE}
    acts = {r: max(w["activations"][r] for w in speed) for r in RECOMPUTE}
    planned = {r: plan(models["speed"], {**SPEED_MESH, "recompute": r}, 2, seq)[1].ranks[0].activations
               for r in RECOMPUTE}  # fmt: skip
    cfg = AutoConfig.from_pretrained(models["speed"])
    return {
        "model": C.shape_str(cfg), "hidden": cfg.hidden_size, "mesh": SPEED_MESH, "seq_len": seq, "rows": ROWS,
        "rounds": rounds, "step_s": slowest, "median_step_s": times, "activations": acts,
        "planned_activations": planned,
        "step_over_none": {r: times[r] / times["none"] for r in RECOMPUTE},
        "activations_over_none": {r: acts[r] / acts["none"] for r in RECOMPUTE},
    }  # fmt: skip


def tables(d: dict) -> str:
    w, rc = d["worst"], d["recompute"]
    body = (
        f"Models: a tiny Llama (4 layers, hidden 48, 6/2 heads, tied) and a tiny Qwen3-MoE (4 experts, top-2), fp32 "
        f"+ AdamW; {ROWS} rows of {SEQ} tokens per micro-batch per dp rank. Bytes per rank: the training state "
        "(weights + master + gradients + optimizer state) from `opt.memory_report()`, the activations from "
        "`ActivationMeter` around the second step's `train_step`; predicted by `Planner(...).plan(mesh)`.\n\n"
        f"Worst predicted / measured: training state {w['state']:.4f}x ({within(w['state'], STATE_TOL)}), "
        f"activations {w['activations']:.4f}x ({within(w['activations'], ACT_TOL)}).\n\n"
    )
    rows = []
    for name, m in d["meshes"].items():
        for r in m["ranks"]:
            cells = [name, str(r["rank"])]
            for k, tol in (("state", STATE_TOL), ("activations", ACT_TOL)):
                pred, meas, q = r["predicted"][k], r["measured"][k], r["ratio"][k]
                cells += [f"{pred:,}", f"{meas:,}", f"{q:.4f}", within(q, tol)]
            rows.append(cells)
    body += C.md_table(["mesh", "rank", "state predicted B", "state measured B", "ratio", "verdict",
                        "activations predicted B", "activations measured B", "ratio", "verdict"], rows)  # fmt: skip
    body += (
        f"\n\n## Selective recompute's cost: {rc['model']}, tp2 + sequence parallelism, {rc['rows']} rows of "
        f"{rc['seq_len']} tokens, 2 processes\n\nStep = `train_step` + `opt.step()`, median of {rc['rounds']} "
        "interleaved rounds, slowest rank. CPU timings are regression guards: no target.\n\n"
    )
    body += C.md_table(
        ["recompute", "median step s", "step / none", "activations B (measured)", "activations / none",
         "activations B (planned)"],
        [[r, rc["median_step_s"][r], f"{rc['step_over_none'][r]:.3f}x", f"{rc['activations'][r]:,}",
          f"{rc['activations_over_none'][r]:.3f}x", f"{rc['planned_activations'][r]:,}"] for r in RECOMPUTE],
    )  # fmt: skip
    return body + f"\n\nWall time of the benchmark: {d['wall_s']:.0f} s."


SHAPES = {"SmolLM3-3B": "smollm3-3b-shape", "an 8B Llama": "llama-8b-shape"}  # examples/models/<folder>/config.json
CONTEXTS = {4096: 256, 32768: 32, 65536: 16}  # seq_len: rows a step (about 1M tokens)
GPU, GPUS = "80GB", 8


def published_shapes() -> dict:
    """hf3d plan's best meshes for SmolLM3-3B and an 8B Llama on 8 x 80 GB at 4k, 32k, 64k (bf16, AdamW, flash
    kernels, rows of one document: no masks), and what one layer keeps per token."""
    from transformers import AutoConfig

    from hf3d import ParallelConfig
    from hf3d.models import get_adapter
    from hf3d.plan import command, memory, planner

    out, gpu = {}, int(GPU.removesuffix("GB")) * 10**9
    for (name, folder), (seq, rows) in ((s, c) for s in SHAPES.items() for c in CONTEXTS.items()):
        config = AutoConfig.from_pretrained(C.BENCH_DIR.parent / "examples" / "models" / folder)
        job = memory.Job(seq_len=seq, global_batch=rows, packed=False)
        maker = planner.Planner(config, job, adapter=get_adapter(config.model_type))
        default = maker.plan(ParallelConfig(num_microbatches=rows // GPUS).resolve(GPUS))
        default.fits = default.peak <= command.HEADROOM * gpu
        plans = command.best_per_mesh(maker, config, maker.adapter, job, GPUS, gpu)
        per_h = {r: maker.activations(ParallelConfig(recompute=r).resolve(1)).layers[0] / seq / config.hidden_size
                 for r in RECOMPUTE}  # fmt: skip
        out[f"{name} at {seq // 1024}k"] = dict(
            head=command.TABLE_HEAD, rows=[command.table_row(p, default, 2**30) for p in [*plans[:4], default]],
            meshes=len(plans), fitting=sum(p.fits for p in plans), per_token_h=per_h, global_batch=rows, seq_len=seq,
            params=sum(n for n, _, _ in maker.params(default.pcfg, 0).params))  # fmt: skip
    return out


def shapes_tables(shapes: dict) -> str:
    body = (
        f"\n\n## Plans for published shapes: {GPUS} x {GPU}, bf16, AdamW, about 1M tokens a step\n\n`hf3d plan` "
        "(examples/models/smollm3-3b-shape, llama-8b-shape), CUDA's flash kernels, rows of one document (no masks): "
        "the four fastest meshes that fit (hf3d/plan/cost.py's estimate), then the default mesh at one row a "
        "micro-batch (*: dp over all, ZeRO-1, no recompute); GiB per rank of the fullest rank.\n"
    )
    for title, s in shapes.items():
        per = ", ".join(f"{k} {v:.1f}h" for k, v in s["per_token_h"].items())
        body += (
            f"\n### {title}: {s['params'] / 1e9:.2f}B parameters, {s['global_batch']} rows of {s['seq_len']} tokens; "
            f"{s['fitting']} of {s['meshes']} meshes fit; one layer keeps {per} bytes a token (h = hidden size, "
            "tp = cp = 1)\n\n" + C.md_table(s["head"], s["rows"]) + "\n"
        )
    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 meshes and 2 timed rounds of the small model: a smoke run")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    ap.add_argument("--speed", nargs=3, metavar=("MODEL", "ROUNDS", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return mesh_worker(args.worker[0], json.loads(args.worker[1]), args.out)
    if args.speed:
        return speed_worker(args.speed[0], int(args.speed[1]), int(args.speed[2]), args.out)

    t0, work = time.perf_counter(), Path(tempfile.mkdtemp(prefix="bench_plan_"))
    d = {"env": C.env_info(), "seq_len": SEQ, "rows_per_microbatch": ROWS, "meshes": {}}
    try:
        models = save_models(work, quick=args.quick)
        for i, name in enumerate(QUICK_MESHES if args.quick else MESHES):
            d["meshes"][name] = compare(name, models, work / str(i))
            print(f"{name}: {[r['ratio'] for r in d['meshes'][name]['ranks']]}", flush=True)
        d["recompute"] = recompute_cost(models, *((2, SEQ) if args.quick else (8, 256)), work)
        d["shapes"] = {} if args.quick else published_shapes()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [r["ratio"] for m in d["meshes"].values() for r in m["ranks"]]
    d["worst"] = {k: max((q[k] for q in ratios), key=lambda x: abs(x - 1)) for k in ("state", "activations")}
    d["wall_s"] = time.perf_counter() - t0
    body = tables(d) + shapes_tables(d["shapes"])
    print(C.write_results("plan", "`hf3d plan`'s memory prediction against measured runs, CPU", body, d,
                          quick=args.quick))  # fmt: skip
    print(body)


if __name__ == "__main__":
    main()
