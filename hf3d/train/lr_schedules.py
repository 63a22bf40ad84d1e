"""Learning-rate schedules: linear warm-up, then cosine, linear, warmup-stable-decay (WSD) or constant.

The curves after warm-up are transformers' own (`get_scheduler("cosine_with_min_lr")`, and
`get_wsd_schedule` for linear and WSD, whose `min_lr_ratio` makes linear end at min_lr); hf3d adds
only what they lack:

- step numbering: the lr of the step with index i (0-based; the scheduler's `last_epoch`, the number
  of optimizer steps done before it) is transformers' curve at i + 1. So the first warm-up step runs
  at lr / warmup_steps instead of 0, the last warm-up step at lr, and the last step of the run
  exactly at min_lr. Stepping past the run stays at the end value (cosine does not swing back up).
  What the run prints counts steps from 1, as metrics.jsonl does: step n is the one with index n - 1.
- warm-up is linear from 0 in every schedule (transformers' WSD warms up from min_lr).
- an explicit, absolute min_lr, and warm-up / decay lengths as a number of steps or a fraction of
  the run, validated with a message per mistake.

Resuming: the scheduler's state is its position (`last_epoch`); the curve comes from the config and
the total steps given when it is built, and `load_state_dict` writes the position's lr into the
optimizer at once, whatever order the optimizer and scheduler are restored in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ..data.summary import steps_span

SCHEDULES = ("cosine", "linear", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass
class ScheduleConfig:
    """The learning-rate schedule (fields of the `optim` section of `hf3d train`)."""

    lr: float = 3e-3
    """Peak learning rate, reached at the last warm-up step."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (absolute, not a ratio of lr); unused by `constant`."""
    warmup_steps: int | float = 0
    """Linear warm-up from 0: an int number of steps (step k of n runs at k/n of lr, so 1 is no warm-up), or a
    float in (0, 1), a fraction of the run."""
    schedule: str = "cosine"
    """cosine | linear (decay from lr to min_lr over the whole run after warm-up) | wsd (warm-up,
    stable at lr, decay to min_lr over the window set by decay_start / decay_steps) | constant."""
    decay_start: int | float | None = None
    """wsd only: steps done before the decay starts (an int), or a fraction of the run in (0, 1).
    Alone, the decay runs to the end of the run."""
    decay_steps: int | float | None = None
    """wsd only: length of the decay (an int number of steps, or a fraction of the run in (0, 1):
    `0.1` decays over the last 10 %). Alone, the decay ends with the run; with decay_start, the lr
    stays at min_lr after the window."""
    decay_shape: str | None = None
    """wsd only: linear (default) | cosine | 1-sqrt (1 - sqrt(progress), Hägele et al. 2024)."""

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or not self.lr > 0:
            raise ValueError(f"optim.lr must be a number > 0, got {self.lr!r}")
        if isinstance(self.min_lr, bool) or not isinstance(self.min_lr, int | float) or self.min_lr < 0:
            raise ValueError(f"optim.min_lr must be a number >= 0, got {self.min_lr!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr:g}) is above optim.lr ({self.lr:g}): set min_lr <= lr")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        _check_length("warmup_steps", self.warmup_steps, allow_zero=True)
        wsd_fields = {"decay_start": self.decay_start, "decay_steps": self.decay_steps, "decay_shape": self.decay_shape}
        if self.schedule != "wsd":
            given = [k for k, v in wsd_fields.items() if v is not None]
            if given:
                raise ValueError(
                    f"optim.{' and optim.'.join(given)} apply to optim.schedule: wsd only, not {self.schedule!r}: "
                    "remove them or set schedule: wsd"
                )
            return
        if self.decay_start is None and self.decay_steps is None:
            raise ValueError(
                "optim.schedule: wsd needs optim.decay_steps (e.g. 0.1: decay over the last 10 % of the run) "
                "and/or optim.decay_start (the step, or fraction of the run, where the decay starts)"
            )
        if self.decay_start is not None:
            _check_length("decay_start", self.decay_start, allow_zero=True)
        if self.decay_steps is not None:
            _check_length("decay_steps", self.decay_steps, allow_zero=False)
        if self.decay_shape is not None and self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"optim.decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}")


