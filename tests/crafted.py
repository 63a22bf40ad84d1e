"""Crafted checkpoint files: pickles that would run code when opened, through the modules hf3d's readers allow.

Each payload, unpickled by a plain pickle.load, creates `marker` (a file) or returns an object that is not
DCP metadata; hf3d's readers must refuse every one with one line, before anything runs.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def _arg(value: str | int) -> bytes:
    if isinstance(value, int):
        return b"K" + bytes([value])  # BININT1
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def global_pickle(module: str, name: str, *args: str | int) -> bytes:
    """Protocol 4: STACK_GLOBAL(module, name), called with args when there are some."""
    body = b"\x80\x04" + _arg(module) + _arg(name) + b"\x93"
    if args:
        body += b"".join(_arg(a) for a in args) + {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(args)] + b"R"
    return body + b"."


def payloads(marker: Path) -> dict[str, bytes]:
    """{what it tries: pickle}, through each module the metadata reader takes something from."""
    touch = f"touch {marker}"
    return {
        "dotted os.system under DCP metadata": global_pickle(
            "torch.distributed.checkpoint.metadata", "os.system", touch
        ),
        "dotted os.system under DCP filesystem": global_pickle(
            "torch.distributed.checkpoint.filesystem", "os.system", touch
        ),
        "dotted os.system under torch.serialization": global_pickle("torch.serialization", "os.system", touch),
        "dotted os.system under pathlib": global_pickle("pathlib", "os.system", touch),
        "another name of DCP metadata": global_pickle("torch.distributed.checkpoint.metadata", "os"),
        "torch.save": global_pickle("torch", "save", 0, str(marker)),
        "pathlib.Path": global_pickle("pathlib", "Path", str(marker)),
        "collections.namedtuple": global_pickle("collections", "namedtuple", "T", "a"),
    }


def reseal(ckpt: Path) -> None:
    """Record the checkpoint's files as they are now in its marker, as whoever crafted them would: the size
    and checksum check passes and the crafted bytes reach hf3d's readers."""
    from hf3d import checkpoint

    marker = ckpt / checkpoint.MARKER
    meta = json.loads(marker.read_text())
    meta["files"] = checkpoint.file_table(ckpt)
    marker.write_text(json.dumps(meta))


def write_crafted(ckpt: Path, name: str, data: bytes) -> None:
    """Replace one file of a complete checkpoint with crafted bytes, marker resealed."""
    (ckpt / name).write_bytes(data)
    reseal(ckpt)


def rewrite_metadata(ckpt: Path, edit) -> None:
    """Re-pickle a checkpoint's honest .metadata after edit(metadata) changed it."""
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    edit(metadata)
    write_crafted(ckpt, ".metadata", pickle.dumps(metadata))


def craft_stored_box(ckpt: Path, payload: bytes) -> None:
    """Point the checkpoint's first stored box at a torch.save archive whose data.pkl is `payload`, as large as the
    box's bytes (as whoever crafted it would make it: the sizes check passes and the pickle reaches the reader)."""
    path = ckpt / "__crafted.distcp"
    first = next(iter(dcp.FileSystemReader(ckpt).read_metadata().storage_data.values()))
    writer = torch._C.PyTorchFileWriter(str(path))
    writer.write_record("data.pkl", payload, len(payload))
    writer.write_record("data/padding", bytes(first.length), first.length)
    writer.write_end_of_file()
    del writer

    def edit(metadata) -> None:
        index = next(iter(metadata.storage_data))
        info = metadata.storage_data[index]
        info.relative_path, info.offset, info.length = path.name, 0, path.stat().st_size

    rewrite_metadata(ckpt, edit)


def fake_checkpoint(path: Path, step: int, **meta) -> Path:
    """A complete checkpoint folder as hf3d makes one (its owner file, then the marker), holding no weights:
    what resume and rotation look at."""
    from hf3d import checkpoint
    from hf3d.utils import files

    files.make_dir(path, checkpoint.CHECKPOINT)
    checkpoint.write_marker(path, {"kind": "training", "step": step, **meta})
    return path


def craft_expanded(ckpt: Path, name: str, n: int) -> None:
    """Add the weight `name` to the checkpoint, declared [n, n] float32 and stored as ONE element with strides
    (0, 0) (torch.save keeps an expanded tensor's strides and its one-element storage): a reader that trusts the
    stored strides writes n * n elements of it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path = ckpt / "__expanded.distcp"
    with open(path, "wb") as f:
        torch.save(torch.ones(1).expand(n, n), f)

    def edit(metadata) -> None:
        key, size = f"model/{name}", torch.Size([n, n])
        chunk = ChunkStorageMetadata(torch.Size([0, 0]), size)
        metadata.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk])
        metadata.storage_data[MetadataIndex(key, [0, 0])] = _StorageInfo(path.name, 0, path.stat().st_size)

    rewrite_metadata(ckpt, edit)


def link_data_file(ckpt: Path, target: Path) -> None:
    """Make the checkpoint's data file a link to `target` (another checkpoint's) under a marker that lists no files,
    as hf3d wrote them before it recorded each file's size and checksum."""
    from hf3d import checkpoint

    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(target)
    meta = json.loads((ckpt / checkpoint.MARKER).read_text())
    meta.pop("files")
    (ckpt / checkpoint.MARKER).write_text(json.dumps(meta))


