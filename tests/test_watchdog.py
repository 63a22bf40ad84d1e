"""The hang watchdog (run.hang_timeout, hf3d/train/watchdog.py): a rank asleep in a step ends the job with one line
that names it and exit code 4, within the timeout; the first step and a long phase (of this rank, or of a peer while
this rank waits) are not a hang; the line's wording; the auto rule.

The 2-process run goes through torchrun with tests/hang_driver.py, which plants the sleep (and rank 0's long
phase) by monkeypatching hf3d, then calls `hf3d.cli.main`. The rest runs in this process on a HashStore.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.train.watchdog import FORWARD, OPTIMIZER, Watchdog, auto_timeout, describe_hang  # noqa: E402
from hf3d.utils.faults import EXIT_HANG, RunState  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3.0
SLOW_S = 4.5  # rank 0 alone in a long phase while rank 1 is past its deadline
# the job ends this long after the deadline at most (measured 0.05-0.29 s for a 3 s timeout, 0.07-0.47 s for 5 s: up
# to two polls of timeout/10, one of them rank 0's saying its long phase is over, and the report)
MARGIN_S = 5.0
COORDS = {0: {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, 1: {"pp": 0, "dp": 0, "cp": 0, "tp": 1}}
ALL_REDUCE = [["all_reduce", "torch/distributed/distributed_c10d.py", 3252], ["f", "hf3d/parallel/tensor.py", 56]]
ASLEEP = [["nap", "driver.py", 29], ["one_step", "hf3d/train/step.py", 94]]


def _report(rank, step, mark, phase, frames, *, waiting, for_s=6.0, coords=None):
    coords = coords or {"pp": 0, "dp": 0, "cp": 0, "tp": rank}
    return dict(rank=rank, coords=coords, step=step, mark=mark, phase=phase, for_s=for_s, frames=frames,
                waiting=waiting)  # fmt: skip


def test_a_rank_asleep_in_a_step_ends_the_job_with_one_line_and_exit_code_4(tmp_path):
    """Rank 1 sleeps in the forward of step 4 (tp=2: rank 0 waits in the tensor-parallel all-reduce of the same
    forward); meanwhile rank 0 spends longer than the timeout alone in step 3's samples phase, which must not
    count. Every rank ends with 4 about run.hang_timeout after rank 0's long phase, one line names rank 1, and
    the output directory holds what step 2 saved and nothing more."""
    log, out = tmp_path / "events.log", tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(ROOT / "tests" / "hang_driver.py")]
    cmd += ["1", "4", str(SLOW_S), str(log), "--", "train", "examples/configs/tiny-smollm.yaml", "--set"]
    cmd += ["run.steps=6", "run.global_batch=4", "data.seq_len=32", "checkpoint.every=2", "optim.warmup_steps=1"]
    cmd += ["run.log_every=1000", f"run.hang_timeout={TIMEOUT_S}", f"run.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    events = [line.split() for line in log.read_text().splitlines()]
    exits = {int(e[1]): (int(e[2]), float(e[3])) for e in events if e[0] == "exit"}
    asleep = [float(e[2]) for e in events if e[0] == "asleep"]
    slow = [float(e[2]) for e in events if e[0] == "slow"]
    assert sorted(exits) == [0, 1] and len(asleep) == 1 and len(slow) == 1, (events, proc.stderr[-3000:])
    assert {code for code, _ in exits.values()} == {EXIT_HANG}
    ended = [t - slow[0] for _, t in exits.values()]
    assert slow[0] - asleep[0] > SLOW_S - 1  # rank 1 was past its deadline during rank 0's long phase
    assert all(TIMEOUT_S - 0.5 < t < TIMEOUT_S + MARGIN_S for t in ended), ended

    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").rglob("stderr.log"))
    lines = [line for line in logs.replace("\r", "\n").splitlines() if "hang" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("hf3d train: hang: no rank finished a step in 3 s (run.hang_timeout=3): "), line
    assert "rank 1 did not get as far as the others: rank 1 (pp=0, dp=0, cp=0, tp=1) at step 4, " in line, line
    source = (ROOT / "tests" / "hang_driver.py").read_text().splitlines()
    asleep_at = next(i for i, text in enumerate(source, 1) if "time.sleep(600)" in text)
    frame = f"in asleep_in_the_forward (hang_driver.py:{asleep_at}) via one_step (hf3d/train/step.py:"
    assert f"{FORWARD}, {frame}" in line, line
    assert "; rank 0 waits at step 4, forward and backward, in all_reduce (torch/distributed/" in line, line
    assert line.endswith(f"every rank ends with exit code {EXIT_HANG}"), line
    assert "Traceback" not in logs and "failed" not in logs, logs[-3000:]
    assert line in proc.stderr  # torchrun's summary takes it from the ranks' error files

    saves = out / "checkpoints"
    assert sorted(p.name for p in saves.iterdir()) == ["latest", "step_2"]
    assert (saves / "latest").read_text().strip() == "step_2" and not (out / "final").exists()
    steps = [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_the_auto_rule():
    assert auto_timeout(0.5, 600.0) == 120.0  # the floor
    assert auto_timeout(10.0, 600.0) == 200.0  # 20 x the longest step
    assert auto_timeout(30.0, 600.0) == 480.0  # under the collective timeout
    assert auto_timeout(0.5, 60.0) == 48.0  # the collective timeout wins over the floor


def test_the_line_names_the_ranks_behind_the_others():
    no_coords = lambda rank: {"pp": rank // 2, "dp": 0, "cp": 0, "tp": rank % 2}  # noqa: E731
    # a phase behind: rank 1 still in the forward, rank 0 in the optimizer step
    behind = [_report(0, 3, 2, OPTIMIZER, ALL_REDUCE, waiting=True), _report(1, 3, 1, FORWARD, ASLEEP, waiting=False)]
    assert describe_hang(behind, world_size=2, coords_of=no_coords) == (
        "rank 1 did not get as far as the others: rank 1 (pp=0, dp=0, cp=0, tp=1) at step 3, forward and backward, "
        "in nap (driver.py:29) via one_step (hf3d/train/step.py:94) for 6.0 s; rank 0 waits at step 3, optimizer "
        "step, in all_reduce (torch/distributed/distributed_c10d.py:3252) via f (hf3d/parallel/tensor.py:56)"
    )
    # the same phase: the rank that does not wait in a collective is the one behind, whatever its rank
    same = [_report(0, 3, 1, FORWARD, ASLEEP, waiting=False), _report(1, 3, 1, FORWARD, ALL_REDUCE, waiting=True)]
    line = describe_hang(same, world_size=2, coords_of=no_coords)
    assert line.startswith("rank 0 did not get as far as the others: rank 0 (pp=0, dp=0, cp=0, tp=0) at step 3"), line
    assert line.endswith("; rank 1 waits at step 3, forward and backward, in all_reduce "
                         "(torch/distributed/distributed_c10d.py:3252) via f (hf3d/parallel/tensor.py:56)")  # fmt: skip
    # a silent rank: the others all wait, none is behind
    waiting = [_report(r, 3, 1, FORWARD, ALL_REDUCE, waiting=True) for r in (0, 1, 2)]
    assert describe_hang(waiting, world_size=4, coords_of=no_coords) == (
        "rank 3 published nothing (process or node gone?): rank 3 (pp=1, dp=0, cp=0, tp=1); ranks 0-2 wait at "
        "step 3, forward and backward, in all_reduce (torch/distributed/distributed_c10d.py:3252) via f "
        "(hf3d/parallel/tensor.py:56)"
    )
    # everyone waits at the same point: no rank is singled out
    line = describe_hang(waiting[:2], world_size=2, coords_of=no_coords)
    assert line.startswith("no rank is behind the others: rank 0 (pp=0, dp=0, cp=0, tp=0) at step 3"), line
    assert "rank 1 (pp=0, dp=0, cp=0, tp=1) at step 3" in line and "waits" not in line
    # one process
    line = describe_hang([_report(0, 7, 1, FORWARD, ASLEEP, waiting=False)], world_size=1, coords_of=no_coords)
    assert line.startswith("it is stuck: rank 0 (pp=0, dp=0, cp=0, tp=0) at step 7, forward and backward, in nap")
    # many ranks behind: four named, the rest counted
    many = [_report(r, 3, 1, FORWARD, ASLEEP, waiting=False) for r in range(6)]
    many.append(_report(6, 3, 2, OPTIMIZER, ALL_REDUCE, waiting=True))
    line = describe_hang(many, world_size=7, coords_of=no_coords)
    assert line.startswith("ranks 0-5 did not get as far as the others: rank 0 ") and "; and 2 more ranks; " in line


def _watchdog(store, rank: int, leave: list, timeout: float = 0.3) -> Watchdog:
    state = RunState(rank=rank, coords=COORDS[rank])
    return Watchdog(timeout, collective_timeout_s=60.0, state=state, world_size=2 if store else 1,
                    store=store or dist.HashStore(), warmups=frozenset({1}), leave=leave.append)  # fmt: skip


def _step(watch: Watchdog, step: int, pause_s: float = 0.0) -> None:
    watch.begin(step)
    watch.enter(FORWARD)
    time.sleep(pause_s)
    watch.enter(OPTIMIZER)
    watch.finished()


def _stuck(watch: Watchdog, codes: list, at_most_s: float) -> float:
    """The main thread stalls in a step's forward until the watchdog ends it; returns how long that took."""
    t0 = time.monotonic()
    while not codes and time.monotonic() - t0 < at_most_s:
        time.sleep(0.01)
    return time.monotonic() - t0


