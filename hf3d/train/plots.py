"""The loss curve of a run as a PNG (`loss_curve.png`, linked from the model card).

matplotlib is optional (the `dev` extra): without it `plot_loss_curve` returns None. The figure is
drawn on matplotlib's Agg canvas directly, without pyplot, so no display and no global backend
switch is involved.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from ..utils import files


def _records(metrics_jsonl: Path) -> list[dict]:
    out = []
    for line in Path(metrics_jsonl).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interruption
        if isinstance(record, dict) and isinstance(record.get("step"), int | float):
            out.append(record)
    return out


def _points(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = sorted(
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and math.isfinite(float(r[key]))
    )
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _ema(values: list[float], span: int) -> list[float]:
    alpha, out, avg = 2 / (span + 1), [], values[0]
    for v in values:
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg)
    return out


def plot_loss_curve(
    metrics_jsonl: Path, out_png: Path, *, title: str | None = None, stages: list[tuple[int, str]] = ()
) -> Path | None:
    """Draw the loss curve of a metrics.jsonl (`draw_loss_curve`) into `out_png`; returns its path, or None
    when matplotlib is not installed. Raises ValueError when the file has no finite loss to draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    fig = draw_loss_curve(_records(metrics_jsonl), title=title, stages=stages, source=str(metrics_jsonl))
    out_png.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", metadata={"Title": title} if title else None)  # the title, readable by tools
    files.write_file(out_png, png.getvalue(), replace=True)
    return out_png


def draw_loss_curve(records: list[dict], *, title: str | None = None, stages=(), source: str = "the records"):
    """A matplotlib Figure (Agg canvas) of metrics.jsonl records: train loss against step, `eval_loss` points and
    each source's `eval_loss/<source>` where records have them (and a MoE run's expert load imbalance on a right
    axis), the downstream scores (acc_norm per task and their average) in a lower panel when records have them,
    one legend for all of these under the plot (where it covers no point), and the run's `title` on top.

    stages: (start_step, name) of the data stages; each start after step 0 inside the plotted steps is
    marked by a vertical line with the stage's name (a stage starting at step s is the record of step s + 1 on).
    A record with `resumed_from` (the first of a resumed run) gets a dashed line before it, labelled with the
    checkpoint resumed.

    The y axis is logarithmic when the losses span more than a factor of 3. When records carry
    `consumed_tokens` (or `tokens`, cumulative), a top axis shows tokens. Raises ValueError when the
    records have no finite loss to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, FormatStrFormatter, MaxNLocator

    steps, losses = _points(records, "loss")
    eval_steps, eval_losses = _points(records, "eval_loss")
    if not steps and not eval_steps:
        raise ValueError(f"{source} has no finite `loss` or `eval_loss` to plot")

    scores = downstream_series(records)
    fig = Figure(figsize=(7, 6.8 if scores else 4.8), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    if scores:
        ax, low = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
        _downstream_panel(low, scores)
    else:
        ax = fig.add_subplot()
    if steps:
        smooth = len(steps) >= 50
        ax.plot(steps, losses, color="tab:blue", lw=0.8, alpha=0.35 if smooth else 1.0, label="train loss")
        if smooth:
            ax.plot(steps, _ema(losses, max(5, len(steps) // 50)), color="tab:blue", lw=1.6, label="train loss (EMA)")
    if eval_steps:
        ax.plot(eval_steps, eval_losses, "o--", color="tab:orange", ms=5, lw=1, label="eval loss")
    every = losses + eval_losses + _eval_by_source(ax, records)
    if min(every) > 0 and max(every) / min(every) > 3:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 3, 4, 6 rather than 3x10^0
        if max(every) / min(every) < 100:  # within two decades the minor ticks carry labels: plain numbers too
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    _mark_stages(ax, stage_marks(stages, steps + eval_steps))
    _mark_resumes(ax, resume_marks(records))
    if not scores:
        ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(True, which="both", alpha=0.3)
    load_steps, imbalance = _points(records, "moe/load_imbalance")
    if load_steps:  # a MoE run: the expert load on its own axis, at the right
        right = ax.twinx()
        right.plot(load_steps, imbalance, color="tab:green", lw=0.8, alpha=0.7, label="expert load max / mean")
        right.set_ylabel("expert load max / mean (worst layer)", color="tab:green")
        right.tick_params(axis="y", colors="tab:green")
    top = _token_axis(ax, records)
    if top is not None:
        top.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1.5M
    if title:
        ax.set_title(title)
    handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(3, len(handles)), fontsize=8, frameon=False)
    return fig


EVAL_SOURCE_STYLES = [("tab:red", "^"), ("tab:purple", "s"), ("tab:brown", "D"), ("tab:pink", "v"), ("tab:olive", "P")]


def _eval_by_source(ax, records: list[dict]) -> list[float]:
    """Each source's eval loss (`eval_loss/<source>`), points joined by a thin dashed line; returns the values."""
    names = list(dict.fromkeys(k for r in records for k in r if k.startswith("eval_loss/")))
    values = []
    for i, key in enumerate(names):
        color, marker = EVAL_SOURCE_STYLES[i % len(EVAL_SOURCE_STYLES)]
        xs, ys = _points(records, key)
        ax.plot(xs, ys, f"{marker}:", color=color, ms=4, lw=0.8, label=f"eval loss: {key[len('eval_loss/') :]}")
        values += ys
    return values


