"""Regenerate the performance tables of README.md and benchmarks/README.md from benchmarks/results/*.json.

Only the results files are read; nothing is measured and no figure is typed in by hand. Each table lives
between marker comments and is replaced as a whole: `perf` in README.md (the performance table);
`summary` (the same table and an index of every results file) and one `copy:<name>` block per results
file in benchmarks/README.md (results/<name>.md's tables under a heading saying when, and at which
commit, they were recorded).

Every results file records the git commit it was measured at (benchmarks/_common.env_info). A row is
"current" when `git diff --stat <commit> HEAD -- hf3d` is empty and no uncommitted hf3d/ change was
recorded at measurement; otherwise it is marked STALE (hf3d/ changed since), UNCOMMITTED (measured on
hf3d/ changes that are in no commit) or UNKNOWN (commit not in this repository). Marked rows are kept,
not hidden.

    python benchmarks/report.py            # rewrite the marked blocks
    python benchmarks/report.py --check    # exit 1 if a block is out of date with the results files
    python benchmarks/report.py --strict   # exit 2 (writing nothing) if a row the README uses is not current
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"


# -- staleness ----------------------------------------------------------------------------------------
def status(env: dict, repo: Path = REPO) -> tuple[str, str]:
    """(state, note): state is current | STALE | UNCOMMITTED | UNKNOWN."""
    commit = env.get("git_commit")
    if not commit:
        return "UNKNOWN", "no commit recorded"
    diff = subprocess.run(
        ["git", "diff", "--stat", commit, "HEAD", "--", "hf3d"], cwd=repo, capture_output=True, text=True
    )
    if diff.returncode != 0:
        return "UNKNOWN", f"commit {commit} is not in this repository"
    if diff.stdout.strip():
        files = len(diff.stdout.strip().splitlines()) - 1
        return "STALE", f"hf3d/ changed since {commit} ({files} file{'s' * (files != 1)})"
    dirty = env.get("hf3d_uncommitted_at_start") or env.get("hf3d_uncommitted_at_end")
    if dirty:
        return "UNCOMMITTED", f"measured at {commit} with uncommitted hf3d/ changes"
    return "current", commit


def load(name: str, results: Path) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- rows of the README table: (results file, what, command, extractor -> result text) -----------------
def _verdict(ratio: float, target: float) -> str:
    return f"target ≤ {target}x: {'met' if ratio <= target else 'missed'}"


def _step_memory(d: dict) -> str:
    if "memory" not in d:
        return ""
    m = d["memory_ratio_hf3d_over_stock"]
    return f"; peak RSS over 3 steps, each side alone: {m:.3f}x ({_verdict(m, 1.0)})"


def _step_time(d: dict) -> str:
    r = d["result"]["wall"]
    s = d["samples"]
    dl = abs(s["hf3d"][0]["loss"] - s["stock"][0]["loss"])
    out = (
        f"{d['n_params'] / 1e6:.1f}M params: {r['ratio_hf3d_over_stock']:.3f}x median step time "
        f"({_verdict(r['ratio_hf3d_over_stock'], 0.95)}), {r['ratio_of_minima']:.3f}x fastest steps "
        f"({d['args']['repeats']} interleaved rounds, {d['env'].get('torch_threads')} threads)"
    )
    if "ratio_hf3d_plain_over_stock" in r:
        out += f"; with the plain (unfused) output head {r['ratio_hf3d_plain_over_stock']:.3f}x"
    return out + _step_memory(d) + f"; first timed step's losses differ by {dl:.1e}"


def _step_time_1(d: dict) -> str:
    r = d["result"]["wall"]
    rounds = d["args"]["repeats"]
    out = (
        f"{r['ratio_hf3d_over_stock']:.3f}x median ({_verdict(r['ratio_hf3d_over_stock'], 0.95)}), "
        f"{r['ratio_of_minima']:.3f}x fastest steps ({rounds} rounds)"
    )
    if "ratio_hf3d_plain_over_stock" in r:
        out += f"; plain output head {r['ratio_hf3d_plain_over_stock']:.3f}x"
    return out + _step_memory(d)


def _step_time_compile(d: dict) -> str:
    r, first = d["ratio_compiled_over_eager"], d["first"]
    return (
        f"{d['n_params'] / 1e6:.1f}M params: compiled / eager {r['wall']:.3f}x median step time, "
        f"{d['ratio_of_minima']:.3f}x fastest steps, forward+backward {r['fwd_bwd_wall']:.3f}x "
        f"({d['args']['repeats']} rounds, {d['env'].get('torch_threads')} threads); first step (the compile) "
        f"{first['hf3d_compiled']['wall']:.0f} s; first-step losses differ by "
        f"{abs(first['hf3d_compiled']['loss'] - first['hf3d']['loss']):.1e}"
    )


def _load_memory(d: dict) -> str:
    s = d["summary"]
    use = s["bf16"]["metrics"]["peak RSS, load + first use (VmHWM)"]["ratio_above_baseline_B_worst_rank"]
    anon = s["bf16"]["metrics"]["private RSS after first use (RssAnon)"]["ratio_above_baseline_B_worst_rank"]
    load = s["bf16"]["metrics"]["peak RSS during load (VmHWM)"]
    only = load["ratio_above_baseline_B_worst_rank"]
    worst = "hf3d worst of 3 ranks"
    own = (load["values"][worst] - load["baseline"]) / s["bf16"]["param_bytes"][worst]
    out = (
        f"{use:.2f}x over load + first use (bf16), {anon:.2f}x private memory; load-only peak {only:.2f}x "
        "(missed: stock keeps same-dtype weights as untouched mmap views until first use), which is "
        f"{own:.2f}x the rank's own parameter bytes"
    )
    if "fp32" in s:
        fp32 = s["fp32"]["metrics"]["peak RSS during load (VmHWM)"]["ratio_above_baseline_B_worst_rank"]
        out += f"; {fp32:.2f}x (bf16 → fp32)"
    fit = d.get("scale_fit")
    if fit:  # the same load-only peak at larger shards (results files before it have none)
        target = fit["target"]
        larger = ", ".join(
            f"{p['name']} tp={p['tp']} {p['ratio']:.3f}x ({'met' if p['ratio'] <= target else 'missed'})"
            for p in fit["points"][1:]
        )
        out += (
            f"; against own bytes at larger shards: {larger} (a fixed {fit['fixed'] / 2**20:.1f} MiB + "
            f"{fit['per_byte']:.3f}x per byte)"
        )
    return out


def _zero_a(d: dict) -> str:
    cells = []
    for mesh, v in d["a"].items():
        w = v["worst_rank"]
        dp = int(mesh.strip("()").split(",")[2])
        cells.append(
            f"{mesh.replace(' ', '')} {w['memory']['total'] / w['local_params']:.2f} (6 + 12/dp = {6 + 12 / dp:.2f})"
        )
    return (
        "bytes per local parameter: "
        + "; ".join(cells)
        + " — hf3d's own count (`opt.memory_report()`), true by construction"
    )


def _zero_b(d: dict) -> str:
    out = []
    for key, label in (
        ("(1,1,4) bf16 zero1-all_to_all", "all_to_all (gloo's default)"),
        ("(1,1,4) bf16 zero1-reduce_scatter", "reduce_scatter"),
        ("(1,1,4) bf16 zero1-all_reduce", "all_reduce"),
    ):
        if key in d["b"]:
            out.append(f"{label} {d['b'][key]['ratio_to_min']:.2f}x")
    return (
        "dp=4, bf16 params: "
        + ", ".join(out)
        + " of 2(dp−1)/dp × fp32 grad bytes (counted collectives; ZeRO-1 gathers bf16 params after reducing "
        "fp32 grads, hence below 1; all_reduce also gathers by an all-reduce, twice an all-gather's bytes)"
    )


def _zero_d(d: dict) -> str:
    t, m = d["d"]["throughput"]["tokens_per_s"], d["d"]["memory"]
    tok, mem = t["hf3d"] / t["ddp"], m["hf3d"]["peak_above"] / m["ddp"]["peak_above"]
    return (
        f"tokens/s {tok:.2f}x (target ≥ 1.0x: {'met' if tok >= 1.0 else 'missed'}), peak RSS above baseline "
        f"{mem:.2f}x ({_verdict(mem, 0.85)})"
    )


def _tp(d: dict) -> str:
    t, m = d["throughput"], d["memory"]
    step, mem = t["ratio_hf3d_over_transformers"], m["hf3d"]["peak_above"] / m["transformers"]["peak_above"]
    return (
        f"step time {step:.2f}x median ({_verdict(step, 0.7)}), {t['ratio_of_fastest']:.2f}x fastest steps, "
        f"tokens/s {t['tokens_per_s_ratio']:.2f}x; peak RSS above baseline {mem:.2f}x ({_verdict(mem, 0.85)}); "
        f"first-step losses differ by {d['first_step']['loss_rel_diff']:.1e} (relative)"
    )


def _pipeline(d: dict) -> str:
    parts = []
    for r in d["results"]:
        if r["schedule"] in ("afab", "1f1b") and r["m"] == max(x["m"] for x in d["results"]):
            parts.append(f"{r['schedule']} (m={r['m']}) {'/'.join(map(str, r['max_live_per_rank']))}")
    return "max live micro-batches per rank: " + "; ".join(parts)


def _memory_model(d: dict) -> str:
    errs = [(tuple(r["mesh"]), r["error"]) for r in d["rows"]]
    worst = max(errs, key=lambda e: abs(e[1]))
    miss = [e for e in errs if abs(e[1]) > 0.10]
    comm = [
        abs(x["sent_predicted"][k] - x["sent_measured"][k])
        for r in d["rows"]
        for x in r.get("ranks", [])
        for k in ("tp", "pp", "dp")
    ]
    sent = (
        "tp/pp/dp bytes sent equal the counted ones"
        if max(comm, default=0) <= 64
        else f"bytes sent differ from the counted ones by up to {max(comm) / 2**20:.2f} MiB"
    )
    listed = f" ({', '.join(str(m[0]) for m in miss)})" if miss else ""
    return (
        f"predicted / measured peak RSS per rank at {len(errs)} meshes: worst {worst[1]:+.1%} at {worst[0]}; "
        f"{len(miss)} outside ±10 %{listed}" + (f"; {sent}" if comm else "")
    )


def _scaling(d: dict) -> str:
    s = d["slopes"]
    n = [r["params"] for r in d["sizes"]]
    parts = [f"N = {min(n) / 1e6:.0f}–{max(n) / 1e6:.0f}M params"]
    parts += [
        f"{k}=2: tokens/s ∝ N^{v['tokens_per_s']:.2f}, peak memory ∝ N^{v['peak_memory']:.2f}" for k, v in s.items()
    ]
    dps = {r["dp"]: r for r in d["dp"]}
    if len(dps) > 1:
        top = dps[max(dps)]
        cores = d["env"].get("cpu_count", "?")
        parts.append(
            f"dp={top['dp']} weak-scaling efficiency {top['efficiency']:.2f} "
            f"({top['efficiency_per_core']:.2f} per core; {cores} cores)"
        )
        if "noop" in top:
            share = (top["real"]["step_s"] - top["noop"]["step_s"]) / top["real"]["step_s"]
            parts.append(f"dp communication {share:.0%} of the step")
    return "; ".join(parts)


def _convert(d: dict) -> str:
    dts = [dt for dt in ("bf16", "fp32") if dt in d]
    s = {dt: d[dt]["summary"] for dt in dts}

    def per_dtype(value: Callable[[str], float], unit: str = "") -> str:
        return ", ".join(f"{dt} {value(dt):.2f}{unit}" for dt in dts)

    def in_largest(side: str) -> Callable[[str], float]:
        return lambda dt: s[dt]["medians"][side]["extra_peak"] / d[dt]["largest_tensor_bytes"]

    met = all(s[dt]["to_hf_time_target_met"] for dt in dts)
    from_hf_target = ""
    if all("from_hf_fsync_time_vs_raw_fsync" in s[dt] for dt in dts):  # results before the --fsync side lack it
        met_from = all(s[dt]["from_hf_time_target_met"] for dt in dts)
        from_hf_target = (
            f" (target ≤ 2x raw: {'met' if met_from else 'missed'}; with --fsync, against raw + fsync: "
            f"{per_dtype(lambda dt: s[dt]['from_hf_fsync_time_vs_raw_fsync'], 'x')})"
        )
    same = all(d[dt]["to_hf_bit_identical_to_source"] for dt in dts)
    return (
        f"time / raw: to-hf {per_dtype(lambda dt: s[dt]['to_hf_time_vs_raw'], 'x')} "
        f"(target ≤ 2x raw: {'met' if met else 'missed'}); "
        f"from-hf {per_dtype(lambda dt: s[dt]['from_hf_time_vs_raw'], 'x')}{from_hf_target}; "
        f"to-hf extra peak memory {per_dtype(in_largest('to-hf'))} largest tensors "
        f"(raw: {per_dtype(in_largest('raw'))}: the whole model); "
        f"to-hf output bit-identical to the source: {same}"
    )


def _checkpoint(d: dict) -> str:
    parts = []
    for mesh, modes in d["meshes"].items():
        if "slowest" in modes:  # results from before checkpoint.async: one synchronous row per mesh
            modes = {"sync": modes}
        for mode, m in modes.items():
            t = m["slowest"]
            stall = m.get("stall_s", t["save"]) / m["step_s"]
            if mode == "raw-async":
                parts.append(f"{mesh} raw async write of the same bytes (reference): stall {stall:.2f} steps")
                continue
            target = f" (target ≤ 0.1: {'met' if stall <= 0.1 else 'missed'})" if mode == "async" else ""
            if mode == "async" and m.get("steady_steps") is not None:
                steady = m["steady_steps"]
                target += f", from the 3rd save {steady:.2f} ({'met' if steady <= 0.1 else 'missed'})"
            parts.append(
                f"{mesh} {mode}: the step waits {t['save']:.2f} s, stall {stall:.2f} steps{target}; "
                f"load {t['load'] / t['raw_read']:.2f}x raw read; restored exactly: {m['restored']}"
            )
    return f"{d['params'] / 1e6:.1f}M params, fp32 + AdamW, 2 processes (slowest rank). " + "; ".join(parts)


def _init_memory(d: dict) -> str:
    ratio = d["summary"]["peak_above"]["ratio_worst"]
    stock = d["runs"]["stock"][0][0]
    exact = stock["export_keys_match"] and not stock["export_tensors_differing"]
    return (
        f"{ratio:.2f}x, worst of {d['tp']} ranks "
        f"(target ≤ 0.6x: {'met' if ratio <= 0.6 else 'missed'}); "
        f"export equals stock from_config tensor by tensor: {exact}"
    )


def _recompute(d: dict) -> str:
    s = d["summary"]
    fastest = [s[m]["train_step_time_ratio_of_minima"] for m in ("every_2", "full")]
    return (
        f"{d['shape']['num_hidden_layers']} layers, {d['args']['rows']} x {d['args']['seq']} tokens: peak RSS of "
        f"forward + backward above rest every_2 {s['every_2']['memory_ratio']:.2f}x, full "
        f"{s['full']['memory_ratio']:.2f}x of none (−{s['full']['saved_bytes'] / 2**20:.0f} MiB); train_step time "
        f"{s['every_2']['train_step_time_ratio']:.2f}x, {s['full']['train_step_time_ratio']:.2f}x (fastest steps "
        f"{fastest[0]:.2f}x, {fastest[1]:.2f}x); "
        f"losses equal: {d['losses_equal']}"
    )


def _cp(d: dict) -> str:
    s = d["summary"]
    met = {cp: "met" if s[cp]["saved_ratio"] <= t else "missed" for cp, t in (("2", 0.55), ("4", 0.3))}
    return (
        f"{d['shape']['num_hidden_layers']} layers, 1 x {d['args']['seq']} tokens: activation memory per rank "
        f"(saved for backward) cp=2 {s['2']['saved_ratio']:.2f}x (target ≤ 0.55x: {met['2']}), cp=4 "
        f"{s['4']['saved_ratio']:.2f}x (target ≤ 0.3x: {met['4']}) of cp=1; peak RSS above rest "
        f"{s['2']['rss_ratio']:.2f}x, {s['4']['rss_ratio']:.2f}x; train_step time cp=2 "
        f"{s['2']['step_time_ratio']:.2f}x of cp=1 (same tokens, 2 processes vs 1); K/V received per rank "
        f"{s['2']['kv_bytes_per_rank'] / 2**20:.1f} MiB (cp=2), {s['4']['kv_bytes_per_rank'] / 2**20:.1f} MiB "
        f"(cp=4) per step, as counted = expected: "
        f"{all(v['kv_bytes_per_rank'] == v['kv_bytes_expected'] for v in s.values())}"
    )


def _moe(d: dict) -> str:
    r = d["ratios"]
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    two = d["two"]
    a2a = max(x.get("a2a_bytes_per_step", 0) for x in two["hf3d ep=2"]) / 2**20
    return (
        f"{d['shape']['num_experts']} experts, top-{d['shape']['num_experts_per_tok']}: hf3d ep=1 step time "
        f"{r['step_vs_grouped_mm']:.2f}x stock grouped_mm (target ≤ 0.9x: {met(r['step_vs_grouped_mm'] <= 0.9)}), "
        f"{r['step_vs_eager']:.2f}x stock's eager loop; at ep=2 (2 processes) expert parameters + optimizer state "
        f"per rank {r['expert_bytes_ep2_vs_ep1']:.2f}x of one-process ep=1 (target ≤ 0.55x: "
        f"{met(r['expert_bytes_ep2_vs_ep1'] <= 0.55)}), all-to-all {a2a:.2f} MiB received per rank and step"
    )


def _moe_balance(d: dict) -> str:
    s = d["summary"]
    parts = [
        f"{name} {v['imbalance_first']:.2f} → {v['imbalance_last_quarter_mean']:.2f} "
        f"(loss {v['loss_last_quarter_mean']:.2f})"
        for name, v in s.items()
    ]
    dropped = sum(v["dropped_tokens"] for v in s.values())
    return (
        f"{d['steps']} steps of the tiny Qwen3-MoE example at ep=2; max/mean expert load, step 1 → mean of the last "
        f"quarter: {'; '.join(parts)}; dropped tokens {dropped}; curves in results/moe_balance.png"
    )


def _fp8(d: dict) -> str:
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    runs = d["runs"]
    base = runs["bf16"]
    parts = [
        f"{name} {r['final_loss']:.3f} = {r['loss_vs_bf16']:.4f}x (target within 2 %: {met(r['meets_target'])}), "
        f"step time {r['median_step_s'] / base['median_step_s']:.2f}x"
        for name, r in runs.items()
        if name != "bf16"
    ]
    return (
        f"200-step default run, tp=2, final loss (mean of the last 10 steps): bf16 {base['final_loss']:.3f}; "
        + "; ".join(parts)
        + " (CPU: no fp8 tensor cores, the step time is not a target"
        + ("; fp8 matmuls emulated, `--emulate`" if d.get("emulate") else "")
        + "); curves in results/fp8_loss_curves.png"
    )


def _default_run(d: dict) -> str:
    evals = d["eval_losses"]
    return (
        f"{d['steps']} steps, {d['tokens']:,} tokens in {d['wall_s']:.0f} s wall on 2 processes (tp=2); loss "
        f"{d['first_loss']:.2f} → {d['last_loss']:.2f}, eval loss {evals[0][1]:.2f} (step {evals[0][0]}) → "
        f"{evals[-1][1]:.2f} (step {evals[-1][0]}); checkpoints {', '.join(d['checkpoints'])}"
    )


def default_run_block(results: Path = RESULTS) -> str:
    """The quick start's paragraph on what the main command did when it was last run."""
    d = load("default_run", results)
    if d is None:
        return "(not measured yet: `python benchmarks/bench_default_run.py`)"
    state, note = status(d["env"])
    sample = d["sample"].replace("\n", " ").strip()
    return (
        f"Measured by `python benchmarks/bench_default_run.py` ({_cell(state, note, d['env']['date_utc'])}): "
        f"{_default_run(d)}. Its loss curve (`outputs/tiny-smollm/loss_curve.png`, train and eval):\n\n"
        f"![loss curve of the default run](benchmarks/results/default_run_loss_curve.png)\n\n"
        f"and the sample it wrote (`outputs/tiny-smollm/sample.txt`, from the exported model): "
        f"`{sample[:160]}`"
    )


