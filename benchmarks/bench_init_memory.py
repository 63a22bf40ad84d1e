"""From-scratch init memory: ONE hf3d rank at tp=3 initialising a SmolLM2-135M shape from a
config-only directory (`hf3d.parallelize(dir, ParallelConfig(tp=3), seed=0)`) vs stock
`torch.manual_seed(0); AutoModelForCausalLM.from_config(config, dtype=torch.float32)`, each in a
fresh process; the hf3d export is also compared with stock's state dict, tensor by tensor.

Shape: hidden 576, 30 layers, 9/3 heads, inter 1536, vocab 49152, tied, rope θ 100000 (a LlamaConfig).
Memory is the peak RSS while the call runs minus the RSS just before it: the kernel's peak
(VmHWM) is reset through /proc/self/clear_refs after every import and the process-group start-up,
so each process is its own baseline. RSS after the call and after glibc's `malloc_trim` are
reported too (freed memory that glibc keeps counts in RSS).

    python benchmarks/bench_init_memory.py            # 3 repeats (~2-3 min)
    python benchmarks/bench_init_memory.py --quick    # 1 repeat; results/quick/
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
SMOLLM2_135M = C.SMOLLM2_135M
TARGET = 0.6


def _status(key: str) -> int:
    return C.proc_status()[key]


def _measure(fn) -> tuple[object, dict]:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    rec = {"seconds": time.perf_counter() - t0, "peak_above": _status("VmHWM") - base}
    rec["rss_after"] = _status("VmRSS") - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rec["rss_after_trim"] = _status("VmRSS") - base
    return out, rec


def worker(args) -> None:
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (both sides build this class)
    from transformers import AutoConfig, AutoModelForCausalLM

    hf3d = C.import_hf3d()
    from hf3d.mesh import init_distributed

    rank = int(os.environ.get("RANK", "0"))
    if args.worker == "hf3d":
        init_distributed()
        pm, rec = _measure(lambda: hf3d.parallelize(args.dir, hf3d.ParallelConfig(tp=args.tp), seed=0))
        rec["param_bytes"] = sum(p.numel() * p.element_size() for _, p in pm.unique_parameters())
        if args.export:
            pm.save_pretrained(args.export)
    else:
        config = AutoConfig.from_pretrained(args.dir)

        def stock():
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

        model, rec = _measure(stock)
        rec["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        rec["largest_tensor_bytes"] = max(p.numel() * p.element_size() for p in model.parameters())
        if args.export:  # hf3d's export against this model, tensor by tensor
            from safetensors.torch import load_file

            got = {}
            for f in Path(args.export).glob("*.safetensors"):
                got.update(load_file(f))
            want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
            rec["export_keys_match"] = sorted(got) == sorted(want)
            rec["export_tensors_differing"] = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(rec))


def run(kind: str, cfg_dir: Path, out: Path, tp: int, export: Path | None) -> list[dict]:
    args = ["--worker", kind, "--dir", str(cfg_dir), "--out", str(out), "--tp", str(tp)]
    args += ["--export", str(export)] if export else []
    nproc = tp if kind == "hf3d" else 1
    env = {"OMP_NUM_THREADS": "1"}
    proc = C.torchrun(SCRIPT, nproc, args, env=env) if nproc > 1 else C.python_subprocess(SCRIPT, args, env=env)
    files = [Path(f"{out}.rank{r}.json") for r in range(nproc)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        raise RuntimeError(f"{kind} worker failed (rc {proc.returncode}):\n{C.tail(proc.stderr, 40)}")
    return [json.loads(f.read_text()) for f in files]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat; results go to results/quick/")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--worker", choices=["stock", "hf3d"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--export", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.repeats = 1

    env = C.env_info()
    env["worker_OMP_NUM_THREADS"] = 1
    cfg = C.llama_config(**SMOLLM2_135M)
    shapes = C.shape_str(cfg) + ", rope θ 100000 (SmolLM2-135M shape), fp32"
    print("shapes:", shapes, flush=True)
    runs: dict[str, list] = {"stock": [], "hf3d": []}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_init_") as tmpdir:
        tmp = Path(tmpdir)
        cfg.save_pretrained(tmp / "config-only")
        for rep in range(args.repeats):
            export = tmp / "export" if rep == 0 else None
            for kind in ("hf3d", "stock"):  # stock second: it checks hf3d's export of this repeat
                recs = run(kind, tmp / "config-only", tmp / f"{kind}-{rep}", args.tp, export)
                runs[kind].append(recs)
                print(
                    f"rep {rep} {kind:5s}: peak above baseline "
                    + ", ".join(f"{C.mib(r['peak_above']):.0f}" for r in recs)
                    + f" MiB ({max(r['seconds'] for r in recs):.1f} s)",
                    flush=True,
                )
    data = {"env": env, "shapes": shapes, "tp": args.tp, "repeats": args.repeats, "runs": runs}
    data["wall_s"] = time.perf_counter() - t_all
    body = summarise(runs, args.tp, data)
    print("\n" + body)
    path = C.write_results(
        "init_memory",
        f"From-scratch init memory: one hf3d rank (tp={args.tp}) vs stock from_config",
        body,
        data,
        quick=args.quick,
    )
    print(f"\nwrote {path}")


def summarise(runs: dict, tp: int, data: dict) -> str:
    def med(kind, field, worst=False):
        return C.median([max(r[field] for r in recs) if worst else recs[0][field] for recs in runs[kind]])

    stock0 = runs["stock"][0][0]
    rows, summary = [], {}
    for field, label in (
        ("peak_above", "peak RSS above baseline"),
        ("rss_after", "RSS after, above baseline"),
        ("rss_after_trim", "RSS after malloc_trim, above baseline"),
        ("param_bytes", "parameter bytes held"),
        ("seconds", "time (s)"),
    ):
        s, h, hw = med("stock", field), med("hf3d", field), med("hf3d", field, worst=True)
        conv = (lambda x: x) if field == "seconds" else C.mib
        rows.append([label, conv(s), conv(h), conv(hw), f"{h / s:.3f}x", f"{hw / s:.3f}x"])
        summary[field] = {"stock": s, "hf3d_rank0": h, "hf3d_worst": hw, "ratio_worst": hw / s}
    data["summary"] = summary
    table = C.md_table(
        ["metric (MiB, median)", "stock", "hf3d rank 0", f"hf3d worst of {tp}", "rank 0 / stock", "worst / stock"], rows
    )
    ratio = summary["peak_above"]["ratio_worst"]
    over_share = med("hf3d", "peak_above", worst=True) - med("hf3d", "param_bytes", worst=True)
    exact = stock0["export_keys_match"] and not stock0["export_tensors_differing"]
    return (
        f"Shapes: {data['shapes']}. hf3d: `parallelize(config_only_dir, ParallelConfig(tp={tp}), seed=0)` on "
        f"{tp} gloo processes (torchrun); stock: `torch.manual_seed(0); AutoModelForCausalLM.from_config(config, "
        f"dtype=torch.float32)`. Fresh processes, {data['repeats']} repeat(s), median; OMP_NUM_THREADS=1.\n\n"
        f"{table}\n\n"
        f"- worst hf3d rank / stock, peak RSS above baseline: **{ratio:.3f}x** "
        f"({'meets' if ratio <= TARGET else 'misses'} the ≤ {TARGET}x target)\n"
        f"- worst hf3d rank's peak above its own parameter bytes: {C.mib(over_share):.0f} MiB "
        f"(largest full tensor: {C.mib(stock0['largest_tensor_bytes']):.0f} MiB)\n"
        f"- hf3d export == stock from_config, every tensor (torch.equal): **{exact}**"
        + ("" if exact else f" (differing: {stock0['export_tensors_differing'][:5]})")
    )


if __name__ == "__main__":
    sys.exit(main())
