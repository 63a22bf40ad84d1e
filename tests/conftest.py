"""Shared pytest fixtures: the tiny saved HF models of every supported family, built once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the test helpers (dist, models, reference)

from models import make_model_dir  # noqa: E402

FAMILIES = ("llama", "llama-kvrep", "qwen2", "qwen3", "smollm3")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """{family: HF directory} for the five tiny families of tests/models.py (seed 0)."""
    root = tmp_path_factory.mktemp("families")
    return {f: make_model_dir(root / f, f) for f in FAMILIES}


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
