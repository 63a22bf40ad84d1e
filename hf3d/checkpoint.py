"""Training checkpoints: torch.distributed.checkpoint (DCP) files keyed by HF names and global offsets.

A checkpoint folder holds

    .metadata, __<rank>_0.distcp   DCP: every rank writes only the boxes it owns, in parallel
    config.json                    the HF model config (+ generation_config.json, tokenizer files)
    rng_<rank>.pt                  each rank's RNG states (training checkpoints)
    extra.pt                       the caller's `extra` (scheduler, data position), from rank 0
    hf3d_checkpoint.json           written last: its presence marks the folder complete; it records
                                   each other file's size and CRC-32, checked before a load

DCP keys are `model/<hf name>` (parameters, in the training dtype), `optim/master/<hf name>`
(fp32 master weights, only when they differ from the parameters) and `optim/<state>/<hf name>`
(the wrapped optimizer's per-element state, e.g. exp_avg). Every tensor has its global, unfused,
unpadded HF shape, so a checkpoint loads on any (tp, pp, dp) and converts to HF without a mesh.
A weights-only checkpoint (`hf3d convert from-hf`) has `model/*` keys only.

Saving is atomic and durable: files go into `<path>.tmp` (a folder of hf3d's own, hf3d/files.py), the
marker is written last, every file and folder is fsynced, then the folder takes the name `<path>` in one
rename (swapped with the checkpoint it replaces, which only then is removed). A folder without the marker is
never loaded. hf3d replaces or deletes only folders it made; a `<path>` or `<path>.tmp` of anyone else's is
refused before anything is written. The marker also records the save's `sequence` under its folder: resume
and rotation go by the order of the saves, not of the step numbers. A marked folder whose files no
longer match the sizes and checksums in its marker (a truncated or rewritten file) is damaged: loading
it is refused with one line, and `checkpoint.resume: auto` passes over it to the previous checkpoint.
Markers written before hf3d recorded the files (no "files" entry) load without this check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
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
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from . import files as files_
from . import optim_state
from .checksums import crc32_file
from .faults import is_communication_error, one_line
from .layout import hf_boxes
from .mesh import on_rank0
from .stored import TORCH_DTYPES, AllowListUnpickler, stored_box
from .writer import OneFileWriter, dcp_debug_records_off

MARKER = "hf3d_checkpoint.json"
FORMAT_VERSION = 1
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
MASTER_KEY = optim_state.MASTER_KEY


def model_key(hf_name: str) -> str:
    return MODEL_PREFIX + hf_name


def optim_key(state: str, hf_name: str) -> str:
    return f"{OPTIM_PREFIX}{state}/{hf_name}"


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


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` through an allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = AllowListUnpickler(f, _METADATA_GLOBALS, f"{self.path}/.metadata").load()
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
        for info in metadata.storage_data.values():
            check_relative(Path(self.path), getattr(info, "relative_path", None))
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
        """DCP's read, with each stored box mapped (hf3d/stored.py) instead of torch.loaded into new memory:
        the one copy is into the target, from the page cache; each file is read front to back."""

        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):  # read_metadata refused them already
            raise ValueError(f"{self.path}: a byte entry reached the reader; hf3d never unpickles one")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            path = Path(self.path) / rel
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            with open(path, "rb") as f:
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


_CHECKPOINT_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp|rng_\d+\.pt|extra\.pt")


def is_checkpoint_file(name: str) -> bool:
    """Whether `name` is a file of an hf3d checkpoint folder (what `convert from-hf` may replace)."""
    from .hf import is_export_file

    return name in (MARKER, files_.OWNER_FILE) or bool(_CHECKPOINT_FILE.fullmatch(name)) or is_export_file(name)


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def read_marker(path: str | os.PathLike) -> dict:
    """The checkpoint's own description; refuses folders that are not complete hf3d checkpoints."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a directory")
    if not is_complete(path):
        raise ValueError(
            f"{path} is not a complete hf3d checkpoint (no {MARKER}: the save was interrupted, or this is "
            "not a checkpoint folder)"
        )
    try:
        meta = json.loads((path / MARKER).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path / MARKER} is damaged ({type(e).__name__}: {e}); this checkpoint cannot be trusted: resume from "
            "another one (checkpoint.resume: PATH) or delete this folder"
        ) from None
    if meta.get("format") != "hf3d" or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path / MARKER} is not an hf3d checkpoint of format version {FORMAT_VERSION}")
    return meta


def staging_dir(final: Path) -> Path:
    """Where a checkpoint destined for `final` is written before the rename."""
    return final.with_name(final.name + ".tmp")


