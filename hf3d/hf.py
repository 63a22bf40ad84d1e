"""Hugging Face I/O: finding a checkpoint, reading only this rank's slices, writing HF dirs."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import mmap
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import files

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local HF directory, or a Hub id fetched (config, safetensors, tokenizer) into the HF cache."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory but has no config.json; point at an HF model directory")
        return path
    text = str(name_or_path)
    looks_like_id = text.count("/") <= 1 and not text.startswith((".", "/", "~")) and path.suffix == ""
    if path.exists() or not looks_like_id:
        raise ValueError(
            f"{text!r} is neither an HF model directory nor a Hub model id (like 'HuggingFaceTB/SmolLM2-135M')"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        local = snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except (RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise ValueError(f"could not fetch {text!r} from the Hub ({type(e).__name__}: {e})") from e
    return Path(local)


_ST_DTYPES = {
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
        index = model_dir / SAFE_INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (model_dir / SAFE_SINGLE).is_file():
            files = [SAFE_SINGLE]
        else:
            raise ValueError(
                f"no {SAFE_SINGLE} or {SAFE_INDEX} in {model_dir}; hf3d reads safetensors checkpoints only "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        self.entries: dict[str, tuple[Path, int, str, tuple[int, ...]]] = {}  # name -> file, offset, dtype, shape
        for f in files:
            fpath = model_dir / f
            if not fpath.is_file():
                raise ValueError(f"{fpath} is listed in {SAFE_INDEX} but missing; re-download the checkpoint")
            for name, (offset, dtype, shape) in _read_header(fpath).items():
                self.entries[name] = (fpath, offset, dtype, shape)

    def spec(self, name: str) -> TensorSpec:
        _, _, dtype_name, shape = self.entries[name]
        return TensorSpec(name, shape, _ST_DTYPES[dtype_name])

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (any shape, scalars included)."""
        fpath, offset, dtype_name, shape = self.entries[name]
        out = torch.empty(shape, dtype=_ST_DTYPES[dtype_name])
        with open(fpath, "rb", buffering=0) as f:
            _read_into(f, offset, out.view(-1))
        return out

    def mapped(self, name: str) -> torch.Tensor:
        """The whole tensor `name` as a view of its file's pages (`mapped`): no copy is made."""
        fpath, offset, dtype_name, shape = self.entries[name]
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=_ST_DTYPES[dtype_name])
        with open(fpath, "rb") as f:
            return mapped(f, offset, _ST_DTYPES[dtype_name], math.prod(shape)).view(shape)

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of `name` along `dim`, in the file's dtype."""
        if name not in self.entries:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        _, _, dtype_name, shape = self.entries[name]
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=_ST_DTYPES[dtype_name])
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
        dtype = _ST_DTYPES[dtype_name]
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
    """{name: (absolute byte offset, dtype, shape)}; refuses files cut short or not safetensors."""
    size = fpath.stat().st_size
    with open(fpath, "rb") as f:
        try:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{fpath} is not a readable safetensors file ({e}); is it truncated?") from e
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if size < 8 + header_len + end:
        raise ValueError(
            f"{fpath} is truncated ({size} bytes, its header promises {8 + header_len + end}); "
            "re-download or re-save the checkpoint"
        )
    unknown = {v["dtype"] for v in header.values()} - set(_ST_DTYPES)
    if unknown:
        raise ValueError(f"{fpath} holds tensors of dtype {', '.join(sorted(unknown))}, which hf3d cannot read")
    return {k: (8 + header_len + v["data_offsets"][0], v["dtype"], tuple(v["shape"])) for k, v in header.items()}


