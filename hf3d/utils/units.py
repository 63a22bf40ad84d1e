"""Sizes as people write them: "5GB", "500MB", "80GiB" or a number of bytes (GB = 10^9 bytes, as transformers
counts; GiB = 2^30)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: str | int, *, what: str = "--max-shard-size") -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain number; `what` names the option in the one-line error."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"{what} {size!r} is not understood; write it like 5GB, 500MB, 2GiB or a number of bytes")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"{what} {size!r} must be positive")
    return value
