"""LR schedules (hf3d/train/lr_schedules.py): each curve at its key steps against hand-computed values, resume
from state_dict, validation messages, and the schedule driving hf3d's ParallelOptimizer to the same
numbers as stock transformers + torch AdamW."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from dist import report, spawn, start_watchdog
from reference import ADAMW, CLIP, LR, batches, oracle_adamw
from transformers import AutoModelForCausalLM

from hf3d.train.lr_schedules import ScheduleConfig, build_lr_scheduler, decay_start_step, describe_schedule

PEAK, MIN = 1e-3, 1e-4


def _lrs(cfg: ScheduleConfig, total: int, extra_steps: int = 0) -> list[float]:
    """The lr each step of the run uses (index i: i steps done), stepping a real optimizer."""
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=cfg.lr)
    sched = build_lr_scheduler(opt, cfg, total)
    out = []
    for _ in range(total + extra_steps):
        out.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr() == [out[-1]]
        opt.step()
        sched.step()
    return out


def _decayed(progress: float, shape: str) -> float:
    g = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)), "1-sqrt": 1 - math.sqrt(progress)}
    return MIN + (PEAK - MIN) * g[shape]


def test_cosine_and_linear_key_steps():
    # warm-up 10 steps, decay over indices [10, 110): index i is at progress (i + 1 - 10) / 100
    for schedule in ("cosine", "linear"):
        lrs = _lrs(ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=10, schedule=schedule), 110, extra_steps=5)
        assert lrs[0] == pytest.approx(PEAK / 10, rel=1e-12)  # the first step is not wasted at lr 0
        assert lrs[4] == pytest.approx(PEAK * 5 / 10, rel=1e-12)
        assert lrs[9] == pytest.approx(PEAK, rel=1e-12)  # the last warm-up step is at the peak
        assert lrs[10] == pytest.approx(_decayed(0.01, schedule), rel=1e-12)
        assert lrs[34] == pytest.approx(_decayed(0.25, schedule), rel=1e-12)
        assert lrs[59] == pytest.approx(_decayed(0.5, schedule), rel=1e-12)
        assert lrs[109] == pytest.approx(MIN, rel=1e-12)  # the last step of the run is at min_lr
        assert lrs[110:] == pytest.approx([MIN] * 5, rel=1e-12)  # and it stays there (cosine does not swing back)
        assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_key_steps(shape):
    # 100 steps, warm-up 10 % (10 steps), decay over the last 20 % = indices [80, 100)
    cfg = ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=0.1, schedule="wsd", decay_steps=0.2, decay_shape=shape)
    lrs = _lrs(cfg, 100)
    assert lrs[0] == pytest.approx(PEAK / 10, rel=1e-12)  # from 0, not from min_lr as in transformers' WSD
    assert lrs[9] == pytest.approx(PEAK, rel=1e-12)
    assert lrs[10:80] == pytest.approx([PEAK] * 70, rel=1e-12)  # stable
    assert lrs[80] == pytest.approx(_decayed(1 / 20, shape), rel=1e-12)  # the decay's first step
    assert lrs[89] == pytest.approx(_decayed(0.5, shape), rel=1e-12)  # half the decay
    assert lrs[99] == pytest.approx(MIN, rel=1e-12)
    if shape == "1-sqrt":
        assert lrs[89] == pytest.approx(MIN + (PEAK - MIN) * (1 - math.sqrt(0.5)), rel=1e-12)
    assert decay_start_step(cfg, 100) == 80


def test_wsd_windows_by_start_and_length():
    # decay_start alone: the decay runs to the end of the run
    by_start = ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=5, schedule="wsd", decay_start=0.8)
    by_length = ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=5, schedule="wsd", decay_steps=20)
    assert _lrs(by_start, 100) == _lrs(by_length, 100)
    assert decay_start_step(by_start, 100) == decay_start_step(by_length, 100) == 80
    # both: a window inside the run, then min_lr to the end
    cfg = ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=5, schedule="wsd", decay_start=40, decay_steps=20)
    lrs = _lrs(cfg, 100)
    assert lrs[39] == pytest.approx(PEAK) and lrs[49] == pytest.approx(_decayed(0.5, "linear"), rel=1e-12)
    assert lrs[59:] == pytest.approx([MIN] * 41, rel=1e-12)
    assert describe_schedule(cfg, 100) == [
        "lr schedule: wsd over 100 steps, peak lr 0.001, min lr 0.0001",
        "lr warm-up: steps 1..5, linear from 0.0002 to 0.001",
        "lr decay (linear): steps 41..60 (20 steps), to 0.0001; at min lr after it until step 100",
    ]


def test_constant():
    cfg = ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=4, schedule="constant")
    lrs = _lrs(cfg, 20)
    assert lrs[:4] == pytest.approx([PEAK / 4, PEAK / 2, 3 * PEAK / 4, PEAK], rel=1e-12)
    assert lrs[4:] == pytest.approx([PEAK] * 16, rel=1e-12)
    assert decay_start_step(cfg, 20) is None
    assert describe_schedule(cfg, 20)[-1] == "lr decay: none (constant at 0.001)"
    # cosine with no warm-up: the first step is already a third into the decay, the last at min_lr (0)
    assert _lrs(ScheduleConfig(lr=PEAK), 3) == pytest.approx([PEAK * 0.75, PEAK * 0.25, 0.0], abs=1e-15)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_state_dict_resumes_at_the_same_lr(schedule):
    """Save after 7 steps (through torch.save, as a checkpoint does), rebuild optimizer and scheduler,
    load: the lrs of the remaining steps equal the uninterrupted run's, in either load order."""
    extra = {"decay_steps": 0.5, "decay_shape": "1-sqrt"} if schedule == "wsd" else {}
    cfg = ScheduleConfig(lr=PEAK, min_lr=MIN, warmup_steps=3, schedule=schedule, **extra)
    whole = _lrs(cfg, 16)
    params = list(torch.nn.Linear(2, 2).parameters())
    opt = torch.optim.AdamW(params, lr=PEAK)
    sched = build_lr_scheduler(opt, cfg, 16)
    for _ in range(7):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    for optimizer_first in (True, False):
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        opt2 = torch.optim.AdamW(params, lr=PEAK)
        if optimizer_first:
            opt2.load_state_dict(saved["opt"])
        sched2 = build_lr_scheduler(opt2, cfg, 16)
        sched2.load_state_dict(saved["sched"])
        if not optimizer_first:
            opt2.load_state_dict(saved["opt"])
        rest = []
        for _ in range(7, 16):
            rest.append(opt2.param_groups[0]["lr"])
            opt2.step()
            sched2.step()
        assert rest == whole[7:], optimizer_first


