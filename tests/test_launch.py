"""How a run ends on screen under hf3d's own launch (`hf3d train --nproc-per-node N ...`, hf3d/utils/launch.py).

The launcher is started in a session of its own and signalled with os.killpg, as a terminal's Ctrl-C reaches
every process of the foreground group; what the tests read is what a terminal would show: stdout and stderr
together, carriage returns (the progress bar) overwriting their line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.checkpoint.marker import is_complete  # noqa: E402
from hf3d.utils.launch import worker_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=3", "run.log_every=1", "evals.tasks=[]"]
TINY += ["samples.prompts=[]", "run.sample_prompt=null", "checkpoint.every=0", "run.save_final=false"]


def _start(out: Path, *extra: str, cwd: Path = ROOT) -> subprocess.Popen:
    """`hf3d train --nproc-per-node 2` of the tiny run, in a new session (its own process group), launched from
    `cwd` as the `hf3d` script launches (-P: the launch folder is not on the launcher's path)."""
    config = str(ROOT / "examples" / "configs" / "tiny-smollm.yaml")
    cmd = [sys.executable, "-P", "-m", "hf3d", "train", "--nproc-per-node", "2", config]
    cmd += ["--set", *TINY, f"run.output_dir={out}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _screen(raw: bytes) -> list[str]:
    """The lines a terminal would show: each carriage return rewrites its line from the start; blank lines out."""
    lines = []
    for line in raw.decode(errors="replace").split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part) :]
        if shown.strip():
            lines.append(shown.rstrip())
    return lines


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    path, end = out / "metrics.jsonl", time.time() + timeout
    while time.time() < end and proc.poll() is None:
        lines = path.read_text().splitlines() if path.is_file() else []
        if len(lines) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach step {step} (exit code {proc.poll()})")


def test_worker_argv_leaves_out_the_launch_option():
    argv = ["train", "--nproc-per-node", "2", "c.yaml", "--set", "a=1"]
    assert worker_argv(argv) == ["train", "c.yaml", "--set", "a=1"]
    assert worker_argv(["generate", "m", "--nproc-per-node=4", "--prompt", "x"]) == ["generate", "m", "--prompt", "x"]
    several = ["train", "c.yaml", "--nnodes", "1:2", "--node-rank=1", "--rdzv-endpoint", "h:29500", "--rdzv-id", "j"]
    several += ["--rdzv-backend=c10d", "--rdzv-conf", "last_call_timeout=5", "--max-restarts", "3", "--set", "a=1"]
    assert worker_argv(several) == ["train", "c.yaml", "--set", "a=1"]


