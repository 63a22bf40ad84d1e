"""Untrusted files stay data: the classes of the reviews (issues 39 and 47), each closed by one rule and checked here.

The guard of every class runs at run time too: tests/audit.py records, over the whole suite (its save, load,
convert, export and push flows, in this process and in the gloo workers), every deletion, rename, file write
and unpickling that hf3d asks for, whatever name it calls them by, and fails the test that made one outside
the module allowed to. The scans below read the source for the same calls, on paths no test runs.

1. Nothing is unpickled beyond torch.load(weights_only=True) and the allow-list reader, whose two tables hold
   exactly the names listed here; a crafted checkpoint whose .metadata declares a weight as DCP bytes (which
   DCP's load planner torch.loads with weights_only=False), and a token cache of Python objects, are refused in
   one line with nothing run. The checkpoint writer process imports nothing from the working directory.
2. hf3d deletes, renames and replaces only folders of the kind it writes that it made there, holding only the
   files it wrote (hf3d/utils/files.py): a user's folder, a foreign PATH.tmp or PATH.old, a copy, a move, an
   export under a checkpoint's path and a checkpoint with a user's notes are refused; a copy from another run
   is neither resumed from silently nor rotated.
3. Files written into shared folders never follow a link (the push's card through a dangling README.md link),
   and a card holds one line per value.
4. Rotation keeps the checkpoint just published and what resume would choose, by the order of the saves.
5. A published checkpoint is durable before anything older goes (recorded through save_checkpoint), and a
   kill at any instant of a publish or a rotation leaves whole checkpoints, or leftovers the next start removes.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hf3d without an install
sys.path.insert(0, str(ROOT / "tests"))

from crafted import fake_checkpoint, global_pickle, reseal, torch_archive, write_crafted  # noqa: E402
from dist import report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402

from hf3d import checkpoint  # noqa: E402
from hf3d.checkpoint import entries  # noqa: E402
from hf3d.utils import files  # noqa: E402

PACKAGE = ROOT / "hf3d"


# -- the scans ------------------------------------------------------------------------------------------------
def _calls(path: Path):
    """(line, dotted name of the callee, the call node) of every call in the module at `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node.lineno, ast.unparse(node.func), node


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


# the one reader that unpickles anything: AllowListUnpickler (hf3d/checkpoint/stored.py), which resolves only listed
# (module, name) pairs to objects hf3d imported itself; tests/test_convert.py and tests/test_checkpoint.py feed it
# crafted payloads through every allowed module
ALLOW_LIST_READER = ("checkpoint/stored.py", "AllowListUnpickler")


def test_nothing_in_hf3d_unpickles_beyond_weights_only_and_the_allow_list_reader():
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        source = path.read_text()
        for lineno, name, call in _calls(path):
            where = f"{rel}:{lineno} {name}"
            if name.endswith("torch.load") or name == "load" and "from torch import load" in source:
                weights_only = _keyword(call, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where}: torch.load without weights_only=True")
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler") or name.endswith("._pickle.load"):
                found.append(f"{where}: a plain unpickler")
            if (
                name == "AllowListUnpickler"
                and rel != ALLOW_LIST_READER[0]
                and "_METADATA_GLOBALS" not in ast.unparse(call)
            ):
                found.append(f"{where}: AllowListUnpickler with another table than hf3d's")
            if name.endswith("dcp.load") and "SafeReader" not in ast.unparse(_keyword(call, "storage_reader") or call):
                found.append(f"{where}: dcp.load without hf3d's SafeReader")
            weights_only = _keyword(call, "weights_only")
            if isinstance(weights_only, ast.Constant) and weights_only.value is False:
                found.append(f"{where}: weights_only=False")
            pickles = _keyword(call, "allow_pickle")
            if pickles is not None and not (isinstance(pickles, ast.Constant) and pickles.value is False):
                found.append(f"{where}: allow_pickle (numpy unpickles object arrays)")
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith("Unpickler") for b in bases) and (rel, node.name) != ALLOW_LIST_READER:
                    found.append(f"{rel}:{node.lineno} class {node.name}({', '.join(bases)}): another unpickler")
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                # DCP's load planner torch.loads byte entries (weights_only=False), its reader unpickles .metadata
                if any(b.endswith("LoadPlanner") for b in bases) and "load_bytes" not in methods:
                    found.append(f"{rel}:{node.lineno} {node.name} inherits DCP's load_bytes")
                if any(b.endswith(("FileSystemReader", "StorageReader")) for b in bases):
                    for method in {"read_metadata", "read_data"} - methods:
                        found.append(f"{rel}:{node.lineno} {node.name} inherits DCP's {method}")
    assert not found, "\n".join(found)


def test_the_allow_lists_hold_exactly_these_names():
    """The (module, name) pairs the two allow-list readers resolve, listed here one by one: a pair added to either
    (`("builtins", "eval")`) fails this test, whatever the code that adds it looks like."""
    from collections import OrderedDict
    from pathlib import PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

    from torch.distributed.checkpoint import filesystem, metadata

    from hf3d.checkpoint import reader, stored

    paths = {("pathlib", c.__name__): c for c in (PosixPath, PurePosixPath, WindowsPath, PureWindowsPath)}
    if sys.version_info >= (3, 13):  # pickled under pathlib._local there
        paths.update({("pathlib._local", c.__name__): c for _, c in paths.items()})
    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties")
    expected = {
        **{("torch.distributed.checkpoint.metadata", n): getattr(metadata, n) for n in names},
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"): metadata.MetadataIndex,
        ("torch.distributed.checkpoint.metadata", "StorageMeta"): metadata.StorageMeta,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): metadata._MEM_FORMAT_ENCODING,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): OrderedDict,
        **paths,
    }
    expected |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}  # torch.float32, ...
    table = reader._METADATA_GLOBALS
    assert set(table) == set(expected), set(table) ^ set(expected)
    assert all(table[k] is v for k, v in expected.items()), "an allowed name resolves to another object"
    layout = stored._LAYOUT_GLOBALS
    plain = {
        ("torch._utils", "_rebuild_tensor_v2"): stored._rebuilt_layout,
        ("torch._utils", "_rebuild_tensor_v3"): stored._rebuilt_layout,
        ("collections", "OrderedDict"): dict,
    }
    storages = {k for k in layout if k[0] in ("torch", "torch.storage") and k[1].endswith("Storage")}
    assert all(layout[k] == k[1] for k in storages), "a storage name resolves to more than its own name"
    dtypes = {k: v for k, v in expected.items() if isinstance(v, torch.dtype)}
    assert {k: v for k, v in layout.items() if k not in storages} == plain | dtypes


_DELETE_OR_MOVE = {"shutil.rmtree", "os.remove", "os.unlink", "os.rmdir", "os.rename", "os.replace", "os.renames"}
_DELETE_OR_MOVE |= {"os.removedirs", "shutil.move", "os.truncate"}
_WRITE = {"shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.copytree"}


def _mode(call: ast.Call) -> str | None:
    mode = call.args[1] if len(call.args) > 1 else _keyword(call, "mode")
    return mode.value if isinstance(mode, ast.Constant) else None


def test_deleting_renaming_and_writing_files_goes_through_hf3d_files():
    """Outside hf3d/utils/files.py nothing in hf3d/ deletes, renames or replaces a path, and a file is created only
    exclusively (open(..., "x"), O_EXCL | O_NOFOLLOW): no write follows a link or lands on a file hf3d did not
    make. torch.save, numpy and matplotlib write into file objects from files.new_file; the writers of other
    libraries (config.save_pretrained, DCP's .metadata) write only into a staging folder files.make_dir just
    made."""
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "utils/files.py":
            continue
        for lineno, name, call in _calls(path):
            where = f"{rel}:{lineno} {name}"
            method = name.rsplit(".", 1)[-1]
            if name in _DELETE_OR_MOVE or name in _WRITE:
                found.append(where)
            elif method in ("unlink", "rmdir", "touch", "write_text", "write_bytes", "symlink_to", "hardlink_to"):
                found.append(where)
            elif method in ("rename", "replace") and len(call.args) == 1 and not call.keywords:  # Path's
                found.append(where)
            elif name in ("open", "io.open") or name.endswith(".open") and name != "os.open":
                mode = _mode(call)
                if mode is not None and any(c in mode for c in "wa+") and not name.startswith(("tarfile", "zipfile")):
                    found.append(f"{where} mode {mode!r}")
            elif name == "os.open":
                flags = ast.unparse(call.args[1])
                if "O_CREAT" in flags and not ("O_EXCL" in flags and "O_NOFOLLOW" in flags):
                    found.append(f"{where} {flags}")
            elif method in ("save", "savefig") and name.split(".")[0] in ("torch", "np", "numpy", "fig"):
                target = call.args[1] if name.startswith("torch") else call.args[0]
                if not isinstance(target, ast.Name):  # a path expression, not a file object
                    found.append(f"{where} into {ast.unparse(target)}")
    assert not found, "calls outside hf3d/utils/files.py:\n" + "\n".join(found)


PLANTED = """
import ctypes, os, subprocess
subprocess.run(["true"])
os.system("true")
ctypes.CDLL(None).getpid()
"""
SPAWNED = ["subprocess.Popen", "os.system", "ctypes.dlopen", "ctypes.dlsym:getpid"]


def test_the_audit_refuses_programs_and_c_code_started_by_hf3d_in_every_process_the_suite_starts(tmp_path):
    """Code whose frames are hf3d's starting a program (subprocess, os.system) or loading C code (ctypes) is
    refused by the audit (tests/audit.py), in this process and in a `python -I` process the suite starts (the
    .pth line of the conftest), as in the writer, torchrun's workers and `python -m hf3d`. The code is compiled
    as hf3d/planted.py (no such file is made): the mutations `subprocess rm -rf` and `os.system('rm -rf')` in a
    cleanup of hf3d's are this."""
    import subprocess

    import audit

    code = compile(PLANTED, str(PACKAGE / "planted.py"), "exec")
    before = len(audit.found)
    exec(code, {})
    planted = audit.found[before:]
    del audit.found[before:]  # seen: not this test's failure
    assert [line.split("(")[0] for line in planted] == SPAWNED
    assert all("from hf3d/planted.py:" in line and "hf3d starts no program" in line for line in planted)
    log = tmp_path / "audit.log"
    child = f"exec(compile({PLANTED!r}, {str(PACKAGE / 'planted.py')!r}, 'exec'), {{}})"
    env = {**os.environ, audit.LOG_ENV: str(log)}
    subprocess.run([sys.executable, "-I", "-c", child], env=env, check=True, capture_output=True)
    assert [line.split("(")[0] for line in log.read_text().splitlines()] == SPAWNED


def test_the_writer_process_imports_nothing_from_the_working_directory_nor_pythonpath(tmp_path, monkeypatch):
    """Modules named as numpy, torch and hf3d in the folder the user launches from and on PYTHONPATH: the checkpoint
    writer process (started with `python -I`, hf3d imported from the parent's package folder) runs none of them."""
    from hf3d.checkpoint.writer_process import WriterProcess

    sentinel = tmp_path / "planted-code-ran"
    plant = f"open({str(sentinel)!r}, 'a').write(__name__ + '\\n')\n"
    for folder in (tmp_path / "cwd", tmp_path / "pythonpath"):
        (folder / "hf3d").mkdir(parents=True)
        for name in ("numpy.py", "torch.py", "hf3d/__init__.py"):
            (folder / name).write_text(plant)
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pythonpath"))
    writer = WriterProcess()
    writer.conn.close()  # the child ends once its imports are done and it reads the end of its connection
    code = writer.child.wait(timeout=120)  # (close() kills a child still busy after 5 s: a loaded machine)
    writer.close()
    assert code == 0 and not sentinel.exists(), sentinel.read_text() if sentinel.exists() else code


# -- 1. a checkpoint whose .metadata declares a weight as bytes ----------------------------------------------
def _bytes_entry(ckpt: Path, sentinel: Path) -> str:
    """Make one weight of the checkpoint a DCP byte entry whose bytes are a pickle that creates `sentinel` when
    torch.load(weights_only=False) reads them (DCP's DefaultLoadPlanner.load_bytes); the marker resealed.
    Returns the entry's key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = checkpoint.SafeReader(ckpt).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if k.endswith("layers.0.mlp.down_proj.weight"))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    payload = global_pickle("os", "system", f"touch {sentinel}")
    (ckpt / "__crafted.distcp").write_bytes(payload)
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__crafted.distcp", 0, len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(ckpt)
    return key


def _load_crafted(ckpt: str, model_dir: str, out: str) -> None:
    import hf3d

    start_watchdog(120)
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    try:
        hf3d.load_checkpoint(ckpt, pm, hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3))
        report({"error": None}, Path(out))
    except ValueError as e:
        report({"error": str(e)}, Path(out))


def test_a_bytes_entry_is_refused_when_the_metadata_is_read_and_runs_nothing(tmp_path, capsys):
    from hf3d.checkpoint.convert import hf_to_checkpoint
    from hf3d.cli import main as cli_main

    model_dir = make_model_dir(tmp_path / "llama", "llama")
    ckpt = hf_to_checkpoint(model_dir, tmp_path / "ckpt")
    sentinel = tmp_path / "code-ran"
    key = _bytes_entry(ckpt, sentinel)
    spawn(_load_crafted, 1, str(ckpt), str(model_dir), str(tmp_path / "res.pt"))
    error = torch.load(tmp_path / "res.pt")[0]["error"]
    want = f"{ckpt}/.metadata declares the entry {key!r} as BytesStorageMetadata, not a tensor"
    assert error is not None and error.startswith(want) and "\n" not in error, error
    assert not sentinel.exists()
    capsys.readouterr()
    assert cli_main(["convert", "to-hf", str(ckpt), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf3d convert: error: {want}") and "\n" not in err and "Traceback" not in err, err
    assert not sentinel.exists() and not (tmp_path / "hf").exists()


class _RunsCode:
    """Pickles as a call of os.system: what a crafted object array holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_token_cache_holding_python_objects_is_refused_and_never_unpickled(tmp_path):
    """A token cache whose tokens.npy was replaced by an array of Python objects (a pickle that runs a command):
    the pipeline refuses it in one line, naming the folder, and nothing is unpickled (the arrays are memory maps)."""
    import numpy as np
    from transformers import AutoTokenizer

    from hf3d.data import DataConfig, DataPipeline

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(20)))
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer")
    cfg = DataConfig(path=str(tmp_path / "docs.jsonl"), seq_len=16, cache_dir=str(tmp_path / "cache"))
    kw = dict(global_batch=2, dp_rank=0, dp_size=1, total_steps=2)
    DataPipeline(cfg, tokenizer, **kw)
    (tokens,) = (tmp_path / "cache").rglob("tokens.npy")
    sentinel = tmp_path / "code-ran"
    tokens.unlink()
    with open(tokens, "wb") as f:
        np.save(f, np.array([_RunsCode(f"touch {sentinel}")], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError) as refused:
        DataPipeline(cfg, tokenizer, **kw)
    assert str(refused.value).startswith(f"data source 'docs': {tokens.parent} holds token files hf3d did not write")
    assert "\n" not in str(refused.value) and not sentinel.exists()


def test_the_load_planner_never_unpickles_bytes():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("model/x"), [], MetadataIndex("model/x"), [], [])
    with pytest.raises(ValueError, match="'model/x' is bytes; hf3d never unpickles one"):
        entries.LoadPlanner().load_bytes(item, __import__("io").BytesIO(global_pickle("os", "getpid")))


# -- 2. only folders hf3d made are deleted or replaced ---------------------------------------------------------
def _user_folder(path: Path) -> Path:
    (path / "src").mkdir(parents=True)
    (path / "src" / "thesis.tex").write_text("\\section{Years of work}\n")
    return path


def _tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _save_into_foreign_folders(model_dir: str, root: str, out: str) -> None:
    import hf3d

    start_watchdog(120)
    root, res = Path(root), {}
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    for name, path in [
        ("folder", root / "thesis"),  # a user's folder at PATH
        ("staging", root / "ckpt"),  # a user's folder at PATH.tmp
        ("export", root / "stock-export"),  # a stock save_pretrained folder: model files only, not hf3d's
    ]:
        try:
            if name == "export":
                pm.save_pretrained(path)
            else:
                hf3d.save_checkpoint(path, pm, opt, step=1)
            res[name] = None
        except ValueError as e:
            res[name] = str(e)
    hf3d.save_checkpoint(root / "mine", pm, opt, step=1)
    hf3d.save_checkpoint(root / "mine", pm, opt, step=2)  # hf3d's own checkpoint: replaced
    res["mine"] = checkpoint.read_marker(root / "mine")["step"]
    real = files._renameat2  # a file system without renameat2: the replaced folder is first moved to PATH.old
    files._renameat2 = lambda src, dst, flags: False
    try:
        hf3d.save_checkpoint(root / "mine", pm, opt, step=3)
        res["old"] = None
    except ValueError as e:
        res["old"] = str(e)
    files._renameat2 = real
    res["kept"] = checkpoint.read_marker(root / "mine")["step"]
    # hf3d's own checkpoint with a user's notes in it; a copy of hf3d's checkpoint; an export of hf3d's
    (root / "mine" / "NOTES.md").write_text("what step 2 showed\n")
    (root / "mine" / "analysis").mkdir()
    (root / "mine" / "analysis" / "probe_results.csv").write_text("layer,score\n")
    shutil.copytree(root / "mine", root / "copy", ignore=shutil.ignore_patterns("NOTES.md", "analysis"))
    pm.save_pretrained(root / "final")
    for name, path in [("annotated", root / "mine"), ("copy", root / "copy"), ("over-export", root / "final")]:
        try:
            hf3d.save_checkpoint(path, pm, opt, step=4)
            res[name] = None
        except ValueError as e:
            res[name] = str(e)
    try:
        pm.save_pretrained(root / "mine")  # and an export never replaces a checkpoint
        res["export-over"] = None
    except ValueError as e:
        res["export-over"] = str(e)
    report(res, Path(out))


def test_no_writer_deletes_or_replaces_a_folder_hf3d_did_not_make(tmp_path, capsys):
    from hf3d.cli import main as cli_main

    model_dir = make_model_dir(tmp_path / "llama", "llama")
    root = tmp_path / "out"
    foreign = {
        "thesis": _user_folder(root / "thesis"),
        "ckpt.tmp": _user_folder(root / "ckpt.tmp"),
        "stock-export": make_model_dir(root / "stock-export", "llama", seed=1),
        "mine.old": _user_folder(root / "mine.old"),
        "from-hf": _user_folder(root / "from-hf"),
        "from-hf.tmp": _user_folder(root / "from-hf.tmp"),
    }
    before = {name: _tree(path) for name, path in foreign.items()}
    spawn(_save_into_foreign_folders, 1, str(model_dir), str(root), str(tmp_path / "res.pt"))
    res = torch.load(tmp_path / "res.pt")[0]
    for name, path in [("folder", root / "thesis"), ("staging", root / "ckpt.tmp"), ("export", root / "stock-export")]:
        assert res[name] == (
            f"{path} is a folder hf3d did not make (it has no {files.OWNER_FILE}); hf3d never deletes or replaces "
            "it: move it away or choose a new output path"
        ), (name, res[name])
    assert res["mine"] == 2 and res["kept"] == 2
    mine, tail = root / "mine", "hf3d never deletes or replaces it: move it away or choose a new output path"
    assert res["annotated"] == f"{mine} holds 'NOTES.md', which hf3d does not write there; {tail}", res["annotated"]
    assert res["copy"] == (
        f"{root / 'copy'} is a copy or a move of a folder hf3d made elsewhere (its {files.OWNER_FILE} names another "
        f"folder); {tail}"
    ), res["copy"]
    assert (
        res["over-export"] == f"{root / 'final'} is an hf3d folder of another kind (export, not checkpoint); {tail}"
    ), res["over-export"]
    assert res["export-over"] == f"{mine} is an hf3d folder of another kind (checkpoint, not export); {tail}", res[
        "export-over"
    ]
    assert (mine / "NOTES.md").is_file() and (mine / "analysis" / "probe_results.csv").is_file()
    assert checkpoint.read_marker(mine)["step"] == 2 and checkpoint.read_marker(root / "copy")["step"] == 2
    assert (root / "final" / "model.safetensors").is_file()
    assert res["old"].startswith(f"could not write the checkpoint {root / 'mine'} (") and "\n" not in res["old"]
    assert f"{root / 'mine.old'} is a folder hf3d did not make" in res["old"]
    for argv in (["from-hf", str(model_dir), str(root / "from-hf")], ["from-hf", str(model_dir), str(root / "x")]):
        if argv[-1].endswith("x"):  # the output is new, but its staging path is a user's folder
            foreign["x.tmp"] = _user_folder(root / "x.tmp")
            before["x.tmp"] = _tree(root / "x.tmp")
        assert cli_main(["convert", *argv]) == 1
        assert "is a folder hf3d did not make" in capsys.readouterr().err
    assert {name: _tree(path) for name, path in foreign.items()} == before  # nothing deleted or changed
    assert not (root / "x").exists() and not (root / "thesis.tmp").exists()


def test_a_folder_is_hf3ds_only_with_its_own_owner_file(tmp_path):
    made = files.make_dir(tmp_path / "made", checkpoint.CHECKPOINT)
    assert files.owned(made) and json.loads((made / files.OWNER_FILE).read_text())["made_by"] == "hf3d"
    link = tmp_path / "link"
    link.symlink_to(made, target_is_directory=True)
    linked_marker = _user_folder(tmp_path / "linked-marker")
    (linked_marker / files.OWNER_FILE).symlink_to(made / files.OWNER_FILE)
    wrong = _user_folder(tmp_path / "wrong")
    (wrong / files.OWNER_FILE).write_text('{"made_by": "someone"}')
    for path in (link, linked_marker, wrong):
        assert not files.owned(path)
        with pytest.raises(ValueError, match="hf3d never deletes or replaces it"):
            files.remove_dir(path, checkpoint.CHECKPOINT)
    assert link.is_symlink() and (wrong / "src" / "thesis.tex").exists() and made.is_dir()
    (tmp_path / "empty").mkdir()
    files.remove_dir(tmp_path / "empty", checkpoint.CHECKPOINT)  # an empty folder loses nothing
    assert not (tmp_path / "empty").exists()


def test_no_file_of_a_checkpoint_is_read_through_a_link(tmp_path):
    """Past find_damage's look (a link swapped in after it, or a marker that lists no files), the readers themselves
    open each file of a checkpoint without following a link: the marker, the .metadata, a data file, the RNG and
    extra files, and the checksum pass."""
    from hf3d.checkpoint import load
    from hf3d.checkpoint.checksums import crc32_file
    from hf3d.checkpoint.convert import hf_to_checkpoint

    ckpt = hf_to_checkpoint(make_model_dir(tmp_path / "llama", "llama"), tmp_path / "ckpt")
    other = tmp_path / "elsewhere"
    other.mkdir()
    for name in (checkpoint.MARKER, ".metadata", "__0_0.distcp", "extra.pt"):
        (other / name).write_bytes((ckpt / name).read_bytes() if (ckpt / name).exists() else b"")
        (ckpt / name).unlink(missing_ok=True)
        (ckpt / name).symlink_to(other / name)
    reads = [
        lambda: checkpoint.read_marker(ckpt),
        lambda: checkpoint.SafeReader(ckpt).read_metadata(),
        lambda: crc32_file(ckpt / "__0_0.distcp"),
        lambda: load._load(ckpt / "extra.pt"),
    ]
    for read in reads:
        with pytest.raises(ValueError, match="is a link; hf3d reads no file of a checkpoint through a link"):
            read()
    legacy = hf_to_checkpoint(tmp_path / "llama", tmp_path / "legacy")  # a marker that lists no files: verified
    meta = {k: v for k, v in checkpoint.read_marker(legacy).items() if k != "files"}
    (legacy / checkpoint.MARKER).write_text(json.dumps(meta))
    (legacy / "NOTES.md").write_text("mine")
    (legacy / "analysis").mkdir()
    assert checkpoint.find_damage(legacy, meta) is None  # the user's files are not the checkpoint's
    (legacy / "rng_0.pt").symlink_to(other / "extra.pt")
    assert checkpoint.find_damage(legacy, meta).startswith("rng_0.pt is a link or not a regular file")


# -- 3. no write through a link; a card holds one line per value ------------------------------------------
def test_the_push_writes_no_card_through_a_dangling_link_and_sends_nothing(tmp_path):
    from hf3d.hf.hub import HubError, push_to_hub

    model_dir = make_model_dir(tmp_path / "m", "llama")
    target = tmp_path / "elsewhere" / "created-by-the-card"
    (model_dir / "README.md").symlink_to(target)
    with pytest.raises(HubError, match=r"README.md is a link to .*created-by-the-card, which does not exist"):
        push_to_hub(model_dir, "user/m", token="hf_x", endpoint="http://127.0.0.1:9", retries=0)
    assert not target.exists() and not target.parent.exists()


def test_card_values_stay_on_one_line(tmp_path):
    from hf3d.hf.hub import write_model_card

    model_dir = make_model_dir(tmp_path / "m", "llama")
    summary = {
        "started_from": "run\n## Injected heading",
        "base_model": "org/model\n---\nlicense: none",
        "datasets": ["data.jsonl\n- [x](https://example.com)"],
        "hyperparameters": {"lr\n| fake | row |": "3e-4\r\n# Title"},
        "license": "mit\nextra: 1",
    }
    card = write_model_card(model_dir, summary).read_text()
    for value in ("## Injected heading", "---\nlicense: none", "- [x]", "| fake | row |", "# Title", "extra: 1"):
        assert not any(line.startswith(value.split("\n")[-1]) for line in card.splitlines()), (value, card)
    assert card.count("\n---\n") == 1  # the metadata block ends once
    with pytest.raises(FileExistsError):  # the card is a new file: an existing one is never overwritten
        write_model_card(model_dir, {})


def test_shared_files_are_never_written_through_links(tmp_path):
    from hf3d.train.metrics import MetricsWriter

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match="metrics.jsonl is a link; hf3d never writes through a link"):
        MetricsWriter(run, enabled=True)
    (run / "metrics.jsonl").unlink()
    writer = MetricsWriter(run, enabled=True)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        writer.write({"step": 1})
    assert victim.read_text() == "keep me"


# -- 4. rotation keeps the newest saves, the one just published first -------------------------------------
ROTATION_RUN = [
    "parallel.tp=1",
    "run.global_batch=2",
    "data.seq_len=32",
    "optim.warmup_steps=1",
    "data.eval.every=0",
    "run.save_final=false",
    "run.sample_prompt=null",
    "run.log_every=1000",
]


def _train_one(out: str, *overrides: str) -> None:
    from hf3d.train.trainer import TrainConfig, train

    start_watchdog(240)
    os.chdir(ROOT)
    overrides = [*ROTATION_RUN, f"run.output_dir={out}", *overrides]
    train(TrainConfig.from_yaml("examples/configs/tiny-smollm.yaml", overrides))


def test_rotation_after_resuming_past_a_damaged_checkpoint_keeps_the_save_it_made(tmp_path):
    """step_2 good, step_4 damaged: the resumed run starts at step_2, saves step_3 with keep_last=1, and that is
    what is left and what the next resume takes (the highest step number, step_4, is not the newest save)."""
    root = tmp_path / "checkpoints"
    spawn(_train_one, 1, str(tmp_path), "run.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0")
    largest = max((root / "step_4").iterdir(), key=lambda f: f.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    spawn(_train_one, 1, str(tmp_path), "run.steps=3", "checkpoint.every=1", "checkpoint.keep_last=1")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3"]
    assert (root / "latest").read_text() == "step_3\n"
    assert checkpoint.resolve_resume("auto", root) == root / "step_3"
    assert checkpoint.read_marker(root / "step_3")["sequence"] == 3  # step_2, step_4, then step_3


def test_rotation_and_resume_follow_the_order_of_the_saves(tmp_path):
    """A rollback (or load_step: false, or a save off the cadence) saves a lower step after higher ones: that
    save is the newest, `resume: auto` takes it, and keep_last keeps it and the newest others; a damaged
    checkpoint does not count as a kept one. Checkpoints of hf3d before it recorded a sequence are older."""
    root = tmp_path / "checkpoints"
    for step, sequence in [(2, None), (4, None), (6, 1), (8, 2)]:
        meta = {} if sequence is None else {"sequence": sequence}
        ckpt = fake_checkpoint(root / f"step_{step}", step, **meta)
        (ckpt / "__0_0.distcp").write_bytes(bytes(1000))
        checkpoint.write_marker(ckpt, checkpoint.read_marker(ckpt) | {"files": None})  # records the new file
    assert [d.name for _, d in checkpoint.step_dirs(root)] == ["step_2", "step_4", "step_6", "step_8"]
    os.truncate(root / "step_6" / "__0_0.distcp", 10)  # damaged
    assert checkpoint.next_sequence(root) == 3
    published = fake_checkpoint(root / "step_5", 5, sequence=checkpoint.next_sequence(root))  # rolled back
    assert checkpoint.resolve_resume("auto", root) == published
    checkpoint.finish_save(root, keep_last=3, published=published)
    assert (root / "latest").read_text() == "step_5\n"
    # kept: step_5 (just published), step_8 and step_4 (the newest undamaged others); step_6 (damaged) and
    # step_2 go
    assert [d.name for _, d in checkpoint.step_dirs(root)] == ["step_4", "step_8", "step_5"]
    checkpoint.finish_save(root, keep_last=1, published=published)
    assert [d.name for _, d in checkpoint.step_dirs(root)] == ["step_5"]


def _legacy(ckpt: Path) -> Path:
    """`ckpt` as an hf3d before identities wrote it: its owner file records the kind only."""
    (ckpt / files.OWNER_FILE).write_text(json.dumps({"made_by": "hf3d", "kind": "checkpoint"}) + "\n")
    return ckpt


def test_copies_moves_and_earlier_folders_are_never_resumed_from_silently_nor_rotated(tmp_path, capsys):
    """A colleague's step_50 (save number 99) copied into a run at step_100-step_120 (numbers 10-12): resume: auto
    takes step_120 and names the copy in one line; rotation never deletes it, nor a copy kept elsewhere, nor a
    folder of an earlier hf3d, nor one holding a user's notes, each said once; a copy or a move is not hf3d's
    anywhere."""
    root = tmp_path / "run" / "checkpoints"
    for step, sequence in [(100, 10), (110, 11), (120, 12)]:
        fake_checkpoint(root / f"step_{step}", step, sequence=sequence)
    colleague = fake_checkpoint(tmp_path / "colleague" / "step_50", 50, sequence=99)
    shutil.copytree(colleague, root / "step_50")
    kept = shutil.copytree(root / "step_110", tmp_path / "keep" / "best")
    assert [files.origin(p) for p in (root / "step_120", root / "step_50", kept)] == ["here", "elsewhere", "elsewhere"]
    capsys.readouterr()
    assert checkpoint.resolve_resume("auto", root) == root / "step_120"
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hf3d: warning: not resuming from {root / 'step_50'}, saved after step_120") and (
        "a copy or a move" in line and f"checkpoint.resume={root / 'step_50'}" in line
    ), line
    assert checkpoint.next_sequence(root) == 13  # the copy's number belongs to another run
    published = fake_checkpoint(root / "step_130", 130, sequence=13)
    (root / "step_120" / "NOTES.md").write_text("the loss spike\n")  # the user's notes in the run's own
    _legacy(fake_checkpoint(root / "step_90", 90, sequence=9))
    told: set[Path] = set()
    for _ in range(2):  # said once each, over two rotations
        checkpoint.finish_save(root, keep_last=1, published=published, told=told)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_120", "step_130", "step_50", "step_90"]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(x.startswith("hf3d: warning: checkpoint.keep_last keeps ") for x in lines), lines
    assert f"keeps {root / 'step_50'}: it is a copy or a move" in lines[0]  # newest save first
    assert f"keeps {root / 'step_120'}: {root / 'step_120'} holds 'NOTES.md', which hf3d does not write" in lines[1]
    assert f"keeps {root / 'step_90'}: an earlier hf3d wrote it without recording where" in lines[2]
    assert (root / "step_120" / "NOTES.md").is_file() and kept.is_dir() and colleague.is_dir()
    with pytest.raises(ValueError, match="is a copy or a move of a folder hf3d made elsewhere"):
        files.remove_dir(kept, checkpoint.CHECKPOINT)
    moved = tmp_path / "moved"
    os.rename(root / "step_130", moved)  # a move to another folder: the same inode, another parent
    assert files.origin(moved) == "elsewhere" and files.refusal(moved, checkpoint.CHECKPOINT) is not None
    # only copies and earlier folders left: the newest is taken, and one line says what it is
    shutil.rmtree(root / "step_120")
    assert checkpoint.resolve_resume("auto", root) == root / "step_50"
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hf3d: warning: resuming from {root / 'step_50'}, which is not this run's own save")


def test_a_run_moved_or_copied_as_a_whole_keeps_its_folders_and_a_dropped_in_one_stays_foreign(tmp_path, capsys):
    """A run folder (checkpoints step_4, step_8 and its export) copied with `cp -r` and moved with `mv`: in both,
    its folders are the run's own (resumed, replaced, rotated) before and after `claim_run` records the new
    place; a colleague's checkpoint dropped into the copy, a checkpoint copied inside a run that did not move,
    and one copied from the claimed copy back into the original (two runs now) stay foreign. A kill in the
    middle of a claim changes nothing `origin` reads."""
    from hf3d.hf.folders import EXPORT

    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    assert files.claim_run(run) is None and files.claim_run(run) is None  # a new run, then nothing to do
    root = run / "checkpoints"
    for step, sequence in [(4, 1), (8, 2)]:
        fake_checkpoint(root / f"step_{step}", step, sequence=sequence)
    files.make_dir(run / "final", EXPORT)
    other = tmp_path / "runs" / "b"
    other.mkdir()
    files.claim_run(other)
    colleague = fake_checkpoint(other / "checkpoints" / "step_12", 12, sequence=3)
    inside = shutil.copytree(root / "step_8", root / "step_9")
    assert files.origin(inside) == "elsewhere"  # the run did not move: a copy inside it is a copy
    shutil.rmtree(inside)

    copy = shutil.copytree(run, tmp_path / "forks" / "a", symlinks=True)
    dropped = shutil.copytree(colleague, copy / "checkpoints" / "step_12")
    ours = [copy / "checkpoints" / "step_4", copy / "checkpoints" / "step_8", copy / "final"]
    assert [files.origin(d) for d in ours + [dropped]] == ["here", "here", "here", "elsewhere"]
    assert files.refusal(copy / "final", EXPORT) is None
    capsys.readouterr()
    assert checkpoint.resolve_resume("auto", copy / "checkpoints") == ours[1]  # the dropped one is passed over
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hf3d: warning: not resuming from {dropped}, saved after step_8"), line

    def dying(path, data, **kw):  # a kill after the first owner file is recorded again
        if len(calls) == 1:
            raise KeyboardInterrupt
        calls.append(path)
        return write_file(path, data, **kw)

    calls, write_file = [], files.write_file
    files.write_file = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            files.claim_run(copy)
    finally:
        files.write_file = write_file
    assert [files.origin(d) for d in ours + [dropped]] == ["here", "here", "here", "elsewhere"]
    assert files.claim_run(copy) == 3  # the run's three folders; the dropped one is not the run's
    assert [files.origin(d) for d in ours + [dropped]] == ["here", "here", "here", "elsewhere"]
    checkpoint.finish_save(copy / "checkpoints", keep_last=1, published=ours[1])
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["latest", "step_12", "step_8"]
    back = shutil.copytree(ours[1], root / "step_80")  # from the claimed copy into the original: another run's
    assert files.origin(back) == "elsewhere"
    shutil.rmtree(back)

    moved = tmp_path / "elsewhere" / "a"
    moved.parent.mkdir()
    os.rename(run, moved)
    assert files.owner_record(moved, files.RUN_FILE)["parent_inode"] != moved.parent.stat().st_ino
    assert files.claim_run(moved) == 3
    mine = [moved / "checkpoints" / "step_4", moved / "checkpoints" / "step_8", moved / "final"]
    assert [files.origin(d) for d in mine] == ["here"] * 3 and files.refusal(moved / "final", EXPORT) is None


def test_a_run_going_on_from_an_earlier_step_never_replaces_another_trajectorys_checkpoints_unannounced(tmp_path):
    """A run saved step_4 and step_8; resuming step_4 (or starting over) into the same folder would replace step_8
    at step 8: refused at start in one line naming step_8 and the key; with the key, said at start. A copy from
    elsewhere at a later step is not the run's to replace (resume and rotation leave it alone)."""
    from types import SimpleNamespace

    from hf3d.train.build import _refuse_replacing_later_saves

    root = tmp_path / "run" / "checkpoints"
    step_4, step_8 = (fake_checkpoint(root / f"step_{n}", n, sequence=i) for i, n in enumerate((4, 8), 1))
    shutil.copytree(fake_checkpoint(tmp_path / "other" / "step_12", 12), root / "step_12")

    def run(resume_from, start, allow=False, auto=False):
        resume = "auto" if auto else "none" if resume_from is None else str(resume_from)
        cfg = SimpleNamespace(checkpoint=SimpleNamespace(replace_later_steps=allow, resume=resume, load_step=True))
        return SimpleNamespace(cfg=cfg, out=root.parent, start=start, resume_from=resume_from, later_saves_line=None)

    for resume_from, start, frm in [(step_4, 4, f"from {step_4}"), (None, 0, "from the start (no checkpoint")]:
        with pytest.raises(ValueError) as e:
            _refuse_replacing_later_saves(run(resume_from, start))
        assert str(e.value).startswith(f"the run goes on at step {start + 1} {frm}") and (
            f"{root} holds checkpoints of later steps from another trajectory ({'step_4, ' * (start == 0)}step_8)"
            " that its saves would replace: set checkpoint.replace_later_steps: true" in str(e.value)
        ), e.value
    allowed = run(step_4, 4, allow=True)
    _refuse_replacing_later_saves(allowed)
    assert allowed.later_saves_line.startswith(
        "checkpoint.replace_later_steps: the later checkpoints of another trajectory (step_8) are replaced"
    )
    for resume_from, start in [(step_8, 8), (step_4, 8)]:  # the newest, or a step_4 whose step counter reads 8
        _refuse_replacing_later_saves(run(resume_from, start))
    _refuse_replacing_later_saves(run(step_4, 4, auto=True))  # auto passed over step_8: damaged, retrained


def test_a_folder_of_an_earlier_hf3d_is_replaced_only_at_its_own_path_holding_only_its_files(tmp_path):
    """An owner file without identity (hf3d before this rule): its kind and its files still decide."""
    ckpt = _legacy(fake_checkpoint(tmp_path / "step_1", 1))
    assert files.origin(ckpt) == "legacy" and files.refusal(ckpt, checkpoint.CHECKPOINT) is None
    from hf3d.hf.folders import EXPORT

    assert "(checkpoint, not export)" in files.refusal(ckpt, EXPORT)
    (ckpt / "NOTES.md").write_text("keep me")
    assert files.refusal(ckpt, checkpoint.CHECKPOINT) == f"{ckpt} holds 'NOTES.md', which hf3d does not write there"
    (ckpt / "NOTES.md").unlink()
    staged = fake_checkpoint(tmp_path / "step_1.tmp", 1, sequence=2)
    files.publish_dir(staged, ckpt, checkpoint.CHECKPOINT)
    assert files.origin(ckpt) == "here" and checkpoint.read_marker(ckpt)["sequence"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


# -- 5. durable before anything older goes; a kill at any instant leaves a checkpoint -----------------------
class _Killed(BaseException):
    """The process dies here (nothing after this instant happens)."""


def _staged_over_old(root: Path) -> tuple[Path, Path]:
    """root/step_5 published (old), and root/step_5.tmp staged (new, marked): what a publish starts from."""
    for path, value in [(root / "step_5", 1), (root / "step_5.tmp", 2)]:
        ckpt = files.make_dir(path, checkpoint.CHECKPOINT)
        (ckpt / "__0_0.distcp").write_bytes(bytes([value]) * 4096)
        checkpoint.write_marker(ckpt, {"kind": "training", "step": 5, "sequence": value})
    return root / "step_5.tmp", root / "step_5"


def _instants(monkeypatch, kill_at: int | None, log: list) -> None:
    """Record (and, at the kill_at-th one, die at) every step of a publish or a removal that touches the disk."""

    def step(what, fn):
        def run(*args, **kwargs):
            if kill_at is not None and len(log) == kill_at:
                raise _Killed
            name = what if what != "fsync" else f"fsync {Path(os.readlink(f'/proc/self/fd/{args[0]}')).name}"
            log.append(name if what in ("fsync", "renameat2") else f"{what} {Path(args[0]).name}")
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(os, "fsync", step("fsync", os.fsync))
    monkeypatch.setattr(files, "_renameat2", step("renameat2", files._renameat2))
    for name in ("rename", "replace", "unlink", "rmdir"):
        monkeypatch.setattr(os, name, step(name, getattr(os, name)))


def _no_leftovers(root: Path) -> None:
    """The next start (`clean_leftovers`) leaves no trash folder, no replaced `.old` one and no staging folder."""
    checkpoint.clean_leftovers(root)
    left = [p.name for p in root.iterdir() if p.name.startswith(files.TRASH_PREFIX) or p.suffix in (".old", ".tmp")]
    assert not left, left


@pytest.mark.parametrize("swap", [True, False], ids=["renameat2", "without-renameat2"])
def test_a_publish_is_durable_before_it_removes_and_survives_a_kill_at_any_instant(tmp_path, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(files, "_renameat2", lambda src, dst, flags: False)
    log = []
    with monkeypatch.context() as m:
        tmp, final = _staged_over_old(tmp_path / "plain")
        _instants(m, None, log)
        files.publish_dir(tmp, final, checkpoint.CHECKPOINT)
    moved = "renameat2" if swap else "rename step_5"
    first_move = log.index(moved)
    synced = {e.removeprefix("fsync ") for e in log[:first_move] if e.startswith("fsync")}
    assert {p.name for p in final.iterdir()} | {"step_5.tmp"} <= synced  # every file and the folder, first
    assert log[first_move + (1 if swap else 2)] == "fsync plain"  # the name on disk, then what it replaced goes
    removal = [e for e in log[first_move:] if e.startswith(("unlink", "rmdir"))]
    assert log.index(removal[0]) > log.index("fsync plain") and log[-1].startswith(f"rmdir {files.TRASH_PREFIX}")
    assert removal[-2] == f"unlink {files.OWNER_FILE}"  # the owner file last: a trash folder stays hf3d's
    assert checkpoint.read_marker(final)["sequence"] == 2 and sorted(p.name for p in final.parent.iterdir()) == [
        "step_5"
    ]
    for kill_at in range(len(log)):
        root = tmp_path / f"killed-{kill_at}"
        with monkeypatch.context() as m:
            tmp, final = _staged_over_old(root)
            _instants(m, kill_at, [])
            with pytest.raises(_Killed):
                files.publish_dir(tmp, final, checkpoint.CHECKPOINT)
        found = checkpoint.resolve_resume("auto", root)  # old or new, complete and undamaged
        assert found is not None and checkpoint.read_marker(found)["sequence"] in (1, 2), (kill_at, log[kill_at])
        assert checkpoint.find_damage(found, checkpoint.read_marker(found)) is None
        _no_leftovers(root)
        assert checkpoint.resolve_resume("auto", root) == root / "step_5"  # the leftovers went, not the checkpoint
        staged = fake_checkpoint(root / "step_5.tmp", 5, sequence=3)  # nothing blocks a later save
        files.publish_dir(staged, root / "step_5", checkpoint.CHECKPOINT)
        assert checkpoint.read_marker(root / "step_5")["sequence"] == 3


def _saved_three(root: Path) -> None:
    """root/step_1, step_2 and step_3, saved in that order, each with a data file: what a rotation starts from."""
    for step in (1, 2, 3):
        ckpt = files.make_dir(root / f"step_{step}", checkpoint.CHECKPOINT)
        (ckpt / "__0_0.distcp").write_bytes(bytes([step]) * 4096)
        (ckpt / "config.json").write_text("{}")
        checkpoint.write_marker(ckpt, {"kind": "training", "step": step, "sequence": step})


def test_a_rotation_killed_at_any_instant_leaves_whole_checkpoints_or_nothing_that_blocks_a_save(tmp_path, monkeypatch):
    """keep_last=1 after step_3: step_1 and step_2 go, each renamed to a trash name first, then emptied. A kill at
    any instant leaves each whole at its name or gone (a trash folder at most, which the next start removes), and
    saving step_1 or step_2 again is never refused."""
    log = []
    _saved_three(tmp_path / "plain")
    with monkeypatch.context() as m:
        _instants(m, None, log)
        checkpoint.finish_save(tmp_path / "plain", keep_last=1, published=tmp_path / "plain" / "step_3")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["latest", "step_3"]
    renames = [i for i, e in enumerate(log) if e.startswith(("rename step_", "renameat2"))]
    assert len(renames) == 2 and all(e.startswith(("unlink", "rmdir")) for e in log[renames[0] + 1 : renames[1]])
    for kill_at in range(len(log)):
        root = tmp_path / f"killed-{kill_at}"
        _saved_three(root)
        with monkeypatch.context() as m:
            _instants(m, kill_at, [])
            with pytest.raises(_Killed):
                checkpoint.finish_save(root, keep_last=1, published=root / "step_3")
        for step in (1, 2):  # whole, or gone
            d = root / f"step_{step}"
            assert not d.exists() or checkpoint.find_damage(d, checkpoint.read_marker(d)) is None, (kill_at, step)
            assert not d.exists() or sorted(p.name for p in d.iterdir()) == sorted(
                [files.OWNER_FILE, checkpoint.MARKER, "__0_0.distcp", "config.json"]
            )
        assert checkpoint.resolve_resume("auto", root) == root / "step_3", log[kill_at]
        _no_leftovers(root)
        for step in (1, 2):  # a later save of the step is not blocked
            staged = fake_checkpoint(root / f"step_{step}.tmp", step, sequence=4)
            files.publish_dir(staged, root / f"step_{step}", checkpoint.CHECKPOINT)
        checkpoint.finish_save(root, keep_last=1, published=root / "step_2")
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"], log[kill_at]


def _durable_saves(model_dir: str, root: str, out: str) -> None:
    """Three saves through hf3d.save_checkpoint (a new folder, the same folder again, an async save), with every
    fsync and every rename recorded in order: (what, path) and (what, source, destination)."""
    import hf3d

    start_watchdog(120)
    root, log, res = Path(root), [], {}
    real = os.fsync, files._renameat2, os.rename
    os.fsync = lambda fd: (log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real[0](fd))[1]
    files._renameat2 = lambda src, dst, flags: (log.append(("rename", str(src), str(dst))), real[1](src, dst, flags))[1]
    os.rename = lambda src, dst: (log.append(("rename", str(src), str(dst))), real[2](src, dst))[1]
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    pm.train_step(ids, ids)
    opt.step()
    for name, path, kwargs in [
        ("new", "step_1", {}),
        ("replacing", "step_1", {}),
        ("async", "step_2", {"async_": True}),
    ]:
        del log[:]
        saved = hf3d.save_checkpoint(root / path, pm, opt, step=1, **kwargs)
        if kwargs:
            saved.result()
        res[name] = (list(log), sorted(p.name for p in (root / path).iterdir()))
    for name in ("export", "export replacing"):  # save_pretrained publishes through the same files.publish_dir
        del log[:]
        pm.save_pretrained(root / "export")
        res[name] = (list(log), sorted(p.name for p in (root / "export").iterdir()))
    os.fsync, files._renameat2, os.rename = real
    report(res, Path(out))


def test_save_checkpoint_is_durable_before_it_publishes_and_before_it_removes(tmp_path):
    """Through hf3d.save_checkpoint itself (a new checkpoint, one that replaces another, an async one): every file of
    the checkpoint and its staging folder are fsynced before the rename that publishes it, the parent folder
    after it, and what a save replaces is moved away (then deleted) only after that. The same for an export
    (save_pretrained) that replaces another. Mutation: publish_dir replacing without a sync."""
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    root = tmp_path / "checkpoints"
    spawn(_durable_saves, 1, str(model_dir), str(root), str(tmp_path / "res.pt"))
    res = torch.load(tmp_path / "res.pt")[0]
    for name, path in [("new", "step_1"), ("replacing", "step_1"), ("async", "step_2")]:
        log, names = res[name]
        staging, final = str(root / f"{path}.tmp"), str(root / path)
        publish = log.index(("rename", staging, final))
        synced = {e[1] for e in log[:publish] if e[0] == "fsync"}
        assert {f"{staging}/{n}" for n in names} | {staging} <= synced, (name, sorted(synced))
        parent = log.index(("fsync", str(root)), publish)
        removal = [i for i, e in enumerate(log) if e[0] == "rename" and Path(e[2]).name.startswith(files.TRASH_PREFIX)]
        assert len(removal) == (name == "replacing") and all(i > parent for i in removal), (name, log)
    log, names = res["export replacing"]  # an export replacing another: durable before the older one goes
    staging, final = str(root / "export.tmp-hf3d"), str(root / "export")
    publish = log.index(("rename", staging, final))
    assert {f"{staging}/{n}" for n in names} | {staging} <= {e[1] for e in log[:publish] if e[0] == "fsync"}, log
    parent = log.index(("fsync", str(root)), publish)
    assert [i for i, e in enumerate(log) if e[0] == "rename" and files.TRASH_PREFIX in e[2]] > [parent], log


# -- crafted input reaches every reader of YAML and of pickled files ------------------------------------------
def test_a_yaml_tag_that_would_run_code_is_refused_wherever_hf3d_reads_yaml(tmp_path, capsys):
    """A python tag in a config file, in `hf3d train --set` and in `hf3d eval --set`: one line each, nothing run.
    Mutation: yaml.unsafe_load (or getattr(yaml, "unsafe_load")) at any of the three runs the tag (the marker)."""
    from hf3d.cli import main as cli_main

    marker = tmp_path / "ran"
    tag = f'!!python/object/apply:os.system ["touch {marker}"]'
    config = tmp_path / "crafted.yaml"
    config.write_text(f"run:\n  steps: {tag}\n")
    out = str(tmp_path / "eval-out")
    for argv in (
        ["train", str(config)],
        ["train", "examples/configs/tiny-smollm.yaml", "--set", f"run.steps={tag}"],
        ["eval", str(tmp_path), "--tasks", "shakespeare-word", "--output-dir", out, "--set", f"parallel.tp={tag}"],
    ):
        assert cli_main(argv) != 0, argv
        said = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(said) == 1 and "python/object/apply:os.system" in said[0], (argv, said)
    assert not marker.exists()


def test_every_reader_of_a_small_torch_file_refuses_a_crafted_pickle_and_runs_nothing(tmp_path):
    """A checkpoint's extra.pt replaced by a pickle that runs `touch` when a plain unpickler reads it, in a torch.save
    archive so that hf3d's archive check passes (marker resealed, so the file checks pass): load_checkpoint's
    reader, `hf3d convert to-hf`'s record of the run and a run's starting point (model.path a checkpoint) each
    refuse it, and nothing runs. Mutations: torch.load with weights_only=False, `import pickle as pk` / `from
    pickle import loads as _l` at any of the three (the marker, and the audit's pickle.find_class)."""
    from hf3d.checkpoint import convert, load
    from hf3d.train.finish import starting_point

    marker = tmp_path / "ran"
    src = make_model_dir(tmp_path / "m", "llama")
    ckpt = convert.hf_to_checkpoint(src, tmp_path / "ckpt")
    write_crafted(ckpt, "extra.pt", torch_archive(global_pickle("os", "system", f"touch {marker}")))
    for read in (lambda: load._load(ckpt / "extra.pt"), lambda: convert._training_summary(ckpt),
                 lambda: starting_point(str(ckpt))):  # fmt: skip
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            read()
    assert not marker.exists()
