"""`hf3d average`: the element-wise mean of several checkpoints' weights, written as one stock HF folder.

The last checkpoints of a warmup-stable-decay run, averaged, are what SmolLM-style releases publish. Every
checkpoint stores its weights under their HF names in their global shapes (hf3d/checkpoint/entries.py), so
checkpoints saved at different meshes (tp=2, pp=2, ...) average without any process group: each input is
read as `hf3d convert to-hf` reads one (`convert._TensorReader`, its stored boxes mapped, not read whole).

Streaming: the output is written one tensor at a time (hf3d/hf/save.py `write_hf_dir`), and each tensor is
the sum, in fp32, of that tensor of every input, divided by their number. Peak memory: one fp32 accumulator
the size of the largest tensor, its copy in the output dtype (none for fp32), and one assembly buffer the
size of the largest tensor that ranks stored in boxes, shared by all inputs (inputs are read one after the
other); the inputs' pages are mapped from their files and go with each tensor. Never a whole model: three
fp32 checkpoints of a 58M-parameter Llama (largest tensor 62.5 MiB) grew the process by 62.7 MiB.

Inputs are the same model or nothing is written: the same config (but the keys that say who wrote it and
in which dtype), the same tensor names and shapes. A checkpoint of a bf16 run with fp32 master weights
contributes its masters. Each input is checked against its marker's sizes before the first read and
against its checksums before the output is published (a damaged input publishes nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..hf.folders import EXPORT, check_output_dir
from ..hf.load import TensorSpec
from ..hf.save import DEFAULT_MAX_SHARD_BYTES, write_hf_dir
from ..utils.units import parse_size
from . import entries, marker
from .convert import _nbytes, _state_dict_order, _TensorReader, _whole
from .reader import SafeReader

OUTPUT_DTYPES = ("bfloat16", "float32")
_WRITER_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}  # who wrote it, in which dtype


def _config_diff(a: dict, b: dict, prefix: str = "") -> str | None:
    """The first key (dotted) whose value differs between two config dicts, or None."""
    for key in sorted(set(a) | set(b)):
        if prefix == "" and key in _WRITER_KEYS:
            continue
        va, vb = a.get(key, "<missing>"), b.get(key, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict):
            inner = _config_diff(va, vb, f"{prefix}{key}.")
            if inner is not None:
                return inner
        elif va != vb:
            return f"{prefix}{key} ({va!r} vs {vb!r})"
    return None


class _Input:
    """One checkpoint to average: its marker, config, stored tensors, and the keys to read them under."""

    def __init__(self, path: Path):
        from transformers import AutoConfig

        self.path = path
        self.meta = marker.read_marker(path)
        marker.refuse_damaged(path, self.meta, checksums=False, collective=False)  # sizes now, sums at the end
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint {path} has no config.json; hf3d average needs each checkpoint's config")
        self.config = AutoConfig.from_pretrained(path)
        self.metadata = SafeReader(path).read_metadata()
        stored = self.metadata.state_dict_metadata
        self.keys: dict[str, str] = {}  # hf name -> the stored key read (the fp32 master when there is one)
        for key, info in stored.items():
            if not key.startswith(entries.MODEL_PREFIX):
                continue
            name = key[len(entries.MODEL_PREFIX) :]
            master = entries.optim_key(entries.MASTER_KEY, name)
            fp32_master = info.properties.dtype != torch.float32 and master in stored
            self.keys[name] = master if fp32_master else key
        if self.config.tie_word_embeddings:
            self.keys.pop("lm_head.weight", None)  # HF does not store a tied head

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[self.keys[name]].size)

    def boxed_bytes(self) -> int:
        """The largest tensor this input stores in boxes (assembled in the shared buffer)."""
        infos = [self.metadata.state_dict_metadata[k] for k in self.keys.values()]
        return max((_nbytes(i) for i in infos if not _whole(i)), default=0)


def _check_same_model(inputs: list[_Input]) -> None:
    """One line naming the first config key, tensor name or shape where an input differs from the first."""
    first = inputs[0]
    for other in inputs[1:]:
        where = f"{other.path} is not the same model as {first.path}"
        diff = _config_diff(first.config.to_dict(), other.config.to_dict())
        if diff is not None:
            raise ValueError(f"{where}: config key {diff}; average checkpoints of one run (or one model)")
        for name in sorted(set(first.keys) | set(other.keys)):
            if name not in other.keys or name not in first.keys:
                holder = first if name in first.keys else other
                raise ValueError(f"{where}: only {holder.path} has the tensor {name!r}")
            if first.shape(name) != other.shape(name):
                raise ValueError(
                    f"{where}: tensor {name!r} has shape {other.shape(name)} there, {first.shape(name)} in the first"
                )


def average_checkpoints(
    ckpts: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the mean of the weights of `ckpts` (hf3d checkpoints, any mesh each) as an HF folder that
    `AutoModelForCausalLM.from_pretrained` loads; returns out_dir. dtype: "bfloat16" or "float32" (the
    mean is accumulated in fp32 either way). Config and tokenizer files come from the first checkpoint."""
    if len(ckpts) < 2:
        raise ValueError(f"hf3d average needs at least 2 checkpoints to average, got {len(ckpts)}")
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    paths = [Path(c) for c in ckpts]
    seen = {}
    for p in paths:
        if p.resolve() in seen:
            also = f" (also as {seen[p.resolve()]})" if seen[p.resolve()] != p else ""
            raise ValueError(f"{p} is given twice{also}: each checkpoint counts once in a mean")
        seen[p.resolve()] = p
    out_dir, out_dtype, max_shard_bytes = Path(out_dir), getattr(torch, dtype), parse_size(max_shard_size)
    for p in paths:
        check_output_dir(out_dir, EXPORT, src=p)
    inputs = [_Input(p) for p in paths]
    _check_same_model(inputs)
    first = inputs[0]
    order = {n: i for i, n in enumerate(_state_dict_order(first.config))}
    names = sorted(first.keys, key=lambda n: order.get(n, len(order)))  # unknown extras keep their order, last
    specs = [TensorSpec(n, first.shape(n), out_dtype) for n in names]
    buffer = torch.zeros(max(i.boxed_bytes() for i in inputs), dtype=torch.uint8)  # shared: one input at a time
    readers = [_TensorReader(i.path, i.metadata, i.keys, buffer=buffer) for i in inputs]

    def produce(name: str) -> torch.Tensor:
        total = torch.zeros(first.shape(name), dtype=torch.float32)
        for read in readers:
            total += read(name)  # the stored dtype, promoted into the fp32 sum
        return total.div_(len(readers)).to(out_dtype)

    def check() -> None:  # before publishing: every input's checksums
        for i in inputs:
            marker.refuse_damaged(i.path, i.meta, collective=False)

    config = first.config
    config.dtype = out_dtype
    write_hf_dir(out_dir, specs, produce, config, src_dir=first.path, max_shard_bytes=max_shard_bytes, check=check)
    return out_dir
