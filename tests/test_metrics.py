"""hf3d/train/metrics.py: the process's own peak memory, throughput / TFLOP/s / MFU, which trackers are usable;
hf3d/train/plots.py: the loss-curve PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf3d.train import metrics
from hf3d.train.metrics import available_trackers, peak_memory_bytes, throughput, tracker_install_hint
from hf3d.train.plots import plot_loss_curve

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM needs Linux /proc")
def test_child_reports_its_own_peak_not_its_parents():
    """A child started while this process holds 1 GiB more reports its own peak (VmHWM), far below
    ours. Measured: parent 1405 MiB, child 379 MiB (the child's ru_maxrss said 1405 MiB: the parent's,
    carried over fork + exec, which is what the old ru_maxrss-based figure reported)."""
    held = torch.ones(2**28)  # 1 GiB, touched
    parent = peak_memory_bytes()
    assert parent >= held.numel() * 4
    code = "from hf3d.train.metrics import peak_memory_bytes; print(peak_memory_bytes())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child = int(proc.stdout.strip())
    assert 0 < child < parent - 2**29, (child, parent)
    del held


def test_peak_memory_is_a_high_water_mark():
    before = peak_memory_bytes()
    x = torch.ones(2**26)  # 256 MiB
    during = peak_memory_bytes()
    del x
    assert during >= before and during >= 2**28
    assert peak_memory_bytes() >= during  # the peak does not come down when the memory is freed


def test_throughput_math():
    # 8192 tokens in 2 s on 4 devices at 1e9 FLOPs per token
    out = throughput(8192, 2.0, 4, 1e9, 2e12)
    assert out == pytest.approx(
        {"tokens_per_sec": 4096.0, "tokens_per_sec_per_device": 1024.0, "tflops": 1.024, "mfu": 0.512}, rel=1e-12
    )
    assert set(throughput(8192, 2.0, 4, 1e9)) == {"tokens_per_sec", "tokens_per_sec_per_device", "tflops"}
    assert "mfu" not in throughput(8192, 2.0, 4, 1e9, None)
    with pytest.raises(ValueError, match="seconds > 0"):
        throughput(8192, 0.0, 4, 1e9)


def test_trackers_split_by_what_accelerate_finds(monkeypatch):
    from accelerate import tracking
    from accelerate.utils import LoggerType

    # as if only tensorboard were installed: accelerate's own list of available trackers
    monkeypatch.setattr(tracking, "_available_trackers", [LoggerType.TENSORBOARD])
    usable, missing = available_trackers(["wandb", "tensorboard", "comet_ml", "wandb"])
    assert usable == ["tensorboard"] and missing == ["wandb", "comet_ml"]
    assert available_trackers("tensorboard") == (["tensorboard"], [])
    assert available_trackers(["all", "wandb"]) == (["tensorboard"], [])  # "all": what is installed
    hint = tracker_install_hint(missing)
    assert hint == "hf3d: not logging to wandb, comet_ml: not installed (pip install wandb comet-ml)"
    with pytest.raises(ValueError, match=r"unknown experiment tracker 'weights-and-biases': choose from all, aim"):
        available_trackers(["weights-and-biases"])


def test_trackers_in_this_environment():
    """Unpatched: a tracker is usable exactly when accelerate would initialise it."""
    from accelerate.tracking import get_available_trackers

    names = ["tensorboard", "trackio", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive"]
    usable, missing = available_trackers(names)
    installed = {t.value for t in get_available_trackers()}
    assert usable == [n for n in names if n in installed] and missing == [n for n in names if n not in installed]
    assert metrics.available_trackers([]) == ([], [])


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("with_eval", [False, True], ids=["train-only", "with-eval"])
def test_loss_curve_png(tmp_path, with_eval):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    records = [{"step": s, "loss": 8.0 / s**0.5, "consumed_tokens": 1024 * s} for s in range(1, 121)]
    if with_eval:
        records += [{"step": s, "eval_loss": 8.5 / s**0.5} for s in (30, 60, 90, 120)]
    path = _write_metrics(tmp_path / "metrics.jsonl", records)
    with path.open("a") as f:
        f.write('{"step": 121, "loss": 0.7')  # a last line cut short by an interruption is skipped
    out = plot_loss_curve(path, tmp_path / "plots" / "loss_curve.png", title="tiny run")
    assert out == tmp_path / "plots" / "loss_curve.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(out).shape
    assert width > 600 and height > 400
    assert not list(out.parent.glob("*.tmp"))


def test_loss_curve_marks_the_stage_starts(tmp_path):
    """A stage starting at step s (0-based) is the record of step s + 1 on: its line falls between the
    records s and s + 1; stage 0 and starts outside the plotted steps get none; the lines are drawn."""
    pytest.importorskip("matplotlib")
    from hf3d.train.plots import stage_marks

    stages = [(0, "short"), (40, "long-32k"), (80, "long-64k"), (500, "later")]
    assert stage_marks(stages, [float(s) for s in range(1, 121)]) == [(40.5, "long-32k"), (80.5, "long-64k")]
    records = [{"step": s, "loss": 8.0 / s**0.5} for s in range(1, 121)]
    path = _write_metrics(tmp_path / "metrics.jsonl", records)
    plain = plot_loss_curve(path, tmp_path / "plain.png").read_bytes()
    marked = plot_loss_curve(path, tmp_path / "marked.png", stages=stages).read_bytes()
    assert marked != plain


def test_loss_curve_without_matplotlib_returns_none(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import matplotlib...` raise ImportError
    path = _write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 3.0}])
    assert plot_loss_curve(path, tmp_path / "loss_curve.png") is None
    assert not (tmp_path / "loss_curve.png").exists()


def test_loss_curve_of_no_losses_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    path = _write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "loss": float("nan")}])
    with pytest.raises(ValueError, match="has no finite `loss` or `eval_loss` to plot"):
        plot_loss_curve(path, tmp_path / "loss_curve.png")


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_the_loss_curve_names_the_run_shows_every_eval_series_and_marks_each_resume():
    """What a reader gets from the figure, read from its artists: the title given (the run's name), one legend
    that lists the train loss, the eval loss, each source's eval loss and each downstream task's acc_norm, one
    dashed line with a label per resume (records with `resumed_from`, just before them), and legend boxes that
    lie outside the loss axes (so they cover no point)."""
    pytest.importorskip("matplotlib")
    from hf3d.train.plots import draw_loss_curve, resume_marks

    records = [{"step": s, "loss": 8.0 / s**0.5} for s in range(1, 13)]
    for s in (4, 8, 12):
        records[s - 1].update({"eval_loss": 7.0 / s**0.5, "eval_loss/plays": 6.9 / s**0.5, "eval_loss/poems": 7.3})
        records[s - 1].update({"downstream/word/acc_norm": 0.3, "downstream/average/acc_norm": 0.3})
    records[4]["resumed_from"] = "out/checkpoints/step_4"  # the first record of a run resumed after step 4
    records[8]["resumed_from"] = "out/checkpoints/step_8"
    assert resume_marks(records) == [(4.5, "resumed from step_4"), (8.5, "resumed from step_8")]

    fig = draw_loss_curve(records, title="my-run")
    loss_ax = fig.axes[0]
    assert loss_ax.get_title() == "my-run"
    assert _legend_labels(fig) == [
        "train loss",
        "eval loss",
        "eval loss: plays",
        "eval loss: poems",
        "word acc_norm",
        "average acc_norm",
    ]
    resume_lines = [a for a in loss_ax.lines if a.get_gid() == "resume"]
    assert [line.get_xdata()[0] for line in resume_lines] == [4.5, 8.5]
    assert [t.get_text() for t in loss_ax.texts if t.get_gid() == "resume"] == [
        "resumed from step_4",
        "resumed from step_8",
    ]
    fig.canvas.draw()
    for legend in fig.legends:
        assert not any(legend.get_window_extent().overlaps(ax.get_window_extent()) for ax in fig.axes)

    plain = draw_loss_curve([{"step": s, "loss": 3.0} for s in (1, 2)])
    assert [a for a in plain.axes[0].lines if a.get_gid() == "resume"] == [] and _legend_labels(plain) == ["train loss"]


def test_the_png_carries_its_title(tmp_path):
    """The title is also in the PNG's metadata, where a test (or a tool) reads it without looking."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = _write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}])
    out = plot_loss_curve(path, tmp_path / "loss_curve.png", title="run-7")
    assert Image.open(out).text["Title"] == "run-7"
