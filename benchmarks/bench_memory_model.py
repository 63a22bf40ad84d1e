"""Memory and communication model (benchmarks/memory_model.py) vs measurement, at six meshes.

Each mesh (tp, pp, dp) runs as its own torchrun job (gloo, one thread per process) on a Llama-shaped
fp32 model with the same rows per dp rank. Per rank:

* baseline = RSS after imports, process group, a device mesh (the same groups hf3d builds) and two steps
  of a tiny model of the same family on the same mesh, freed (code, kernels and thread buffers that any
  run loads on first use);
* the model is built from a config-only directory (hf3d's sharded init: no file pages) with a ZeRO-1
  AdamW; one warm-up step creates the optimizer state and the pipeline buffers;
* `malloc_trim(0)`, then "at rest" = RSS − baseline, and the peak RSS is reset (`/proc/self/clear_refs`
  5: VmHWM := VmRSS);
* more steps; "peak" = VmHWM − baseline: the peak resident memory of training, measured by the kernel.

glibc keeps freed heap memory and raises its mmap threshold as large blocks are freed, so RSS would
track the allocator's history rather than live tensors. The workers run with MALLOC_MMAP_THRESHOLD_=65536
(a fixed threshold: every block of 64 KiB or more is its own mapping, returned when freed), so RSS
follows live allocations. `opt.memory_report()` is NOT used as a measurement: it is hf3d's own count of
its tensors, true by construction; it is recorded only to show the state part of the model.

Bytes sent are counted during one step: dp/tp collectives by wrapping torch.distributed (bench_zero's
CommTally), pipeline sends by wrapping PipelineStage.get_fwd_send_ops / get_bwd_send_ops. The derived
per-layer activation bytes are checked against the storages a saved_tensors_hooks counts in layer 0.

    python benchmarks/bench_memory_model.py            # six meshes (~2-4 min on 2 cores)
    python benchmarks/bench_memory_model.py --quick    # smoke: small model at (2,1,1) and (1,2,1); results/quick/
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import memory_model as MM

SCRIPT = Path(__file__).resolve()
MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)]
MODEL = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=1024,
    vocab_size=8192,
    tie_word_embeddings=False,
)
QUICK_MODEL = dict(MODEL, hidden_size=128, num_hidden_layers=4, intermediate_size=256, vocab_size=1024)
TARGET = 0.10


# -- measurement helpers (also used by bench_scaling.py) --------------------------------------------
def trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak_rss() -> bool:
    """VmHWM := VmRSS (Linux >= 4.0); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class SendTally:
    """Bytes this rank sends through pipeline p2p ops while active."""

    def __init__(self):
        from torch.distributed.pipelining import stage as pst

        self.active, self.bytes = False, 0
        base = pst._PipelineStageBase
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            orig = getattr(base, name)

            def wrapped(stage, *args, _orig=orig, **kwargs):
                ops = _orig(stage, *args, **kwargs)
                if self.active:
                    self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                return ops

            setattr(base, name, wrapped)


def layer_saved_bytes(pmodel, tokens_shape) -> float:
    """Bytes per token autograd saves in this rank's first decoder layer (parameters and the layer
    input's and rotary cos/sin storages excluded; the input counted as h elements like the model)."""
    import torch

    stage = pmodel.stages[0]
    layer = stage.layers[0]
    b, s = tokens_shape
    h = pmodel.config.hidden_size
    x = torch.randn(b, s, h, requires_grad=True)
    pos = torch.arange(s).expand(b, s)
    cos, sin = stage.rotary_emb(x, pos)
    skip = {p.untyped_storage().data_ptr() for p in pmodel.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (x, cos, sin)}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    del y
    return sum(seen.values()) / (b * s) + h * x.element_size()


# -- worker (under torchrun) --------------------------------------------------------------------------
def warm_up(tiny_dir: str, pcfg) -> None:
    """Two steps of a tiny model of the same family on the same mesh, then freed: the modules, kernels
    and thread buffers every run loads on first use are then part of the baseline, not of the model."""
    import torch

    hf3d = C.import_hf3d()

    pmodel = hf3d.parallelize(tiny_dir, pcfg, seed=0)
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, 64, (pcfg.num_microbatches, 16))
    for _ in range(2):
        pmodel.train_step(ids, ids)
        opt.step()
        opt.zero_grad()
    del pmodel, opt


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    from bench_zero import CommTally

    hf3d = C.import_hf3d()
    from hf3d.mesh import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp, pp, dp = spec["mesh"]
    m, rows, seq = spec["microbatches"], spec["rows"], spec["seq"]

    def pcfg():
        return hf3d.ParallelConfig(tp=tp, pp=pp, dp=dp, pp_schedule=spec["schedule"], num_microbatches=m)

    build_mesh(pcfg())  # the groups' buffers belong to the baseline
    warm_up(spec["tiny"], pcfg())  # lazily loaded code and one-off buffers belong to it too
    tally, sends = CommTally(), SendTally()
    trim()
    rec = {"baseline": C.proc_status()}
    pmodel = hf3d.parallelize(spec["ckpt"], pcfg(), seed=0)
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0)
    tally.name_groups(pmodel)
    g = torch.Generator().manual_seed(pmodel.dp_rank)
    ids = torch.randint(0, spec["vocab"], (m * rows, seq), generator=g)

    def step():
        loss = pmodel.train_step(ids, ids)
        opt.step()
        opt.zero_grad()
        return float(loss)

    losses = [step()]
    trim()
    rec["rest"] = C.proc_status()
    rec["hwm_reset"] = reset_peak_rss()
    for i in range(spec["steps"]):
        if i == 0:
            tally.records, tally.active, sends.active = [], True, True
        losses.append(step())
        tally.active = sends.active = False
    rec["end"] = C.proc_status()
    rec.update(
        coords={"tp": pmodel.tp_rank, "pp": pmodel.pp_rank, "dp": pmodel.dp_rank},
        losses=losses,
        memory_report=opt.memory_report(),
        comm=tally.summary(),
        pp_sent=sends.bytes,
        layer_saved_bytes_per_token=layer_saved_bytes(pmodel, (rows, seq)),
        dp_collective=opt.dp_collective,
    )
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, rec)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"ranks": out}, default=str))
    dist.barrier()
    C.leave_distributed()


