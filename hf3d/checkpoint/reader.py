"""Reading DCP's files without running code: `.metadata` through an allow-list unpickler, only tensor entries whose
sizes and stored items the files on disk bear out, each stored box mapped from the file's pages (every file opened
by untrusted.py's rules: in the folder, through real folders, no link)."""

from __future__ import annotations

import math
import os
import pickle
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..utils.faults import one_line
from .stored import TORCH_DTYPES, AllowListUnpickler, stored_box
from .untrusted import open_in

_METADATA_GLOBALS = {
    **{
        ("torch.distributed.checkpoint.metadata", c.__name__): c
        for c in (
            Metadata,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            MetadataIndex,
            StorageMeta,
            _MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch", "Size"): torch.Size,
    **{  # Python 3.13 pickles paths under pathlib._local
        (m, c.__name__): c
        for c in (PosixPath, PurePosixPath, WindowsPath, PureWindowsPath)
        for m in ("pathlib", c.__module__)
    },
    ("collections", "OrderedDict"): OrderedDict,
    **TORCH_DTYPES,
}


def check_relative(path: Path, rel: str) -> None:
    """Refuse a file name from a checkpoint's metadata that points outside the checkpoint folder."""
    parts = Path(rel).parts if isinstance(rel, str) else ()
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(
            f"{path / '.metadata'} names the data file {rel!r}, outside the checkpoint folder (an absolute path "
            "or '..'); refusing to read it (the metadata may have been crafted)"
        )


def _sizes(values, n: int | None = None) -> tuple[int, ...] | None:
    """`values` as a tuple of ints >= 0 (of length n when given), or None when they are not."""
    values = tuple(values) if isinstance(values, list | tuple | torch.Size) else ()
    ok = all(type(v) is int and v >= 0 for v in values) and (n is None or len(values) == n)
    return values if ok else None


def _check_tensor(where: Path, key: str, md: TensorStorageMetadata, storage_data: dict) -> None:
    """Refuse a tensor entry whose size is not whole numbers, whose boxes lie outside it, repeat an offset (two
    boxes of one stored item) or hold fewer elements than it, or whose stored items are smaller than its boxes."""
    size = _sizes(md.size)
    if size is None or not isinstance(md.properties.dtype, torch.dtype):
        raise ValueError(f"{where} declares {key!r} with size {md.size!r}; refusing this checkpoint")
    seen = set()
    for chunk in md.chunks:
        offsets, sizes = _sizes(chunk.offsets, len(size)), _sizes(chunk.sizes, len(size))
        if offsets is None or sizes is None or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise ValueError(
                f"{where} declares a box of {key!r} at {chunk.offsets} of size {chunk.sizes}, outside its size "
                f"{size}; refusing this checkpoint"
            )
        if offsets in seen:
            raise ValueError(
                f"{where} declares two boxes of {key!r} at {list(offsets)}, one stored item counted twice; refusing "
                "this checkpoint (it may have been crafted)"
            )
        seen.add(offsets)
        info = storage_data.get(MetadataIndex(key, offsets))
        need = math.prod(sizes) * md.properties.dtype.itemsize
        if info is None or not isinstance(info.length, int) or info.length < need:
            raise ValueError(
                f"{where}: the box of {key!r} at {offsets} needs {need} bytes, and its stored item has "
                f"{getattr(info, 'length', None)}; refusing this checkpoint"
            )
    stored = sum(math.prod(_sizes(chunk.sizes)) for chunk in md.chunks)
    if stored < math.prod(size):  # boxes at distinct offsets, so their items are distinct and lie in the files
        raise ValueError(
            f"{where} declares {key!r} of size {list(size)} ({math.prod(size)} elements) stored only in part (its "
            f"boxes hold {stored}); the checkpoint is incomplete: use another one"
        )


def check_storage(path: Path, metadata: Metadata) -> None:
    """Refuse, in one line, a `.metadata` whose words the files on disk do not bear out, so that nothing it
    declares makes hf3d allocate or read more than the folder holds: every tensor's size is covered by its
    stored boxes, each inside it, at offsets of its own, in whole numbers (`_check_tensor`); every stored item
    lies inside its data file (a regular file of the folder, reached through real folders, not a link), is
    large enough for its box, and overlaps no other item of that file, whatever name the item gives the file
    ('./x', a hard link). So no tensor declares more bytes than the data files hold."""
    where = path / ".metadata"
    for key, md in metadata.state_dict_metadata.items():
        _check_tensor(where, key, md, metadata.storage_data)
    per_file: dict[str, list] = {}
    for info in metadata.storage_data.values():
        check_relative(path, getattr(info, "relative_path", None))
        if _sizes((info.offset, info.length)) is None:
            raise ValueError(f"{where} declares an item at byte {info.offset!r} of length {info.length!r}")
        per_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    per_inode: dict[tuple[int, int], tuple[str, int, list]] = {}  # one file under several names ('./x', a hard link)
    for rel, items in per_file.items():
        try:
            with open_in(path, rel) as f:
                st = os.fstat(f.fileno())
        except (OSError, ValueError):
            raise ValueError(
                f"{path / rel}, a data file its .metadata names, is missing, a link, in a linked folder or not a file"
            ) from None
        per_inode.setdefault((st.st_dev, st.st_ino), (rel, st.st_size, []))[2].extend(items)
    for rel, file_size, items in per_inode.values():
        items.sort()
        ends = [0, *(end for _, end in items[:-1])]
        if items[-1][1] > file_size or any(start < end for (start, _), end in zip(items, ends)):
            raise ValueError(
                f"{where} declares items of {path / rel} that overlap or run past its {file_size} bytes; "
                "refusing this checkpoint"
            )


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` through an allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        name = Path(self._get_metadata_path(kwargs.get("rank"))).name
        with open_in(self.path, name) as f:
            data = f.read()  # as many bytes as the file holds, whatever its pickle declares
        try:
            metadata = AllowListUnpickler(data, _METADATA_GLOBALS, f"{self.path}/.metadata").load()
        except pickle.UnpicklingError as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # truncated, or values the allowed classes do not take
            raise ValueError(f"{self.path}/.metadata is not readable DCP metadata ({one_line(e)})") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise ValueError(f"{self.path}/.metadata holds a {type(metadata).__name__}, not DCP metadata")
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):  # DCP unpickles byte entries (torch.load, weights_only=False)
                raise ValueError(
                    f"{self.path}/.metadata declares the entry {key!r} as {type(md).__name__}, not a tensor; hf3d "
                    "stores only tensors and never unpickles an entry: refusing this checkpoint (it may have been "
                    "crafted to run code)"
                )
        check_storage(Path(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.boxes = {  # what the metadata says each stored box is: (dtype, shape)
            MetadataIndex(fqn, chunk.offsets): (md.properties.dtype, tuple(chunk.sizes))
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        """DCP's read, with each stored box mapped (hf3d/checkpoint/stored.py) instead of torch.loaded into new memory:
        the one copy is into the target, from the page cache; each file is read front to back."""

        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):  # read_metadata refused them already
            raise ValueError(f"{self.path}: a byte entry reached the reader; hf3d never unpickles one")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            path = Path(self.path) / rel
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            with open_in(self.path, rel) as f:
                index, box = None, None
                for item in items:
                    if item.storage_index != index:  # several targets may read one box (another mesh)
                        index, info = item.storage_index, self.storage_data[item.storage_index]
                        box = stored_box(path, info, *self.boxes[index], f)
                    source = box
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        source = source.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != source.size():
                        raise ValueError(
                            f"{path}: {index.fqn} holds {tuple(source.size())} where {tuple(target.size())} is read"
                        )
                    target.copy_(source)
                    planner.commit_tensor(item, target)
                box = None
        done = torch.futures.Future()
        done.set_result(None)
        return done
