"""The benchmark scripts and their runner (benchmarks/run.py), and one check the dropped benchmarks made.

Slow (deselected by default; `python -m pytest -q -m slow tests/test_benchmarks.py`): every CPU benchmark the
runner knows runs at its smoke size (`--quick`) in a fresh process, with HF3D_BENCH_RESULTS pointing at a
temporary folder so no recorded result is touched; it must exit 0, write a results JSON that records its commit,
and the runner must make its table row from it. The GPU script runs its `--cpu-smoke` path (every row at tiny
shapes on the CPU, FP8 emulated, `hf3d train` with async saves). Fast: the GPU script stops cleanly without
CUDA; the runner marks rows by commit and shows missing, missed and stale rows; the README blocks it rewrites
exist; benchmarks/ stays within its 3,850 lines (3,600 until bench_plan.py, which compares `hf3d plan`'s memory
prediction with measured runs); context parallelism's K/V traffic is the formula's (what
bench_cp.py checked before it was dropped).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(Path(__file__).parent))

import run  # noqa: E402  (benchmarks/run.py)

SMOKE_TIMEOUT_S = 600
CPU_BENCHMARKS = [b for b in run.BENCHMARKS if not b.gpu]


def run_script(args: list[str], results: Path, timeout: float = SMOKE_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF3D_BENCH_RESULTS=str(results), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _written(results: Path, name: str) -> dict:
    path = results / "quick" / f"{name}.json"
    assert path.is_file(), f"no {path.relative_to(results)} written (expected under $HF3D_BENCH_RESULTS/quick/)"
    data = json.loads(path.read_text())
    env = data["env"]
    assert env.get("git_commit") and "torch" in env, f"{path.name} does not record its commit and versions"
    return data


@pytest.mark.slow
@pytest.mark.parametrize("bench", CPU_BENCHMARKS, ids=[b.name for b in CPU_BENCHMARKS])
def test_benchmark_runs_at_smallest_size(bench, tmp_path):
    proc = run_script([str(BENCH / bench.script), *bench.args, "--quick"], tmp_path)
    assert proc.returncode == 0, f"{bench.command} --quick failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    bench.line(_written(tmp_path, bench.name))  # the runner makes its table row from this file


@pytest.mark.slow
def test_gpu_script_cpu_smoke_runs_every_row(tmp_path):
    proc = run_script([str(BENCH / "gpu.py"), "--cpu-smoke"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = _written(tmp_path, "gpu")
    failed = {name: r.get("error") or r.get("skipped") for name, r in data["rows"].items() if "tokens_per_s" not in r}
    assert not failed, failed
    import gpu  # benchmarks/gpu.py: every row it ran is in a comparison, and every comparison has its ratio

    assert set(data["rows"]) == {row for _, *rows, _ in gpu.COMPARISONS for row in rows}, sorted(data["rows"])
    assert all("ratio" in r for r in data["ratios"]), data["ratios"]
    train = data["rows"]["hf3d train 360M"]
    assert [s["step"] for s in train["saves"]] == [2, 4, 6] and len(train["save_blocking_s"]) == 4, train
    for side in ("stock", "hf3d"):  # every decoder layer through torch.compile, one graph for all of them
        assert data["rows"][f"360M {side} compiled"]["graphs"] == 1, data["rows"][f"360M {side} compiled"]
    run.BY_NAME["gpu"].line(data)


def test_gpu_script_stops_cleanly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu.py would run for real")
    script = str(BENCH / "gpu.py")
    skipped = run_script([script, "--skip-without-gpu"], tmp_path, timeout=120)
    assert skipped.returncode == 0 and "CUDA is not available" in skipped.stdout, skipped.stderr[-2000:]
    refused = run_script([script], tmp_path, timeout=120)
    assert refused.returncode == 2 and "does not fall back to CPU" in refused.stdout, refused.stderr[-2000:]
    assert not list(tmp_path.rglob("*.json")), "no results may be written without a GPU"


def test_runner_marks_rows_by_commit_and_shows_every_row(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    if not head.strip():
        pytest.skip("not a git checkout")
    assert run.status({"git_commit": head.strip()})[0] == "current"
    assert run.status({"git_commit": head.strip(), "hf3d_uncommitted_at_start": "1 file changed"})[0] == "UNCOMMITTED"
    assert run.status({"git_commit": "0000000"})[0] == "UNKNOWN"
    assert run.status({})[0] == "UNKNOWN"
    root = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True, text=True)
    first = root.stdout.split()[0] if root.stdout.split() else None
    if first and subprocess.run(["git", "diff", "--quiet", first, "HEAD", "--", "hf3d"], cwd=REPO).returncode:
        assert run.status({"git_commit": first})[0] == "STALE"

    env = {"git_commit": "0000000", "date_utc": "2000-01-01 00:00:00", "torch_threads": 2}
    wall = {"ratio_hf3d_over_stock": 1.25, "ratio_of_minima": 1.2}
    step_time = dict(env=env, n_params=8e6, args={"repeats": 20}, result={"wall": wall})
    (tmp_path / "step_time.json").write_text(json.dumps({**step_time, "memory_ratio_hf3d_over_stock": 0.7}))
    (tmp_path / "convert.json").write_text(json.dumps({"env": env, "bf16": {}}))  # an older format
    table, not_current = run.perf_table(tmp_path)
    assert not_current == ["step_time", "convert"]
    row = next(line for line in table.splitlines() if "`python benchmarks/bench_step_time.py`" in line)
    assert "**UNKNOWN**" in row and "1.250x median step time (target ≤ 0.95x: missed)" in row  # a miss is shown
    assert "earlier version of the script" in next(line for line in table.splitlines() if "bench_convert" in line)
    assert "not measured yet: no `results/init_memory.json`" in table  # a missing file is shown, not hidden
    assert "not measured yet (needs a GPU)" in table
    assert len(table.splitlines()) == 2 + len(run.BENCHMARKS)


def test_runner_finds_the_blocks_it_rewrites():
    texts, _ = run.render()  # raises when README.md, docs/performance.md or benchmarks/README.md lost a marker block
    assert set(texts) == {REPO / "README.md", REPO / "docs" / "performance.md", BENCH / "README.md"}
    assert "<!-- perf:start -->" not in (REPO / "README.md").read_text()  # the table lives in docs/performance.md
    readme = (BENCH / "README.md").read_text()
    for b in run.BENCHMARKS:
        assert f"`{b.script}`" in readme, f"benchmarks/README.md does not say what {b.script} measures"
    assert {p.name for p in BENCH.glob("*.py")} == {"_common.py", "run.py", *(b.script for b in run.BENCHMARKS)}


def test_benchmarks_stay_within_3900_lines():
    lines = sum(len(p.read_text().splitlines()) for p in BENCH.rglob("*.py"))
    assert lines <= 3900, f"benchmarks/ holds {lines} lines of Python"


def _cp_traffic(model_dir: str, out: str) -> None:
    from dist import report

    import hf3d

    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(cp=2))
    ids = torch.randint(0, pm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    pm.train_step(ids, ids)
    report(pm.cp.kv_bytes, out)


def test_cp_kv_bytes_received_per_rank_are_the_formula(tmp_path):
    """cp=2, one step: each rank receives (cp - 1)/cp of the K/V of every layer once forward (all-gather) and
    once backward (reduce-scatter of their gradients): layers x 2 x 2 (K and V) x rows x S x kv_heads x head_dim
    x 4 bytes x (cp - 1)/cp, and nothing more."""
    from dist import spawn
    from models import make_model_dir, tiny_config

    cfg = tiny_config("llama")
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    spawn(_cp_traffic, 2, str(model_dir), str(tmp_path / "kv.pt"))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    want = cfg.num_hidden_layers * 2 * 2 * 2 * 24 * cfg.num_key_value_heads * head_dim * 4 // 2
    assert torch.load(tmp_path / "kv.pt") == [want, want]