def edit_safetensors_header(path: Path, edit) -> None:
    """Rewrite the header of the safetensors file `path` after edit(header) changed it (the data bytes kept)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


# -- files whose words would make a reader leave the folder or allocate what the files do not hold -------------
def torch_archive(payload: bytes) -> bytes:
    """The bytes of a torch.save archive (its records stored as they are, as torch's writer stores them) whose
    data.pkl is `payload`: what torch.load(weights_only=True) unpickles once hf3d's archive check passes."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        writer = torch._C.PyTorchFileWriter(f"{tmp}/archive")
        writer.write_record("data.pkl", payload, len(payload))
        writer.write_end_of_file()
        del writer
        return Path(f"{tmp}/archive").read_bytes()


def inflating_archive(path: Path, inflated: int, padding: int = 0) -> Path:
    """A zip archive at `path` as torch.save lays one out, but its data.pkl `inflated` zero bytes DEFLATED (about
    1/1000 of that on disk: 256 MiB in 261 KB), beside a stored record of `padding` bytes: a reader that trusts
    the archive's directory inflates all of it before it reads the pickle."""
    import zipfile

    info = zipfile.ZipInfo("archive/data.pkl")
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", compresslevel=9) as archive:
        with archive.open(info, "w", force_zip64=inflated >= 1 << 31) as out:
            chunk = bytes(1 << 20)
            for start in range(0, inflated, len(chunk)):
                out.write(chunk[: min(len(chunk), inflated - start)])
        archive.writestr("archive/data/0", bytes(padding))
        archive.writestr("archive/version", b"3\n")
    return path


def craft_inflating_box(ckpt: Path, inflated: int) -> None:
    """Point the checkpoint's first stored box at an `inflating_archive` (its stored record as large as the box's
    bytes, so the .metadata's sizes check out), marker resealed."""
    path = ckpt / "__inflating.distcp"
    first = next(iter(dcp.FileSystemReader(ckpt).read_metadata().storage_data.values()))
    inflating_archive(path, inflated, padding=first.length)

    def edit(metadata) -> None:
        info = metadata.storage_data[next(iter(metadata.storage_data))]
        info.relative_path, info.offset, info.length = path.name, 0, path.stat().st_size

    rewrite_metadata(ckpt, edit)


def counted_pickle(declared: int) -> bytes:
    """A pickle that opens with BINBYTES8 declaring `declared` bytes, followed by 1000: C's unpickler allocates the
    declared size before it finds the bytes are not there."""
    return b"\x80\x04\x8e" + declared.to_bytes(8, "little") + bytes(1000)


def _add_tensor(ckpt: Path, name: str, size: list[int], stored: list[int], count: int) -> None:
    """Add the weight `name`, declared float32 of `size`, whose one stored box (a real tensor of shape `stored` at
    offsets 0, in a data file of its own) its .metadata lists `count` times; marker resealed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path = ckpt / "__box.distcp"
    with open(path, "wb") as f:
        torch.save(torch.ones(stored), f)

    def edit(metadata) -> None:
        key, offsets = f"model/{name}", torch.Size([0] * len(size))
        box = ChunkStorageMetadata(offsets, torch.Size(stored))
        md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [box] * count)
        metadata.state_dict_metadata[key] = md
        metadata.storage_data[MetadataIndex(key, offsets)] = _StorageInfo(path.name, 0, path.stat().st_size)

    rewrite_metadata(ckpt, edit)


def craft_repeated_box(ckpt: Path, name: str, n: int) -> None:
    """Add the weight `name`, declared [n, n] float32, whose one stored row (a real [1, n] box of 4n bytes) is listed
    as n boxes at the same offsets: their elements add up to the tensor's, and a reader that trusts the count
    assembles (and `convert to-hf` writes) n * n * 4 bytes from 4n on disk."""
    _add_tensor(ckpt, name, [n, n], [1, n], n)


def craft_partial_tensor(ckpt: Path, name: str, n: int) -> None:
    """Add the weight `name`, declared [n, n] float32, of which one element is stored: `hf3d average` sized its
    buffer by the declared n * n * 4 bytes before it looked at what is stored."""
    _add_tensor(ckpt, name, [n, n], [1, 1], 1)


def link_data_folder(ckpt: Path, other: Path, *, listed: bool) -> None:
    """Move the checkpoint's data into a folder `sub` that is a link to the checkpoint `other` (its .metadata naming
    `sub/__0_0.distcp`), marker resealed: with `listed`, the marker also records that file's size and checksum, as
    whoever crafted it would (resealing does not follow the link)."""
    from hf3d import checkpoint

    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "sub").symlink_to(other, target_is_directory=True)

    def edit(metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "sub/" + info.relative_path

    rewrite_metadata(ckpt, edit)
    if listed:
        meta = json.loads((ckpt / checkpoint.MARKER).read_text())
        meta["files"]["sub/__0_0.distcp"] = checkpoint.file_table(other, only="__0_0.distcp")["__0_0.distcp"]
        (ckpt / checkpoint.MARKER).write_text(json.dumps(meta))


def nested_json(depth: int) -> str:
    """A JSON array nested `depth` deep: deeper than Python's parser recurses."""
    return "[" * depth + "]" * depth
