"""Pipeline schedules at pp=4: measured bubble fraction and live activations per stage, next to theory.

For afab (GPipe), 1f1b and interleaved-1f1b (virtual_stages=2) at pp=4 and M micro-batches, 4 gloo
processes (torch.multiprocessing, like tests/dist.py) run hf3d.train_step on an 8-layer Llama.
Every rank is instrumented by monkeypatching torch.distributed.pipelining's stage methods:

* busy time = wall time inside PipelineStage.forward_one_chunk (hf3d's StageModule.forward; on the
  last stage also hf3d's loss) + backward_one_chunk (the autograd backward of that chunk);
  total = wall time of the step (barrier -> train_step returns; train_step ends with a broadcast
  from the last stage, so every rank's total is the same step); bubble = (total - busy) / total.
  Theory: (p-1)/(m+p-1) for afab and 1f1b, (p-1)/(v*m+p-1) for interleaved-1f1b.
* live micro-batches = forwards whose backward has not run yet, per rank (all its chunks);
  its maximum is the activation-memory figure that does not depend on timing: afab holds all m,
  1f1b at most p (rank r: p - r).
* saved activation bytes: a torch.autograd.graph.saved_tensors_hooks pack hook inside every
  forward chunk counts the storages autograd saves for backward (parameters excluded, each storage
  once), added at forward and released at that chunk's backward; the peak is per rank.

On a 2-core machine, 4 processes oversubscribe the CPU: a stage "busy" in the wall-clock sense
can be descheduled while another stage computes, so wall-based bubbles are distorted (stage
compute is slowed, idle periods overlap other stages' work). The table also gives a CPU-time
bubble (busy measured with time.thread_time). The in-flight micro-batch counts and saved bytes
are exact and the robust figures here.

    python benchmarks/bench_pipeline.py            # full run (~3-6 min on 2 cores)
    python benchmarks/bench_pipeline.py --quick    # smoke run (results/quick/pipeline.md)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import torch

PP = 4


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; results go to results/quick/")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mb-rows", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration (median)")
    args = ap.parse_args(argv)
    if args.quick:
        args.microbatches, args.hidden, args.inter, args.seq, args.mb_rows, args.steps = [4], 64, 128, 32, 1, 1
    return args


SCHEDULES = [("afab", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]


def theory_bubble(schedule: str, p: int, m: int, v: int) -> float:
    return (p - 1) / ((v if schedule == "interleaved-1f1b" else 1) * m + p - 1)


def live_bound(schedule: str, p: int, m: int, v: int, r: int) -> int:
    """Most forwards (model chunks) rank r holds before their backward: afab all m; 1f1b its
    warm-up p - r (never more than p); interleaved-1f1b torch's warm-up (v-1)p + 2(p-1-r), plus the
    forward of the first 1F1B pair."""
    if schedule == "afab":
        return m
    if schedule == "1f1b":
        return min(m, p - r)
    return min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1)


# -------------------------------------------------------------------------------------------------
# instrumentation (runs in every worker)
# -------------------------------------------------------------------------------------------------
class Probe:
    """Per-rank counters fed by the patched stage methods; reset before each measured step."""

    def __init__(self):
        self.param_ptrs: set[int] = set()
        self.reset()

    def reset(self):
        self.busy_wall = 0.0
        self.busy_cpu = 0.0
        self.live = 0
        self.max_live = 0
        self.live_per_stage: dict[int, int] = {}
        self.max_live_per_stage: dict[int, int] = {}
        self.bytes_of: dict[tuple[int, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.n_fwd = self.n_bwd = 0


PROBE = Probe()


def _timed(fn, *args, **kwargs):
    w0, c0 = time.perf_counter(), time.thread_time()
    try:
        return fn(*args, **kwargs)
    finally:
        PROBE.busy_wall += time.perf_counter() - w0
        PROBE.busy_cpu += time.thread_time() - c0


def install_probes() -> None:
    from torch.distributed.pipelining import stage as pst

    import hf3d.pipeline as hpipe

    base = pst._PipelineStageBase
    orig_fwd, orig_bwd, orig_bwd_w = base.forward_one_chunk, base.backward_one_chunk, base.backward_weight_one_chunk
    orig_loss = hpipe._Pipeline._loss

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        seen: set[int] = set()
        nbytes = 0

        def pack(t):
            nonlocal nbytes
            try:
                st = t.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):
                return t
            if ptr not in PROBE.param_ptrs and ptr not in seen:
                seen.add(ptr)
                nbytes += st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _timed(orig_fwd, self, fwd_chunk_id, *args, **kwargs)
        key = (self.stage_index, fwd_chunk_id)
        PROBE.bytes_of[key] = nbytes
        PROBE.live_bytes += nbytes
        PROBE.peak_bytes = max(PROBE.peak_bytes, PROBE.live_bytes)
        PROBE.live += 1
        PROBE.max_live = max(PROBE.max_live, PROBE.live)
        s = self.stage_index
        PROBE.live_per_stage[s] = PROBE.live_per_stage.get(s, 0) + 1
        PROBE.max_live_per_stage[s] = max(PROBE.max_live_per_stage.get(s, 0), PROBE.live_per_stage[s])
        PROBE.n_fwd += 1
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        out = _timed(orig_bwd, self, bwd_chunk_id, *args, **kwargs)
        PROBE.live -= 1
        PROBE.live_per_stage[self.stage_index] -= 1
        PROBE.live_bytes -= PROBE.bytes_of.pop((self.stage_index, bwd_chunk_id), 0)
        PROBE.n_bwd += 1
        return out

    def backward_weight_one_chunk(self, *args, **kwargs):
        return _timed(orig_bwd_w, self, *args, **kwargs)

    def loss(self, *args, **kwargs):  # the last stage's loss runs outside forward_one_chunk
        return _timed(orig_loss, self, *args, **kwargs)

    base.forward_one_chunk = forward_one_chunk
    base.backward_one_chunk = backward_one_chunk
    base.backward_weight_one_chunk = backward_weight_one_chunk
    hpipe._Pipeline._loss = loss


# -------------------------------------------------------------------------------------------------
# the worker
# -------------------------------------------------------------------------------------------------
def _worker(rank, world, port, model_dir, args_dict, out_file):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _measure(rank, world, model_dir, argparse.Namespace(**args_dict), out_file)
        C.leave_distributed()
    finally:
        dist.destroy_process_group()


def _measure(rank, world, model_dir, args, out_file):
    import torch.distributed as dist

    hf3d = C.import_hf3d()

    install_probes()
    results = []
    g = torch.Generator().manual_seed(0)
    for schedule, v in SCHEDULES:
        for m in args.microbatches:
            pcfg = hf3d.ParallelConfig(pp=PP, pp_schedule=schedule, virtual_stages=v, num_microbatches=m)
            pm = hf3d.parallelize(model_dir, pcfg)
            PROBE.param_ptrs = {p.untyped_storage().data_ptr() for p in pm.parameters()}
            rows = m * args.mb_rows
            steps = []
            for step in range(args.warmup + args.steps):
                ids = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
                PROBE.reset()
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                pm.train_step(ids, ids.clone())
                total, cpu = time.perf_counter() - t0, time.process_time() - c0
                pm.hf_model.zero_grad(set_to_none=True)  # no optimizer: measure the pipeline only
                assert PROBE.live == 0 and PROBE.n_fwd == PROBE.n_bwd, (PROBE.live, PROBE.n_fwd, PROBE.n_bwd)
                if step >= args.warmup:
                    steps.append(
                        {
                            "total_s": total,
                            "process_cpu_s": cpu,
                            "busy_wall_s": PROBE.busy_wall,
                            "busy_cpu_s": PROBE.busy_cpu,
                            "max_live": PROBE.max_live,
                            "max_live_per_stage": dict(PROBE.max_live_per_stage),
                            "peak_saved_bytes": PROBE.peak_bytes,
                            "forwards": PROBE.n_fwd,
                        }
                    )
            mine = {
                "schedule": schedule,
                "v": v,
                "m": m,
                "pp_rank": pm.pp_rank,
                "stages": [st.stage_index for st in pm.stages],
                "layers": [list(st.layer_ids) for st in pm.stages],
                "steps": steps,
            }
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                results.append(gathered)
                Path(out_file).write_text(json.dumps(results))
            del pm
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))


# -------------------------------------------------------------------------------------------------
# the parent: model, spawn, table
# -------------------------------------------------------------------------------------------------
def summarize(results, args) -> tuple[str, str, list[dict]]:
    med = statistics.median
    rows_bubble, rows_mem, flat = [], [], []
    for gathered in results:
        by_rank = sorted(gathered, key=lambda r: r["pp_rank"])
        sched, v, m = by_rank[0]["schedule"], by_rank[0]["v"], by_rank[0]["m"]
        theory = theory_bubble(sched, PP, m, v)
        wall_b, cpu_b, live, peak, totals = [], [], [], [], []
        for r in by_rank:
            wall_b.append(med([(s["total_s"] - s["busy_wall_s"]) / s["total_s"] for s in r["steps"]]))
            cpu_b.append(med([(s["total_s"] - s["busy_cpu_s"]) / s["total_s"] for s in r["steps"]]))
            live.append(max(s["max_live"] for s in r["steps"]))
            peak.append(max(s["peak_saved_bytes"] for s in r["steps"]))
            totals.append(med([s["total_s"] for s in r["steps"]]))
        bounds = [live_bound(sched, PP, m, v, r) for r in range(PP)]
        within = all(x <= b for x, b in zip(live, bounds)) and (sched != "1f1b" or max(live) <= PP)
        name = f"{sched} (v={v})" if v > 1 else sched
        step_s = max(totals)
        rows_bubble.append(
            [
                name,
                m,
                f"{theory:.3f}",
                " / ".join(f"{b:.2f}" for b in wall_b),
                f"{statistics.mean(wall_b):.3f}",
                f"{statistics.mean(cpu_b):.3f}",
                f"{step_s:.2f}",
            ]
        )
        rows_mem.append(
            [
                name,
                m,
                " / ".join(str(x) for x in live),
                " / ".join(str(b) for b in bounds),
                "yes" if within else "**NO**",
                " / ".join(f"{C.mib(b):.1f}" for b in peak),
            ]
        )
        flat.append(
            {
                "schedule": sched,
                "v": v,
                "m": m,
                "theory_bubble": theory,
                "bubble_wall_per_rank": wall_b,
                "bubble_cpu_per_rank": cpu_b,
                "max_live_per_rank": live,
                "live_bound_per_rank": bounds,
                "peak_saved_bytes_per_rank": peak,
                "step_s": step_s,
                "layers_per_rank": [r["layers"] for r in by_rank],
            }
        )
    md_b = C.md_table(
        [
            "schedule",
            "M",
            "theory bubble",
            "measured bubble r0 / r1 / r2 / r3 (wall)",
            "mean (wall)",
            "mean (CPU-time busy)",
            "step s",
        ],
        rows_bubble,
    )
    md_m = C.md_table(
        [
            "schedule",
            "M",
            "max live micro-batches r0 / r1 / r2 / r3",
            "expected r0 / r1 / r2 / r3",
            "within (1f1b ≤ p)",
            "peak saved activations MiB r0 / r1 / r2 / r3",
        ],
        rows_mem,
    )
    return md_b, md_m, flat


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    env = C.env_info()
    cores = os.cpu_count() or 1
    oversub = PP > cores
    note = (
        f"**{PP} processes on {cores} CPU cores: the CPU is oversubscribed** — wall-clock stage timings "
        "include time a process waits for a core, so the measured bubble fractions are distorted "
        "(they mix pipeline idle time with CPU sharing). The live micro-batch counts and saved-activation "
        "bytes do not depend on timing and are the robust figures here."
        if oversub
        else f"{PP} processes on {cores} CPU cores (not oversubscribed)."
    )
    print(note, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = C.llama_config(
            hidden_size=args.hidden,
            intermediate_size=args.inter,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            vocab_size=args.vocab,
            tie_word_embeddings=False,
        )
        model_dir = Path(tmp) / "model"
        n_params = C.save_model_dir(cfg, model_dir, dtype=torch.float32)
        out_file = Path(tmp) / "results.json"
        import torch.multiprocessing as mp

        mp.start_processes(
            _worker,
            args=(PP, C.free_port(), str(model_dir), vars(args), str(out_file)),
            nprocs=PP,
            join=True,
            start_method="spawn",
        )
        results = json.loads(out_file.read_text())
    md_b, md_m, flat = summarize(results, args)
    elapsed = time.perf_counter() - t_start
    cmd = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *(argv if argv is not None else sys.argv[1:])])
    env["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    layers = flat[0]["layers_per_rank"] if flat else []
    body = f"""# Pipeline schedules at pp={PP}: bubble and live activations

