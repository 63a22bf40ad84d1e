"""Spectral µP (hf3d/optim/parametrization.py) against standard parametrization (SP), on the CPU, one process.

    python benchmarks/bench_mup.py                  # both parts, then results/mup.{json,md} and two PNGs
    python benchmarks/bench_mup.py --part coord     # the coordinate check only (--part sweep: the lr sweep)
    python benchmarks/bench_mup.py --quick          # smoke sizes into results/quick/

Both parts train a tiny Llama (4 layers, head_dim 16, heads = width / 16, MLP 2 x width, tied embeddings as
SmolLM's) from scratch (seed 0) with hf3d at 1x1x1 and AdamW (betas 0.9 / 0.95, no weight decay), on the
shipped Shakespeare text tokenized with the example tokenizer (vocabulary 2,000), packed into rows.

- coord: widths 64 ... 1024, base width 64, constant lr, no clipping. After each of the first steps, one fixed
  held-out batch goes through the model; per layer (the embedding, each decoder layer's output, the logits) the
  RMS of its output (activation) and of the change of that output since step 0 (update). µP should keep
  both flat across widths; under SP the logits grow with width.
- sweep: as a µTransfer user tunes: first a coarse grid on the proxy alone (width 128, the base width; seed 0):
  5 lrs a factor √10 apart, for SP, and for µP those lrs times output multipliers 1, 4, 16 (µTransfer's
  output_mult, `mup_output_multiplier`: at the base width µP is SP with that gain on the logits). Then, for
  each parametrization, 5 lrs a factor 2 apart centred on its proxy's best, µP at its proxy's multiplier, at
  widths 128 and 512, each from 5 seeds (initialisation and data order); linear warm-up then cosine decay,
  clipping at 1.0; the loss on held-out rows at the end, averaged over the seeds. µP should keep the best lr
  where it is and do better at 512; under SP the best lr should move.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch
from _common import REPO, env_info, md_table, write_results

LAYERS, HEAD_DIM, VOCAB_DIR = 4, 16, REPO / "examples" / "tokenizer"
BETAS = (0.9, 0.95)
FULL = dict(
    coord=dict(widths=[64, 128, 256, 512, 1024], base=64, steps=5, lr=1e-2, batch=8, seq=64),
    sweep=dict(
        widths=[128, 512],
        base=128,
        steps=300,
        coarse=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1],
        alphas=[1.0, 4.0, 16.0],
        factor=2.0,
        seeds=[0, 1, 2, 3, 4],
        batch=8,
        seq=32,
    ),
)
QUICK = dict(
    coord=dict(widths=[32, 64], base=32, steps=2, lr=1e-2, batch=2, seq=16),
    sweep=dict(
        widths=[32, 64],
        base=32,
        steps=4,
        coarse=[1e-3, 1e-2, 1e-1],
        alphas=[1.0, 4.0],
        factor=2.0,
        seeds=[0, 1],
        batch=2,
        seq=16,
    ),
)
EVAL_ROWS = 32
SHORT = {"standard": "SP", "spectral_mup": "µP"}  # the figure's titles
WORKERS = 2  # runs at a time, one thread each
PARAMETRIZATIONS = ("standard", "spectral_mup")


# -- data and models ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def token_rows(seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows in the order of `seed`, held-out rows) of `seq` tokens from the shipped corpus."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(VOCAB_DIR)
    lines = (REPO / "examples" / "data" / "shakespeare.jsonl").read_text().splitlines()
    ids = [t for line in lines for t in tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id or 0]]
    rows = torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)
    held_out, train = rows[-EVAL_ROWS:], rows[:-EVAL_ROWS]
    return train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))], held_out


def model_dir(root: Path, width: int) -> str:
    from transformers import LlamaConfig

    heads = width // HEAD_DIM
    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        vocab_size=2000,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        initializer_range=0.02,
    )
    path = root / f"w{width}"
    config.save_pretrained(path)
    return str(path)


def build(
    root: Path, width: int, parametrization: str, base: int, lr: float, clip: float | None, seed: int = 0, alpha=1.0
):
    import hf3d

    mup = dict(mup_base_width=base, mup_output_multiplier=alpha) if parametrization == "spectral_mup" else {}
    pcfg = hf3d.ParallelConfig(parametrization=parametrization, **mup)
    pm = hf3d.parallelize(model_dir(root, width), pcfg, seed=seed)
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=lr, betas=BETAS, weight_decay=0.0, max_grad_norm=clip)
    return pm, opt


def rms(t: torch.Tensor) -> float:
    return float(t.float().square().mean().sqrt())


# -- coordinate check -----------------------------------------------------------------------------------
@torch.no_grad()
def outputs(pm, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each layer's output on `ids`: the embedding, every decoder layer, the logits."""
    seen, hooks = {}, []
    inner = pm.hf_model.model

    def keep(name):
        return lambda _m, _i, out: seen.__setitem__(name, (out[0] if isinstance(out, tuple) else out).clone())

    hooks.append(inner.embed_tokens.register_forward_hook(keep("embedding")))
    for i in range(LAYERS):
        hooks.append(inner.layers[str(i)].register_forward_hook(keep(f"layer {i}")))
    pm.eval()
    seen["logits"] = pm(input_ids=ids).logits.clone()
    pm.train()
    for h in hooks:
        h.remove()
    return seen


