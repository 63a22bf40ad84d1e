"""How hf3d opens the files of a checkpoint, which may come from someone else: every reader (load_checkpoint,
`convert to-hf`, `hf3d average`, the checksums, the marker) goes through these two rules, so that nothing a file
says makes hf3d read outside the checkpoint folder or allocate more than the files hold.

- **A file of a checkpoint is a regular file of its folder, reached through real folders** (`open_in`). Its name
  (one the marker or the `.metadata` gives too) is relative, without `..`; each component below the checkpoint
  folder is opened as a folder that is not a link (openat with O_NOFOLLOW | O_DIRECTORY, from the descriptor of
  the folder above), then the file itself without following a link, and it must be a regular file. A link at
  any level, one swapped in after a check included, is never followed; a FIFO does not block the open. The
  checkpoint folder itself is the path the caller gave.
- **An archive's sizes are checked against its bytes before anything of it is read** (`zip_records`): torch.save's
  archives (DCP's stored boxes, rng_<rank>.pt, extra.pt) are read only when every record is stored as it is and
  lies inside the bytes at hand. A compressed record, which would inflate to whatever size it declares (1 MB of
  deflated zeros is 1 GB), is refused, as is a file in torch's legacy format (whose pickle declares the storage
  sizes torch allocates before it reads them). Python's zipfile reads the directory through a window that never
  returns more than the file holds there, whatever size it is asked for.

The pickles inside are read by hf3d's allow-list reader (stored.py), which checks every length they declare
against their bytes before anything is built, or by torch.load(weights_only=True), whose reads are bounded.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import torch

from ..utils.faults import one_line

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO answers at once, and is refused
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip record's local header: signature, ..., name and extra lengths


def name_parts(folder: Path, name) -> tuple[str, ...]:
    """The components of `name`, a file name of the checkpoint folder `folder` (a '/'-separated relative path);
    refused in one line when it is not a string, is empty, absolute, or holds '..'."""
    parts = PurePosixPath(name).parts if isinstance(name, str) and "\0" not in name else ()
    if not parts or parts[0] == "/" or ".." in parts:
        raise ValueError(
            f"{folder} names the file {name!r}, outside the checkpoint folder (an absolute path or '..'); refusing to "
            "read it (the checkpoint may have been crafted)"
        )
    return parts


def open_in(folder: str | os.PathLike, name: str) -> BinaryIO:
    """The file `name` of the checkpoint folder `folder`, open for binary reading: every component below `folder`
    a real folder, the file a regular file, no link followed (`name_parts` for the name). A link or anything but
    a folder above the file, or anything but a regular file as it, is refused in one line (ValueError); a missing
    one is FileNotFoundError."""
    folder = Path(folder)
    parts = name_parts(folder, name)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, part in enumerate(parts, 1):
            last = depth == len(parts)
            try:
                below = os.open(part, _FILE if last else _FOLDER, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                where = folder.joinpath(*parts[:depth])
                what = "a link" if last else "a link or not a folder"
                raise ValueError(f"{where} is {what}; hf3d reads no file of a checkpoint through a link") from None
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ValueError(f"{folder / name} is not a regular file")
    return f


def size_of(f: BinaryIO) -> int:
    """The size of the open file `f`, as it is now."""
    return os.fstat(f.fileno()).st_size


class _Window:
    """Bytes [start, start + length) of the open file `f` as a read-only file of their own (what zipfile reads an
    archive through): a read returns at most what the window holds from where it is, whatever it asks for."""

    def __init__(self, f: BinaryIO, start: int, length: int):
        self.fd, self.start, self.length, self.pos = f.fileno(), start, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, self.length)[whence])
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.length - self.pos)
        n = left if n is None or n < 0 else min(n, left)
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        self.pos += len(data)
        return data


def zip_records(f: BinaryIO, start: int, length: int, what: str) -> dict[str, tuple[int, int]]:
    """{record name without the archive's folder: (byte of the file where its bytes start, their number)} of the
    torch.save archive at bytes [start, start + length) of the open file `f` (`what` names it in errors). Refused
    in one line: not a zip archive, a compressed record, a record whose bytes run past the archive's."""
    window = _Window(f, start, length)
    try:
        with zipfile.ZipFile(window) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error) as e:
        raise ValueError(f"{what} is not an archive torch.save writes ({one_line(e)}); refusing to read it") from None
    records = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise ValueError(
                f"{what}: its record {info.filename!r} is compressed ({info.compress_size} bytes, declared to inflate "
                f"to {info.file_size}); torch.save stores every record as it is: refusing to inflate it"
            )
        window.seek(info.header_offset)
        header = window.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise ValueError(f"{what}: its record {info.filename!r} has no header where its directory says")
        begin = info.header_offset + _LOCAL_HEADER.size + sum(_LOCAL_HEADER.unpack(header)[1:])
        if begin + info.file_size > length:
            raise ValueError(
                f"{what}: its record {info.filename!r} ({info.file_size} bytes) runs past the {length} bytes of the "
                "archive; refusing to read it"
            )
        records[info.filename.partition("/")[2]] = (start + begin, info.file_size)
    return records


def load_small(folder: str | os.PathLike, name: str):
    """A small file torch.save wrote into the checkpoint folder (rng_<rank>.pt, extra.pt; a Trainer checkpoint's
    scheduler.pt), read through `open_in` once `zip_records` has checked its archive: tensors and plain values
    only (torch.load with weights_only=True)."""
    with open_in(folder, name) as f:
        zip_records(f, 0, size_of(f), str(Path(folder) / name))
        return torch.load(f, weights_only=True)
