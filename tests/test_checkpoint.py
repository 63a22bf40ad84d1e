"""Training checkpoints (DESIGN decision 8): resume on the same mesh bit for bit, on another mesh within
float precision, across ZeRO stages and dtypes; atomic saves; clear refusals.

The oracle for a resumed run is the uninterrupted run on the same data: same mesh, CPU fp32 -> equal
bit for bit (losses, LR, grad norms, final weights); another mesh -> losses within rel 1e-6
(measured: 2.1e-7 at most over 3 resumed steps). Spawns: one world of 4 (save at (2,2,1) and (1,2,2)),
then one world of 2 (resume those at (1,1,2) and (2,1,1); ZeRO and bf16 cases), plus the `hf3d train`
loop on 2 processes with a writer killed mid-save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import MetadataIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asserts import assert_close  # noqa: E402
from crafted import fake_checkpoint, payloads, write_crafted  # noqa: E402
from dist import report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402
from reference import batches, oracle_adamw, train_losses  # noqa: E402

import hf3d  # noqa: E402
from hf3d import checkpoint  # noqa: E402
from hf3d.checkpoint import entries, save  # noqa: E402
from hf3d.optim import state as optim_state
from hf3d.utils import files  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ, STEPS, SAVE_AT = 4, 16, 6, 3
MESH_RTOL = 1e-6  # measured 2.1e-7 (fp32, 3 steps after a resume on another mesh)

SAVES = {  # name: ParallelConfig kwargs of the run that saves (world 4); a smollm3- name: that family
    "tp2-pp2": dict(tp=2, pp=2, num_microbatches=2),
    "pp2-dp2": dict(pp=2, num_microbatches=2),
    "smollm3-tp2-pp2": dict(tp=2, pp=2, num_microbatches=2),  # stage 0: a RoPE layer, stage 1: a NoPE one
}
RESUMES = {  # name: (checkpoint of SAVES, ParallelConfig kwargs, build_optimizer kwargs, dtype) (world 2)
    "tp2-pp2->dp2": ("tp2-pp2", dict(), dict(), torch.float32),
    "pp2-dp2->tp2": ("pp2-dp2", dict(tp=2), dict(), torch.float32),
    "smollm3-tp2-pp2->dp2": ("smollm3-tp2-pp2", dict(), dict(), torch.float32),
}


def _family(name: str) -> str:
    return "smollm3" if name.startswith("smollm3") else "llama"


def _opt(pm, **kw):
    return oracle_adamw(pm, **kw)


def _train(pm, opt, data) -> list[float]:
    return train_losses(pm, opt, data, BATCH)


def _masters(opt) -> list[torch.Tensor]:
    return [m.detach().clone() for _, m, _, _ in opt._masters]


def _steps(opt) -> list[tuple[str, str]]:
    return sorted({(str(st["step"].device), str(st["step"].dtype)) for st in opt.optimizer.state.values()})


def _step_placement(model_dir, ckpt: str) -> dict:
    """Where AdamW's step lands after a load through load_checkpoint and through opt.load_state_dict.
    With no GPU at hand, optim_state's placement rule is asked as if the masters lived on another
    device (meta stands in for CUDA): a fused optimizer's step must follow them on both paths."""
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = _opt(pm)  # fused=True: build_optimizer's default on CPU
    hf3d.load_checkpoint(ckpt, pm, opt)
    res = dict(fused=[g["fused"] for g in opt.optimizer.param_groups], cpu=_steps(opt), num_steps=opt.num_steps)
    sd, rule = opt.state_dict(), optim_state.step_tensor
    optim_state.step_tensor = lambda step, group, master: rule(step, group, master.to("meta"))
    try:
        for way in ("load_checkpoint", "load_state_dict"):  # each into a fresh optimizer
            pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
            opt = _opt(pm)
            if way == "load_checkpoint":
                hf3d.load_checkpoint(ckpt, pm, opt)
            else:
                opt.load_state_dict(sd)
            res[way] = _steps(opt)
    finally:
        optim_state.step_tensor = rule
    return res


