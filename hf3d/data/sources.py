"""Sources -> flat token arrays on disk, memory-mapped on every rank.

A source becomes one or more segments: a 1-D token array (uint16 when the vocabulary fits, else
uint32) and the exclusive end offsets of its documents (`doc_ends[-1] == len(tokens)`).

- HF datasets sources (local json/parquet/text files, Hub datasets): datasets' `load_dataset`, then
  `Dataset.map` (batched, `num_proc` workers, cached by datasets) tokenises whole documents with the
  model's tokenizer (no special tokens) and appends the tokenizer's EOS to each. The node's main
  process then writes the tokens and document ends as `tokens.npy` / `doc_ends.npy` into
  `<cache_dir>/<key>/`, where the key hashes the files (path, size, mtime), or the Hub id, subset and
  split, the text field and the tokenizer. The folder is written under a temporary name and renamed
  when complete, so a folder that exists is whole. Other ranks never tokenise: they wait at the
  barrier and open the arrays with `np.load(mmap_mode="r")`. No rank holds the dataset in memory.
- A document whose text is missing (null, or the field absent on that row) or blank is skipped and
  counted (`skipped_docs` in the summary). A text field absent from every row is an error naming the
  fields that exist. A .txt file is one document, read as UTF-8 with invalid bytes replaced by
  U+FFFD; JSON that is not valid UTF-8 is an error naming the source.
- datatrove shards (`DocumentTokenizer` output): `<file>.ds` holds little-endian tokens of the
  size in `<file>.ds.metadata` (first line `<tokenizer name>|<bytes per token>`), `<file>.ds.index`
  the uint64 document ends. They are memory-mapped as they are: the EOS is whatever datatrove wrote
  (its `eos_token` option) and documents are the index's. A metadata tokenizer that is a local file
  or folder is compared with the model's vocabulary (a mismatch is refused); a Hub name that differs
  from the model's tokenizer name gives a warning, as it cannot be checked offline.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..utils import files
from ..utils.faults import one_line
from .config import SourceConfig

CACHE_FORMAT = 1  # bump when the cached layout or the tokenisation changes
SUFFIX_KIND = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
MAP_BATCH = 1000  # documents per tokenizer call in datasets' map


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass
class Resolved:
    """What a source spec points at, found without reading the data (every rank does this)."""

    kind: str  # json | parquet | text | hub | datatrove
    files: list[str]  # local files; datatrove: the .ds files


def resolve(src: SourceConfig) -> Resolved:
    """The kind and files of `src`; a ValueError for a path that names nothing usable."""
    where = f"data source {src.label!r}"
    path = src.path
    if src.kind == "hub":
        return Resolved("hub", [])
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise ValueError(f"{where}: the pattern {path!r} matches no files")
    elif os.path.isdir(path):
        root = Path(path)
        shards = sorted(str(p) for p in root.rglob("*.ds"))
        if shards and src.kind in ("auto", "datatrove"):
            files = shards
        else:
            files = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIX_KIND)
        if not files:
            raise ValueError(f"{where}: the folder {path!r} holds no .jsonl/.json/.parquet/.txt files or .ds shards")
    elif os.path.isfile(path):
        files = [path]
    elif src.kind in ("auto",) and Path(path).suffix not in (*SUFFIX_KIND, ".ds") and not path.startswith((".", "/")):
        return Resolved("hub", [])
    else:
        raise ValueError(
            f"{where}: {path!r} does not exist; give an existing file, folder or glob, or a Hub dataset id"
        )
    if src.kind != "auto":
        kind = src.kind
    elif all(f.endswith(".ds") for f in files):
        kind = "datatrove"
    else:
        kinds = {SUFFIX_KIND.get(Path(f).suffix) for f in files}
        if None in kinds:
            odd = next(f for f in files if Path(f).suffix not in SUFFIX_KIND)
            raise ValueError(f"{where}: cannot tell the format of {odd!r}; set kind (json, parquet, text or datatrove)")
        if len(kinds) > 1:
            raise ValueError(
                f"{where}: {path!r} mixes formats ({', '.join(sorted(kinds))}); make one source per format"
            )
        kind = kinds.pop()
    if kind == "datatrove" and src.streaming:
        raise ValueError(f"{where}: streaming applies to HF datasets, not datatrove shards")
    return Resolved(kind, files)


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}|{tokenizer.eos_token_id}|{text}".encode()).hexdigest()[:16]


def cache_key(src: SourceConfig, res: Resolved, tokenizer) -> str:
    if res.kind == "hub":
        data = [src.path, src.subset, src.split]
    else:
        data = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in res.files]
    spec = [CACHE_FORMAT, res.kind, data, src.text_field, tokenizer_fingerprint(tokenizer)]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "hf3d-tokens"


# --- tokenising (the node's main process) --------------------------------------------------------


def _tokenize(batch: dict, *, tokenizer, text_field: str, eos_id: int | None) -> dict:
    """Token ids of each document plus EOS; [] for a missing or blank text (skipped when flattened)."""
    texts = batch[text_field]
    keep = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    ids: list[list[int]] = [[] for _ in texts]
    if keep:
        encoded = tokenizer([texts[i] for i in keep], add_special_tokens=False, verbose=False)["input_ids"]
        tail = [] if eos_id is None else [eos_id]
        for i, e in zip(keep, encoded):
            ids[i] = list(e) + tail
    return {"input_ids": ids}


def _load(src: SourceConfig, res: Resolved, datasets_cache: str | None):
    import datasets

    where = f"data source {src.label!r}"
    empty = [f for f in res.files if os.path.getsize(f) == 0]
    if empty:
        raise ValueError(f"{where}: {empty[0]!r} is empty (0 bytes); remove it from the source or fill it")
    try:
        if res.kind == "hub":
            return datasets.load_dataset(
                src.path, src.subset, split=src.split, streaming=src.streaming, cache_dir=datasets_cache
            )
        extra = dict(sample_by="document", encoding_errors="replace") if res.kind == "text" else {}
        return datasets.load_dataset(
            res.kind, data_files=res.files, split="train", streaming=src.streaming, cache_dir=datasets_cache, **extra
        )
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line naming the source
        _raise_if_not_utf8(e, src)
        cause = e.__cause__ or e.__context__ or e
        detail = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
        what = f"Hub dataset {src.path!r}" if res.kind == "hub" else f"{src.path!r}"
        raise ValueError(f"{where}: could not load {what} ({detail})") from e


def _raise_if_not_utf8(e: BaseException, src: SourceConfig) -> None:
    """A UnicodeDecodeError anywhere in `e`'s chain (the loader or the tokenising map) -> one line."""
    seen = e
    while seen is not None:
        if isinstance(seen, UnicodeDecodeError):
            raise ValueError(
                f"data source {src.label!r}: {src.path!r} is not valid UTF-8 ({seen}); re-encode it as UTF-8"
            ) from e
        seen = seen.__cause__ or seen.__context__


