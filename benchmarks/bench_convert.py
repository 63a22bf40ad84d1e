"""Conversion time and memory on a SmolLM2-135M-shaped model: `hf3d convert to-hf` and `from-hf` next
to raw safetensors I/O of the same bytes, and the extra memory of the streaming writer inside
`ParallelModel.save_pretrained`.

The model is built here (random init, `from_config` + `save_pretrained`, stock shape: hidden 576,
30 layers, 9/3 heads, inter 1536, vocab 49152, tied) in bf16 and in fp32. Sides, each in a fresh
process, in alternating order over the rounds:

- raw: `safetensors.torch.load_file` of the model file + `save_file` of the same tensors (the whole
  model in memory: the floor for time, the model size for memory);
- raw-fsync: raw, then an fsync of the file it wrote (the floor of from-hf-fsync);
- writer: the same `load_file`, then hf3d's streaming `write_hf_dir` instead of `save_file` (the
  writer alone, to tell its cost from the checkpoint reader's);
- to-hf: `hf3d.convert.checkpoint_to_hf` of a checkpoint of the same weights (made by from-hf);
- from-hf: `hf3d.convert.hf_to_checkpoint` of the HF directory, its files left to the page cache as
  raw's and to-hf's are (the marker's CRC-32s, checked at every load, catch an output cut short);
- from-hf-fsync: the same with `fsync=True` (`hf3d convert from-hf --fsync`), next to raw-fsync.

Time is the call only: every worker imports its libraries first (transformers' modeling code too,
which to-hf needs to know the model's tensor order); the first call in a process still pays lazy
set-up (config and meta-model construction, first DCP plan) that the repeated calls do not. Memory
is the peak RSS of the call above the RSS just before it: the peak is reset
(`/proc/self/clear_refs` = 5) before the call and read from VmHWM after it, so import transients
do not count. The export part runs `parallelize` + `save_pretrained` under torchrun at tp=3
(`--export-tp 1,3` adds tp=1) and reports rank 0's extra memory during `save_pretrained` next to
the largest tensor. Files are in the page cache for every timed run, and `os.sync()` runs before each
call (not timed): raw and the writer leave their output unsynced, and its writeback, landing in the next
call's fsync, made that call (from-hf's first, in the next process) 2-15x slower.

    python benchmarks/bench_convert.py            # bf16 + fp32, 2 rounds x 3 calls, export at tp=3 (~5 min)
    python benchmarks/bench_convert.py --small    # smoke: 4 layers, 1 round; results go to results/quick/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
SMOLLM2_135M = C.SMOLLM2_135M
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
SIDES = ("raw", "raw-fsync", "writer", "to-hf", "from-hf", "from-hf-fsync")


# -- workers (each in a fresh process) -------------------------------------------------------------
def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _measured(fn) -> dict:
    os.sync()  # no call waits on the writeback of another side's (or its own previous) unsynced output
    before = C.proc_status()
    _reset_peak()
    with C.PeakSampler() as sampler:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    after = C.proc_status()
    return {
        "seconds": seconds,
        "rss_before": before["VmRSS"],
        "peak": after["VmHWM"],
        "extra_peak": after["VmHWM"] - before["VmRSS"],
        "extra_anon_sampled": sampler.peak.get("RssAnon", 0) - before["RssAnon"],
        "extra_file_sampled": sampler.peak.get("RssFile", 0) - before["RssFile"],
    }


def worker(args) -> None:
    import torch  # noqa: F401
    from safetensors.torch import load_file, save_file

    C.import_hf3d()  # every side: no measured call imports a module

    if args.worker in ("raw", "raw-fsync"):

        def op():
            tensors = load_file(Path(args.src) / "model.safetensors")
            Path(args.out).mkdir(parents=True, exist_ok=True)
            save_file(tensors, Path(args.out) / "model.safetensors", metadata={"format": "pt"})
            if args.worker == "raw-fsync":
                fd = os.open(Path(args.out) / "model.safetensors", os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    elif args.worker == "writer":
        from transformers import AutoConfig

        from hf3d.hf import TensorSpec, write_hf_dir

        config = AutoConfig.from_pretrained(args.src)

        def op():
            tensors = load_file(Path(args.src) / "model.safetensors")
            specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
            write_hf_dir(args.out, specs, tensors.__getitem__, config)

    elif args.worker in ("to-hf", "from-hf", "from-hf-fsync"):
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401

        from hf3d.convert import checkpoint_to_hf, hf_to_checkpoint

        if args.worker == "to-hf":
            op = lambda: checkpoint_to_hf(args.ckpt, args.out)  # noqa: E731
        else:
            fsync = args.worker == "from-hf-fsync"
            op = lambda: hf_to_checkpoint(args.src, args.out, fsync=fsync)  # noqa: E731
    else:  # export, under torchrun
        hf3d = C.import_hf3d()

        pm = hf3d.parallelize(args.src, hf3d.ParallelConfig(tp=args.tp))
        op = lambda: pm.save_pretrained(args.out)  # noqa: E731
    reps = []
    for _ in range(args.repeats):
        _rm(Path(args.out))  # every call writes a new output, as the first one does (not timed)
        reps.append(_measured(op))
    rec = {"kind": args.worker, "reps": reps, "seconds": [r["seconds"] for r in reps]}
    rec["extra_peak"] = max(r["extra_peak"] for r in reps)  # the first, in a fresh process, is the largest
    if args.worker == "export":
        import torch.distributed as dist

        Path(f"{args.result}.rank{dist.get_rank()}.json").write_text(json.dumps(rec))
        C.leave_distributed()
    Path(f"{args.result}.rank0.json").write_text(json.dumps(rec))


# -- orchestration ---------------------------------------------------------------------------------
def run_worker(
    kind: str, tmp: Path, tag: str, *, src: Path, ckpt: Path | None = None, tp: int = 1, repeats: int = 1
) -> list[dict]:
    out, result = tmp / f"out-{kind}-{tag}", tmp / f"res-{kind}-{tag}"
    args = ["--worker", kind, "--src", str(src), "--out", str(out), "--result", str(result), "--tp", str(tp)]
    args += ["--repeats", str(repeats)]
    if ckpt is not None:
        args += ["--ckpt", str(ckpt)]
    env = {"OMP_NUM_THREADS": "1"}
    proc = C.torchrun(SCRIPT, tp, args, env=env) if kind == "export" else C.python_subprocess(SCRIPT, args, env=env)
    recs = [
        json.loads(Path(f"{result}.rank{r}.json").read_text())
        for r in range(tp)
        if Path(f"{result}.rank{r}.json").exists()
    ]
    if proc.returncode != 0 or len(recs) != tp:
        raise RuntimeError(f"{kind} worker failed (rc {proc.returncode}):\n{C.tail(proc.stderr, 40)}")
    _rm(out)
    return recs


def _rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _tensor_sizes(model_dir: Path) -> tuple[int, int]:
    """(model bytes, largest tensor bytes) of an HF dir's single safetensors file."""
    from hf3d.hf import SafetensorsSource

    source = SafetensorsSource(model_dir)
    specs = [source.spec(n) for n in source.entries]
    return sum(s.nbytes for s in specs), max(s.nbytes for s in specs)