# -- parent -------------------------------------------------------------------------------------------
def measure(mesh, spec, tmp: Path, timeout: float) -> tuple[dict | None, str]:
    tp, pp, dp = mesh
    spec = dict(spec, mesh=mesh, out=str(tmp / f"mm-{tp}{pp}{dp}.json"))
    t0 = time.perf_counter()
    try:
        proc = C.torchrun(SCRIPT, tp * pp * dp, ["--worker", json.dumps(spec)], timeout=timeout, env=C.MALLOC_ENV)
    except Exception as e:  # a hang
        return None, f"{type(e).__name__}: {e}"
    print(f"  mesh {mesh}: {time.perf_counter() - t0:.1f}s, rc {proc.returncode}", flush=True)
    if proc.returncode != 0 or not Path(spec["out"]).exists():
        return None, C.tail(proc.stderr, 30)
    return json.loads(Path(spec["out"]).read_text()), ""


def compare(mesh, res: dict, shape: MM.Shape, spec: dict) -> dict:
    tp, pp, dp = mesh
    run = MM.Run(
        tp=tp,
        pp=pp,
        dp=dp,
        microbatches=spec["microbatches"],
        rows=spec["rows"],
        seq=spec["seq"],
        schedule=spec["schedule"],
        dp_collective=res["ranks"][0]["dp_collective"],
    )
    pred = MM.predict(shape, run)
    per_rank = []
    for r in res["ranks"]:
        b, rest, end = r["baseline"], r["rest"], r["end"]
        mem = pred["ranks"][r["coords"]["pp"]]["memory"]
        comm = pred["ranks"][r["coords"]["pp"]]["comm"]
        c = r["comm"]
        sent = {
            "tp": c.get("tp_tensors", {}).get("sent_bytes", 0.0),
            "dp": c.get("dp_grad_reduce", {}).get("sent_bytes", 0.0)
            + c.get("dp_param_gather", {}).get("sent_bytes", 0),
            "pp": float(r["pp_sent"]),
        }
        at_rest = mem["params"] + mem["main_grads"] + mem["master_weights"] + mem["optimizer_state"] + mem["pp_buffers"]
        per_rank.append(
            {
                "coords": r["coords"],
                "peak_measured": end["VmHWM"] - b["VmRSS"],
                "peak_predicted": mem["total"],
                "rest_measured": rest["VmRSS"] - b["VmRSS"],
                "rest_predicted": at_rest,
                "predicted": mem,
                "memory_report": r["memory_report"],
                "sent_measured": sent,
                "sent_predicted": comm,
                "layer_saved_measured": r["layer_saved_bytes_per_token"],
                "layer_saved_derived": MM.layer_activation_bytes(shape, tp),
                "losses": r["losses"],
                "hwm_reset": r["hwm_reset"],
            }
        )
    worst = max(per_rank, key=lambda x: x["peak_measured"])
    err = worst["peak_predicted"] / worst["peak_measured"] - 1
    any_rank = max((x["peak_predicted"] / x["peak_measured"] - 1 for x in per_rank), key=abs)
    return {"mesh": list(mesh), "worst": worst, "error": err, "largest_rank_error": any_rank, "ranks": per_rank}


