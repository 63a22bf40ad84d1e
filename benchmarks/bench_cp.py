"""Context parallelism: activation memory per rank, step time and the attention's communication, fp32 CPU.

A SmolLM2-135M-shaped model cut to 2 layers (hidden 576, 9/3 heads, inter 1536, vocab 49152, tied),
initialised from a config-only directory (the same seed everywhere), one row of 8192 tokens of packed
documents per step, sdpa. `ParallelConfig(cp=c)` for c in 1, 2, 4, each a torchrun job of c processes
with one thread each and MALLOC_MMAP_THRESHOLD_=65536 (RSS follows live allocations).

Per rank and measured step (after one warm-up step that creates the optimizer state):
- peak activation memory, two ways: the bytes autograd holds for backward at the end of the forward
  (every distinct storage a saved-tensor pack hook sees, `torch.autograd.graph.saved_tensors_hooks`,
  parameters left out, over the whole train_step: with one micro-batch that is what the forward leaves
  for the backward; the fused output head runs its loss chunk by chunk and keeps no logits),
  and the peak RSS of train_step above the RSS before it (VmHWM reset just before), which also holds
  the output head's and the parameters' gradient buffers, the same at every cp;
- train_step wall time (the cp=c job runs the same 8192 tokens per step on c processes);
- the K/V bytes the rank received (all-gather forward + reduce-scatter backward), counted by
  `CPContext.kv_bytes`, against 2 (cp-1)/cp x layers x 2 x S x kv_heads x head_dim x 4 bytes.
The losses of every cp must agree (the same weights and tokens).

    python benchmarks/bench_cp.py            # seq 8192, 2 layers (~15 min on a busy 2-core machine)
    python benchmarks/bench_cp.py --quick    # tiny model, seq 256; results/quick/
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
CPS = (1, 2, 4)
QUICK_MODEL = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=1024
)


def _positions(seq: int):
    """Packed documents of 700-1900 tokens (position ids restart), crossing the cp chunk boundaries."""
    import torch

    g = torch.Generator().manual_seed(1)
    parts, total = [], 0
    while total < seq:
        n = min(int(torch.randint(max(seq // 12, 2), max(seq // 4, 3), (1,), generator=g)), seq - total)
        parts.append(torch.arange(n))
        total += n
    return torch.cat(parts).unsqueeze(0)


def _saved_bytes(fn, params):
    """Run fn() (a forward) and return (its result, bytes of the distinct storages saved for backward,
    the parameters' own storages left out: they are not activations)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if t.device.type != "meta" and s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    hf3d = C.import_hf3d()
    pm = hf3d.parallelize(args.dir, hf3d.ParallelConfig(cp=args.cp), seed=0)
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0)
    vocab = pm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    pos = _positions(args.seq)
    libc = ctypes.CDLL("libc.so.6")
    rec = {"cp": args.cp, "losses": [], "peak_above_rest": [], "saved_bytes": [], "step_s": [], "kv_bytes": []}
    for i in range(args.steps + 1):
        w = torch.randint(0, vocab, (1, args.seq + 1), generator=g)
        ids, targets = w[:, :-1], w[:, 1:]
        libc.malloc_trim(0)
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        rest, kv0 = C.proc_status()["VmRSS"], pm.cp.kv_bytes
        t0 = time.perf_counter()
        # one micro-batch: what autograd holds at the end of its forward is every storage saved in the step
        loss, saved = _saved_bytes(
            functools.partial(pm.train_step, ids, shift_labels=targets, position_ids=pos), pm.parameters()
        )
        step_s = time.perf_counter() - t0
        peak = C.proc_status()["VmHWM"] - rest
        kv = pm.cp.kv_bytes - kv0
        opt.step()
        opt.zero_grad()
        if i == 0:  # warm-up: the optimizer state is created here
            continue
        rec["losses"].append(loss.item())
        rec["peak_above_rest"].append(peak)
        rec["saved_bytes"].append(saved)
        rec["step_s"].append(step_s)
        rec["kv_bytes"].append(kv)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rec)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))


