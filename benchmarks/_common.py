"""Helpers shared by the benchmark scripts: results files, tables, memory probes, launching.

Nothing here is timed by tests; the scripts are run by hand (see benchmarks/README.md).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# HF3D_BENCH_RESULTS redirects every results file (tests/test_benchmarks.py writes into a temporary folder)
RESULTS = Path(os.environ.get("HF3D_BENCH_RESULTS") or BENCH_DIR / "results")
if str(REPO) not in sys.path:  # hf3d is used from the working tree, not an installed copy
    sys.path.insert(0, str(REPO))


# glibc's malloc for memory measurements: every block of 64 KiB or more is its own mapping, returned when
# freed, so RSS follows live memory rather than the allocator's history (benchmarks/README.md)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


# -- statistics and tables -------------------------------------------------------------------------
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def quantile(xs, q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


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
    for r in rows:
        out.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |")
    return "\n".join(out)


def line_panels(panels: list[dict], path: Path, *, width: float = 7.0, height: float = 4.0) -> None:
    """Side-by-side panels of named curves, saved as a PNG. Each panel: {"curves": {name: (xs, ys)}, "xlabel",
    "ylabel", "title"}; the first panel carries the legend. matplotlib is in the dev extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name, (xs, ys) in panel["curves"].items():
            ax.plot(xs, ys, label=name, linewidth=1)
        ax.set(xlabel=panel["xlabel"], ylabel=panel["ylabel"], title=panel["title"])
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- environment ------------------------------------------------------------------------------------
def env_info() -> dict:
    import torch
    import transformers

    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    try:
        import accelerate

        info["accelerate"] = accelerate.__version__
    except ImportError:
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        info["hf3d_uncommitted_at_start"] = hf3d_uncommitted()
        if os.environ.get("HF3D_BENCH_COMMIT"):  # a clean copy of that commit's tree, sent without its own .git
            info["git_commit"], info["hf3d_uncommitted_at_start"] = os.environ["HF3D_BENCH_COMMIT"], ""
    except OSError:
        pass
    return info


def hf3d_uncommitted() -> str:
    """Uncommitted changes under hf3d/ ('' when the tree matches the commit): other people edit it."""
    try:
        out = subprocess.run(
            ["git", "diff", "HEAD", "--shortstat", "--", "hf3d"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        files = subprocess.run(
            ["git", "diff", "HEAD", "--name-only", "--", "hf3d"], cwd=REPO, capture_output=True, text=True
        ).stdout.split()
    except OSError:
        return "unknown"
    return f"{out} ({', '.join(files)})" if out else ""


def write_results(name: str, title: str, body_md: str, data: dict, *, quick: bool) -> Path:
    """Write results/<name>.md (markdown + the raw JSON) and results/<name>.json.

    Quick (smoke) runs go to results/quick/ so they never overwrite a full run's numbers.
    """
    out_dir = RESULTS / "quick" if quick else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    data = dict(data)
    data.setdefault("env", {})["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    data["env"]["hf3d_uncommitted_at_end"] = "" if os.environ.get("HF3D_BENCH_COMMIT") else hf3d_uncommitted()
    env = data["env"]
    env_line = ", ".join(f"{k}={v}" for k, v in env.items())
    cmd = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    text = (
        f"# {title}\n\n{'**QUICK smoke run — not a measurement.**' if quick else ''}\n\n"
        f"Command: `{cmd}`\n\nEnvironment: {env_line}\n\n{body_md}\n\n"
        f"<details><summary>raw JSON</summary>\n\n```json\n{json.dumps(data, indent=1, default=str)}\n```\n</details>\n"
    )
    md = out_dir / f"{name}.md"
    md.write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    return md


def import_hf3d():
    """hf3d with every public name loaded, as a plain `import hf3d` loaded them before names were loaded on
    first use: a baseline taken after this call holds hf3d's module imports, and no measured call does."""
    import hf3d

    for name in hf3d.__all__:
        if name != "Trainer":  # transformers' Trainer was never imported with hf3d
            getattr(hf3d, name)
    return hf3d


# -- memory probes ----------------------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process in bytes (Linux /proc)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakSampler:
    """Samples /proc/self/status in a thread; records the peak of each field.

    ru_maxrss (VmHWM) is the exact peak RSS but counts file-backed pages (mmapped safetensors)
    as well as anonymous memory; the sampled RssAnon peak separates the two (it may miss a spike
    shorter than the interval).
    """

    def __init__(self, interval_s: float = 0.003):
        self.interval_s = interval_s
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for k, v in proc_status().items():
            if v > self.peak.get(k, -1):
                self.peak[k] = v

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


# -- launching --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, nproc: int, args: list[str], *, timeout: float = 900, env: dict | None = None):
    """Run `torchrun --standalone --nproc-per-node N script args`; returns the CompletedProcess."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONWARNINGS"] = "ignore"
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def python_subprocess(script: Path, args: list[str], *, timeout: float = 900, env: dict | None = None):
    full_env = dict(os.environ)
    full_env["PYTHONWARNINGS"] = "ignore"
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO
    )


def hf3d_train(config: str, settings: list[str], *, nproc: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    """`torchrun --nproc-per-node N -m hf3d train CONFIG --set SETTINGS...` from the repository root, as the
    README launches it; returns the finished process and its wall time in seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "hf3d", "train"]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, config, "--set", *settings], cwd=REPO, capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


# -- models -----------------------------------------------------------------------------------------
# the published SmolLM2 shapes (FACTS.md), as LlamaConfig keyword arguments
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
    base.update(kw)
    return LlamaConfig(**base)


def shape_str(cfg) -> str:
    return (
        f"Llama hidden={cfg.hidden_size}, layers={cfg.num_hidden_layers}, heads={cfg.num_attention_heads}/"
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
    del model
    return n


def leave_distributed() -> None:
    """End a distributed worker whose work is done on every rank: all ranks arrive, output is flushed,
    then os._exit(0) (hf3d.faults.leave). No interpreter teardown: with gloo's threads still up it was
    seen to abort a finished rank ("terminate called without an active exception", SIGABRT), even after
    destroy_process_group, which cannot free process groups that live objects still reference."""
    from hf3d.faults import leave

    leave(0)