def report(rows: list[dict], failures: dict) -> str:
    mem_rows, comm_rows = [], []
    for r in rows:
        w, mesh = r["worst"], "({},{},{})".format(*r["mesh"])
        p = w["predicted"]
        ok = abs(r["error"]) <= TARGET
        mem_rows.append(
            [
                mesh,
                "pp {pp}, tp {tp}, dp {dp}".format(**w["coords"]),
                f"{C.mib(p['params'] + p['main_grads'] + p['master_weights'] + p['optimizer_state']):.1f}",
                f"{C.mib(p['activations']):.1f}",
                f"{C.mib(p['loss_head']):.1f}",
                f"{C.mib(p['pp_buffers']):.1f}",
                f"{C.mib(w['peak_predicted']):.1f}",
                f"{C.mib(w['peak_measured']):.1f}",
                f"{r['error']:+.1%}" + ("" if ok else " **MISS**"),
                f"{r['largest_rank_error']:+.1%}",
                f"{C.mib(w['rest_predicted']):.1f} / {C.mib(w['rest_measured']):.1f}",
                f"{w['layer_saved_derived']:,.0f} / {w['layer_saved_measured']:,.0f}",
            ]
        )
        for x in r["ranks"]:
            if x["coords"]["tp"] or x["coords"]["dp"]:
                continue  # one rank per pipeline stage: the others send the same
            cells = [
                f"{C.mib(x['sent_predicted'][k]):.2f} / {C.mib(x['sent_measured'][k]):.2f}" for k in ("tp", "pp", "dp")
            ]
            comm_rows.append([mesh, x["coords"]["pp"], *cells])
    mem = C.md_table(
        [
            "(tp,pp,dp)",
            "worst rank",
            "state MiB",
            "activations MiB",
            "loss head MiB",
            "pp buffers MiB",
            "predicted peak MiB",
            "measured peak MiB",
            "error",
            "largest error, any rank",
            "at rest MiB pred / meas",
            "layer saved B/token derived / hooks",
        ],
        mem_rows,
    )
    comm = C.md_table(
        ["(tp,pp,dp)", "pp rank", "tp MiB sent pred / meas", "pp MiB sent pred / meas", "dp MiB sent pred / meas"],
        comm_rows,
    )
    misses = [("({},{},{})".format(*r["mesh"]), r["error"]) for r in rows if abs(r["error"]) > TARGET]
    verdict = (
        f"All {len(rows)} meshes within ±{TARGET:.0%}."
        if not misses and not failures
        else "Misses (|error| > 10 %): "
        + (", ".join(f"{m} {e:+.1%}" for m, e in misses) or "none")
        + (f"; failed meshes: {', '.join(failures)}" if failures else "")
    )
    if not all(x["hwm_reset"] for r in rows for x in r["ranks"]):
        verdict += " The kernel refused to reset VmHWM on some rank: its peak includes model building."
    return f"{verdict}\n\n### Peak memory per rank, predicted vs measured\n\n{mem}\n\n### Bytes sent per step\n\n{comm}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke: small model, meshes (2,1,1) and (1,2,1); results/quick/"
    )
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2, help="rows per micro-batch (per dp rank)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2, help="measured steps after the warm-up step")
    ap.add_argument("--meshes", help="tp,pp,dp;... (default: the six of MESHES)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker)) or 0

    model, meshes = (QUICK_MODEL, [(2, 1, 1), (1, 2, 1)]) if args.quick else (MODEL, MESHES)
    if args.quick:
        args.seq, args.steps = 64, 1
    if args.meshes:
        meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes.split(";")]
    cfg = C.llama_config(**model)
    shape = MM.Shape.from_config(cfg)
    env = C.env_info()
    env["worker_threads"] = 1
    env.update(C.MALLOC_ENV)
    spec = dict(microbatches=args.microbatches, rows=args.rows, seq=args.seq, steps=args.steps, schedule="1f1b")
    spec["vocab"] = cfg.vocab_size
    data = {"env": env, "args": vars(args), "model": model, "n_params": shape.params(), "rows": [], "failures": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_mm_") as tmpdir:
        tmp = Path(tmpdir)
        cfg.save_pretrained(tmp / "model")  # config only: hf3d initialises its shards from the seed
        spec["ckpt"] = str(tmp / "model")
        tiny = dict(model, hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=64)
        C.llama_config(**tiny).save_pretrained(tmp / "tiny")
        spec["tiny"] = str(tmp / "tiny")
        for mesh in meshes:
            res, err = measure(mesh, spec, tmp, args.timeout)
            if res is None:
                print(f"  mesh {mesh} FAILED:\n{err}", flush=True)
                data["failures"]["({},{},{})".format(*mesh)] = err
                continue
            data["rows"].append(compare(mesh, res, shape, spec))
    data["wall_s"] = time.perf_counter() - t0
    batch = f"{args.microbatches} micro-batches × {args.rows} rows × {args.seq} tokens per dp rank"
    body = (
        f"Model: {C.shape_str(cfg)}, {shape.params():,} params, fp32, sdpa; {batch}; 1f1b; ZeRO-1 AdamW; gloo, "
        f"1 thread per process; {args.steps} measured step(s) after one warm-up. Took {data['wall_s']:.0f} s.\n\n"
        + report(data["rows"], data["failures"])
        + "\n\n"
        + "\n\n".join(f"Failed {k}:\n```\n{v}\n```" for k, v in data["failures"].items())
    )
    print(body)
    path = C.write_results("memory_model", "Memory model vs measured RSS", body, data, quick=args.quick)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