def _gpu(d: dict) -> str:
    rows = {r["name"]: r for r in d.get("rows", []) if r.get("tokens_per_s")}
    return f"{d['env'].get('gpu')}, seq {d['args']['seq']}: " + "; ".join(
        f"{n}: {r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu']:.1%}" for n, r in rows.items() if r.get("mfu")
    )


def _gpu_switches(d: dict) -> str:
    parts, out = d["parts"], []
    for name, part in parts.items():
        if "result" not in part:
            out.append(f"{name}: {part.get('skipped') or part.get('error', '?')[:120]}")
            continue
        r = part["result"]
        if name == "fp8 parity":
            out += [
                f"FP8 {recipe} vs torchao on stock, 3 steps: losses within {v['loss_rel']:.1e}, "
                f"weights {v['weight_max_abs']:.1e}{', head in fp8' if v['head_fp8'] else ''}"
                if "error" not in v
                else f"FP8 {recipe}: {v['error'][:120]}"
                for recipe, v in r.items()
            ]
        elif name == "compile parity":
            out.append(f"compiled vs eager losses within {r['loss_rel']:.1e}")
        elif name == "async checkpoint":
            out.append(
                f"stall per save sync {r['sync_median_steps']:.2f}, async {r['async_median_steps']:.2f} steps, "
                f"restored exactly: {r['restored_exactly']}"
            )
        elif name == "fp8 speed":
            out += [f"{n} {v['vs_bf16_eager']:.2f}x" for n, v in r["rows"].items() if "vs_bf16_eager" in v]
    return f"{d['env'].get('gpu')}, torch {d['env'].get('torch')}: " + "; ".join(out)


