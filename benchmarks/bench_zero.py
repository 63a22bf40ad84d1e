"""ZeRO-1 / data parallelism: memory per rank, bytes communicated, overlap, and hf3d vs accelerate DDP.

(a) per-rank bytes from `opt.memory_report()` (params, fp32 main grads, fp32 master weights, AdamW
    state) at (tp, pp, dp) = (1,1,1), (1,1,4), (2,1,2) and (2,2,2), bf16 params, next to the
    Megatron accounting: 2 B params + 4 B grads + 12/dp B master+Adam = 6 + 12/dp bytes per param.
(b) bytes each rank sends per step on the dp group, counted by wrapping torch.distributed's
    collectives during one step (ring model: all_reduce 2(n-1)/n x bytes; reduce_scatter, all_to_all
    and all_gather (n-1)/n x the full buffer), next to the bucket arithmetic and to 2(dp-1)/dp x grad bytes.
(c) step time at dp=2 with overlap_grad_reduce True/False x dp_collective all_reduce / reduce_scatter /
    all_to_all.
(d) hf3d dp=2 vs accelerate DDP (`accelerator.prepare` on the stock model) on the same 2-process job:
    tokens/s (steps interleaved in the same processes) and peak memory (separate fresh jobs).

Every part runs under torchrun on gloo (CPU). Worlds of 4 and 8 processes share 2 cores here, so
only (c) and (d) time anything, both at 2 processes.

    python benchmarks/bench_zero.py            # full (~3-5 min on 2 cores)
    python benchmarks/bench_zero.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _common as C

SCRIPT = Path(__file__).resolve()
LR, WD, CLIP = 1e-4, 0.1, 1.0
MODEL = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=768,
    vocab_size=8192,
    tie_word_embeddings=True,
)
MESHES_A = [(1, 1, 1), (1, 1, 4), (2, 1, 2), (2, 2, 2)]


# =================================================================================================
# collective accounting
# =================================================================================================
class CommTally:
    """Wraps torch.distributed collectives; while active, adds up the bytes each rank sends.

    Bytes sent per rank follow the ring algorithms: all_reduce 2(n-1)/n x tensor bytes;
    reduce_scatter and all_to_all (n-1)/n x input bytes; all_gather (n-1)/n x output bytes; broadcast
    (n-1) x the tensor bytes from the source, nothing from the others. Calls are classified by their
    group's ranks (dp / tp / pp / world); on dp, a collective on the parameters' own storage (ZeRO-1's
    gather: an all_gather, a broadcast per shard, or an all_reduce of the zero-padded parameter
    buffer) is the param gather, any other the gradient reduction.
    """

    # Point-to-point ops are left alone: batch_isend_irecv (pipeline schedules) checks P2POp.op against
    # the original isend/irecv functions, so wrapping them breaks pp; they never touch the dp group.
    OPS = (
        "all_reduce",
        "reduce_scatter_single",
        "all_gather_single",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
        "broadcast",
        "all_to_all_single",
    )

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.active = False
        self.groups: dict[tuple[int, ...], str] = {}
        self.records: list[dict] = []
        self.pmodel = None
        self._orig = {}
        for op in self.OPS:
            if hasattr(dist, op):
                self._orig[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self._orig[op]))

    def name_groups(self, pmodel) -> None:
        self.pmodel = pmodel  # its parameters' storages are read at each call: build_optimizer moves them
        for dim in ("dp", "tp", "pp"):  # dp first: it wins when two dims cover the same ranks
            ranks = tuple(self.dist.get_process_group_ranks(pmodel.mesh.get_group(dim)))
            self.groups.setdefault(ranks, dim)

    def _wrap(self, op, fn):
        def wrapped(*args, **kwargs):
            if self.active:
                self._record(op, args, kwargs)
            return fn(*args, **kwargs)

        return wrapped

    def _record(self, op, args, kwargs):
        import torch

        group = kwargs.get("group")
        if group is None:
            pos = {
                "all_reduce": 2,
                "broadcast": 2,
                "reduce_scatter_single": 2,
                "all_gather_single": 2,
                "all_to_all_single": 4,
            }.get(op)
            if pos is not None and len(args) > pos and not isinstance(args[pos], (int, bool)):
                group = args[pos]
        n = self.dist.get_world_size(group)
        ranks = tuple(self.dist.get_process_group_ranks(group)) if group is not None else tuple(range(n))
        kind = self.groups.get(ranks, "world" if group is None else "other")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if op == "all_reduce":
            t = tensors[0]
            nbytes = t.numel() * t.element_size()
            sent = 2 * (n - 1) / n * nbytes
        elif op == "broadcast":
            t = tensors[0]
            nbytes = t.numel() * t.element_size()
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            if kwargs.get("group_src") is not None:
                src = self.dist.get_global_rank(group, kwargs["group_src"])
            sent = float((n - 1) * nbytes) if src == self.dist.get_rank() else 0.0
        elif op in ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single"):
            out, inp = tensors[0], tensors[1]
            nbytes = inp.numel() * inp.element_size()
            sent = (n - 1) / n * nbytes
        elif op in ("all_gather_single", "all_gather_into_tensor"):
            out = tensors[0]
            nbytes = out.numel() * out.element_size()
            sent = (n - 1) / n * nbytes
        else:
            raise AssertionError(op)
        numel = tensors[0].numel() if tensors else 0
        params = (
            bool(tensors)
            and self.pmodel is not None
            and tensors[0].untyped_storage().data_ptr()
            in {p.untyped_storage().data_ptr() for p in self.pmodel.parameters()}
        )
        self.records.append(
            {"op": op, "group": kind, "n": n, "numel": numel, "bytes": nbytes, "sent": sent, "params": params}
        )

    def measure(self):
        tally = self

        class _Ctx:
            def __enter__(self):
                tally.records = []
                tally.active = True
                return tally

            def __exit__(self, *exc):
                tally.active = False

        return _Ctx()

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for r in self.records:
            if r["group"] == "dp" and r["numel"] > 1:
                key = "dp_param_gather" if r["params"] else "dp_grad_reduce"
            elif r["group"] == "dp":
                key = "dp_scalars"
            else:
                key = f"{r['group']}_{'scalars' if r['numel'] <= 1 else 'tensors'}"
            s = out.setdefault(key, {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0, "ops": set()})
            s["calls"] += 1
            s["payload_bytes"] += r["bytes"]
            s["sent_bytes"] += r["sent"]
            s["ops"].add(r["op"])
        for s in out.values():
            s["ops"] = sorted(s["ops"])
        return out


# =================================================================================================
# workers (run under torchrun)
# =================================================================================================
def _rank_batch(spec, pmodel_dp_rank: int, dp: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, MODEL["vocab_size"], (spec["global_batch"], spec["seq"]), generator=g)
    rows = spec["global_batch"] // dp
    mine = ids[pmodel_dp_rank * rows : (pmodel_dp_rank + 1) * rows]
    return mine, mine.clone()


def _build(spec, *, tp, pp, dp, dtype, zero=1, collective="auto", overlap=True):
    import torch

    hf3d = C.import_hf3d()

    pcfg = hf3d.ParallelConfig(tp=tp, pp=pp, dp=dp, num_microbatches=spec.get("microbatches", 1))
    pmodel = hf3d.parallelize(spec["ckpt"], pcfg, dtype=dtype)
    opt = hf3d.build_optimizer(
        pmodel,
        torch.optim.AdamW,
        lr=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        zero_stage=zero,
        dp_collective=collective,
        overlap_grad_reduce=overlap,
    )
    return pmodel, opt


def _hf3d_step(pmodel, opt, ids, labels, errors: list):
    try:
        pmodel.train_step(ids, labels)
    except Exception as e:  # pp>1 before hf3d.pipeline exists: record where it raised, still step
        tb = traceback.extract_tb(e.__traceback__)
        where = [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in tb if "hf3d" in f.filename]
        errors.append(f"{type(e).__name__}: {e} [at {' -> '.join(where[-3:])}]")
    opt.step()
    opt.zero_grad()


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def worker_mem_comm(spec) -> dict:
    """Part (a) + (b): one mesh; memory report of a ZeRO-1 optimizer after a step; bytes per step."""
    import torch

    tp, pp, dp = spec["mesh"]
    dtype = torch.bfloat16
    tally = CommTally()
    variants = [
        ("zero1", 1, "all_to_all"),
        ("zero1", 1, "all_reduce"),
        ("zero1", 1, "reduce_scatter"),
        ("zero0", 0, "all_reduce"),
    ]
    if dp == 1:
        variants = variants[:1]
    mine = {"variants": {}}
    for vname, zero, coll in variants:
        pmodel, opt = _build(spec, tp=tp, pp=pp, dp=dp, dtype=dtype, zero=zero, collective=coll)
        tally.name_groups(pmodel)
        ids, labels = _rank_batch(spec, pmodel.dp_rank, dp)
        errors: list[str] = []
        _hf3d_step(pmodel, opt, ids, labels, errors)  # warm-up; creates the AdamW state
        with tally.measure():
            _hf3d_step(pmodel, opt, ids, labels, errors)
        local_numel = sum(p.numel() for b in opt.buckets for p in b.params)
        rec = {
            "coords": {"tp": pmodel.tp_rank, "pp": pmodel.pp_rank, "dp": pmodel.dp_rank},
            "memory": opt.memory_report(),
            "local_params": local_numel,
            "buckets": [b.numel for b in opt.buckets],
            "param_elem": pmodel.param_dtype.itemsize,
            "comm": tally.summary(),
            "errors": errors[:1],
            "collective": opt.dp_collective,
            "full_params": sum(
                int(torch.Size(s).numel())
                for n, s in pmodel.hf_shapes.items()
                if not (pmodel.config.tie_word_embeddings and n == "lm_head.weight")
            ),
        }
        mine["variants"][f"{vname}-{coll}"] = rec
        del pmodel, opt
    return {"ranks": _gather(mine)}


def worker_overlap(spec) -> dict:
    """Part (c): dp=2, four optimizer variants on four copies of the model, steps interleaved."""
    import torch
    import torch.distributed as dist

    variants = [(ov, coll) for ov in (True, False) for coll in ("all_reduce", "reduce_scatter", "all_to_all")]
    tally = CommTally()
    built = []
    for ov, coll in variants:
        pmodel, opt = _build(spec, tp=1, pp=1, dp=2, dtype=torch.float32, collective=coll, overlap=ov)
        tally.name_groups(pmodel)
        built.append((f"overlap={ov}, {coll}", pmodel, opt))
    ids, labels = _rank_batch(spec, built[0][1].dp_rank, 2)
    times = {name: [] for name, _, _ in built}
    parts = {name: {"train_step": [], "opt_step": []} for name, _, _ in built}
    for r in range(spec["warmup"] + spec["repeats"]):
        order = built[r % len(built) :] + built[: r % len(built)]  # rotate who goes first
        for name, pmodel, opt in order:
            dist.barrier()
            t0 = time.perf_counter()
            pmodel.train_step(ids, labels)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            if r >= spec["warmup"]:
                times[name].append(t2 - t0)
                parts[name]["train_step"].append(t1 - t0)
                parts[name]["opt_step"].append(t2 - t1)
    comm = {}
    for name, pmodel, opt in built:
        tally.pmodel = pmodel  # whose parameter gather to recognise
        with tally.measure():
            _hf3d_step(pmodel, opt, ids, labels, [])
        comm[name] = {
            "comm": tally.summary(),
            "buckets": [b.numel for b in opt.buckets],
            "local_params": sum(p.numel() for b in opt.buckets for p in b.params),
            "param_elem": 4,
            "collective": opt.dp_collective,
        }
    return {"times": _gather(times), "parts": _gather(parts), "comm": comm}


def worker_ddp(spec) -> dict:
    """Part (d): mode 'both' interleaves hf3d and DDP steps (throughput); 'hf3d' / 'ddp' alone (memory)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    hf3d = C.import_hf3d()  # imported in every mode so the baselines match

    mode = spec["mode"]
    rank = dist.get_rank()
    mem = {"baseline": C.proc_status()}
    sides = {}
    if mode in ("both", "hf3d"):
        pmodel = hf3d.parallelize(spec["ckpt"], hf3d.ParallelConfig(tp=1, pp=1, dp=2), dtype=torch.float32)
        mem["model loaded"] = C.proc_status()
        opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=LR, weight_decay=WD, max_grad_norm=CLIP)
        mem["optimizer built"] = C.proc_status()
        ids, labels = _rank_batch(spec, pmodel.dp_rank, 2)

        def hf3d_step():
            loss = pmodel.train_step(ids, labels)
            opt.step()
            opt.zero_grad()
            return loss

        sides["hf3d"] = hf3d_step
        state_bytes = {"hf3d": opt.memory_report()}
    if mode in ("both", "ddp"):
        accelerator = Accelerator(cpu=True)
        stock = AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32)
        stock.train()
        mem["model loaded"] = C.proc_status()
        dopt = torch.optim.AdamW(stock.parameters(), lr=LR, weight_decay=WD)
        model, dopt = accelerator.prepare(stock, dopt)
        mem["optimizer built"] = C.proc_status()
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
        ids, labels = _rank_batch(spec, rank, 2)

        def ddp_step():
            loss = model(input_ids=ids, labels=labels).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            dopt.step()
            dopt.zero_grad()
            return loss.detach()

        sides["ddp"] = ddp_step
        ddp_info = {
            "distributed_type": str(accelerator.distributed_type),
            "gradient_as_bucket_view": model.gradient_as_bucket_view
            if hasattr(model, "gradient_as_bucket_view")
            else None,
        }
    times = {k: [] for k in sides}
    losses = {k: [] for k in sides}
    names = list(sides)
    for r in range(spec["warmup"] + spec["repeats"]):
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = sides[name]()
            dt = time.perf_counter() - t0
            if r >= spec["warmup"]:
                times[name].append(dt)
            if name == "ddp":  # DDP's loss is this rank's mean; hf3d returns the global-batch mean
                loss = loss.clone()
                dist.all_reduce(loss)
                loss /= dist.get_world_size()
            losses[name].append(float(loss))
        if r == 0:
            mem["after step 1"] = C.proc_status()
    mem["end"] = C.proc_status()
    try:  # what is live, not what glibc keeps cached from freed activations and temporaries
        import ctypes

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mem["end, after malloc_trim(0)"] = C.proc_status()
    except OSError:
        mem["end, after malloc_trim(0)"] = mem["end"]
    out = {"times": _gather(times), "mem": _gather(mem), "losses": losses}
    if mode in ("both", "ddp"):
        out["ddp_info"] = ddp_info
        n = sum(p.numel() for p in model.parameters())
        st = sum(
            t.numel() * t.element_size()
            for s in dopt.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        out["ddp_state_bytes"] = {"params": 4 * n, "grads": 4 * n, "optimizer_state": st, "n_params": n}
    if mode in ("both", "hf3d"):
        out["hf3d_state_bytes"] = opt.memory_report()
        out["hf3d_state_bytes_at_build"] = state_bytes["hf3d"]
    return out


def run_worker(kind: str, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        fn = {"mem_comm": worker_mem_comm, "overlap": worker_overlap, "ddp": worker_ddp}[kind]
        result = fn(spec)
        if dist.get_rank() == 0:
            Path(spec["out"]).write_text(json.dumps(result, default=str))
        dist.barrier()
        C.leave_distributed()
    finally:
        dist.destroy_process_group()


# =================================================================================================
# orchestration and reports
# =================================================================================================
def launch(kind: str, nproc: int, spec: dict, tmp: Path, tag: str, timeout: float) -> tuple[dict | None, str]:
    spec = dict(spec, out=str(tmp / f"{kind}-{tag}.json"))
    t0 = time.perf_counter()
    try:
        proc = C.torchrun(SCRIPT, nproc, ["--worker", kind, "--spec", json.dumps(spec)], timeout=timeout)
    except Exception as e:  # TimeoutExpired: a hang (e.g. a pipeline schedule waiting forever)
        return None, f"{type(e).__name__}: {e}"
    print(f"  [{kind} {tag}] {nproc} processes, {time.perf_counter() - t0:.1f}s, rc {proc.returncode}", flush=True)
    out = Path(spec["out"])
    if proc.returncode != 0 or not out.exists():
        return None, C.tail(proc.stderr, 30)
    return json.loads(out.read_text()), ""


def report_a(results: dict) -> tuple[str, dict]:
    rows, data = [], {}
    for mesh, res in results.items():
        tp, pp, dp = mesh
        if res is None:
            rows.append([f"({tp},{pp},{dp})", "FAILED", "", "", "", "", "", "", ""])
            continue
        recs = [r["variants"]["zero1-all_to_all"] for r in res["ranks"]]
        worst = max(recs, key=lambda r: r["memory"]["total"])
        m, p_local, n_full = worst["memory"], worst["local_params"], worst["full_params"]
        theory = {
            "params": 2 * p_local,
            "main_grads": 4 * p_local,
            "master_weights": 4 * p_local / dp,
            "optimizer_state": 8 * p_local / dp,
        }
        theory["total"] = sum(theory.values())
        ideal_total = n_full / (tp * pp) * (6 + 12 / dp)
        note = "; ".join(sorted({e for r in recs for e in r["errors"]}))
        data[str(mesh)] = {
            "worst_rank": worst,
            "theory_from_local_params": theory,
            "ideal_total_from_full_model": ideal_total,
            "all_totals": [r["memory"]["total"] for r in recs],
            "errors": note,
        }
        cell = lambda k, m=m, theory=theory: f"{C.mib(m[k]):.2f} / {C.mib(theory[k]):.2f}"  # noqa: E731
        rows.append(
            [
                f"({tp},{pp},{dp})",
                f"{p_local:,}",
                cell("params"),
                cell("main_grads"),
                cell("master_weights"),
                cell("optimizer_state"),
                f"{C.mib(m['total']):.2f} / {C.mib(theory['total']):.2f}",
                f"{m['total'] / p_local:.2f} (theory {6 + 12 / dp:.2f})",
                f"{m['total'] / ideal_total:.3f}x",
            ]
        )
    table = C.md_table(
        [
            "(tp,pp,dp)",
            "params on the worst rank",
            "params MiB meas/theory",
            "main grads",
            "master weights",
            "AdamW state",
            "total MiB meas/theory",
            "bytes per local param",
            "total vs N/(tp·pp)·(6+12/dp)",
        ],
        rows,
    )
    notes = [
        f"- ({k}): train_step raised `{v['errors']}`; memory measured after `opt.step()` on zero gradients "
        "(the AdamW state exists; the layout is the same)"
        for k, v in data.items()
        if v["errors"]
    ]
    return table + ("\n\n" + "\n".join(notes) if notes else ""), data


def comm_row(label: str, rec: dict, dp: int, collective: str, zero: int, note: str = "") -> tuple[list, dict]:
    comm, buckets, pe = rec["comm"], rec["buckets"], rec["param_elem"]
    grad_bytes = 4 * rec["local_params"]  # fp32 main grads
    reduce_sent = comm.get("dp_grad_reduce", {}).get("sent_bytes", 0.0)
    gather_sent = comm.get("dp_param_gather", {}).get("sent_bytes", 0.0)
    scal = comm.get("dp_scalars", {}).get("sent_bytes", 0.0) + comm.get("world_scalars", {}).get("sent_bytes", 0.0)
    f = (dp - 1) / dp
    exp_reduce = sum(4 * b for b in buckets) * (2 * f if collective == "all_reduce" else f)
    # the param gather: all_gather or one broadcast per shard (n-1)/n, an all-reduce (dp_collective all_reduce) 2(n-1)/n
    exp_gather = 0.0 if zero == 0 else sum(pe * b for b in buckets) * (2 * f if collective == "all_reduce" else f)
    minimum = 2 * f * grad_bytes
    total = reduce_sent + gather_sent
    ops = "+".join(comm.get("dp_grad_reduce", {}).get("ops", []))
    row = [
        label,
        dp,
        ops or collective,
        f"{C.mib(reduce_sent):.2f} ({C.mib(exp_reduce):.2f})",
        f"{C.mib(gather_sent):.2f} ({C.mib(exp_gather):.2f})",
        f"{scal:.0f}",
        f"{C.mib(total):.2f}",
        f"{C.mib(minimum):.2f}",
        f"{total / minimum:.3f}x",
        note,
    ]
    return row, {
        "grad_reduce_sent": reduce_sent,
        "param_gather_sent": gather_sent,
        "expected_reduce": exp_reduce,
        "expected_gather": exp_gather,
        "min_2(dp-1)/dp_grad_bytes": minimum,
        "ratio_to_min": total / minimum,
        "scalar_bytes": scal,
        "raw": comm,
    }


def report_b(mem_results: dict, overlap_res: dict | None) -> tuple[str, dict]:
    rows, data = [], {}
    for mesh, res in mem_results.items():
        tp, pp, dp = mesh
        if res is None or dp == 1:
            continue
        for vname, rec in res["ranks"][0]["variants"].items():
            note = "train_step raised; counted opt.step() only" if rec["errors"] else ""
            label = f"({tp},{pp},{dp}) bf16 {vname}"
            zero, _, coll = vname.partition("-")
            row, d = comm_row(label, rec, dp, coll, int(zero[-1]), note)
            rows.append(row)
            data[label] = d
    if overlap_res:
        for name, rec in overlap_res["comm"].items():
            label = f"(1,1,2) fp32 zero1 {name}"
            row, d = comm_row(label, rec, 2, rec["collective"], 1)
            rows.append(row)
            data[label] = d
    table = C.md_table(
        [
            "config",
            "dp",
            "grad collective",
            "grad reduce MiB sent (bucket arithmetic)",
            "param gather MiB sent (bucket arithmetic)",
            "scalar bytes",
            "total MiB sent",
            "2(dp-1)/dp x fp32 grad MiB",
            "total / that",
            "note",
        ],
        rows,
    )
    return table, data


def report_c(res: dict | None) -> tuple[str, dict]:
    if res is None:
        return "FAILED", {}
    times0 = res["times"][0]
    names = list(times0)
    # one step's time = the slower rank's time
    step = {n: [max(ts[n][i] for ts in res["times"]) for i in range(len(times0[n]))] for n in names}
    base = C.median(step[names[0]])
    rows, data = [], {}
    for n in names:
        med = C.median(step[n])
        tr = C.median(res["parts"][0][n]["train_step"])
        os_ = C.median(res["parts"][0][n]["opt_step"])
        rows.append(
            [
                n,
                f"{med:.4f} [{C.quantile(step[n], 0.25):.4f}, {C.quantile(step[n], 0.75):.4f}]",
                f"{tr:.4f}",
                f"{os_:.4f}",
                f"{med / base:.3f}x",
            ]
        )
        data[n] = {"median": med, "train_step": tr, "opt_step": os_, "samples": step[n]}
    table = C.md_table(
        [
            "variant (dp=2, fp32)",
            "step s, median [p25, p75]",
            "train_step s (rank 0)",
            "opt.step s (rank 0)",
            f"vs {names[0]}",
        ],
        rows,
    )
    return table, data


def report_d(both: dict | None, alone: dict, spec: dict) -> tuple[str, dict]:
    data, parts = {}, []
    tokens = spec["global_batch"] * spec["seq"]
    if both is not None:
        step = {
            n: [max(ts[n][i] for ts in both["times"]) for i in range(len(both["times"][0][n]))] for n in ("hf3d", "ddp")
        }
        med = {n: C.median(v) for n, v in step.items()}
        tps = {n: tokens / med[n] for n in med}
        data["throughput"] = {"median_step_s": med, "tokens_per_s": tps, "losses": both["losses"]}
        rows = [
            [n, f"{med[n]:.4f} [{C.quantile(step[n], 0.25):.4f}, {C.quantile(step[n], 0.75):.4f}]", f"{tps[n]:,.0f}"]
            for n in ("hf3d", "ddp")
        ]
        rows.append(["hf3d / DDP", f"{med['hf3d'] / med['ddp']:.3f}x", f"**{tps['hf3d'] / tps['ddp']:.3f}x**"])
        first = {n: both["losses"][n][0] for n in ("hf3d", "ddp")}
        parts.append(
            C.md_table(["side (same 2 processes, interleaved)", "step s median [p25, p75]", "tokens/s"], rows)
            + f"\n\nFirst-step loss: hf3d {first['hf3d']:.6f}, DDP {first['ddp']:.6f} "
            "(global-batch mean, same weights and rows). "
            f"DDP: {both.get('ddp_info')}."
        )
    mem_rows = {}
    for side, res in alone.items():
        if res is None:
            mem_rows[side] = None
            continue
        ranks = res["mem"]
        worst = max(ranks, key=lambda m: m["end"]["VmHWM"])
        base = worst["baseline"]
        mem_rows[side] = {
            "peak": worst["end"]["VmHWM"],
            "peak_above": worst["end"]["VmHWM"] - base["VmHWM"],
            "anon_end_above": worst["end"]["RssAnon"] - base["RssAnon"],
            "baseline": base["VmHWM"],
            "state": res.get(f"{side}_state_bytes"),
        }
    data["memory"] = mem_rows
    if all(mem_rows.get(s) for s in ("hf3d", "ddp")):
        h, d = mem_rows["hf3d"], mem_rows["ddp"]
        ds = d["state"]
        ddp_state_total = ds["params"] + ds["grads"] + ds["optimizer_state"]
        rows = [
            ["peak RSS (VmHWM), worst rank", C.mib(h["peak"]), C.mib(d["peak"]), f"{h['peak'] / d['peak']:.3f}x"],
            [
                "peak RSS above the process's own baseline (imports + gloo init)",
                C.mib(h["peak_above"]),
                C.mib(d["peak_above"]),
                f"**{h['peak_above'] / d['peak_above']:.3f}x**",
            ],
            [
                "private RSS (RssAnon) at the end, above baseline",
                C.mib(h["anon_end_above"]),
                C.mib(d["anon_end_above"]),
                f"{h['anon_end_above'] / d['anon_end_above']:.3f}x",
            ],
            [
                "training-state tensors (hf3d memory_report; DDP params+grads+AdamW, reducer buckets not counted)",
                C.mib(h["state"]["total"]),
                C.mib(ddp_state_total),
                f"{h['state']['total'] / ddp_state_total:.3f}x",
            ],
        ]
        phase_rows = []
        for phase in ("model loaded", "optimizer built", "after step 1", "end", "end, after malloc_trim(0)"):
            vals = []
            for side in ("hf3d", "ddp"):
                ranks = alone[side]["mem"]
                worst = max(ranks, key=lambda m: m["end"]["VmHWM"])
                vals.append(
                    (
                        worst[phase]["VmRSS"] - worst["baseline"]["VmRSS"],
                        worst[phase]["VmHWM"] - worst["baseline"]["VmHWM"],
                        worst[phase]["RssAnon"] - worst["baseline"]["RssAnon"],
                    )
                )
            phase_rows.append([phase, *(f"{C.mib(v[0]):.1f} / {C.mib(v[1]):.1f} / {C.mib(v[2]):.1f}" for v in vals)])
        rows.append(["(phases below: RSS / peak RSS / private RSS, each above baseline)", "", "", ""])
        rows += [[f"  {r[0]}", r[1], r[2], ""] for r in phase_rows]
        parts.append(
            "Peak memory, each side alone in a fresh 2-process job (same steps):\n\n"
            + C.md_table(["metric (MiB)", "hf3d dp=2", "accelerate DDP", "hf3d / DDP"], rows)
        )
    else:
        parts.append(f"memory jobs failed: {[k for k, v in mem_rows.items() if not v]}")
    return "\n\n".join(parts), data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run; results go to results/quick/")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4, help="rows per step over all dp ranks, (c) and (d)")
    ap.add_argument("--parts", default="a,b,c,d")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per torchrun job")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args.worker, json.loads(args.spec))
    if args.quick:
        args.repeats = 2
    parts = set(args.parts.split(","))

    import torch

    env = C.env_info()
    env["worker_threads"] = 1
    cfg = C.llama_config(**MODEL)
    t_all = time.perf_counter()
    data = {"env": env, "args": vars(args)}
    body = []
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmpdir:
        tmp = Path(tmpdir)
        ckpt = tmp / "model"
        n_params = C.save_model_dir(cfg, ckpt, dtype=torch.float32)
        shapes = (
            f"{C.shape_str(cfg)}; {n_params:,} params; global batch {args.global_batch} x seq {args.seq} "
            f"(split over dp); AdamW(lr={LR}, wd={WD}), clip {CLIP}; default bucket_size 2**22 elements"
        )
        print("shapes:", shapes, flush=True)
        body.append(f"Shapes: {shapes}. gloo on CPU, 1 thread per process, launched with torchrun.")
        spec = {
            "ckpt": str(ckpt),
            "seq": args.seq,
            "global_batch": args.global_batch,
            "warmup": 2,
            "repeats": args.repeats,
        }

        mem_results = {}
        if parts & {"a", "b"}:
            print("(a)+(b) memory report and dp bytes per mesh", flush=True)
            for mesh in MESHES_A:
                tp, pp, dp = mesh
                # memory and bytes do not depend on the batch: keep the steps cheap (4 rows x 32 tokens)
                s = dict(spec, mesh=mesh, microbatches=2 if pp > 1 else 1, global_batch=4, seq=32)
                res, err = launch("mem_comm", tp * pp * dp, s, tmp, "x".join(map(str, mesh)), args.timeout)
                if res is None:
                    print(f"  mesh {mesh} FAILED:\n{err}", flush=True)
                    data.setdefault("failures", {})[str(mesh)] = err
                mem_results[mesh] = res
        overlap_res = None
        if parts & {"b", "c"}:
            print("(c) overlap / collective at dp=2", flush=True)
            overlap_res, err = launch("overlap", 2, spec, tmp, "dp2", args.timeout)
            if overlap_res is None:
                print(f"  FAILED:\n{err}", flush=True)
                data.setdefault("failures", {})["overlap"] = err
        ddp_both, ddp_alone = None, {}
        if "d" in parts:
            print("(d) hf3d vs accelerate DDP at dp=2", flush=True)
            ddp_both, err = launch("ddp", 2, dict(spec, mode="both"), tmp, "both", args.timeout)
            if ddp_both is None:
                print(f"  FAILED:\n{err}", flush=True)
                data.setdefault("failures", {})["ddp-both"] = err
            for side in ("hf3d", "ddp"):
                s = dict(spec, mode=side, repeats=max(2, args.repeats // 2))
                ddp_alone[side], err = launch("ddp", 2, s, tmp, side, args.timeout)
                if ddp_alone[side] is None:
                    data.setdefault("failures", {})[f"ddp-{side}"] = err

    if "a" in parts:
        t, d = report_a(mem_results)
        body.append(
            "## (a) Memory per rank, bf16 params, ZeRO-1 (worst rank; MiB measured / theory)\n\n"
            "Theory per rank from this rank's own parameter count P: params 2P, fp32 main grads 4P, "
            "fp32 master 4P/dp, AdamW state 8P/dp (Megatron: 6 + 12/dp bytes per parameter). The last "
            "column compares with the whole model's N parameters split evenly: N/(tp·pp)·(6+12/dp); "
            "above 1 by the norms every tp rank keeps, the tied embedding copy a pp split adds, and "
            "padding.\n\n" + t
        )
        data["a"] = d
    if "b" in parts:
        t, d = report_b(mem_results, overlap_res)
        body.append(
            "## (b) Bytes each rank sends per step on the dp group\n\n"
            "Counted by wrapping torch.distributed collectives during one step (ring model: all_reduce "
            "2(n-1)/n x bytes, reduce_scatter, all_to_all and all_gather (n-1)/n x the full buffer, a "
            "broadcast (n-1) x its bytes from the source); in brackets what "
            "the buckets predict. The reference is 2(dp-1)/dp x the fp32 gradient bytes (one all-reduce "
            "of the grads, = reduce-scatter grads + all-gather fp32 params). hf3d reduces fp32 main grads "
            "(4 B/param) and, under ZeRO-1, gathers params in the param dtype: all-gather with "
            "reduce_scatter; with all_to_all (gloo's default: all-to-all of the grads and a local sum, "
            "the same bytes as a reduce-scatter) one broadcast per shard from its owner; with all_reduce "
            "an all-reduce of the zero-padded parameter buffer, twice the bytes of an all-gather.\n\n" + t
        )
        data["b"] = d
    if "c" in parts:
        t, d = report_c(overlap_res)
        body.append(f"## (c) Step time at dp=2 (fp32, {args.repeats} interleaved rounds after 2 warm-up)\n\n" + t)
        data["c"] = d
    if "d" in parts:
        t, d = report_d(ddp_both, ddp_alone, spec)
        body.append("## (d) hf3d dp=2 (ZeRO-1) vs accelerate DDP, fp32, 2 processes\n\n" + t)
        data["d"] = d
    if data.get("failures"):
        body.append("## Failures\n\n" + "\n\n".join(f"{k}:\n```\n{v}\n```" for k, v in data["failures"].items()))
    data["wall_s"] = time.perf_counter() - t_all
    body_md = "\n\n".join(body)
    print("\n" + body_md)
    path = C.write_results(
        "zero", "ZeRO-1 / data parallel: memory, communication, overlap, vs DDP", body_md, data, quick=args.quick
    )
    print(f"\nwrote {path} ({data['wall_s']:.0f}s)")


if __name__ == "__main__":
    sys.exit(main())