def _check_text_field(ds, src: SourceConfig) -> list[str]:
    import datasets

    columns = ds.column_names
    if columns is None:  # a stream of unknown schema: look at its first row
        first = next(iter(ds), None)
        if first is None:
            raise ValueError(f"data source {src.label!r}: {src.path!r} holds no rows")
        columns = list(first)
    if src.text_field not in columns:
        raise ValueError(
            f"data source {src.label!r}: no field {src.text_field!r} in {src.path!r}; its fields are "
            f"{', '.join(columns)} (set text_field)"
        )
    feature = (ds.features or {}).get(src.text_field)
    if isinstance(feature, datasets.Value) and feature.dtype not in ("string", "large_string", "null"):
        raise ValueError(
            f"data source {src.label!r}: field {src.text_field!r} of {src.path!r} holds {feature.dtype}, not text"
        )
    return columns


TOKEN_CACHE = files.Kind("token cache", lambda name: name in ("tokens.bin", "tokens.npy", "doc_ends.npy", "meta.json"))
"""A source's tokens as `build_token_cache` writes them (its staging folder, renamed into place once whole)."""


def build_token_cache(
    src: SourceConfig, res: Resolved, tokenizer, out: Path, *, num_proc: int, datasets_cache: str | None
) -> None:
    """Tokenise `src` into `out` (tokens.npy, doc_ends.npy, meta.json); written whole or not at all."""
    ds = _load(src, res, datasets_cache)
    columns = _check_text_field(ds, src)
    dtype = token_dtype(len(tokenizer))
    tmp = files.make_dir(out.parent / f"{out.name}.tmp-{socket.gethostname()}-{os.getpid()}", TOKEN_CACHE)
    try:
        lens = _write_tokens(_tokenized_batches(ds, src, tokenizer, columns, num_proc), tmp / "tokens.bin", dtype)
    except Exception as e:
        files.remove_dir(tmp, TOKEN_CACHE)
        _raise_if_not_utf8(e, src)
        raise
    kept = lens[lens > 0]
    _raw_to_npy(tmp / "tokens.bin", tmp / "tokens.npy", dtype, int(kept.sum()))
    with files.new_file(tmp / "doc_ends.npy") as f:
        np.save(f, np.cumsum(kept, dtype=np.int64))
    meta = dict(source=src.label, path=src.path, num_tokens=int(kept.sum()), num_docs=int(len(kept)))
    meta["skipped_docs"] = int(len(lens) - len(kept))
    files.write_file(tmp / "meta.json", json.dumps(meta))
    try:
        files.rename_new(tmp, out)
    except OSError:  # another process finished first (a shared file system): keep its copy
        if not (out / "meta.json").is_file():
            raise
        files.remove_dir(tmp, TOKEN_CACHE)


