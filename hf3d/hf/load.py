"""Reading HF weights: only this rank's slices of the safetensors files (or of a model in memory), each read into
its target without a copy of its own.

An HF folder may come from someone else: the files read are the folder's own (`weights_files`: every shard its
index names is a plain file name of the folder, and no weights file is a link leaving it, links into the Hub
cache aside), and a safetensors header's word is checked against the file before anything is read by it
(`_read_header`: its length and every tensor's byte range inside the file, each shape exactly its range). A
malformed index or header is refused in one line naming the file."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..utils.jsonl import json_document
from .folders import SAFE_INDEX, SAFE_SINGLE, link_outside

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


_BLOCK_BYTES = 64 * 2**20  # column slices are read this many bytes of rows at a time


class SafetensorsSource:
    """Reads slices of named tensors from an HF dir's safetensors files (single or sharded).

    Only the requested rows are read (columns: block by block of rows), with plain file reads
    rather than a memory map, so neither the tensors nor the file pages of other ranks' slices
    count towards this process's memory.
    """

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.entries: dict[str, tuple[Path, int, str, tuple[int, ...]]] = {}  # name -> file, offset, dtype, shape
        for fpath in weights_files(model_dir):
            for name, (offset, dtype, shape) in _read_header(fpath).items():
                self.entries[name] = (fpath, offset, dtype, shape)

    def spec(self, name: str) -> TensorSpec:
        _, _, dtype_name, shape = self.entries[name]
        return TensorSpec(name, shape, ST_DTYPES[dtype_name])

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (any shape, scalars included)."""
        fpath, offset, dtype_name, shape = self.entries[name]
        out = torch.empty(shape, dtype=ST_DTYPES[dtype_name])
        with open(fpath, "rb", buffering=0) as f:
            _read_into(f, offset, out.view(-1))
        return out

    def mapped(self, name: str) -> torch.Tensor:
        """The whole tensor `name` as a view of its file's pages (`mapped`): no copy is made."""
        fpath, offset, dtype_name, shape = self.entries[name]
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=ST_DTYPES[dtype_name])
        with open(fpath, "rb") as f:
            return mapped(f, offset, ST_DTYPES[dtype_name], math.prod(shape)).view(shape)

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of `name` along `dim`, in the file's dtype."""
        if name not in self.entries:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        _, _, dtype_name, shape = self.entries[name]
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=ST_DTYPES[dtype_name])
        self.read_into(name, dim, start, stop, out, block_bytes=_BLOCK_BYTES)
        return out

    def read_into(
        self, name: str, dim: int, start: int, stop: int, out: torch.Tensor, *, block_bytes: int | None = None
    ) -> None:
        """Fill `out` (a parameter's piece) with `get(name, dim, start, stop)`, converted to out's dtype,
        without holding that slice in memory of its own: rows of the file go straight into `out` when
        they are its bytes (same dtype, rows along dim 0, out contiguous, in host memory); otherwise they pass
        through a host block of at most `block_bytes` (default _INTO_BLOCK_BYTES), copied into `out` (on a GPU
        too)."""
        if name not in self.entries:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        fpath, offset, dtype_name, shape = self.entries[name]
        dtype = ST_DTYPES[dtype_name]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        rows = (start, stop) if dim == 0 else (0, shape[0])  # the file rows the slice lies in
        with open(fpath, "rb", buffering=0) as f:
            if dim == 0 and out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu":
                _read_into(f, offset + start * row_bytes, out)
                return
            per_block = max(1, (block_bytes or _INTO_BLOCK_BYTES) // max(row_bytes, 1))
            block = torch.empty((min(per_block, rows[1] - rows[0]), *shape[1:]), dtype=dtype)
            for r0 in range(rows[0], rows[1], per_block):
                r1 = min(rows[1], r0 + per_block)
                _read_into(f, offset + r0 * row_bytes, block[: r1 - r0])
                part = block[: r1 - r0] if dim == 0 else block[: r1 - r0].narrow(dim, start, stop - start)
                out[r0 - rows[0] : r1 - rows[0]].copy_(part)


def _inside(model_dir: Path, path: Path) -> Path:
    """`path`, a file of the HF folder `model_dir`, refused in one line when it is a link leaving the folder
    (links into the Hub cache, as its downloads are, aside)."""
    target = link_outside(path, model_dir)
    if target is not None:
        raise ValueError(
            f"{path} is a link to {target}, outside {model_dir}; hf3d reads no weights from outside the model folder: "
            "replace the link by the file"
        )
    return path


def _shard_names(index: Path) -> list[str]:
    """The files the index `index` names in its weight_map, each a plain file name of its folder: refused in one
    line when the index is malformed or names a path ('/', '..', an absolute path)."""
    with open(_inside(index.parent, index), "rb") as f:
        data = json_document(index, f.read())
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"{index} has no weight_map of tensor names to file names; re-download the model or re-save it with "
            "save_pretrained"
        )
    names = sorted(set(weight_map.values()))
    for name in names:
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(
                f"{index} names the shard {name!r}, which is not a file name inside its folder (a path, '..' or "
                "absolute); hf3d reads no weights from outside the model folder (the index may have been crafted)"
            )
    return names


