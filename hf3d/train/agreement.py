"""Every node of an `hf3d train` job runs the same run: the same resolved config, the same versions of the code
that shapes the numbers, the same data. A node started with another YAML, another `--set`, another environment
or other data files would otherwise train on its own settings inside the job, silently.

Two checks, each ONE gather over the default process group (`dist.all_gather_object`), each compared with rank 0:

- `check_config`, right after the process group starts: the versions (hf3d with a hash of its own source files,
  python, torch with its CUDA build, transformers, accelerate; numpy, whose generators draw the data order on every
  rank and may change their streams between releases; tokenizers), then the resolved `TrainConfig`
  after `--set`, flattened to `section.key -> value` (nested sections and lists of sections by key and index:
  `data.eval.every`, `data.stages[1].sources[0].weight`). Versions come first: another hf3d can explain a config
  difference (another default).
- `check_data`, once the data pipeline has opened its sources: the tokenizer's fingerprint, then per source its
  name, token, document and segment counts and a hash of a fixed sample of its token ids and document ends (a few
  KiB read from the memory maps). Nothing of it depends on file paths or times, so copies of the same files on
  each node pass, and two nodes with different files are refused; the sample may miss an edit that changes no
  count and no sampled token.

A mismatch raises the same ValueError on every rank (every rank holds the whole gather), so no rank goes on to a
collective its peers never reach, and the run's failure path (faults.fail) prints one line for the job. The line
names the first rank whose values differ from rank 0's: its node (torchrun's node rank, env GROUP_RANK), host and
the node's ranks that differ, the first differing key with both values, and what to do.

Keys that may differ per node (`PER_NODE`): data.cache_dir and data.num_proc. The cache folder is where each node's
main process writes its tokenised sources (a node-local disk has its own path), and num_proc is how many
processes tokenise on that node: neither changes a token, and the tokens themselves are compared by `check_data`.
Every other key counts, paths included: the checkpoint and output folders must be one shared place, and a model
or data path that differs is more often another model or data set than a copy.

Under nccl `all_gather_object` moves the pickled values through the current CUDA device, which
`mesh.init_distributed` sets from LOCAL_RANK before the group starts; under gloo through host memory. A run of one
process gathers nothing and computes nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

PER_NODE = ("data.cache_dir", "data.num_proc")
PACKAGES = ("transformers", "accelerate", "numpy", "tokenizers")
SAMPLE_SPANS = 16  # slices of a source's tokens that its hash reads, evenly spaced
SAMPLE_TOKENS = 256  # tokens per slice
MAX_VALUE = 80  # characters of a value in the message


@dataclass(frozen=True)
class Entry:
    """One rank's part of a gather: where it runs and what it holds (section -> key -> value)."""

    rank: int
    node: int | None
    host: str
    values: dict[str, dict]


# --- what is compared ----------------------------------------------------------------------------------------


def flat_config(cfg) -> dict:
    """The TrainConfig as `section.key -> value` (nested mappings and lists of mappings flattened), without the
    keys that may differ per node."""
    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, list | tuple) and any(isinstance(v, dict | list | tuple) for v in value):
            out[f"{prefix} length"] = len(value)  # first: a list of another length says so
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        else:
            out[prefix] = list(value) if isinstance(value, tuple) else value

    for section, values in cfg.to_dict().items():
        walk(section, values)
    return {k: v for k, v in out.items() if k not in PER_NODE}


def _hf3d_source() -> str:
    """sha256 (12 hex) of hf3d's .py files, names and bytes: two installs of one version from other commits
    differ here."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def versions() -> dict[str, str]:
    """The versions of what shapes the numbers, by name."""
    from .. import __version__

    out = {
        "hf3d": f"{__version__} (source {_hf3d_source()})",
        "python": platform.python_version(),
        "torch": torch.__version__ + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""),
    }
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _sample_hash(segments) -> str:
    """sha256 (16 hex) of each segment's length and SAMPLE_SPANS evenly spaced slices of its tokens and
    document ends, read as int64 (the same ids hash alike in uint16 and uint32 files)."""
    h = hashlib.sha256()
    for tokens, doc_ends in segments:
        h.update(np.int64(len(tokens)).tobytes())
        for array, width in ((tokens, SAMPLE_TOKENS), (doc_ends, 1)):
            n = len(array)
            starts = np.linspace(0, max(n - width, 0), num=SAMPLE_SPANS).astype(np.int64)
            for s in np.unique(starts):
                h.update(np.asarray(array[s : s + width], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def data_fingerprint(pipe, tokenizer) -> dict:
    """`name -> value` of what a DataPipeline reads: the tokenizer, the sources' names, and per source its
    counts and a hash of a sample of its tokens; nothing that depends on a path or a file's time."""
    from ..data.sources import tokenizer_fingerprint

    opened = {}  # a source read at two seq_lens is two views of one segment list
    for src in [*pipe.sources.values(), *([pipe.eval_source] if pipe.eval_source is not None else [])]:
        opened.setdefault(src.name, src)
    out: dict = {"tokenizer": tokenizer_fingerprint(tokenizer), "sources": sorted(opened)}
    for name, src in sorted(opened.items()):
        out[f"source {name!r} num_tokens"] = src.num_tokens
        out[f"source {name!r} num_docs"] = src.num_docs
        out[f"source {name!r} num_segments"] = len(src.segments)
        out[f"source {name!r} token sample"] = _sample_hash(src.segments)
    return out