# -- worker side ----------------------------------------------------------------------------------
def _save_world(dirs, out: str) -> None:
    start_watchdog(240)
    data, res = batches(STEPS, BATCH, SEQ, 101), {}
    for name, pkw in SAVES.items():
        pm = hf3d.parallelize(dirs[_family(name)], hf3d.ParallelConfig(**pkw))
        opt = _opt(pm)
        first = _train(pm, opt, data[:SAVE_AT])
        hf3d.save_checkpoint(f"{out}/{name}", pm, opt, step=SAVE_AT, extra={"note": name})
        res[name] = first + _train(pm, opt, data[SAVE_AT:])
    report(res, f"{out}/save.pt")


def _resume_world(dirs, out: str) -> None:
    start_watchdog(240)
    data, res = batches(STEPS, BATCH, SEQ, 101), {}
    for name, (src, pkw, okw, dtype) in RESUMES.items():
        pm = hf3d.parallelize(dirs[_family(name)], hf3d.ParallelConfig(**pkw), dtype=dtype)
        opt = _opt(pm, **okw)
        extra = {}
        step = hf3d.load_checkpoint(f"{out}/{src}", pm, opt, extra=extra)
        res[name] = dict(step=step, extra=extra, losses=_train(pm, opt, data[step:]))
    model_dir = dirs["llama"]

    # ZeRO-1 <-> ZeRO-0, and bf16 (fp32 masters differ from the bf16 params): same mesh, dp=2
    for name, save_kw, load_kw, dtype in (
        ("zero1->zero0", dict(zero_stage=1), dict(zero_stage=0), torch.float32),
        ("zero0->zero1", dict(zero_stage=0), dict(zero_stage=1), torch.float32),
        ("bf16", dict(), dict(), torch.bfloat16),
    ):
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(), dtype=dtype)
        opt = _opt(pm, **save_kw)
        _train(pm, opt, data[:SAVE_AT])
        hf3d.save_checkpoint(f"{out}/{name}", pm, opt, step=SAVE_AT)
        saved_masters, saved_params = _masters(opt), [p.detach().clone() for _, p in pm.unique_parameters()]
        rest = _train(pm, opt, data[SAVE_AT:])
        pm2 = hf3d.parallelize(model_dir, hf3d.ParallelConfig(), dtype=dtype)
        opt2 = _opt(pm2, **load_kw)
        step = hf3d.load_checkpoint(f"{out}/{name}", pm2, opt2)
        params_equal = all(torch.equal(a, p) for a, (_, p) in zip(saved_params, pm2.unique_parameters()))
        masters_equal = None
        if save_kw == load_kw:  # the same fragments on both sides
            masters_equal = all(torch.equal(a, b) for a, b in zip(saved_masters, _masters(opt2)))
        res[name] = dict(
            step=step,
            uninterrupted=rest,
            resumed=_train(pm2, opt2, data[step:]),
            params_equal=params_equal,
            masters_equal=masters_equal,
            aliased=opt2._aliased,
        )

    res["step_placement"] = _step_placement(model_dir, f"{out}/zero1->zero0")

    # a weights-only checkpoint: step 0, the optimizer left fresh
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = _opt(pm)
    _train(pm, opt, data[:1])
    hf3d.save_checkpoint(f"{out}/weights", pm, None, step=1)
    pm2 = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt2 = _opt(pm2)
    res["weights"] = dict(
        step=hf3d.load_checkpoint(f"{out}/weights", pm2, opt2),
        state=len(opt2.optimizer.state),
        params_equal=all(torch.equal(a, b) for (_, a), (_, b) in zip(pm.unique_parameters(), pm2.unique_parameters())),
    )
    report(res, f"{out}/resume.pt")


