"""What hf3d reads of a checkpoint or an HF folder is the folder's own, and no larger than its files: the classes of
a review, each closed by one rule (docs/untrusted-files.md) and checked here by its crafted inputs and by a scan.

1. A file of a checkpoint is read through real folders only (hf3d/checkpoint/untrusted.py `open_in`): a folder
   link anywhere below the checkpoint (`sub -> /elsewhere/ckpt`, its `.metadata` naming `sub/...`) is refused by
   every reader, whether the marker lists the file or not. Mutation: open the folders above the file without
   O_NOFOLLOW (check the last component only): the linked-folder tests fail.
2. An HF folder is read by its own file names (hf3d/hf/load.py `weights_files`): an index naming a shard by a path,
   '..' or an absolute path, a weights file linked from outside, and a malformed index or header are refused in
   one line naming the file. Mutation: let a weight_map name hold '/' or '..': the index tests fail.
3. Nothing a file declares is allocated before the files bear it out: a compressed record in a torch.save archive
   (a stored box, extra.pt), a pickle's counted length, a stored box counted twice, one byte range named twice
   ('./x', a hard link), a weight stored in part. The peak memory of each refusal is measured and bounded.
   Mutations: let zip_records check nothing, skip the pickle's count check, drop the repeated-offset check: the
   memory tests fail (+512 MiB, 1.9 GB traced, +64 MiB).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hf3d without an install
sys.path.insert(0, str(ROOT / "tests"))

import crafted  # noqa: E402
from dist import report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402

from hf3d import checkpoint  # noqa: E402
from hf3d.checkpoint.untrusted import load_small, open_in  # noqa: E402

PACKAGE = ROOT / "hf3d"


def _cli_error(argv: list[str], capsys) -> str:
    """The one error line of `hf3d <argv>` (exit 1, no traceback)."""
    from hf3d.cli import main

    capsys.readouterr()
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama's HF folder, its checkpoint, and a checkpoint of another Llama (other weights)."""
    root = tmp_path_factory.mktemp("honest")
    model = make_model_dir(root / "llama", "llama")
    from hf3d.checkpoint.convert import hf_to_checkpoint

    other = hf_to_checkpoint(make_model_dir(root / "other", "llama", seed=1), root / "other-ckpt")
    return {"model": model, "ckpt": hf_to_checkpoint(model, root / "ckpt"), "other": other}


# -- the scans ------------------------------------------------------------------------------------------------
_READS = {"open", "io.open", "files.open_read", "torch.load", "zipfile.ZipFile", "torch._C.PyTorchFileReader"}
_READ_METHODS = {"read_text", "read_bytes", "FileSystemReader", "safe_open", "load_file", "fromfile", "memmap"}
# reads of a checkpoint's files that are not untrusted.py's, each with why it may stay
ALLOWED = {
    "checkpoint/checksums.py": "crc32_range: the file a writer is writing or just wrote (a checkpoint's own go through "
    "crc32_open)",
    "checkpoint/writer.py": "the files a writer creates (mode 'xb', O_EXCL)",
}
# torch.load and zip readers outside hf3d/checkpoint that read a file of a checkpoint
PENDING_OUTSIDE: dict[str, str] = {}


