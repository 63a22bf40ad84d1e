"""Hugging Face I/O: finding a checkpoint, reading only this rank's slices, writing HF dirs."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

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


class SafetensorsSource:
    """Reads slices of named tensors from an HF dir's safetensors files (single or sharded).

    Only the requested rows/columns are read (`get_slice`), so a rank never holds the full model.
    """

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        index = model_dir / SAFE_INDEX
        if index.is_file():
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        elif (model_dir / SAFE_SINGLE).is_file():
            weight_map = None
        else:
            raise ValueError(
                f"no {SAFE_SINGLE} or {SAFE_INDEX} in {model_dir}; hf3d reads safetensors checkpoints only "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SAFE_SINGLE]
        self._handles = {}
        for f in files:
            fpath = model_dir / f
            if not fpath.is_file():
                raise ValueError(f"{fpath} is listed in {SAFE_INDEX} but missing; re-download the checkpoint")
            try:
                self._handles[f] = safe_open(str(fpath), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{fpath} is not a readable safetensors file ({e}); is it truncated?") from e
            _check_complete(fpath)
        if weight_map is None:
            weight_map = {k: SAFE_SINGLE for k in self._handles[SAFE_SINGLE].keys()}
        self.weight_map = dict(weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        sl = self._handles[self.weight_map[name]].get_slice(name)
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return sl[index]


def _check_complete(fpath: Path) -> None:
    """safetensors opens a file whose data was cut short; compare the header's extent with the size."""
    with open(fpath, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if fpath.stat().st_size < 8 + header_len + end:
        raise ValueError(
            f"{fpath} is truncated ({fpath.stat().st_size} bytes, header promises {8 + header_len + end}); "
            "re-download or re-save the checkpoint"
        )


class StateDictSource:
    """The same reader over an in-memory state dict (a stock model instance)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict

    def __contains__(self, name: str) -> bool:
        return name in self.state_dict

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