def write_marker(tmp: Path, meta: dict) -> None:
    """The last file written into a staged checkpoint: `meta`, plus the size and CRC-32 of every other
    file already there (what `find_damage` checks). Files `meta["files"]` already lists (checksummed by
    the ranks that wrote them) are taken as given."""
    given = meta.get("files") or {}
    files = {**_file_table(tmp, skip=set(given)), **given}
    meta = {"format": "hf3d", "version": FORMAT_VERSION, **meta, "files": dict(sorted(files.items()))}
    files_.write_file(tmp / MARKER, json.dumps(meta, indent=1), replace=True)


def _file_table(folder: Path, skip: set[str] = frozenset(), only: str = "*") -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files under `folder` matching `only`, but the marker and `skip`."""
    files = (p for p in sorted(folder.rglob(only)) if p.is_file() and not p.name.startswith(MARKER))
    files = (p for p in files if p.relative_to(folder).as_posix() not in skip)
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "crc32": crc32_file(p)} for p in files}


def find_damage(path: Path, meta: dict, *, checksums: bool = True) -> str | None:
    """What is wrong with the files of the complete checkpoint at `path` (`meta`: its marker), in a few
    words naming the first damaged file; None when every file has the size and CRC-32 its marker records,
    or when the marker records none (written before hf3d recorded them: not verified).

    Under a process group every rank must call this: each checksums its share of the files and the
    verdicts are gathered, so all ranks return the same answer. Sizes are checked by every rank;
    `checksums=False` checks only them (no file is read)."""
    files = meta.get("files")
    if not isinstance(files, dict):
        return None
    names = sorted(files)
    for name in names:
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != files[name].get("size"):
            return f"{name} has {size} bytes where {files[name].get('size')} were written"
    if not checksums:
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad = [n for n in names[rank::world] if crc32_file(path / n) != files[n].get("crc32")]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, bad)
        bad = sorted(n for b in everyone for n in b)
    return f"{bad[0]} does not match the checksum written with it" if bad else None


def refuse_damaged(path: Path, meta: dict, *, checksums: bool = True, problem: str | None = None) -> None:
    """Raise the one-line refusal of a damaged checkpoint: `problem` when given, else `find_damage`'s."""
    problem = problem or find_damage(path, meta, checksums=checksums)
    if problem is not None:
        raise ValueError(
            f"checkpoint {path} is damaged: {problem}; use another checkpoint (an older step_<N>) or delete this folder"
        )


class CheckpointWriteError(ValueError):
    """A checkpoint could not be written; raised on every rank, after the staging folder is removed."""


class _RankFailure(OSError):
    """A failure on some rank, raised on every rank that learns of it: "rank N: <that rank's one line>"."""


def _one_line(e: BaseException) -> str:
    if isinstance(e, _RankFailure):
        return str(e)
    if isinstance(e, CheckpointException):  # DCP: {rank: (exception, traceback)}; the first says it
        rank, (e, _) = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {_one_line(e)}"
    return one_line(e)


def _on_every_rank(fn) -> None:
    """Run fn on every rank; an exception on any of them is raised on all (as an OSError carrying
    that rank's one-line message), so no rank goes on to wait in the next collective."""
    msg = None
    try:
        fn()
    except Exception as e:
        msg = f"rank {dist.get_rank()}: {_one_line(e)}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, msg)
    failed = [m for m in everyone if m is not None]
    if failed:
        raise _RankFailure(failed[0])