def test_ctrl_c_ends_on_the_resume_line_with_130(tmp_path):
    """Ctrl-C (SIGINT to the launcher's whole process group): the workers finish their step, save it, rank 0
    prints where to resume, and that line is the last on screen; the launch exits 130, no traceback."""
    out = tmp_path / "run"
    proc = _start(out, "run.steps=100000")
    try:
        _wait_for_step(out, 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        raw, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    screen = _screen(raw)
    assert proc.returncode == 130, screen[-20:]
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    saved = out / "checkpoints" / f"step_{step}"
    expected = f"hf3d: stopped by SIGINT after step {step}; resume from {saved} (checkpoint.resume=auto); exit code 130"
    assert screen[-1] == expected, screen[-20:]
    assert sum("stopped by SIGINT" in line for line in screen) == 1, screen[-20:]
    assert not any("Traceback" in line or "SignalException" in line for line in screen), screen[-40:]
    assert is_complete(saved)


def test_a_refusal_appears_once_on_the_whole_screen(tmp_path):
    """A config the workers refuse (3 dp replicas on 2 processes): every rank raises it, the first prints it,
    the launcher adds nothing (no ChildFailedError summary repeating it), exit 1. Launched from a folder holding a
    `numpy.py`: the workers (which import numpy with torch) never run it."""
    ran = tmp_path / "numpy-ran"
    (tmp_path / "numpy.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit(7)\n")
    proc = _start(tmp_path / "run", "parallel.dp=3", cwd=tmp_path)
    raw, _ = proc.communicate(timeout=300)
    assert not ran.exists()
    screen = _screen(raw)
    assert proc.returncode == 1, screen[-20:]
    said = [line for line in screen if line.startswith("hf3d train:")]
    assert len(said) == 1 and screen[-1] == said[0], screen[-20:]
    assert "world size 2 is not tp·pp·dp=3·cp" in said[0] and screen[-1].startswith("hf3d train: rank "), said
    assert not any("Traceback" in line or "ChildFailedError" in line for line in screen), screen[-40:]
    assert not (tmp_path / "run" / "final").exists()


def test_the_peers_the_agent_ends_after_a_refusal_are_not_reported_as_deaths():
    """Rank 0 fails with hf3d's line; the agent then ends rank 1 with SIGTERM (its shutdown of the peers), while
    rank 2 was SIGKILLed: only rank 2 gets a line. A SIGTERM death with no hf3d line anywhere is reported."""
    from types import SimpleNamespace

    from hf3d.utils.launch import _silent_deaths

    said = SimpleNamespace(message="hf3d train: rank 0 (pp=0, dp=0, cp=0, tp=0) failed: ...", exitcode=1)
    term, kill = SimpleNamespace(message="", exitcode=-15), SimpleNamespace(message="", exitcode=-9)
    assert _silent_deaths("hf3d train", {0: said, 1: term, 2: kill}) == [(2, kill)]
    assert _silent_deaths("hf3d train", {0: said, 1: term}) == []
    assert _silent_deaths("hf3d train", {1: term}) == [(1, term)]


def test_a_config_refused_before_the_workers_start_is_one_line(tmp_path, capsys):
    from hf3d.cli import main

    argv = ["train", "--nproc-per-node", "2", "--set", "optim.lr=fast", f"run.output_dir={tmp_path}/run"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "hf3d train: error: optim.lr must be a number, got 'fast' (str)\n"
    assert not (tmp_path / "run").exists()


def test_a_worker_killed_without_a_word_gets_one_line_from_the_launcher(tmp_path):
    """A worker SIGKILLed (as the OOM killer does) prints nothing itself: the launcher names it, once, and
    exits 137; the surviving rank reports its broken collective once."""
    out = tmp_path / "run"
    proc = _start(out, "run.steps=100000")
    try:
        _wait_for_step(out, 2, proc)
        workers = [p for p in psutil.Process(proc.pid).children() if "hf3d" in " ".join(p.cmdline())]
        ranks = {int(p.environ()["RANK"]): p for p in workers}
        ranks[1].kill()
        raw, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    screen = _screen(raw)
    killed = [line for line in screen if "was killed by SIGKILL" in line]
    assert killed == [killed[0]] and killed[0].startswith("hf3d train: rank 1 was killed by SIGKILL"), screen[-20:]
    assert sum(line.startswith("hf3d train: rank 0") for line in screen) <= 1, screen[-20:]
    assert not any("Traceback" in line or "ChildFailedError" in line for line in screen), screen[-40:]
    assert proc.returncode == 137, screen[-20:]


def test_ctrl_c_outside_training_is_one_line_and_130(capsys):
    """A KeyboardInterrupt where hf3d has no handler of its own (before training's first step, in eval and
    generate): one line from rank 0, exit 130, no traceback."""
    from hf3d.cli import _collective

    def body(state) -> None:
        raise KeyboardInterrupt

    assert _collective("hf3d train", body, steps=True) == 130
    assert _collective("hf3d generate", body, steps=False) == 130
    assert capsys.readouterr().err.splitlines() == [
        "hf3d train: stopped by SIGINT before the first step (nothing saved); exit code 130",
        "hf3d generate: stopped by SIGINT; exit code 130",
    ]


def test_the_launch_flags_reach_the_agent_with_torchruns_meaning():
    from hf3d.utils.launch import LaunchOptions

    alone = LaunchOptions(nproc_per_node=2).config()
    assert (alone.min_nodes, alone.max_nodes, alone.rdzv_endpoint, alone.max_restarts) == (1, 1, "localhost:0", 0)
    assert "SIGUSR1" in alone.signals_to_handle.split(",") and "SIGTERM" in alone.signals_to_handle.split(",")
    job = LaunchOptions(nnodes="1:4", rdzv_endpoint="head:29500", rdzv_conf="last_call_timeout=5", max_restarts=3)
    c = job.config()
    assert (c.min_nodes, c.max_nodes, c.rdzv_backend, c.rdzv_endpoint, c.run_id) == (1, 4, "c10d", "head:29500", "hf3d")
    assert c.rdzv_configs["last_call_timeout"] == "5" and c.max_restarts == 3
    static = LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint="head:29500", rdzv_backend="static").config()
    assert static.rdzv_configs["rank"] == 1 and static.rdzv_backend == "static"


def test_the_process_group_hf3d_starts_is_destroyed_at_exit_and_a_callers_is_left():
    """A script of the Python API (parallelize, then the end of the script) leaves no gloo group to the
    interpreter's finalization, where its threads can abort a finished run; a group the script started itself
    stays the script's. The check runs after hf3d's own exit handler (atexit runs the last registered first)."""
    probe = (
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
        "{start}\n"
        "from hf3d.parallel.mesh import init_distributed\n"
        "init_distributed()\n"
        "print('initialized:', dist.is_initialized())\n"
    )
    own = "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for start, at_exit in (("", "False"), (own, "True")):
        proc = subprocess.run([sys.executable, "-c", probe.format(start=start)], capture_output=True, text=True,
                              timeout=120, env=env, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == ["initialized:", "True", "initialized", "at", "exit:", at_exit], proc.stdout