def coord_run(task: tuple) -> tuple:
    """One (parametrization, width) of the coordinate check, in a pool worker."""
    par, width, c = task
    train, held = token_rows(c["seq"])
    probe = held[: c["batch"]]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        pm, opt = build(Path(tmp), width, par, c["base"], c["lr"], None)
        start = outputs(pm, probe)
        rec = {k: {"activation": [rms(v)], "update": [0.0]} for k, v in start.items()}
        for step in range(c["steps"]):
            rows = train[step * c["batch"] : (step + 1) * c["batch"]]
            pm.train_step(rows, rows)
            opt.step()
            opt.zero_grad()
            for k, v in outputs(pm, probe).items():
                rec[k]["activation"].append(rms(v))
                rec[k]["update"].append(rms(v - start[k]))
    print(f"coord {par} width {width}: {time.perf_counter() - t0:.1f} s", flush=True)
    return par, width, rec


def coord_check(c: dict) -> dict:
    out = {}
    tasks = [(par, width, c) for par in PARAMETRIZATIONS for width in reversed(c["widths"])]  # longest first
    for par, width, rec in in_pool(coord_run, tasks):
        out.setdefault(par, {})[str(width)] = rec
    return {par: {str(w): out[par][str(w)] for w in c["widths"]} for par in PARAMETRIZATIONS}


def spread(coord: dict, par: str, kind: str) -> dict[str, float]:
    """Per layer: the largest over the smallest RMS across widths, at the last step."""
    widths = list(coord[par])
    return {
        layer: max(coord[par][w][layer][kind][-1] for w in widths) / min(coord[par][w][layer][kind][-1] for w in widths)
        for layer in coord[par][widths[0]]
    }


