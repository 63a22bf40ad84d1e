"""Load memory: ONE hf3d rank at tp=3 loading a SmolLM2-135M-shaped checkpoint against a stock
`AutoModelForCausalLM.from_pretrained` of the whole model, each in a fresh process.

The checkpoint is made here (random init, bf16 safetensors as on the Hub) and loaded at bf16 and at fp32. Each
worker first loads and uses a 2-layer model of the same kind the same way (`--warm`), so that the code the load
runs is mapped and its caches are built before the worker reads its own memory; what the load holds is measured
above that. Without it, about 8 MiB of libtorch_cpu.so's code pages, faulted in by the first load, counted as the
load's (/proc/self/smaps of a tp=3 rank). Peak RSS is VmHWM from /proc/self/status, set back to the current RSS
before the load; it counts file-backed pages of the mmapped safetensors too, so private memory (RssAnon) is given
as well. Stock keeps a weight whose dtype matches the file as a zero-copy mmap
view until it is used, so each worker then reads and writes every weight once ("first use", as a forward and an
optimizer step would) and memory is read again. Targets: hf3d / stock above the memory before the load, load +
first use, ≤ 0.6x; and the load-only peak of a rank ≤ 1.05x its own parameter bytes.

    python benchmarks/bench_load_memory.py            # bf16 and fp32 loads, 3 repeats (~3-4 min on 2 cores)
    python benchmarks/bench_load_memory.py --quick    # bf16, 1 repeat; results/quick/
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TARGET, OWN_BYTES_TARGET = 0.6, 1.05
# the warm-up model: SmolLM2's kind at 2 layers, heads and vocab divisible by tp=3
WARM = dict(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=3, tie_word_embeddings=True)  # fmt: skip


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    hf3d = C.import_hf3d()
    if args.worker == "hf3d":
        dist.init_process_group("gloo")  # before the warm-up: the process group is no part of the load
    dtype = getattr(torch, DTYPES[args.dtype])

    def load(ckpt):
        if args.worker == "stock":
            return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
        return hf3d.parallelize(ckpt, hf3d.ParallelConfig(tp=args.tp), dtype=dtype)

    def first_use(params):  # read every weight, then write it
        with torch.no_grad():
            for p in params:
                p.sum()
                p.mul_(1.0)

    first_use(load(args.warm).parameters())  # the code and its caches, on a 2-layer model (module docstring)
    gc.collect()
    C.reset_peak()
    rec = {"baseline": C.proc_status()}
    t0 = time.perf_counter()
    model = load(args.ckpt)
    rec["load_s"] = time.perf_counter() - t0
    rec["loaded"] = C.proc_status()
    params = list(model.parameters())
    rec["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    first_use(params)
    rec["used"] = C.proc_status()
    C.write_rank(args.out, rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="bf16 only, one repeat; results go to results/quick/")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="bf16,fp32", help="dtype(s) to load the bf16 checkpoint at")
    ap.add_argument("--tp", type=int, default=3)
    for hidden in ("--worker", "--ckpt", "--warm", "--dtype", "--out"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    repeats, dtypes = (1, ["bf16"]) if args.quick else (args.repeats, args.dtypes.split(","))

    import torch

    env = C.env_info()
    cfg = C.llama_config(**C.SMOLLM2_135M)
    runs = {f"{k}-{dt}": [] for dt in dtypes for k in ("stock", "hf3d")}
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        ckpt, warm = Path(tmp) / "smollm2-135m-bf16", Path(tmp) / "warm-bf16"
        n_params = C.save_model_dir(cfg, ckpt, dtype=torch.bfloat16)
        C.save_model_dir(C.llama_config(**WARM), warm, dtype=torch.bfloat16)
        for rep in range(repeats):
            for key in runs:  # every side once per repeat, in turn
                kind, _, dt = key.partition("-")
                argv = ["--worker", kind, "--ckpt", str(ckpt), "--warm", str(warm), "--dtype", dt, "--tp", str(args.tp)]
                recs = C.run_workers(SCRIPT, args.tp if kind == "hf3d" else 1, argv, Path(tmp) / f"{key}-{rep}")
                runs[key].append(recs)
                print(f"rep {rep} {key}: peak {C.mib(max(r['loaded']['VmHWM'] for r in recs)):.0f} MiB", flush=True)

    def med(key, fn):  # the median over repeats of the worst rank
        return C.median([max(fn(r) for r in recs) for recs in runs[key]])

    metrics = {  # name: a record's figure above its own memory before the load
        "peak RSS during load (VmHWM)": lambda r: r["loaded"]["VmHWM"] - r["baseline"]["VmRSS"],
        "peak RSS, load + first use (VmHWM)": lambda r: r["used"]["VmHWM"] - r["baseline"]["VmRSS"],
        "private RSS after first use (RssAnon)": lambda r: r["used"]["RssAnon"] - r["baseline"]["RssAnon"],
    }
    base = med(f"stock-{dtypes[0]}", lambda r: r["baseline"]["VmRSS"])
    summary, rows = {}, []
    for dt in dtypes:
        s = summary[dt] = {}
        for name, fn in metrics.items():
            stock, hf3d = med(f"stock-{dt}", fn), med(f"hf3d-{dt}", fn)
            s[name] = {"stock_above": stock, "hf3d_worst_above": hf3d, "ratio": hf3d / stock}
            rows.append([dt, name, C.mib(stock), C.mib(hf3d), f"{hf3d / stock:.3f}x"])
        own = max(r["param_bytes"] for r in runs[f"hf3d-{dt}"][0])
        s["own_param_bytes"] = own
        s["load_peak_over_own_bytes"] = s["peak RSS during load (VmHWM)"]["hf3d_worst_above"] / own
        s["load_s"] = {k: med(f"{k}-{dt}", lambda r: r["load_s"]) for k in ("stock", "hf3d")}
    lines = [
        f"- {dt}: load + first use **{s['peak RSS, load + first use (VmHWM)']['ratio']:.3f}x** stock "
        f"({C.verdict(s['peak RSS, load + first use (VmHWM)']['ratio'], TARGET)}); load-only peak of the worst rank "
        f"**{s['load_peak_over_own_bytes']:.3f}x its own parameter bytes** "
        f"({C.verdict(s['load_peak_over_own_bytes'], OWN_BYTES_TARGET)}); load time {s['load_s']['hf3d']:.2f} s "
        f"vs stock {s['load_s']['stock']:.2f} s"
        for dt, s in summary.items()
    ]
    body = (
        f"Checkpoint: {C.shape_str(cfg)} (SmolLM2-135M), {n_params:,} params, bf16 safetensors. hf3d at tp={args.tp} "
        f"({args.tp} gloo processes, the worst rank); stock `from_pretrained(dir, dtype=...)`; fresh processes, "
        f"{repeats} repeat(s), median; OMP_NUM_THREADS=1. Each above its own RSS before the load, after a warm-up "
        f"load of a 2-layer model (stock: {C.mib(base):.0f} MiB).\n\n"
        + C.md_table(["loaded as", "MiB above RSS before the load", "stock", "hf3d worst rank", "hf3d / stock"], rows)
        + "\n\n"
        + "\n".join(lines)
    )
    print("\n" + body)
    data = dict(env=env, tp=args.tp, repeats=repeats, n_params=n_params, runs=runs, summary=summary)
    title = f"Load memory: one hf3d rank (tp={args.tp}) vs stock from_pretrained"
    print(f"\nwrote {C.write_results('load_memory', title, body, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
