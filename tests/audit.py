"""A run-time guard over the suite's flows: what hf3d deletes, renames, writes and unpickles, as it happens.

The scans of tests/test_untrusted_files.py read names in the source, so an alias passes them
(`getattr(shutil, "rmtree")`, `import pickle as pk`). This module records the audit events Python raises for
the act itself (`sys.addaudithook`), whatever the name it was called by, and attributes each to the code that
asked for it: the innermost frame outside the standard library (os, shutil, pathlib and pickle raise the events
on their callers' behalf). What it refuses:

- `os.remove`, `os.rmdir`, `os.rename` (also os.replace), `shutil.rmtree`, `os.truncate` asked for by a module of
  hf3d/ other than hf3d/utils/files.py;
- a file opened for writing by hf3d/ that could follow a link or truncate a file of the user's: anything but
  O_CREAT | O_EXCL (a new file; such an open does not follow links), or, in hf3d/utils/files.py, O_NOFOLLOW;
- a path (not a file object) handed by hf3d/ to a writer that takes either (torch.save, numpy, matplotlib;
  torch.save opens a path in C++, so its openers raise the event here: `_audit_torch_paths`);
- `pickle.find_class` while hf3d/ is on the stack: hf3d's one unpickler (AllowListUnpickler) resolves its names
  itself and raises no such event, so any event is another unpickler at work (torch.load without
  weights_only, numpy's allow_pickle, a plain pickle.load) - but for torch's own (the objects its collectives
  send between ranks, and inductor's compile cache) and the checkpoint writer's (what its parent sends it
  through their pipe, PICKLES_ALLOWED);
- a program started, or a C library or symbol loaded, by hf3d/ (`subprocess`, `os.system`, `os.exec*`,
  `os.posix_spawn`, `ctypes`): refused outright, but for those hf3d makes (SPAWNS_ALLOWED): the checkpoint
  writer process, and libc's prctl (faults.die_with_parent), sync_file_range (checksums) and renameat2 (files).

An audit hook cannot be removed: `install` adds one per process, which records only while `watching` is on. The
suite's conftest turns it on around every test and fails the test on what it recorded. Every other Python
process started while the suite runs watches too, appending to the file named by HF3D_AUDIT_LOG: the conftest
puts a `.pth` line into site-packages for the session (`START_LINE`), which runs this file in any process whose
environment names it (HF3D_AUDIT_FILE): `python -m hf3d` commands, torchrun's workers, the checkpoint writer
(started with `python -I`, which ignores PYTHONPATH but not site-packages) and the gloo workers of tests/dist.py.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "hf3d") + os.sep
FILES_MODULE = str(ROOT / "hf3d" / "utils" / "files.py")
LOG_ENV = "HF3D_AUDIT_LOG"

_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = str(Path(sysconfig.get_paths()["purelib"]).resolve()) + os.sep
_PATH_WRITERS = tuple(_SITE + p for p in ("torch/serialization.py", "numpy/", "matplotlib/"))
# torch's own pickles: the objects its collectives send between ranks, and inductor's compile cache
_TORCH_OWN = tuple(_SITE + p for p in ("torch/distributed/", "torch/_inductor/"))
_DELETES = {"os.remove", "os.rmdir", "os.rename", "shutil.rmtree", "os.truncate"}
_SPAWNS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "pty.spawn"}
_LOADS = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"}
SPAWNS_ALLOWED = {  # hf3d file: what it may start or load (the writer; libc's prctl, sync_file_range, renameat2)
    "hf3d/checkpoint/writer_process.py": {"subprocess.Popen"},
    "hf3d/utils/faults.py": {"ctypes.dlopen", "ctypes.dlsym:prctl"},
    "hf3d/checkpoint/checksums.py": {"ctypes.dlopen", "ctypes.dlsym:sync_file_range"},
    "hf3d/utils/files.py": {"ctypes.dlopen", "ctypes.dlsym:renameat2"},
}
PICKLES_ALLOWED = ("hf3d/checkpoint/writer_process.py:",)  # the writer's pipe from the process that started it
FILE_ENV = "HF3D_AUDIT_FILE"
START_LINE = (
    f'import os; p = os.environ.get("{FILE_ENV}"); '
    'p and os.path.isfile(p) and __import__("runpy").run_path(p, run_name="hf3d_audit_start")\n'
)
"""The .pth line that watches a process started while the suite runs (site runs .pth lines beginning `import`)."""
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_EXCLUSIVE = os.O_CREAT | os.O_EXCL

watching = False
"""Whether the hook records (the conftest turns it on for the session)."""
found: list[str] = []
"""What the hook recorded in this process, one line each."""
_kinds: dict[str, str] = {}


def _kind(filename: str) -> str:
    """The kind of code in `filename`: stdlib, hf3d, files (utils/files.py), path writer, torch's own, audit, other."""
    kind = _kinds.get(filename)
    if kind is None:
        path = filename if filename.startswith("<") else os.path.realpath(filename)
        if path == FILES_MODULE:
            kind = "files"
        elif path.startswith(PACKAGE):
            kind = "hf3d"
        elif path == os.path.realpath(__file__):
            kind = "audit"
        elif path.startswith("<") or path.startswith(_STDLIB) and not path.startswith(_SITE):
            kind = "stdlib"
        elif path.startswith(_PATH_WRITERS):
            kind = "path writer"
        elif path.startswith(_TORCH_OWN):
            kind = "torch's own"
        else:
            kind = "other"
        _kinds[filename] = kind
    return kind


