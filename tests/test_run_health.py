"""Non-finite steps (skip, count, explain, stop), loss-spike warnings and deterministic runs of `hf3d train`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from runs import metrics_records as _records  # noqa: E402

from hf3d.train.config import RunConfig  # noqa: E402
from hf3d.train.step import StepHealth  # noqa: E402

ONE_PROCESS = [
    "parallel.tp=1",
    "parallel.num_microbatches=1",
    "run.global_batch=4",
    "data.seq_len=32",
    "data.eval.every=0",
    "optim.warmup_steps=1",
    "run.sample_prompt=null",
    "run.log_every=1",
]


# `python -m hf3d` with an atexit handler that says so if the interpreter's teardown runs
TEARDOWN_PROBE = (
    "import atexit, sys; atexit.register(print, 'interpreter teardown', file=sys.stderr); "
    "from hf3d.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _train(out: Path, *settings: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", TEARDOWN_PROBE, "train", "examples/configs/tiny-smollm.yaml", "--set", *ONE_PROCESS]
    cmd += [*settings, f"run.output_dir={out}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_diverging_run_skips_counts_and_stops_after_k_in_a_row(tmp_path):
    """lr=1e30: after step 1's update the gradients are so large that their squared norm overflows; steps
    2..4 are skipped (weights untouched) and the third skip in a row stops the run with one line."""
    out = tmp_path / "run"
    proc = _train(
        out,
        "optim.lr=1e30",
        "optim.max_grad_norm=0",
        "run.steps=10",
        "run.max_consecutive_skips=3",
        "checkpoint.every=1",
        "checkpoint.keep_last=0",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "hf3d train" in line and "failed" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "3 steps in a row had a non-finite gradient" in errors[0] and "step 4" in errors[0]
    assert "every gradient is finite, their norm overflowed" in errors[0]
    assert "lower optim.lr" in errors[0]
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["skipped"] for r in records] == [False, True, True]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    assert "update skipped" in proc.stdout
    assert not (out / "final").exists()  # nothing that looks like a finished run
    assert (out / "checkpoints" / "step_3" / "hf3d_checkpoint.json").is_file()  # the last good save stays


def test_on_nonfinite_stop_stops_at_the_first_bad_step(tmp_path):
    out = tmp_path / "run"
    proc = _train(
        out, "optim.lr=1e30", "optim.max_grad_norm=0", "run.steps=10", "run.on_nonfinite=stop", "checkpoint.every=0"
    )
    assert proc.returncode == 1
    assert "non-finite step 2: loss" in proc.stderr and "run.on_nonfinite=stop" in proc.stderr
    assert [r["step"] for r in _records(out)] == [1]


class _Opt(SimpleNamespace):
    last_step_skipped = False


def test_loss_spike_is_a_warning_not_a_stop():
    health = StepHealth(RunConfig(spike_factor=3.0))
    opt = _Opt()
    assert all(health.check(step, 2.0, 1.0, opt) is None for step in range(1, 21))
    warning = health.check(21, 6.5, 1.0, opt)
    assert warning and "loss spike at step 21: 6.5000 > 3 x the mean of the previous 20 steps (2.0000)" in warning
    assert health.check(22, 5.9, 1.0, opt) is None  # below 3x the mean, which now includes the spike
    assert StepHealth(RunConfig(spike_factor=0)).check(1, 1e9, 1.0, opt) is None


@pytest.mark.parametrize(
    "bad, words",
    [
        ("run.on_nonfinite=ignore", "run.on_nonfinite must be skip or stop"),
        ("run.max_consecutive_skips=0", "run.max_consecutive_skips must be >= 1"),
    ],
)
def test_bad_health_settings(bad, words, tmp_path):
    proc = _train(tmp_path / "x", bad)
    assert proc.returncode == 1 and words in proc.stderr
    assert not (tmp_path / "x").exists()


def test_deterministic_runs_are_bit_identical(tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = _train(out, "run.steps=4", "run.deterministic=true", "checkpoint.every=0")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(out)
    a, b = (_records(out) for out in runs)
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in a] == [(r["loss"], r["grad_norm"], r["lr"]) for r in b]
    assert (runs[0] / "final" / "model.safetensors").read_bytes() == (
        runs[1] / "final" / "model.safetensors"
    ).read_bytes()


def _poisoned_step(tmp: str) -> None:
    import torch
    import torch.distributed as dist
    from dist import report, start_watchdog
    from models import make_model_dir

    import hf3d

    start_watchdog(120)
    model_dir = Path(tmp) / "model"
    if dist.get_rank() == 0:
        make_model_dir(model_dir, "llama")
    dist.barrier()
    pmodel = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=2))
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3)
    before = {n: p.detach().clone() for n, p in pmodel.unique_parameters()}
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    pmodel.train_step(ids, ids)
    opt.finish_grad_sync()
    if dist.get_rank() == 1:  # one rank's gradient of one layer's MLP goes bad
        p = dict(pmodel.unique_parameters())["model.layers.1.mlp.down_proj.weight"]
        _, master, lo, hi = next(m for m in opt._masters if m[0] is p)
        opt.main_grad[lo + 3] = float("nan")
    opt.step()
    names = opt.nonfinite_parameters()
    unchanged = all(torch.equal(p, before[n]) for n, p in pmodel.unique_parameters())
    report({"skipped": opt.last_step_skipped, "names": names, "unchanged": unchanged}, Path(tmp) / "res.pt")


def test_nonfinite_gradient_on_one_rank_skips_everywhere_and_is_named(tmp_path):
    import torch
    from dist import spawn

    sys.path.insert(0, str(ROOT / "tests"))
    spawn(_poisoned_step, 2, str(tmp_path))
    for res in torch.load(tmp_path / "res.pt"):
        assert res == {"skipped": True, "names": ["model.layers.1.mlp.down_proj.weight"], "unchanged": True}


def test_rerunning_a_finished_run_trains_nothing_and_writes_the_final_outputs_again(tmp_path):
    """A job killed after its last checkpoint (in the export, say) is run again by its launcher: it trains
    nothing, leaves the checkpoints and metrics as they are, and writes the final directory again, replacing
    the one already there (hf3d's own export, with its loss curve and run record)."""
    out = tmp_path / "run"
    settings = ["run.steps=2", "checkpoint.every=1"]
    first = _train(out, *settings)
    assert first.returncode == 0, first.stderr[-2000:]
    # a finished one-process run also ends without it: with gloo's threads up it aborted (SIGABRT) once in CI
    assert "interpreter teardown" not in first.stderr
    metrics = (out / "metrics.jsonl").read_text()
    weights = (out / "final" / "model.safetensors").read_bytes()
    checkpoints = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in (out / "checkpoints").rglob("*"))
    exported = sorted(p.name for p in (out / "final").iterdir())
    assert {"loss_curve.png", "hf3d_training.json", "model.safetensors"} <= set(exported), exported
    (out / "final" / "model.safetensors").write_bytes(b"")  # to see it written again
    again = _train(out, *settings)  # resume: auto finds step 2 of 2
    assert again.returncode == 0, again.stderr[-2000:]
    assert "the run is complete at step 2 (run.steps); writing its final outputs again" in again.stdout
    assert (out / "metrics.jsonl").read_text() == metrics
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in (out / "checkpoints").rglob("*")) == checkpoints
    assert (out / "final" / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (out / "final").iterdir()) == exported


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
NOT_HF3D_READS = {
    "device_mesh.py": "a DeviceMesh's rank tensor always lives on the host",
    "masking_utils.py": "stock transformers' packed-sequence detection: one read per forward (docs/inside.md)",
}