# -- boxes: the rectangles of global HF tensors that one rank writes or reads -------------------------
class _Boxes:
    """One DCP entry as this rank sees it: a global size and the local boxes it writes or fills.
    Implements the hooks DCP's planners call for sharded values (write items, chunk list, shard
    lookup), so DCP's own resharding reads whatever boxes another mesh wrote."""

    def __init__(self, size: list[int], dtype: torch.dtype):
        self._size, self.dtype = torch.Size(size), dtype
        self.boxes: dict[torch.Size, torch.Tensor] = {}

    def add(self, offsets: list[int], view: torch.Tensor) -> None:
        key = torch.Size(offsets)
        assert key not in self.boxes, f"two boxes at {offsets}"
        self.boxes[key] = view

    def size(self) -> torch.Size:
        return self._size

    def copied(self, into: Callable[[torch.Size, torch.Tensor, torch.dtype], torch.Tensor]) -> _Boxes:
        """The same entry over copies of its boxes: `into(offsets, box, dtype)` returns the copy (an async
        save's staging)."""
        out = _Boxes(list(self._size), self.dtype)
        out.boxes = {off: into(off, t, self.dtype) for off, t in self.boxes.items()}
        return out

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(off, t.shape), props, self._size),
            )
            for off, t in self.boxes.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(off, t.shape) for off, t in self.boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[torch.Size(index.offset)]


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner over hf3d's entries. `plans_key`: the key of one model's saves, under which DCP keeps
    their plans from one save to the next (its plan caching). A rank whose plan did not change then sends
    an empty one, and the coordinator reuses the global plan and metadata instead of gathering, merging
    and checking every rank's items again. DCP compares plans by names, offsets and sizes, not dtypes,
    and keys its cache by class name unless told otherwise, so the key is one model's: its saves keep
    their dtypes."""

    def __init__(self, *, background: bool = False, plans_key: str | None = None):
        super().__init__(flatten_state_dict=False, enable_plan_caching=plans_key is not None)
        if plans_key is not None:
            self._cached_plans_key = plans_key
        self.background = background  # planning starts DCP's write thread of an async save

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        if self.background:
            from .async_save import lower_thread_priority

            lower_thread_priority()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Boxes):  # torch.save of a view would write its whole storage (a flat buffer)
            box = obj.__get_tensor_shard__(index)
            if box.dtype == obj.dtype and box.is_contiguous() and box.device.type == "cpu":
                return _alone(box)
            return box.to(obj.dtype, copy=True).contiguous()
        return super().lookup_object(index)


def _alone(t: torch.Tensor) -> torch.Tensor:
    """`t` on a storage of exactly its own bytes, without a copy: a slice of its storage, which keeps the
    rest alive. torch.save then writes the same record as for `t.clone()`. Measured here on 39 boxes of
    4 MB: 0.14 CPU s instead of 0.55 with the copy (which also had fresh pages to fault in)."""
    size = t.element_size()
    start = t.storage_offset() * size
    storage = t.untyped_storage()[start : start + t.numel() * size]
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        ours = dict(state_dict)  # the default set-up drops values that are not tensors
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.state_dict = ours

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Boxes):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        """DCP's default torch.loads the bytes with weights_only=False: hf3d's loads have no byte entries."""
        raise ValueError(f"the checkpoint entry {read_item.dest_index.fqn!r} is bytes; hf3d never unpickles one")


def _entry(entries: dict[str, _Boxes], key: str, hf_shapes, hf_name: str, dtype: torch.dtype) -> _Boxes:
    if key not in entries:
        entries[key] = _Boxes(list(hf_shapes[hf_name]), dtype)
    return entries[key]


# -- save / load ----------------------------------------------------------------------------------
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# config fields that decide which weights exist and their shapes: a checkpoint must agree on all of them,
# and a config override cannot change them while weights are loaded
SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
)


def _write_ranges(pmodel, opt):
    """(param, a, b): the element range of each parameter this rank writes. With an optimizer, dp
    rank d (of dp x cp) writes the d-th 1/(dp*cp) of every gradient bucket (the ZeRO shard), so all ranks write in
    parallel; without one, dp rank 0 (cp rank 0) writes its parameters whole."""
    if opt is None:
        return [(p, 0, p.numel()) for _, p in pmodel.unique_parameters() if pmodel.exports(p)]
    out = []
    for b in opt.buckets:
        lo, hi = opt._my_shard(b)
        for p in b.params:
            s, e = opt._flat_range[id(p)]
            if max(s, lo) < min(e, hi):
                out.append((p, max(s, lo) - s, min(e, hi) - s))
    return out


def _optim_keys(opt) -> list[str]:
    """Names of the wrapped optimizer's per-element state (exp_avg, ...), the same on every rank."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, optim_state.state_keys(opt))
    return sorted(set().union(*everyone))


def _rng_state(pmodel) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if pmodel.dropout_rng is not None:
        state["dropout"] = pmodel.dropout_rng.state_dict()
    return state


def _restore_rng(path: Path, meta: dict, pmodel) -> None:
    """This rank's RNG streams, when the checkpoint was written at this mesh (the same pp, dp, cp and tp
    degrees): a resumed run then draws what the uninterrupted one would. At another mesh nothing is
    restored (a saved rank's streams belong to other coordinates): the default generators keep the
    seeding they had, and the dropout stream starts afresh from its seed and the checkpoint's step, so
    the masks after the resume differ from the uninterrupted run's, with the same statistics."""
    saved_mesh = [(meta.get("parallel") or {}).get(k, 1 if k == "cp" else None) for k in ("pp", "dp", "cp", "tp")]
    same_mesh = meta.get("world_size") == dist.get_world_size() and saved_mesh == [
        pmodel.pcfg.pp,
        pmodel.dp_size,
        pmodel.cp_size,
        pmodel.pcfg.tp,
    ]
    rng = path / f"rng_{dist.get_rank()}.pt"
    state = torch.load(rng, weights_only=True) if same_mesh and rng.is_file() else {}
    if state:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    ours = pmodel.dropout_rng
    if ours is not None and "dropout" in state:
        ours.load_state_dict(state["dropout"])
    elif ours is not None and meta.get("kind") == "training":
        ours.manual_seed(ours.seed if ours.seed is not None else torch.initial_seed(), step=int(meta["step"]))


