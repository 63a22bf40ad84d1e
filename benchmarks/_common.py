"""What the benchmark scripts share: the environment block, results files, tables, memory probes, launching.

Nothing here is timed by tests; benchmarks/run.py runs the scripts and builds the tables from their results.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# HF3D_BENCH_RESULTS redirects every results file (tests/test_benchmarks.py writes into a temporary folder)
RESULTS = Path(os.environ.get("HF3D_BENCH_RESULTS") or BENCH_DIR / "results")
if str(REPO) not in sys.path:  # hf3d is used from the working tree, not an installed copy
    sys.path.insert(0, str(REPO))

# glibc's malloc for memory measurements: every block of 64 KiB or more is its own mapping, returned when
# freed, so RSS follows live memory rather than the allocator's history
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


# -- statistics and tables ------------------------------------------------------------------------
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != x:
            return "n/a"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def mib(n_bytes) -> float:
    return float(n_bytes) / 2**20


def md_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    out += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def verdict(value: float, target: float, *, at_most: bool = True) -> str:
    met = value <= target if at_most else value >= target
    return f"target {'≤' if at_most else '≥'} {target}x: {'met' if met else 'missed'}"


# -- environment and results files ---------------------------------------------------------------
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def hf3d_uncommitted() -> str:
    """Uncommitted changes under hf3d/ ('' when the tree matches the commit): other people edit it."""
    if os.environ.get("HF3D_BENCH_COMMIT"):  # a clean copy of that commit's tree, sent without its .git
        return ""
    out = _git("diff", "HEAD", "--shortstat", "--", "hf3d")
    return f"{out} ({', '.join(_git('diff', 'HEAD', '--name-only', '--', 'hf3d').split())})" if out else ""


def env_info() -> dict:
    """The environment block every results file carries; git_commit is what benchmarks/run.py marks rows by."""
    import torch
    import transformers

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "git_commit": os.environ.get("HF3D_BENCH_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "hf3d_uncommitted_at_start": hf3d_uncommitted(),
    }


def write_results(name: str, title: str, body_md: str, data: dict, *, quick: bool) -> Path:
    """results/<name>.md (the table, the command, the environment, the raw JSON) and results/<name>.json.
    Quick (smoke) runs go to results/quick/ so they never overwrite a measurement."""
    out_dir = RESULTS / "quick" if quick else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    data = dict(data)
    env = data.setdefault("env", {})
    env["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    env["hf3d_uncommitted_at_end"] = hf3d_uncommitted()
    cmd = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    raw = json.dumps(data, indent=1, default=str)
    text = (
        f"# {title}\n\n{'**QUICK smoke run — not a measurement.**' if quick else ''}\n\n"
        f"Command: `{cmd}`\n\nEnvironment: {', '.join(f'{k}={v}' for k, v in env.items())}\n\n{body_md}\n\n"
        f"<details><summary>raw JSON</summary>\n\n```json\n{raw}\n```\n</details>\n"
    )
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(raw)
    return out_dir / f"{name}.md"


def import_hf3d():
    """hf3d with every public name loaded (as a user's script would use them): a memory baseline taken after
    this call holds hf3d's module imports, and no measured call imports a module."""
    import hf3d

    for name in hf3d.__all__:
        if name != "Trainer":  # transformers' Trainer is not imported by a training script
            getattr(hf3d, name)
    return hf3d


# -- memory probes (Linux /proc) ------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes. VmHWM is the kernel's exact peak RSS;
    `reset_peak()` sets it back to the current RSS (ru_maxrss cannot be reset, and survives fork + exec)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


# -- launching ------------------------------------------------------------------------------------
def child_env(extra: dict | None = None) -> dict:
    """This environment for a child process, less the rendezvous of this process's own process group (which
    hf3d.parallelize writes into os.environ for a world of one): the child starts a world of its own."""
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    # PYTHONFAULTHANDLER: a worker killed by a signal (SIGABRT, SIGSEGV) prints where each thread was
    return {"OMP_NUM_THREADS": "1", **env, "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1", **(extra or {})}


def torchrun(script: Path, nproc: int, args: list[str], *, timeout: float = 900, env: dict | None = None):
    """`torchrun --standalone --nproc-per-node N script args`; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=child_env(env), cwd=REPO)


def python_subprocess(script: Path, args: list[str], *, timeout: float = 900, env: dict | None = None):
    cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(env), cwd=REPO)


def run_workers(script: Path, nproc: int, args: list[str], out: Path, *, env: dict | None = None) -> list[dict]:
    """Run `script args` as nproc torchrun workers (one plain process when nproc is 1), each writing
    `<out>.rank<r>.json`; returns those records, or raises with the workers' error output."""
    launch = torchrun if nproc > 1 else lambda s, _n, a, env: python_subprocess(s, a, env=env)
    proc = launch(script, nproc, [*args, "--out", str(out)], env=env)
    files = [Path(f"{out}.rank{r}.json") for r in range(nproc)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        raise RuntimeError(f"{script.name} {args[:2]} failed (exit {proc.returncode}):\n{worker_errors(proc.stderr)}")
    return [json.loads(f.read_text()) for f in files]


def write_rank(out: str, rec: dict) -> None:
    """A worker's last call: its record, then hf3d.finish() (in a process group every rank leaves together and
    skips the interpreter's teardown, where a gloo thread freeing the last collective's tensors can abort it)."""
    Path(f"{out}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(rec))
    import_hf3d().finish()


def hf3d_train(config: str, settings: list[str], *, nproc: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    """`hf3d train --nproc-per-node N CONFIG --set SETTINGS...` from the repository root, as the README
    launches it; returns the finished process and its wall time in seconds."""
    cmd = [sys.executable, "-m", "hf3d", "train", "--nproc-per-node", str(nproc)]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, config, "--set", *settings], cwd=REPO, capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def worker_errors(stderr: str, n: int = 40) -> str:
    """The last n lines the workers wrote before torchrun's report of their failure (which would fill a tail), and
    that report's first line."""
    lines = stderr.strip().splitlines()
    cut = next((i for i, line in enumerate(lines) if "failed (exitcode" in line), len(lines))
    return "\n".join(lines[max(0, cut - n) : cut + 1])


# -- models ---------------------------------------------------------------------------------------
# the published SmolLM2 shapes, as LlamaConfig keyword arguments
_SMOLLM2 = dict(
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    bos_token_id=0,
    eos_token_id=0,
)
SMOLLM2_135M = dict(
    _SMOLLM2,
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
)
SMOLLM2_360M = dict(
    _SMOLLM2,
    hidden_size=960,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    intermediate_size=2560,
)
SMOLLM2_1_7B = dict(
    _SMOLLM2,
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 130000.0},
)


def llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=None,
    )
    return LlamaConfig(**{**base, **kw})


def shape_str(cfg) -> str:
    return (
        f"{cfg.model_type} hidden={cfg.hidden_size}, layers={cfg.num_hidden_layers}, heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} kv, inter={cfg.intermediate_size}, vocab={cfg.vocab_size}, "
        f"tied={bool(cfg.tie_word_embeddings)}"
    )


def save_model_dir(cfg, path: Path, *, dtype, seed: int = 0) -> int:
    """A stock model from `cfg` (seeded init) saved as an HF dir; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    return n
