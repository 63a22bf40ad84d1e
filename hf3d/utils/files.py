"""Every folder hf3d deletes, renames or replaces, and every file it writes into a folder it shares, by one rule.

- **A folder hf3d may remove or replace is one it made, of the kind being written, holding only what it wrote
  there.** `make_dir` writes the owner file (`OWNER_FILE`) before anything else goes in: the folder's `Kind`
  (checkpoint, export, token cache) and its identity, the inode numbers of the folder and of the folder it
  was made in. A copy (`cp -r`) has other inode numbers and a move to another folder another parent, so
  neither is hf3d's, wherever the owner file travels (device numbers are not compared: a network file
  system numbers its devices per mount, and a resumed job may run on another machine). `refusal` names,
  in one line, why a path may not go: a file or a link, a folder without the owner file, a copy or a move,
  a folder of another kind (a checkpoint never replaces an export), or an entry the kind does not write
  there (a user's NOTES.md, a subfolder, a link). An empty real folder is the one exception (removing it
  loses nothing). Owner files of hf3d before it recorded identities (`origin` "legacy") are replaced at
  their own path when they hold only their kind's files, and never deleted by rotation.
- **A run folder moved or copied as a whole stays one run** (`claim_run`): `hf3d train` records a run identity
  in its output folder (`RUN_FILE`: a random id and the folder's own inode numbers), and every folder hf3d makes
  in it or one level below (its checkpoints, exports) names that id in its owner file. When the run file no
  longer matches its folder (the whole run was moved or copied), its folders that name its id are the run's own
  wherever it now lives (`origin` "here"), and `claim_run` records the new identities at the next start. A folder
  of another run (a colleague's checkpoint dropped in) names another id, and one copied inside a run that did not
  move has other inode numbers: both stay "elsewhere".
- **Removing a folder is atomic for hf3d's purposes** (`remove_dir`): the folder is first renamed to a
  hidden trash name beside it (`TRASH_PREFIX`), then its entries are deleted one by one, the owner file
  last, then the folder. A kill at any instant leaves the whole folder at its name, or a trash folder that
  blocks nothing and that `sweep` (run by every `make_dir` in that folder) deletes later.
- **Files are created without following links**: `write_file` opens with O_CREAT | O_EXCL | O_NOFOLLOW (an
  existing file or link is an error, never written through); with `replace`, it writes `<name>.part` that
  way and renames it over the file, refusing a link in the file's place. `append_to` and `new_file` do the
  same for a log and for writers that take a file object (torch.save, numpy, matplotlib). `open_read` opens
  a file of a checkpoint for reading without following a link.
- **Publishing is atomic and durable** (`publish_dir`): the staged folder's files and folders are fsynced,
  then it takes the final name in one step (Linux's renameat2: RENAME_NOREPLACE for a new path,
  RENAME_EXCHANGE to swap with the folder it replaces), the parent folder is fsynced, and only then is the
  replaced content removed. A kill at any instant leaves either the old folder or the new one at the final
  path, never neither. Where the system has no renameat2, the old folder is first renamed to `PATH.old`.

tests/audit.py records, over the whole test suite, every deletion, rename and file write hf3d asks for, and fails
the test when one comes from outside this module (or writes through a link); tests/test_untrusted_files.py also
scans hf3d/ for such calls.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

OWNER_FILE = ".hf3d-made"
"""The file that marks a folder as hf3d's own: {"made_by": "hf3d", "kind", "inode", "parent_inode"}. Hidden:
`hf3d push` skips it, and transformers' loaders ignore it."""

RUN_FILE = ".hf3d-run"
"""The file that names the run an output folder holds: {"made_by": "hf3d", "run", "inode", "parent_inode"}."""

_OWNER_NAMES = (OWNER_FILE, OWNER_FILE + ".part")  # the owner file, and what a kill while it is replaced leaves

TRASH_PREFIX = ".hf3d-trash."
"""The name a folder takes while `remove_dir` deletes it: `.hf3d-trash.<random>.<its name>`, beside it."""

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _nothing_recorded(folder: Path) -> None:
    return None