{"**QUICK smoke run — not a measurement.**" if args.quick else ""}

Command: `{cmd}` (took {elapsed:.0f} s)

Model: {C.shape_str(cfg)}, {n_params / 1e6:.2f} M parameters, fp32, sdpa. Micro-batch: {args.mb_rows} rows × {args.seq}
tokens; global batch = M × {args.mb_rows} rows; {args.warmup} warm-up + {args.steps} measured steps (median) per row;
no optimizer step (forward + backward of the schedule only). One torch thread per process, gloo.
Layers per pipeline rank (afab/1f1b): {layers}.

{note}

Environment: {", ".join(f"{k}={v}" for k, v in env.items())}

## Bubble fraction per stage (pipeline rank)

bubble = (step wall time − busy time) / step wall time, busy = forward chunks (+ loss) + backward chunks
timed inside the stage (wall clock, or CPU time of the thread). Theory: (p−1)/(m+p−1) for afab and 1f1b,
(p−1)/(v·m+p−1) for interleaved-1f1b (equal stages, backward = 2 × forward, no communication).

{md_b}

## Activations alive at once (afab vs 1f1b)

Live micro-batches: forwards whose backward has not run yet on that rank (all its chunks; for
interleaved-1f1b a live chunk holds half a rank's layers). Expected: afab m; 1f1b min(m, p − r), so never more
than p; interleaved-1f1b min(v·m, (v−1)·p + 2·(p−1−r) + 1) chunks (torch's warm-up). Saved activations:
bytes of the storages autograd saved for backward (torch.autograd.graph.saved_tensors_hooks; parameters
excluded), at their peak.

{md_m}

<details><summary>raw JSON</summary>

```json
{json.dumps({"env": env, "args": vars(args), "results": flat}, indent=1, default=str)}
```
</details>
"""
    out_dir = C.RESULTS / "quick" if args.quick else C.RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pipeline.md").write_text(body)
    env["hf3d_uncommitted_at_end"] = C.hf3d_uncommitted()
    raw = {"env": env, "args": vars(args), "n_params": n_params, "wall_s": elapsed, "results": flat}
    (out_dir / "pipeline.json").write_text(json.dumps(raw, indent=1, default=str))
    print(md_b, md_m, sep="\n\n")
    print(f"wrote {out_dir / 'pipeline.md'} and pipeline.json in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