Row = tuple[str, str, str, Callable[[dict], str]]
ROWS: list[Row] = [
    (
        "default_run",
        "the README's main command (the embedded default run), 2-core CPU",
        "python benchmarks/bench_default_run.py",
        _default_run,
    ),
    (
        "step_time",
        "step time and peak RSS, hf3d tp=pp=dp=1 / stock transformers + AdamW (Llama, fp32)",
        "python benchmarks/bench_step_time.py",
        _step_time,
    ),
    (
        "step_time_threads1",
        "the same with one thread",
        "python benchmarks/bench_step_time.py --threads 1",
        _step_time_1,
    ),
    (
        "step_time_compile",
        "compiled decoder layers (`parallel.compile`) / eager, hf3d tp=pp=dp=1 (Llama, fp32, inductor on CPU)",
        "python benchmarks/bench_step_time.py --compile",
        _step_time_compile,
    ),
    (
        "load_memory",
        "peak RSS of one tp=3 rank loading a SmolLM2-135M-shaped checkpoint / stock full load (above a baseline)",
        "python benchmarks/bench_load_memory.py",
        _load_memory,
    ),
    (
        "init_memory",
        "peak RSS of one tp=3 rank initialising SmolLM2-135M from its config / stock `from_config` "
        "(above each process's own baseline)",
        "python benchmarks/bench_init_memory.py",
        _init_memory,
    ),
    ("zero", "ZeRO-1 training state per rank, bf16 params", "python benchmarks/bench_zero.py", _zero_a),
    ("zero", "gradient bytes sent per dp rank", "python benchmarks/bench_zero.py --parts b", _zero_b),
    (
        "zero",
        "hf3d dp=2 / accelerate DDP on the same 2-process job",
        "python benchmarks/bench_zero.py --parts d",
        _zero_d,
    ),
    (
        "tp",
        "hf3d tp=2 / transformers' own tensor parallelism (`DistributedConfig(tp_size=2)`) on the same "
        "2-process job (Llama, fp32)",
        "python benchmarks/bench_tp.py",
        _tp,
    ),
    ("pipeline", "live micro-batches per pipeline rank at pp=4", "python benchmarks/bench_pipeline.py", _pipeline),
    (
        "memory_model",
        "memory model (benchmarks/memory_model.py) vs measured RSS",
        "python benchmarks/bench_memory_model.py",
        _memory_model,
    ),
    (
        "scaling",
        "scaling with model size at tp=2 / pp=2, and over dp (weak scaling)",
        "python benchmarks/bench_scaling.py",
        _scaling,
    ),
    (
        "convert",
        "checkpoint → HF conversion (`hf3d convert to-hf`) and HF → checkpoint, SmolLM2-135M shape, "
        "vs a plain safetensors `load_file` + `save_file` of the same bytes",
        "python benchmarks/bench_convert.py",
        _convert,
    ),
    (
        "checkpoint",
        "training checkpoint: the stall per save, synchronous and `checkpoint.async`; load vs a raw read; per mesh",
        "python benchmarks/bench_checkpoint.py",
        _checkpoint,
    ),
    (
        "recompute",
        "activation recompute (`ParallelConfig.recompute`) / none, SmolLM2-135M shape cut to a few layers, "
        "fp32, one process",
        "python benchmarks/bench_recompute.py",
        _recompute,
    ),
    (
        "cp",
        "context parallelism (`ParallelConfig(cp=...)`) / cp=1, SmolLM2-135M shape cut to 2 layers, fp32, "
        "seq 8192, one process per cp rank",
        "python benchmarks/bench_cp.py",
        _cp,
    ),
    (
        "moe",
        "mixture of experts (Qwen3-MoE, fp32): hf3d / stock transformers + AdamW on one process, and expert "
        "parallelism on two",
        "python benchmarks/bench_moe.py",
        _moe,
    ),
    (
        "moe_balance",
        "expert load balance over a run (`moe.load_balance`: aux_loss, bias, none)",
        "python benchmarks/bench_moe_balance.py",
        _moe_balance,
    ),
    (
        "fp8",
        "FP8 training (`precision.fp8`, torchao recipes) / bf16 on the embedded default run",
        "python benchmarks/bench_fp8.py",
        _fp8,
    ),
    (
        "gpu_smollm",
        "SmolLM2-360M shape on one GPU, bf16 (hf3d and stock rows)",
        "python benchmarks/gpu_smollm.py",
        _gpu,
    ),
    (
        "gpu_switches",
        "FP8, compiled layers and async checkpoints on one GPU (step time of each row / bf16 eager)",
        "python benchmarks/gpu_switches.py",
        _gpu_switches,
    ),
]
GPU_ONLY = ("gpu_smollm", "gpu_switches")  # measured only where a GPU is lent