class StateDictSource:
    """The same reader over an in-memory state dict (a stock model instance)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self.state_dict:
            raise ValueError(f"tensor {name!r} is missing from the model's state dict")
        return self.state_dict[name].detach().narrow(dim, start, stop - start)


# -- writing HF directories ---------------------------------------------------------------------------
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # "5GB", as huggingface_hub counts it
GENERATION_CONFIG = "generation_config.json"
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
# files of an HF model dir that travel with the weights (tokenizer, chat template, generation defaults)
_MODEL_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[tuple[str, list[TensorSpec]]]:
    """[(file name, tensors in file order)]: the split transformers makes, and the layout safetensors makes.

    Tensors are taken in the given order and a new shard starts when the next tensor would pass
    max_shard_bytes, as huggingface_hub's splitter does for a state dict in that order (transformers 5
    saves a model built with from_config in state-dict order); a tensor larger than the limit gets a
    shard of its own, placed in order (huggingface_hub leaves the current shard open instead). Inside
    a file, tensors are laid out as `safetensors.torch.save_file` lays them out: larger elements first,
    then by name, so a one-dtype file is byte-identical to save_file's.
    """
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if groups[-1] and size + s.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    ordered = [sorted(g, key=lambda s: (-s.dtype.itemsize, s.name)) for g in groups]
    if len(ordered) == 1:
        return [(SAFE_SINGLE, ordered[0])]
    n = len(ordered)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(ordered)]


def write_order(specs: list[TensorSpec], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """The order in which write_hf_dir asks for tensors (collective producers walk the same list)."""
    return [s.name for _, group in plan_shards(specs, max_shard_bytes) for s in group]


def _safetensors_header(group: list[TensorSpec]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding `group` in this order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in group:
        if s.dtype not in _ST_NAMES:
            raise ValueError(f"cannot write {s.name!r} of dtype {s.dtype} to safetensors")
        header[s.name] = {
            "dtype": _ST_NAMES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes, keeping the data aligned
    return len(text).to_bytes(8, "little") + text


# what an HF model folder holds as hf3d writes it (hf3d train adds its record, loss curve and model card), and
# what transformers' save_pretrained writes: the only files an export may replace
_EXPORT_FILES = {
    "config.json",
    GENERATION_CONFIG,
    SAFE_SINGLE,
    SAFE_INDEX,
    "hf3d_training.json",
    "loss_curve.png",
    "README.md",
}
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_weights_file(name: str) -> bool:
    """Whether `name` is a safetensors weights file (or its index) as transformers names them."""
    return name in (SAFE_SINGLE, SAFE_INDEX) or bool(_SHARD_FILE.fullmatch(name))


def is_export_file(name: str) -> bool:
    """Whether `name` is a file an HF export holds (weights, configs, tokenizer files, hf3d's run record)."""
    return name in _EXPORT_FILES or bool(_SHARD_FILE.fullmatch(name)) or name.startswith(_MODEL_FILE_PREFIXES)


def check_output_dir(out: Path, owns: Callable[[str], bool], *, src: str | os.PathLike | None = None) -> None:
    """The one rule of every hf3d writer (save_pretrained, `convert`, `hf3d train`'s final export,
    Trainer.save_model): `out` is written when it does not exist, is an empty folder, or is a folder hf3d
    made (`files.owned`) holding only files of the kind this writer puts there (`owns(name)`: an earlier
    output, which is replaced). Anything else (a folder of the user's, even one of model files; a file of the
    user's in hf3d's folder, a subfolder, a link) is refused in one line, before anything is written or
    deleted."""
    if src is not None and out.resolve() == Path(src).resolve():
        raise ValueError(f"the output {out} is the input; choose another output path")
    files.check_replaceable(out)
    for entry in sorted(out.iterdir()) if out.exists() else ():
        if entry.name == files.OWNER_FILE:
            continue
        if entry.is_symlink() or not entry.is_file() or not owns(entry.name):
            raise ValueError(
                f"{out} holds {entry.name!r}, which hf3d does not write there; hf3d replaces only a folder of its "
                "own output and never deletes other files: move it away or choose a new output path"
            )


def link_outside(path: Path, root: Path) -> Path | None:
    """Where `path` points when it is a symlink to a place outside `root` and outside the Hub cache; else None.

    The Hub client's downloads are links into its cache (snapshots/<rev>/f -> ../../blobs/<hash>), so those
    are followed; any other link leaving the folder could pull an unrelated local file (a key, a token) into
    an export or an upload."""
    if not path.is_symlink():
        return None
    from huggingface_hub import constants

    target = path.resolve()
    inside = [Path(root).resolve(), Path(constants.HF_HUB_CACHE).resolve()]
    return None if any(target.is_relative_to(d) for d in inside) else target


def model_files(src_dir: str | os.PathLike) -> list[Path]:
    """generation_config.json, the tokenizer files and the chat template of an HF model dir (or a checkpoint),
    those that exist. A link to a file outside the folder (and outside the Hub cache) is refused, not skipped:
    an export without its tokenizer would look complete, and copying it could publish any local file."""
    src = Path(src_dir)
    found = []
    for f in sorted(src.iterdir()):
        if f.is_file() and (f.name == GENERATION_CONFIG or f.name.startswith(_MODEL_FILE_PREFIXES)):
            target = link_outside(f, src)
            if target is not None:
                raise ValueError(
                    f"{f} is a link to {target}, outside {src}; hf3d copies no file from outside the model folder "
                    "into an export (it could be pushed): replace the link by a copy of the file"
                )
            found.append(f)
    return found


def copy_model_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy `model_files(src_dir)` into dst_dir; returns the names copied."""
    copied = []
    for f in model_files(src_dir):
        files.copy_file(f, Path(dst_dir) / f.name)
        copied.append(f.name)
    return copied


def _causal_lm_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def _save_config(config, out: Path, *, have_generation_config: bool) -> None:
    """config.json (with `architectures`, as transformers' save_pretrained sets it) and, when the source
    had none, the generation_config.json that transformers' save_pretrained would write."""
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    cls = _causal_lm_class(config)
    if cls is not None and not config.architectures:
        config.architectures = [cls.__name__]
    config.save_pretrained(out)
    if not have_generation_config and cls is not None and cls.can_generate():
        try:
            gen = GenerationConfig.from_model_config(config)
        except NotImplementedError:
            gen = GenerationConfig()
        gen.save_pretrained(out)


def write_hf_dir(
    out_dir: str | os.PathLike,
    specs: list[TensorSpec],
    produce: Callable[[str], torch.Tensor],
    config,
    *,
    src_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    check: Callable[[], None] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> None:
    """Write an HF directory, holding at most one tensor at a time.

    specs: every tensor to write, in state-dict order (the order the shards are cut in).
    produce(name): the full tensor `name`, of its spec's shape and dtype; called once per tensor, in
    `write_order(specs, max_shard_bytes)`, and the tensor is written before the next call (so the
    producer may reuse its memory). Each file's header is known from the specs, so it is written
    first and the tensors' bytes are streamed after it. Sharded with an index (as transformers names
    them) past max_shard_bytes; config.json; generation_config.json and tokenizer files copied from
    src_dir when it has them. Files go into a temporary sibling directory that replaces out_dir at the
    end, so an interrupted export never leaves a directory that looks finished. An existing out_dir is
    replaced only when it holds nothing but an HF export's files (`check_output_dir`).
    check(): called when every shard is written, before anything is published; what it raises is raised
    after the staging folder is removed. extra_files: {name: bytes} written beside the weights before the
    folder is published (a run's record and loss curve).
    """
    tmp = start_staging(out_dir)
    plan = plan_shards(list(specs), max_shard_bytes)
    for fname, group in plan:
        write_shard(tmp / fname, group, produce)
    if len(plan) > 1:
        write_index(tmp, specs, plan)
    if check is not None:
        try:
            check()
        except BaseException:
            files.remove_dir(tmp)
            raise
    _finish_staging(tmp, out_dir, config, src_dir=src_dir, extra_files=extra_files)


def staging_dir(out_dir: str | os.PathLike) -> Path:
    """The temporary sibling folder an HF directory is written into before it replaces out_dir."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".tmp-hf3d")


def start_staging(out_dir: str | os.PathLike) -> Path:
    """A fresh, empty staging folder of hf3d's own for out_dir, after checking that out_dir may be replaced
    (`check_output_dir`): the one rule of every writer. A staging folder left by an interrupted export is
    replaced; a folder of that name that hf3d did not make is refused."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, is_export_file)
    return files.make_dir(staging_dir(out_dir), "export")


def _finish_staging(
    tmp: Path, out_dir: str | os.PathLike, config, *, src_dir, extra_files: Mapping[str, bytes] | None = None
) -> None:
    """The config, the model files from src_dir and `extra_files` into the staging folder, which then
    replaces out_dir."""
    copied = copy_model_files(src_dir, tmp) if src_dir is not None else []
    _save_config(config, tmp, have_generation_config=GENERATION_CONFIG in copied)
    for name, data in (extra_files or {}).items():
        files.write_file(tmp / name, data)
    files.publish_dir(tmp, out_dir, sync=False)


def write_shard(path: Path, group: list[TensorSpec], produce: Callable[[str], torch.Tensor]) -> None:
    """One safetensors file holding `group` in this order: the header from the specs, then each
    tensor's bytes as `produce(name)` returns it, one tensor alive at a time."""
    with files.new_file(path) as f:
        f.write(_safetensors_header(group))
        for s in group:
            t = produce(s.name)
            assert tuple(t.shape) == s.shape and t.dtype == s.dtype, (s, tuple(t.shape), t.dtype)
            f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            del t


def write_index(out: Path, specs: list[TensorSpec], plan: list[tuple[str, list[TensorSpec]]]) -> None:
    """model.safetensors.index.json of a sharded directory, as transformers writes it."""
    index = {
        "metadata": {
            "total_parameters": sum(math.prod(s.shape) for s in specs),
            "total_size": sum(s.nbytes for s in specs),
        },
        "weight_map": {s.name: fname for fname, group in plan for s in group},
    }
    files.write_file(out / SAFE_INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")


def plan_writer_shards(
    per_writer: list[list[TensorSpec]], max_shard_bytes: int
) -> list[list[tuple[str, list[TensorSpec]]]]:
    """The shard plan of an HF directory written by several processes, each writing its own files: each
    writer's tensors (in state-dict order) are cut as `plan_shards` cuts them, and the files are
    numbered across writers, in writer order, as one sharded directory (model-0000i-of-0000n)."""
    cut = [[g for _, g in plan_shards(specs, max_shard_bytes)] if specs else [] for specs in per_writer]
    n = sum(len(groups) for groups in cut)
    plans, i = [], 0
    for groups in cut:
        plans.append([(f"model-{i + k + 1:05d}-of-{n:05d}.safetensors", g) for k, g in enumerate(groups)])
        i += len(groups)
    return plans


def finish_hf_dir(
    tmp: Path,
    out_dir: str | os.PathLike,
    specs,
    plan,
    config,
    *,
    src_dir: str | os.PathLike | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> None:
    """Complete a staging folder whose shard files are written (by any processes): the index, the
    config, the model files from src_dir and `extra_files`; then it replaces out_dir, as `write_hf_dir` ends."""
    write_index(tmp, specs, plan)
    _finish_staging(tmp, out_dir, config, src_dir=src_dir, extra_files=extra_files)