def save_checkpoint(
    path: str | os.PathLike,
    pmodel,
    opt=None,
    *,
    step: int,
    extra: dict | None = None,
    async_: bool = False,
    after_publish: Callable[[], None] | None = None,
) -> Path | PendingCheckpoint:
    """Collective: write a training checkpoint of `pmodel` (and `opt`) at `path`, atomically.

    Every rank writes only what it owns (its tp slices, its pipeline stages, its ZeRO shard), under
    HF names and global offsets, so any mesh can load it. `extra` is a dict of the caller's state
    (an LR scheduler or anything with `state_dict()`, data position, counters), saved from rank 0.
    Returns the checkpoint folder. `after_publish` runs on rank 0 once the folder is published.

    A write that fails on any rank (a full disk, a folder that cannot be created) raises one
    CheckpointWriteError (a ValueError) on every rank, naming the path; the staging folder is removed
    and nothing is published, so the checkpoints already there (and `latest`) are unchanged. A peer
    that dies mid-save leaves the staging folder unmarked: never loaded, replaced by the next save.

    async_=True returns a PendingCheckpoint at once: the big files are written in the background while
    training goes on (the next update of `opt` waits until this rank's write has read the state, on a
    GPU until it is copied to the host; without `opt` the call returns once a copy is taken), and the
    checksums, the marker, the rename and `after_publish` follow them there, with the same atomicity.
    Its `result()` (collective) waits and returns the folder or raises as above; the next save or load of
    this model waits for it first, so two saves never overlap."""
    final = Path(path)
    tmp = staging_dir(final)
    wait_for_checkpoint(pmodel)
    # a folder hf3d did not make, at the path or its staging path, is refused before anything is written
    on_rank0(lambda: (files_.check_replaceable(final), files_.check_replaceable(tmp)))
    try:
        pending = _save(final, tmp, pmodel, opt, step=step, extra=extra, async_=async_, after_publish=after_publish)
    except (Exception, CheckpointException) as e:
        _refuse_write(e, final, tmp)
    return final if pending is None else pending


def _refuse_write(e: BaseException, final: Path, tmp: Path) -> NoReturn:
    if is_communication_error(e):  # a peer is gone: nothing left to agree with
        raise e
    if dist.get_rank() == 0:
        try:
            files_.remove_dir(tmp)
        except (OSError, ValueError):
            pass  # left unmarked: never loaded, and the next save of this step replaces it
    raise CheckpointWriteError(
        f"could not write the checkpoint {final} ({_one_line(e)}); nothing was published and the "
        f"checkpoints already in {final.parent} are unchanged: {_remedy(e)}, then resume"
    ) from None


_UNSHARED = "though rank 0 made it"  # _must_see's words, which _remedy answers


def _must_see(tmp: Path) -> None:
    """Every rank writes into the staging folder rank 0 made: a rank that does not see it saves under
    another path, or on a disk of its own machine that rank 0's is not."""
    if not tmp.is_dir():
        raise FileNotFoundError(f"{tmp} is not there on this rank, {_UNSHARED}")


def _remedy(e: BaseException) -> str:
    """What to do about a failed write: a path that is not a writable folder, or (anything else: a full
    disk shows up as ENOSPC, EFBIG or a short write inside torch.save) room on the disk."""
    text = f"{e} {_one_line(e)}"
    if _UNSHARED in text:
        return "give every rank the same checkpoint path, on a file system that every machine of the job shares"
    if any(s in text for s in ("Not a directory", "Permission denied", "Read-only file system", "Is a directory")):
        return "check that the output folder is a folder this user can write, or write to another folder"
    return "make room on that disk, or write to another folder"


@dataclasses.dataclass
class PendingCheckpoint:
    """A checkpoint being written in the background (`save_checkpoint(..., async_=True)`)."""

    path: Path
    """The folder it is published as."""
    future: Future
    """This rank's part: its files written and checksummed, then (rank 0) the marker, the rename and
    after_publish."""
    published: threading.Event
    """Set on rank 0 once the folder is published (before after_publish)."""
    waited: bool = False
    """Whether result() or join() has been called (the next save then need not wait again)."""

    def done(self) -> bool:
        """Whether this rank's part has finished (no collective)."""
        return self.future.done()

    def result(self) -> Path:
        """Collective: wait until the checkpoint is published and return its folder; a failure on any
        rank raises one CheckpointWriteError on every rank (the staging folder removed)."""
        error = self.future.exception()
        mine = None if error is None else f"rank {dist.get_rank()}: {_one_line(error)}"
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, self.published.is_set()))
        self.waited = True
        failed = [m for m, _ in everyone if m is not None]
        # rank 0's word, not the folder's: a checkpoint published before at the same path is no sign of
        # this one, and rank 0 removes the staging folder while the others look
        if failed and everyone[0][1]:
            raise CheckpointWriteError(f"{self.path} was published, but what follows it failed: {failed[0]}")
        if failed:
            _refuse_write(OSError(failed[0]), self.path, staging_dir(self.path))
        return self.path

    def join(self) -> str | None:
        """Wait for this rank's part alone (no collective: for a rank on its way out with an error, whose
        peers may not be waiting); returns its failure in one line, or None."""
        error = self.future.exception()
        self.waited = True
        return None if error is None else _one_line(error)


