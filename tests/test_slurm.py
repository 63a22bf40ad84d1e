"""The SLURM batch scripts (examples/slurm) run by bash as sbatch would, under stand-ins for srun and scontrol
(tests/slurm_standin: every "node" is this machine) and the SLURM_* variables a real job has.

- Two nodes (train-multinode.sbatch), one worker each, a checkpoint every 2 steps: SIGUSR1 to the batch shell alone
  (`#SBATCH --signal=B:USR1@...`) stops the run on both ranks at one step with a checkpoint; the script requeues the
  job (`scontrol requeue`) and exits 138. The script run again, as the requeued job runs it, resumes and finishes:
  every step once in metrics.jsonl, with the losses of an uninterrupted one-process run of the same config (dp=2
  and dp=1 sum the same rows in another order).
- One node (train.sbatch), two workers: SIGTERM to every process of the job at once, as the time limit sends it
  (the batch shell, srun, the hf3d launcher, its workers): the run ends with one checkpoint, written by both ranks
  at the step the run stopped after, and the script requeues the job (143). A run that fails is not requeued: the
  job ends with the run's code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from asserts import assert_close
from runs import CONFIG, ROOT, STEPS, TINY, free_port
from runs import metrics_records as _records

STANDIN = ROOT / "tests" / "slurm_standin"
SCRIPTS = ROOT / "examples" / "slurm"
# dp=2 and dp=1 sum the same rows in another order: 6.9e-8 relative measured on these runs (1.5e-7 over 16 steps)
RTOL = 1e-6


def _job_env(tmp: Path, job_id: int, hosts: list[str], *, gpus: int, restart: int = 0) -> dict:
    """The environment of a batch job (what sbatch gives the script), with the stand-ins first on PATH and the
    checkout importable by the `hf3d` command."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(STANDIN), os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(
        SLURM_JOB_ID=str(job_id), SLURM_JOBID=str(job_id), SLURM_JOB_NAME="hf3d", SLURM_NNODES=str(len(hosts)),
        SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_JOB_NODELIST=",".join(hosts), SLURM_NODELIST=",".join(hosts),
        SLURM_NODEID="0", SLURM_GPUS_ON_NODE=str(gpus), SLURM_CPUS_PER_TASK="2", SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_RESTART_COUNT=str(restart), SLURM_STANDIN_REQUEUES=str(tmp / "requeues"),
    )  # fmt: skip
    return env


def _submit(script: str, env: dict, out: Path, log: Path, *more: str) -> subprocess.Popen:
    """The batch script as SLURM starts it: bash, in the submit folder, a session of its own."""
    cmd = ["bash", str(SCRIPTS / script), CONFIG, "--set", *TINY, f"run.output_dir={out}", *more]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _wait_for_steps(out: Path, steps: int, job: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    end = time.time() + timeout
    while len(_records(out)) < steps:
        if job.poll() is not None or time.time() > end:
            raise AssertionError(f"step {steps} not seen (exit code {job.poll()}): {log.read_text()[-3000:]}")
        time.sleep(0.05)


def _end(job: subprocess.Popen, log: Path, timeout: float = 300) -> int:
    """The job's exit code; a job still running then is killed with everything it started."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(job)
        raise AssertionError(f"the job did not end: {log.read_text()[-3000:]}") from None


def _kill(job: subprocess.Popen) -> None:
    """The job's session (the batch shell, srun, the launchers; the workers die with their launcher)."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()


def _requeues(tmp: Path) -> list[str]:
    path = tmp / "requeues"
    return path.read_text().splitlines() if path.is_file() else []


def _checkpoints(out: Path) -> dict[int, set[str]]:
    """{step: the files of its checkpoint} for every complete checkpoint."""
    root = out / "checkpoints"
    saves = [p for p in root.glob("step_*") if (p / "hf3d_checkpoint.json").is_file()] if root.is_dir() else []
    return {int(p.name.removeprefix("step_")): {f.name for f in p.iterdir()} for p in saves}


def _assert_stopped_with_a_checkpoint(out: Path, log: Path, signame: str, ranks: int) -> int:
    """The run stopped after one step on every rank: metrics end there, its checkpoint holds each rank's part,
    rank 0 said where to resume, once. Returns the step."""
    records = _records(out)
    last = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last + 1))
    assert last < STEPS, "the run ended before the signal stopped it"
    saves = _checkpoints(out)
    assert max(saves) == last, saves.keys()
    assert {name for rank in range(ranks) for name in (f"__{rank}_0.distcp", f"rng_{rank}.pt")} <= saves[last]
    screen = log.read_text()
    line = f"hf3d: stopped by {signame} after step {last}; resume from {out / 'checkpoints' / f'step_{last}'}"
    assert screen.count(line) == 1, screen[-3000:]
    assert "Traceback" not in screen
    return last


