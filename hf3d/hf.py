"""Hugging Face I/O: finding a checkpoint, reading only this rank's slices, writing HF dirs."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

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

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self.entries:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        fpath, offset, dtype_name, shape = self.entries[name]
        dtype = _ST_DTYPES[dtype_name]
        item = torch.empty((), dtype=dtype).element_size()
        row_elems = 1
        for n in shape[1:]:
            row_elems *= n
        row_bytes = row_elems * item
        with open(fpath, "rb", buffering=0) as f:
            if dim == 0:
                out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
                _read_into(f, offset + start * row_bytes, out)
                return out
            out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=dtype)
            rows_per_block = max(1, _BLOCK_BYTES // max(row_bytes, 1))
            block = torch.empty((min(rows_per_block, shape[0]), *shape[1:]), dtype=dtype)
            for r0 in range(0, shape[0], rows_per_block):
                r1 = min(shape[0], r0 + rows_per_block)
                _read_into(f, offset + r0 * row_bytes, block[: r1 - r0])
                out[r0:r1].copy_(block[: r1 - r0].narrow(dim, start, stop - start))
            return out


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


def write_hf_dir(
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    config,
    *,
    tokenizer_dir: Path | None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write safetensors (sharded with an index past max_shard_bytes) + config.json (+ tokenizer files).

    Files are written into a temporary sibling directory that replaces out_dir at the end, so an
    interrupted export never leaves a directory that looks finished.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp-hf3d")
    if tmp.exists():
        _rmtree(tmp)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / SAFE_SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / SAFE_INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    config.save_pretrained(tmp)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if (
                f.name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges"))
                or f.name == "chat_template.jinja"
            ):
                (tmp / f.name).write_bytes(f.read_bytes())
    if out_dir.exists():
        _rmtree(out_dir)
    tmp.rename(out_dir)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