@dataclass(frozen=True)
class Kind:
    """A kind of folder hf3d makes, and the files it writes into one."""

    name: str
    """Recorded in the owner file: a folder of one kind is never replaced by a writer of another."""
    writes: Callable[[str], bool]
    """Whether hf3d writes a file of this name into a folder of this kind (the owner file aside)."""
    recorded: Callable[[Path], Collection[str] | None] = _nothing_recorded
    """The files a finished folder of this kind lists as its own (a checkpoint's marker), or None: a file of a
    name `writes` takes is hf3d's only if it is listed too, when there is a list."""


# -- folders -------------------------------------------------------------------------------------------------
def owner_record(path: str | os.PathLike, name: str = OWNER_FILE) -> dict | None:
    """The owner file's record (or the run file's, `name`) when `path` is a real folder (not a link) holding it
    as a regular file (not a link) written by hf3d; else None."""
    path = Path(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            record = json.loads(f.read(4096))
        except (ValueError, RecursionError):
            return None
    return record if isinstance(record, dict) and record.get("made_by") == "hf3d" else None


def _identity(path: Path) -> dict[str, int]:
    """The inode numbers of the folder `path` and of the folder it is in."""
    return {"inode": os.lstat(path).st_ino, "parent_inode": os.stat(os.path.dirname(os.path.abspath(path))).st_ino}


def _recorded_identity(record: dict) -> dict[str, int] | None:
    made = {k: record.get(k) for k in ("inode", "parent_inode")}
    return made if all(isinstance(v, int) for v in made.values()) else None


def _run_around(path: Path) -> tuple[Path, dict] | None:
    """The run folder `path` is in (its parent or the parent's parent holding a run file) and its run file's
    record, or None."""
    for folder in (path.parent, path.parent.parent):
        record = owner_record(folder, RUN_FILE)
        if record is not None and isinstance(record.get("run"), str):
            return folder, record
    return None


def _moved_with_its_run(path: Path, record: dict) -> bool:
    """Whether the folder `path` (its owner `record`) belongs to the run around it, and that run folder was moved
    or copied as a whole since it recorded where it was: then the folder moved with it."""
    around = _run_around(path)
    if around is None or record.get("run") != around[1]["run"]:
        return False
    folder, run = around
    return _identity(folder) != _recorded_identity(run)


def origin(path: str | os.PathLike) -> str | None:
    """Whose folder `path` is: "here" (hf3d made it, and it is that folder, in the folder it was made in, or it
    moved there with the whole run folder it belongs to), "elsewhere" (its owner file was made for another
    folder: `path` is a copy, or was moved from another folder), "legacy" (an owner file of hf3d before it
    recorded identities), or None (not hf3d's)."""
    path = Path(path)
    record = owner_record(path)
    if record is None:
        return None
    made = _recorded_identity(record)
    if made is None:
        return "legacy"
    return "here" if _identity(path) == made or _moved_with_its_run(path, record) else "elsewhere"


def owned(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder hf3d made here (`origin` "here")."""
    return origin(path) == "here"


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def refusal(path: str | os.PathLike, kind: Kind) -> str | None:
    """Why hf3d may not delete or replace `path` with a folder of `kind`, in a few words naming it; None when it
    may: nothing is there, an empty real folder, or a folder of `kind` that hf3d made here (or before it
    recorded identities) holding nothing but files hf3d writes into one."""
    path = Path(path)
    if not os.path.lexists(path) or _is_empty_dir(path):
        return None
    if path.is_symlink() or not path.is_dir():
        return f"{path} exists and is not a folder hf3d made (a file or a link)"
    record, where = owner_record(path), origin(path)
    if record is None:
        return f"{path} is a folder hf3d did not make (it has no {OWNER_FILE})"
    if where == "elsewhere":
        return f"{path} is a copy or a move of a folder hf3d made elsewhere (its {OWNER_FILE} names another folder)"
    if record.get("kind") != kind.name:
        return f"{path} is an hf3d folder of another kind ({record.get('kind')}, not {kind.name})"
    listed = kind.recorded(path)
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name not in _OWNER_NAMES and not _wrote(entry, kind, listed):
            return f"{path} holds {entry.name!r}, which hf3d does not write there"
    return None


def _wrote(entry: os.DirEntry, kind: Kind, listed: Collection[str] | None) -> bool:
    """Whether hf3d wrote `entry` into a folder of `kind` (`listed`: the files the folder records, if any)."""
    return entry.is_file(follow_symlinks=False) and kind.writes(entry.name) and (listed is None or entry.name in listed)


def check_replaceable(path: str | os.PathLike, kind: Kind) -> None:
    """Refuse, in one line (ValueError), a `path` hf3d may not delete or replace with a folder of `kind`
    (`refusal`), or could not create (`_cannot_create`)."""
    problem = refusal(path, kind)
    if problem is not None:
        raise ValueError(f"{problem}; hf3d never deletes or replaces it: move it away or choose a new output path")
    problem = _cannot_create(Path(path)) if not os.path.lexists(path) else None
    if problem is not None:
        raise ValueError(f"{problem}: choose another output path")


def remove_dir(path: str | os.PathLike, kind: Kind) -> None:
    """Delete the folder `path` of `kind` (nothing there is fine; anything `refusal` names is refused): renamed
    to a trash name first, so a kill leaves the whole folder or a trash folder (`sweep`), then emptied of
    the files hf3d wrote, the owner file last. Links inside are unlinked, never followed."""
    path = Path(path)
    check_replaceable(path, kind)
    if not os.path.lexists(path):
        return
    if owner_record(path) is None:
        os.rmdir(path)  # empty: rmdir refuses a folder that is not, whatever came in meanwhile
        return
    trash = path.with_name(f"{TRASH_PREFIX}{uuid.uuid4().hex[:12]}.{path.name}")
    rename_new(path, trash)
    _empty_trash(trash, kind)


def _empty_trash(trash: Path, kind: Kind) -> None:
    """Delete what hf3d wrote in the trash folder `trash`, the owner file last, then the folder; anything else
    (a file that came in after the check) stays, and so does the folder."""
    listed = kind.recorded(trash)
    for entry in sorted(os.scandir(trash), key=lambda e: e.name):
        if entry.name not in _OWNER_NAMES and _wrote(entry, kind, listed) or entry.name == _OWNER_NAMES[1]:
            _unlink_if_there(Path(entry.path))
    if {e.name for e in os.scandir(trash)} == {OWNER_FILE}:
        _unlink_if_there(trash / OWNER_FILE)
        try:
            os.rmdir(trash)
        except FileNotFoundError:
            pass


def _unlink_if_there(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # another process sweeping the same folder
        pass


def sweep(folder: str | os.PathLike, kind: Kind) -> None:
    """Finish what a killed removal left in `folder`: the trash folders of `kind` (`remove_dir`), and the empty
    ones of any kind."""
    folder = Path(folder)
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        path = Path(entry.path)
        if entry.name.startswith(TRASH_PREFIX) and _is_empty_dir(path):
            try:
                os.rmdir(path)
            except OSError:  # something came in, or another process removed it
                pass
        elif entry.name.startswith(TRASH_PREFIX) and refusal(path, kind) is None:
            _empty_trash(path, kind)


def make_dir(path: str | os.PathLike, kind: Kind) -> Path:
    """A new folder `path` of hf3d's own, of `kind` (parents made as needed), its owner file written first. A
    folder of that kind hf3d made that is already there (a leftover of an interrupted write) is removed
    first; anything else there is refused (`refusal`). Leftovers of killed removals beside it go too."""
    path = Path(path)
    sweep(path.parent, kind)
    remove_dir(path, kind)
    path.mkdir(parents=True)
    write_file(path / OWNER_FILE, json.dumps(_owner(path, kind.name)) + "\n")
    return path


def _owner(path: Path, kind: str, run: str | None = None) -> dict:
    """The owner file of the folder `path`: its kind, its identity and the run it is made in (`_run_around`)."""
    around = _run_around(path)
    run = run or (around[1]["run"] if around is not None else None)
    return {"made_by": "hf3d", "kind": kind, **_identity(path), **({"run": run} if run else {})}


def claim_run(folder: str | os.PathLike) -> int | None:
    """Make the output folder `folder` a run of hf3d's own, at the start of a run, where its run file is missing
    or no longer matches the folder (the whole run was moved or copied): the owner file of every folder of the
    run (`_run_members` that are "here" by `origin`) recorded again with its identity and a new run id, then
    the run file; a copy and its original are two runs from then on. A kill midway leaves nothing that `origin`
    reads otherwise. Returns how many folders moved with the run when it was moved or copied, else None. Rank
    0, before anything is written into the folder."""
    folder = Path(folder)
    record = owner_record(folder, RUN_FILE)
    if record is not None and _recorded_identity(record) == _identity(folder):
        return None
    run = uuid.uuid4().hex
    members = [m for m in _run_members(folder) if origin(m) == "here"]
    for member in members:
        owner = _owner(member, owner_record(member)["kind"], run)
        write_file(member / OWNER_FILE, json.dumps(owner) + "\n", replace=True)
    write_file(folder / RUN_FILE, json.dumps({"made_by": "hf3d", "run": run, **_identity(folder)}) + "\n",
               replace=True, sync=True)  # fmt: skip
    return len(members) if record is not None else None


def _run_members(folder: Path) -> list[Path]:
    """The folders hf3d made in the run folder `folder` or one level below (its checkpoints folder), which
    `_run_around` finds the run of."""
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.is_dir(follow_symlinks=False) or entry.name.startswith(TRASH_PREFIX):
            continue
        if owner_record(entry.path) is not None:
            found.append(Path(entry.path))
            continue
        for inner in sorted(os.scandir(entry.path), key=lambda e: e.name):
            if inner.is_dir(follow_symlinks=False) and owner_record(inner.path) is not None:
                found.append(Path(inner.path))
    return found


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


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike, kind: Kind, *, sync: bool = True) -> None:
    """Make the complete staged folder `tmp` (made by `make_dir` with `kind`) the folder `final`, atomically.

    `final` may be absent, an empty folder, or a folder of `kind` hf3d made (replaced); anything else is
    refused (`refusal`) before anything moves. With `sync` (and always when something is replaced), every
    file and folder of `tmp` is on disk before it takes the name, and the name is on disk before the
    replaced folder is removed."""
    tmp, final = Path(tmp), Path(final)
    assert owned(tmp) and owner_record(tmp)["kind"] == kind.name, f"{tmp} is not a staging folder hf3d made"
    check_replaceable(final, kind)
    replacing = os.path.lexists(final)
    if sync or replacing:  # durable before anything older is removed
        sync_tree(tmp)
    if not replacing:
        rename_new(tmp, final)
    elif not _renameat2(tmp, final, _RENAME_EXCHANGE):  # tmp now holds what final was
        old = final.with_name(final.name + ".old")
        remove_dir(old, kind)
        os.rename(final, old)
        os.rename(tmp, final)
        tmp = old
    if sync or replacing:
        sync_dir(final.parent)
    if replacing:
        remove_dir(tmp, kind)


# -- files ---------------------------------------------------------------------------------------------------
def check_output(path: str | os.PathLike, what: str, *, folder: bool = False) -> None:
    """Refuse, in one line (ValueError), an output path hf3d could not write at the end of its work, before the
    work: a link in its place, a folder where a file goes (`folder`: a file where a folder goes), a file where a
    folder above it must be, or a nearest existing folder above it that this user may not write into."""
    path = Path(path)
    refuse_link(path)
    if os.path.lexists(path) and folder != path.is_dir():
        want, found = ("a folder", "a file") if folder else ("a file", "a folder or not a regular file")
        raise ValueError(f"{what} {path} is {found}: give the path of {want}")
    problem = _cannot_create(path, inside=folder)
    if problem is not None:
        raise ValueError(f"{what} {problem}: choose another path")


def _cannot_create(path: Path, *, inside: bool = False) -> str | None:
    """Why hf3d could not create `path` (or, `inside`, files in the folder `path` when it exists), in a few words
    naming it: it lies under a file, or this user may not write where it goes; else None."""
    above = next(p for p in path.absolute().parents if os.path.lexists(p) or p == p.parent)
    if not above.is_dir():
        return f"{path} lies under {above}, which is a file"
    into = path if inside and os.path.lexists(path) else above  # where the files are created
    if not os.access(into, os.W_OK | os.X_OK):
        return f"{path}: this user may not write into {into}"
    return None


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


def open_read(path: str | os.PathLike) -> BinaryIO:
    """The regular file `path` open for binary reading, never through a link: a link (or anything but a
    regular file) in its place is refused in one line (ValueError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a link; hf3d reads no file of a checkpoint through a link") from None
        raise
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ValueError(f"{path} is not a regular file")
    return f


def remove_file(path: str | os.PathLike) -> None:
    """Delete a regular file hf3d wrote in a folder of its own (a probe, a raw token file); a link or anything
    else there is refused."""
    path = Path(path)
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError(f"{path} is not a regular file; hf3d deletes only files it wrote")
    path.unlink()
