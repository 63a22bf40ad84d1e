"""The tensors DCP stored in a checkpoint's files, read as views of the files' pages, running no code.

DCP torch.saves each stored box (a zip: data.pkl + the storage's bytes). torch.load of a box reads it
into new memory, and the caller then copies that into its target: two copies, plus torch.load's
per-call cost. Here a box's data.pkl is read for its layout only (`AllowListUnpickler`: the globals
torch.save writes for a plain tensor, mapped to a layout tuple, so nothing is built or imported), and
its bytes are mapped, not read: the one copy is the caller's, from the page cache.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.utils import _create_file_view
from torch.serialization import StorageType

from ..hf.load import mapped
from ..utils import files
from ..utils.faults import one_line


# -- reading pickles without running code ----------------------------------------------------------
# DCP's own reader unpickles `.metadata` with a plain pickle.load, and DCP torch.saves each stored box: a
# checkpoint from an untrusted source could run code when it is opened. hf3d reads both through
# AllowListUnpickler, which resolves a global only when its exact (module, name) pair is listed. The table maps
# each pair to the object itself, taken from hf3d's own imports: nothing named in the file is ever imported
# or looked up (pickle's default find_class follows dotted names, so "os.system" under any module that
# imports os would resolve).
class AllowListUnpickler(pickle.Unpickler):
    """Unpickles only the globals of `allowed` ({(module, name): object}); `what` names the file in errors."""

    def __init__(self, file, allowed: dict[tuple[str, str], object], what: str, persistent_load=None):
        super().__init__(file)
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
    return AllowListUnpickler(io.BytesIO(data), _LAYOUT_GLOBALS, what, persistent_load=lambda pid: pid)


def stored_box(path: Path, info, dtype: torch.dtype, shape: tuple[int, ...], f=None) -> torch.Tensor:
    """The box DCP stored in file `path` as item `info` (a _StorageInfo), which the checkpoint's metadata
    says is a `dtype` tensor of `shape`, as a view of the file's pages: a private mapping, so nothing
    written to the tensor reaches the file. `f`: that file, already open for reading."""
    if info.transform_descriptors:
        raise ValueError(f"{path}: stored with DCP transforms {info.transform_descriptors}, which hf3d does not write")
    if f is None:
        with files.open_read(path) as f:
            return stored_box(path, info, dtype, shape, f)
    item = torch._C.PyTorchFileReader(_create_file_view(f, info.offset, info.length))
    try:
        layout = _layout_unpickler(item.get_record("data.pkl"), f"{path} at byte {info.offset}").load()
        stored_dtype, key, offset, size, stride = layout
        start = info.offset + item.get_record_offset(f"data/{key}")
    except pickle.UnpicklingError as e:
        raise ValueError(str(e)) from None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # an unknown storage type, a malformed layout
        raise ValueError(f"{path} at byte {info.offset} is not a stored tensor ({one_line(e)})") from None
    if stored_dtype != dtype or size != shape:
        raise ValueError(
            f"{path} at byte {info.offset}: a {stored_dtype} tensor of shape {size} where the checkpoint's "
            f"metadata says {dtype}, {shape}"
        )
    whole = [math.prod(size[d + 1 :]) for d in range(len(size))]  # the strides of a tensor laid out whole
    if offset < 0 or any(n > 1 and step != w for n, step, w in zip(size, stride, whole)):
        raise ValueError(
            f"{path} at byte {info.offset}: a tensor of shape {size} stored with strides {stride} at offset {offset}, "
            "not laid out whole as hf3d stores every tensor; refusing to read it (it would be expanded)"
        )
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    start += offset * dtype.itemsize
    if start + numel * dtype.itemsize > info.offset + info.length:
        raise ValueError(f"{path} at byte {info.offset}: the tensor's bytes run past the stored item")
    return mapped(f, start, dtype, numel).view(shape)
