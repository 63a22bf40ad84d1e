"""From-scratch init memory: ONE hf3d rank at tp=3 initialising a SmolLM2-135M shape from a config-only
directory (`hf3d.parallelize(dir, ParallelConfig(tp=3), seed=0)`) against stock
`torch.manual_seed(0); AutoModelForCausalLM.from_config(config, dtype=torch.float32)`, each in a fresh process.

Memory is the peak RSS while the call runs minus the RSS just before it (VmHWM reset after the imports and the
process group's start, so each process is its own baseline); target: the worst hf3d rank ≤ 0.6x stock. hf3d's
export is compared with stock's state dict tensor by tensor (`torch.equal`): the sharded init is stock's init.

    python benchmarks/bench_init_memory.py            # 3 repeats (~2-3 min on 2 cores)
    python benchmarks/bench_init_memory.py --quick    # 1 repeat; results/quick/
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
TARGET = 0.6


def _measure(fn) -> tuple[object, dict]:
    C.reset_peak()
    base = C.proc_status()["VmRSS"]
    t0 = time.perf_counter()
    out = fn()
    return out, {"seconds": time.perf_counter() - t0, "peak_above": C.proc_status()["VmHWM"] - base}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (both sides build this class)
    from transformers import AutoConfig, AutoModelForCausalLM

    hf3d = C.import_hf3d()
    if args.worker == "hf3d":
        dist.init_process_group("gloo")  # before the measurement: the process group is no part of the init
        pm, rec = _measure(lambda: hf3d.parallelize(args.dir, hf3d.ParallelConfig(tp=args.tp), seed=0))
        rec["param_bytes"] = sum(p.numel() * p.element_size() for p in pm.parameters())
        if args.export:
            pm.save_pretrained(args.export)
        C.write_rank(args.out, rec)
    config = AutoConfig.from_pretrained(args.dir)

    def stock():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    model, rec = _measure(stock)
    rec["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.export:  # hf3d's export against this model, tensor by tensor
        from safetensors.torch import load_file

        got = {k: v for f in Path(args.export).glob("*.safetensors") for k, v in load_file(f).items()}
        want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        rec["export_equal"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    C.write_rank(args.out, rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat; results go to results/quick/")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=3)
    for hidden in ("--worker", "--dir", "--out", "--export"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    repeats = 1 if args.quick else args.repeats
    env = C.env_info()
    cfg = C.llama_config(**C.SMOLLM2_135M)
    runs: dict[str, list] = {"stock": [], "hf3d": []}
    with tempfile.TemporaryDirectory(prefix="bench_init_") as tmp:
        cfg.save_pretrained(Path(tmp) / "config-only")
        for rep in range(repeats):
            export = ["--export", str(Path(tmp) / "export")] if rep == 0 else []
            for kind in ("hf3d", "stock"):  # stock second: it checks hf3d's export of this repeat
                argv = ["--worker", kind, "--dir", str(Path(tmp) / "config-only"), "--tp", str(args.tp), *export]
                recs = C.run_workers(SCRIPT, args.tp if kind == "hf3d" else 1, argv, Path(tmp) / f"{kind}-{rep}")
                runs[kind].append(recs)
                print(f"rep {rep} {kind}: peak above baseline {[round(C.mib(r['peak_above'])) for r in recs]} MiB")

    def med(kind, field):  # the median over repeats of the worst rank
        return C.median([max(r[field] for r in recs) for recs in runs[kind]])

    summary = {
        f: {"stock": med("stock", f), "hf3d_worst": med("hf3d", f), "ratio_worst": med("hf3d", f) / med("stock", f)}
        for f in ("peak_above", "param_bytes", "seconds")
    }
    exact = runs["stock"][0][0]["export_equal"]
    ratio = summary["peak_above"]["ratio_worst"]
    rows = [
        [label, conv(summary[f]["stock"]), conv(summary[f]["hf3d_worst"]), f"{summary[f]['ratio_worst']:.3f}x"]
        for f, label, conv in (
            ("peak_above", "peak RSS above the process's baseline, MiB", C.mib),
            ("param_bytes", "parameter bytes held, MiB", C.mib),
            ("seconds", "time, s", float),
        )
    ]
    body = (
        f"Shape: {C.shape_str(cfg)} (SmolLM2-135M), fp32. hf3d at tp={args.tp} on {args.tp} gloo processes; "
        f"fresh processes, {repeats} repeat(s), median of the worst rank; OMP_NUM_THREADS=1.\n\n"
        + C.md_table(["", "stock from_config", f"hf3d, worst of {args.tp} ranks", "hf3d / stock"], rows)
        + f"\n\n**worst hf3d rank / stock peak RSS {ratio:.3f}x** ({C.verdict(ratio, TARGET)}); hf3d's export "
        f"equals stock's from_config tensor by tensor: **{exact}**."
    )
    print("\n" + body)
    data = dict(env=env, tp=args.tp, repeats=repeats, runs=runs, summary=summary, export_equal=exact)
    title = f"From-scratch init memory: one hf3d rank (tp={args.tp}) vs stock from_config"
    print(f"\nwrote {C.write_results('init_memory', title, body, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
