"""Faults: a killed launcher takes its workers along, a failing rank stops the whole job with one line,
a checkpoint that cannot be written is refused on every rank and leaves the previous one in place,
pruning never deletes outside the checkpoints folder, and SIGKILLs between resumes change nothing.

`hf3d train` runs under torchrun subprocesses where the launcher matters. Failures are injected by a
small driver script written by the test (tests' own monkeypatches, never a production switch): it
patches one site on one rank, then calls `hf3d.cli.main`, and logs each rank's exit code and time.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from crafted import fake_checkpoint  # noqa: E402
from dist import _free_port, report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402

import hf3d  # noqa: E402
from hf3d import checkpoint  # noqa: E402
from hf3d.utils import faults, files

ROOT = Path(__file__).resolve().parents[1]
TINY = ["run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=3", "run.log_every=1000"]
# a failing rank: every rank gone this long after the failure (measured: 0.1-1.2 s on 2 busy cores)
ALL_GONE_S = 15.0
# a SIGKILLed torchrun: its workers gone this long after (measured: < 0.1 s)
ORPHANS_GONE_S = 5.0

DRIVER = '''
"""Test driver: `python driver.py RANK STEP SITE LOG -- <hf3d args>`; SITE: forward, dp, send (raise there),
or published (SIGKILL the process right after `latest` names the checkpoint of step STEP)."""
import os, sys, time
import torch.distributed as dist
from hf3d.utils import compat
from hf3d.cli import main
from hf3d.model import ParallelModel
from hf3d.parallel.stage import StageModule

fail_rank, fail_step, site, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
argv = sys.argv[sys.argv.index("--") + 1:]
rank, calls = int(os.environ.get("RANK", "0")), [0]
train_step = ParallelModel.train_step

def counted(self, *a, **k):
    calls[0] += 1
    return train_step(self, *a, **k)

def armed():
    return rank == fail_rank and calls[0] == fail_step

def raising(fn, exc):
    def wrapper(*a, **k):
        if armed() and (site != "dp" or k.get("async_op")):  # dp: the bucketed gradient reduction
            with open(log, "a") as f:
                f.write(f"fail {rank} {time.time()}\\n")
            raise exc
        return fn(*a, **k)
    return wrapper

ParallelModel.train_step = counted
if site == "forward":
    StageModule.forward = raising(StageModule.forward, ValueError("injected failure in forward"))
elif site == "dp":  # the buckets' collective: all-reduce, or ZeRO-1's reduce-scatter (all-to-all on gloo)
    dp_failure = RuntimeError("injected failure in the dp reduction")
    for name in ("all_reduce", compat.REDUCE_SCATTER, "all_to_all_single"):
        setattr(dist, name, raising(getattr(dist, name), dp_failure))
elif site == "send":
    dist.batch_isend_irecv = raising(dist.batch_isend_irecv, RuntimeError("injected failure in a pipeline send"))
elif site == "published":
    import signal
    import hf3d.train.trainer
    finish_save = hf3d.train.trainer.finish_save

    def killed_after(root, *a, **k):  # checkpoint.async: in the background, while a later step runs
        finish_save(root, *a, **k)
        if rank == fail_rank and (root / "latest").read_text().strip() == f"step_{fail_step}":
            os.kill(os.getpid(), signal.SIGKILL)

    hf3d.train.trainer.finish_save = killed_after
real_exit = os._exit

def logged_exit(code):
    with open(log, "a") as f:
        f.write(f"exit {rank} {code} {time.time()}\\n")
    real_exit(code)

os._exit = logged_exit
code = main(argv)
logged_exit(code)
'''


def _train_args(out: Path, *extra: str) -> list[str]:
    return ["train", "examples/configs/tiny-smollm.yaml", "--set", *TINY, f"run.output_dir={out}", *extra]


def _torchrun(nproc: int, args: list[str], tmp: Path, driver_args: list[str] | None = None):
    """Start `hf3d train` (or the test driver) under torchrun; each worker's output goes to
    <tmp>/logs/**/<local rank>/stderr.log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--standalone", "--log-dir", str(tmp / "logs"), "--redirects", "3"]  # standalone: torchrun picks a port
    if driver_args is None:
        cmd += ["-m", "hf3d", *args]
    else:
        driver = tmp / "driver.py"
        driver.write_text(DRIVER)
        cmd += [str(driver), *driver_args, "--", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the driver script imports this checkout's hf3d
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _worker_stderr(tmp: Path) -> dict[int, str]:
    return {int(p.parent.name): p.read_text() for p in (tmp / "logs").rglob("stderr.log")}


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for_lines(path: Path, n: int, proc, timeout: float = 180) -> None:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} lines (exit code {proc.poll()})")


