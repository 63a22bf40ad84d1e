"""JSON Lines files a user gives hf3d (tasks, prompts): each object with its line number, a bad line refused in one
line naming the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def json_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of `path`."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not valid JSON: {e.msg}") from None