def _cell(state: str, note: str, date: str) -> str:
    tag = f"{note}, {date[:10]}" if state == "current" else f"**{state}**: {note}, {date[:10]}"
    return tag


def perf_table(results: Path = RESULTS) -> tuple[str, list[str]]:
    """The README table and the names of the results files it uses that are not current."""
    lines = ["| what | result | command | measured at |", "| --- | --- | --- | --- |"]
    not_current = []
    for name, what, cmd, fn in ROWS:
        d = load(name, results)
        if d is None:
            if name in GPU_ONLY:
                continue
            lines.append(f"| {what} | no `results/{name}.json` yet | `{cmd}` | — |")
            continue
        state, note = status(d.get("env", {}))
        try:
            text = fn(d)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            text = f"unreadable `results/{name}.json` ({type(e).__name__}: {e})"
        if state != "current":
            not_current.append(name)
        lines.append(f"| {what} | {text} | `{cmd}` | {_cell(state, note, d['env'].get('date_utc', '?'))} |")
    return "\n".join(lines), sorted(set(not_current))


def results_index(results: Path = RESULTS) -> str:
    lines = [
        "| results file | recorded (UTC) | commit | state | load avg start → end |",
        "| --- | --- | --- | --- | --- |",
    ]
    for path in sorted(results.glob("*.json")):
        try:
            env = json.loads(path.read_text()).get("env", {})
        except json.JSONDecodeError:
            lines.append(f"| `{path.name}` | unreadable | | | |")
            continue
        state, note = status(env)
        load_avg = f"{env.get('load_avg_1m_at_start', '?')} → {env.get('load_avg_1m_at_end', '?')}"
        lines.append(
            f"| `{path.name}` | {env.get('date_utc', '?')} | {env.get('git_commit', '?')} | "
            f"{state if state == 'current' else f'**{state}**: {note}'} | {load_avg} |"
        )
    return "\n".join(lines)