def _wait_for_step(path: Path, step: int, proc, timeout: float = 300) -> None:
    """Until metrics.jsonl records `step` (lines a resumed run will drop may still be there: they are older)."""
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        lines = path.read_text().splitlines() if path.is_file() else []
        try:
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        except json.JSONDecodeError:
            pass  # a line being written
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach step {step} (exit code {proc.poll()})")


# -- 1. launcher death -------------------------------------------------------------------------------
def test_workers_die_with_a_sigkilled_torchrun(tmp_path):
    out = tmp_path / "run"
    tr = _torchrun(2, _train_args(out, "run.steps=100000", "checkpoint.every=0", "run.save_final=false"), tmp_path)
    workers = []
    try:
        _wait_for_lines(out / "metrics.jsonl", 2, tr)
        workers = psutil.Process(tr.pid).children()
        assert len(workers) == 2
        tr.send_signal(signal.SIGKILL)
        t0 = time.time()
        while time.time() - t0 < ORPHANS_GONE_S and not all(_gone(w) for w in workers):
            time.sleep(0.02)
        assert all(_gone(w) for w in workers), f"workers alive {ORPHANS_GONE_S} s after torchrun's SIGKILL"
        size = (out / "metrics.jsonl").stat().st_size
        time.sleep(2)
        assert (out / "metrics.jsonl").stat().st_size == size  # nothing written after
    finally:
        for p in [tr, *workers]:
            try:
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        tr.wait()


