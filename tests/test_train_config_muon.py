"""`hf3d train`'s `optim.name: muon` and `optim.muon:` (docs/muon.md): the section as YAML gives it, its refusals,
the check against the mesh, the lr schedule over the two optimizers' peaks, and one 1-process run resumed from its
own checkpoint (the step after the resume trains to the same loss)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from runs import metrics_records  # noqa: E402

from hf3d.train.build import _lr_scheduler, check_optimizer, peak_lr  # noqa: E402
from hf3d.train.config import TrainConfig  # noqa: E402
from hf3d.train.sections import MuonConfig  # noqa: E402


def _cfg(*overrides: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, ["parallel.tp=1", *overrides])


def test_adamw_is_the_default_and_muon_fills_in_its_defaults():
    assert _cfg().optim.name == "adamw" and _cfg().optim.muon is None
    o = _cfg("optim.name=muon", "optim.weight_decay=0.05").optim
    assert o.muon == MuonConfig(weight_decay=0.05)  # null: optim.weight_decay, written out
    assert (o.muon.lr, o.muon.momentum, o.muon.nesterov, o.muon.ns_steps, o.muon.adjust_lr_fn) == (
        0.02,
        0.95,
        True,
        5,
        None,
    )
    o = _cfg(
        "optim.name=muon",
        "optim.muon.lr=0.01",
        "optim.muon.weight_decay=0",
        "optim.muon.adjust_lr_fn=match_rms_adamw",
        "optim.muon.params=['model.layers.*.mlp.*']",
    ).optim
    assert o.muon == MuonConfig(0.01, adjust_lr_fn="match_rms_adamw", weight_decay=0.0, params=["model.layers.*.mlp.*"])


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_resolved_config_reads_back(tmp_path, name):
    cfg = _cfg(f"optim.name={name}")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert TrainConfig.from_yaml(str(path)).optim == cfg.optim


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["optim.name=lion"], "optim.name must be adamw or muon, got 'lion'"),
        (["optim.muon.lr=0.01"], "optim.muon is set but optim.name is adamw: set optim.name: muon"),
        (["optim.name=muon", "optim.muon.lrr=0.01"], "unknown key 'lrr' in optim.muon; did you mean 'lr'?"),
        (["optim.name=muon", "optim.muon=3"], "optim.muon must be a mapping (or null), got 3"),
        (["optim.name=muon", "optim.muon.lr=0"], "optim.muon.lr must be a number > 0, got 0"),
        (["optim.name=muon", "optim.muon.momentum=1"], "optim.muon.momentum must be in [0, 1)"),
        (["optim.name=muon", "optim.muon.ns_steps=100"], "optim.muon.ns_steps must be 1 to 99"),
        (["optim.name=muon", "optim.muon.adjust_lr_fn=rms"], "optim.muon.adjust_lr_fn must be null or original"),
        (["optim.name=muon", "optim.muon.weight_decay=-1"], "optim.muon.weight_decay must be >= 0"),
        (["optim.name=muon", "optim.muon.params=[]"], "optim.muon.params must be null (the hidden matrices)"),
        (["optim.name=muon", "optim.muon.params=q_proj"], "optim.muon.params must be a list (or null), got 'q_proj'"),
    ],
)
def test_the_section_refuses_in_one_line(overrides, words):
    with pytest.raises(ValueError) as e:
        _cfg(*overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_muon_against_the_mesh():
    for ok in (["parallel.zero_stage=0"], ["parallel.zero_stage=1"], ["parallel.dp_shard=4"]):
        check_optimizer(_cfg("optim.name=muon", *ok), world_size=4)
    check_optimizer(_cfg("parallel.zero_stage=2"), world_size=4)  # AdamW takes any stage
    for bad, got in [
        (["parallel.zero_stage=2"], "got parallel.zero_stage=2)"),
        (["parallel.zero_stage=3"], "got parallel.zero_stage=3)"),
        (["parallel.dp_shard=2"], "got parallel.zero_stage=1, parallel.dp_shard=2)"),
    ]:
        with pytest.raises(ValueError, match="optim.name: muon runs at parallel.zero_stage 0 or 1") as e:
            check_optimizer(_cfg("optim.name=muon", *bad), world_size=4)
        assert got in str(e.value)


def test_the_schedule_scales_each_group_from_its_own_peak():
    """AdamW's groups peak at optim.lr, Muon's (they carry ns_steps) at optim.muon.lr, times µP's scale; one
    factor drives both, so Muon ends at muon.lr · min_lr / lr."""
    o = _cfg("optim.name=muon", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=2").optim
    p = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(3)]
    groups = [{"params": [p[0]]}, {"params": [p[1]], "ns_steps": 5}, {"params": [p[2]], "ns_steps": 5, "lr_scale": 0.5}]
    opt = torch.optim.SGD(groups, lr=1.0)
    for g in opt.param_groups:
        g["lr"] = peak_lr(o, g) * g.get("lr_scale", 1.0)
    sched = _lr_scheduler(opt, o, 10)
    seen = []
    for _ in range(10):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx([0.5e-3, 0.5 * 0.02, 0.25 * 0.02])  # step 1 of a 2-step warm-up
    assert seen[1] == pytest.approx([1e-3, 0.02, 0.01])
    assert seen[-1] == pytest.approx([1e-4, 0.002, 0.001])
    for lrs in seen:
        assert math.isclose(lrs[1] / lrs[0], 20.0) and math.isclose(lrs[2] / lrs[1], 0.5)


RUN = [
    "parallel.tp=1",
    "run.global_batch=4",
    "data.seq_len=32",
    "optim.warmup_steps=1",
    "evals.tasks=[]",
    "samples.prompts=[]",
    "run.sample_prompt=null",
    "run.save_final=false",
    "run.log_every=1",
    "run.steps=3",
    "optim.name=muon",
]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hf3d", "train", "examples/configs/tiny-smollm.yaml", "--set", *RUN]
    cmd += [f"run.output_dir={out}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_a_muon_run_trains_and_resumes(tmp_path):
    """One process, 3 steps saved at step 2; a run resumed from step_2 trains step 3 to the same loss (each group's
    peak lr and Muon's momentum restored)."""
    full = _train(tmp_path / "full", "checkpoint.every=2")
    said = "optimizer: Muon (lr 0.02) on 28 matrices (the hidden ones), AdamW (optim.lr 0.003)"
    assert said in full.stderr + full.stdout
    losses = [r["loss"] for r in metrics_records(tmp_path / "full")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    resolved = yaml.safe_load((tmp_path / "full" / "config.yaml").read_text())["optim"]
    assert resolved["name"] == "muon" and resolved["muon"]["lr"] == 0.02 and resolved["muon"]["weight_decay"] == 0.1
    step_2 = tmp_path / "full" / "checkpoints" / "step_2"
    _train(tmp_path / "resumed", f"checkpoint.resume={step_2}", "checkpoint.every=0")
    (last,) = metrics_records(tmp_path / "resumed")
    assert last["step"] == 3 and last["loss"] == losses[-1]
