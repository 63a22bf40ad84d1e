"""JSON Lines files a user gives hf3d (tasks, prompts): each object with its line number, a bad line refused in one
line naming the file and the line.

A line is read at most MAX_LINE_BYTES at a time: a longer one is refused before it is held whole, so one huge line
costs no more memory than the limit (tokenising text costs about 165 times its size, so the limit also bounds
what a row can make the tokenizer hold). Bytes that are not UTF-8 and JSON nested deeper than Python parses are
refused with the line's number. `json_document` reads a whole JSON file by the same rule (a checkpoint's config, an
HF folder's index): any failure is one line naming the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

MAX_LINE_BYTES = 16 << 20
"""The longest line a task or prompts file may hold: 16 MiB, far above any context a model reads (a window of
128k tokens is about 0.5 MB of text)."""


def json_lines(path: Path, *, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of `path`."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(max_line_bytes + 1):
            number += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise ValueError(
                    f"{path} line {number} is longer than {max_line_bytes >> 20} MiB, the most hf3d reads as one "
                    "row or prompt: shorten it (a model reads only its last max_length tokens anyway)"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} line {number} is not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not valid JSON: {e.msg}") from None
            except RecursionError:
                raise ValueError(f"{path} line {number} nests JSON deeper than hf3d parses: flatten the row") from None


def json_document(path: str | Path, data: bytes | str) -> object:
    """The JSON value of the whole file `path` (`data`: its bytes): malformed JSON, bytes that are not UTF-8 and
    JSON nested deeper than Python parses are refused in one line naming the file."""
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at {e.start})") from None
    except RecursionError:
        raise ValueError(
            f"{path} nests JSON deeper than hf3d parses; it is not a file hf3d or transformers wrote"
        ) from None