def wait_for_checkpoint(pmodel) -> Path | None:
    """Collective: wait for the model's checkpoint still being written in the background, if any (see
    PendingCheckpoint.result); returns its folder."""
    saver = getattr(pmodel, "_background_saver", None)
    pending = None if saver is None else saver.checkpoint
    if pending is None or pending.waited:
        return None
    return pending.result()


def _save(final: Path, tmp: Path, pmodel, opt, *, step: int, extra: dict | None, async_: bool, after_publish):
    rank = dist.get_rank()

    on_rank0(lambda: files_.make_dir(tmp, "checkpoint"))  # a leftover of hf3d's own is replaced
    _on_every_rank(lambda: _must_see(tmp))
    entries, optim_meta = _state_entries(pmodel, opt)
    meta = {
        "kind": "training" if opt is not None else "weights",
        "step": int(step),
        "dtype": DTYPE_NAMES[pmodel.param_dtype],
        "model_type": pmodel.config.model_type,
        "parallel": dataclasses.asdict(pmodel.pcfg),
        "world_size": dist.get_world_size(),
        "optim": optim_meta,
    }

    published = threading.Event()

    def publish_now(files: dict | None = None) -> None:
        order = {"sequence": next_sequence(final.parent)}
        write_marker(tmp, {**meta, **order, "files": files} if files else {**meta, **order})
        files_.publish_dir(tmp, final)
        published.set()
        if after_publish is not None:
            after_publish()

    # O_DIRECT, each rank's file checksummed as it is written; an async save on a CPU records its writes
    writer = OneFileWriter(tmp, direct=True, record=async_ and opt is not None and pmodel.device.type == "cpu")
    if not async_:
        with dcp_debug_records_off():  # a failure on any rank raises on all
            dcp.save(entries, storage_writer=writer, planner=_SavePlanner())

        def own_files() -> dict:  # the data file on disk first (its write's error, if any, is the one told)
            table = writer.file_table()
            _save_new(_rng_state(pmodel), tmp / f"rng_{rank}.pt")
            return {**table, **_file_table(tmp, only=f"rng_{rank}.pt")}

        tables = _gather_file_tables(own_files, group=None, everywhere=True)
        on_rank0(lambda: (_write_small_files(tmp, pmodel, extra), publish_now(tables)))
        return None
    return _save_async(final, tmp, pmodel, opt, entries, writer, extra, publish_now, published)


def _save_async(final: Path, tmp: Path, pmodel, opt, entries, writer, extra, publish_now, published):
    """_save's background half: the small files now, then the model and optimizer state (`entries`) by
    `writer` in the model's BackgroundSaver, replaying its last save where nothing moved; rank 0 publishes
    (`publish_now`) once every rank's files are written. Returns the PendingCheckpoint."""
    rank = dist.get_rank()
    # the small files first, in the foreground (the RNG states, the data position and the config change
    # as soon as training goes on); the background then writes the model and optimizer state
    _on_every_rank(lambda: _save_new(_rng_state(pmodel), tmp / f"rng_{rank}.pt"))
    on_rank0(lambda: _write_small_files(tmp, pmodel, extra))
    from .async_save import Replay

    saver = _background_saver(pmodel)
    rng = f"rng_{rank}.pt"  # written above
    copy = _copies(pmodel, opt)
    signature = None if copy else _signature(entries)
    last, saver.replay = saver.replay, None  # kept again only once this save is written
    replay = not copy and _everywhere(last is not None and last.signature == signature, saver.group)

    def complete() -> None:  # every rank, once every rank's files are written (DCP's save returned)
        tables = _gather_file_tables(lambda: {**writer.file_table(), **_file_table(tmp, only=rng)}, saver.group)
        if replay:
            saver.replay = last
        elif writer.program is not None:
            saver.replay = Replay(signature, writer.program, writer.finished)
        if rank == 0:
            publish_now(tables)

    if replay:
        released, future = saver.replay_save(writer, last, then=complete)
    else:
        planner = _SavePlanner(background=True, plans_key=saver.plans_key)
        released, future = saver.save(entries, writer, planner, then=complete, copy=copy)
    if opt is not None:
        opt.wait_before_update(released)  # the write (or the copy) runs beside the next forward and backward
    else:
        wait([released])  # nothing here to hold back whatever changes the parameters next
    saver.checkpoint = PendingCheckpoint(final, future, published)
    return saver.checkpoint