@pytest.mark.parametrize(
    "kwargs, total, match",
    [
        (dict(lr=1e-4, min_lr=1e-3), 10, r"optim.min_lr \(0.001\) is above optim.lr \(0.0001\)"),
        (dict(warmup_steps=1.5), 10, r"optim.warmup_steps = 1.5: a float is a fraction of the run and must be in"),
        (dict(schedule="wsd", decay_steps=0.0), 10, r"optim.decay_steps = 0.0: a float is a fraction"),
        (dict(schedule="wsd", decay_start=-3), 10, r"optim.decay_start must be >= 0 steps"),
        (dict(schedule="wsd", warmup_steps=8, decay_steps=3), 10, r"optim.warmup_steps \(8\) \+ optim.decay_steps"),
        (dict(schedule="wsd", decay_start=8, decay_steps=3), 10, r"optim.decay_start \(8\) \+ optim.decay_steps \(3\)"),
        (dict(schedule="wsd", decay_start=12), 10, r"optim.decay_start \(12\) is at or past the end of the run"),
        (dict(schedule="wsd", warmup_steps=5, decay_start=3), 10, r"optim.decay_start \(3\) is before the end"),
        (dict(schedule="wsd"), 10, r"wsd needs optim.decay_steps"),
        (dict(schedule="cos"), 10, r"optim.schedule must be one of cosine, linear, wsd, constant, got 'cos'"),
        (dict(schedule="wsd", decay_steps=2, decay_shape="exp"), 10, r"must be one of linear, cosine, 1-sqrt"),
        (dict(decay_steps=2), 10, r"optim.decay_steps apply to optim.schedule: wsd only"),
        (dict(lr=0.0), 10, r"optim.lr must be a number > 0"),
    ],
)
def test_bad_schedules_are_one_line_errors(kwargs, total, match):
    with pytest.raises(ValueError, match=match) as err:
        _lrs(ScheduleConfig(**kwargs), total)
    assert "\n" not in str(err.value)


def test_optimizer_lr_must_be_the_schedule_peak():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 has lr 0.1 but the schedule's peak lr is 0.001"):
        build_lr_scheduler(opt, ScheduleConfig(lr=PEAK), 10)


# ------------------------------------------------------------------------------------------------
# hf3d's ParallelOptimizer (1 process) against stock transformers + torch AdamW, same schedule
# ------------------------------------------------------------------------------------------------
STEPS = 6
SCHED = ScheduleConfig(lr=LR, min_lr=LR / 10, warmup_steps=2, schedule="wsd", decay_steps=3, decay_shape="1-sqrt")


def _stock(model_dir, data):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    sched = build_lr_scheduler(opt, SCHED, STEPS)
    losses, lrs = [], []
    for ids, labels in data:
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, lrs


def _hf3d_worker(model_dir, data, out: str) -> None:
    import hf3d

    start_watchdog(120)
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=1, pp=1))
    opt = oracle_adamw(pm)
    sched = build_lr_scheduler(opt, SCHED, STEPS)
    losses, lrs, norms = [], [], []
    for ids, labels in data:
        lrs.append([g["lr"] for g in opt.param_groups])
        losses.append(pm.train_step(ids, labels).item())
        norms.append(opt.step())  # the scheduler's step-tracking wrapper keeps the returned norm
        sched.step()
        opt.zero_grad()
    report({"losses": losses, "lrs": lrs, "norms": norms}, out)