def bench_dtype(dt: str, cfg, tmp: Path, rounds: int, repeats: int) -> dict:
    import torch

    from hf3d.convert import checkpoint_to_hf, hf_to_checkpoint

    src = tmp / f"src-{dt}"
    n_params = C.save_model_dir(cfg, src, dtype=getattr(torch, DTYPES[dt]))
    ckpt = hf_to_checkpoint(src, tmp / f"ckpt-{dt}")
    check = checkpoint_to_hf(ckpt, tmp / f"check-{dt}")
    identical = (check / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    _rm(check)
    model_bytes, largest = _tensor_sizes(src)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(rounds):
        order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]  # rotating: no side always first
        for side in order:
            runs[side].append(run_worker(side, tmp, f"{dt}-{r}", src=src, ckpt=ckpt, repeats=repeats)[0])
            print(f"  {dt} round {r} {side}: {' '.join(f'{t:.2f}' for t in runs[side][-1]['seconds'])} s", flush=True)
    return {
        "n_params": n_params,
        "model_bytes": model_bytes,
        "largest_tensor_bytes": largest,
        "to_hf_bit_identical_to_source": identical,
        "runs": runs,
    }


def summarise(dt: str, res: dict) -> tuple[str, dict]:
    med = {
        s: {
            "seconds": C.median([t for r in res["runs"][s] for t in r["seconds"]]),
            "extra_peak": max(r["extra_peak"] for r in res["runs"][s]),
        }
        for s in SIDES
    }
    raw_t, raw_m, largest = med["raw"]["seconds"], med["raw"]["extra_peak"], res["largest_tensor_bytes"]
    rows, verdicts = [], {}
    for s in SIDES:
        t, m = med[s]["seconds"], med[s]["extra_peak"]
        rows.append(
            [s, t, f"{t / raw_t:.2f}x", C.mib(m), f"{(m - raw_m) / largest:+.2f}", f"{m / res['model_bytes']:.2f}"]
        )
    t_ratio = med["to-hf"]["seconds"] / raw_t
    from_ratio = med["from-hf"]["seconds"] / raw_t
    above = (med["to-hf"]["extra_peak"] - raw_m) / largest
    verdicts = {
        "to_hf_time_vs_raw": t_ratio,
        "to_hf_time_target_met": t_ratio <= 2.0,
        "to_hf_extra_mem_above_raw_in_largest_tensors": above,
        "to_hf_mem_target_met": above <= 1.0,
        "writer_time_vs_raw": med["writer"]["seconds"] / raw_t,
        "from_hf_time_vs_raw": from_ratio,
        "from_hf_time_target_met": from_ratio <= 2.0,
        "from_hf_fsync_time_vs_raw_fsync": med["from-hf-fsync"]["seconds"] / med["raw-fsync"]["seconds"],
        "from_hf_extra_mem_above_raw_in_largest_tensors": (med["from-hf"]["extra_peak"] - raw_m) / largest,
        "medians": med,
    }
    table = C.md_table(
        [
            "side",
            "time (s, median)",
            "time / raw",
            "extra peak RSS (MiB, max)",
            "above raw, in largest tensors",
            "/ model",
        ],
        rows,
    )
    text = (
        f"### {dt} ({DTYPES[dt]}): model {C.mib(res['model_bytes']):.1f} MiB, largest tensor "
        f"{C.mib(largest):.1f} MiB (embed_tokens)\n\n{table}\n\n"
        f"- to-hf / raw time = **{t_ratio:.2f}x** ({'meets' if t_ratio <= 2 else 'MISSES'} the ≤ 2x target); "
        f"the streaming writer alone {med['writer']['seconds'] / raw_t:.2f}x, so the rest is reading the checkpoint\n"
        f"- from-hf / raw time = **{from_ratio:.2f}x** ({'meets' if from_ratio <= 2 else 'MISSES'} the ≤ 2x target); "
        f"with `--fsync`, against raw with an fsync of its file: {verdicts['from_hf_fsync_time_vs_raw_fsync']:.2f}x\n"
        f"- to-hf peak memory above raw = **{above:+.2f}** largest tensors "
        f"({'meets' if above <= 1 else 'MISSES'} the ≤ +1 tensor target); to-hf's own extra peak is "
        f"{med['to-hf']['extra_peak'] / largest:.2f} largest tensors, from-hf's "
        f"{med['from-hf']['extra_peak'] / largest:.2f}, raw's {raw_m / largest:.2f} (the whole model)\n"
        f"- to-hf output bit-identical to the source file: {res['to_hf_bit_identical_to_source']}"
    )
    return text, verdicts