def _background_saver(pmodel):
    """The model's BackgroundSaver, made (collectively) by its first async save or `prepare_async_save`."""
    from .async_save import BackgroundSaver

    saver = getattr(pmodel, "_background_saver", None)
    if saver is None:
        saver = pmodel._background_saver = BackgroundSaver()
    return saver


def _copies(pmodel, opt) -> bool:
    """Whether an async save writes from a host copy of the state: on a GPU (pinned memory), and without an
    optimizer (nothing holds the parameters still). On a CPU with an optimizer the write reads the live state,
    and the next update waits for it."""
    return opt is None or pmodel.device.type != "cpu"


def prepare_async_save(pmodel, opt=None) -> None:
    """Collective: what the async saves of `pmodel` (and `opt`) need, made now rather than in the first save:
    the checkpoints' process group and, where the saves copy (`_copies`), the host buffers of exactly the boxes
    this rank writes (pinned memory on a GPU). Call it once the optimizer holds its state (after the first
    step). On an H200 the first async save, which made them, stalled training 14-15 s, the later ones 0.2-1.4
    steps; pinning GiBs of host memory takes seconds."""
    wait_for_checkpoint(pmodel)
    saver = _background_saver(pmodel)
    if _copies(pmodel, opt):
        entries, _ = _state_entries(pmodel, opt)
        saver.reserve(entries)


def _signature(entries: dict[str, _Boxes]) -> tuple:
    """What a replayed save assumes unchanged since the save it replays: every entry's name, dtype and size,
    and each box's offsets, place in memory, shape and strides (the write reads the same memory, and every
    byte around it, its padding included, is the same)."""
    return tuple(
        (key, e.dtype, e.size(), tuple((off, t.data_ptr(), t.shape, t.stride()) for off, t in e.boxes.items()))
        for key, e in entries.items()
    )


def _everywhere(flag: bool, group) -> bool:
    """True on every rank if `flag` is true on every rank of `group` (collective)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _gather_file_tables(own_files: Callable[[], dict], group, *, everywhere: bool = False) -> dict | None:
    """Every rank's table of the files it wrote (`own_files()`: {name: {"size", "crc32"}}, once they are on
    disk), gathered on rank 0 (None elsewhere) or, with `everywhere`, on every rank, over `group`. A failure
    on any rank raises where the tables are gathered (and on that rank): no marker is written, the folder
    stays unpublished."""
    rank = dist.get_rank()
    try:
        mine = own_files()
    except Exception as e:
        mine = f"rank {rank}: {_one_line(e)}"
    if everywhere:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=group)
    if isinstance(mine, str):
        raise _RankFailure(mine)
    if everyone is None:
        return None
    failed = [t for t in everyone if isinstance(t, str)]
    if failed:
        raise _RankFailure(failed[0])
    return {name: entry for table in everyone for name, entry in table.items()}


def _state_entries(pmodel, opt) -> tuple[dict[str, _Boxes], dict | None]:
    """The DCP entries this rank writes (views of the live tensors), and the optimizer's description."""
    hf_shapes, entries = pmodel.hf_shapes, {}
    for p, a, b in _write_ranges(pmodel, opt):
        for name, off, _, view in hf_boxes(p, p.detach().view(-1), 0, a, b, owned_only=True):
            _entry(entries, model_key(name), hf_shapes, name, p.dtype).add(off, view)
    if opt is None:
        return entries, None
    keys = _optim_keys(opt)
    mine = dict(create=False, master=not opt._aliased, owned_only=True, my_shard=True)
    for k, name, off, _, view in optim_state.state_boxes(opt, keys, **mine):
        _entry(entries, optim_key(k, name), hf_shapes, name, torch.float32).add(off, view)
    return entries, {"keys": keys, "step": optim_state.num_steps(opt), "param_groups": optim_state.group_settings(opt)}


def _write_small_files(tmp: Path, pmodel, extra: dict | None) -> None:
    """Rank 0's files beside DCP's: the caller's extra, the HF config and the tokenizer files."""
    from .hf import copy_model_files

    if extra is not None:
        saved = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in extra.items()}
        _save_new(saved, tmp / "extra.pt")
    pmodel.config.save_pretrained(tmp)
    if pmodel.tokenizer_dir is not None:
        copy_model_files(pmodel.tokenizer_dir, tmp)


def _save_new(obj, path: Path) -> None:
    with files_.new_file(path) as f:
        torch.save(obj, f)