def _check_length(name: str, value: Any, *, allow_zero: bool) -> None:
    """An int number of steps (>= 0, or >= 1) or a float fraction of the run in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"optim.{name} must be an int number of steps or a fraction in (0, 1), got {value!r}")
    if isinstance(value, float) and not 0 < value < 1:
        raise ValueError(
            f"optim.{name} = {value!r}: a float is a fraction of the run and must be in (0, 1); "
            "give a number of steps as an int"
        )
    if isinstance(value, int) and value < (0 if allow_zero else 1):
        raise ValueError(f"optim.{name} must be {'>= 0' if allow_zero else '>= 1'} steps, got {value}")


def _steps(value: int | float, total_steps: int) -> int:
    """A number of steps; a fraction rounds to the nearest step, and to at least one."""
    return value if isinstance(value, int) else max(1, round(value * total_steps))


def fitted_warmup(cfg: ScheduleConfig, total_steps: int) -> tuple[int, str | None]:
    """The warm-up steps of a run of `total_steps`, and a line saying so where the configured warm-up did not fit
    (None where it did). A cosine, linear or constant schedule whose warm-up leaves no step to decay over (a short
    try of a config written for a long run) warms up over a tenth of the run instead; a wsd schedule keeps its
    windows, checked against each other below."""
    asked = _steps(cfg.warmup_steps, total_steps)
    room = total_steps if cfg.schedule == "constant" else total_steps - 1
    if cfg.schedule == "wsd" or asked <= room:
        return asked, None
    fitted = total_steps // 10
    # a one-step warm-up runs its step at the peak lr already: no warm-up at all
    how = f"it warms up over {fitted} steps, a tenth of the run" if fitted > 1 else "it does not warm up"
    return fitted, (
        f"lr warm-up: optim.warmup_steps={asked} does not fit the {total_steps}-step run, so {how}; set "
        "optim.warmup_steps to choose"
    )


def _window(cfg: ScheduleConfig, total_steps: int) -> tuple[int, int | None, int | None]:
    """(warmup steps, decay start, decay end) in step indices of the run; (w, None, None) for constant."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"the run's total steps must be an int >= 1, got {total_steps!r}")
    warmup, _ = fitted_warmup(cfg, total_steps)
    if cfg.schedule == "constant":
        return warmup, None, None
    if cfg.schedule in ("cosine", "linear"):
        return warmup, warmup, total_steps
    if cfg.decay_start is not None:
        start = _steps(cfg.decay_start, total_steps)
        if start >= total_steps:
            raise ValueError(
                f"optim.decay_start ({start}) is at or past the end of the run ({total_steps} steps): "
                "start the decay earlier"
            )
        length = total_steps - start if cfg.decay_steps is None else _steps(cfg.decay_steps, total_steps)
        if start + length > total_steps:
            raise ValueError(
                f"optim.decay_start ({start}) + optim.decay_steps ({length}) is past the end of the run "
                f"({total_steps} steps): start the decay earlier or shorten it"
            )
    else:
        length = _steps(cfg.decay_steps, total_steps)
        start = total_steps - length
    if warmup > start:
        raise ValueError(
            f"optim.warmup_steps ({warmup}) + optim.decay_steps ({length}) do not fit in the "
            f"run: the decay would start at step {start + 1}, before the warm-up ends at step {warmup}; set "
            f"optim.warmup_steps to at most {start} (a short try: --set optim.warmup_steps=0) or run longer"
            if cfg.decay_start is None
            else f"optim.decay_start ({start}) is before the end of the warm-up (optim.warmup_steps = {warmup}): "
            f"set optim.warmup_steps to at most {start} or start the decay later"
        )
    return warmup, start, start + length


def decay_start_step(cfg: ScheduleConfig, total_steps: int) -> int | None:
    """Steps done before the lr starts to decay (the index of the first decaying step); None for
    `constant`. For cosine and linear this is the end of the warm-up."""
    return _window(cfg, total_steps)[1]


