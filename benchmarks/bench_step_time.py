"""Step time: hf3d at tp=pp=dp=1 vs stock transformers + torch.optim.AdamW + clip_grad_norm_.

Both sides live in ONE process, start from the same HF checkpoint, see the same batch and use the
same optimizer settings. Steps are interleaved (rotated order) after a warm-up; the table reports the
median (and quartiles) of the per-step wall time and process CPU time, split into
forward+backward and the optimizer part (clip + step + zero_grad). A torch.profiler table of one
step of each side shows where the time goes.

Peak memory needs one process per side: each side then runs MEMORY_STEPS steps alone in a fresh
process (the same imports on every side, glibc's mmap threshold fixed as in bench_memory_model.py),
and the table gives VmHWM above the RSS after the imports, after the load and over the steps.

    python benchmarks/bench_step_time.py            # full run (~2-4 min on 2 cores)
    python benchmarks/bench_step_time.py --quick    # smoke run

`--compile` measures regional compile instead (`parallelize(..., compile=True)`, hf3d/compile.py): hf3d
compiled, hf3d eager and stock in the same rotated rounds, the compiled / eager ratio of the median step,
and the first step of each (the compiled one includes the compile) -> results/step_time_compile.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import _common as C
import torch

LR, WD, BETAS, CLIP = 1e-4, 0.1, (0.9, 0.95), 1.0
MEMORY_STEPS = 3


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (few steps); results go to results/quick/")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--compile", action="store_true", help="hf3d compiled vs eager (results/step_time_compile.md)")
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    return ap.parse_args()


class Stock:
    name = "stock"

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, betas=BETAS)

    def fwd_bwd(self, ids, labels):
        loss = self.model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    def opt_step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm


class HF3D:
    name = "hf3d"

    def __init__(self, model_dir, fused_loss: bool = True, compile: bool = False):
        hf3d = C.import_hf3d()

        self.model = hf3d.parallelize(
            model_dir,
            hf3d.ParallelConfig(tp=1, pp=1, dp=1),
            dtype=torch.float32,
            attn_implementation="sdpa",
            compile=compile,
        )
        self.model.fused_loss = fused_loss
        self.opt = hf3d.build_optimizer(
            self.model, torch.optim.AdamW, lr=LR, weight_decay=WD, betas=BETAS, max_grad_norm=CLIP
        )

    def fwd_bwd(self, ids, labels):
        return self.model.train_step(ids, labels)

    def opt_step(self):
        norm = self.opt.step()
        self.opt.zero_grad()
        return norm


def timed_step(side, ids, labels) -> dict:
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    loss = side.fwd_bwd(ids, labels)
    w1, c1 = time.perf_counter(), time.process_time()
    norm = side.opt_step()
    w2, c2 = time.perf_counter(), time.process_time()
    return {
        "wall": w2 - w0,
        "cpu": c2 - c0,
        "fwd_bwd_wall": w1 - w0,
        "opt_wall": w2 - w1,
        "fwd_bwd_cpu": c1 - c0,
        "opt_cpu": c2 - c1,
        "loss": float(loss),
        "grad_norm": float(norm),
    }


def profile_step(side, ids, labels, rows: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.fwd_bwd(ids, labels)
        side.opt_step()
    out = []
    for ev in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]:
        out.append({"op": ev.key, "self_cpu_ms": ev.self_cpu_time_total / 1e3, "calls": ev.count})
    total = sum(ev.self_cpu_time_total for ev in prof.key_averages()) / 1e3
    out.append({"op": "TOTAL self CPU", "self_cpu_ms": total, "calls": None})
    return out


def loss_components(hf3d_side, n_tokens: int, hidden: int, vocab: int, repeats: int) -> dict:
    """The output head and the loss alone, forward + backward on the same hidden states and weight:
    hf3d's fused head (tp=1) vs the F.linear + F.cross_entropy that stock transformers runs."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, n_tokens, hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g) * 0.02
    targets = torch.randint(0, vocab, (1, n_tokens), generator=g)
    head = hf3d_side.model.lm_head
    count = torch.tensor(float(n_tokens))

    def hf3d_loss():
        x = base.clone().requires_grad_(True)
        saved, head.weight = head.weight, torch.nn.Parameter(weight.clone())
        head.fused_loss_terms(x, targets, count)[0].backward()
        head.weight = saved

    def stock_loss():
        x, w = base.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logits = F.linear(x, w).flatten(0, 1)
        (F.cross_entropy(logits, targets.flatten(), reduction="sum") / n_tokens).backward()

    times = {"hf3d fused head": [], "F.linear + F.cross_entropy": []}
    fns = {"hf3d fused head": hf3d_loss, "F.linear + F.cross_entropy": stock_loss}
    for r in range(repeats + 1):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            gc.collect()
            t0 = time.perf_counter()
            fns[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {k: C.median(v) for k, v in times.items()}


def memory_worker(args) -> None:
    """One side alone in this process: VmHWM above the post-import RSS, after the load and over the steps."""
    import transformers  # noqa: F401  (the same imports on every side)

    C.import_hf3d()

    base = C.proc_status()["VmRSS"]
    side = {"stock": Stock, "hf3d": HF3D, "hf3d_plain": lambda d: HF3D(d, fused_loss=False)}[args.memory_worker](
        args.model_dir
    )
    loaded = C.proc_status()["VmHWM"] - base
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    for _ in range(MEMORY_STEPS):
        side.fwd_bwd(ids, ids)
        side.opt_step()
    print(json.dumps({"load_peak": loaded, "peak": C.proc_status()["VmHWM"] - base}))


def measure_memory(args, model_dir: str) -> dict:
    out = {}
    flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "seq", "batch", "threads")]
    for name in ("stock", "hf3d", "hf3d_plain"):
        proc = C.python_subprocess(
            Path(__file__),
            [*flags, "--memory-worker", name, "--model-dir", model_dir],
            env={**C.MALLOC_ENV, "MASTER_PORT": str(C.free_port())},  # this process holds its own port
        )
        if proc.returncode:
            raise SystemExit(f"memory worker {name} failed:\n{C.tail(proc.stdout + proc.stderr)}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main():
    args = parse_args()
    if args.memory_worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        return memory_worker(args)
    if args.quick:
        args.warmup, args.repeats = 1, 3
        args.layers, args.seq, args.batch = 2, 128, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    env = C.env_info()
    cfg = C.llama_config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.inter,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    shapes = (
        f"{C.shape_str(cfg)}; batch={args.batch} x seq={args.seq}; fp32; sdpa; AdamW(lr={LR}, wd={WD}), clip {CLIP}"
    )
    print("shapes:", shapes, flush=True)

    tmp_dir = tempfile.TemporaryDirectory(prefix="bench_step_")
    tmp = tmp_dir.name
    n_params = C.save_model_dir(cfg, Path(tmp), dtype=torch.float32)
    # hf3d_plain: the same hf3d with the plain head + loss (fused_loss=False), to show what fusing brings
    sides = {"stock": Stock(tmp), "hf3d": HF3D(tmp), "hf3d_plain": HF3D(tmp, fused_loss=False)}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = ids.clone()

    samples: dict[str, list[dict]] = {name: [] for name in sides}
    first = {}
    order = ["hf3d", "stock", "hf3d_plain"]
    for r in range(args.warmup + args.repeats):
        for name in order[r % 3 :] + order[: r % 3]:  # rotated: no side always goes first
            s = timed_step(sides[name], ids, labels)
            first.setdefault(name, s)
            if r >= args.warmup:
                samples[name].append(s)
        if r >= args.warmup:
            print(
                f"round {r - args.warmup + 1}/{args.repeats}: hf3d {samples['hf3d'][-1]['wall']:.3f}s  "
                f"stock {samples['stock'][-1]['wall']:.3f}s",
                flush=True,
            )

    def stat(name, key, fn=C.median):
        return fn([s[key] for s in samples[name]])

    keys = ["wall", "fwd_bwd_wall", "opt_wall", "cpu", "fwd_bwd_cpu", "opt_cpu"]
    result = {
        k: {
            side: {
                "median": stat(side, k),
                "p25": stat(side, k, lambda xs: C.quantile(xs, 0.25)),
                "p75": stat(side, k, lambda xs: C.quantile(xs, 0.75)),
                "min": stat(side, k, min),
            }
            for side in sides
        }
        for k in keys
    }
    for k in keys:
        result[k]["ratio_hf3d_over_stock"] = result[k]["hf3d"]["median"] / result[k]["stock"]["median"]
        result[k]["ratio_of_minima"] = result[k]["hf3d"]["min"] / result[k]["stock"]["min"]
        result[k]["ratio_hf3d_plain_over_stock"] = result[k]["hf3d_plain"]["median"] / result[k]["stock"]["median"]
    tokens = args.batch * args.seq
    ratio = result["wall"]["ratio_hf3d_over_stock"]

    labels_row = {
        "wall": "step, wall (s)",
        "fwd_bwd_wall": "  forward+backward, wall (s)",
        "opt_wall": "  clip+optimizer+zero_grad, wall (s)",
        "cpu": "step, process CPU (s)",
        "fwd_bwd_cpu": "  forward+backward, CPU (s)",
        "opt_cpu": "  clip+optimizer+zero_grad, CPU (s)",
    }
    rows = []
    for k in keys:
        h, s = result[k]["hf3d"], result[k]["stock"]
        rows.append(
            [
                labels_row[k],
                f"{h['median']:.4f} [{h['p25']:.4f}, {h['p75']:.4f}]",
                f"{s['median']:.4f} [{s['p25']:.4f}, {s['p75']:.4f}]",
                f"{result[k]['ratio_hf3d_over_stock']:.3f}x",
                f"{h['min']:.4f} / {s['min']:.4f} = {result[k]['ratio_of_minima']:.3f}x",
            ]
        )
    rows.append(
        [
            "tokens/s (from median wall)",
            f"{tokens / result['wall']['hf3d']['median']:,.0f}",
            f"{tokens / result['wall']['stock']['median']:,.0f}",
            f"{result['wall']['stock']['median'] / result['wall']['hf3d']['median']:.3f}x",
            "",
        ]
    )
    table = C.md_table(
        ["metric (median [p25, p75])", "hf3d", "stock", "hf3d / stock (medians)", "min hf3d / min stock"], rows
    )
    sanity = (
        f"Same start: first-step loss hf3d {first['hf3d']['loss']:.6f} vs stock {first['stock']['loss']:.6f} "
        f"(|Δ| {abs(first['hf3d']['loss'] - first['stock']['loss']):.2e}); grad norm hf3d "
        f"{first['hf3d']['grad_norm']:.6f} vs stock {first['stock']['grad_norm']:.6f}."
    )
    plain = (
        "The same hf3d with the plain output head (`fused_loss=False`: [tokens, vocab] logits, then the loss), "
        f"in the same rounds: {result['wall']['ratio_hf3d_plain_over_stock']:.3f}x of stock's median step, "
        f"{result['fwd_bwd_wall']['ratio_hf3d_plain_over_stock']:.3f}x of its forward+backward."
    )
    verdict = (
        f"**hf3d / stock step time (median wall) = {ratio:.3f}x** (target ≤ 0.95x: "
        f"{'met' if ratio <= 0.95 else 'NOT met'}); by process CPU time "
        f"{result['cpu']['ratio_hf3d_over_stock']:.3f}x; ratio of the fastest steps "
        f"{result['wall']['ratio_of_minima']:.3f}x (least disturbed by other load). Load average during the run: "
        f"{env['load_avg_1m_at_start']} at start on {env['cpu_count']} cores — above ~1 the spread is other "
        "processes' noise; the interleaving keeps the comparison fair but not precise."
    )
    body = [
        f"Shapes: {shapes}; {n_params:,} parameters; {args.warmup} warm-up rounds, {args.repeats} timed rounds "
        "(each round one step of each side, order alternating).",
        table,
        verdict,
        plain,
        sanity,
    ]
    data = {"env": env, "shapes": shapes, "n_params": n_params, "args": vars(args), "result": result}
    data["samples"] = samples
    mem = measure_memory(args, tmp)
    tmp_dir.cleanup()
    data["memory"] = mem
    ratio_mem = mem["hf3d"]["peak"] / mem["stock"]["peak"]
    data["memory_ratio_hf3d_over_stock"] = ratio_mem
    body.append(
        f"Peak memory, each side alone in a fresh process ({MEMORY_STEPS} steps, MiB of VmHWM above the RSS "
        "after the imports):\n\n"
        + C.md_table(
            ["", "stock", "hf3d", "hf3d, plain head", "hf3d / stock"],
            [
                [label]
                + [f"{C.mib(mem[n][key]):.1f}" for n in ("stock", "hf3d", "hf3d_plain")]
                + [f"{mem['hf3d'][key] / mem['stock'][key]:.3f}x"]
                for label, key in (("peak of the load", "load_peak"), ("peak over the steps", "peak"))
            ],
        )
        + f"\n\n**hf3d / stock peak RSS = {ratio_mem:.3f}x** "
        f"(target ≤ 1.0x: {'met' if ratio_mem <= 1.0 else 'NOT met'})."
    )
    if not args.no_profile:
        comp = loss_components(sides["hf3d"], tokens, args.hidden, args.vocab, max(3, args.repeats // 2))
        data["loss_components"] = comp
        body.append(
            f"The output head and loss alone (forward + backward from the same [{tokens}, {args.hidden}] hidden "
            f"states and [{args.vocab}, {args.hidden}] weight, fp32, median): hf3d fused head "
            f"{comp['hf3d fused head'] * 1e3:.1f} ms vs `F.linear` + `F.cross_entropy` "
            f"{comp['F.linear + F.cross_entropy'] * 1e3:.1f} ms "
            f"({comp['hf3d fused head'] / comp['F.linear + F.cross_entropy']:.2f}x)."
        )
        profiles = {name: profile_step(sides[name], ids, labels) for name in ("hf3d", "stock")}
        data["profile"] = profiles
        prow = []
        for i in range(max(len(profiles["hf3d"]), len(profiles["stock"]))):
            row = []
            for name in ("hf3d", "stock"):
                e = profiles[name][i] if i < len(profiles[name]) else None
                row += (
                    [f"`{e['op'][:48]}`", f"{e['self_cpu_ms']:.1f}", "" if e["calls"] is None else str(e["calls"])]
                    if e
                    else ["", "", ""]
                )
            prow.append(row)
        body.append(
            "torch.profiler, one step of each side (after the timed rounds), top ops by self CPU time:\n\n"
            + C.md_table(
                ["hf3d op", "ms", "calls", "stock op", "ms", "calls"],
                prow,
            )
        )
    body_md = "\n\n".join(body)
    print("\n" + body_md)
    path = C.write_results(
        "step_time" + (f"_threads{args.threads}" if args.threads else ""),
        "Step time: hf3d (tp=pp=dp=1) vs stock transformers",
        body_md,
        data,
        quick=args.quick,
    )
    print(f"\nwrote {path}")


def model_config(args):
    return C.llama_config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.inter,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )


def rounds(sides: dict, ids, labels, warmup: int, repeats: int) -> tuple[dict, dict]:
    """Rotated rounds, one step of each side per round: (the timed steps per side, the first step per side)."""
    samples: dict[str, list[dict]] = {name: [] for name in sides}
    first, order = {}, list(sides)
    for r in range(warmup + repeats):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            s = timed_step(sides[name], ids, labels)
            first.setdefault(name, s)
            if r >= warmup:
                samples[name].append(s)
        if r >= warmup:
            walls = "  ".join(f"{n} {samples[n][-1]['wall']:.3f}s" for n in order)
            print(f"round {r - warmup + 1}/{repeats}: {walls}", flush=True)
    return samples, first


def compile_main(args) -> None:
    """hf3d with compiled decoder layers vs hf3d eager (and stock), same checkpoint, batch and rounds."""
    if args.quick:
        args.warmup, args.repeats = 2, 3
        args.layers, args.seq, args.batch = 2, 128, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    env = C.env_info()
    cfg = model_config(args)
    shapes = f"{C.shape_str(cfg)}; batch={args.batch} x seq={args.seq}; fp32; sdpa; AdamW, clip {CLIP}"
    print("shapes:", shapes, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_step_compile_") as tmp:
        n_params = C.save_model_dir(cfg, Path(tmp), dtype=torch.float32)
        sides = {"hf3d_compiled": HF3D(tmp, compile=True), "hf3d": HF3D(tmp), "stock": Stock(tmp)}
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        samples, first = rounds(sides, ids, ids.clone(), args.warmup, args.repeats)
    keys = ("wall", "fwd_bwd_wall", "opt_wall", "cpu")
    result = {
        k: {n: {"median": C.median([s[k] for s in samples[n]]), "min": min(s[k] for s in samples[n])} for n in sides}
        for k in keys
    }
    ratio = {k: result[k]["hf3d_compiled"]["median"] / result[k]["hf3d"]["median"] for k in keys}
    ratio_min = result["wall"]["hf3d_compiled"]["min"] / result["wall"]["hf3d"]["min"]
    labels = {
        "wall": "step, wall (s)",
        "fwd_bwd_wall": "  forward+backward, wall (s)",
        "opt_wall": "  clip+optimizer+zero_grad, wall (s)",
        "cpu": "step, process CPU (s)",
    }
    rows = [[labels[k], *(f"{result[k][n]['median']:.4f}" for n in sides), f"{ratio[k]:.3f}x"] for k in keys]
    rows.append(["first step, wall (s): the compile", *(f"{first[n]['wall']:.2f}" for n in sides), ""])
    table = C.md_table(["metric (median)", "hf3d compiled", "hf3d eager", "stock", "compiled / eager"], rows)
    dl = abs(first["hf3d_compiled"]["loss"] - first["hf3d"]["loss"])
    body = "\n\n".join(
        [
            f"Shapes: {shapes}; {n_params:,} parameters; {args.warmup} warm-up rounds (the compile happens in the "
            f"first), {args.repeats} timed rounds (each round one step of each side, order rotating).",
            table,
            f"**hf3d compiled / hf3d eager step time (median wall) = {ratio['wall']:.3f}x**; forward+backward "
            f"{ratio['fwd_bwd_wall']:.3f}x; fastest steps {ratio_min:.3f}x; compiled / stock "
            f"{result['wall']['hf3d_compiled']['median'] / result['wall']['stock']['median']:.3f}x. Load average "
            f"{env['load_avg_1m_at_start']} at start on {env['cpu_count']} cores.",
            f"Same start: first-step loss compiled {first['hf3d_compiled']['loss']:.6f} vs eager "
            f"{first['hf3d']['loss']:.6f} (|Δ| {dl:.1e}).",
        ]
    )
    print("\n" + body)
    data = {"env": env, "shapes": shapes, "n_params": n_params, "args": vars(args), "result": result}
    data.update(ratio_compiled_over_eager=ratio, ratio_of_minima=ratio_min, first=first, samples=samples)
    name = "step_time_compile" + (f"_threads{args.threads}" if args.threads else "")
    path = C.write_results(name, "Step time: hf3d compiled layers vs eager", body, data, quick=args.quick)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    if parse_args().compile:  # main() parses the same arguments again
        compile_main(parse_args())
    else:
        main()
