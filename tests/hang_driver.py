"""Test driver of tests/test_watchdog.py, under torchrun: `python hang_driver.py SLEEPER STEP SLOW_S LOG -- <hf3d
args>`. Rank SLEEPER falls asleep for 10 minutes in the forward of step STEP; in the step before, rank 0 spends
SLOW_S seconds alone recording the step's samples and trackers' log (a long phase no collective follows, as a
slow tracker makes it). Monkeypatches of the tests' own, never a production switch; then `hf3d.cli.main` runs the
command. LOG gets `asleep RANK TIME`, `slow RANK TIME` (the end of the slow phase) and `exit RANK CODE TIME`.
"""

import os
import sys
import time

import hf3d.train.trainer
from hf3d.cli import main
from hf3d.model import ParallelModel

sleeper, sleep_step, slow_s, log = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rank, calls = int(os.environ.get("RANK", "0")), [0]
train_step, record_samples = ParallelModel.train_step, hf3d.train.trainer._record_samples


def _write(line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")


def asleep_in_the_forward(self, *args, **kwargs):
    calls[0] += 1
    if rank == sleeper and calls[0] == sleep_step:
        _write(f"asleep {rank} {time.time()}")
        time.sleep(600)  # the planted hang
    return train_step(self, *args, **kwargs)


def slow_samples(run, step, *args, **kwargs):
    record_samples(run, step, *args, **kwargs)
    if rank == 0 and step + 1 == sleep_step - 1:
        time.sleep(slow_s)
        _write(f"slow {rank} {time.time()}")


ParallelModel.train_step = asleep_in_the_forward
hf3d.train.trainer._record_samples = slow_samples
real_exit = os._exit


def logged_exit(code: int) -> None:
    _write(f"exit {rank} {code} {time.time()}")
    real_exit(code)


os._exit = logged_exit
logged_exit(main(sys.argv[sys.argv.index("--") + 1 :]))