def check_compatible(path: Path, config) -> None:
    """Refuse a checkpoint of another architecture or shape, naming every mismatch in one line."""
    saved = json.loads((path / "config.json").read_text())
    ours = config.to_dict()
    diffs = [
        f"{k}={saved.get(k)!r} (model has {ours.get(k)!r})"
        for k in SHAPE_FIELDS
        if k in saved or k in ours
        if saved.get(k) != ours.get(k) and not (k == "head_dim" and None in (saved.get(k), ours.get(k)))
    ]
    if diffs:
        raise ValueError(f"checkpoint {path} does not fit this model: it has {', '.join(diffs)}")


def load_checkpoint(path: str | os.PathLike, pmodel, opt=None, *, extra: dict | None = None) -> int:
    """Collective: restore `pmodel` (and `opt`) from a checkpoint written at any mesh; returns its step.

    A weights-only checkpoint (`hf3d convert from-hf`) restores the weights, leaves the optimizer
    fresh and returns 0. A damaged checkpoint (a file missing, or not of the size or checksum its
    marker records), or one whose files DCP cannot read into this model (a .metadata that lacks one of
    its weights), is refused with one ValueError on every rank. `extra`, when given, receives what
    save_checkpoint's `extra` held: objects with `load_state_dict` (an LR scheduler) are restored in
    place, other values are set in the dict.
    RNG states are restored when the checkpoint was written at this mesh (see `_restore_rng`)."""
    path = Path(path)
    wait_for_checkpoint(pmodel)
    meta = read_marker(path)
    refuse_damaged(path, meta)
    check_compatible(path, pmodel.config)
    stored = SafeReader(path).read_metadata().state_dict_metadata
    has_master = any(k.startswith(optim_key(MASTER_KEY, "")) for k in stored)
    training = meta["kind"] == "training" and opt is not None
    # fp32 parameters are their own master weights: take them from the fp32 masters when there are some
    params_from = optim_key(MASTER_KEY, "") if has_master and pmodel.param_dtype == torch.float32 else MODEL_PREFIX
    hf_shapes = pmodel.hf_shapes
    entries: dict[str, _Boxes] = {}
    masters: dict[str, _Boxes] = {}  # a second pass when masters read the same keys as the parameters
    for _, p in pmodel.unique_parameters():
        for name, off, _, view in hf_boxes(p, p.detach().view(-1), 0, 0, p.numel(), owned_only=False):
            _entry(entries, params_from + name, hf_shapes, name, p.dtype).add(off, view)
    if opt is not None:
        keys = meta["optim"]["keys"] if training else []
        for k, name, off, _, view in optim_state.state_boxes(opt, keys, create=True, master=not opt._aliased):
            prefix = optim_key(k, "") if k != MASTER_KEY or has_master else MODEL_PREFIX
            into = masters if prefix == params_from else entries
            _entry(into, prefix + name, hf_shapes, name, torch.float32).add(off, view)
        if keys:  # on the device torch's fused and capturable kernels read it from
            optim_state.restore_steps(opt, meta["optim"]["step"])
    with torch.no_grad(), dcp_debug_records_off():
        for part in (entries, masters):
            if part:
                try:
                    dcp.load(part, storage_reader=SafeReader(path), planner=_LoadPlanner())
                except CheckpointException as e:  # DCP raises it on every rank; a BaseException
                    # the first rank's error names the cause (a key the .metadata lacks, a read that failed)
                    raise ValueError(
                        f"could not load the checkpoint {path} ({_one_line(e)}): use another checkpoint (an older "
                        "step_<N>)"
                    ) from None
    if training:
        optim_state.restore_group_settings(opt, meta["optim"]["param_groups"])
    _restore_rng(path, meta, pmodel)
    if extra is not None and (path / "extra.pt").is_file():
        for k, v in torch.load(path / "extra.pt", weights_only=True).items():
            if hasattr(extra.get(k), "load_state_dict"):
                extra[k].load_state_dict(v)
            else:
                extra[k] = v
    dist.barrier()
    return int(meta["step"]) if meta["kind"] == "training" else 0


