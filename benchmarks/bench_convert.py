"""Conversion speed and memory: `hf3d convert to-hf` and `from-hf` on a SmolLM2-135M-shaped model against
raw safetensors I/O of the same bytes, in bf16 and fp32.

Sides, each in a fresh process that has imported its libraries first, in rotating order over the rounds:
- raw: `safetensors.torch.load_file` of the model file + `save_file` of the same tensors (the whole model in
  memory: the floor for time); raw-fsync: the same, then an fsync of the file it wrote;
- to-hf: `hf3d convert to-hf` of a checkpoint of the same weights (made by from-hf);
- from-hf: `hf3d convert from-hf` of the HF directory; from-hf-fsync: with `--fsync`, next to raw-fsync.
Time is the call (median over every call); memory is the peak RSS of the call above the RSS before it (VmHWM
reset just before), counted in largest tensors. `os.sync()` runs before each call, untimed. Targets: to-hf and
from-hf ≤ 2x raw time; to-hf's extra peak ≤ raw's + 1 largest tensor; to-hf's output bit-identical to the source.

    python benchmarks/bench_convert.py            # bf16 + fp32, 2 rounds x 3 calls (~4 min on 2 cores)
    python benchmarks/bench_convert.py --quick    # 4 layers, 1 round, 1 call; results/quick/
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
SIDES = ("raw", "raw-fsync", "to-hf", "from-hf", "from-hf-fsync")


def hf3d_convert(*argv: str) -> None:
    """`hf3d convert ARGV...`, the command, in this process."""
    import hf3d.cli

    if hf3d.cli.main(["convert", *argv]):
        raise RuntimeError(f"hf3d convert {' '.join(argv)} failed")


def worker(args) -> None:
    from safetensors.torch import load_file, save_file
    from transformers.models.llama import modeling_llama  # noqa: F401  (to-hf reads the model's tensor order)

    import hf3d.cli  # noqa: F401  (imported before the measured calls)

    C.import_hf3d()
    src, out = Path(args.src), Path(args.dest)
    if args.worker.startswith("raw"):

        def op():
            out.mkdir(parents=True, exist_ok=True)
            save_file(load_file(src / "model.safetensors"), out / "model.safetensors", metadata={"format": "pt"})
            if args.worker == "raw-fsync":
                fd = os.open(out / "model.safetensors", os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    else:
        fsync = ["--fsync"] if args.worker == "from-hf-fsync" else []
        argv = ["to-hf", args.ckpt, str(out)] if args.worker == "to-hf" else ["from-hf", str(src), str(out), *fsync]
        op = lambda: hf3d_convert(*argv)  # noqa: E731
    calls = []
    for _ in range(args.repeats):
        shutil.rmtree(out, ignore_errors=True)  # every call writes a new output, as the first one does
        os.sync()  # no call waits on the writeback of another side's unsynced output
        before = C.proc_status()["VmRSS"]
        C.reset_peak()
        t0 = time.perf_counter()
        op()
        calls.append({"seconds": time.perf_counter() - t0, "extra_peak": C.proc_status()["VmHWM"] - before})
    C.write_rank(args.out, {"calls": calls})


def bench_dtype(dt: str, cfg, tmp: Path, rounds: int, repeats: int) -> dict:
    import torch
    from safetensors import safe_open

    src, ckpt, check = tmp / f"src-{dt}", tmp / f"ckpt-{dt}", tmp / f"check-{dt}"
    n_params = C.save_model_dir(cfg, src, dtype=getattr(torch, DTYPES[dt]))
    hf3d_convert("from-hf", str(src), str(ckpt))
    hf3d_convert("to-hf", str(ckpt), str(check))
    identical = (check / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    with safe_open(src / "model.safetensors", "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    item = torch.empty((), dtype=getattr(torch, DTYPES[dt])).element_size()
    largest = max(item * torch.Size(s).numel() for s in sizes)
    calls: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(rounds):
        for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:  # rotating: no side always first
            argv = ["--worker", side, "--src", str(src), "--ckpt", str(ckpt), "--dest", str(tmp / f"out-{side}")]
            rec = C.run_workers(SCRIPT, 1, [*argv, "--repeats", str(repeats)], tmp / f"res-{dt}-{side}-{r}")[0]
            calls[side] += rec["calls"]
            times = " ".join(f"{c['seconds']:.2f}" for c in rec["calls"])
            print(f"  {dt} round {r} {side}: {times} s", flush=True)
    med = {
        s: {"seconds": C.median([c["seconds"] for c in calls[s]]), "extra_peak": max(c["extra_peak"] for c in calls[s])}
        for s in SIDES
    }
    raw = med["raw"]
    summary = {
        "to_hf_time_vs_raw": med["to-hf"]["seconds"] / raw["seconds"],
        "from_hf_time_vs_raw": med["from-hf"]["seconds"] / raw["seconds"],
        "from_hf_fsync_time_vs_raw_fsync": med["from-hf-fsync"]["seconds"] / med["raw-fsync"]["seconds"],
        "to_hf_extra_mem_above_raw_in_largest_tensors": (med["to-hf"]["extra_peak"] - raw["extra_peak"]) / largest,
        "medians": med,
    }
    summary["to_hf_time_target_met"] = summary["to_hf_time_vs_raw"] <= 2.0
    summary["from_hf_time_target_met"] = summary["from_hf_time_vs_raw"] <= 2.0
    return dict(
        n_params=n_params,
        largest_tensor_bytes=largest,
        to_hf_bit_identical_to_source=identical,
        calls=calls,
        summary=summary,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", "--small", action="store_true", help="4 layers, 1 round, 1 call; results/quick/")
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per side, in rotating order")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    ap.add_argument("--dtypes", default="bf16,fp32")
    for hidden in ("--worker", "--src", "--ckpt", "--dest", "--out"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    layers, rounds, repeats = (4, 1, 1) if args.quick else (30, args.rounds, args.repeats)
    cfg = C.llama_config(**{**C.SMOLLM2_135M, "num_hidden_layers": layers})
    data, body = {"env": C.env_info(), "rounds": rounds, "repeats": repeats}, []
    with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
        for dt in args.dtypes.split(","):
            d = data[dt] = bench_dtype(dt, cfg, Path(tmp), rounds, repeats)
            s, med, largest = d["summary"], d["summary"]["medians"], d["largest_tensor_bytes"]
            above = s["to_hf_extra_mem_above_raw_in_largest_tensors"]
            rows = [
                [
                    side,
                    med[side]["seconds"],
                    f"{med[side]['seconds'] / med['raw']['seconds']:.2f}x",
                    C.mib(med[side]["extra_peak"]),
                    f"{med[side]['extra_peak'] / largest:.2f}",
                ]
                for side in SIDES
            ]
            body.append(
                f"### {dt}: largest tensor {C.mib(largest):.1f} MiB\n\n"
                + C.md_table(
                    ["side", "time s (median)", "/ raw", "extra peak RSS MiB (max)", "in largest tensors"], rows
                )
                + f"\n\n- to-hf **{s['to_hf_time_vs_raw']:.2f}x** raw ({C.verdict(s['to_hf_time_vs_raw'], 2.0)}); "
                f"from-hf **{s['from_hf_time_vs_raw']:.2f}x** ({C.verdict(s['from_hf_time_vs_raw'], 2.0)}); "
                f"from-hf --fsync {s['from_hf_fsync_time_vs_raw_fsync']:.2f}x raw + fsync\n"
                f"- to-hf extra peak above raw's: {above:+.2f} largest tensors "
                f"(target ≤ +1: {'met' if above <= 1 else 'missed'})"
                f"; to-hf output bit-identical to the source: **{d['to_hf_bit_identical_to_source']}**"
            )
    body_md = (
        f"Model: {C.shape_str(cfg)} (SmolLM2-135M shape, random weights). Each side in {rounds} fresh process(es), "
        f"rotating order, {repeats} timed call(s) each.\n\n" + "\n\n".join(body)
    )
    print("\n" + body_md)
    title = "Conversion: hf3d convert vs raw safetensors I/O"
    print(f"\nwrote {C.write_results('convert', title, body_md, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