def _count_host_syncs(tmp: str) -> None:
    """hf3d train's steps with every host read of a tensor counted (the reads that make a GPU run wait)."""
    import torch
    from dist import report, start_watchdog

    from hf3d.data import DataPipeline
    from hf3d.train import trainer
    from hf3d.train.config import TrainConfig

    start_watchdog(300)
    reads: list[str] = []
    counting = [False]

    def counted(name, original):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            # the fused loss's backward reads its incoming gradient only on CPU (`device.type != "cpu" or`)
            cpu_only = caller.co_name == "backward" and caller.co_filename.endswith("parallel/tensor.py")
            exempt = Path(caller.co_filename).name in NOT_HF3D_READS
            if counting[0] and not (cpu_only or exempt):
                reads.append(f"{name} in {caller.co_name}")
            return original(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    next_batch = DataPipeline.next_batch

    def host_batch(self, step):  # host data: its own tensors live on the host
        counting[0] = False
        try:
            return next_batch(self, step)
        finally:
            counting[0] = True

    DataPipeline.next_batch = host_batch
    step = trainer.one_step
    per_step = []

    def counting_step(*args, **kwargs):
        reads.clear()
        counting[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            counting[0] = False
            per_step.append(list(reads))

    trainer.one_step = counting_step
    settings = [s for s in ONE_PROCESS if not s.startswith("parallel.")] + ["parallel.tp=1", "optim.z_loss=1e-4"]
    settings += ["run.steps=3", "checkpoint.every=0", "run.save_final=false", f"run.output_dir={tmp}/run"]
    trainer.train(TrainConfig.from_yaml(str(ROOT / "examples/configs/tiny-smollm.yaml"), settings))
    report(per_step, Path(tmp) / "res.pt")


def test_a_step_of_hf3d_train_reads_the_device_once(tmp_path):
    """The out-of-vocabulary flag, the loss, the z-loss, the grad norm (and with it the skip decision) and
    the stop signal travel in one small tensor: one host read per step (main had 6: the vocab flag, the
    norm, the loss and norm twice more, the z-loss, the stop signal), here on 2 dp ranks."""
    import torch
    from dist import spawn

    spawn(_count_host_syncs, 2, str(tmp_path))
    for per_step in torch.load(tmp_path / "res.pt"):
        assert len(per_step) == 3
        assert all(reads == ["tolist in _read_values"] for reads in per_step), per_step


def _deferred_bad_label(tmp: str) -> None:
    import torch
    from dist import report, start_watchdog
    from models import make_model_dir

    import hf3d

    start_watchdog(120)
    make_model_dir(Path(tmp) / "model", "llama")
    pmodel = hf3d.parallelize(Path(tmp) / "model", hf3d.ParallelConfig(tp=1))
    pmodel.deferred_checks = True
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    pmodel.train_step(ids, ids)
    opt.step()
    opt.zero_grad()
    before = {n: p.detach().clone() for n, p in pmodel.unique_parameters()}
    state = [v.clone() for st in opt.state.values() for v in st.values()]
    labels = ids.clone()
    labels[1, 5] = 5000  # the forward runs on it (ignored) before opt.step() refuses the step
    pmodel.train_step(ids, labels)
    try:
        opt.step()
        error = None
    except ValueError as e:
        error = str(e)
    unchanged = all(torch.equal(p, before[n]) for n, p in pmodel.unique_parameters())
    now = [v for st in opt.state.values() for v in st.values()]
    state_unchanged = len(now) == len(state) and all(torch.equal(a, b) for a, b in zip(now, state))
    pmodel.train_step(ids, ids)  # the refused step left nothing half done
    opt.step()
    report({"error": error, "unchanged": unchanged and state_unchanged, "steps": opt.num_steps}, Path(tmp) / "res.pt")


def test_a_deferred_bad_label_is_refused_by_opt_step_with_the_weights_unchanged(tmp_path):
    import torch
    from dist import spawn

    spawn(_deferred_bad_label, 1, str(tmp_path))
    (res,) = torch.load(tmp_path / "res.pt")
    assert res["error"] and "labels[1, 5] = 5000" in res["error"] and "vocab_size=" in res["error"], res
    assert res["unchanged"] and res["steps"] == 2, res