def _stack() -> list[tuple[str, str, int]]:
    """(kind, file, line) of the frames that led to the event, innermost first, the standard library's and this
    module's left out."""
    frames, f = [], sys._getframe(0)
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind not in ("stdlib", "audit"):
            frames.append((kind, f.f_code.co_filename, f.f_lineno))
        f = f.f_back
    return frames


def _where(frame: tuple[str, str, int]) -> str:
    return f"{os.path.relpath(frame[1], ROOT)}:{frame[2]}"


def _verdict(event: str, args: tuple) -> str | None:
    """What is wrong with this event, or None."""
    if event in _DELETES:
        if isinstance(args[0], int):  # os.ftruncate of a file this process opened (that open was judged)
            return None
        if _in_frame("_write_atomic", "importlib"):  # Python caching the bytecode of a module hf3d imports
            return None
        stack = _stack()
        if stack and stack[0][0] == "hf3d":
            return f"{event}{args[:2]} from {_where(stack[0])}, outside hf3d/utils/files.py"
        return None
    if event == "open":
        path, _, flags = args
        if not isinstance(path, str | bytes | os.PathLike) or not flags & _WRITE or path == os.devnull:
            return None
        stack = _stack()
        if not stack:
            return None
        kind = stack[0][0]
        if kind == "files" and flags & os.O_NOFOLLOW or kind in ("hf3d", "files") and flags & _EXCLUSIVE == _EXCLUSIVE:
            return None
        if kind in ("hf3d", "files"):
            return f"open({os.fspath(path)!r}, flags {flags:#o}) from {_where(stack[0])}: follows a link or truncates"
        asker = next((frame for frame in stack if frame[0] != "path writer"), None)
        if kind == "path writer" and asker is not None and asker[0] in ("hf3d", "files"):
            return f"a path handed to {_where(stack[0])} by {_where(asker)}: {os.fspath(path)!r} (use files.new_file)"
        return None
    if event in _SPAWNS or event in _LOADS:
        return _spawn_verdict(event, args)
    if event == "pickle.find_class":
        stack = _stack()
        asker = next((frame for frame in stack if frame[0] in ("hf3d", "files")), None)
        if asker is not None and _where(asker).startswith(PICKLES_ALLOWED):
            return None
        if asker is not None and stack[0][0] != "torch's own":
            return f"pickle.find_class{args} under {_where(asker)} (innermost: {_where(stack[0])})"
    return None


