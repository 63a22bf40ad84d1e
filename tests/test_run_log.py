"""What a run of `hf3d train` tells its user, read from a short run on a mixture of two sources and its resume:
step numbers counted from 1 in every line and record, the warm-up and the stages said as they happen, each
source's held-out loss beside the total (equal to stock transformers' on the same rows), and the loss curve
titled with the run's name and marked where it resumed.

One process trains steps 1-4 (checkpoints after 2 and 4), then the same output folder is resumed from step_2
at cp=2 (2 processes, each row split over both): it trains steps 3 and 4 again and writes the export the eval
losses are checked against."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
EVAL_ATOL = 3e-6  # ~20x the largest |eval loss - stock| measured (1.6e-7)
CONFIG = {
    "model": {"path": "examples/models/tiny-smollm"},
    "data": {
        "seq_len": 32,
        "stages": [
            {
                "name": "main",
                "start_step": 0,
                "sources": [
                    {"path": "examples/data/shakespeare.jsonl", "name": "plays", "weight": 0.7},
                    {"path": "examples/data/poems.jsonl", "name": "poems", "weight": 0.3},
                ],
            },
            {
                "name": "anneal",
                "start_step": 2,
                "sources": [
                    {"path": "examples/data/shakespeare.jsonl", "name": "plays", "weight": 0.5},
                    {"path": "examples/data/poems.jsonl", "name": "poems", "weight": 0.5},
                ],
            },
        ],
        "eval": {"fraction": 0.05, "every": 2, "batches": 1},
    },
    "parallel": {"tp": 1, "num_microbatches": 1},
    "optim": {"lr": 3.0e-3, "warmup_steps": 2, "schedule": "wsd", "decay_steps": 1},
    "run": {"steps": STEPS, "global_batch": 8, "log_every": 1, "sample_prompt": None},
    "checkpoint": {"every": 2, "keep_last": 0},
}


def _train(launcher: list[str], config: Path, *extra: str) -> str:
    cmd = [*launcher, "-m", "hf3d", "train", str(config), "--set", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("runlog")
    config, out = base / "mix.yaml", base / "my-run"
    config.write_text(yaml.safe_dump(CONFIG))
    first = _train([sys.executable], config, f"run.output_dir={out}", "run.save_final=false")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    mesh = ["parallel.cp=2", "parallel.num_microbatches=2"]
    resume = [f"checkpoint.resume={out}/checkpoints/step_2", "checkpoint.replace_later_steps=true"]  # step_4 goes
    resumed = _train(torchrun, config, f"run.output_dir={out}", *resume, *mesh)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return config, out, first, resumed, records


def _step_numbers(text: str) -> list[int]:
    """Every step number a reader meets, in order: `step N`, `steps A..B`, `step_N` (not `N steps`, a count)."""
    found = []
    for m in re.finditer(r"\bsteps? (\d+)(?:\.\.(\d+))?|\bstep_(\d+)", text):
        found += [int(g) for g in m.groups() if g is not None]
    return found


def test_every_step_number_is_counted_from_1(run):
    """Each line of both runs (derived values, stage and eval lines, log lines, checkpoints, resume) names steps
    1..4 only; the first log line of the 4-step run is step 1 and the last step 4; the stage that starts after
    2 steps (start_step 2) says step 3, as its records do; metrics.jsonl counts 1..4."""
    _, out, first, resumed, records = run
    lines = [line for text in (first, resumed) for line in text.splitlines() if line.startswith(("hf3d:", "step "))]
    numbers = _step_numbers("\n".join(lines))
    assert numbers and set(numbers) <= set(range(1, STEPS + 1)), [ln for ln in lines if _step_numbers(ln)]
    logged = [int(m) for m in re.findall(r"^step (\d+)/4:", first, flags=re.M)]
    assert logged == [1, 2, 3, 4]
    assert "hf3d: lr warm-up: steps 1..2, linear from 0.0015 to 0.003" in first
    assert "hf3d: lr decay (linear): step 4, to 0" in first
    assert "hf3d: data stage 'anneal' starts at step 3 (start_step 2)" in first
    assert "hf3d: data stage main: steps 1..2: plays 70.0%, poems 30.0%" in first
    assert "hf3d: data stage anneal: steps 3..4: plays 50.0%, poems 50.0%" in first
    assert f"hf3d: saved {out}/checkpoints/step_2" in first
    assert "2 steps done, training goes on at step 3" in resumed
    assert (
        "hf3d: warning: checkpoint.replace_later_steps: the later checkpoints of another trajectory (step_4) are "
        "replaced as the run reaches their steps" in resumed
    )
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["stage"] for r in records] == [0, 0, 1, 1]  # the stage of step 3 is anneal's, as the line says
    assert records[0]["lr"] == pytest.approx(1.5e-3) and records[1]["lr"] == pytest.approx(3e-3)  # it warms up


def test_each_source_has_its_eval_loss_beside_the_total(run):
    """Steps 2 and 4 evaluate; each record holds eval_loss/plays and eval_loss/poems, whose token-weighted mean is
    the total, and the log line shows them."""
    _, _, first, resumed, records = run
    for r in records:
        assert ("eval_loss/plays" in r) == ("eval_loss/poems" in r) == ("eval_loss" in r) == (r["step"] in (2, 4))
    assert re.search(r"^step 4/4: .* eval_loss \d\.\d+ \(ppl [\d.]+; plays \d\.\d+, poems \d\.\d+\)$", resumed, re.M)
    assert "(plays 6 rows, poems 2 rows)" in first  # 8 rows by the first stage's weights 0.7 / 0.3


def test_the_eval_losses_are_stock_transformers_on_the_same_rows(run):
    """The last evaluation (after step 4, at cp=2) against stock transformers on the exported weights of
    that step: each source's token-mean cross-entropy over its own held-out rows, and the total over all of
    them. Each row is checked to be one of its source's held-out windows, so a row counted under the wrong source
    fails too. Measured |difference|: at most 1.6e-7 (fp32, cp=2); tolerance EVAL_ATOL."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf3d.data import DataPipeline

    _, out, _, _, records = run
    data = _data_config(out)
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    pipe = DataPipeline(data, tokenizer, global_batch=8, dp_rank=0, dp_size=1, total_steps=STEPS)
    names = pipe.eval_names
    assert names == ["plays", "poems"]
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32, attn_implementation="sdpa")
    sums = {name: [0.0, 0] for name in names}
    held = {  # each source's held-out windows (inputs), never trained on
        name: {tuple(src.read(k)[0][:-1].tolist()) for k in range(pipe.num_train[name], src.num_windows)}
        for name, src in pipe.sources.items()
    }
    for batch, sources in zip(pipe.eval_batches(), pipe.eval_sources()):
        for ids, targets, pos, source in zip(batch["input_ids"], batch["shift_labels"], batch["position_ids"], sources):
            name = names[int(source)]
            assert tuple(ids.tolist()) in held[name], name
            with torch.no_grad():
                logits = model(ids[None], position_ids=pos[None], use_cache=False).logits[0]
            ce = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
            sums[name][0] += ce.item()
            sums[name][1] += int((targets != -100).sum())
    last = records[-1]
    for name, (s, n) in sums.items():
        assert abs(last[f"eval_loss/{name}"] - s / n) < EVAL_ATOL, (name, last[f"eval_loss/{name}"], s / n)
    total = sum(s for s, _ in sums.values()) / sum(n for _, n in sums.values())
    assert abs(last["eval_loss"] - total) < EVAL_ATOL, (last["eval_loss"], total)
    assert abs(last["eval_loss/plays"] - last["eval_loss/poems"]) > 1e-3  # two different numbers, not one copied


def _data_config(out: Path):
    from hf3d.train.config import TrainConfig

    return TrainConfig.from_yaml(str(out / "config.yaml")).data


def test_the_loss_curve_is_the_runs_and_marks_the_resume(run):
    """The PNG is titled with the output folder's name (not the model's), and the records it is drawn from mark
    one resume, before step 3."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from hf3d.train.plots import resume_marks

    _, out, _, _, records = run
    assert Image.open(out / "loss_curve.png").text["Title"] == "my-run"
    assert [x for x, _ in resume_marks(records)] == [2.5]
    assert records[2]["resumed_from"] == str(out / "checkpoints" / "step_2")