def _mismatch_world(dirs, out: str) -> None:
    start_watchdog(120)
    pm = hf3d.parallelize(dirs["llama"], hf3d.ParallelConfig())
    hf3d.save_checkpoint(f"{out}/llama", pm, _opt(pm), step=1)
    errors = {}
    for name in ("llama-3layers", "llama-vocab103", "qwen2"):
        other = hf3d.parallelize(dirs[name], hf3d.ParallelConfig())
        try:
            hf3d.load_checkpoint(f"{out}/llama", other, _opt(other))
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    try:
        hf3d.load_checkpoint(f"{out}/nothing-here", pm)
    except ValueError as e:
        errors["missing"] = str(e)
    crafted = {}  # load_checkpoint of the llama checkpoint with each crafted .metadata of tests/crafted.py
    for i, (what, payload) in enumerate(payloads(Path(out) / "code-ran").items()):
        shutil.copytree(f"{out}/llama", f"{out}/crafted-{i}")
        write_crafted(Path(f"{out}/crafted-{i}"), ".metadata", payload)
        try:
            hf3d.load_checkpoint(f"{out}/crafted-{i}", pm, _opt(pm))
            crafted[what] = "loaded"
        except Exception as e:  # noqa: BLE001 - asserted on in the parent
            crafted[what] = f"{type(e).__name__}: {e}"
    report({"errors": errors, "crafted": crafted}, f"{out}/mismatch.pt")


# -- parent side ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {f: make_model_dir(root / f, f) for f in ("llama", "smollm3")}
    spawn(_save_world, 4, dirs, str(root))
    spawn(_resume_world, 2, dirs, str(root))
    return dict(save=torch.load(root / "save.pt")[0], resume=torch.load(root / "resume.pt")[0], root=root)


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_on_another_mesh_continues_the_run(saved, name):
    src = RESUMES[name][0]
    got, want = saved["resume"][name], saved["save"][src][SAVE_AT:]
    assert got["step"] == SAVE_AT and got["extra"] == {"note": src}
    assert_close(got["losses"], want, rtol=MESH_RTOL, what=f"{name} resumed loss")


@pytest.mark.parametrize("name", ["zero1->zero0", "zero0->zero1"])
def test_resume_across_zero_stages(saved, name):
    got = saved["resume"][name]
    assert got["step"] == SAVE_AT and got["params_equal"]
    assert_close(got["resumed"], got["uninterrupted"], rtol=MESH_RTOL, what=f"{name} resumed loss")


def test_bf16_master_weights_are_restored_exactly(saved):
    got = saved["resume"]["bf16"]
    assert not got["aliased"]  # bf16 params: the fp32 masters are separate tensors
    assert got["params_equal"] and got["masters_equal"]
    assert got["resumed"] == got["uninterrupted"]  # bit for bit


def test_adamw_step_goes_where_its_kernel_reads_it(saved):
    """A fused (or capturable) AdamW reads `step` on the parameters' device: after a resume through
    load_checkpoint, as after opt.load_state_dict, it is there (before the shared rule, load_checkpoint
    left it on the CPU, where CUDA's fused kernel refuses it)."""
    got = saved["resume"]["step_placement"]
    assert set(got["fused"]) == {True} and got["num_steps"] == SAVE_AT
    assert got["cpu"] == [("cpu", "torch.float32")]
    assert got["load_checkpoint"] == got["load_state_dict"] == [("meta", "torch.float32")]


@pytest.mark.parametrize("group", [dict(fused=True), dict(capturable=True), dict(fused=False, capturable=False)])
def test_step_placement_rule_is_torchs(group):
    """optim_state.step_tensor places the step as torch's own Optimizer.load_state_dict does: on the
    parameter's device for fused and capturable kernels, on the CPU otherwise; float32, a scalar."""
    master = torch.empty(8, device="meta")
    got = optim_state.step_tensor(3, group, master)
    want = torch.optim.Optimizer._process_value_according_to_param_policy(
        master, torch.tensor(3.0), 0, [{"params": [0], **group}], "step"
    )
    assert (got.device, got.dtype, got.dim()) == (want.device, torch.float32, 0)