def bench_export(cfg, tmp: Path, tps: list[int]) -> tuple[str, dict]:
    import torch

    src = tmp / "src-export-fp32"
    C.save_model_dir(cfg, src, dtype=torch.float32)
    _, largest = _tensor_sizes(src)
    out, rows = {}, []
    for tp in tps:
        recs = run_worker("export", tmp, f"tp{tp}", src=src, tp=tp)
        out[f"tp{tp}"] = recs
        r0 = recs[0]
        rows.append(
            [f"tp={tp}", r0["seconds"][0], C.mib(r0["extra_peak"]), C.mib(largest), f"{r0['extra_peak'] / largest:.2f}"]
        )
    table = C.md_table(
        ["mesh", "save_pretrained (s)", "rank 0 extra peak RSS (MiB)", "largest tensor (MiB)", "ratio"], rows
    )
    text = (
        "### Streaming `ParallelModel.save_pretrained` (fp32, rank 0)\n\n"
        f"{table}\n\nRank 0 holds one full tensor at a time (plus, at tp>1, the piece being received)."
    )
    return text, {"largest_tensor_bytes": largest, "runs": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="4 layers, 1 round, tp=1 export; results go to results/quick/")
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per side, in rotating order")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--export-tp", default="3", help="tp degrees of the save_pretrained part, e.g. 1,3 ('' skips it)")
    ap.add_argument("--worker", choices=[*SIDES, "export"], help=argparse.SUPPRESS)
    for hidden in ("--src", "--ckpt", "--out", "--result"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    layers = 4 if args.small else SMOLLM2_135M["num_hidden_layers"]
    rounds, repeats = (1, 1) if args.small else (args.rounds, args.repeats)
    tps = [1] if args.small else [int(t) for t in args.export_tp.split(",") if t]
    cfg = C.llama_config(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    env = C.env_info()
    env["worker_OMP_NUM_THREADS"] = 1
    shapes = C.shape_str(cfg) + " (SmolLM2-135M shape, random weights)"
    data = {"env": env, "shapes": shapes, "rounds": rounds, "repeats": repeats}
    body = [
        f"Shapes: {shapes}. Each side runs in {rounds} fresh process(es), in rotating order, {repeats} timed "
        "call(s) each; time = median over all calls. Extra peak RSS = VmHWM during the call (peak reset just "
        "before it) minus RSS before it, the largest over the calls."
    ]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf3d-bench-convert-") as d:
        tmp = Path(d)
        for dt in args.dtypes.split(","):
            print(f"{dt}:", flush=True)
            res = bench_dtype(dt, cfg, tmp, rounds, repeats)
            text, verdict = summarise(dt, res)
            data[dt] = {**res, "summary": verdict}
            body.append(text)
            _rm(tmp / f"src-{dt}")
            _rm(tmp / f"ckpt-{dt}")
        if tps:
            print("export:", flush=True)
            text, res = bench_export(cfg, tmp, tps)
            data["export"] = res
            body.append(text)
    data["wall_s"] = time.perf_counter() - t0
    body_md = "\n\n".join(body)
    print("\n" + body_md)
    path = C.write_results(
        "convert", "Conversion: hf3d convert vs raw safetensors I/O", body_md, data, quick=args.small
    )
    print(f"\nwrote {path} ({data['wall_s']:.0f} s)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
