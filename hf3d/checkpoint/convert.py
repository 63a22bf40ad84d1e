"""`hf3d convert`: HF directory <-> hf3d checkpoint, on one CPU process, one tensor at a time.

A checkpoint stores every weight under `model/<hf name>` in its global HF shape (hf3d/checkpoint/entries.py),
so conversion needs no mesh and no process group (from-hf calls `dcp.save` with `no_dist=True`).

- to-hf: reads DCP's files itself, at the offsets in DCP's metadata: `dcp.load` torch.loads each stored
  box into a fresh tensor, copies it into the target and plans every call, which made to-hf 4.5x a raw
  safetensors load + save. Each box is mapped, not read (hf3d/checkpoint/stored.py `stored_box`). A tensor
  stored whole (from-hf writes them so) goes to the HF writer (hf3d/hf/core.py `write_hf_dir`) as that
  view of the file's pages, so the writer's copy into the output is the only one; a tensor that ranks
  wrote in boxes is assembled in a buffer the size of the largest such tensor. Peak: about one
  largest tensor (its pages; plus that buffer).
- from-hf: DCP plans and writes `.metadata`; the data goes into one file through hf3d's writer
  (hf3d/checkpoint/writer.py `OneFileWriter`, checksummed as it is written, not fsynced unless asked: see
  `hf_to_checkpoint`), each tensor mapped from the safetensors
  (`_ReadOnDemand`, in file order) just before it is written and dropped just after, so the state dict
  handed to DCP holds only meta tensors. DCP's own FileSystemWriter (torch 2.13) keeps every tensor of a
  file referenced until the file is closed, and one file per tensor cost a fsync each (8x a raw read +
  write, benchmarks/README.md).

Tensors are written in the model's state-dict order, so a sharded output is cut where transformers
would cut it, and a round trip HF -> checkpoint -> HF gives back the same files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..hf.folders import (
    EXPORT,
    SAFE_INDEX,
    SAFE_SINGLE,
    check_output_dir,
    copy_model_files,
    model_files,
    resolve_model_dir,
)
from ..hf.load import SafetensorsSource, TensorSpec
from ..hf.save import DEFAULT_MAX_SHARD_BYTES, write_hf_dir
from ..parallel.config import DTYPE_NAMES
from ..utils import files
from ..utils.units import parse_size
from . import entries, marker
from .reader import SafeReader
from .stored import stored_box
from .untrusted import load_small, open_in
from .writer import OneFileWriter, dcp_debug_records_off


@contextlib.contextmanager
def _single_process():
    """DCP warns on every single-process call that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state_dict_order(config) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the stock model of `config`, in state-dict order (built on the meta device), under the
    names stock saves (a MoE model's fused experts per expert)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from ..models import get_adapter

    with torch.device("meta"), no_init_weights():  # init functions still run on meta tensors: 2/3 of the time
        model = AutoModelForCausalLM.from_config(config)
    return get_adapter(config.model_type).disk_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()})


# -- checkpoint -> HF -----------------------------------------------------------------------------
def _nbytes(info) -> int:
    return math.prod(info.size) * info.properties.dtype.itemsize


def _whole(info) -> bool:
    """Whether one stored box is the whole tensor (a checkpoint from from-hf, or a weight no rank split)."""
    return len(info.chunks) == 1 and tuple(info.chunks[0].sizes) == tuple(info.size)


class _TensorReader:
    """Hands the writer one full tensor at a time. A tensor stored whole is a view of the checkpoint's
    file pages, so its bytes are copied once, by the writer; one stored in boxes (by several ranks) is
    assembled in a reused buffer the size of the largest such tensor. The writer is done with a tensor
    before it asks for the next, and the mapping goes with the tensor."""

    def __init__(self, root: Path, metadata, keys: dict[str, str], *, buffer: torch.Tensor | None = None):
        self.root, self.metadata, self.keys = root, metadata, keys
        # every tensor is covered by its boxes, whose bytes are on disk (reader.check_storage): none is larger than
        # the files hold
        infos = [metadata.state_dict_metadata[k] for k in keys.values()]
        # zeros: a part no box covers (boxes that overlap) holds nothing of this process's memory; `buffer`: one
        # the caller shares between readers it calls one after the other (hf3d average), large enough
        need = max((_nbytes(i) for i in infos if not _whole(i)), default=0)
        self.buffer = torch.zeros(need, dtype=torch.uint8) if buffer is None else buffer
        assert self.buffer.numel() >= need, (self.buffer.numel(), need)

    def _box(self, key: str, chunk, dtype: torch.dtype) -> torch.Tensor:
        info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        with open_in(self.root, info.relative_path) as f:
            return stored_box(self.root / info.relative_path, info, dtype, tuple(chunk.sizes), f)

    def __call__(self, name: str) -> torch.Tensor:
        key = self.keys[name]
        info = self.metadata.state_dict_metadata[key]
        dtype = info.properties.dtype
        if _whole(info):
            return self._box(key, info.chunks[0], dtype)
        full = self.buffer[: _nbytes(info)].view(dtype).view(tuple(info.size))
        for chunk in info.chunks:
            box = full
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                box = box.narrow(dim, start, length)
            box.copy_(self._box(key, chunk, dtype))
        return full


