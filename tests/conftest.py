"""Shared pytest fixtures: the tiny saved HF models of every supported family, built once."""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the test helpers (dist, models, reference)

import audit  # noqa: E402
import runs  # noqa: E402
from models import make_model_dir  # noqa: E402

FAMILIES = ("llama", "llama-kvrep", "qwen2", "qwen3", "smollm3")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """{family: HF directory} for the five tiny families of tests/models.py (seed 0)."""
    root = tmp_path_factory.mktemp("families")
    return {f: make_model_dir(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_losses(tmp_path_factory) -> list[float]:
    """The tiny run's losses on one process (tests/runs.py): what two nodes, a restart or a preemption must give."""
    return runs.one_process_losses(tmp_path_factory.mktemp("tiny-one-process"))


@pytest.fixture
def direct_writes_from_memory(monkeypatch) -> list[int]:
    """The lengths of the writes hf3d.checkpoint.checksums.DirectFile makes from its caller's memory (past its buffers),
    in order, while the test runs."""
    from hf3d.checkpoint import checksums

    lengths: list[int] = []
    write_view = checksums.DirectFile._write_view
    monkeypatch.setattr(
        checksums.DirectFile, "_write_view", lambda self, view: (lengths.append(len(view)), write_view(self, view))
    )
    return lengths


@pytest.fixture(scope="session", autouse=True)
def _audit_log(tmp_path_factory) -> Path:
    """Every process of the session records what hf3d deletes, renames, writes and unpickles (tests/audit.py):
    this one in `audit.found`, the gloo workers of tests/dist.py in this file."""
    log = tmp_path_factory.mktemp("audit") / "problems.txt"
    log.touch()
    try:  # matplotlib writes its font cache on a machine's first plot: let that happen before the audit watches
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass
    os.environ[audit.LOG_ENV] = str(log)
    os.environ[audit.FILE_ENV] = audit.__file__
    audit.install()
    audit.watching = True
    with _audit_line_in_site_packages():
        yield log
    audit.watching = False
    os.environ.pop(audit.LOG_ENV, None)
    os.environ.pop(audit.FILE_ENV, None)


@contextlib.contextmanager
def _audit_line_in_site_packages():
    """For the session, a .pth file in site-packages whose line watches every Python process the suite starts
    (tests/audit.py: commands, torchrun workers, the checkpoint writer under `python -I`); removed afterwards, and
    those of killed sessions when the next one starts."""
    site = Path(sysconfig.get_paths()["purelib"])
    for left in site.glob("hf3d_suite_audit_*.pth"):  # a killed session's: its process is gone
        pid = left.stem.rsplit("_", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            left.unlink(missing_ok=True)
    pth = site / f"hf3d_suite_audit_{os.getpid()}.pth"
    pth.write_text(audit.START_LINE)
    try:
        yield
    finally:
        pth.unlink(missing_ok=True)


_said = {"found": 0, "logged": 0}


@pytest.fixture(autouse=True)
def _audited(_audit_log: Path):
    """Fails the test (at its teardown) on whatever the audit recorded since the last test was checked (in a
    module's fixtures too): a deletion, a rename, a write or an unpickling that hf3d must not make."""
    yield
    logged = _audit_log.read_text().splitlines()
    new = audit.found[_said["found"] :] + logged[_said["logged"] :]
    _said.update(found=len(audit.found), logged=len(logged))
    if new:
        pytest.fail("the audit of hf3d's file and pickle calls (tests/audit.py) found:\n" + "\n".join(new))