COMMANDS = {name: cmd for name, _, cmd, _ in ROWS}


def copy_block(name: str, results: Path = RESULTS) -> str:
    """results/<name>.md as a README section: a heading with its command, when and at which commit it was
    recorded (and its state), then the body, headings demoted so that the shallowest is level 4."""
    md, d = results / f"{name}.md", load(name, results)
    if d is None or not md.exists():
        return (
            f"### results/{name}.md\n\nNot measured yet: `{COMMANDS.get(name, f'python benchmarks/bench_{name}.py')}`."
        )
    lines = md.read_text().split("\n<details>")[0].splitlines()
    title = lines[0].lstrip("# ").strip()
    cmd = next((m.group(1) for line in lines if (m := re.match(r"Command: `([^`]*)`", line))), COMMANDS.get(name, ""))
    env_at = next((i for i, line in enumerate(lines) if line.startswith("Environment: ")), 0)
    body = lines[env_at + 1 :]
    levels = [len(line) - len(line.lstrip("#")) for line in body if re.match(r"#+ ", line)]
    shift = max(0, 4 - min(levels)) if levels else 0
    body = ["#" * shift + line if re.match(r"#+ ", line) else line for line in body]
    env = d.get("env", {})
    state, note = status(env)
    where = note if state == "current" else f"**{state}**: {note}"
    head = (
        f"### {title} — `{cmd}` (results/{name}.md)\n\n"
        f"Recorded {env.get('date_utc', '?')} UTC ({where}), load average {env.get('load_avg_1m_at_start', '?')} → "
        f"{env.get('load_avg_1m_at_end', '?')} on {env.get('cpu_count', '?')} cores."
    )
    return head + "\n\n" + "\n".join(body).strip()


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {name}:start --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text, count=1)