def test_a_box_is_written_as_its_own_bytes_without_a_copy():
    """A box (a view into a flat buffer) goes to torch.save as an alias on exactly its bytes: the record is
    the one of its clone, and no copy is made; a box of another dtype or layout is still copied."""
    import io

    flat = torch.arange(40, dtype=torch.float32)
    boxes = entries.Boxes([8, 4], torch.float32)
    boxes.add([0, 0], flat[6:22].view(4, 4))
    boxes.add([4, 0], flat[22:38].view(4, 4))
    planner = entries.SavePlanner()
    planner.state_dict = {"w": boxes}
    for off, box in boxes.boxes.items():
        item = planner.lookup_object(MetadataIndex("w", off))
        assert item.data_ptr() == box.data_ptr() and item.untyped_storage().nbytes() == box.numel() * 4
        mine, clone = io.BytesIO(), io.BytesIO()
        torch.save(item, mine)
        torch.save(box.clone(), clone)
        assert mine.getvalue() == clone.getvalue()
    bf16 = entries.Boxes([4, 4], torch.bfloat16)
    bf16.add([0, 0], flat[6:22].view(4, 4))
    strided = entries.Boxes([4, 2], torch.float32)
    strided.add([0, 0], flat[:16].view(4, 4)[:, :2])
    for obj in (bf16, strided):
        planner.state_dict = {"w": obj}
        item = planner.lookup_object(MetadataIndex("w", torch.Size([0, 0])))
        assert item.dtype == obj.dtype and item.untyped_storage().nbytes() == item.numel() * item.element_size()
        assert torch.equal(item.float(), next(iter(obj.boxes.values())).to(obj.dtype).float())


def test_large_boxes_are_written_from_their_memory_and_read_back(tmp_path, monkeypatch, direct_writes_from_memory):
    """Boxes of at least DirectFile.from_memory bytes (lowered here) are placed in phase with their memory and
    written from it; DCP's own reader and hf3d's mapped one read every box back, and the marker's CRC-32 is
    the file's. Boxes start at odd places in the flat buffer; a bf16 box is a copy, a small one is buffered."""
    import zlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from hf3d.checkpoint import checksums, writer
    from hf3d.checkpoint.stored import stored_box

    monkeypatch.setattr(checksums.DirectFile, "from_memory", 4096)
    from_memory = direct_writes_from_memory
    flat = torch.randn(3 * 3000 + 7)
    w = entries.Boxes([3000, 3], torch.float32)  # three boxes of 12,000 bytes at odd offsets
    for i in range(3):
        w.add([1000 * i, 0], flat[7 + 3000 * i : 7 + 3000 * (i + 1)].view(1000, 3))
    half = entries.Boxes([2000, 3], torch.bfloat16)  # copied to bf16: a storage of its own
    half.add([0, 0], flat[1 : 1 + 6000].view(2000, 3))
    small = entries.Boxes([10], torch.float32)
    small.add([0], flat[:10])
    state = {"w": w, "half": half, "small": small}
    out = writer.OneFileWriter(tmp_path, direct=True)
    dcp.save(state, storage_writer=out, planner=entries.SavePlanner(), no_dist=True)
    assert len(from_memory) == 4  # the three float32 boxes and the bf16 copy; not the small box
    [(name, written)] = out.file_table().items()
    assert written["crc32"] == zlib.crc32((tmp_path / name).read_bytes())
    want = {"w": flat[7 : 7 + 9000].view(3000, 3), "half": flat[1:6001].view(2000, 3).bfloat16(), "small": flat[:10]}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    metadata = FileSystemReader(tmp_path).read_metadata()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
        for index, info in metadata.storage_data.items():
            if index.fqn == k:
                shape = tuple(metadata.state_dict_metadata[k].chunks[0].sizes)
                box = stored_box(tmp_path / info.relative_path, info, v.dtype, shape)
                rows = index.offset[0]
                assert torch.equal(box, v[rows : rows + shape[0]]), (k, index.offset)


def test_a_tensor_of_a_layout_saved_before_is_written_as_torch_save_writes_it(tmp_path, monkeypatch):
    """From the second tensor of a layout on, the writer replays the bytes torch.save wrote around the first
    one's storage: every item is still torch.save's own bytes for its tensor (its records aligned as the
    writer asks: a page for a write from memory), and torch.save ran once per layout and alignment. Layouts
    of the same byte count (shape, dtype) differ; the same tensors go into a DirectFile, then a RunningFile."""
    import io

    from torch.utils.serialization import config

    from hf3d.checkpoint import checksums, writer

    monkeypatch.setattr(checksums.DirectFile, "from_memory", 4096)  # 4 KiB and up: written from memory
    monkeypatch.setattr(writer, "_SAVED", writer._SavedBytes())
    saves = []
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: (saves.append(obj.shape), save(obj, f))[1])
    g = torch.Generator().manual_seed(0)
    tensors = [
        *(torch.randn(40, 30, generator=g) for _ in range(2)),  # 4,800 bytes: from memory in a DirectFile
        torch.randn(30, 40, generator=g),
        torch.randint(0, 9, (40, 30), dtype=torch.int32, generator=g),
        *(torch.randn(4, 6, generator=g).bfloat16() for _ in range(2)),  # 48 bytes: buffered
        torch.randn(6, 4, generator=g).bfloat16(),
        torch.randn(12, generator=g),
    ]
    for direct in (True, False):
        out = checksums.open_checksummed(tmp_path / f"items-{direct}", direct=direct)
        spans = []
        with writer._without_record_crc():
            for t in tensors:
                start = writer._save_tensor(t, out)
                spans.append((start, out.tell()))
                out.write(bytes(-out.tell() % writer.ALIGN))
        out.finish().result()
        data = (tmp_path / f"items-{direct}").read_bytes()
        for t, (start, stop) in zip(tensors, spans):
            large = direct and t.untyped_storage().nbytes() >= 4096
            want = io.BytesIO()
            alignment = checksums.PAGE if large else config.save.storage_alignment
            with writer._without_record_crc(), config.patch({"save.storage_alignment": alignment}):
                save(t, want)
            assert data[start:stop] == want.getvalue(), (direct, tuple(t.shape), t.dtype)
            assert torch.equal(torch.load(io.BytesIO(data[start:stop])), t)
    assert len(saves) == 6 + 3  # 6 layouts; the 3 large ones again at the RunningFile's alignment


def test_weights_only_checkpoint_leaves_the_optimizer_fresh(saved):
    got = saved["resume"]["weights"]
    assert got == dict(step=0, state=0, params_equal=True)
    meta = checkpoint.read_marker(saved["root"] / "weights")
    assert meta["kind"] == "weights" and meta["optim"] is None