def _in_frame(function: str, file_part: str) -> bool:
    """Whether a frame of `function`, in a file whose name holds `file_part`, is on this thread's stack."""
    f = sys._getframe(0)
    while f is not None:
        if f.f_code.co_name == function and file_part in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _importing(package: str) -> bool:
    """Whether the standard library's `package` is being imported (its __init__ runs) on this thread's stack."""
    f = sys._getframe(0)
    while f is not None:
        if f.f_code.co_name == "<module>" and f.f_code.co_filename.endswith(os.path.join(package, "__init__.py")):
            return True
        f = f.f_back
    return False


def _spawn_verdict(event: str, args: tuple) -> str | None:
    """A program started or a C library or symbol loaded by hf3d/ that SPAWNS_ALLOWED does not name."""
    if event == "ctypes.dlopen" and _importing("ctypes"):  # ctypes' own pythonapi, as it is first imported
        return None
    stack = _stack()
    if not stack or stack[0][0] not in ("hf3d", "files"):
        return None
    what = f"{event}:{args[1]}" if event.startswith("ctypes.dlsym") and len(args) > 1 else event
    if what in SPAWNS_ALLOWED.get(os.path.relpath(os.path.realpath(stack[0][1]), ROOT), ()):
        return None
    shown = args[:2] if event != "ctypes.dlsym" else args[1:2]
    return f"{what}{tuple(map(str, shown))} from {_where(stack[0])}: hf3d starts no program and loads no C code"


def _hook(event: str, args: tuple) -> None:
    if event == "import" and not _torch_audited and "torch.serialization" in sys.modules:
        _audit_torch_paths()  # as soon as torch.serialization is there (not imported here: it costs seconds)
    if not watching or event not in _EVENTS:
        return
    problem = _verdict(event, args)
    if problem is not None:
        found.append(problem)
        if _log_fd is not None:  # os.write raises no event; one write per line, appended (the ranks share it)
            os.write(_log_fd, (problem.replace("\n", " ") + "\n").encode())


_EVENTS = {*_DELETES, *_SPAWNS, *_LOADS, "open", "pickle.find_class"}
_installed = False
_torch_audited = False
_log_fd: int | None = None


def _audit_torch_paths() -> None:
    """torch.save given a path opens it in C++ (torch._C.PyTorchFileWriter), which raises no audit event: its two
    openers of a path, looked up in torch.serialization at every save whatever name hf3d calls torch.save by,
    raise one ("open", like Python's own)."""
    global _torch_audited
    ts = sys.modules.get("torch.serialization")
    if ts is None or not hasattr(ts, "_open_file") or not hasattr(ts, "_open_zipfile_writer_file"):
        return  # not imported yet, or still being imported
    _torch_audited = True

    def audited(cls, mode_of):
        init = cls.__init__

        def __init__(self, name, *args, **kwargs):
            mode = mode_of(args, kwargs)
            if "w" in mode or "a" in mode:
                sys.audit("open", name, mode, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            init(self, name, *args, **kwargs)

        cls.__init__ = __init__

    audited(ts._open_zipfile_writer_file, lambda args, kwargs: "wb")
    audited(ts._open_file, lambda args, kwargs: args[0] if args else kwargs.get("mode", ""))


def install(log: str | None = None) -> None:
    """Add the hook to this process (once); `log`: a file that every problem is also appended to."""
    global _installed, _log_fd
    if log is not None and _log_fd is None:
        _log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if not _installed and not getattr(sys, "hf3d_audit_installed", False):  # one hook a process, however loaded
        _audit_torch_paths()
        sys.addaudithook(_hook)
        _installed = sys.hf3d_audit_installed = True


def watch_in_worker() -> None:
    """In a gloo worker of tests/dist.py: install and watch when the test that started it watches."""
    global watching
    log = os.environ.get(LOG_ENV)
    if log:
        install(log)
        watching = True


if __name__ == "hf3d_audit_start":  # run by START_LINE at the start of a process of the suite's
    watch_in_worker()