def test_schedule_drives_parallel_optimizer_like_stock(family_dirs, tmp_path):
    data = batches(STEPS, 4, 16, 101)
    spawn(_hf3d_worker, 1, str(family_dirs["llama"]), data, str(tmp_path / "res.pt"))
    (res,) = torch.load(tmp_path / "res.pt", weights_only=False)
    ref_losses, ref_lrs = _stock(family_dirs["llama"], data)
    assert ref_lrs == pytest.approx([LR / 2, LR, LR, *_wsd_ref(3)], rel=1e-12)
    assert [g[0] for g in res["lrs"]] == ref_lrs and all(len(set(g)) == 1 for g in res["lrs"])
    assert all(isinstance(n, torch.Tensor) and math.isfinite(n.item()) for n in res["norms"])
    # measured max relative loss difference: 2e-7 (float32 reduction order); 20x margin
    for a, b in zip(res["losses"], ref_losses):
        assert abs(a - b) <= 4e-6 * abs(b), (res["losses"], ref_losses)


def _wsd_ref(decay: int) -> list[float]:
    lo = LR / 10
    return [lo + (LR - lo) * (1 - math.sqrt(k / decay)) for k in range(1, decay + 1)]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_a_warm_up_that_does_not_fit_a_short_run_takes_a_tenth_of_it_and_says_so(schedule):
    """A short try of a config written for a long run (40 warm-up steps, 30 steps): the warm-up takes a tenth of
    the run, the derived values say so, and the schedule is that of warmup_steps=3."""
    from hf3d.train.lr_schedules import describe_schedule

    long_warmup = ScheduleConfig(lr=1e-3, warmup_steps=40, schedule=schedule)
    lines = describe_schedule(long_warmup, 30)
    assert "lr warm-up: optim.warmup_steps=40 does not fit the 30-step run, so it warms up over 3 steps" in lines[1]
    assert lines[2] == "lr warm-up: steps 1..3, linear from 0.000333333 to 0.001"
    fitted = ScheduleConfig(lr=1e-3, warmup_steps=3, schedule=schedule)
    assert _lrs(long_warmup, 30) == _lrs(fitted, 30)
    assert _lrs(fitted, 30)[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-12)  # it does warm up
    assert describe_schedule(ScheduleConfig(lr=1e-3, warmup_steps=20, schedule=schedule), 200)[1].startswith(
        "lr warm-up: steps 1..20"
    )  # where it fits, nothing changes


@pytest.mark.parametrize("steps, like, line", [(5, 0, ""), (10, 1, " (step 1 runs at the peak lr 0.001 already)")])
def test_a_short_run_that_would_not_warm_up_at_all_says_so(steps, like, line):
    """A run under 20 steps with 20 warm-up steps: a tenth of the run is under 2 steps (none, or one that runs at
    the peak lr), so the run does not warm up, and the lines say that, not '1 step(s)' or '0 step(s)'."""
    from hf3d.train.lr_schedules import describe_schedule

    too_long = ScheduleConfig(lr=1e-3, warmup_steps=20, schedule="cosine")
    lines = describe_schedule(too_long, steps)
    assert f"does not fit the {steps}-step run, so it does not warm up; set optim.warmup_steps" in lines[1], lines
    assert lines[2] == "lr warm-up: none" + line
    lrs = _lrs(too_long, steps)
    assert lrs == _lrs(ScheduleConfig(lr=1e-3, warmup_steps=like, schedule="cosine"), steps)
    assert max(lrs[1:]) < lrs[0] <= 1e-3  # no step's lr rises above the first's


def test_a_one_step_warm_up_is_said_to_be_none():
    """optim.warmup_steps=1 runs step 1 at lr / 1: the line says there is no warm-up, and the lr of step 1 is the
    peak indeed."""
    from hf3d.train.lr_schedules import describe_schedule

    one = ScheduleConfig(lr=2e-4, warmup_steps=1, schedule="wsd", decay_steps=1)
    assert describe_schedule(one, 6)[1] == "lr warm-up: none (step 1 runs at the peak lr 0.0002 already)"
    assert _lrs(one, 6)[0] == 2e-4


@pytest.mark.parametrize(
    "extra, fix",
    [
        (dict(decay_steps=0.1), "set optim.warmup_steps to at most 9 (a short try: --set optim.warmup_steps=0)"),
        (dict(decay_start=0.5), "set optim.warmup_steps to at most 5 or start the decay later"),
    ],
)
def test_a_wsd_warm_up_that_does_not_fit_is_refused_with_its_fix(extra, fix):
    """wsd keeps the windows it was given (the decay's place is the user's choice): a warm-up that runs into the
    decay is refused, and the same line names the largest warm-up that fits."""
    from hf3d.train.lr_schedules import describe_schedule

    with pytest.raises(ValueError, match=re.escape(fix)):
        describe_schedule(ScheduleConfig(lr=1e-3, warmup_steps=20, schedule="wsd", **extra), 10)