def weights_files(model_dir: Path) -> list[Path]:
    """The safetensors files of the HF folder `model_dir`: the shards its index names (`_shard_names`), or its
    one model.safetensors; each a file of the folder, not a link leaving it (`_inside`)."""
    index = model_dir / SAFE_INDEX
    if index.is_file():
        names = _shard_names(index)
    elif (model_dir / SAFE_SINGLE).is_file():
        names = [SAFE_SINGLE]
    else:
        raise ValueError(
            f"no {SAFE_SINGLE} or {SAFE_INDEX} in {model_dir}; hf3d reads safetensors checkpoints only "
            "(re-save the model with save_pretrained(..., safe_serialization=True))"
        )
    for name in names:
        if not (model_dir / name).is_file():
            raise ValueError(f"{model_dir / name} is listed in {SAFE_INDEX} but missing; re-download the checkpoint")
    return [_inside(model_dir, model_dir / name) for name in names]


_INTO_BLOCK_BYTES = 4 * 2**20  # read_into's block, when the file's rows cannot go straight into the target


# madvise(MADV_POPULATE_READ), Linux 5.14+ (Python has no name for it): maps a range's pages from the page
# cache in one call, without copying them; faulting them in one at a time costs more than a read() copy
_MADV_POPULATE_READ = 22


def mapped(f, start: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    """`count` elements of `dtype` at byte `start` of the open file f, as a 1-D view of its pages: a private
    (copy-on-write) mapping, so nothing written to the tensor reaches the file. The mapping lives as long
    as the tensor; its pages are populated from the page cache in one call."""
    first_page = start - start % mmap.ALLOCATIONGRANULARITY
    pages = mmap.mmap(
        f.fileno(), start + count * dtype.itemsize - first_page, offset=first_page, access=mmap.ACCESS_COPY
    )
    with contextlib.suppress(OSError):  # before Linux 5.14 the pages fault in one by one as they are read
        pages.madvise(_MADV_POPULATE_READ)
    return torch.frombuffer(pages, dtype=dtype, count=count, offset=start - first_page)


def _read_into(f, offset: int, out: torch.Tensor) -> None:
    """Fill a contiguous tensor with the file's bytes at offset (reads may come back short)."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{f.name} ended early; is it truncated?")
        done += n


def _read_header(fpath: Path) -> dict[str, tuple[int, str, tuple[int, ...]]]:
    """{name: (absolute byte offset, dtype, shape)}; refuses, in one line, a file cut short or not safetensors,
    and a header whose every entry the bytes do not bear out: each shape in whole numbers, its byte range
    exactly the shape times the dtype's size, inside the file, overlapping no other."""
    size = fpath.stat().st_size
    with open(fpath, "rb") as f:
        try:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except RecursionError:
            raise ValueError(f"{fpath} is not a readable safetensors file (its header nests JSON too deep)") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{fpath} is not a readable safetensors file ({e}); is it truncated?") from None
    header.pop("__metadata__", None)
    entries = {name: _header_entry(fpath, name, v) for name, v in header.items()}
    unknown = {dtype for dtype, _, _ in entries.values()} - set(ST_DTYPES)
    if unknown:
        raise ValueError(f"{fpath} holds tensors of dtype {', '.join(sorted(unknown))}, which hf3d cannot read")
    end = max((e for _, _, (_, e) in entries.values()), default=0)
    if size < 8 + header_len + end:
        raise ValueError(
            f"{fpath} is truncated ({size} bytes, its header promises {8 + header_len + end}); "
            "re-download or re-save the checkpoint"
        )
    last = (0, None)
    for name, (dtype, shape, (begin, stop)) in sorted(entries.items(), key=lambda kv: kv[1][2]):
        nbytes = math.prod(shape) * ST_DTYPES[dtype].itemsize
        if stop - begin != nbytes:
            raise ValueError(
                f"{fpath}: {name!r} is {dtype} of shape {list(shape)} ({nbytes} bytes), but its header gives it bytes "
                f"[{begin}, {stop}); refusing the file (re-download or re-save it)"
            )
        if begin < last[0]:
            raise ValueError(f"{fpath}: the bytes of {name!r} overlap those of {last[1]!r}; refusing the file")
        last = (stop, name)
    return {k: (8 + header_len + begin, dtype, shape) for k, (dtype, shape, (begin, _)) in entries.items()}


def _header_entry(fpath: Path, name: str, value) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one safetensors header entry, each number a whole number >= 0."""
    try:
        dtype, shape, offsets = value["dtype"], tuple(value["shape"]), tuple(value["data_offsets"])
    except (TypeError, KeyError):
        dtype = shape = offsets = None
    numbers = (*(shape or ()), *(offsets or ()))
    if not isinstance(dtype, str) or shape is None or len(offsets or ()) != 2:
        numbers = (-1,)
    if not all(type(n) is int and n >= 0 for n in numbers) or offsets[0] > offsets[1]:
        raise ValueError(
            f"{fpath}: the header entry {name!r} is not a tensor (dtype, a shape of whole numbers >= 0, a byte range "
            f"[begin, end)): {json.dumps(value)[:120]}; refusing the file"
        )
    return dtype, shape, offsets


class StateDictSource:
    """The same reader over an in-memory state dict (a stock model instance)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self.state_dict:
            raise ValueError(f"tensor {name!r} is missing from the model's state dict")
        return self.state_dict[name].detach().narrow(dim, start, stop - start)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize
