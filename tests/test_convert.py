"""`hf3d convert` and the streaming HF writer: exact round trips.

HF dir -> `convert from-hf` -> `convert to-hf` must give back the source bit for bit: the same
tensor names, dtypes, shapes and bytes (torch.equal), the same config (config.to_dict() without
`transformers_version` and `_name_or_path`, which say who wrote it and where it was read from),
and, as the writer lays files out the way transformers + safetensors do, the very same file bytes.
The same holds for a ParallelModel's streaming `save_pretrained` at tp=2 (vocab 101 padded, so the
crop is exercised) and pp=2 (pieces sent from another rank). Error paths: one clear line, exit 1.
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from crafted import craft_stored_box, global_pickle, payloads, rewrite_metadata, write_crafted  # noqa: E402
from dist import report, spawn, start_watchdog  # noqa: E402
from models import MOE_FAMILIES, VOCAB, make_model_dir  # noqa: E402
from reference import batches, hf3d_run  # noqa: E402

import hf3d  # noqa: E402
from hf3d import checkpoint  # noqa: E402
from hf3d.checkpoint.convert import checkpoint_to_hf, hf_to_checkpoint  # noqa: E402
from hf3d.cli import main as cli_main  # noqa: E402
from hf3d.hf.folders import EXPORT  # noqa: E402
from hf3d.hf.load import TensorSpec  # noqa: E402
from hf3d.hf.save import write_hf_dir  # noqa: E402
from hf3d.utils import files
from hf3d.utils.units import parse_size  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "llama-kvrep", "qwen2", "qwen3", "smollm3")
VOLATILE = {"transformers_version", "_name_or_path"}  # the writing library's version; where it was read from
SHARD = 20_000  # bytes: several shards for the tiny models, no tensor above it


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def _assert_same_model(src: Path, out: Path) -> None:
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
    ca, cb = (AutoConfig.from_pretrained(d).to_dict() for d in (src, out))
    for c in (ca, cb):
        for k in VOLATILE:
            c.pop(k)
    assert ca == cb
    weight_files = sorted(f.name for f in src.iterdir() if f.name.startswith("model"))
    assert weight_files == sorted(f.name for f in out.iterdir() if f.name.startswith("model"))
    for name in [*weight_files, "config.json", "generation_config.json"]:
        assert (src / name).read_bytes() == (out / name).read_bytes(), name


def _dcp_keys(ckpt: Path) -> dict:
    return dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata


# -- HF -> checkpoint -> HF -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: make_model_dir(root / f, f) for f in MOE_FAMILIES}


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_round_trip_is_bit_identical(family_dirs, moe_dirs, tmp_path, family):
    """HF -> checkpoint -> HF gives stock's files byte for byte (a MoE model's per-expert tensors too)."""
    src = (moe_dirs if family in MOE_FAMILIES else family_dirs)[family]
    ckpt = hf_to_checkpoint(src, tmp_path / "ckpt")
    meta = checkpoint.read_marker(ckpt)
    assert {k: meta[k] for k in ("kind", "step", "dtype", "parallel")} == dict(
        kind="weights", step=0, dtype="float32", parallel=None
    )
    assert meta["model_type"] == AutoConfig.from_pretrained(src).model_type
    stored = _dcp_keys(ckpt)
    tied = AutoConfig.from_pretrained(src).tie_word_embeddings
    assert sorted(stored) == sorted(checkpoint.model_key(n) for n in _tensors(src))
    assert (checkpoint.model_key("lm_head.weight") in stored) == (not tied)
    out = checkpoint_to_hf(ckpt, tmp_path / "hf")
    _assert_same_model(src, out)


def test_from_hf_writes_one_data_file_checksummed_as_written(family_dirs, tmp_path):
    """One data file whatever the number of tensors (one per tensor cost a fsync each), and the CRC-32 that
    the marker records for it, computed while writing, is the file's own: a flipped byte is found."""
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp"]
    data, mine = ckpt / "__0_0.distcp", (checkpoint.MARKER, files.OWNER_FILE)  # the owner file says whose it is
    meta, raw = checkpoint.read_marker(ckpt), data.read_bytes()
    assert meta["files"]["__0_0.distcp"] == {"size": len(raw), "crc32": zlib.crc32(raw)}
    assert sorted(meta["files"]) == sorted(p.name for p in ckpt.iterdir() if p.name not in mine)
    assert checkpoint.find_damage(ckpt, meta) is None
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 1
    data.write_bytes(flipped)
    assert checkpoint.find_damage(ckpt, meta) == "__0_0.distcp does not match the checksum written with it"


def test_from_hf_fsyncs_its_files_only_when_asked(family_dirs, tmp_path, monkeypatch, capsys):
    """By default from-hf leaves its files to the page cache, as save_pretrained does (the marker's
    checksums, checked at every load, catch an output a power loss cut short); `--fsync` syncs every file
    and the staging folder before it takes its name, then the folder holding it. The data file is the same
    either way."""
    import os

    synced = []
    real_fsync = os.fsync

    def recording(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    plain = hf_to_checkpoint(family_dirs["llama"], tmp_path / "plain")
    assert synced == []
    assert cli_main(["convert", "from-hf", "--fsync", str(family_dirs["llama"]), str(tmp_path / "synced")]) == 0
    assert {p.name for p in (tmp_path / "synced").iterdir()} <= set(synced)
    assert synced[-2:] == ["synced.tmp", tmp_path.name]  # the folder, then its name in the parent
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'synced'}"
    assert (plain / "__0_0.distcp").read_bytes() == (tmp_path / "synced" / "__0_0.distcp").read_bytes()


@pytest.mark.parametrize("where", ["data", "zip header"])
def test_to_hf_refuses_a_damaged_checkpoint_and_publishes_nothing(family_dirs, tmp_path, where):
    """to-hf checks the sizes first and the checksums beside the conversion: a flipped byte in a tensor's
    data or in the zip header of the first stored box (which fails the read before the checksums are in)
    gives the damage message, and neither the output nor its staging folder is left."""
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    data = ckpt / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 if where == "data" else 12] ^= 0xFF
    data.write_bytes(raw)
    with pytest.raises(ValueError, match="is damaged: __0_0.distcp does not match the checksum written with it"):
        checkpoint_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp-hf3d").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_into_matches_get(tmp_path, monkeypatch, dtype):
    """SafetensorsSource.read_into fills a parameter's piece with what get() returns, converted: straight
    from the file (rows, same dtype) and through blocks of rows (a column range, a dtype change), the
    block cut to 3 rows so that slices span several blocks and end inside one; nothing outside the piece
    is written."""
    from safetensors.torch import save_file

    from hf3d.hf import load as hf

    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(13, 7, generator=g), "b": torch.randn(5, generator=g).bfloat16()}, tmp_path / "x")
    (tmp_path / "x").rename(tmp_path / "model.safetensors")
    source = hf.SafetensorsSource(tmp_path)
    monkeypatch.setattr(hf, "_INTO_BLOCK_BYTES", 3 * 7 * 4)
    for name, dim, start, stop in [("a", 0, 2, 11), ("a", 1, 1, 6), ("b", 0, 1, 4)]:
        want = source.get(name, dim, start, stop).to(dtype)
        holder = torch.full((want.shape[0] + 2, *want.shape[1:]), float("nan"), dtype=dtype)
        if dim == 1:  # a column piece of a wider parameter: not contiguous
            holder = torch.full((want.shape[0], want.shape[1] + 3), float("nan"), dtype=dtype)
        out = holder.narrow(dim, 1, want.shape[dim])
        source.read_into(name, dim, start, stop, out)
        assert torch.equal(out, want), (name, dim)
        assert int(holder.isnan().sum()) == holder.numel() - out.numel(), (name, dim)


def test_tied_head_in_safetensors_is_dropped(tmp_path):
    src = make_model_dir(tmp_path / "src", "llama")
    t = load_file(src / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    from safetensors.torch import save_file

    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    ckpt = hf_to_checkpoint(src, tmp_path / "ckpt")
    assert checkpoint.model_key("lm_head.weight") not in _dcp_keys(ckpt)
    out = checkpoint_to_hf(ckpt, tmp_path / "hf")
    assert "lm_head.weight" not in _tensors(out)
    stock = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(stock.lm_head.weight, t["model.embed_tokens.weight"])


def test_bf16_source_stays_bf16(tmp_path):
    fp32 = make_model_dir(tmp_path / "fp32", "qwen2")
    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(src)
    ckpt = hf_to_checkpoint(src, tmp_path / "ckpt")
    assert checkpoint.read_marker(ckpt)["dtype"] == "bfloat16"
    assert {m.properties.dtype for m in _dcp_keys(ckpt).values()} == {torch.bfloat16}
    out = checkpoint_to_hf(ckpt, tmp_path / "hf")
    _assert_same_model(src, out)
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16
    # an fp32 export of bf16 weights (no masters in a weights checkpoint) is the exact upcast
    up = checkpoint_to_hf(ckpt, tmp_path / "hf32", dtype="float32")
    a, b = _tensors(src), _tensors(up)
    assert all(b[k].dtype == torch.float32 and torch.equal(b[k], a[k].float()) for k in a)
    assert json.loads((up / "config.json").read_text())["dtype"] == "float32"


def _save_sharded(src: Path, out: Path, *, loaded: bool) -> Path:
    """The weights of src saved by transformers in shards of SHARD bytes. transformers 5 cuts shards in
    module (state-dict) order for a model built with from_config, as hf3d does, but in natural name
    order for a model that from_pretrained loaded."""
    if loaded:
        model = AutoModelForCausalLM.from_pretrained(src)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
        model.load_state_dict(load_file(src / "model.safetensors"), strict=False)
        model.tie_weights()
    model.save_pretrained(out, max_shard_size=SHARD)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    return out


@pytest.mark.parametrize("family", ["llama-kvrep", "qwen3"])
def test_sharded_source_gives_the_same_shards(family_dirs, tmp_path, family):
    src = _save_sharded(family_dirs[family], tmp_path / "src", loaded=False)
    ckpt = hf_to_checkpoint(src, tmp_path / "ckpt")
    out = checkpoint_to_hf(ckpt, tmp_path / "hf", max_shard_size=str(SHARD))
    _assert_same_model(src, out)
    assert (src / "model.safetensors.index.json").read_bytes() == (out / "model.safetensors.index.json").read_bytes()
    # unsharded output of the same checkpoint: one file with every tensor
    single = checkpoint_to_hf(ckpt, tmp_path / "hf1")
    assert sorted(f.name for f in single.glob("*.safetensors")) == ["model.safetensors"]
    assert all(torch.equal(_tensors(single)[k], v) for k, v in _tensors(src).items())


def test_sharded_source_in_name_order(family_dirs, tmp_path):
    """A source sharded in another order: the same tensors, re-cut in module order."""
    src = _save_sharded(family_dirs["llama-kvrep"], tmp_path / "src", loaded=True)
    out = checkpoint_to_hf(hf_to_checkpoint(src, tmp_path / "ckpt"), tmp_path / "hf", max_shard_size="20KB")
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(a) and index["metadata"]["total_size"] == 4 * sum(
        v.numel() for v in a.values()
    )
    assert all(f.stat().st_size <= SHARD + 1000 for f in out.glob("model-*.safetensors"))  # + header


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_masters_are_read_for_float32(tmp_path):
    """A bf16 training checkpoint: --dtype float32 exports the fp32 masters, the default the bf16 params."""
    src = make_model_dir(tmp_path / "src", "llama")
    full = _tensors(src)
    masters = {k: v + 1e-4 * torch.randn_like(v) for k, v in full.items()}  # not representable in bf16
    state = {checkpoint.model_key(k): v.to(torch.bfloat16) for k, v in masters.items()}
    state.update({checkpoint.optim_key(checkpoint.MASTER_KEY, k): v for k, v in masters.items()})
    ckpt = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    (ckpt / "config.json").write_bytes((src / "config.json").read_bytes())
    checkpoint.write_marker(ckpt, dict(kind="training", step=7, dtype="bfloat16", model_type="llama", parallel={}))
    fp32 = _tensors(checkpoint_to_hf(ckpt, tmp_path / "fp32", dtype="float32"))
    bf16 = _tensors(checkpoint_to_hf(ckpt, tmp_path / "bf16"))
    for k, v in masters.items():
        assert torch.equal(fp32[k], v), k
        assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16)), k


# -- the writer itself ------------------------------------------------------------------------------
def test_writer_matches_save_file_and_loads(tmp_path):
    """Mixed dtypes and odd shapes: the streamed file equals safetensors' own save_file byte for byte."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5).to(torch.bfloat16),
        "a.weight": torch.randn(7),
        "c.scale": torch.tensor(2.5, dtype=torch.float16),
        "d.weight": torch.randn(2, 3, 4, dtype=torch.float64),
    }
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    config = AutoConfig.from_pretrained(make_model_dir(tmp_path / "m", "llama"))
    asked = []
    write_hf_dir(tmp_path / "out", specs, lambda n: asked.append(n) or tensors[n].clone(), config)
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert sorted(asked) == sorted(tensors) and len(asked) == len(tensors)
    assert not (tmp_path / "out.tmp-hf3d").exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("123") == 123
    assert parse_size("2GiB") == 2 * 2**30 and parse_size(7) == 7
    for bad in ("5 parsecs", "-1", "0", "GB"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


# -- command line -----------------------------------------------------------------------------------
def test_cli_to_hf_refuses_a_non_checkpoint(family_dirs, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hf3d", "convert", "to-hf", str(family_dirs["llama"]), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is not a complete hf3d checkpoint" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def _cli_error(argv: list[str], capsys) -> str:
    assert cli_main(argv) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_cli_from_hf_errors(family_dirs, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((family_dirs["llama"] / "config.json").read_bytes())
    assert "has no model.safetensors" in _cli_error(["convert", "from-hf", str(bare), str(tmp_path / "c1")], capsys)
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_bytes(bare.joinpath("config.json").read_bytes())
    torch.save(load_file(family_dirs["llama"] / "model.safetensors"), binary / "pytorch_model.bin")
    msg = _cli_error(["convert", "from-hf", str(binary), str(tmp_path / "c2")], capsys)
    assert "pytorch_model.bin" in msg and "safetensors" in msg and "save_pretrained" in msg
    # an incomplete checkpoint (no marker) and an output that would clobber an unrelated folder
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    (ckpt / checkpoint.MARKER).unlink()
    assert "not a complete hf3d checkpoint" in _cli_error(["convert", "to-hf", str(ckpt), str(tmp_path / "o")], capsys)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    msg = _cli_error(["convert", "from-hf", str(family_dirs["llama"]), str(other)], capsys)
    assert "choose a new output path" in msg and (other / "notes.txt").is_file()
    assert not list(tmp_path.glob("c[12]*"))


def test_conversion_scripts(family_dirs, tmp_path, monkeypatch):
    def script(name: str, *args) -> int:
        monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(REPO / "conversion" / name), run_name="__main__")
        return e.value.code

    src = tmp_path / "src"  # with tokenizer files, which must travel through the checkpoint
    shutil.copytree(family_dirs["qwen3"], src)
    for f in (REPO / "examples" / "tokenizer").iterdir():
        shutil.copyfile(f, src / f.name)
    assert script("convert_hf_to_hf3d.py", src, tmp_path / "ckpt") == 0
    assert script("convert_hf3d_to_hf.py", tmp_path / "ckpt", tmp_path / "hf", "--max-shard-size", "5GB") == 0
    _assert_same_model(src, tmp_path / "hf")
    for f in (REPO / "examples" / "tokenizer").iterdir():
        assert (tmp_path / "hf" / f.name).read_bytes() == f.read_bytes(), f.name
    assert script("convert_hf3d_to_hf.py", src, tmp_path / "x") == 1


# -- ParallelModel.save_pretrained streams, across ranks ---------------------------------------------
def _export_worker(dirs: dict, out: str) -> None:
    start_watchdog(120)
    res = {}
    cases = [("tp2-llama", "llama", dict(tp=2)), ("tp2-kvrep", "llama-kvrep", dict(tp=2))]
    cases += [("pp2-llama", "llama", dict(pp=2)), ("tp2-qwen3-sharded", "qwen3", dict(tp=2))]
    for name, family, pkw in cases:
        pm = hf3d.parallelize(dirs[family], hf3d.ParallelConfig(**pkw))
        pm.save_pretrained(Path(out) / name, max_shard_bytes=SHARD if "sharded" in name else 5 * 10**9)
    pm.save_pretrained(Path(out) / "tp2-qwen3-sharded", max_shard_bytes=SHARD)  # an export replaces its own
    try:  # an old export with a user's notes beside it: refused on every rank, nothing deleted
        pm.save_pretrained(dirs["export-with-notes"])
        res["notes_error"] = None
    except ValueError as e:
        res["notes_error"] = str(e)
    try:  # the lead's load_checkpoint reading a from-hf checkpoint into other weights
        pm = hf3d.parallelize(dirs["other-llama"], hf3d.ParallelConfig(tp=2))
        res["load_step"] = hf3d.load_checkpoint(dirs["llama-ckpt"], pm)
        pm.save_pretrained(Path(out) / "loaded-llama")
    except Exception as e:  # noqa: BLE001 - asserted on in the parent
        res["load_error"] = f"{type(e).__name__}: {e}"
    try:  # a bf16 dp=2 ZeRO-1 training checkpoint (each rank writes part of each bucket) and an export
        pm = hf3d.parallelize(dirs["llama-kvrep"], hf3d.ParallelConfig(), dtype=torch.bfloat16)
        rows = slice(2 * pm.dp_rank, 2 * pm.dp_rank + 2)
        _, _, opt = hf3d_run(pm, batches(1, 4, 8, VOCAB), rows, bucket_size=3000)
        hf3d.save_checkpoint(Path(out) / "train-ckpt", pm, opt, step=1)
        pm.save_pretrained(Path(out) / "train-export")
    except Exception as e:  # noqa: BLE001 - asserted on in the parent
        res["train_error"] = f"{type(e).__name__}: {e}"
    res["rank"] = dist.get_rank()
    report(res, Path(out) / "results.pt")


def test_parallel_save_pretrained_streams(family_dirs, tmp_path):
    sharded = _save_sharded(family_dirs["qwen3"], tmp_path / "qwen3-sharded", loaded=False)
    dirs = {k: str(v) for k, v in family_dirs.items()}
    dirs["other-llama"] = str(make_model_dir(tmp_path / "other", "llama", seed=1))
    dirs["llama-ckpt"] = str(hf_to_checkpoint(family_dirs["llama"], tmp_path / "llama-ckpt"))
    notes = files.make_dir(tmp_path / "export-with-notes", EXPORT)  # an export of hf3d's, then a user's notes
    shutil.copytree(family_dirs["llama"], notes, dirs_exist_ok=True)
    (notes / "my_notes.txt").write_text("keep me")
    dirs["export-with-notes"] = str(notes)
    spawn(_export_worker, 2, dirs, str(tmp_path))
    res = torch.load(tmp_path / "results.pt", weights_only=True)
    for r in res:  # rank 0 refuses; rank 1 hears it from rank 0
        assert f"{notes} holds 'my_notes.txt', which hf3d does not write there" in r["notes_error"], r
        assert "\n" not in r["notes_error"]
    assert (notes / "my_notes.txt").read_text() == "keep me"
    _assert_same_model(family_dirs["llama"], notes)
    assert not (tmp_path / "export-with-notes.tmp-hf3d").exists()
    for name, src in [
        ("tp2-llama", family_dirs["llama"]),
        ("tp2-kvrep", family_dirs["llama-kvrep"]),
        ("pp2-llama", family_dirs["llama"]),
        ("tp2-qwen3-sharded", sharded),
    ]:
        _assert_same_model(src, tmp_path / name)
    assert "load_error" not in res[0], res[0]["load_error"]
    assert res[0]["load_step"] == 0
    _assert_same_model(family_dirs["llama"], tmp_path / "loaded-llama")

    # to-hf of a 2-rank ZeRO-1 bf16 training checkpoint == the same model's save_pretrained, bit for bit
    assert "train_error" not in res[0], res[0]["train_error"]
    export = tmp_path / "train-export"
    _assert_same_model(export, checkpoint_to_hf(tmp_path / "train-ckpt", tmp_path / "train-hf"))
    fp32 = _tensors(checkpoint_to_hf(tmp_path / "train-ckpt", tmp_path / "train-hf32", dtype="float32"))
    ref = _tensors(export)
    assert all(fp32[k].dtype == torch.float32 and torch.equal(fp32[k].to(torch.bfloat16), ref[k]) for k in ref)
    assert not all(torch.equal(fp32[k], ref[k].float()) for k in ref)  # the fp32 masters, not an upcast


def _stage_writers_worker(model_dir: str, out: str) -> None:
    import hf3d.hf.export

    start_watchdog(180)
    written, received = [], []
    write_shard, recv = hf3d.hf.export.write_shard, dist.recv

    def recording_write(path, group, produce):
        written.append(Path(path).name)
        write_shard(path, group, produce)

    def recording_recv(tensor, src=None, group=None, **kw):
        received.append(src)
        return recv(tensor, src=src, group=group, **kw)

    hf3d.hf.export.write_shard, dist.recv = recording_write, recording_recv
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(pp=2, tp=2))
    pm.save_pretrained(Path(out) / "pp2-tp2-sharded", max_shard_bytes=SHARD)
    res = {"written": written, "received": list(received)}

    calls = []

    def full_disk(path, group, produce):  # the second stage's writer fails after its first file
        calls.append(path)
        if dist.get_rank() == 2 and len(calls) == 2:
            raise OSError(28, "No space left on device")
        write_shard(path, group, produce)

    hf3d.hf.export.write_shard = full_disk
    try:
        pm.save_pretrained(Path(out) / "failed", max_shard_bytes=SHARD)
    except (OSError, ValueError) as e:
        res["failure"] = f"{type(e).__name__}: {e}"
    res["failed_exists"] = (Path(out) / "failed").exists()
    report(res, Path(out) / "results.pt")


def test_a_sharded_pp2_export_is_written_by_each_stage(family_dirs, tmp_path):
    """At pp=2 x tp=2, each stage's first tp rank (global ranks 0 and 2) writes its own stage's shard
    files from the pieces of its tp peer (ranks 1 and 3); rank 0 receives nothing from the other stage
    and writes the index. Stock from_pretrained loads the result with the source's weights, bit for bit."""
    spawn(_stage_writers_worker, 4, str(family_dirs["llama"]), str(tmp_path))
    res = torch.load(tmp_path / "results.pt", weights_only=True)
    out = tmp_path / "pp2-tp2-sharded"
    files = sorted(f.name for f in out.glob("model-*.safetensors"))
    assert sorted(res[0]["written"] + res[2]["written"]) == files and res[0]["written"] and res[2]["written"]
    assert not res[1]["written"] and not res[3]["written"]
    assert set(res[0]["received"]) == {1} and set(res[2]["received"]) == {3}  # within a stage only
    assert not res[1]["received"] and not res[3]["received"]
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == set(files)
    stage1 = {name for f in res[2]["written"] for name in load_file(out / f)}
    assert stage1 and all(".layers.1." in n or n == "model.norm.weight" for n in stage1), sorted(stage1)
    a = AutoModelForCausalLM.from_pretrained(family_dirs["llama"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a writer other than rank 0 failing mid-stream: raised on every rank, nothing published
    assert res[2]["failure"].startswith("OSError") and "No space left" in res[2]["failure"]
    for rank in (0, 1, 3):
        assert res[rank]["failure"].startswith("ValueError: rank 2 could not write the HF directory"), res[rank]
    assert not any(r["failed_exists"] for r in res)


class _RunsCode:
    """A pickle that calls a function when it is loaded: what a crafted .metadata would hold."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def test_crafted_checkpoint_metadata_is_refused_without_running_code(family_dirs, tmp_path, capsys):
    """DCP's own reader unpickles .metadata with pickle.load; hf3d's reader takes only DCP's metadata
    classes and a few torch/pathlib values, so a .metadata that would run code is refused unread."""
    import pickle

    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    honest = (ckpt / ".metadata").read_bytes()
    ran = tmp_path / "code-ran"
    write_crafted(ckpt, ".metadata", pickle.dumps(_RunsCode(ran)))
    msg = _cli_error(["convert", "to-hf", str(ckpt), str(tmp_path / "out")], capsys)
    assert "refers to pathlib.Path.touch" in msg, msg
    assert "refusing to load it" in msg and not ran.exists() and not (tmp_path / "out").exists()
    write_crafted(ckpt, ".metadata", honest)  # the honest metadata still reads through the same reader
    assert cli_main(["convert", "to-hf", str(ckpt), str(tmp_path / "out")]) == 0
    _assert_same_model(family_dirs["llama"], tmp_path / "out")


def test_crafted_metadata_through_each_allowed_module_is_refused(family_dirs, tmp_path, capsys):
    """Every payload of tests/crafted.py (a dotted os.system under each module the reader takes names from,
    and other names of those modules) is refused by `convert to-hf` with one line; none runs."""
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    ran = tmp_path / "code-ran"
    for what, payload in payloads(ran).items():
        write_crafted(ckpt, ".metadata", payload)
        msg = _cli_error(["convert", "to-hf", str(ckpt), str(tmp_path / "out")], capsys)
        assert "refusing to load it" in msg and f"{ckpt}/.metadata refers to" in msg, (what, msg)
        assert not ran.exists() and not (tmp_path / "out").exists(), what


def test_crafted_stored_tensor_is_refused_without_running_code(family_dirs, tmp_path, capsys):
    """A stored box whose data.pkl calls os.system through a dotted name: the layout reader refuses it."""
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    ran = tmp_path / "code-ran"
    craft_stored_box(ckpt, global_pickle("torch._utils", "os.system", f"touch {ran}"))
    msg = _cli_error(["convert", "to-hf", str(ckpt), str(tmp_path / "out")], capsys)
    assert "__crafted.distcp at byte 0 refers to torch._utils.os.system" in msg and "refusing" in msg, msg
    assert not ran.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_data_file_outside_the_checkpoint_is_refused(family_dirs, tmp_path, capsys, where):
    """Metadata naming a data file by an absolute path or through '..' is refused before any file is opened
    (a real data file sits at that place, so a reader that follows the name would convert it)."""
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    outside = tmp_path / "outside.distcp"
    first = sorted(ckpt.glob("*.distcp"))[0]
    shutil.copyfile(first, outside)
    name = str(outside) if where == "absolute" else "../outside.distcp"

    def edit(metadata) -> None:
        for info in metadata.storage_data.values():
            if info.relative_path == first.name:
                info.relative_path = name

    rewrite_metadata(ckpt, edit)
    msg = _cli_error(["convert", "to-hf", str(ckpt), str(tmp_path / "out")], capsys)
    assert f"names the data file {name!r}, outside the checkpoint folder" in msg, msg
    assert not (tmp_path / "out").exists()


def test_every_writer_replaces_only_its_own_output(family_dirs, tmp_path, capsys):
    """to-hf replaces an earlier export and from-hf an earlier checkpoint; a user's file beside either, a
    subfolder or a link makes them refuse in one line, deleting nothing."""
    ckpt = hf_to_checkpoint(family_dirs["llama"], tmp_path / "ckpt")
    assert cli_main(["convert", "from-hf", str(family_dirs["llama"]), str(ckpt)]) == 0  # its own output
    out = checkpoint_to_hf(ckpt, tmp_path / "out")
    assert cli_main(["convert", "to-hf", str(ckpt), str(out)]) == 0
    _assert_same_model(family_dirs["llama"], out)
    for folder, argv in [
        (out, ["to-hf", str(ckpt), str(out)]),
        (ckpt, ["from-hf", str(family_dirs["llama"]), str(ckpt)]),
    ]:
        before = sorted(p.name for p in folder.iterdir())
        for extra in ("my_notes.txt", "subfolder", "link"):
            if extra == "subfolder":
                (folder / extra).mkdir()
            elif extra == "link":
                (folder / extra).symlink_to(family_dirs["llama"] / "config.json")
            else:
                (folder / extra).write_text("keep me")
            msg = _cli_error(["convert", *argv], capsys)
            assert f"{folder} holds {extra!r}, which hf3d does not write there" in msg, msg
            assert sorted(p.name for p in folder.iterdir()) == sorted([*before, extra])
            (folder / extra).rmdir() if extra == "subfolder" else (folder / extra).unlink()
    assert "is the input" in _cli_error(
        ["convert", "from-hf", str(family_dirs["llama"]), str(family_dirs["llama"])], capsys
    )


def test_a_linked_file_from_outside_the_source_is_not_copied(family_dirs, tmp_path, capsys):
    """A source folder whose tokenizer.json links to a file elsewhere (a key, a token): from-hf refuses it
    before writing anything, and so does parallelize, whose exports and checkpoints would copy it."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hf_secret")
    src = tmp_path / "src"
    shutil.copytree(family_dirs["llama"], src)
    (src / "tokenizer.json").symlink_to(secret)
    msg = _cli_error(["convert", "from-hf", str(src), str(tmp_path / "ckpt")], capsys)
    assert f"{src}/tokenizer.json is a link to {secret}, outside {src}" in msg, msg
    assert not list(tmp_path.glob("ckpt*"))
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(src / "config.json")  # a link inside the folder is copied as the file
    ckpt = hf_to_checkpoint(src, tmp_path / "ckpt")
    assert (ckpt / "tokenizer.json").read_bytes() == (src / "config.json").read_bytes()
