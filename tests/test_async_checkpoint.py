"""Asynchronous checkpoints (`save_checkpoint(..., async_=True)`, `checkpoint.async: true`).

The oracle is the synchronous save of the same state: the background write must produce the same bytes
(every file but DCP's .metadata, which records its own path) even though the next step runs before the
write begins (on a CPU the write reads the live state, and the optimizer's update waits for it), and a
resume from it must continue bit for bit. A save without an optimizer writes a copy taken before it
returns, so a step taken before its write begins does not change what it writes. Around it: nothing is published
before the marker (no folder, no `latest`), a second save waits for the first, and a background failure
raises one CheckpointWriteError on every rank with nothing published.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemReader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402
from reference import batches, oracle_adamw, train_losses  # noqa: E402

import hf3d  # noqa: E402
from hf3d import checkpoint  # noqa: E402
from hf3d.checkpoint import entries as ckpt_entries  # noqa: E402
from hf3d.checkpoint import save  # noqa: E402
from hf3d.checkpoint.writer import OneFileWriter  # noqa: E402

BATCH, SEQ, SAVE_AT, STEPS = 4, 16, 2, 5
MESHES = {"dp2": dict(), "pp2": dict(pp=2, num_microbatches=2)}


def _opt(pm):
    return oracle_adamw(pm)


def _train(pm, opt, data) -> list[float]:
    return train_losses(pm, opt, data, BATCH)


def _held_until(fn, event: threading.Event, seen: list | None = None):
    """fn, waiting for `event` first (the background thread stops there until the test lets it go)."""

    def held(*args, **kwargs):
        if seen is not None:
            seen.append(args)
        assert event.wait(60), "the test never let the background write go on"
        return fn(*args, **kwargs)

    return held


def _async_world(model_dir: str, out: str) -> None:
    start_watchdog(240)
    data, res, rank = batches(STEPS, BATCH, SEQ, 101), {}, dist.get_rank()
    plan, write_marker = ckpt_entries.SavePlanner.create_local_plan, checkpoint.write_marker
    for name, pkw in MESHES.items():
        root = Path(out) / name
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**pkw))
        opt = _opt(pm)
        first = _train(pm, opt, data[:SAVE_AT])
        hf3d.save_checkpoint(root / "sync", pm, opt, step=SAVE_AT, extra={"note": name})
        # the background write begins 1 s after the save returned (planning held), while the next step
        # runs (its update must wait until the write has read the state), and rank 0's marker waits
        # until the checks below have looked at the folders
        planned, marked = threading.Event(), threading.Event()
        ckpt_entries.SavePlanner.create_local_plan = _held_until(plan, planned)
        save.write_marker = _held_until(write_marker, marked)
        published = []
        pending = hf3d.save_checkpoint(
            root / "async", pm, opt, step=SAVE_AT, extra={"note": name}, async_=True,
            after_publish=lambda seen=published, final=root / "async": seen.append(checkpoint.is_complete(final)),
        )  # fmt: skip
        threading.Timer(1.0, planned.set).start()
        rest = _train(pm, opt, data[SAVE_AT:])
        while rank == 0 and not checkpoint.staging_dir(root / "async").joinpath(".metadata").is_file():
            time.sleep(0.01)  # every rank's files are written once DCP's metadata is
        before = dict(
            done=pending.done(), final=(root / "async").exists(), tmp=checkpoint.staging_dir(root / "async").is_dir()
        )
        marked.set()
        res[name] = dict(before=before, path=str(pending.result()), after_publish=published, uninterrupted=first + rest)
        ckpt_entries.SavePlanner.create_local_plan, save.write_marker = plan, write_marker
        sync, done = checkpoint.read_marker(root / "sync"), checkpoint.read_marker(root / "async")
        # byte for byte but DCP's .metadata (it records its path) and the RNG files (the dropout stream's
        # state_dict records its lazily drawn seed only from its second call on): those compared by value
        same = (".metadata", f"rng_{rank}.pt", f"rng_{1 - rank}.pt")
        res[name]["files"] = {k: (v, done["files"].get(k)) for k, v in sync["files"].items() if k not in same}
        rngs = [torch.load(root / d / f"rng_{rank}.pt", weights_only=True) for d in ("sync", "async")]
        res[name]["rng"] = [
            torch.equal(rngs[0][k], rngs[1][k]) if k == "torch" else rngs[0][k] == rngs[1][k]
            for k in ("torch", "python")
        ] + [torch.equal(rngs[0]["dropout"]["state"], rngs[1]["dropout"]["state"])]
        res[name]["markers"] = (
            {k: v for k, v in sync.items() if k != "files"},
            {k: v for k, v in done.items() if k != "files"},
        )
        pm2 = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**pkw))
        opt2 = _opt(pm2)
        extra: dict = {}
        step = hf3d.load_checkpoint(root / "async", pm2, opt2, extra=extra)
        res[name].update(step=step, extra=extra, resumed=first + _train(pm2, opt2, data[step:]))

    # a second save waits for the first: its staging folder is made only once the first is published
    pm, opt = hf3d.parallelize(model_dir, hf3d.ParallelConfig()), None
    opt = _opt(pm)
    # without an optimizer, the save returns once a copy is taken: a step before its write begins changes
    # nothing in it
    hf3d.save_checkpoint(Path(out) / "weights", pm, step=0)
    planned = threading.Event()
    ckpt_entries.SavePlanner.create_local_plan = _held_until(plan, planned)
    pending = hf3d.save_checkpoint(Path(out) / "weights_async", pm, step=0, async_=True)
    _train(pm, opt, data[:1])
    planned.set()
    pending.result()
    ckpt_entries.SavePlanner.create_local_plan = plan
    files = [checkpoint.read_marker(Path(out) / d)["files"] for d in ("weights", "weights_async")]
    res["weights_only"] = {k: (v, files[1].get(k)) for k, v in files[0].items() if k.endswith(".distcp")}
    marked, seen = threading.Event(), []
    save.write_marker = _held_until(write_marker, marked)
    make_dir = save.files_.make_dir  # the second save stages only once the first one is published
    save.files_.make_dir = lambda p, kind: (seen.append((p.name, checkpoint.is_complete(Path(out) / "one"))),
                                                  make_dir(p, kind))[1]  # fmt: skip
    hf3d.save_checkpoint(Path(out) / "one", pm, opt, step=1, async_=True)
    threading.Timer(0.5, marked.set).start()
    hf3d.save_checkpoint(Path(out) / "two", pm, opt, step=2)
    save.files_.make_dir = make_dir
    res["overlap"] = [s for s in seen if s[0] == "two.tmp"]

    # a background failure on rank 0 (after every rank wrote its files), over a checkpoint published before at
    # the same path: raised on every rank alike, nothing published, the earlier checkpoint kept. Rank 1 looks
    # slowly at the folder, if at all: rank 0 removes the staging folder meanwhile
    def full_disk(tmp, meta):
        raise OSError(28, "No space left on device")

    hf3d.save_checkpoint(Path(out) / "three", pm, opt, step=3)
    is_complete = checkpoint.is_complete
    if rank == 1:
        checkpoint.is_complete = lambda path: (time.sleep(0.5), is_complete(path))[1]
    save.write_marker = full_disk if rank == 0 else write_marker
    pending = hf3d.save_checkpoint(Path(out) / "three", pm, opt, step=33, async_=True)
    try:
        pending.result()
        res["failure"] = None
    except ValueError as e:
        res["failure"] = f"{type(e).__name__}: {e}"
    save.write_marker, checkpoint.is_complete = write_marker, is_complete
    res["failure_left"] = sorted(p.name for p in Path(out).iterdir() if p.name.startswith("three"))
    res["failure_kept_step"] = checkpoint.read_marker(Path(out) / "three")["step"]

    # what follows the publication fails (rank 0's `latest`): raised on every rank, the checkpoint kept
    def no_latest():
        raise OSError(28, "No space left on device")

    pending = hf3d.save_checkpoint(Path(out) / "four", pm, opt, step=4, async_=True, after_publish=no_latest)
    try:
        pending.result()
        res["after_failure"] = None
    except ValueError as e:
        res["after_failure"] = f"{type(e).__name__}: {e}"
    res["four_complete"] = checkpoint.is_complete(Path(out) / "four")

    # two models of one shape, bf16 then fp16 (the same entries), each saved twice in this process: a model's
    # later saves reuse its save plans (DCP compares plans without dtypes), and each checkpoint loads back as it was
    res["dtypes"] = []
    for dtype in (torch.bfloat16, torch.float16):
        m = hf3d.parallelize(model_dir, hf3d.ParallelConfig(), dtype=dtype)
        o = _opt(m)
        _train(m, o, data[:1])
        for i in range(2):
            hf3d.save_checkpoint(Path(out) / f"{dtype}-{i}", m, o, step=i, async_=True).result()
            back = hf3d.parallelize(model_dir, hf3d.ParallelConfig(), dtype=dtype)
            try:
                hf3d.load_checkpoint(Path(out) / f"{dtype}-{i}", back, _opt(back))
            except (Exception, CheckpointException) as e:  # metadata of another dtype: the bytes are refused
                res["dtypes"].append(str(e)[:300])
                continue
            pairs = zip(m.unique_parameters(), back.unique_parameters())
            res["dtypes"].append(all(torch.equal(a, b) and b.dtype == dtype for (_, a), (_, b) in pairs))
    report(res, Path(out) / "res.pt")


def _two_ranks(tmp_path_factory, name: str, world) -> list:
    """What `world` reported from 2 processes that share a tiny Llama."""
    root = tmp_path_factory.mktemp(name)
    model_dir = make_model_dir(root / "model", "llama")
    spawn(world, 2, str(model_dir), str(root))
    return torch.load(root / "res.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _two_ranks(tmp_path_factory, "async", _async_world)


@pytest.mark.parametrize("name", list(MESHES))
def test_async_save_writes_the_state_of_its_step_while_training_goes_on(results, name):
    got = results[0][name]
    # on rank 0, with every rank's files written: nothing is published before the marker
    assert got["before"] == dict(done=False, final=False, tmp=True)
    assert got["after_publish"] == [True]  # rank 0 runs it once, after the folder is published
    assert all(r[name]["after_publish"] == [] for r in results[1:])
    sync_marker, async_marker = got["markers"]
    assert sync_marker == async_marker
    assert got["files"] and all(a == b for a, b in got["files"].values()), got["files"]
    assert got["step"] == SAVE_AT and got["extra"] == {"note": name}
    assert all(r[name]["rng"] == [True, True, True] for r in results)
    for r in results:  # every rank: the resumed run is the uninterrupted one, bit for bit
        assert r[name]["resumed"] == r[name]["uninterrupted"]


def test_a_save_without_an_optimizer_writes_the_parameters_of_its_call(results):
    for r in results:
        assert r["weights_only"] and all(a == b for a, b in r["weights_only"].values()), r["weights_only"]


def test_saves_never_overlap(results):
    assert results[0]["overlap"] == [("two.tmp", True)]


def test_a_background_failure_is_raised_on_every_rank_alike_and_publishes_nothing(results):
    messages = [r["failure"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert messages[0].startswith("CheckpointWriteError: could not write the checkpoint ") and "/three (" in messages[0]
    assert "No space left on device" in messages[0] and "make room on that disk" in messages[0]
    assert results[0]["failure_left"] == ["three"] and results[0]["failure_kept_step"] == 3


def test_each_model_keeps_its_own_save_plans(results):
    assert results[0]["dtypes"] == [True] * 4 and results[1]["dtypes"] == [True] * 4


def test_checkpoint_async_is_a_yaml_key_and_survives_the_resolved_config(tmp_path):
    """`async` is a Python keyword: the field is `async_`, the YAML key (and the saved config.yaml) `async`."""
    import yaml

    from hf3d.train.config import TrainConfig

    cfg = TrainConfig.from_yaml(None, ["checkpoint.async=true"])
    assert cfg.checkpoint.async_ is True and TrainConfig.from_yaml(None, []).checkpoint.async_ is False
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert cfg.to_dict()["checkpoint"]["async"] is True and "async_" not in cfg.to_dict()["checkpoint"]
    assert TrainConfig.from_yaml(str(saved)) == cfg
    with pytest.raises(ValueError, match="^checkpoint.async must be true or false, got 'soon'"):
        TrainConfig.from_yaml(None, ["checkpoint.async=soon"])
    with pytest.raises(ValueError, match="unknown key 'async_' in checkpoint; did you mean 'async'"):
        TrainConfig.from_yaml(None, ["checkpoint.async_=true"])


def test_a_failure_after_the_publication_says_the_checkpoint_is_there(results):
    messages = [r["after_failure"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert (
        messages[0].startswith("CheckpointWriteError: ")
        and "/four was published, but what follows it failed: " in messages[0]
    )
    assert "rank 0: OSError: [Errno 28] No space left on device" in messages[0]
    assert all(r["four_complete"] for r in results)


def _boxes(pm, opt) -> dict:
    """Copies of every box this rank's checkpoint holds (the parameters and the optimizer's state)."""
    entries = ckpt_entries.state_entries(pm, opt)
    return {(k, tuple(off)): t.clone() for k, e in entries.items() for off, t in e.boxes.items()}


def _loads_as(model_dir: str, path: Path, saved: dict) -> bool:
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = _opt(pm)
    hf3d.load_checkpoint(path, pm, opt)
    got = _boxes(pm, opt)
    return got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)


def _replay_world(model_dir: str, out: str) -> None:
    """A model's later async saves write its last save's recorded writes again while its entries and boxes
    stay where they were; anything new or moved goes back through DCP."""
    start_watchdog(240)
    data, res, root = batches(4, BATCH, SEQ, 7), {"replays": []}, Path(out)
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = _opt(pm)

    def save(name: str, step: int, beside=None) -> None:
        pending = hf3d.save_checkpoint(root / name, pm, opt, step=step, async_=True)
        if beside is not None:
            _train(pm, opt, beside)  # its update waits until the write has read the state
        pending.result()
        res["replays"].append(pm._background_saver.replays)

    save("a", 0)  # records torch.save's layouts
    save("b", 0)  # records the writes (no optimizer state yet)
    _train(pm, opt, data[:1])  # the optimizer's state now exists: new entries, so DCP again
    saved = _boxes(pm, opt)
    save("c", 1)
    save("d", 1)  # nothing moved: c's writes again, the same bytes
    tables = [checkpoint.read_marker(root / n)["files"] for n in "cd"]
    res["files"] = {k: (v, tables[1].get(k)) for k, v in tables[0].items() if k.endswith(".distcp")}
    meta = [FileSystemReader(root / n).read_metadata() for n in "cd"]
    res["metadata"] = [
        meta[0].state_dict_metadata == meta[1].state_dict_metadata,
        meta[0].storage_data == meta[1].storage_data,
        meta[0].storage_meta.save_id != meta[1].storage_meta.save_id,
    ]
    res["c"] = _loads_as(model_dir, root / "c", saved)
    saved = _boxes(pm, opt)
    save("e", 2, beside=data[1:2])
    res["e"] = _loads_as(model_dir, root / "e", saved)
    # a replay that fails on rank 1: raised on every rank, nothing published
    from hf3d.checkpoint.writer import OneFileWriter

    replay = OneFileWriter.replay

    def full_disk(self, *args):
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 1:
        OneFileWriter.replay = full_disk
    try:
        save("f", 3)
        res["failure"] = None
    except ValueError as e:
        res["failure"] = f"{type(e).__name__}: {e}"
        res["replays"].append(pm._background_saver.replays)
    OneFileWriter.replay = replay
    res["f"] = sorted(p.name for p in root.iterdir() if p.name.startswith("f"))
    report(res, Path(out) / "res.pt")


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    return _two_ranks(tmp_path_factory, "replay", _replay_world)


def test_a_save_of_unmoved_state_replays_the_last_one_and_writes_the_same_bytes(replayed):
    for r in replayed:
        # a: layouts recorded; b: writes recorded; c: new entries (the optimizer's state), DCP again; d, e:
        # replayed (e beside a training step); f: replayed, and failed
        assert r["replays"] == [0, 0, 0, 1, 2, 3], r["replays"]
        assert r["files"] and all(a == b for a, b in r["files"].values()), r["files"]
        assert r["metadata"] == [True, True, True]  # DCP's metadata but its own save id
        assert r["c"] and r["e"]  # every box of the parameters and the optimizer's state, exactly


def test_a_replay_that_fails_is_raised_on_every_rank_and_publishes_nothing(replayed):
    messages = [r["failure"] for r in replayed]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "rank 1: OSError: [Errno 28] No space left on device" in messages[0]
    assert replayed[0]["f"] == []


# -- saves that copy: the arena, the plan and the writer process, made before the first save ------------------
def _prepared_world(model_dir: str, out: str) -> None:
    """Saves that copy (here: without an optimizer, as a GPU save copies) after prepare_async_save: they copy
    into the arena made then, one page-aligned place per box this rank writes; the staging thread makes the
    entries it copies, not the training thread; DCP plans on the background thread only, and only once (at
    the prepare), not per save; the writer process writes every data file, this process none; and each save
    restores exactly."""
    start_watchdog(120)
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    planned_on, written_here = [], []
    plan, write_data, replay = (
        ckpt_entries.SavePlanner.create_local_plan,
        OneFileWriter.write_data,
        OneFileWriter.replay,
    )

    def planning(self):
        planned_on.append(threading.current_thread() is threading.main_thread())
        return plan(self)

    def writing(self, *args):
        if type(self) is OneFileWriter:  # a Rehearsal writes nothing
            written_here.append(dist.get_rank())
        return write_data(self, *args)

    ckpt_entries.SavePlanner.create_local_plan, OneFileWriter.write_data = planning, writing
    OneFileWriter.replay = lambda self, *a: (written_here.append(dist.get_rank()), replay(self, *a))[1]
    entries_of, entries_on = save.entries_of, []
    save.entries_of = lambda *a: (entries_on.append(threading.current_thread() is threading.main_thread()),
                                  entries_of(*a))[1]  # fmt: skip
    checkpoint.prepare_async_save(pm)
    saver = pm._background_saver
    arena, entries = saver.stager.arena, ckpt_entries.state_entries(pm, None)
    res = {"boxes": sum(len(e.boxes) for e in entries.values()), "places": len(saver.stager.places)}
    res["child"] = saver.process.alive() and saver.process.child.pid != os.getpid()
    fresh = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    res["restored"], res["plans"] = [], []
    for i in range(2):
        with torch.no_grad():
            for p in pm.parameters():
                p.add_(1.0)
        saved = {key: t.clone() for key, t in pm.state_dict().items()}
        hf3d.save_checkpoint(Path(out) / f"weights{i}", pm, step=i, async_=True).result()
        res["plans"].append(len(planned_on))
        hf3d.load_checkpoint(Path(out) / f"weights{i}", fresh)
        res["restored"].append(all(torch.equal(t, saved[k]) for k, t in fresh.state_dict().items()))
    ckpt_entries.SavePlanner.create_local_plan, OneFileWriter.write_data = plan, write_data
    OneFileWriter.replay, save.entries_of = replay, entries_of
    res.update(
        entries_on_main_thread=entries_on,
        same_arena=saver.stager.arena is arena,
        aligned=all(start % 4096 == 0 for start, _, _ in saver.stager.places.values()),
        planned_on_main_thread=planned_on,
        written_here=written_here,
        child_writes=saver.process.writes,
    )
    report(res, Path(out) / "res.pt")


def test_saves_that_copy_are_planned_once_and_written_by_another_process(tmp_path):
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    spawn(_prepared_world, 2, str(model_dir), str(tmp_path))
    results = torch.load(tmp_path / "res.pt")
    assert results[0]["boxes"] > 0  # without an optimizer dp rank 0 writes every parameter, rank 1 none
    for res in results:
        assert res["places"] == res["boxes"] and res["same_arena"] and res["aligned"], res
        assert res["child"] and res["child_writes"] == 2 and res["written_here"] == [], res
        # the prepare's rehearsals (a second where the first recorded torch.save layouts); the saves plan nothing
        assert res["plans"][0] in (1, 2) and res["plans"][1] == res["plans"][0], res
        assert res["planned_on_main_thread"] == [False] * res["plans"][0], res
        assert res["entries_on_main_thread"] == [False, False], res  # the staging thread makes them
        assert res["restored"] == [True, True]


def _copying_world(model_dir: str, out: str) -> None:
    """Saves that copy with an optimizer, as on a GPU (here on a CPU, told to copy): the update waits only for
    the copy, so training goes on while the writer process has not begun; the files are the synchronous save's,
    byte for byte, and a resume from them continues bit for bit. A writer process killed mid-save fails that
    save on every rank with nothing published, and the next save starts another. Where no process can be
    started, a thread writes the same bytes, and says so once."""
    from hf3d.checkpoint import async_save
    from hf3d.checkpoint.writer_process import WriterProcess

    start_watchdog(240)
    save._copies = lambda pmodel, opt: True
    data, res, rank, root = batches(STEPS, BATCH, SEQ, 101), {}, dist.get_rank(), Path(out)
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt = _opt(pm)
    first = _train(pm, opt, data[:SAVE_AT])
    checkpoint.prepare_async_save(pm, opt)
    hf3d.save_checkpoint(root / "sync", pm, opt, step=SAVE_AT)
    held, write = threading.Event(), WriterProcess.write
    WriterProcess.write = _held_until(write, held)
    pending = hf3d.save_checkpoint(root / "async", pm, opt, step=SAVE_AT, async_=True)
    rest = _train(pm, opt, data[SAVE_AT:])  # every update waits for the copy only: the write is held
    res["trained_before_the_write"] = not pending.done()
    held.set()
    pending.result()
    files = [checkpoint.read_marker(root / d)["files"] for d in ("sync", "async")]
    res["files"] = {k: (v, files[1].get(k)) for k, v in files[0].items() if k.endswith(".distcp")}
    pm2 = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt2 = _opt(pm2)
    step = hf3d.load_checkpoint(root / "async", pm2, opt2)
    res["resumed"], res["uninterrupted"] = first + _train(pm2, opt2, data[step:]), first + rest

    # rank 1's writer process killed once its save has chosen it: that save fails everywhere, the next one writes
    saver, killed = pm._background_saver, []

    def killing(self, *args):
        if rank == 1:
            self.child.kill()
            killed.append(self.child.wait())
        return write(self, *args)

    WriterProcess.write = killing
    pending = hf3d.save_checkpoint(root / "killed", pm, opt, step=STEPS, async_=True)
    try:
        pending.result()
        res["killed"] = None
    except ValueError as e:
        res["killed"] = f"{type(e).__name__}: {e}"
    WriterProcess.write = write
    old = saver.process.child.pid
    res["killed_left"] = sorted(p.name for p in root.iterdir() if p.name.startswith("killed"))
    hf3d.save_checkpoint(root / "after", pm, opt, step=STEPS, async_=True).result()
    res["after"] = (checkpoint.is_complete(root / "after"), saver.process.child.pid != old, killed)

    # no process: a thread of this one writes the same bytes, and says why once
    def cannot_start():
        raise OSError(24, "Too many open files")

    async_save.WriterProcess = cannot_start
    pm3 = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    opt3 = _opt(pm3)
    _train(pm3, opt3, data[:SAVE_AT])
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for name in ("thread", "thread2"):
            hf3d.save_checkpoint(root / name, pm3, opt3, step=SAVE_AT, async_=True).result()
    async_save.WriterProcess = WriterProcess
    res["said"] = [str(w.message) for w in said if "hf3d" in str(w.message)]
    thread = checkpoint.read_marker(root / "thread")["files"]
    res["thread"] = {k: (v, thread.get(k)) for k, v in files[0].items() if k.endswith(".distcp")}
    report(res, root / "res.pt")


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    return _two_ranks(tmp_path_factory, "copied", _copying_world)


def test_a_save_that_copies_writes_its_steps_state_from_another_process_while_training_goes_on(copied):
    for r in copied:
        assert r["trained_before_the_write"]
        assert r["files"] and all(a == b for a, b in r["files"].values()), r["files"]
        assert r["resumed"] == r["uninterrupted"]  # bit for bit


def test_a_writer_process_that_dies_fails_its_save_everywhere_and_the_next_save_starts_another(copied):
    messages = [r["killed"] for r in copied]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "rank 1: the checkpoint writer process " in messages[0] and "ended with exit code -9" in messages[0]
    assert copied[0]["killed_left"] == []
    assert copied[0]["after"] == (True, False, []) and copied[1]["after"] == (True, True, [-9])  # rank 1: another


def test_without_a_writer_process_a_thread_writes_the_same_bytes_and_says_why_once(copied):
    for r in copied:
        assert r["thread"] and all(a == b for a, b in r["thread"].values()), r["thread"]
        assert len(r["said"]) == 1 and "could not start (" in r["said"][0] and "Too many open files" in r["said"][0]


def _train_recording(out: str) -> None:
    """`hf3d train` with async checkpoints: what it calls, in order (the first save comes after the prepare)."""
    import hf3d.train.trainer
    from hf3d.train.trainer import TrainConfig, train

    start_watchdog(240)
    calls = []
    for name in ("prepare_async_save", "save_checkpoint"):
        real = getattr(hf3d.train.trainer, name)
        setattr(hf3d.train.trainer, name, lambda *a, real=real, name=name, **k: (calls.append(name), real(*a, **k))[1])
    os.chdir(ROOT)
    sets = ["parallel.tp=1", "run.steps=4", "run.global_batch=2", "data.seq_len=32", "optim.warmup_steps=1"]
    sets += ["checkpoint.every=2", "checkpoint.async=true", "run.save_final=false", f"run.output_dir={out}"]
    train(TrainConfig.from_yaml("examples/configs/tiny-smollm.yaml", sets))
    report(calls, Path(out) / "calls.pt")


def test_hf3d_train_prepares_the_async_saves_before_the_first(tmp_path):
    spawn(_train_recording, 1, str(tmp_path))
    assert torch.load(tmp_path / "calls.pt")[0] == ["prepare_async_save", "save_checkpoint", "save_checkpoint"]