def render(results: Path = RESULTS) -> tuple[dict[Path, str], list[str]]:
    """{file: new text} for both READMEs, and the results files the README table uses that are not current."""
    table, not_current = perf_table(results)
    readme, bench_readme = REPO / "README.md", BENCH_DIR / "README.md"
    text = replace_block(readme.read_text(), "perf", table)
    out = {readme: replace_block(text, "default-run", default_run_block(results))}
    text = bench_readme.read_text()
    text = replace_block(text, "summary", table + "\n\nEvery results file:\n\n" + results_index(results))
    for name in re.findall(r"<!-- copy:(\w+):start -->", text):
        text = replace_block(text, f"copy:{name}", copy_block(name, results))
    out[bench_readme] = text
    return out, not_current


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block differs from the results")
    ap.add_argument(
        "--strict", action="store_true", help="exit 2, writing nothing, if a used results file is not current"
    )
    args = ap.parse_args(argv)
    texts, not_current = render()
    if not_current:
        print(f"not current (marked in the table): {', '.join(not_current)}", file=sys.stderr)
        if args.strict:
            return 2
    changed = [p for p, t in texts.items() if p.read_text() != t]
    if args.check:
        for p in changed:
            print(f"out of date: {p.relative_to(REPO)}", file=sys.stderr)
        return 1 if changed else 0
    for p in changed:
        p.write_text(texts[p])
        print(f"rewrote {p.relative_to(REPO)}")
    if not changed:
        print("up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