# -- a run's checkpoints folder -------------------------------------------------------------------
STEP_DIR = re.compile(r"^step_(\d+)$")
_REPLACED = re.compile(r"^step_(\d+)\.old$")  # files.publish_dir's without renameat2: what a publish replaces


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete `step_<N>` checkpoints under root, (step, folder), in the order they were saved, oldest first:
    by the `sequence` their markers record (checkpoints of hf3d before it recorded one count as older than any
    that has one), then by step. A resumed run that rolled back (`checkpoint.resume: PATH`, `load_step: false`)
    or saved off its cadence writes checkpoints of lower steps after higher ones: the newest save is the one
    the run is at. Only real folders count: a symlink named step_<N> is not a checkpoint hf3d wrote, so it is
    neither resumed from nor pruned. A `step_<N>.old` counts as step_<N> where that is missing: a publish that
    had to move the checkpoint it replaces aside (no atomic swap on that file system) was killed before the
    new one took its name."""
    found = []
    for d in root.iterdir() if root.is_dir() else []:
        m = STEP_DIR.match(d.name) or _REPLACED.match(d.name)
        if m and d.name.endswith(".old") and os.path.lexists(d.with_name(d.stem)):
            continue
        meta = _hf3d_marker(d) if m and not d.is_symlink() and d.is_dir() else None
        if meta is not None:
            sequence = meta.get("sequence")
            found.append((sequence if isinstance(sequence, int) else 0, int(m.group(1)), d))
    return [(step, d) for _, step, d in sorted(found)]


def _hf3d_marker(d: Path) -> dict | None:
    """The marker of the folder `d` when it is hf3d's (a regular file, not a link), else None."""
    marker = d / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == "hf3d" else None


def next_sequence(root: Path) -> int:
    """The `sequence` of a checkpoint published now under root: one past the newest save's."""
    return 1 + max((_hf3d_marker(d).get("sequence") or 0 for _, d in step_dirs(root)), default=0)


def find_resume(root: Path) -> Path | None:
    """The most recently saved complete, undamaged checkpoint under a run's checkpoints folder (`step_dirs`'
    order); None when the folder
    holds none at all. A damaged one is passed over with one warning line naming its file. Folders that
    exist but are all incomplete or damaged are an error, never a silent restart. Collective under a
    process group (see `find_damage`)."""
    complete = step_dirs(root)
    for i, (_, d) in enumerate(reversed(complete)):
        problem = find_damage(d, read_marker(d))
        if problem is None:
            return d
        if not dist.is_initialized() or dist.get_rank() == 0:
            instead = f"trying {complete[-i - 2][1].name}" if i + 1 < len(complete) else "no older checkpoint"
            print(f"hf3d: warning: skipping the damaged checkpoint {d}: {problem}; {instead}", file=sys.stderr)
    partial = sorted(d.name for d in root.iterdir() if d.name.startswith("step_")) if root.is_dir() else []
    if partial:
        which = "every complete one is damaged" if complete else "none is complete"
        raise ValueError(
            f"{root} holds checkpoint folders but {which} ({', '.join(partial)}); "
            "resume from a checkpoint path explicitly, or set checkpoint.resume=none to start over"
        )
    return None


def resolve_resume(spec: str, root: Path) -> Path | None:
    """checkpoint.resume: "auto" (newest complete and undamaged under root, or None), "none", or a path
    to a `step_<N>` folder (refused when damaged) or to a checkpoints folder. Collective under a process
    group (every rank calls it)."""
    if spec == "none":
        return None
    if spec == "auto":
        return find_resume(root)
    path = Path(spec)
    if is_complete(path):
        refuse_damaged(path, read_marker(path))
        return path
    if path.is_dir() and not STEP_DIR.match(path.name):
        found = find_resume(path)
        if found is not None:
            return found
    raise ValueError(f"checkpoint.resume={spec!r} is neither a complete checkpoint nor a folder of them")


def finish_save(root: Path, keep_last: int, published: Path) -> None:
    """After the checkpoint `published` under root is published (fsynced): point `latest` at it, then drop the
    oldest saves beyond keep_last (0 keeps all). Rank 0 only.

    Kept: `published` (the newest save, and the one `checkpoint.resume: auto` chooses) and the newest
    keep_last - 1 other saves whose files still have the sizes their markers record; the rest go, the
    damaged ones among them. So a save never leaves fewer undamaged checkpoints than keep_last allows, and
    never removes the only good one. Only what hf3d made is deleted: real `step_<N>` folders directly under
    root, holding hf3d's owner file (`files.OWNER_FILE`); one without it (written before hf3d marked its
    folders) is kept, with one warning line. Links are never followed: a `latest` that is a link is
    refused, not written through."""
    try:
        files_.write_file(root / "latest", published.name + "\n", replace=True, sync=True)
    except (OSError, ValueError) as e:
        raise CheckpointWriteError(
            f"could not update {root / 'latest'} ({_one_line(e)}); the checkpoint {published} itself is "
            "complete and checkpoint.resume=auto finds it: fix that, then resume"
        ) from None
    if keep_last <= 0:
        return
    kept = 1
    for _, d in reversed(step_dirs(root)):
        if d == published:
            continue
        if kept < keep_last and find_damage(d, read_marker(d), checksums=False) is None:
            kept += 1
            continue
        if not files_.owned(d):
            print(
                f"hf3d: warning: keeping {d} past checkpoint.keep_last: it has no {files_.OWNER_FILE} (written "
                "before hf3d marked its folders); delete it yourself once it is not needed",
                file=sys.stderr,
            )
            continue
        files_.remove_dir(d)