def _alive(p: psutil.Process) -> bool:
    """Still running: an ended process whose parent (the launcher, gone too) was never reaped stays a zombie where
    the machine's first process does not reap orphans (a container), and psutil counts zombies as running."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_usr1_to_the_batch_shell_requeues_two_nodes_and_the_requeued_job_finishes_the_run(tmp_path, tiny_losses):
    out, logs = tmp_path / "run", [tmp_path / "first.log", tmp_path / "requeued.log"]
    hosts = ["127.0.0.1", "127.0.0.2"]  # two names of this machine: the first is the rendezvous host
    env = _job_env(tmp_path, 4242, hosts, gpus=1)
    env["RDZV_PORT"] = str(free_port())
    job = _submit("train-multinode.sbatch", env, out, logs[0], "checkpoint.every=2")
    try:
        _wait_for_steps(out, 2, job, logs[0])
        launchers = [p for p in psutil.Process(job.pid).children(recursive=True) if "--node-rank" in p.cmdline()]
        ranks = sorted(p.cmdline()[p.cmdline().index("--node-rank") + 1] for p in launchers)
        assert ranks == ["0", "1"]  # each task read its own SLURM_NODEID
        os.kill(job.pid, signal.SIGUSR1)  # to the batch shell alone, as --signal=B:USR1 does
    except BaseException:
        _kill(job)
        raise
    code = _end(job, logs[0])
    assert not [p for p in launchers if _alive(p)]  # the script waited for its step to end
    assert code == 138, logs[0].read_text()[-3000:]
    assert _requeues(tmp_path) == ["4242 0"]
    stopped = _assert_stopped_with_a_checkpoint(out, logs[0], "SIGUSR1", ranks=2)
    said = "hf3d-slurm: job 4242: stopped by SIGUSR1 with a checkpoint; requeueing it (restart 1)"
    assert said in logs[0].read_text()

    env["SLURM_RESTART_COUNT"] = "1"  # SLURM runs the requeued job's batch script again
    again = _submit("train-multinode.sbatch", env, out, logs[1], "checkpoint.every=2")
    assert _end(again, logs[1]) == 0, logs[1].read_text()[-3000:]
    assert _requeues(tmp_path) == ["4242 0"]  # a complete run is not requeued
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # every step once
    assert [r["step"] for r in records if "resumed_from" in r] == [stopped + 1]
    assert_close([r["loss"] for r in records], tiny_losses, rtol=RTOL, what="losses")
    assert "Traceback" not in logs[1].read_text()


def test_sigterm_to_every_process_at_the_time_limit_saves_once_and_requeues_one_node(tmp_path):
    out, log = tmp_path / "run", tmp_path / "job.log"
    env = _job_env(tmp_path, 4343, ["127.0.0.1"], gpus=2)
    job = _submit("train.sbatch", env, out, log, "checkpoint.every=0")  # the signal's checkpoint is the only one
    try:
        _wait_for_steps(out, 2, job, log)
        shell = psutil.Process(job.pid)
        every = [shell, *shell.children(recursive=True)]  # the batch shell, srun, the launcher, its workers
        workers = [p for p in every if "RANK" in p.environ()]
        assert len(workers) == 2, [p.cmdline() for p in every]
        for p in every:
            p.send_signal(signal.SIGTERM)
    except BaseException:
        _kill(job)
        raise
    code = _end(job, log)
    assert not [p for p in every if _alive(p)]  # the script waited for its step to end
    assert code == 143, log.read_text()[-3000:]
    assert _requeues(tmp_path) == ["4343 0"]
    stopped = _assert_stopped_with_a_checkpoint(out, log, "SIGTERM", ranks=2)
    assert list(_checkpoints(out)) == [stopped]


def test_a_failed_run_is_not_requeued_and_the_job_ends_with_its_code(tmp_path):
    """A run that cannot start (a bad value: hf3d's one line, exit 1) is a failure, not a preemption."""
    log = tmp_path / "job.log"
    job = _submit("train.sbatch", _job_env(tmp_path, 4444, ["127.0.0.1"], gpus=2), tmp_path / "run", log,
                  "run.steps=-1")  # fmt: skip
    assert _end(job, log) == 1, log.read_text()[-3000:]
    assert _requeues(tmp_path) == []
    screen = log.read_text()
    assert "hf3d train: error: run.steps and run.global_batch must be positive" in screen
    assert "hf3d-slurm: job 4444: the run failed (exit code 1): not requeued" in screen