def run_cp(cp: int, cfg_dir: Path, out: Path, args) -> list[dict]:
    cmd = ["--worker", "--cp", str(cp), "--dir", str(cfg_dir), "--out", str(out)]
    cmd += ["--seq", str(args.seq), "--steps", str(args.steps)]
    proc = C.torchrun(SCRIPT, cp, cmd, env={**C.MALLOC_ENV, "OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"cp={cp} job failed:\n{C.tail(proc.stdout)}\n{C.tail(proc.stderr)}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, seq 256; results go to results/quick/")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1, help="measured steps after the warm-up step, per job")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.seq, args.steps = 256, 1
    shape = dict(C.SMOLLM2_135M, num_hidden_layers=args.layers, **(QUICK_MODEL if args.quick else {}))
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], args.seq)
    cfg = C.llama_config(**shape)
    env = C.env_info()
    runs: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_dir = Path(tmp) / "config-only"
        cfg.save_pretrained(cfg_dir)  # no weights: hf3d initialises from the seed, sharded, in every rank
        for cp in CPS:
            runs[cp] = run_cp(cp, cfg_dir, Path(tmp) / f"cp{cp}.json", args)
            print(
                f"cp={cp}: {[(r['peak_above_rest'], r['saved_bytes'], r['step_s']) for r in runs[cp]]}", file=sys.stderr
            )

    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    summary = {}
    for cp, ranks in runs.items():
        expected_kv = 2 * (cp - 1) * cfg.num_hidden_layers * 2 * args.seq * kv_heads * head_dim * 4 // cp
        summary[cp] = {
            "saved_bytes_max_rank": max(max(r["saved_bytes"]) for r in ranks),
            "peak_above_rest_max_rank": max(max(r["peak_above_rest"]) for r in ranks),
            "step_s_median": C.median([max(r["step_s"][i] for r in ranks) for i in range(args.steps)]),
            "kv_bytes_per_rank": max(max(r["kv_bytes"]) for r in ranks),
            "kv_bytes_expected": expected_kv,
            "losses": ranks[0]["losses"],
        }
    base = summary[1]
    for cp in CPS:
        s = summary[cp]
        s["saved_ratio"] = s["saved_bytes_max_rank"] / base["saved_bytes_max_rank"]
        s["rss_ratio"] = s["peak_above_rest_max_rank"] / base["peak_above_rest_max_rank"]
        s["step_time_ratio"] = s["step_s_median"] / base["step_s_median"]
    losses_agree = all(abs(a - b) <= 1e-4 * abs(b) for cp in CPS for a, b in zip(summary[cp]["losses"], base["losses"]))
    targets = {2: 0.55, 4: 0.3}
    rows = [
        [
            f"cp={cp}",
            C.mib(summary[cp]["saved_bytes_max_rank"]),
            f"{summary[cp]['saved_ratio']:.2f}x" + (f" (target ≤ {targets[cp]}x)" if cp in targets else ""),
            C.mib(summary[cp]["peak_above_rest_max_rank"]),
            f"{summary[cp]['rss_ratio']:.2f}x",
            summary[cp]["step_s_median"],
            f"{summary[cp]['step_time_ratio']:.2f}x",
            C.mib(summary[cp]["kv_bytes_per_rank"]),
            C.mib(summary[cp]["kv_bytes_expected"]),
        ]
        for cp in CPS
    ]
    headers = [
        "cp",
        "saved for backward, MiB (worst rank)",
        "/ cp=1",
        "peak RSS above rest, MiB",
        "/ cp=1",
        "train_step s (median, slowest rank)",
        "/ cp=1",
        "K/V bytes received per rank, MiB",
        "expected",
    ]
    body = (
        f"Shape: {C.shape_str(cfg)}; 1 x {args.seq} tokens of packed documents per step; fp32; sdpa; AdamW; "
        f"each cp a torchrun job of cp processes, 1 thread each; {args.steps} measured steps after a warm-up "
        "step.\n\n"
        + C.md_table(headers, rows)
        + f"\n\n**Activation memory per rank (bytes autograd saves for backward): cp=2 "
        f"{summary[2]['saved_ratio']:.2f}x, cp=4 {summary[4]['saved_ratio']:.2f}x of cp=1 (targets ≤ 0.55x, ≤ 0.3x); "
        f"peak RSS of train_step above rest {summary[2]['rss_ratio']:.2f}x and {summary[4]['rss_ratio']:.2f}x; "
        f"train_step time cp=2 {summary[2]['step_time_ratio']:.2f}x of cp=1.** The RSS peak also holds what does "
        "not shrink with cp: the parameters' gradients and the fused output head's [vocab, hidden] weight "
        f"gradient. Losses agree across cp: {losses_agree}."
    )
    data = {"env": env, "args": vars(args), "shape": shape, "summary": summary, "runs": runs}
    path = C.write_results(
        "cp", "Context parallelism: activation memory, step time, K/V bytes", body, data, quick=args.quick
    )
    print(body)
    print(f"wrote {path}")
    return 0 if losses_agree else 1


if __name__ == "__main__":
    sys.exit(main())
