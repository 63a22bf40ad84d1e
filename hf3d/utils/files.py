"""Every folder hf3d deletes, renames or replaces, and every file it writes into a folder it shares, by one rule.

- **A folder hf3d may remove or replace carries its owner file** (`OWNER_FILE`), written by `make_dir` before
  anything else goes in: checkpoints and their staging folders, HF exports and theirs, token caches. A path
  that is not such a folder (a user's folder, a file, a link, a leftover `PATH.tmp` hf3d did not make) is
  refused with one line (`check_replaceable`) and nothing is deleted; an empty real folder is the one
  exception (removing it loses nothing).
- **Files are created without following links**: `write_file` opens with O_CREAT | O_EXCL | O_NOFOLLOW (an
  existing file or link is an error, never written through); with `replace`, it writes `<name>.part` that
  way and renames it over the file, refusing a link in the file's place. `append_to` and `new_file` do the
  same for a log and for writers that take a file object (torch.save, numpy, matplotlib).
- **Publishing is atomic and durable** (`publish_dir`): the staged folder's files and folders are fsynced,
  then it takes the final name in one step (Linux's renameat2: RENAME_NOREPLACE for a new path,
  RENAME_EXCHANGE to swap with the folder it replaces), the parent folder is fsynced, and only then is the
  replaced content removed. A kill at any instant leaves either the old folder or the new one at the final
  path, never neither. Where the system has no renameat2, the old folder is first renamed to `PATH.old`.

tests/test_untrusted_files.py scans hf3d/ for deleting, renaming and file-writing calls outside this module.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

OWNER_FILE = ".hf3d-made"
"""The file that marks a folder as hf3d's own: {"made_by": "hf3d", "kind": ...}. Hidden: `hf3d push` skips it,
and transformers' loaders ignore it."""

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# -- folders -------------------------------------------------------------------------------------------------
def owned(path: str | os.PathLike) -> bool:
    """Whether `path` is a real folder (not a link) holding hf3d's owner file (a regular file, not a link)."""
    path = Path(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        fd = os.open(path / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            return json.loads(f.read(4096)).get("made_by") == "hf3d"
        except (ValueError, AttributeError):
            return False


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuse, in one line, a `path` hf3d may not delete or replace: anything but nothing at all, an empty
    real folder, or a folder hf3d made (`owned`)."""
    path = Path(path)
    if not os.path.lexists(path) or owned(path) or _is_empty_dir(path):
        return
    if path.is_symlink() or not path.is_dir():
        raise ValueError(
            f"{path} exists and is not a folder hf3d made (a file or a link); hf3d never deletes or replaces it: "
            "move it away or choose a new output path"
        )
    raise ValueError(
        f"{path} is a folder hf3d did not make (it has no {OWNER_FILE}); hf3d never deletes or replaces it: "
        "move it away or choose a new output path"
    )


def remove_dir(path: str | os.PathLike) -> None:
    """Delete the folder `path` if hf3d made it (or it is empty); nothing there is fine; anything else is
    refused (`check_replaceable`). Links inside are unlinked, never followed."""
    path = Path(path)
    check_replaceable(path)
    if not os.path.lexists(path):
        return
    if owned(path):
        shutil.rmtree(path)
    else:
        os.rmdir(path)  # empty: rmdir refuses a folder that is not, whatever came in meanwhile


def make_dir(path: str | os.PathLike, kind: str) -> Path:
    """A new folder `path` of hf3d's own (parents made as needed), its owner file written first. A folder
    hf3d made that is already there (a leftover of an interrupted write) is removed first; anything else
    there is refused."""
    path = Path(path)
    remove_dir(path)
    path.mkdir(parents=True)
    write_file(path / OWNER_FILE, json.dumps({"made_by": "hf3d", "kind": kind}) + "\n")
    return path


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux's renameat2; False where the system or the file system has none (the caller falls back)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_cwd = -100
    if fn(at_cwd, os.fsencode(src), at_cwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def rename_new(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst`, which must not exist: FileExistsError if it does (whoever made it first keeps it)."""
    if _renameat2(Path(src), Path(dst), _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "already exists", str(dst))
    os.rename(src, dst)


def sync_dir(path: str | os.PathLike) -> None:
    """fsync a folder: the names in it (a file created or renamed there) are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str | os.PathLike) -> None:
    """fsync every regular file under `root` and every folder, `root` last (links are not followed)."""
    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        sync_dir(folder)


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike, *, sync: bool = True) -> None:
    """Make the complete staged folder `tmp` (made by `make_dir`) the folder `final`, atomically.

    `final` may be absent, an empty folder, or a folder hf3d made (replaced); anything else is refused before
    anything moves. With `sync` (and always when something is replaced), every file and folder of `tmp` is
    on disk before it takes the name, and the name is on disk before the replaced folder is removed."""
    tmp, final = Path(tmp), Path(final)
    assert owned(tmp), f"{tmp} is not a staging folder hf3d made"
    check_replaceable(final)
    replacing = os.path.lexists(final)
    if sync or replacing:  # durable before anything older is removed
        sync_tree(tmp)
    if not replacing:
        rename_new(tmp, final)
    elif not _renameat2(tmp, final, _RENAME_EXCHANGE):  # tmp now holds what final was
        old = final.with_name(final.name + ".old")
        remove_dir(old)
        os.rename(final, old)
        os.rename(tmp, final)
        tmp = old
    if sync or replacing:
        sync_dir(final.parent)
    if replacing:
        remove_dir(tmp)


# -- files ---------------------------------------------------------------------------------------------------
def refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ValueError(
            f"{path} is a link; hf3d never writes through a link nor replaces one: remove it or choose another folder"
        )


def write_file(path: str | os.PathLike, data: str | bytes, *, replace: bool = False, sync: bool = False) -> Path:
    """Write `data` (text as UTF-8) as the file `path`, never through a link. Without `replace`, `path` must not
    exist (FileExistsError otherwise, a dangling link included). With `replace`, an existing regular file is
    replaced in one rename (a link there is refused); with `sync`, the file and its folder's entry are on
    disk when this returns."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    target = path
    if replace:
        refuse_link(path)
        target = path.with_name(path.name + ".part")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC  # a stale .part is ours
    else:
        flags = _CREATE
    fd = os.open(target, flags, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(fd)
    if replace:
        os.replace(target, path)
    if sync:
        sync_dir(path.parent)
    return path


def new_file(path: str | os.PathLike) -> BinaryIO:
    """A new file `path`, open for binary writing (O_EXCL | O_NOFOLLOW): for writers that take a file
    object (torch.save, numpy.save, matplotlib's savefig, a copy)."""
    return os.fdopen(os.open(path, _CREATE, 0o644), "wb")


def append_to(path: str | os.PathLike) -> BinaryIO:
    """The file `path` open for appending (created if missing), never through a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o644), "ab")


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the file `src` to the new file `dst` (`new_file`)."""
    with open(src, "rb") as f_in, new_file(dst) as f_out:
        shutil.copyfileobj(f_in, f_out, length=1 << 22)


def move_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename the file `src` to `dst`, replacing a regular file there in one step (a link there is refused)."""
    refuse_link(Path(dst))
    os.replace(src, dst)


def remove_file(path: str | os.PathLike) -> None:
    """Delete a regular file hf3d wrote in a folder of its own (a probe, a raw token file); a link or anything
    else there is refused."""
    path = Path(path)
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError(f"{path} is not a regular file; hf3d deletes only files it wrote")
    path.unlink()