def test_every_owned_element_is_written_once_under_hf_names(saved):
    """DCP's metadata: each HF tensor once, at its global unpadded shape (vocab 101 is padded under
    tp=2), and DCP's own plan check refused overlaps and gaps at save time."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(saved["root"] / "tp2-pp2").read_metadata().state_dict_metadata
    stock = load_file(saved["root"] / "llama" / "model.safetensors")
    assert {k for k in md if k.startswith("model/")} == {f"model/{k}" for k in stock}
    for k, t in stock.items():
        assert tuple(md[f"model/{k}"].size) == tuple(t.shape)
        assert tuple(md[f"optim/exp_avg/{k}"].size) == tuple(t.shape)
    assert not any(k.startswith("optim/master/") for k in md)  # fp32 params are their own masters


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("mismatch")
    dirs = {
        "llama": make_model_dir(tmp_path / "a", "llama"),
        "llama-3layers": make_model_dir(tmp_path / "b", "llama", num_hidden_layers=3),
        "llama-vocab103": make_model_dir(tmp_path / "c", "llama", vocab_size=103),
        "qwen2": make_model_dir(tmp_path / "d", "qwen2"),
    }
    spawn(_mismatch_world, 1, dirs, str(tmp_path))
    return {"root": tmp_path, **torch.load(tmp_path / "mismatch.pt")[0]}


def test_a_checkpoint_of_another_shape_is_refused(mismatch):
    errors = mismatch["errors"]
    assert "num_hidden_layers=2 (model has 3)" in errors["llama-3layers"]
    assert "vocab_size=101 (model has 103)" in errors["llama-vocab103"]
    assert "model_type='llama' (model has 'qwen2')" in errors["qwen2"]
    assert all("\n" not in e for e in errors.values())
    assert "is not a directory" in errors["missing"]


def test_crafted_metadata_is_refused_by_load_checkpoint(mismatch):
    """What `hf3d train` with model.path or checkpoint.resume at a crafted folder reads: refused, nothing runs."""
    assert mismatch["crafted"].keys() == payloads(Path("x")).keys()
    for what, error in mismatch["crafted"].items():
        assert error.startswith("ValueError: ") and "\n" not in error, (what, error)
        assert "/.metadata refers to" in error and "refusing to load it" in error, (what, error)
    assert not (mismatch["root"] / "code-ran").exists()


def test_resume_picks_only_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint.find_resume(root) is None  # nothing yet: a fresh start
    (root / "step_5.tmp").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"none is complete \(step_5.tmp\)"):
        checkpoint.resolve_resume("auto", root)
    for n in (2, 4):
        fake_checkpoint(root / f"step_{n}", n)
    (root / "step_6").mkdir()  # renamed but never marked complete
    assert checkpoint.resolve_resume("auto", root) == root / "step_4"
    assert checkpoint.resolve_resume(str(root), root) == root / "step_4"
    assert checkpoint.resolve_resume(str(root / "step_2"), root) == root / "step_2"
    assert checkpoint.resolve_resume("none", root) is None
    with pytest.raises(ValueError, match="neither a complete checkpoint"):
        checkpoint.resolve_resume(str(root / "step_6"), root)
    checkpoint.finish_save(root, keep_last=1, published=root / "step_4")
    assert (root / "latest").read_text().strip() == "step_4" and not (root / "step_2").exists()


def test_a_damaged_checkpoint_is_found_by_its_marker(tmp_path):
    """The marker records each file's size and CRC-32: a missing file, a truncated one and one rewritten
    at the same size are each named; a marker without the table (older checkpoints) is not verified."""
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (ckpt / "config.json").write_text("{}")
    checkpoint.write_marker(ckpt, {"kind": "training", "step": 1})
    meta = checkpoint.read_marker(ckpt)
    assert meta["files"]["__0_0.distcp"]["size"] == 16384 and checkpoint.find_damage(ckpt, meta) is None
    data = ckpt / "__0_0.distcp"
    data.write_bytes(bytes(range(256)) * 63 + bytes(range(255, -1, -1)))  # same size, other bytes
    assert checkpoint.find_damage(ckpt, meta) == "__0_0.distcp does not match the checksum written with it"
    os.truncate(data, 100)
    assert checkpoint.find_damage(ckpt, meta) == "__0_0.distcp has 100 bytes where 16384 were written"
    data.write_bytes(bytes(range(256)) * 64)
    assert checkpoint.find_damage(ckpt, meta) is None
    (ckpt / "config.json").unlink()
    assert checkpoint.find_damage(ckpt, meta) == "config.json is missing"
    assert checkpoint.find_damage(ckpt, {k: v for k, v in meta.items() if k != "files"}) is None


# -- `hf3d train`: 10 steps == 5 + (killed while saving step 10) + resume + 5 ----------------------
TRAIN = [
    "run.steps=10",
    "run.global_batch=4",
    "data.seq_len=32",
    "optim.warmup_steps=3",
    "checkpoint.every=5",
    "checkpoint.keep_last=0",
]


def _train_world(out: str, kill_at: int | None, sigterm_after: int | None = None, *overrides: str) -> None:
    from hf3d.train.trainer import TrainConfig, train

    start_watchdog(240)
    if kill_at is not None:  # die the moment the checkpoint of step kill_at would be marked complete
        write_marker = checkpoint.write_marker

        def dying(tmp, meta):
            if meta["step"] == kill_at and dist.get_rank() == 0:
                os._exit(9)
            write_marker(tmp, meta)

        save.write_marker = dying
    if sigterm_after is not None:  # rank 1 alone is told to stop, during step sigterm_after
        from hf3d.model import ParallelModel

        train_step = ParallelModel.train_step
        calls = []

        def signalled(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == sigterm_after and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return train_step(self, *args, **kwargs)

        ParallelModel.train_step = signalled
    os.chdir(ROOT)
    train(TrainConfig.from_yaml("examples/configs/tiny-smollm.yaml", TRAIN + [f"run.output_dir={out}", *overrides]))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted `hf3d train` run the interrupted ones must equal."""
    out = tmp_path_factory.mktemp("straight")
    spawn(_train_world, 2, str(out), None)
    return out


def _same_run(a: Path, b: Path) -> None:
    ma, mb = _metrics(a), _metrics(b)
    assert [r["step"] for r in mb] == list(range(1, 11))  # each step once, the re-done ones replaced
    for key in ("loss", "lr", "grad_norm", "tokens"):
        assert [r[key] for r in ma] == [r[key] for r in mb], key
    fa, fb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


