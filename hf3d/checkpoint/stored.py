"""The tensors DCP stored in a checkpoint's files, read as views of the files' pages, running no code.

DCP torch.saves each stored box (a zip: data.pkl + the storage's bytes). torch.load of a box reads it
into new memory, and the caller then copies that into its target: two copies, plus torch.load's
per-call cost. Here a box's data.pkl is read for its layout only (`AllowListUnpickler`: the globals
torch.save writes for a plain tensor, mapped to a layout tuple, so nothing is built or imported), and
its bytes are mapped, not read: the one copy is the caller's, from the page cache.

Nothing a file declares is allocated before the file's bytes bear it out: the archive's records are checked
(untrusted.py `zip_records`: stored as they are, inside the box) before one is read, and every length a pickle
declares (a bytes or string opcode's count) against the pickle's own bytes before it is unpickled (C's
unpickler allocates a counted bytes object whole before it reads it).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
from pathlib import Path

import torch
from torch.serialization import StorageType

from ..hf.load import mapped
from ..utils.faults import one_line
from .untrusted import open_in, zip_records


# -- reading pickles without running code ----------------------------------------------------------
# DCP's own reader unpickles `.metadata` with a plain pickle.load, and DCP torch.saves each stored box: a
# checkpoint from an untrusted source could run code when it is opened. hf3d reads both through
# AllowListUnpickler, which resolves a global only when its exact (module, name) pair is listed. The table maps
# each pair to the object itself, taken from hf3d's own imports: nothing named in the file is ever imported
# or looked up (pickle's default find_class follows dotted names, so "os.system" under any module that
# imports os would resolve).
class AllowListUnpickler(pickle.Unpickler):
    """Unpickles the pickle `data` (bytes) resolving only the globals of `allowed` ({(module, name): object}), once
    every length it declares lies inside it (`check_counts`); `what` names the file in errors."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], object], what: str, persistent_load=None):
        check_counts(data, what)
        super().__init__(io.BytesIO(data))
        self.allowed, self.what = allowed, what
        if persistent_load is not None:
            self.persistent_load = persistent_load

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:  # a dotted name is never a key: no attribute chain is followed
            return self.allowed[(module, name)]
        raise pickle.UnpicklingError(
            f"{self.what} refers to {module}.{name}, which hf3d never writes there; refusing to load it "
            "(the file may have been crafted to run code)"
        )


def check_counts(data: bytes, what: str) -> None:
    """Refuse, in one line (pickle.UnpicklingError), a pickle that declares a length its bytes do not hold: read op
    by op (pickletools, each argument read from the bytes at hand), before C's unpickler, which allocates a
    counted bytes object of the declared size before it reads one byte of it."""
    try:
        for _ in pickletools.genops(data):
            pass
    except (ValueError, EOFError) as e:
        raise pickle.UnpicklingError(f"{what} is not a whole pickle ({one_line(e)}); refusing to load it") from None


TORCH_DTYPES = {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _rebuilt_layout(storage, offset, size, stride, requires_grad, hooks, dtype=None, *_):
    """What torch's _rebuild_tensor_v2/_v3 would build, as (dtype, storage key, offset, size, stride)."""
    _, storage_type, key, _, _ = storage
    return dtype or StorageType(storage_type).dtype, key, offset, tuple(size), tuple(stride)


# the globals torch.save writes for a plain tensor, each mapped to what the layout reader builds instead
_LAYOUT_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuilt_layout,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuilt_layout,
    ("collections", "OrderedDict"): dict,
    **{
        (m, n): n
        for m, names in (("torch", dir(torch)), ("torch.storage", dir(torch.storage)))
        for n in names
        if n.endswith("Storage")
    },
    **TORCH_DTYPES,
}


def _layout_unpickler(data: bytes, what: str) -> AllowListUnpickler:
    """Reads one stored box's data.pkl for its layout, running no code."""
    # persistent ids are ("storage", storage type, key, location, numel): kept as they are
    return AllowListUnpickler(data, _LAYOUT_GLOBALS, what, persistent_load=lambda pid: pid)


def stored_box(path: Path, info, dtype: torch.dtype, shape: tuple[int, ...], f=None) -> torch.Tensor:
    """The box DCP stored in file `path` as item `info` (a _StorageInfo), which the checkpoint's metadata
    says is a `dtype` tensor of `shape`, as a view of the file's pages: a private mapping, so nothing
    written to the tensor reaches the file. `f`: that file, already open for reading (`untrusted.open_in`);
    without it, `path` is opened as a file directly in its folder."""
    if info.transform_descriptors:
        raise ValueError(f"{path}: stored with DCP transforms {info.transform_descriptors}, which hf3d does not write")
    if f is None:
        with open_in(path.parent, path.name) as f:
            return stored_box(path, info, dtype, shape, f)
    what = f"{path} at byte {info.offset}"
    records = zip_records(f, info.offset, info.length, what)  # stored as they are, inside the item
    try:
        layout = _layout_unpickler(os.pread(f.fileno(), records["data.pkl"][1], records["data.pkl"][0]), what).load()
        stored_dtype, key, offset, size, stride = layout
        begin, length = records[f"data/{key}"]
        numel, laid_out = math.prod(shape), offset >= 0 and all(type(n) is int for n in (offset, *stride))
    except pickle.UnpicklingError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # an unknown storage type, a malformed layout or pickle, a missing record
        raise ValueError(f"{what} is not a stored tensor ({one_line(e)})") from None
    if stored_dtype != dtype or size != shape:
        raise ValueError(
            f"{what}: a {stored_dtype} tensor of shape {size} where the checkpoint's metadata says {dtype}, {shape}"
        )
    whole = [math.prod(size[d + 1 :]) for d in range(len(size))]  # the strides of a tensor laid out whole
    if not laid_out or len(stride) != len(size) or any(n > 1 and step != w for n, step, w in zip(size, stride, whole)):
        raise ValueError(
            f"{what}: a tensor of shape {size} stored with strides {stride} at offset {offset}, "
            "not laid out whole as hf3d stores every tensor; refusing to read it (it would be expanded)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if (offset + numel) * dtype.itemsize > length:
        raise ValueError(f"{what}: the tensor's bytes run past its stored record ({length} bytes)")
    return mapped(f, begin + offset * dtype.itemsize, dtype, numel).view(shape)
