"""The benchmarks' runner: runs them, then writes the performance tables of docs/performance.md and benchmarks/README.md
from benchmarks/results/*.json (nothing in a table is typed by hand).

    python benchmarks/run.py                      # every benchmark, its command, and the state of its results
    python benchmarks/run.py step_time convert    # run these at full size, one after another, then the tables
    python benchmarks/run.py --all                # every CPU benchmark (about 30 min on 2 cores), then the tables
    python benchmarks/run.py --quick step_time    # smoke sizes into results/quick/; no table is touched
    python benchmarks/run.py --report             # the tables only (--check: exit 1 if one is out of date;
                                                  #   --strict: exit 2, writing nothing, if a row is not current)

The tables live between marker comments and are replaced whole: `perf` in docs/performance.md, `default-run` (the
quick start's measured run) in README.md, `results` in benchmarks/README.md. Every results file records the git
commit it measured (the `env` block; HF3D_BENCH_COMMIT names it for a tree copied without .git). A row is current
when `git diff <commit> HEAD -- hf3d` is empty and no uncommitted hf3d/ change was recorded at measurement;
otherwise it is marked STALE (hf3d/ changed since), UNCOMMITTED (measured on changes in no commit) or UNKNOWN
(commit not in this repository).
Marked rows, rows that miss their target and benchmarks not measured yet are shown, never left out.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"


def met(ok: bool) -> str:
    return "met" if ok else "missed"


# -- one line of results per results file ---------------------------------------------------------
def _default_run(d: dict) -> str:
    evals, scores = d["eval_losses"], d.get("downstream_acc_norm") or []
    out = (
        f"{d['steps']} steps, {d['tokens']:,} tokens in {d['wall_s']:.0f} s wall on 2 processes (tp=2); loss "
        f"{d['first_loss']:.2f} → {d['last_loss']:.2f}, eval loss {evals[0][1]:.2f} (step {evals[0][0]}) → "
        f"{evals[-1][1]:.2f} (step {evals[-1][0]})"
    )
    if scores:
        (first, a), (last, b) = scores[0], scores[-1]
        tasks = ", ".join(f"{t} {a[t]:.3f} → {b[t]:.3f}" for t in b if t != "average")
        out += (
            f", downstream acc_norm {tasks} (average {a['average']:.3f} → {b['average']:.3f}, steps {first} → {last})"
        )
    return out + f"; checkpoints {', '.join(d['checkpoints'])}"


def _step_time(d: dict) -> str:
    r, mem = d["result"]["wall"], d["memory_ratio_hf3d_over_stock"]
    out = (
        f"{d['n_params'] / 1e6:.1f}M params: {r['ratio_hf3d_over_stock']:.3f}x median step time (target ≤ 0.95x: "
        f"{met(r['ratio_hf3d_over_stock'] <= 0.95)}), {r['ratio_of_minima']:.3f}x fastest steps "
        f"({d['args']['repeats']} rounds, {d['env'].get('torch_threads')} threads); peak RSS {mem:.3f}x "
        f"(target ≤ 1.0x: {met(mem <= 1.0)})"
    )
    if "ratio_compiled_over_eager" in r:
        out += (
            f"; hf3d compiled / eager {r['ratio_compiled_over_eager']:.3f}x median step time, first step (the "
            f"compile) {d['first']['hf3d compiled']['wall']:.0f} s"
        )
    return out


def _load_memory(d: dict) -> str:
    parts = []
    for dt, s in d["summary"].items():
        use = s["peak RSS, load + first use (VmHWM)"]["ratio"]
        own = s["load_peak_over_own_bytes"]
        parts.append(
            f"{dt}: load + first use {use:.2f}x stock (target ≤ 0.6x: {met(use <= 0.6)}), private memory "
            f"{s['private RSS after first use (RssAnon)']['ratio']:.2f}x; load-only peak {own:.3f}x the rank's own "
            f"parameter bytes (target ≤ 1.05x: {met(own <= 1.05)})"
        )
    return "; ".join(parts)


def _init_memory(d: dict) -> str:
    ratio = d["summary"]["peak_above"]["ratio_worst"]
    return (
        f"{ratio:.2f}x, worst of {d['tp']} ranks (target ≤ 0.6x: {met(ratio <= 0.6)}); export equals stock "
        f"from_config tensor by tensor: {d['export_equal']}"
    )


def _convert(d: dict) -> str:
    dts = [dt for dt in ("bf16", "fp32") if dt in d]
    s = {dt: d[dt]["summary"] for dt in dts}

    def each(key: str, unit: str = "x") -> str:
        return ", ".join(f"{dt} {s[dt][key]:.2f}{unit}" for dt in dts)

    ok = {k: all(s[dt][k] <= t for dt in dts) for k, t in (("to_hf_time_vs_raw", 2), ("from_hf_time_vs_raw", 2))}
    mem = "to_hf_extra_mem_above_raw_in_largest_tensors"
    return (
        f"time / raw: to-hf {each('to_hf_time_vs_raw')} (target ≤ 2x: {met(ok['to_hf_time_vs_raw'])}); from-hf "
        f"{each('from_hf_time_vs_raw')} (target ≤ 2x: {met(ok['from_hf_time_vs_raw'])}), with --fsync against raw + "
        f"fsync {each('from_hf_fsync_time_vs_raw_fsync')}; to-hf extra peak memory above raw {each(mem, '')} "
        f"largest tensors (target ≤ +1: {met(all(s[dt][mem] <= 1 for dt in dts))}); to-hf output bit-identical "
        f"to the source: {all(d[dt]['to_hf_bit_identical_to_source'] for dt in dts)}"
    )


def _checkpoint(d: dict) -> str:
    parts = []
    for mesh, modes in d["meshes"].items():
        for mode, m in modes.items():
            t = m["slowest"]
            target = f" (target ≤ 0.1: {met(m['stall_steps'] <= 0.1)})" if mode != "sync" else ""
            if mode != "sync" and m.get("steady_steps") is not None:
                target += f", from the 3rd save {m['steady_steps']:.2f} ({met(m['steady_steps'] <= 0.1)})"
            parts.append(
                f"{mesh} {mode}: stall {m['stall_steps']:.2f} steps{target}; save {t['save'] / t['raw_write']:.2f}x "
                f"a raw write, load {t['load'] / t['raw_read']:.2f}x a raw read; restored exactly: {m['restored']}"
            )
    return f"{d['params'] / 1e6:.1f}M params, fp32 + AdamW, 2 processes (slowest rank). " + "; ".join(parts)


def _eval(d: dict) -> str:
    parts = [f"{mesh} {m['ratio']:.2f}x (target ≤ 1.3x: {met(m['ratio'] <= 1.3)})" for mesh, m in d["meshes"].items()]
    m = next(iter(d["meshes"].values()))
    return (
        f"{d['params'] / 1e6:.1f}M params, the two shipped tasks: scoring / a plain forward of the same unpadded "
        f"tokens {', '.join(parts)}; shared contexts compute {m['tokens']:,} tokens where pairs would compute "
        f"{m['pair_tokens'] / m['tokens']:.2f}x as many; {1 - m['tokens'] / m['computed']:.1%} of the rows is padding"
    )


def _generate(d: dict) -> str:
    r = d["ratios"]
    return (
        f"greedy decoding, tp1: hf3d / stock generate {r['tp1_over_stock']:.3f}x per token (target ≤ 1.2x: "
        f"{met(r['tp1_over_stock'] <= 1.2)}); hidden 2048: tp2 / tp1 {r['tp2_over_tp1']:.3f}x (target < 1.0x: "
        f"{met(r['tp2_over_tp1'] < 1.0)}); prefill of a {d['rows']['prefill']['prompt']}-token prompt: cp2 / cp1 "
        f"{r['cp2_over_cp1_prefill']:.3f}x per token (target ≤ 1.0x: {met(r['cp2_over_cp1_prefill'] <= 1.0)})"
    )


def _gpu(d: dict) -> str:
    parts = [
        f"{r['what']} {r['ratio']:.3f}x (target ≥ {r['target']}x: {met(r['ratio'] >= r['target'])})"
        if "ratio" in r
        else f"{r['what']}: not measured"
        for r in d["ratios"]
    ]
    b = d["rows"].get("hf3d train 360M", {})
    if "saves" in b:
        stalls = [s["stall_steps"] for s in b["saves"]]
        beside = max(s["beside_worst"] for s in b["saves"])
        parts.append(
            f"(b) async save stalls {', '.join(f'{x:.2f}' for x in stalls)} steps (target ≤ 0.1: "
            f"{met(max(stalls) <= 0.1)}), worst step beside a write {beside:.2f}x steady (target ≤ 1.05x: "
            f"{met(beside <= 1.05)})"
        )
    mfu = d["rows"].get("1.7B hf3d compiled", {}).get("mfu")
    if mfu is not None:
        parts.append(f"1.7B hf3d MFU {mfu:.1%} (target ≥ 50 %: {met(mfu >= 0.5)})")
    return f"{d['env'].get('gpu')}, torch {d['env'].get('torch')}: " + "; ".join(parts)


def _mup(d: dict) -> str:
    parts = []
    if d.get("coord"):
        c = d["coord"]
        parts.append(
            f"coordinate check (widths {', '.join(map(str, d['config']['coord']['widths']))}): µP's per-layer "
            f"activation and update RMS spread {c['mup_max_spread']:.2f}x across widths (target ≤ 2x: "
            f"{met(c['mup_within_2x'])}); SP's logit RMS {c['standard_logit_growth']:.1f}x from narrowest to widest "
            f"after the steps ({c['standard_logit_growth_at_init']:.1f}x at step 0)"
        )
    if d.get("sweep"):
        s, (small, large) = d["sweep"], map(str, d["config"]["sweep"]["widths"])
        b, n = s["best"], len(d["config"]["sweep"]["seeds"])
        proxy = s["proxy_best"]
        parts.append(
            f"lr sweep ({n} seeds, lrs a factor {d['config']['sweep']['factor']:g} apart around the proxy's best: "
            f"SP {proxy['standard']['lr']:g}, µP {proxy['spectral_mup']['lr']:g} at output multiplier "
            f"{proxy['spectral_mup']['alpha']:g}): µP best lr {b['spectral_mup'][small][0]:g} at {small}, "
            f"{b['spectral_mup'][large][0]:g} at {large} (same: {met(s['mup_same_best_lr'])}; "
            f"{s['seeds_where_mup_keeps']} of {n} seeds), best loss {b['spectral_mup'][small][1]:.3f} → "
            f"{b['spectral_mup'][large][1]:.3f} (wider better: {met(s['mup_wider_is_better'])}; "
            f"{s['mup_wider_better_seeds']} of {n} seeds); SP best lr "
            f"{b['standard'][small][0]:g} → {b['standard'][large][0]:g} (moves: {met(s['standard_best_lr_moves'])}; "
            f"{s['seeds_where_standard_moves']} of {n} seeds)"
        )
    return "; ".join(parts)


def _sharding(d: dict) -> str:
    m, sp, z3 = d["memory"], d["speed"]["over_zero1"], d["memory"]["zero3_over_zero1"]
    return (
        f"{d['params'] / 1e6:.1f}M params, dp=4: ZeRO-3 / ZeRO-1 state {z3:.3f}x (arithmetic 0.4x; target ≤ 0.3x: "
        f"{met(z3 <= 0.3)}), at dp=8 {m['dp8_zero3_over_zero1']:.3f}x (arithmetic 2/9); ZeRO-2 peak gradients "
        f"{m['zero2_peak_gradients'] / 2**20:.1f} MiB, bound {m['zero2_bound'] / 2**20:.1f} "
        f"({met(m['zero2_peak_gradients'] <= m['zero2_bound'])}); ZeRO-3 peak weights "
        f"{m['zero3_peak_weights'] / 2**20:.1f} MiB, counted {m['zero3_counted_peak_weights'] / 2**20:.1f}; dp=2 step "
        f"over ZeRO-1: ZeRO-2 {sp['2']:.3f}x (≤ 1.1x: {met(sp['2'] <= 1.1)}), ZeRO-3 {sp['3']:.3f}x "
        f"(≤ 1.3x: {met(sp['3'] <= 1.3)})"
    )


def _restart(d: dict) -> str:
    return (
        f"{len(d['kills'])} kills of a worker (dp=2, a checkpoint every {d['args']['every']} steps): "
        f"{d['latency_s']:.1f} s from the kill to the next finished step (median), {d['steps_lost']:g} steps lost "
        f"(the steps since the newest checkpoint); start-up {d['startup_s']:.1f} s, steady step "
        f"{d['steady_step_s']:.3f} s"
    )


def _muon(d: dict) -> str:
    c, b = d["cost"], d["best"]

    def mib(mesh: str, side: str, *keys: str) -> float:  # the larger rank's
        return max(sum(m[k] for k in keys) for m in c[mesh][side]["memory"]) / 2**20

    def lrs(side: str) -> str:
        return ", ".join(f"{r['lr']:g}" for r in d["grid"][side])

    parts = [
        f"{mesh}: opt.step() Muon / AdamW {c[mesh]['muon_over_adamw']:.2f}x; collectives in it "
        f"{max(c[mesh]['muon']['step_bytes']) / 2**20:.1f} / {max(c[mesh]['adamw']['step_bytes']) / 2**20:.1f} MiB; "
        f"optimizer state + masters {mib(mesh, 'muon', 'optimizer_state', 'master_weights'):.0f} / "
        f"{mib(mesh, 'adamw', 'optimizer_state', 'master_weights'):.0f} MiB"
        for mesh in ("tp2", "dp2")
    ]
    sides = [k for k, v in c["tp2"].items() if isinstance(v, dict)]  # adamw, muon, and each at lower precision
    key = "optimizer_state"
    states = "; ".join(
        f"{mesh} optimizer state {' / '.join(f'{mib(mesh, s, key):.0f}' for s in sides)} MiB" for mesh in ("tp2", "dp2")
    )
    m, pair = d["mup"], d["mup"]["best"]
    widths = sorted(pair["adamw"], key=int)
    mup = "; ".join(
        f"{s} " + ", ".join(f"{w}: lr {pair[s][w][0]:g}, loss {pair[s][w][1]:.3f}" for w in widths) for s in pair
    )
    return (
        f"{c['params'] / 1e6:.1f}M params, per rank: {'; '.join(parts)}; {states} ({', '.join(sides)}). "
        f"The default run's held-out loss at step {b['muon']['eval_step']}: Muon {b['muon']['eval_loss']:.3f} (muon "
        f"lr {b['muon']['lr']:g}, of {lrs('muon')}), AdamW {b['adamw']['eval_loss']:.3f} (lr {b['adamw']['lr']:g}, "
        f"of {lrs('adamw')}): Muon − AdamW {d['muon_best_minus_adamw_best']:+.3f}. µP with Muon: coordinate check "
        f"spread {max(m['spread'].values()):.2f}x (target ≤ 2x: {'met' if max(m['spread'].values()) <= 2 else 'missed'}"
        f"); proxy pair, best lr and held-out loss per width: {mup}"
    )


def _plan(d: dict) -> str:
    w, rc = d["worst"], d["recompute"]
    ranks = sum(len(m["ranks"]) for m in d["meshes"].values())
    acts, steps = rc["activations_over_none"], rc["step_over_none"]
    return (
        f"{len(d['meshes'])} meshes, {ranks} ranks (tiny Llama and Qwen3-MoE, fp32): predicted / measured, the worst "
        f"rank: training state {w['state']:.3f}x (target within ±5 %: {met(abs(w['state'] - 1) <= 0.05)}), "
        f"activations {w['activations']:.3f}x (target within ±15 %: {met(abs(w['activations'] - 1) <= 0.15)}); "
        f"tp2 + SP, hidden {rc['hidden']}: selective recompute's activations "
        f"{acts['selective']:.2f}x none's (full {acts['full']:.2f}x), step time {steps['selective']:.2f}x none's "
        f"(full {steps['full']:.2f}x; CPU, no target)"
    )


@dataclass
class Benchmark:
    name: str  # its results file: results/<name>.json
    script: str
    args: list[str]
    what: str
    minutes: str  # at full size on a 2-core CPU (the GPU script: on one H100/H200)
    line: Callable[[dict], str]
    gpu: bool = False

    @property
    def command(self) -> str:
        return " ".join(["python", f"benchmarks/{self.script}", *self.args])


BENCHMARKS = [
    Benchmark("default_run", "bench_default_run.py", [], "the README's main command (the embedded default run), "
              "2-core CPU", "1", _default_run),
    Benchmark("step_time", "bench_step_time.py", [], "step time and peak RSS, hf3d tp=pp=dp=1 / stock transformers "
              "+ AdamW (Llama, fp32)", "2", _step_time),
    Benchmark("step_time_threads1", "bench_step_time.py", ["--threads", "1"], "the same with one thread", "2",
              _step_time),
    Benchmark("step_time_compile", "bench_step_time.py", ["--compile"], "the same with hf3d's compiled decoder "
              "layers (`compile=True`) in the rounds too (inductor on CPU)", "3", _step_time),
    Benchmark("load_memory", "bench_load_memory.py", [], "peak RSS of one tp=3 rank loading a SmolLM2-135M-shaped "
              "checkpoint / stock `from_pretrained` (above RSS before the load, code warmed)", "3", _load_memory),
    Benchmark("init_memory", "bench_init_memory.py", [], "peak RSS of one tp=3 rank initialising SmolLM2-135M "
              "from its config / stock `from_config`", "2", _init_memory),
    Benchmark("convert", "bench_convert.py", [], "`hf3d convert to-hf` / `from-hf`, SmolLM2-135M shape, against "
              "raw safetensors I/O of the same bytes", "4", _convert),
    Benchmark("checkpoint", "bench_checkpoint.py", [], "training checkpoint: the stall per save, sync and "
              "`checkpoint.async`, at dp=2 also the GPU's copying path (async-copy) on the CPU; save and load against "
              "raw I/O; dp=2 and pp=2", "10", _checkpoint),
    Benchmark("eval", "bench_eval.py", [], "downstream scoring (hf3d/evaluation) / a plain forward of the same "
              "tokens, at tp1, tp2 and pp2", "3", _eval),
    Benchmark("generate", "bench_generate.py", [], "generation at the mesh (`ParallelModel.generate`): tp1 / stock "
              "generate, tp2 / tp1 on a wide model, the prefill at cp2 / cp1", "4", _generate),
    Benchmark("sharding", "bench_sharding.py", [], "sharded gradients and weights: what a rank holds at ZeRO-1/2/3 "
              "(dp=4, 8) and the step time (dp=2), CPU", "5", _sharding),
    Benchmark("plan", "bench_plan.py", [], "`hf3d plan`'s memory prediction / a run's, every rank of 11 meshes "
              "(dp, recompute, tp + SP, pp 1f1b and interleaved, ZeRO-1/2/3, cp, ep; CPU); selective recompute's "
              "activations and step time beside none and full", "2", _plan),
    Benchmark("restart", "bench_restart.py", [], "a worker SIGKILLed under `--max-restarts` (tiny run, dp=2, CPU): "
              "time from the kill to the next finished step, steps lost", "2", _restart),
    Benchmark("mup", "bench_mup.py", [], "spectral µP against standard parametrization: coordinate check and lr "
              "transfer (tiny Llama, CPU)", "41", _mup),
    Benchmark("muon", "bench_muon.py", [], "the Muon hybrid (`torch.optim.Muon` on the hidden matrices, AdamW on "
              "the rest) / AdamW: the step's cost and state memory at tp2 and dp2 (CPU), the default run's held-out "
              "loss over an lr grid, µP with Muon", "17", _muon),
    Benchmark("gpu", "gpu.py", [], "one GPU: hf3d / stock compiled (360M, 1.7B), `hf3d train`, FP8, MoE, ZeRO-3",
              "9 (GPU)", _gpu, gpu=True),
]  # fmt: skip
BY_NAME = {b.name: b for b in BENCHMARKS}


# -- staleness ------------------------------------------------------------------------------------
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
    if env.get("hf3d_uncommitted_at_start") or env.get("hf3d_uncommitted_at_end"):
        return "UNCOMMITTED", f"measured at {commit} with uncommitted hf3d/ changes"
    return "current", commit


def load(name: str, results: Path) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _when(env: dict) -> str:
    state, note = status(env)
    date = env.get("date_utc", "?")[:10]
    return f"{note}, {date}" if state == "current" else f"**{state}**: {note}, {date}"


# -- the tables -----------------------------------------------------------------------------------
def perf_table(results: Path = RESULTS) -> tuple[str, list[str]]:
    """The table, and the results files it uses that are not current."""
    lines = ["| what | result | command | measured at |", "| --- | --- | --- | --- |"]
    not_current = []
    for b in BENCHMARKS:
        d = load(b.name, results)
        if d is None:
            where = " (needs a GPU)" if b.gpu else ""
            lines.append(f"| {b.what} | not measured yet{where}: no `results/{b.name}.json` | `{b.command}` | — |")
            continue
        try:
            text = b.line(d)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError) as e:
            text = f"`results/{b.name}.json` is from an earlier version of the script ({type(e).__name__}: {e}): re-run"
        if status(d.get("env", {}))[0] != "current":
            not_current.append(b.name)
        lines.append(f"| {b.what} | {text} | `{b.command}` | {_when(d.get('env', {}))} |")
    return "\n".join(lines), not_current


def default_run_block(results: Path = RESULTS) -> str:
    """The quick start's paragraph on what the main command did when it was last run."""
    d = load("default_run", results)
    if d is None:
        return "(not measured yet: `python benchmarks/bench_default_run.py`)"
    sample = d["sample"].replace("\n", " ").strip()
    return (
        f"Measured by `python benchmarks/bench_default_run.py` ({_when(d['env'])}): {_default_run(d)}. Its loss "
        "curve (`outputs/tiny-smollm/loss_curve.png`, train and eval):\n\n"
        "![loss curve of the default run](benchmarks/results/default_run_loss_curve.png)\n\n"
        f"and the sample it wrote (`outputs/tiny-smollm/sample.txt`, from the exported model): `{sample[:160]}`"
        + (f". Its last log line:\n\n```text\n{d['log_lines'][-1]}\n```" if d.get("log_lines") else "")
        + _mesh_sample(d)
    )


def _mesh_sample(d: dict) -> str:
    """The last sample the run generated at its training mesh (samples.jsonl), as the README quotes it."""
    if not d.get("mesh_samples"):
        return ""
    s = d["mesh_samples"][-1]
    text = (s["prompt"] + s["text"]).replace("\n", " / ").strip()
    return f"\n\nand its sample at step {s['step']}, generated at the training mesh (`samples.jsonl`): `{text[:160]}`"


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {name}:start --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text, count=1)


def render(results: Path = RESULTS) -> tuple[dict[Path, str], list[str]]:
    """{file with marker blocks: its new text}, and the results files the table uses that are not current."""
    table, not_current = perf_table(results)
    readme, perf_doc, bench_readme = REPO / "README.md", REPO / "docs" / "performance.md", BENCH_DIR / "README.md"
    out = {readme: replace_block(readme.read_text(), "default-run", default_run_block(results))}
    out[perf_doc] = replace_block(perf_doc.read_text(), "perf", table)
    out[bench_readme] = replace_block(bench_readme.read_text(), "results", table)
    return out, not_current


def report(*, check: bool = False, strict: bool = False) -> int:
    texts, not_current = render()
    if not_current:
        print(f"not current (marked in the table): {', '.join(not_current)}", file=sys.stderr)
        if strict:
            return 2
    changed = [p for p, t in texts.items() if p.read_text() != t]
    for p in changed:
        if check:
            print(f"out of date: {p.relative_to(REPO)}", file=sys.stderr)
        else:
            p.write_text(texts[p])
            print(f"rewrote {p.relative_to(REPO)}")
    return 1 if check and changed else 0


# -- running --------------------------------------------------------------------------------------
def run(b: Benchmark, quick: bool) -> int:
    cmd = [sys.executable, str(BENCH_DIR / b.script), *b.args, *(["--quick"] if quick else [])]
    print(f"== {b.name}: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, cwd=REPO).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BY_NAME)}")
    ap.add_argument("--all", action="store_true", help="every CPU benchmark")
    ap.add_argument("--quick", action="store_true", help="smoke sizes; results/quick/, no table touched")
    ap.add_argument("--report", action="store_true", help="only rewrite the tables from results/*.json")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    ap.add_argument("--strict", action="store_true", help="exit 2, writing nothing, if a row is not current")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    todo = [b for b in BENCHMARKS if not b.gpu] if args.all else [BY_NAME[n] for n in args.names]
    if not (todo or args.report or args.check or args.strict):
        for b in BENCHMARKS:
            d = load(b.name, RESULTS)
            state = "not measured" if d is None else _when(d.get("env", {})).replace("**", "")
            print(f"{b.name:20s} {b.minutes:>8s} min  {b.command:55s} {state}")
        return 0
    failed = [b.name for b in todo if run(b, args.quick)]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    if args.quick and not (args.report or args.check or args.strict):
        return 1 if failed else 0
    return report(check=args.check, strict=args.strict) or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
