"""Training checkpoints on CPU: the stall a save puts on training, synchronous and async, and load vs raw I/O.

A SmolLM2-135M-shaped Llama (its first --layers layers, fp32, AdamW) trains on 2 gloo processes at dp=2 (ZeRO-1)
and at pp=2, saving with `hf3d.save_checkpoint` synchronously and with `async_=True` (`checkpoint.async: true`).
At dp=2 also `async-copy`: the async save a GPU makes (the state copied into the staging arena, the file written
by the writer process), told to run so on the CPU, after `prepare_async_save` as `hf3d train` calls it.
Each round: two plain steps, the save, for async the steps beside the background write until every rank's part
is done, two plain steps, then a raw write + fsync of as many bytes per rank, `hf3d.load_checkpoint` into a fresh
model and optimizer, and a raw read of the raw file (both from disk: their pages are dropped from the cache first).
- save: the time `save_checkpoint` blocks the step (sync: the whole save);
- overlap (async): what the write costs the steps beside it, Σ (step − the round's plain step, the median of
  its four plain steps) plus any wait left at `result()`;
- stall = save + overlap, in steps (async target ≤ 0.1 step), the median over the rounds of the slowest rank,
  and from the 3rd save on (a model's first two async saves are its warm-up);
- restored exactly: the loaded parameters equal a copy taken when the save was called.

    python benchmarks/bench_checkpoint.py [--layers 8] [--rounds 8]    # ~8 min on 2 cores
    python benchmarks/bench_checkpoint.py --quick                       # 2 layers, 1 round; results/quick/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import _common as C

MESHES = {"dp2-zero1": {}, "pp2": {"pp": 2}}
MODES = {"dp2-zero1": ("sync", "async", "async-copy"), "pp2": ("sync", "async")}
TARGET = 0.1


def _drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_synced(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def worker(model_dir: str, work: str, mesh: str, mode: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()
    torch.set_num_threads(1)

    def build():
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**MESHES[mesh]))
        return pm, hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    (pm, opt), (pm2, opt2) = build(), build()
    g = torch.Generator().manual_seed(0)

    def step() -> float:
        ids = torch.randint(0, pm.config.vocab_size, (4, 128), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step(ids, ids)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def all_done(pending) -> bool:
        done = torch.tensor(int(pending.done()))
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    step()  # the first step (allocations, the first collectives) is not a plain one
    if mode == "async-copy":
        from hf3d.checkpoint import save

        save._copies = lambda pmodel, opt: True  # as on a GPU
        save.prepare_async_save(pm, opt)
    rank = dist.get_rank()
    ckpt, raw = Path(work) / f"ckpt-{mesh}-{mode}", Path(work) / f"raw_{rank}.bin"
    times = {k: [] for k in ("save", "overlap", "step", "raw_write", "load", "raw_read")}
    same = True
    for _ in range(rounds):
        plain = [step(), step()]
        saved = [p.detach().clone() for p in pm.parameters()]
        dist.barrier()
        t0 = time.perf_counter()
        pending = hf3d.save_checkpoint(ckpt, pm, opt, step=3, async_=mode != "sync")
        times["save"].append(time.perf_counter() - t0)
        beside, wait = [], 0.0
        if mode != "sync":
            beside.append(step())
            while not all_done(pending):
                beside.append(step())
            t0 = time.perf_counter()
            pending.result()
            wait = time.perf_counter() - t0
        plain += [step(), step()]
        times["step"].append(C.median(plain))
        times["overlap"].append(sum(w - C.median(plain) for w in beside) + wait)
        mine = sum(f.stat().st_size for f in ckpt.glob(f"__{rank}_*.distcp"))
        payload = os.urandom(1 << 20) * max(1, mine >> 20)  # as many bytes as this rank's checkpoint file
        times["raw_write"].append(timed(lambda p=payload: _write_synced(raw, p)))
        del payload
        for f in [raw, *(p for p in ckpt.rglob("*") if p.is_file())]:
            _drop_cached(f)
        times["load"].append(timed(lambda: hf3d.load_checkpoint(ckpt, pm2, opt2)))
        times["raw_read"].append(timed(raw.read_bytes))
        same = same and all(torch.equal(a, b) for a, b in zip(saved, pm2.parameters()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(times=times, bytes=mine, same=same))
    if rank == 0:
        (Path(work) / f"{mesh}-{mode}.json").write_text(json.dumps(everyone))
    hf3d.finish()


def summary(ranks: list[dict], rounds: int) -> dict:
    """The slowest rank's value per round, its median over the rounds, and the stall in steps."""
    slowest = {k: [max(r["times"][k][i] for r in ranks) for i in range(rounds)] for k in ranks[0]["times"]}
    stall = [s + max(0.0, o) for s, o in zip(slowest["save"], slowest["overlap"])]
    rounds_steps = [s / st for s, st in zip(stall, slowest["step"])]
    return dict(
        slowest={k: C.median(v) for k, v in slowest.items()},
        step_s=C.median(slowest["step"]),
        stall_s=C.median(stall),
        stall_steps=C.median(rounds_steps),
        rounds_steps=rounds_steps,
        steady_steps=C.median(rounds_steps[2:]) if rounds > 2 else None,
        bytes=sum(r["bytes"] for r in ranks),
        restored=all(r["same"] for r in ranks),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 round: a smoke run")
    ap.add_argument("--worker", nargs=5, metavar=("MODEL", "WORK", "MESH", "MODE", "ROUNDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        m, w, mesh, mode, r = args.worker
        return worker(m, w, mesh, mode, int(r))
    import torch

    layers, rounds = (2, 1) if args.quick else (args.layers, args.rounds)
    cfg = C.llama_config(**{**C.SMOLLM2_135M, "num_hidden_layers": layers})
    data, rows = {"env": C.env_info(), "model": C.shape_str(cfg), "rounds": rounds, "meshes": {}}, []
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        data["params"] = C.save_model_dir(cfg, work / "model", dtype=torch.float32)
        for mesh in MESHES:
            for mode in MODES[mesh]:
                proc = C.torchrun(
                    Path(__file__), 2, ["--worker", str(work / "model"), str(work), mesh, mode, str(rounds)]
                )
                if proc.returncode:
                    raise SystemExit(f"{mesh} {mode} failed:\n{C.worker_errors(proc.stderr)}")
                m = summary(json.loads((work / f"{mesh}-{mode}.json").read_text()), rounds)
                data["meshes"].setdefault(mesh, {})[mode] = m
                t, steady = m["slowest"], m["steady_steps"]
                verdict = f" ({'met' if m['stall_steps'] <= TARGET else 'missed'})" if mode != "sync" else ""
                rows.append(
                    [
                        mesh,
                        mode,
                        f"{m['bytes'] / 2**20:.0f}",
                        m["step_s"],
                        t["save"],
                        t["overlap"] if mode != "sync" else "—",
                        f"{m['stall_steps']:.2f}{verdict}",
                        "—" if steady is None else f"{steady:.2f}",
                        f"{t['save'] / t['raw_write']:.2f}x",
                        f"{t['load'] / t['raw_read']:.2f}x",
                        str(m["restored"]),
                    ]
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    headers = [
        "mesh",
        "mode",
        "checkpoint MiB",
        "step s",
        "save s (blocks)",
        "overlap s",
        "stall in steps",
        "from the 3rd save",
        "save / raw write",
        "load / raw read",
        "restored exactly",
    ]
    body = (
        f"Model: {data['model']} ({data['params'] / 1e6:.1f}M params, fp32, AdamW), 2 processes, 4 x 128 tokens per "
        f"step, {rounds} round(s), medians of the slowest rank. Async target: stall ≤ {TARGET} step.\n\n"
        + C.md_table(headers, rows)
    )
    print(body)
    print(f"\nwrote {C.write_results('checkpoint', 'Checkpoint stall, save and load', body, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