def describe_schedule(cfg: ScheduleConfig, total_steps: int) -> list[str]:
    """Lines for the start of a run: the schedule, the warm-up, the decay window, min lr."""
    warmup, start, end = _window(cfg, total_steps)
    shape = (cfg.decay_shape or "linear") if cfg.schedule == "wsd" else cfg.schedule
    min_lr = cfg.lr if cfg.schedule == "constant" else cfg.min_lr
    lines = [f"lr schedule: {cfg.schedule} over {total_steps} steps, peak lr {cfg.lr:g}, min lr {min_lr:g}"]
    note = fitted_warmup(cfg, total_steps)[1]
    if note is not None:
        lines.append(note)
    if warmup > 1:
        lines.append(f"lr warm-up: {steps_span(1, warmup)}, linear from {cfg.lr / warmup:g} to {cfg.lr:g}")
    elif warmup == 1:  # its one step runs at lr / 1
        lines.append(f"lr warm-up: none (step 1 runs at the peak lr {cfg.lr:g} already)")
    else:
        lines.append("lr warm-up: none")
    if start is None:
        lines.append(f"lr decay: none (constant at {cfg.lr:g})")
    else:
        tail = f"; at min lr after it until step {total_steps}" if end < total_steps else ""
        what = steps_span(start + 1, end) + (f" ({end - start} steps)" if end - start > 1 else "")
        lines.append(f"lr decay ({shape}): {what}, to {cfg.min_lr:g}{tail}")
    return lines


class _ScheduledLR(LambdaLR):
    """A LambdaLR whose state is its position only (see the module docstring)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["lr"] = base_lr * factor(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The optimizer's lr now, before µP's per-group scales (the schedule's value; every group's lr under SP)."""
    group = optimizer.param_groups[0]
    return float(group["lr"]) / group.get("lr_scale", 1.0)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int, peak_of=None
) -> LRScheduler:
    """The schedule for `optimizer` (a torch optimizer or hf3d's ParallelOptimizer) over `total_steps`.

    Call `scheduler.step()` after every `optimizer.step()`. Every param group's lr must be its peak lr times
    its µP `lr_scale`: cfg.lr (build the optimizer with lr=cfg.lr), or `peak_of(group)` where groups peak
    apart (Muon's and AdamW's); min_lr is reached as the same fraction of each group's lr.
    """
    from transformers import get_scheduler

    warmup, start, end = _window(cfg, total_steps)
    for i, group in enumerate(optimizer.param_groups):
        group_lr = group.get("initial_lr", group["lr"]) / group.get("lr_scale", 1.0)
        peak = cfg.lr if peak_of is None else peak_of(group)
        if not math.isclose(float(group_lr), peak, rel_tol=1e-9):
            raise ValueError(
                f"optimizer param group {i} has lr {float(group_lr):g} but the schedule's peak lr is {peak:g}: "
                "build the optimizer with lr=optim.lr"
            )
    # transformers' curve, computed on a stand-in optimizer so that the real one is set only once, below
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    ratio = cfg.min_lr / cfg.lr
    if cfg.schedule == "cosine":
        curve = get_scheduler(
            "cosine_with_min_lr", stand_in, warmup, total_steps, scheduler_specific_kwargs={"min_lr": cfg.min_lr}
        )
    elif cfg.schedule == "constant":
        curve = get_scheduler("constant_with_warmup", stand_in, warmup)
    else:  # linear is WSD with no stable phase: transformers' linear schedule has no min_lr
        shape = "linear" if cfg.schedule == "linear" else cfg.decay_shape or "linear"
        kwargs = {"num_stable_steps": start - warmup, "num_decay_steps": end - start}
        kwargs |= {"decay_type": shape, "min_lr_ratio": ratio}
        curve = get_scheduler("warmup_stable_decay", stand_in, warmup, scheduler_specific_kwargs=kwargs)
    after_warmup = curve.lr_lambdas[0]

    def lr_factor(index: int) -> float:  # index: optimizer steps done (the scheduler's last_epoch)
        step = min(index + 1, total_steps)
        return step / warmup if step < warmup else after_warmup(step)

    return _ScheduledLR(optimizer, lr_factor)