def _tokenized_batches(ds, src: SourceConfig, tokenizer, columns: list[str], num_proc: int):
    """Batches of the `input_ids` column: pyarrow tables (a Dataset) or dicts of lists (a stream)."""
    import datasets

    kwargs = dict(
        batched=True,
        batch_size=MAP_BATCH,
        remove_columns=columns,
        fn_kwargs=dict(tokenizer=tokenizer, text_field=src.text_field, eos_id=tokenizer.eos_token_id),
    )
    if isinstance(ds, datasets.Dataset):
        procs = num_proc if num_proc > 1 else None
        mapped = ds.map(_tokenize, num_proc=procs, desc=f"tokenising {src.label}", **kwargs)
        return mapped.with_format("arrow").iter(batch_size=10 * MAP_BATCH)
    return ds.map(_tokenize, **kwargs).iter(batch_size=10 * MAP_BATCH)


def _write_tokens(batches, raw: Path, dtype: np.dtype) -> np.ndarray:
    """Append every document's tokens to `raw`; returns each document's length (0: skipped)."""
    lengths = []
    with files.new_file(raw) as f:
        for batch in batches:
            if isinstance(batch, dict):
                docs = batch["input_ids"]
                lens = np.array([len(x) for x in docs], dtype=np.int64)
                values = np.fromiter((t for x in docs for t in x), dtype=np.int64, count=int(lens.sum()))
                f.write(values.astype(dtype).tobytes())
                lengths.append(lens)
                continue
            for chunk in batch.column("input_ids").chunks:
                lengths.append(chunk.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64))
                f.write(chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype).tobytes())
    return np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def _raw_to_npy(raw: Path, dst: Path, dtype: np.dtype, count: int) -> None:
    """An .npy file holding the `count` values of `raw` (its header written first, then the bytes)."""
    with files.new_file(dst) as f_out, open(raw, "rb") as f_in:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
        np.lib.format.write_array_header_2_0(f_out, header)
        shutil.copyfileobj(f_in, f_out, length=2**24)
    files.remove_file(raw)


# --- opening (every rank) --------------------------------------------------------------------------

Segment = tuple[np.ndarray, np.ndarray]  # (tokens [n], doc_ends [num_docs]), both memory maps


def open_token_cache(folder: Path, src: SourceConfig) -> tuple[list[Segment], dict]:
    if not (folder / "meta.json").is_file():
        raise ValueError(
            f"data source {src.label!r}: its tokens are not in {folder}; the node's main process did not "
            "prepare them (see its error), or the cache folder is not shared by the processes of this node"
        )
    meta = json.loads((folder / "meta.json").read_text())
    if meta["num_tokens"] == 0:
        return [], meta
    try:  # memory maps: an array of Python objects (a pickle) cannot be one, and is never unpickled
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        doc_ends = np.load(folder / "doc_ends.npy", mmap_mode="r")
    except ValueError as e:
        tokens = doc_ends = e
    if not all(isinstance(a, np.ndarray) and a.dtype.kind in "iu" for a in (tokens, doc_ends)):
        raise ValueError(
            f"data source {src.label!r}: {folder} holds token files hf3d did not write "
            f"({one_line(tokens) if isinstance(tokens, Exception) else 'not arrays of integers'}); delete that folder "
            "and hf3d tokenises the source again"
        )
    return [(tokens, doc_ends)], meta