def test_die_with_parent_ends_a_child_whose_parent_is_killed(tmp_path):
    """The mechanism on its own: a grandchild armed with die_with_parent dies with its parent."""
    code = textwrap.dedent(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "from hf3d.utils.faults import die_with_parent; import time; die_with_parent(); "
            "print('armed', flush=True); "
            "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    grandchild = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    t0 = time.time()
    while time.time() - t0 < ORPHANS_GONE_S and not _gone(grandchild):
        time.sleep(0.02)
    assert _gone(grandchild)


# -- 2. a rank that fails ------------------------------------------------------------------------------
MESH = ["parallel.tp=1", "parallel.pp=2", "parallel.num_microbatches=2", "checkpoint.every=0", "run.save_final=false"]
COORDS = {
    0: "pp=0, dp=0, cp=0, tp=0",
    1: "pp=0, dp=1, cp=0, tp=0",
    2: "pp=1, dp=0, cp=0, tp=0",
    3: "pp=1, dp=1, cp=0, tp=0",
}
INJECTED = {
    "forward": "ValueError: injected failure in forward",
    "dp": "RuntimeError: injected failure in the dp reduction",
    "send": "RuntimeError: injected failure in a pipeline send",
}


def _fail_one_rank(tmp: Path, rank: int, site: str, step: int = 3) -> None:
    log = tmp / "exits.log"
    tr = _torchrun(4, _train_args(tmp / "run", "run.steps=50", *MESH), tmp, [str(rank), str(step), site, str(log)])
    try:
        output, _ = tr.communicate(timeout=300)
    finally:
        tr.kill()
    assert tr.returncode != 0 and log.is_file(), output[-3000:]
    events = [line.split() for line in log.read_text().splitlines()]
    failed_at = [float(e[2]) for e in events if e[0] == "fail"]
    exits = {int(e[1]): (int(e[2]), float(e[3])) for e in events if e[0] == "exit"}
    assert len(failed_at) == 1 and sorted(exits) == [0, 1, 2, 3], events
    assert exits[rank][0] == faults.EXIT_ERROR
    assert all(code in (faults.EXIT_ERROR, faults.EXIT_COMMUNICATION) for code, _ in exits.values())
    assert max(t for _, t in exits.values()) - failed_at[0] < ALL_GONE_S
    logs = _worker_stderr(tmp)
    line = f"hf3d train: rank {rank} ({COORDS[rank]}) failed at step {step}: {INJECTED[site]}"
    assert logs[rank].count(line) == 1, logs[rank][-3000:]
    for other in set(logs) - {rank}:  # peers: no line, no traceback wall
        assert "failed" not in logs[other] and "Traceback" not in logs[other], logs[other][-3000:]


def test_a_rank_failing_in_forward_stops_every_rank_with_one_line(tmp_path):
    _fail_one_rank(tmp_path, 2, "forward")


@pytest.mark.slow
@pytest.mark.parametrize("site", ["forward", "dp", "send"])
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_any_rank_failing_anywhere_stops_every_rank_with_one_line(tmp_path, rank, site):
    _fail_one_rank(tmp_path, rank, site)


def _timeout_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    hf3d.parallel.mesh.init_distributed(timeout_s=2)
    if rank == 1:  # a peer that hangs without dying
        time.sleep(12)
        return
    t0 = time.time()
    try:
        dist.all_reduce(torch.ones(1))
        res = None
    except Exception as e:
        res = (time.time() - t0, faults.is_communication_error(e))
    torch.save(res, out)
    os._exit(0)


def test_a_hung_peer_is_a_collective_timeout_after_timeout_s(tmp_path):
    out = tmp_path / "res.pt"
    mp.spawn(_timeout_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    waited, communication = torch.load(out)
    assert communication and 1.5 < waited < 8  # measured 2.0 s for timeout_s=2


FINISH_SCRIPT = """
import sys, time, torch, torch.distributed as dist, hf3d
dist.init_process_group("gloo")
x = torch.ones(4)
dist.all_reduce(x)  # gloo's threads are up
if dist.get_rank() == 0:
    time.sleep(1.0)  # rank 0 works alone (an export): the others wait for it, no collective timeout
print(f"rank {dist.get_rank()} done {x.sum().item():.0f}", flush=False)
hf3d.finish(int(sys.argv[1]))
print("not reached")
"""


def test_finish_ends_every_rank_together_after_the_slowest(tmp_path):
    script = tmp_path / "finish.py"
    script.write_text(FINISH_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    proc = subprocess.run(
        [*cmd, str(_free_port()), "--tee", "3", str(script), "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 done 8" in proc.stdout and "rank 1 done 8" in proc.stdout  # flushed before exit
    assert "not reached" not in proc.stdout
    with pytest.raises(SystemExit) as e:  # no process group: a plain exit
        hf3d.finish(2)
    assert e.value.code == 2


def test_collective_timeout_must_be_positive():
    with pytest.raises(ValueError, match="collective timeout must be a number of seconds > 0"):
        hf3d.parallel.mesh.init_distributed(timeout_s=0)


def test_nccl_ends_a_rank_stuck_on_a_dead_peer_after_the_timeout(monkeypatch):
    """Under nccl a dead peer is not reported at once as under gloo: the survivors' collectives only end
    through NCCL's watchdog, which must tear the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING) after the
    process group's timeout (run.collective_timeout_s). Checked without CUDA: the environment chosen for
    "nccl", a user's own setting (under either name) kept, and what init_process_group receives."""
    from hf3d.parallel.mesh import backend_environment

    assert backend_environment("nccl", {}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert backend_environment("gloo", {}) == {}
    assert backend_environment("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}  # torchrun's, or the user's
    assert backend_environment("nccl", {"NCCL_ASYNC_ERROR_HANDLING": "0"}) == {}  # the older name

    seen = {}

    def fake_init(backend, timeout):
        seen.update(backend=backend, timeout=timeout, env=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.setattr(hf3d.parallel.mesh.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(hf3d.parallel.mesh.dist, "init_process_group", fake_init)
    monkeypatch.setattr(hf3d.parallel.mesh.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hf3d.parallel.mesh.torch.cuda, "set_device", lambda device: None)
    for name in ("TORCHELASTIC_RUN_ID", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")  # as a launcher would: no free-port search
    hf3d.parallel.mesh.init_distributed(timeout_s=7)
    assert seen == {"backend": "nccl", "timeout": datetime.timedelta(seconds=7), "env": "3"}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    hf3d.parallel.mesh.init_distributed(timeout_s=7)
    assert seen["env"] == "2"


def test_run_state_coordinates_follow_the_mesh_layout():
    """place() (degrees only) agrees with init_device_mesh's pp-major, tp-minor layout."""
    for rank in range(12):
        s = faults.RunState(rank=rank)
        s.place(tp=2, pp=3, world_size=12)
        assert s.coords == {"pp": rank // 4, "dp": rank // 2 % 2, "cp": 0, "tp": rank % 2}
    for rank in range(16):  # pp=2, dp=2, cp=2, tp=2
        s = faults.RunState(rank=rank)
        s.place(tp=2, pp=2, world_size=16, cp=2)
        assert s.coords == {"pp": rank // 8, "dp": rank // 4 % 2, "cp": rank // 2 % 2, "tp": rank % 2}
    s = faults.RunState(rank=1)
    s.place(tp=4, pp=1, world_size=2)
    assert s.coords is None and s.where() == "rank 1 failed before the first step"


# -- 3. checkpoint writes that fail --------------------------------------------------------------------
def _opt(pm):
    return hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)


def _save_failures_world(model_dir, root: str) -> None:
    import resource

    start_watchdog(120)
    root, res = Path(root), {}
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = _opt(pm)
    ids = torch.randint(0, 101, (4, 16))
    pm.train_step(ids[pm.dp_rank * 2 : pm.dp_rank * 2 + 2], ids[pm.dp_rank * 2 : pm.dp_rank * 2 + 2])
    opt.step()
    # an output folder that cannot be created: a regular file where a folder must be
    try:
        hf3d.save_checkpoint(root / "a-file" / "step_1", pm, opt, step=1)
    except ValueError as e:
        res["unwritable"] = str(e)
    # a full disk on one rank (EFBIG past RLIMIT_FSIZE, SIGXFSZ ignored): previous checkpoint kept
    ckpts = root / "checkpoints"
    hf3d.save_checkpoint(ckpts / "step_1", pm, opt, step=1)
    if dist.get_rank() == 0:
        checkpoint.finish_save(ckpts, keep_last=1, published=ckpts / "step_1")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for full in (1, 0):
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if dist.get_rank() == full:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
        try:
            hf3d.save_checkpoint(ckpts / "step_2", pm, opt, step=2)
        except ValueError as e:
            res[f"full-{full}"] = str(e)
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        dist.barrier()
    report(res, root / "res.pt")


def test_a_checkpoint_that_cannot_be_written_is_refused_on_every_rank(tmp_path):
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    (tmp_path / "a-file").write_text("not a folder")
    spawn(_save_failures_world, 2, model_dir, str(tmp_path))
    res = torch.load(tmp_path / "res.pt")
    ckpts = tmp_path / "checkpoints"
    for rank in (0, 1):
        assert res[rank]["unwritable"] == (  # refused before anything is written, on every rank
            f"{tmp_path / 'a-file' / 'step_1'} lies under {tmp_path / 'a-file'}, which is a file: choose another "
            "output path"
        )
        for full in (0, 1):
            msg = res[rank][f"full-{full}"]
            assert msg.startswith(f"could not write the checkpoint {ckpts / 'step_2'}") and "\n" not in msg
            assert f"(rank {full}: " in msg and "make room on that disk" in msg  # names the rank that failed
    assert "(rank 0: OSError: [Errno 27] File too large)" in res[0]["full-0"]
    assert res[0] == res[1]  # the same words on every rank
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1"]  # no step_2, no step_2.tmp
    assert (ckpts / "latest").read_text().strip() == "step_1"
    assert checkpoint.resolve_resume("auto", ckpts) == ckpts / "step_1"


# -- 5. keep_last touches only what hf3d made ----------------------------------------------------------
def _victim(path: Path) -> Path:
    path.mkdir(parents=True)
    checkpoint.write_marker(path, {"kind": "training", "step": 3})  # even one that looks like ours
    (path / "precious.txt").write_text("keep me")
    return path


def test_pruning_never_follows_symlinks_out_of_the_checkpoints_folder(tmp_path):
    outside = tmp_path / "outside"
    victims = [_victim(outside / f"v{i}") for i in range(4)]
    root = tmp_path / "run" / "checkpoints"
    for n in (1, 2, 4, 6):
        fake_checkpoint(root / f"step_{n}", n)
    (root / "step_3").symlink_to(victims[0], target_is_directory=True)
    (root / "step_9").symlink_to(victims[1], target_is_directory=True)  # newest by name: never resumed
    (root / "step_7.tmp").symlink_to(victims[2], target_is_directory=True)
    (root / "latest").symlink_to(Path("..") / "..", target_is_directory=True)  # points outside
    (root / "step_5").mkdir()
    (root / "step_5" / checkpoint.MARKER).symlink_to(victims[3] / checkpoint.MARKER)  # a marker that is a link
    assert [d.name for _, d in checkpoint.step_dirs(root)] == ["step_1", "step_2", "step_4", "step_6"]
    assert checkpoint.resolve_resume("auto", root) == root / "step_6"
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"latest is a link; hf3d never writes through a link"):
        checkpoint.finish_save(root, keep_last=1, published=root / "step_6")  # nothing written through `latest`
    assert (root / "latest").is_symlink()
    (root / "latest").unlink()
    checkpoint.finish_save(root, keep_last=1, published=root / "step_6")
    assert (root / "latest").read_text() == "step_6\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3", "step_5", "step_6", "step_7.tmp", "step_9"]
    # a staging path or a final path that is a link is refused, never removed nor followed
    with pytest.raises(ValueError, match=r"step_7.tmp exists and is not a folder hf3d made"):
        files.make_dir(root / "step_7.tmp", checkpoint.CHECKPOINT)
    staged = fake_checkpoint(root / "step_8.tmp", 8)
    with pytest.raises(ValueError, match=r"step_3 exists and is not a folder hf3d made"):
        files.publish_dir(staged, root / "step_3", checkpoint.CHECKPOINT)
    assert (root / "step_3").is_symlink() and (root / "step_7.tmp").is_symlink()
    for v in victims:
        assert (v / "precious.txt").read_text() == "keep me" and checkpoint.is_complete(v)
    assert (tmp_path / "run").is_dir()


# -- 6. security ---------------------------------------------------------------------------------------
def _unsafe_calls(source: str) -> list[str]:
    """torch.load without weights_only=True, yaml loaders other than safe_load, pickle loads,
    trust_remote_code=True written into a call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if name.endswith("torch.load"):
            ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            if not ok:
                found.append(ast.unparse(node))
        if name.startswith("yaml.") and name.split(".")[-1] in ("load", "load_all", "unsafe_load", "full_load"):
            found.append(ast.unparse(node))
        if name in ("pickle.load", "pickle.loads", "eval", "exec", "marshal.loads"):
            found.append(ast.unparse(node))
        if isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is not False:
            found.append(ast.unparse(node))
    return found


def test_no_unsafe_deserialisation_or_remote_code_in_the_package():
    bad = _unsafe_calls(
        "torch.load(p)\ntorch.load(p, weights_only=False)\nyaml.load(s)\nyaml.unsafe_load(s)\npickle.loads(b)\n"
        "AutoModel.from_pretrained(d, trust_remote_code=True)\ntorch.load(p, weights_only=True)\nyaml.safe_load(s)\n"
    )
    assert len(bad) == 6  # the scanner catches each kind, and passes the safe ones
    files = sorted((ROOT / "hf3d").rglob("*.py"))
    assert len(files) > 10
    found = {str(f.relative_to(ROOT)): _unsafe_calls(f.read_text()) for f in files}
    assert not {k: v for k, v in found.items() if v}


SAMPLED = ["samples.prompts=['ROMEO:']", "samples.every=1", "samples.max_new_tokens=4"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_right_after_a_checkpoint_loses_no_metrics_record(tmp_path, mode):
    """Killed between publishing step 3's checkpoint and writing step 3's record: the resumed run starts
    at step 4, so step 3's record must already be on disk (write the record first: a kill after the
    record and before the checkpoint re-trains that step, and the resumed run drops the stale record); so must
    step 3's sample in samples.jsonl (drawn every step). With checkpoint.async the kill comes from the background
    thread, as `latest` is updated."""
    out = tmp_path / "run"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    args = _train_args(out, "run.steps=5", "parallel.tp=1", "checkpoint.every=1", "run.save_final=false", *SAMPLED)
    args += ["checkpoint.async=true"] if mode == "async" else []
    cmd = [sys.executable, str(driver), "0", "3", "published", str(tmp_path / "exits.log"), "--", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True).returncode == -signal.SIGKILL
    assert checkpoint.resolve_resume("auto", out / "checkpoints") == out / "checkpoints" / "step_3"
    proc = subprocess.run([sys.executable, "-m", "hf3d", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in _metrics(out, "samples.jsonl")] == [1, 2, 3, 4, 5]  # step 3's sample was not lost


# -- 7. SIGKILL between resumes ------------------------------------------------------------------------
LOOP = ["run.steps=20", "parallel.tp=1", "checkpoint.every=1", "checkpoint.keep_last=2", SAMPLED[0], "samples.every=3"]


def _metrics(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_loop_resumes_to_the_uninterrupted_run_bit_for_bit(tmp_path, mode):
    """With checkpoint.async a kill also lands while a checkpoint is written in the background; the
    uninterrupted run is the synchronous one either way."""

    def run(out: Path, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "hf3d", *_train_args(out, *LOOP, *extra)]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run(straight).wait(timeout=600) == 0
    ours = ["checkpoint.async=true"] if mode == "async" else []
    rng = random.Random(0)
    for _ in range(6):  # each kill 1-3 steps after the last resume, anywhere in a step or its checkpoint
        done = _metrics(killed)[-1]["step"] if (killed / "metrics.jsonl").is_file() else 0
        if done >= 20:  # the last kill landed after the last step: the final run below re-exports
            break
        proc = run(killed, *ours)
        try:
            _wait_for_step(killed / "metrics.jsonl", min(done + rng.randint(1, 3), 20), proc)
            time.sleep(rng.uniform(0, 0.6))
        finally:
            proc.kill()
            proc.wait()
    assert run(killed, *ours).wait(timeout=600) == 0
    a, b = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 21))  # each step once: none trained twice, none skipped
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert _metrics(straight, "samples.jsonl") == _metrics(killed, "samples.jsonl")  # every sample, once
    fa, fb = load_file(straight / "final" / "model.safetensors"), load_file(killed / "final" / "model.safetensors")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _export_into_a_full_disk(tmp: str, mid_stream: bool) -> None:
    import resource

    start_watchdog(120)
    model_dir = Path(tmp) / "model"
    if dist.get_rank() == 0:
        make_model_dir(model_dir, "llama")
    dist.barrier()
    pmodel = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=2))
    out = Path(tmp) / "export"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 0:
        if mid_stream:  # the header and the first tensors fit; the rest of the file does not (EFBIG)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, limit[1]))
        else:  # the folder cannot be created: a file stands where its parent should be
            (Path(tmp) / "blocked").write_text("")
            out = Path(tmp) / "blocked" / "export"
    t0 = time.perf_counter()
    try:
        pmodel.save_pretrained(out)
        msg = None
    except (OSError, ValueError) as e:
        msg = f"{type(e).__name__}: {e}"
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    report({"msg": msg, "seconds": time.perf_counter() - t0, "final": out.exists()}, Path(tmp) / "res.pt")


@pytest.mark.parametrize("mid_stream", [False, True], ids=["unwritable", "full-disk-mid-stream"])
def test_save_pretrained_failing_on_rank0_raises_on_every_rank(tmp_path, mid_stream):
    """Rank 0 writes the export while the others send it their pieces: a write that fails on rank 0
    (before the first tensor, or in the middle of the stream) is raised on every rank at once, with no
    rank left waiting for the collective timeout and no directory that looks finished."""
    spawn(_export_into_a_full_disk, 2, str(tmp_path), mid_stream)
    results = torch.load(tmp_path / "res.pt")
    for rank, res in enumerate(results):
        assert res["msg"] is not None, rank
        assert res["seconds"] < 30, res  # the collective timeout is 10 minutes
        assert not res["final"], rank
    assert ("File too large" if mid_stream else "blocked, which is a file: choose another output path") in results[0][
        "msg"
    ]
    assert results[1]["msg"].startswith("ValueError: rank 0 could not write the HF directory")