def checkpoint_to_hf(
    ckpt: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the weights of an hf3d checkpoint (any mesh) as an HF directory; returns out_dir.

    dtype: "float32", "bfloat16" or "float16" (default: the training dtype in the checkpoint's marker).
    When it differs from the stored parameters' dtype and the checkpoint has fp32 master weights, the
    weights are taken from the masters (e.g. `--dtype float32` of a bf16 run gives its fp32 masters).
    No collective, even under a process group: this process checks every file (checkpoint.push_to_hub runs
    it in a thread of rank 0 while the ranks train).
    """
    from transformers import AutoConfig

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    meta = marker.read_marker(ckpt)
    marker.refuse_damaged(ckpt, meta, checksums=False, collective=False)  # sizes now, checksums beside the conversion
    name = dtype or meta.get("dtype")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}; pass --dtype")
    out_dtype = getattr(torch, name)
    max_shard_bytes = parse_size(max_shard_size)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"checkpoint {ckpt} has no config.json; it cannot be converted to an HF model")
    check_output_dir(out_dir, EXPORT, src=ckpt)
    config = AutoConfig.from_pretrained(ckpt)
    metadata = SafeReader(ckpt).read_metadata()
    stored = metadata.state_dict_metadata
    prefix = entries.MODEL_PREFIX
    names = [k[len(prefix) :] for k in stored if k.startswith(prefix)]
    expected = _state_dict_order(config)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        names = [n for n in names if n != "lm_head.weight"]  # HF does not store a tied head either
    missing = [n for n in expected if n not in names]
    if missing:
        raise ValueError(
            f"checkpoint {ckpt} lacks {len(missing)} weight(s) of its config's model, e.g. {missing[0]!r}; "
            "was it written by another model?"
        )
    position = {n: i for i, n in enumerate(expected)}
    names.sort(key=lambda n: position.get(n, len(position)))  # unknown extras keep their order, at the end
    specs, keys = [], {}
    for n in names:
        key, size = entries.model_key(n), tuple(stored[entries.model_key(n)].size)
        if n in expected and size != expected[n]:
            raise ValueError(f"checkpoint {ckpt}: {n!r} has shape {size}, its config says {expected[n]}")
        master = entries.optim_key(entries.MASTER_KEY, n)
        if stored[key].properties.dtype != out_dtype and master in stored:
            key = master
        keys[n] = key
        specs.append(TensorSpec(n, size, out_dtype))

    produce = _TensorReader(ckpt, metadata, keys)
    config.dtype = out_dtype
    with _checksums_beside(ckpt, meta) as damage:
        try:
            write_hf_dir(
                out_dir,
                specs,
                lambda n: produce(n).to(out_dtype),
                config,
                src_dir=ckpt,
                max_shard_bytes=max_shard_bytes,
                check=lambda: _refuse(ckpt, meta, damage()),
                extra_files=_training_summary(ckpt),
            )
        except ValueError:  # a damaged file can fail the read first: say that it is damaged
            _refuse(ckpt, meta, damage())
            raise
    return out_dir


def _refuse(ckpt: Path, meta: dict, problem: str | None) -> None:
    """The refusal of a damaged checkpoint when the checksums found `problem`; nothing when None."""
    if problem is not None:
        marker.refuse_damaged(ckpt, meta, problem=problem)


@contextlib.contextmanager
def _checksums_beside(ckpt: Path, meta: dict):
    """The checksum half of `find_damage`, run in a thread while the weights are converted (the CRC-32
    releases the GIL, so on a second core it costs no time): yields a function that waits for it and
    returns its verdict. The output is published only after that verdict (`write_hf_dir`'s check)."""
    pool = ThreadPoolExecutor(1)
    verdict = pool.submit(marker.find_damage, ckpt, meta, collective=False)  # one process reads every file
    try:
        yield verdict.result
    finally:
        pool.shutdown(wait=True)


def _training_summary(ckpt: Path) -> dict[str, bytes]:
    """The run's record that `hf3d train` keeps in each checkpoint's extra.pt, as the file hf3d_training.json
    to write beside the weights ({} when there is none): `hf3d push` makes the model card from it."""
    from ..hf.hub import SUMMARY_FILE

    if not (ckpt / "extra.pt").is_file():
        return {}
    extra = load_small(ckpt, "extra.pt")
    summary = extra.get("training") if isinstance(extra, dict) else None
    return {SUMMARY_FILE: json.dumps(summary, indent=1).encode()} if isinstance(summary, dict) else {}


# -- HF -> checkpoint -----------------------------------------------------------------------------
class _ReadOnDemand(DefaultSavePlanner):
    """The state dict holds meta tensors; each one's data is mapped from the safetensors when DCP writes it
    (a mapping of its own pages: torch.save writes a view's whole storage)."""

    def __init__(self, source: SafetensorsSource):
        super().__init__()
        self.source = source

    def lookup_object(self, index):
        return self.source.mapped(index.fqn[len(entries.MODEL_PREFIX) :])

    def resolve_data(self, write_item):
        """DefaultSavePlanner's, without the two debug records DCP's logging wrapper makes per tensor."""
        return self.transform_object(write_item, self.lookup_object(write_item.index))


def _check_safetensors(model_dir: Path) -> None:
    if (model_dir / SAFE_INDEX).is_file() or (model_dir / SAFE_SINGLE).is_file():
        return
    bins = sorted(f.name for f in model_dir.glob("pytorch_model*.bin*"))
    if bins:
        raise ValueError(
            f"{model_dir} holds PyTorch .bin weights ({bins[0]}) but no safetensors; hf3d reads safetensors only: "
            "re-save it with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir), which writes "
            "safetensors"
        )
    raise ValueError(f"{model_dir} has no {SAFE_SINGLE} or {SAFE_INDEX}; point at an HF model directory with weights")


def hf_to_checkpoint(src: str | os.PathLike, out_ckpt: str | os.PathLike, *, fsync: bool = False) -> Path:
    """Write an HF model (directory or Hub id) as a weights-only hf3d checkpoint; returns its path.

    Every tensor of the safetensors becomes `model/<name>` in its own dtype (a tied lm_head.weight is
    dropped, as HF drops it); config.json, generation_config.json and tokenizer files are copied. The
    marker says kind "weights", step 0 and the dtype of most of the weights. Atomic: a staging folder
    gets the marker last and is then renamed.

    The files are left to the page cache, as save_pretrained leaves its own, unless `fsync`: the marker
    records each file's size and CRC-32 and every load checks them, so an output a power loss cut short
    is refused as damaged, never trained on, and the source is there to convert again. (Training
    checkpoints always fsync: keep_last deletes older ones once a newer one is complete.)
    """
    from transformers import AutoConfig

    from ..models import get_adapter

    final = Path(out_ckpt)
    model_dir = resolve_model_dir(src)
    _check_safetensors(model_dir)
    model_files(model_dir)  # refuses a linked file from outside the folder before anything is written
    config = AutoConfig.from_pretrained(model_dir)
    get_adapter(config.model_type)  # a checkpoint hf3d could not train is refused now, not at `hf3d train`
    check_output_dir(final, marker.CHECKPOINT, src=model_dir)
    source = SafetensorsSource(model_dir)
    specs = [source.spec(n) for n in source.entries]
    if config.tie_word_embeddings:
        specs = [s for s in specs if s.name != "lm_head.weight"]
    if not specs:
        raise ValueError(f"{model_dir} holds no tensors")
    weight = Counter()
    for s in specs:
        weight[s.dtype] += math.prod(s.shape)
    main_dtype = weight.most_common(1)[0][0]
    specs.sort(key=lambda s: source.entries[s.name][:2])  # file order: each file is read once, front to back
    state = {entries.model_key(s.name): torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs}

    tmp = files.make_dir(marker.staging_dir(final), marker.CHECKPOINT)  # replaces an interrupted conversion's
    try:
        writer = OneFileWriter(tmp, sync=fsync)
        with _single_process(), dcp_debug_records_off():
            dcp.save(state, storage_writer=writer, planner=_ReadOnDemand(source), no_dist=True)
        checked = writer.file_table()
        files.copy_file(model_dir / "config.json", tmp / "config.json")
        copy_model_files(model_dir, tmp)
    except BaseException:  # nothing half-written is left
        files.remove_dir(tmp, marker.CHECKPOINT)
        raise
    meta = {
        "kind": "weights",
        "step": 0,
        "dtype": str(main_dtype).removeprefix("torch."),
        "model_type": config.model_type,
        "parallel": None,
    }
    marker.write_marker(tmp, {**meta, "files": checked})
    files.publish_dir(tmp, final, marker.CHECKPOINT, sync=fsync)
    return final