def read_shard_metadata(shard: str) -> tuple[str, int]:
    """(tokenizer name, bytes per token) from `<shard>.metadata`, as datatrove writes it."""
    meta = Path(shard + ".metadata")
    if not meta.is_file():
        raise ValueError(
            f"datatrove shard {shard!r} has no {meta.name} (it gives the token size, 2 or 4 bytes); copy it "
            "along with the shard, or re-tokenise with datatrove's DocumentTokenizer"
        )
    name, _, size = meta.read_text().splitlines()[0].rpartition("|")
    if size not in ("2", "4"):
        raise ValueError(f"{meta}: expected '<tokenizer>|<2 or 4>' on its first line, got {size!r}")
    return name, int(size)


def check_shard_tokenizer(name: str, token_size: int, tokenizer, where: str) -> None:
    """Refuse shards whose token size or (locally resolvable) vocabulary differ from the model's."""
    if token_size == 2 and len(tokenizer) > 2**16:
        raise ValueError(
            f"{where}: 2-byte tokens, but the model's tokenizer has {len(tokenizer)} tokens; re-tokenise the shards"
        )
    p = Path(name)
    local = p if p.is_file() else p / "tokenizer.json" if (p / "tokenizer.json").is_file() else None
    if local is not None:
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(local)).get_vocab(with_added_tokens=True) != tokenizer.get_vocab():
            raise ValueError(
                f"{where}: written with the tokenizer {name!r}, whose vocabulary differs from the model's "
                f"({tokenizer.name_or_path!r}); re-tokenise with the model's tokenizer"
            )
    elif name.startswith("Unknown Tokenizer"):
        warnings.warn(
            f"{where}: the shard metadata names no tokenizer; cannot check it against the model's", stacklevel=2
        )
    elif name != tokenizer.name_or_path:
        warnings.warn(
            f"{where}: written with the tokenizer {name!r}, the model's is {tokenizer.name_or_path!r}; "
            "not checked (not a local file): make sure they are the same",
            stacklevel=2,
        )


def open_datatrove(src: SourceConfig, shards: list[str], tokenizer) -> tuple[list[Segment], dict]:
    where = f"data source {src.label!r}"
    segments, checked = [], set()
    for shard in shards:
        name, size = read_shard_metadata(shard)
        if (name, size) not in checked:
            check_shard_tokenizer(name, size, tokenizer, where)
            checked.add((name, size))
        if not os.path.isfile(shard + ".index"):
            raise ValueError(f"{where}: {shard!r} has no .index (document ends); re-tokenise with save_index=True")
        if os.path.getsize(shard) == 0:
            continue
        tokens = np.memmap(shard, dtype=np.dtype("<u2" if size == 2 else "<u4"), mode="r")
        doc_ends = np.memmap(shard + ".index", dtype=np.dtype("<u8"), mode="r")
        if len(doc_ends) == 0 or int(doc_ends[-1]) != len(tokens):
            raise ValueError(
                f"{where}: {shard!r} holds {len(tokens)} tokens but its index ends elsewhere (a truncated or "
                "mismatched file); re-tokenise it with datatrove's DocumentTokenizer"
            )
        segments.append((tokens, doc_ends))
    meta = dict(
        source=src.label,
        path=src.path,
        num_tokens=sum(len(t) for t, _ in segments),
        num_docs=sum(len(e) for _, e in segments),
        skipped_docs=0,
    )
    return segments, meta


class TokenSource:
    """A source's segments cut into windows of `window` tokens (= seq_len + 1).

    Window k covers tokens [k * window, (k + 1) * window) of its segment: consecutive windows do not
    share a token (each window's last token is a label only), and a segment's tail shorter than a
    window is never used (datatrove's readers cut the same way)."""

    def __init__(self, name: str, segments: list[Segment], meta: dict, window: int):
        self.name, self.segments, self.meta, self.window = name, segments, meta, window
        counts = [len(tokens) // window for tokens, _ in segments]
        self.offsets = np.cumsum([0, *counts])
        self.num_windows = int(self.offsets[-1])
        self.num_tokens = int(meta["num_tokens"])
        self.num_docs = int(meta["num_docs"])

    def read(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Window k: its tokens (int64 [window]) and where documents start inside it (in (0, window))."""
        seg = int(np.searchsorted(self.offsets, k, side="right")) - 1
        start = (k - int(self.offsets[seg])) * self.window
        tokens, doc_ends = self.segments[seg]
        ids = np.asarray(tokens[start : start + self.window], dtype=np.int64)
        lo = int(np.searchsorted(doc_ends, start, side="right"))
        hi = int(np.searchsorted(doc_ends, start + self.window, side="left"))
        starts = np.asarray(doc_ends[lo:hi], dtype=np.int64) - start
        return ids, starts