def test_the_first_step_and_long_phases_do_not_count_a_stalled_step_does():
    codes: list[int] = []
    watch = _watchdog(None, 0, codes).start()
    _step(watch, 1, pause_s=0.8)  # the first step compiles: not armed yet
    _step(watch, 2)
    with watch.long("checkpoint save"):
        time.sleep(0.8)
    time.sleep(0.15)  # after the step: watched, under the timeout
    assert not codes and watch.line is None
    watch.begin(3)
    watch.enter(FORWARD)
    waited = _stuck(watch, codes, at_most_s=5.0)
    watch.stop()
    assert codes == [EXIT_HANG] and 0.1 < waited < 0.3 + 1.0, waited  # measured 0.16-0.2 s
    assert watch.line.startswith(
        "hf3d train: hang: no rank finished a step in 0.3 s (run.hang_timeout=0.3): it is stuck: rank 0 "
        "(pp=0, dp=0, cp=0, tp=0) at step 3, forward and backward, in _stuck (test_watchdog.py:"
    ), watch.line


def test_a_peer_in_a_long_phase_holds_the_deadline_and_stop_ends_the_watch():
    """Two watchdogs on one store as two ranks: rank 1 publishes a checkpoint alone for longer than the timeout
    while rank 0 waits; the hang is called a timeout after rank 1's long phase ended, and rank 1 answers the alarm
    though its own deadline has not passed. A stopped watchdog never fires."""
    store, codes = dist.HashStore(), {0: [], 1: []}
    ranks = [_watchdog(store, r, codes[r], timeout=0.4) for r in (0, 1)]
    ranks[1].prefix = ranks[0].prefix  # one job's keys
    for w in ranks:
        w.start()
        _step(w, 1)
    saving = ranks[1].long("checkpoint save")
    saving.__enter__()
    time.sleep(1.2)  # three timeouts
    assert not codes[0] and not codes[1]
    saving.__exit__(None, None, None)
    t0 = time.monotonic()
    ranks[0].begin(2)
    ranks[0].enter(FORWARD)
    ranks[1].begin(2)
    while len(codes[0]) + len(codes[1]) < 2 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    waited = time.monotonic() - t0
    assert codes == {0: [EXIT_HANG], 1: [EXIT_HANG]} and 0.3 < waited < 0.4 + 1.0, (
        codes,
        waited,
    )  # measured 0.42-0.46 s
    assert ranks[0].line == ranks[1].line and "rank 1 did not get as far as the others: rank 1 " in ranks[0].line

    quiet: list[int] = []
    stopped = _watchdog(None, 0, quiet, timeout=0.1).start()
    _step(stopped, 1)
    _step(stopped, 2)
    stopped.stop()
    time.sleep(0.4)
    assert not quiet and stopped.line is None