def resume_marks(records: list[dict]) -> list[tuple[float, str]]:
    """Where a run was resumed: just before the first record of each resumed run (`resumed_from`), with the name
    of the checkpoint it resumed."""
    return [
        (r["step"] - 0.5, f"resumed from {Path(str(r['resumed_from'])).name}") for r in records if "resumed_from" in r
    ]


def _mark_resumes(ax, marks: list[tuple[float, str]]) -> None:
    """A dashed vertical line at each resume, its label at the bottom (the stages' labels are at the top)."""
    for x, label in marks:
        ax.axvline(x, color="tab:red", lw=1, ls="--", gid="resume")
        ax.annotate(
            label,
            (x, 0),
            xycoords=("data", "axes fraction"),
            xytext=(3, 3),
            textcoords="offset points",
            rotation=90,
            va="bottom",
            fontsize=8,
            color="tab:red",
            gid="resume",
        )


def _mark_stages(ax, marks: list[tuple[float, str]]) -> None:
    """A dotted vertical line at each stage start, with the stage's name."""
    for x, name in marks:
        ax.axvline(x, color="tab:gray", lw=1, ls=":")
        ax.annotate(
            name,
            (x, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            rotation=90,
            va="top",
            fontsize=8,
            color="tab:gray",
        )


def downstream_series(records: list[dict], metric: str = "acc_norm") -> dict[str, tuple[list[float], list[float]]]:
    """{task: (steps, scores)} of the downstream evaluations the records hold (`downstream/<task>/<metric>`), the
    macro average last."""
    prefix, suffix = "downstream/", f"/{metric}"
    tasks = list(dict.fromkeys(k for r in records for k in r if k.startswith(prefix) and k.endswith(suffix)))
    tasks.sort(key=lambda k: k == f"{prefix}average{suffix}")
    return {k[len(prefix) : -len(suffix)]: _points(records, k) for k in tasks}


def _downstream_panel(ax, scores: dict[str, tuple[list[float], list[float]]]) -> None:
    """acc_norm of each downstream task against step, the average dashed."""
    for task, (steps, values) in scores.items():
        average = task == "average"
        ax.plot(steps, values, "s--" if average else "o-", ms=4, lw=1.6 if average else 1, label=f"{task} acc_norm")
    ax.set_xlabel("step")
    ax.set_ylabel("downstream acc_norm")
    ax.grid(True, alpha=0.3)


def stage_marks(stages: list[tuple[int, str]], steps: list[float]) -> list[tuple[float, str]]:
    """Where the stage lines go: between the last record of one stage and the first of the next."""
    if not steps:
        return []
    lo, hi = min(steps), max(steps)
    return [(start + 0.5, name) for start, name in stages if start > 0 and lo <= start + 0.5 <= hi]


def _token_axis(ax, records: list[dict]):
    """A top axis in tokens, interpolated from (step, tokens) pairs, when the records have them."""
    key = next((k for k in ("consumed_tokens", "tokens") if any(k in r for r in records)), None)
    if key is None:
        return None
    pairs = sorted({(float(r["step"]), float(r[key])) for r in records if isinstance(r.get(key), int | float)})
    steps, tokens = [p[0] for p in pairs], [p[1] for p in pairs]
    increasing = lambda xs: all(b > a for a, b in zip(xs, xs[1:]))
    if len(pairs) < 2 or not increasing(steps) or not increasing(tokens):
        return None  # not a monotonic mapping (several records per step, a restart): no axis rather than a wrong one
    # extend the map linearly past the ends, so that the axis covers the margins of the plot too
    rate = (tokens[-1] - tokens[0]) / (steps[-1] - steps[0])
    import numpy as np

    xs = np.array([steps[0] - 1e9, *steps, steps[-1] + 1e9])
    ys = np.array([tokens[0] - 1e9 * rate, *tokens, tokens[-1] + 1e9 * rate])
    top = ax.secondary_xaxis("top", functions=(lambda s: np.interp(s, xs, ys), lambda t: np.interp(t, ys, xs)))
    top.set_xlabel("tokens")
    return top
