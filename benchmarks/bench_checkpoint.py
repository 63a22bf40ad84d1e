"""Training checkpoints: save and load time next to raw I/O of the same bytes, and the training stall.

A SmolLM2-135M-shaped Llama (first --layers of its 30 layers, fp32, AdamW) trained on 2 processes at
dp=2 (ZeRO-1) and at pp=2 (tp=2 does not fit its 9/3 heads). Per mesh, in one run:
  - step: median time of one training step (4 x 128 tokens per dp rank);
  - save: `hf3d.save_checkpoint` (collective, atomic, fsync'd by DCP) = the training stall per save,
    since the save is synchronous;
  - raw write: each rank writes the same number of bytes to its own file with one write + fsync;
  - load: `hf3d.load_checkpoint` into a fresh model + optimizer on the same mesh;
  - raw read: each rank reads its raw file back (both reads find the files in the page cache).
Rounds alternate (save, raw write, load, raw read) and the medians of the slowest rank are reported.

    python benchmarks/bench_checkpoint.py [--layers 8] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    SMOLLM2_135M,
    env_info,
    import_hf3d,
    leave_distributed,
    llama_config,
    md_table,
    median,
    save_model_dir,
    shape_str,
    torchrun,
    write_results,
)

MESHES = {"dp2-zero1": dict(), "pp2": dict(pp=2)}


def smollm2_135m(layers: int):
    return llama_config(**{**SMOLLM2_135M, "num_hidden_layers": layers})


def worker(model_dir: str, work: str, mesh: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    hf3d = import_hf3d()

    torch.set_num_threads(1)
    pcfg = hf3d.ParallelConfig(**MESHES[mesh])

    def build():
        pm = hf3d.parallelize(model_dir, pcfg)
        return pm, hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    pm, opt = build()
    g = torch.Generator().manual_seed(0)
    step_times = []
    for _ in range(3):
        ids = torch.randint(0, 49152, (4, 128), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step(ids, ids)
        opt.step()
        opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
    rank = dist.get_rank()
    ckpt, raw = Path(work) / "ckpt", Path(work) / f"raw_{rank}.bin"
    times = {"save": [], "raw_write": [], "load": [], "raw_read": []}
    pm2, opt2 = build()
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        hf3d.save_checkpoint(ckpt, pm, opt, step=3)
        times["save"].append(time.perf_counter() - t0)
        mine = sum(f.stat().st_size for f in ckpt.glob(f"__{rank}_*.distcp"))
        payload = os.urandom(1 << 20) * max(1, mine >> 20)
        dist.barrier()
        t0 = time.perf_counter()
        with open(raw, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        times["raw_write"].append(time.perf_counter() - t0)
        del payload
        dist.barrier()
        t0 = time.perf_counter()
        hf3d.load_checkpoint(ckpt, pm2, opt2)
        times["load"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        raw.read_bytes()
        dist.barrier()
        times["raw_read"].append(time.perf_counter() - t0)
    same = all(torch.equal(a, b) for (_, a), (_, b) in zip(pm.unique_parameters(), pm2.unique_parameters()))
    res = dict(times=times, step=step_times[1:], bytes=mine, same=same)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if rank == 0:
        (Path(work) / f"{mesh}.json").write_text(json.dumps(everyone))
    leave_distributed()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 round: a smoke run")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "WORK", "MESH", "ROUNDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        m, w, mesh, r = args.worker
        return worker(m, w, mesh, int(r))
    import torch

    layers, rounds = (2, 1) if args.quick else (args.layers, args.rounds)
    cfg = smollm2_135m(layers)
    env = env_info()
    work = Path(tempfile.mkdtemp(prefix="hf3d-bench-ckpt-"))
    rows, data = [], {"env": env, "model": shape_str(cfg), "meshes": {}}
    try:
        n = save_model_dir(cfg, work / "model", dtype=torch.float32)
        data["params"] = n
        for mesh in MESHES:
            proc = torchrun(Path(__file__), 2, ["--worker", str(work / "model"), str(work), mesh, str(rounds)])
            if proc.returncode:
                raise SystemExit(f"{mesh} failed:\n{proc.stderr[-3000:]}")
            ranks = json.loads((work / f"{mesh}.json").read_text())
            slowest = {
                k: median([max(r["times"][k][i] for r in ranks) for i in range(rounds)]) for k in ranks[0]["times"]
            }
            step = median([max(r["step"][i] for r in ranks) for i in range(len(ranks[0]["step"]))])
            total = sum(r["bytes"] for r in ranks)
            restored = all(r["same"] for r in ranks)
            data["meshes"][mesh] = dict(slowest=slowest, step_s=step, bytes=total, restored=restored)
            rows.append(
                [
                    mesh,
                    f"{total / 2**20:.0f}",
                    f"{step:.3f}",
                    f"{slowest['save']:.3f}",
                    f"{slowest['raw_write']:.3f}",
                    f"{slowest['save'] / slowest['raw_write']:.2f}x",
                    f"{slowest['save'] / step:.2f}",
                    f"{slowest['load']:.3f}",
                    f"{slowest['raw_read']:.3f}",
                    str(restored),
                ]
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = md_table(
        [
            "mesh",
            "checkpoint MiB",
            "step s",
            "save s (= stall)",
            "raw write s",
            "save / raw",
            "stall in steps",
            "load s",
            "raw read s",
            "restored exactly",
        ],
        rows,
    )
    body = f"Model: {shape_str(cfg)} ({data['params'] / 1e6:.1f}M params, fp32, AdamW), 2 processes.\n\n{table}"
    print(body)
    write_results("checkpoint", "Checkpoint save/load vs raw I/O", body, data, quick=args.quick)


if __name__ == "__main__":
    main()