ASYNC = {"sync": (), "async": ("checkpoint.async=true",)}


@pytest.mark.parametrize("mode", list(ASYNC))
def test_sigterm_checkpoints_the_step_and_resumes_bit_for_bit(tmp_path, straight, mode):
    """SIGTERM on one rank during step 4: every rank finishes step 4, step_4 is saved, the run exits
    with 143; the run folder is moved (`mv runs/stopped elsewhere/stopped`), and resume: auto there ends exactly
    where the uninterrupted run ends. With checkpoint.async the stop waits for the write (step_4 complete when
    the run has exited); the resumed run saves in the background and still equals the synchronous uninterrupted
    run."""
    out, moved = tmp_path / "runs" / "stopped", tmp_path / "elsewhere" / "stopped"
    with pytest.raises(mp.ProcessExitedException) as e:
        spawn(_train_world, 2, str(out), None, 4, *ASYNC[mode])
    assert e.value.exit_code == 143
    assert checkpoint.resolve_resume("auto", out / "checkpoints") == out / "checkpoints" / "step_4"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    moved.parent.mkdir()
    os.rename(out, moved)
    spawn(_train_world, 2, str(moved), None, None, *ASYNC[mode])
    _same_run(straight, moved)
    assert files.owner_record(moved, files.RUN_FILE)["parent_inode"] == moved.parent.stat().st_ino  # claimed there


@pytest.mark.parametrize("mode", list(ASYNC))
def test_train_resumes_bit_for_bit_after_a_writer_dies_mid_save(tmp_path, straight, mode):
    """Rank 0 dies as step 10's marker would be written (in the background with checkpoint.async)."""
    killed = tmp_path / "killed"
    with pytest.raises(mp.ProcessExitedException):
        spawn(_train_world, 2, str(killed), 10, None, *ASYNC[mode])
    ckpts = killed / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_10.tmp", "step_5"]
    assert checkpoint.resolve_resume("auto", ckpts) == ckpts / "step_5"
    # step 10 died in its save: its record is written first, and the resumed run drops what follows step 5
    assert [r["step"] for r in _metrics(killed)] == list(range(1, 11))

    spawn(_train_world, 2, str(killed), None, None, *ASYNC[mode])  # resume: auto
    _same_run(straight, killed)
    assert not (ckpts / "step_10.tmp").exists() and checkpoint.is_complete(ckpts / "step_10")
    assert (ckpts / "latest").read_text().strip() == "step_10"


def test_auto_resume_passes_over_a_damaged_newest_checkpoint(tmp_path, straight, capfd):
    """A copy (`cp -r`) of the uninterrupted run's folder with step_10's largest file cut in half (its marker
    intact): the same command with resume: auto warns once, naming the file, and retrains steps 6-10 from
    step_5, exactly. The copy is a run of its own: its checkpoints and export are its own (replaced, rotated)."""
    out = tmp_path / "damaged"
    shutil.copytree(straight, out, symlinks=True)
    largest = max((out / "checkpoints" / "step_10").iterdir(), key=lambda f: f.stat().st_size)
    size = largest.stat().st_size
    os.truncate(largest, size // 2)
    capfd.readouterr()
    spawn(_train_world, 2, str(out), None)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("hf3d: warning") or "damaged" in line]
    assert warnings == [
        f"hf3d: warning: skipping the damaged checkpoint {largest.parent}: {largest.name} has {size // 2} bytes "
        f"where {size} were written; trying step_5"
    ], err[-2000:]
    assert "Traceback" not in err
    _same_run(straight, out)
    assert checkpoint.find_damage(largest.parent, checkpoint.read_marker(largest.parent)) is None  # saved again
    runs = [files.owner_record(d, files.RUN_FILE)["run"] for d in (straight, out)]
    assert runs[0] != runs[1]  # a copy and its original: two runs
    for d in (out / "final", out / "checkpoints" / "step_5", out / "checkpoints" / "step_10"):
        assert files.origin(d) == "here" and files.owner_record(d)["run"] == runs[1], d