# --- the comparison --------------------------------------------------------------------------------------


def _ranks_text(ranks: list[int]) -> str:
    """`rank 3`, `ranks 2-3`, `ranks 0-1, 4-5`."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


_ABSENT = object()  # a key one side does not have


def _shown(value) -> str:
    text = "not set" if value is _ABSENT else repr(value)
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 3] + "..."


def _first_difference(mine: dict, ref: dict) -> str | None:
    """The first key (in rank 0's order, then this rank's) whose values differ."""
    for key in [*ref, *(k for k in mine if k not in ref)]:
        if mine.get(key, _ABSENT) != ref.get(key, _ABSENT):
            return key
    return None


def disagreement(entries: list[Entry], section: str, *, does: str, todo: str) -> str | None:
    """The line for the first rank whose `section` differs from rank 0's, None when all agree. `does`: what the
    odd node does ("runs another config"); `todo`: what to do."""
    ref = entries[0]
    odd = next((e for e in entries if e.values[section] != ref.values[section]), None)
    if odd is None:
        return None
    key = _first_difference(odd.values[section], ref.values[section])
    assert key is not None
    same_place = [e for e in entries if (e.node, e.host) == (odd.node, odd.host)]
    ranks = _ranks_text([e.rank for e in same_place if e.values[section] != ref.values[section]])
    if odd.node is not None and odd.node != ref.node:
        who, there = f"node {odd.node} (host {odd.host}, {ranks})", f"node {ref.node}"
    else:  # on rank 0's node, or no node rank (no torchrun): the ranks name it
        node = f"node {odd.node}, " if odd.node is not None else ""
        who, there = f"{ranks} ({node}host {odd.host})", "rank 0"
    mine, theirs = odd.values[section].get(key, _ABSENT), ref.values[section].get(key, _ABSENT)
    return f"{who} {does} than {there}: {key} is {_shown(mine)} there, {_shown(theirs)} on {there}; {todo}"


# --- the checks ----------------------------------------------------------------------------------------------


def _gather(values: dict[str, dict], node: int | None, host: str | None) -> list[Entry]:
    """Every rank's Entry, in rank order."""
    if node is None and "GROUP_RANK" in os.environ:  # torchrun's node rank
        node = int(os.environ["GROUP_RANK"])
    entry = Entry(dist.get_rank(), node, host or socket.gethostname(), values)
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    return entries


def _single_process() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def config_line(entries: list[Entry]) -> str | None:
    """The refusal of a gather of versions and configs: the first version that differs, else the first key."""
    return disagreement(
        entries,
        "versions",
        does="runs other versions",
        todo="install the same versions on every node (one environment, one hf3d checkout)",
    ) or disagreement(entries, "config", does="runs another config", todo="give every node the same YAML and --set")


def data_line(entries: list[Entry]) -> str | None:
    """The refusal of a gather of data fingerprints."""
    return disagreement(
        entries,
        "data",
        does="reads other data",
        todo="give every node the same data files (copies are fine) and the same tokenizer",
    )


def check_config(cfg, *, node: int | None = None, host: str | None = None) -> None:
    """Refuse a job whose ranks differ from rank 0 in versions or resolved config (one ValueError on every rank).
    node, host: where this rank runs (default: env GROUP_RANK, the host name)."""
    if _single_process():
        return
    line = config_line(_gather({"versions": versions(), "config": flat_config(cfg)}, node, host))
    if line:
        raise ValueError(line)


def check_data(pipe, tokenizer, *, node: int | None = None, host: str | None = None) -> None:
    """Refuse a job whose ranks read other data than rank 0: other files, counts or tokenizer (one ValueError on
    every rank). node, host: as in check_config."""
    if _single_process():
        return
    line = data_line(_gather({"data": data_fingerprint(pipe, tokenizer)}, node, host))
    if line:
        raise ValueError(line)
