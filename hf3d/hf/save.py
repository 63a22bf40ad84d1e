"""Writing HF folders as transformers writes them, one tensor alive at a time, into a staging folder of hf3d's own
that replaces the output once complete."""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..utils import files
from .folders import EXPORT, GENERATION_CONFIG, SAFE_INDEX, SAFE_SINGLE, check_output_dir, copy_model_files
from .load import ST_DTYPES, TensorSpec

# -- writing HF directories ---------------------------------------------------------------------------
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # "5GB", as huggingface_hub counts it


_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


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
    check(): called when every shard is written, before anything is published. What it raises, and any
    failure before (of `produce`, of a write), is raised after the staging folder is removed.
    extra_files: {name: bytes} written beside the weights before the folder is published (a run's record
    and loss curve).
    """
    tmp = start_staging(out_dir)
    try:
        plan = plan_shards(list(specs), max_shard_bytes)
        for fname, group in plan:
            write_shard(tmp / fname, group, produce)
        if len(plan) > 1:
            write_index(tmp, specs, plan)
        if check is not None:
            check()
    except BaseException:  # a refused read, a full disk, a failed check: nothing half-written is left
        files.remove_dir(tmp, EXPORT)
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
    check_output_dir(out_dir, EXPORT)
    return files.make_dir(staging_dir(out_dir), EXPORT)


def _finish_staging(
    tmp: Path, out_dir: str | os.PathLike, config, *, src_dir, extra_files: Mapping[str, bytes] | None = None
) -> None:
    """The config, the model files from src_dir and `extra_files` into the staging folder, which then
    replaces out_dir."""
    copied = copy_model_files(src_dir, tmp) if src_dir is not None else []
    _save_config(config, tmp, have_generation_config=GENERATION_CONFIG in copied)
    for name, data in (extra_files or {}).items():
        files.write_file(tmp / name, data)
    files.publish_dir(tmp, out_dir, EXPORT, sync=False)


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