# -- learning-rate sweep --------------------------------------------------------------------------------
def sweep_run(task: tuple) -> tuple:
    """One (parametrization, width, lr, seed, output multiplier) of the sweep, in a pool worker: the held-out
    loss at the end."""
    par, width, lr, seed, s, alpha = task
    train, held = token_rows(s["seq"], seed)
    warmup = max(1, s["steps"] // 10)

    def factor(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, s["steps"] - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        pm, opt = build(Path(tmp), width, par, s["base"], lr, 1.0, seed, alpha)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        for step in range(s["steps"]):
            rows = train[(step * s["batch"]) % len(train) :][: s["batch"]]
            pm.train_step(rows, rows)
            opt.step()
            opt.zero_grad()
            sched.step()
        total, n = pm.eval_loss(held, labels=held)
    loss = float(total / n)
    took = time.perf_counter() - t0
    print(f"sweep {par} width {width} lr {lr:g} α {alpha:g} seed {seed}: loss {loss:.4f}, {took:.1f} s", flush=True)
    return par, width, lr, seed, alpha, loss if math.isfinite(loss) else None


def sweep(s: dict) -> dict:
    """The coarse grid on the proxy (the base width, seed 0): lrs for SP, lrs x output multipliers for µP (at
    the base width µP is SP with that gain on the logits); then, for each parametrization, 5 lrs around its
    proxy's best at every width and seed, µP at its proxy's multiplier: {coarse: {par: {alpha: {lr: loss}}},
    proxy_best: {par: {lr, alpha}}, lrs: {par: [lr]}, runs: {par: {width: {lr: [loss per seed]}}}}."""
    grid = [("standard", 1.0)] + [("spectral_mup", a) for a in s["alphas"]]
    coarse: dict = {}
    for par, _w, lr, _s, alpha, loss in in_pool(
        sweep_run, [(par, s["base"], lr, 0, s, alpha) for par, alpha in grid for lr in s["coarse"]]
    ):
        coarse.setdefault(par, {}).setdefault(repr(alpha), {})[repr(lr)] = loss
    proxy_best, lrs = {}, {}
    for par, by_alpha in coarse.items():
        alpha, lr = min(
            ((a, k) for a, curve in by_alpha.items() for k, v in curve.items() if v is not None),
            key=lambda ak: by_alpha[ak[0]][ak[1]],
        )
        proxy_best[par] = dict(lr=float(lr), alpha=float(alpha))
        lrs[par] = [float(f"{float(lr) * s['factor'] ** k:.6g}") for k in (-2, -1, 0, 1, 2)]
    tasks = [
        (par, w, lr, seed, s, proxy_best[par]["alpha"])
        for w in reversed(s["widths"])
        for par in PARAMETRIZATIONS
        for lr in lrs[par]
        for seed in s["seeds"]
    ]
    got = {(par, w, lr, seed): loss for par, w, lr, seed, _a, loss in in_pool(sweep_run, tasks)}
    runs = {
        par: {
            str(w): {repr(lr): [got[(par, w, lr, seed)] for seed in s["seeds"]] for lr in lrs[par]} for w in s["widths"]
        }
        for par in PARAMETRIZATIONS
    }
    return dict(coarse=coarse, proxy_best=proxy_best, lrs=lrs, runs=runs)


def _worker_init() -> None:
    """One thread per worker (two workers on two cores; OpenMP's spinning threads cost more than they give on
    these small matrices), and a world of one of its own: not the parent's rendezvous."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    torch.set_num_threads(1)


def in_pool(fn, tasks: list) -> list:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=ctx, initializer=_worker_init) as pool:
        return list(pool.map(fn, tasks))


def best(losses: dict[str, float | None]) -> tuple[float, float]:
    lr, loss = min(((float(k), v) for k, v in losses.items() if v is not None), key=lambda kv: kv[1])
    return lr, loss


def mean(losses: list[float | None]) -> float | None:
    """The mean over the seeds; None (diverged) if any seed diverged."""
    return None if None in losses else sum(losses) / len(losses)


def vertex(curve: dict[str, float | None]) -> float | None:
    """The lr at the minimum of the parabola in log lr through the best grid point and its two neighbours (an
    estimate between grid points); None when the best is at the grid's edge or a neighbour diverged."""
    keys = list(curve)
    i = keys.index(repr(best(curve)[0]))
    if i in (0, len(keys) - 1) or None in (curve[keys[i - 1]], curve[keys[i + 1]]):
        return None
    (x0, x1, x2), (y0, y1, y2) = (
        (math.log(float(keys[j])) for j in (i - 1, i, i + 1)),
        (curve[keys[j]] for j in (i - 1, i, i + 1)),
    )
    num = (x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)
    den = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    return math.exp(x1 - 0.5 * num / den)


# -- figures and tables ---------------------------------------------------------------------------------
def figure(path: Path, coord: dict | None, swept: dict | None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = (coord is not None) + (swept is not None)
    fig = Figure(figsize=(13, 4 * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 4, squeeze=False)
    r = 0
    if coord is not None:
        for j, (par, kind) in enumerate((p, k) for p in PARAMETRIZATIONS for k in ("activation", "update")):
            ax, widths = axes[r][j], [int(w) for w in coord[par]]
            for layer in coord[par][str(widths[0])]:
                ax.plot(widths, [coord[par][str(w)][layer][kind][-1] for w in widths], marker="o", label=layer)
            ax.set(xscale="log", yscale="log", xlabel="width", title=f"{SHORT[par]}: {kind} RMS, last step")
            ax.set_xticks(widths, [str(w) for w in widths])
        axes[r][0].legend(fontsize=7)
        r += 1
    if swept is not None:
        for j, par in enumerate(PARAMETRIZATIONS):
            ax = axes[r][j]
            for width, curve in swept["runs"][par].items():
                pts = [(float(k), v) for k, v in curve.items() if None not in v]
                ys = [sum(v) / len(v) for _, v in pts]
                err = [[y - min(v) for y, (_, v) in zip(ys, pts)], [max(v) - y for y, (_, v) in zip(ys, pts)]]
                ax.errorbar([x for x, _ in pts], ys, yerr=err, marker="o", capsize=3, label=f"width {width}")
            ax.set(xscale="log", xlabel="lr", ylabel="held-out loss", title=f"{SHORT[par]}: lr sweep (mean, min-max)")
            ax.legend(fontsize=7)
        ax = axes[r][2]
        for par, by_alpha in swept["coarse"].items():
            for alpha, curve in by_alpha.items():
                pts = [(float(k), v) for k, v in curve.items() if v is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{SHORT[par]} α {float(alpha):g}")
        ax.set(xscale="log", xlabel="lr", ylabel="held-out loss", title="proxy's coarse grid (seed 0)")
        ax.legend(fontsize=7)
        axes[r][3].axis("off")
    fig.savefig(path)


def _grows(values: list[float]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


def _by_width(values: dict[str, float]) -> str:
    return ", ".join(f"{w}: {v:.3g}" for w, v in values.items())


def summary(coord: dict | None, swept: dict | None, cfg: dict) -> tuple[dict, str]:
    data, md = {}, []
    if coord is not None:
        c = cfg["coord"]
        mup_act, mup_upd = spread(coord, "spectral_mup", "activation"), spread(coord, "spectral_mup", "update")
        sp_logits = {w: coord["standard"][w]["logits"]["activation"][-1] for w in coord["standard"]}
        sp_init = {w: coord["standard"][w]["logits"]["activation"][0] for w in coord["standard"]}
        lo, hi = str(min(c["widths"])), str(max(c["widths"]))
        data["coord"] = dict(
            mup_activation_spread=mup_act,
            mup_update_spread=mup_upd,
            standard_activation_spread=spread(coord, "standard", "activation"),
            standard_update_spread=spread(coord, "standard", "update"),
            mup_within_2x=max([*mup_act.values(), *mup_upd.values()]) <= 2.0,
            standard_logit_rms=sp_logits,
            standard_logits_grow=all(sp_logits[a] < sp_logits[b] for a, b in zip(list(sp_logits), list(sp_logits)[1:])),
            standard_logit_growth=sp_logits[hi] / sp_logits[lo],
            standard_logit_rms_init=sp_init,
            standard_logits_grow_at_init=all(sp_init[a] < sp_init[b] for a, b in zip(list(sp_init), list(sp_init)[1:])),
            standard_logit_growth_at_init=sp_init[hi] / sp_init[lo],
            mup_max_spread=max([*mup_act.values(), *mup_upd.values()]),
            standard_logits_grow_at_steps=[
                k
                for k in range(c["steps"] + 1)
                if _grows([coord["standard"][w]["logits"]["activation"][k] for w in sp_init])
            ],
        )
        rows = [
            [layer, mup_act[layer], mup_upd[layer], data["coord"]["standard_activation_spread"][layer],
             data["coord"]["standard_update_spread"][layer]]
            for layer in mup_act
        ]  # fmt: skip
        md += [
            f"## Coordinate check: widths {', '.join(map(str, c['widths']))}, after {c['steps']} steps at lr "
            f"{c['lr']:g}",
            "Largest over smallest RMS across the widths, per layer (1.0: flat).",
            md_table(["layer", "µP activation", "µP update", "SP activation", "SP update"], rows),
            f"µP: largest spread {data['coord']['mup_max_spread']:.3g}x (within 2x: {data['coord']['mup_within_2x']}).",
            f"SP logit RMS by width after {c['steps']} steps: {_by_width(sp_logits)} "
            f"({data['coord']['standard_logit_growth']:.3g}x from {lo} to {hi}; growing at every width: "
            f"{data['coord']['standard_logits_grow']}); at step 0: {_by_width(sp_init)}"
            f" ({data['coord']['standard_logit_growth_at_init']:.3g}x). Steps after which SP's logit RMS grows from"
            f" each width to the next: {', '.join(map(str, data['coord']['standard_logits_grow_at_steps'])) or 'none'}"
            f" (of 0 ... {c['steps']}).",
        ]
    if swept is not None:
        data["sweep"], text = sweep_summary(swept, cfg["sweep"])
        md.append(text)
    return data, "\n\n".join(md)


def sweep_summary(swept: dict, s: dict) -> tuple[dict, str]:
    runs, lrs = swept["runs"], {par: [repr(lr) for lr in v] for par, v in swept["lrs"].items()}
    means = {par: {w: {k: mean(runs[par][w][k]) for k in lrs[par]} for w in runs[par]} for par in runs}
    bests = {par: {w: best(means[par][w]) for w in means[par]} for par in means}
    per_seed = {
        par: {
            w: [best({k: runs[par][w][k][i] for k in lrs[par]})[0] for i in range(len(s["seeds"]))] for w in runs[par]
        }
        for par in runs
    }
    vertices = {par: {w: vertex(means[par][w]) for w in means[par]} for par in means}
    small, large = (str(w) for w in s["widths"])
    mup_best = bests["spectral_mup"]
    data = dict(
        proxy_best=swept["proxy_best"],
        best=bests,
        best_per_seed=per_seed,
        vertex=vertices,
        mup_same_best_lr=mup_best[small][0] == mup_best[large][0],
        mup_wider_is_better=mup_best[large][1] < mup_best[small][1],
        mup_wider_better_seeds=sum(
            a < b
            for a, b in zip(
                runs["spectral_mup"][large][repr(mup_best[large][0])],
                runs["spectral_mup"][small][repr(mup_best[small][0])],
            )
        ),
        standard_best_lr_moves=bests["standard"][small][0] != bests["standard"][large][0],
        seeds_where_mup_keeps=sum(map(float.__eq__, per_seed["spectral_mup"][small], per_seed["spectral_mup"][large])),
        seeds_where_standard_moves=sum(map(float.__ne__, per_seed["standard"][small], per_seed["standard"][large])),
    )

    def cell(losses: list[float | None]) -> str:
        if None in losses:
            return f"diverged ({sum(v is None for v in losses)} of {len(losses)})"
        return f"{sum(losses) / len(losses):.4f} ±{(max(losses) - min(losses)) / 2:.4f}"

    coarse = "; ".join(
        f"{par} α {float(a):g}: "
        + ", ".join(f"lr {float(k):g}: " + ("diverged" if v is None else f"{v:.4f}") for k, v in curve.items())
        for par, by_alpha in swept["coarse"].items()
        for a, curve in by_alpha.items()
    )
    chosen = "; ".join(
        f"{par}: lr {b['lr']:g}" + (f", output multiplier {b['alpha']:g}" if par == "spectral_mup" else "")
        for par, b in swept["proxy_best"].items()
    )
    tables = [
        md_table(
            ["run", *(f"lr {float(k):g}" for k in lrs[par])],
            [[f"{par} width {w}", *(cell(runs[par][w][k]) for k in lrs[par])] for w in runs[par]],
        )
        for par in runs
    ]
    est = lambda v: "at the grid's edge" if v is None else f"{v:.2g}"  # noqa: E731
    n = len(s["seeds"])
    md = [
        f"## lr sweep: {s['steps']} steps of {s['batch']} x {s['seq']} tokens, held-out loss of {EVAL_ROWS} rows",
        f"Coarse grid on the proxy (width {s['base']}, seed 0; µP at the base width is SP with its output "
        f"multiplier α on the logits): {coarse}. Best: {chosen}. The grids below: 5 lrs a factor {s['factor']:g}"
        " apart centred on each parametrization's best, µP at its α.",
        f"Held-out loss, mean over seeds {', '.join(map(str, s['seeds']))} ± half their range:",
        *tables,
        "Best lr (by the seed mean; per seed; the parabola's minimum through it and its neighbours): "
        + "; ".join(
            f"{par} width {w}: {b[0]:g} (loss {b[1]:.4f}; per seed {', '.join(f'{x:g}' for x in per_seed[par][w])};"
            f" parabola {est(vertices[par][w])})"
            for par in bests for w, b in bests[par].items()
        )
        + f". µP: the same best lr at both widths: {data['mup_same_best_lr']} ({data['seeds_where_mup_keeps']} of {n}"
        f" seeds), lower loss at {large}: {data['mup_wider_is_better']} ({data['mup_wider_better_seeds']} of {n} "
        f"seeds at the best lrs); SP: the best lr moves: {data['standard_best_lr_moves']} "
        f"({data['seeds_where_standard_moves']} of {n} seeds).",
    ]  # fmt: skip
    return data, "\n\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("both", "coord", "sweep"), default="both")
    ap.add_argument("--quick", action="store_true", help="smoke sizes into results/quick/")
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    env = env_info()
    t0 = time.perf_counter()
    coord = coord_check(cfg["coord"]) if args.part in ("both", "coord") else None
    t1 = time.perf_counter()
    swept = sweep(cfg["sweep"]) if args.part in ("both", "sweep") else None
    t2 = time.perf_counter()
    data, md = summary(coord, swept, cfg)
    data.update(env=env, config=cfg, layers=LAYERS, coord_raw=coord, sweep_raw=swept, part=args.part)
    data["wall_s"] = dict(coord=t1 - t0, sweep=t2 - t1)
    data["load_avg"] = os.getloadavg()
    path = write_results("mup", "Spectral µP against standard parametrization (CPU)", md, data, quick=args.quick)
    figure(path.with_suffix(".png"), coord, swept)
    print(md)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