def _read_calls(path: Path):
    """(line, callee) of every call in the module at `path` that opens or reads a file by its path."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        writes = isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+")
        if (name in _READS or name.rsplit(".", 1)[-1] in _READ_METHODS) and not writes:
            yield node.lineno, name


def test_every_file_of_a_checkpoint_is_opened_by_one_rule_and_every_archive_checked_first():
    """In hf3d/checkpoint/ only untrusted.py opens a file to read it (open_in, load_small), but the writer's own
    files; in all of hf3d/, only untrusted.py reads a torch.save archive (torch.load, zipfile, torch's zip reader),
    but the pending calls named above. Mutation: `files.open_read(path / rel)` in reader.py: this fails."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "checkpoint/untrusted.py" or rel in ALLOWED:
            continue
        for lineno, name in _read_calls(path):
            archive = name in ("torch.load", "zipfile.ZipFile", "torch._C.PyTorchFileReader")
            if rel.startswith("checkpoint/") or archive and rel not in PENDING_OUTSIDE:
                found.append(f"{rel}:{lineno} {name}")
    assert not found, "reads outside hf3d/checkpoint/untrusted.py:\n" + "\n".join(found)


def test_only_the_safetensors_reader_reads_an_hf_folders_weights():
    """No module but hf3d/hf/load.py reads a safetensors file or an index; there every file opened is one
    `weights_files` returned (SafetensorsSource's entries). Mutation: json.loads(index.read_text()) elsewhere."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if rel != "hf/load.py" and re.search(r"weight_map\"\]|\.get\(\"weight_map|safe_open|load_file\(", text):
            found.append(rel)
    assert not found, found
    source = (PACKAGE / "hf" / "load.py").read_text()
    opens = [
        ast.unparse(c) for c in ast.walk(ast.parse(source)) if isinstance(c, ast.Call) and ast.unparse(c.func) == "open"
    ]
    assert all(re.match(r"open\((fpath|_inside\(index\.parent, index\)), ", c) for c in opens), opens


# -- 1. a folder link below a checkpoint ----------------------------------------------------------------------
def _open_refusal(folder: Path, name: str) -> str | None:
    """What open_in(folder, name) refuses (None: it opened), from a thread that must end within 30 s: a FIFO
    does not block the open."""
    said: list[str] = []

    def run() -> None:
        try:
            open_in(folder, name).close()
        except ValueError as e:
            said.append(str(e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"opening {name} blocked"
    return said[0] if said else None


def test_a_folder_link_anywhere_below_a_checkpoint_is_never_followed(honest, tmp_path, capsys):
    """A checkpoint whose data lie in `sub`, a link to another checkpoint: convert to-hf, the .metadata reader and
    find_damage refuse it, the marker listing the file or not (sizes and checksums resealed as a crafter would);
    a link two levels down is refused too, and a FIFO does not block. The same data in a real subfolder convert."""
    from hf3d.checkpoint.convert import checkpoint_to_hf

    for listed in (False, True):
        ckpt = shutil.copytree(honest["ckpt"], tmp_path / f"linked-{listed}", symlinks=True)
        crafted.link_data_folder(ckpt, honest["other"], listed=listed)
        msg = _cli_error(["convert", "to-hf", str(ckpt), str(tmp_path / "out")], capsys)
        assert not (tmp_path / "out").exists()
        if listed:
            assert msg.endswith("damaged: sub/__0_0.distcp is a link or not a regular file, or lies below a link or "
                                "outside the folder (hf3d reads no file of a checkpoint through a link); use another "
                                "checkpoint (an older step_<N>) or delete this folder"), msg  # fmt: skip
        else:
            assert checkpoint.find_damage(ckpt, checkpoint.read_marker(ckpt)) is None  # the marker does not list it
            assert f"{ckpt}/sub/__0_0.distcp, a data file its .metadata names, is missing, a link, in a linked" in msg
            with pytest.raises(ValueError, match="a data file its .metadata names"):
                checkpoint.SafeReader(ckpt).read_metadata()
    deep = tmp_path / "deep"
    (deep / "a").mkdir(parents=True)
    (deep / "a" / "b").symlink_to(honest["other"], target_is_directory=True)
    (deep / "a" / "c").symlink_to(honest["other"] / "__0_0.distcp")
    (deep / "a" / "file").write_text("")
    os.mkfifo(deep / "fifo")
    for name, problem in [
        ("a/b/__0_0.distcp", f"{deep}/a/b is a link or not a folder"),
        ("a/c", f"{deep}/a/c is a link;"),
        ("a/file/x", f"{deep}/a/file is a link or not a folder"),
        ("../deep/a/file", "outside the checkpoint folder"),
        ("/etc/passwd", "outside the checkpoint folder"),
        ("fifo", f"{deep}/fifo is not a regular file"),
    ]:
        assert problem in (_open_refusal(deep, name) or "nothing refused"), name
    real = shutil.copytree(honest["ckpt"], tmp_path / "real-sub")  # the rule is about links, not subfolders
    (real / "sub").mkdir()
    os.rename(real / "__0_0.distcp", real / "sub" / "__0_0.distcp")

    def into_sub(metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "sub/" + info.relative_path

    crafted.rewrite_metadata(real, into_sub)
    assert "sub/__0_0.distcp" in checkpoint.read_marker(real)["files"]
    checkpoint_to_hf(real, tmp_path / "hf-real")
    ours = (tmp_path / "hf-real" / "model.safetensors").read_bytes()
    checkpoint_to_hf(honest["ckpt"], tmp_path / "hf-honest")
    assert ours == (tmp_path / "hf-honest" / "model.safetensors").read_bytes()


# -- 2. an HF folder's index and headers ----------------------------------------------------------------------
def _hf_folder(honest, tmp_path: Path, name: str, index=None, header: bytes | None = None) -> Path:
    """A copy of the tiny Llama's folder with `index` as its model.safetensors.index.json (its model.safetensors
    kept: the index is read first) and `header` as its safetensors header, when given."""
    folder = shutil.copytree(honest["model"], tmp_path / name)
    if index is not None:
        text = index if isinstance(index, str | bytes) else json.dumps(index)
        (folder / "model.safetensors.index.json").write_bytes(text.encode() if isinstance(text, str) else text)
    if header is not None:
        (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


def test_an_hf_folder_is_read_by_its_own_file_names_and_a_malformed_index_is_one_line(honest, tmp_path, capsys):
    """Every index whose weight_map names a path, and every malformed index or header, is refused in one line naming
    the file, by `convert from-hf` (nothing written) and by the reader parallelize uses (hf3d.parallelize._open):
    no KeyError, AttributeError, TypeError or RecursionError. A link into the Hub cache is read, one elsewhere not."""
    from huggingface_hub import constants

    from hf3d.hf.load import SafetensorsSource
    from hf3d.parallelize import _open

    private = tmp_path / "private"
    private.mkdir()
    shutil.copy(honest["model"] / "model.safetensors", private / "model.safetensors")
    (tmp_path / "llama-sub").mkdir()
    shard = {
        "..": "../private/model.safetensors",
        "absolute": str(private / "model.safetensors"),
        "slash": "sub/model.safetensors",
        "dotdot": "..",
        "backslash": "..\\private\\model.safetensors",
    }
    cases = {
        f"names {k}": ({"weight_map": {"model.norm.weight": v}}, None, "not a file name inside")
        for k, v in shard.items()
    }
    cases |= {
        "no weight_map": ({"metadata": {}}, None, "has no weight_map"),
        "a list": ({"weight_map": ["model.safetensors"]}, None, "has no weight_map"),
        "a number": ({"weight_map": {"model.norm.weight": 3}}, None, "has no weight_map"),
        "not an object": ([1, 2], None, "has no weight_map"),
        "nested": (crafted.nested_json(100000), None, "nests JSON deeper than hf3d parses"),
        "not UTF-8": (b'{"weight_map": {"\xff": 1}}', None, "is not UTF-8 text"),
        "not JSON": ("{weight_map", None, "is not valid JSON"),
        "header nested": (None, crafted.nested_json(100000).encode(), "its header nests JSON too deep"),
        "header past the end": (None, b"", "header length beyond the end of the file"),
    }
    for i, (what, (index, header, words)) in enumerate(cases.items()):
        folder = _hf_folder(honest, tmp_path, f"case-{i}", index, header)
        if what == "header past the end":
            data = (honest["model"] / "model.safetensors").read_bytes()
            (folder / "model.safetensors").write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
        where = folder / ("model.safetensors" if header is not None else "model.safetensors.index.json")
        msg = _cli_error(["convert", "from-hf", str(folder), str(tmp_path / "ck")], capsys)
        assert f"error: {where}" in msg and words in msg and len(msg.replace(str(tmp_path), "<tmp>")) < 400, msg
        assert not (tmp_path / "ck").exists(), what
        for read in (lambda f=folder: SafetensorsSource(f), lambda f=folder: _open(str(f))):
            with pytest.raises(ValueError, match=re.escape(words)):
                read()
    linked = _hf_folder(honest, tmp_path, "linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(private / "model.safetensors")
    msg = _cli_error(["convert", "from-hf", str(linked), str(tmp_path / "ck")], capsys)
    assert f"{linked}/model.safetensors is a link to {private}/model.safetensors, outside {linked}" in msg, msg
    cache = tmp_path / "hub-cache"
    shutil.copytree(private, cache / "blobs")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(cache / "blobs" / "model.safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(cache))
        assert "model.norm.weight" in SafetensorsSource(linked).entries  # the Hub's downloads are links into it


# -- 3. declared sizes ------------------------------------------------------------------------------------------
def _vm(field: str) -> int:
    """VmRSS / VmHWM of this process, in KiB."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_growth_mib(fn) -> float:
    """How far this process's resident memory rose above where it was while fn() ran (its peak, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident size (Linux 4.0+)
        f.write("5")
    base = _vm("VmRSS")
    fn()
    return (_vm("VmHWM") - base) / 1024


INFLATED = 256 << 20  # a data.pkl of 256 MiB of zeros, deflated to 261 KB
COUNTED = 1_900_000_000  # the bytes object a 1,011-byte .metadata declares
MAX_GROWTH_MIB = 4
"""The most a refusal may grow the process: about 20 times the most measured, 0.18 MiB (0.00-0.18 MiB over four
runs, convert and load_checkpoint, 2 CPU cores). Before the checks, a data.pkl inflating to INFLATED grew convert
and load_checkpoint by twice INFLATED (torch's inflated record, then Python's copy of it: +2048 MiB for 1 GiB),
and a stored box counted 8192 times made convert write 256 MiB of a 294 KB checkpoint."""
MAX_TRACED = 128 << 10
"""The most Python may allocate reading the counted .metadata: 18 times the 7 KB measured (1.8 GiB before)."""


def _crafted_sizes(honest, root: Path) -> dict[str, Path]:
    """{what: checkpoint}: a stored box and an extra.pt inflating to INFLATED, a .metadata declaring COUNTED bytes, a
    stored row of a 4096 x 4096 weight counted as 4096 boxes."""
    made = {n: shutil.copytree(honest["ckpt"], root / n) for n in ("box", "extra", "counted", "repeated")}
    crafted.craft_inflating_box(made["box"], INFLATED)
    crafted.inflating_archive(made["extra"] / "extra.pt", INFLATED)
    crafted.reseal(made["extra"])
    crafted.write_crafted(made["counted"], ".metadata", crafted.counted_pickle(COUNTED))
    crafted.craft_repeated_box(made["repeated"], "lm_extra.weight", 4096)
    return made


WORDS = {
    "box": "its record 'archive/data.pkl' is compressed",
    "extra": "extra.pt: its record 'archive/data.pkl' is compressed",
    "counted": f"is not a whole pickle (ValueError: expected {COUNTED} bytes in a bytes8",
    "repeated": "declares two boxes of 'model/lm_extra.weight' at [0, 0], one stored item counted twice",
}


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_convert_allocates_nothing_a_checkpoint_declares_before_its_files_bear_it_out(honest, tmp_path, capsys):
    """`convert to-hf` of each crafted checkpoint is refused in one line, the process growing by at most
    MAX_GROWTH_MIB (an honest conversion first, so that imports and first-use costs are paid), and the counted
    .metadata allocating nothing it declares (tracemalloc)."""
    made = _crafted_sizes(honest, tmp_path)
    capsys.readouterr()
    from hf3d.cli import main

    assert main(["convert", "to-hf", str(honest["ckpt"]), str(tmp_path / "warm")]) == 0
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            checkpoint.SafeReader(made["counted"]).read_metadata()
        traced = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert traced < MAX_TRACED and WORDS["counted"] in str(refused.value), (traced, refused.value)
    grown, said = {}, {}

    def convert(what: str) -> None:
        try:
            said[what] = _cli_error(["convert", "to-hf", str(made[what]), str(tmp_path / "o")], capsys)
        except Exception as e:  # what it cost is asserted first
            said[what] = f"{type(e).__name__}: {e}"

    for what in made:
        grown[what] = peak_growth_mib(lambda w=what: convert(w))
    assert max(grown.values()) < MAX_GROWTH_MIB, grown  # first what the refusals cost, then what they said
    assert all(WORDS[what] in msg for what, msg in said.items()) and not (tmp_path / "o").exists(), said
    with pytest.raises(ValueError, match=re.escape(WORDS["extra"])):
        load_small(made["extra"], "extra.pt")


def _load_crafted(ckpts: dict[str, str], honest_ckpt: str, model_dir: str, out: str) -> None:
    import hf3d

    start_watchdog(240)
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    hf3d.load_checkpoint(honest_ckpt, pm, opt, extra={})  # first-use costs paid
    res = {}
    for what, ckpt in ckpts.items():
        error: list[str] = []

        def load(c=ckpt, e=error) -> None:
            try:
                hf3d.load_checkpoint(c, pm, opt, extra={})
            except ValueError as problem:
                e.append(str(problem))
            except Exception as problem:  # what it cost is asserted first
                e.append(f"{type(problem).__name__}: {problem}")

        res[what] = (peak_growth_mib(load), error[0] if error else None)
    report(res, out)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_load_checkpoint_allocates_nothing_a_checkpoint_declares_before_its_files_bear_it_out(honest, tmp_path):
    """`load_checkpoint` of each crafted checkpoint (in a gloo process) raises one ValueError naming the file, its
    process growing by at most MAX_GROWTH_MIB."""
    made = _crafted_sizes(honest, tmp_path)
    ckpts = {k: str(v) for k, v in made.items()}
    spawn(_load_crafted, 1, ckpts, str(honest["ckpt"]), str(honest["model"]), str(tmp_path / "res.pt"))
    res = torch.load(tmp_path / "res.pt")[0]
    assert max(grown for grown, _ in res.values()) < MAX_GROWTH_MIB, res  # first what the refusals cost
    for what, (_, error) in res.items():
        assert error is not None and WORDS[what] in error and "\n" not in error, (what, error)


def test_a_weight_stored_in_part_is_refused_when_the_metadata_is_read(honest, tmp_path, capsys):
    """A weight declared 2^20 x 2^20 of which one element is stored: refused in one line by the .metadata reader
    (`hf3d average` allocated the 4 TiB it declares and ended in a traceback)."""
    pair = [shutil.copytree(honest["ckpt"], tmp_path / n) for n in ("a", "b")]
    for ckpt in pair:
        crafted.craft_partial_tensor(ckpt, "lm_extra.weight", 1 << 20)
    msg = _cli_error(["average", str(pair[0]), str(pair[1]), "--out", str(tmp_path / "avg")], capsys)
    assert f"{pair[0]}/.metadata declares 'model/lm_extra.weight' of size [1048576, 1048576]" in msg, msg
    assert "stored only in part (its boxes hold 1)" in msg and not (tmp_path / "avg").exists()


@pytest.mark.parametrize(
    "alias", ["./__0_0.distcp", ".//__0_0.distcp", "__1_0.distcp"], ids=["dot", "slashes", "hard-link"]
)
def test_one_stored_byte_range_serves_one_box_whatever_name_it_is_given(honest, tmp_path, alias):
    """The two norms of layer 0 read the same stored bytes, the second naming the data file by another name ('./',
    '//', a hard link): the items overlap in the one file and the .metadata is refused, so that no name repeated
    makes a tensor larger than the files hold. Mutation: key the overlap check by the names again."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ckpt = shutil.copytree(honest["ckpt"], tmp_path / "ckpt")
    if alias == "__1_0.distcp":
        os.link(ckpt / "__0_0.distcp", ckpt / alias)

    def share(metadata) -> None:
        index = {i.fqn: i for i in metadata.storage_data}
        a, b = (index[f"model/model.layers.0.{n}.weight"] for n in ("input_layernorm", "post_attention_layernorm"))
        first = metadata.storage_data[a]
        metadata.storage_data[b] = _StorageInfo(alias, first.offset, first.length)

    crafted.rewrite_metadata(ckpt, share)
    with pytest.raises(ValueError, match=re.escape(f"{ckpt}/.metadata declares items of {ckpt}/") + ".* that overlap"):
        checkpoint.SafeReader(ckpt).read_metadata()
