"""The benchmark scripts: each runs at its smallest size, and the tools they share compute what they say.

Every `benchmarks/bench_*.py` (found by glob, so new scripts are covered) runs with its smoke flag
(`--quick`, or `--small` where a script names it so; without CUDA, also what CPU_SMOKE_ARGS names) in a
fresh process, with HF3D_BENCH_RESULTS pointing at a temporary folder so no recorded result is touched;
it must exit 0 and write a results JSON that records its commit. `gpu_smollm.py` must stop cleanly
without CUDA. These smoke runs are slow (torchrun jobs): deselected by default (pyproject addopts);
`python -m pytest -q -m slow` runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))
SMOKE_TIMEOUT_S = 300
# Extra smoke arguments where a CPU needs them. bench_fp8's FP8 runs go through torch._scaled_mm's CPU
# kernel unless emulated: its quick run (10 steps per recipe) took 12 min here (2 cores), past the timeout;
# --emulate is also how its results file is measured on a CPU.
CPU_SMOKE_ARGS = {"bench_fp8.py": ["--emulate"]}
sys.path.insert(0, str(BENCH))


def smoke_flag(script: str) -> str:
    text = (BENCH / script).read_text()
    for flag in ("--quick", "--small"):
        if f'"{flag}"' in text:
            return flag
    pytest.fail(f"{script} has no --quick (or --small) smoke flag")


def run_script(args: list[str], results: Path, timeout: float = SMOKE_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF3D_BENCH_RESULTS=str(results), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_at_smallest_size(script, tmp_path):
    import torch

    extra = [] if torch.cuda.is_available() else CPU_SMOKE_ARGS.get(script, [])
    proc = run_script([str(BENCH / script), smoke_flag(script), *extra], tmp_path)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    written = sorted((tmp_path / "quick").glob("*.json"))
    assert written, f"{script} wrote no results JSON (expected under $HF3D_BENCH_RESULTS/quick/)"
    for path in written:
        env = json.loads(path.read_text())["env"]
        assert env.get("git_commit") and "torch" in env, f"{path.name} does not record its commit and versions"
    if script == "bench_memory_model.py":  # the derived parts of the model are exact: assert them
        for row in json.loads((tmp_path / "quick" / "memory_model.json").read_text())["rows"]:
            for rank in row["ranks"]:
                assert rank["layer_saved_measured"] == rank["layer_saved_derived"], (row["mesh"], rank["coords"])
                for axis in ("tp", "pp", "dp"):
                    pred, meas = rank["sent_predicted"][axis], rank["sent_measured"][axis]
                    assert abs(pred - meas) <= 64, (row["mesh"], rank["coords"], axis, pred, meas)
    if script == "bench_cp.py":  # the counted K/V bytes are the formula's; every cp trains the same numbers
        data = json.loads((tmp_path / "quick" / "cp.json").read_text())
        for cp, s in data["summary"].items():
            assert s["kv_bytes_per_rank"] == s["kv_bytes_expected"], (
                cp,
                s["kv_bytes_per_rank"],
                s["kv_bytes_expected"],
            )
            assert (s["kv_bytes_per_rank"] > 0) == (cp != "1"), cp
    if script == "bench_scaling.py":
        assert (tmp_path / "quick" / "scaling.png").stat().st_size > 0


def test_gpu_script_stops_cleanly_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu_smollm.py would run for real")
    script = str(BENCH / "gpu_smollm.py")
    skipped = run_script([script, "--quick", "--skip-without-gpu"], tmp_path, timeout=120)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "CUDA is not available" in skipped.stdout
    refused = run_script([script, "--quick"], tmp_path, timeout=120)
    assert refused.returncode == 2 and "does not fall back to CPU" in refused.stdout
    switches = run_script([str(BENCH / "gpu_switches.py"), "--quick"], tmp_path, timeout=120)
    assert switches.returncode == 2 and "CUDA is not available" in switches.stdout
    assert not list(tmp_path.rglob("*.json")), "no results may be written without a GPU"


def test_memory_model_state_is_megatron_accounting():
    import memory_model as MM

    s = MM.Shape(hidden=256, layers=8, heads=8, kv_heads=4, inter=768, vocab=8192, tied=True)
    for dp in (1, 2, 4):
        mem = MM.rank_memory(s, MM.Run(dp=dp, param_bytes=2), 0)
        state = mem["params"] + mem["main_grads"] + mem["master_weights"] + mem["optimizer_state"]
        assert state / s.params() == pytest.approx(6 + 12 / dp)
    fp32 = MM.rank_memory(s, MM.Run(dp=2, param_bytes=4), 0)
    assert fp32["master_weights"] == 0  # fp32 params are their own master weights
    tp2 = MM.rank_memory(s, MM.Run(tp=2), 0)
    assert tp2["activations"] < MM.rank_memory(s, MM.Run(), 0)["activations"]
    afab, ofob = (MM.predict(s, MM.Run(pp=4, microbatches=8, schedule=k)) for k in ("afab", "1f1b"))
    assert afab["ranks"][0]["memory"]["activations"] == pytest.approx(8 / 4 * ofob["ranks"][0]["memory"]["activations"])


def test_report_marks_results_by_commit(tmp_path):
    import report

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert report.status({"git_commit": head})[0] == "current"
    assert report.status({"git_commit": head, "hf3d_uncommitted_at_start": "1 file changed"})[0] == "UNCOMMITTED"
    assert report.status({"git_commit": "0000000"})[0] == "UNKNOWN"
    assert report.status({})[0] == "UNKNOWN"
    root = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True, text=True)
    first = root.stdout.split()[0] if root.stdout.split() else None
    if first and subprocess.run(["git", "diff", "--quiet", first, "HEAD", "--", "hf3d"], cwd=REPO).returncode:
        assert report.status({"git_commit": first})[0] == "STALE"

    env = {"git_commit": "0000000", "date_utc": "2000-01-01 00:00:00"}
    (tmp_path / "memory_model.json").write_text(json.dumps({"env": env, "rows": [{"mesh": [1, 1, 1], "error": 0.2}]}))
    table, not_current = report.perf_table(tmp_path)
    assert "memory_model" in not_current
    row = next(line for line in table.splitlines() if "memory model" in line)
    assert "**UNKNOWN**" in row and "+20.0%" in row and "1 outside" in row
    assert "no `results/step_time.json` yet" in table  # a missing file is shown, not hidden
