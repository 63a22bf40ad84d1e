"""The data pipeline (hf3d/data): sources, packing with document masking, mixtures, state, eval split.

What is checked:
- packing: position ids and -100 labels of hand-made windows; on real sources, positions restart
  exactly after each EOS and exactly the labels whose target starts a document are -100.
- packed rows against stock transformers on UNPACKED documents: a tiny llama (tensor parallel over
  2 gloo processes) on one packed row of several documents gives each document's logits and the sum
  of its token losses as stock gives for the document run alone; without masking it does not
  (attention then crosses documents), so the check can fail.
- sources: tokens cached by the HF datasets path equal the tokenizer's encoding of each document plus
  EOS; missing / blank texts are skipped and counted. datatrove shards made by datatrove's own
  DocumentTokenizer read back as datatrove wrote them and equal the tokenizer's encoding; a shard
  tokenizer with another vocabulary is refused, an unverifiable Hub name warns.
- order: same seed, same batches; another seed, other batches; each source's windows form a
  permutation per epoch; mixture weights; stages switch sources at their start step; resuming from
  a JSON round trip of state_dict mid-epoch and mid-stage gives the uninterrupted batches; dp ranks
  (2 processes) take disjoint slices covering the global batch; one process per node tokenises
  (the other waits at the barrier, and does not hang when tokenising fails).
- eval: held-out windows (fraction) are never trained on; eval batches are the same every call.
- one-line errors for the mistakes a user can make in the `data` section.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asserts import assert_close  # noqa: E402
from dist import report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf3d.data import DataConfig, DataPipeline, pack_window  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "examples" / "tokenizer"
TOK = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
EOS = TOK.eos_token_id
WORDS = "the of and to a in that is was he for it with as his on be at by had not are but from or have".split()
# packed (tp=2) vs unpacked stock, fp32 on a 2-core CPU: measured max |Δlogits| 2.4e-7, loss-sum rel 5.6e-8
LOGITS_ATOL = 5e-6
LOSS_RTOL = 1e-6
WATCHDOG_S = 300


def texts(n: int, seed: int, min_words: int = 3, max_words: int = 40, prefix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [
        prefix + " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + "." for _ in range(n)
    ]


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r if isinstance(r, dict) else {"text": r}) + "\n" for r in rows))
    return path


def encoded(docs: list[str]) -> list[list[int]]:
    return [TOK(d, add_special_tokens=False)["input_ids"] + [EOS] for d in docs]


def make_pipe(tmp: Path, *, global_batch=8, dp_rank=0, dp_size=1, total_steps=20, **cfg) -> DataPipeline:
    cfg.setdefault("seq_len", 16)
    cfg.setdefault("cache_dir", str(tmp / "cache"))
    return DataPipeline(
        DataConfig(**cfg),
        TOK,
        global_batch=global_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        total_steps=total_steps,
    )


def rows_of(batch: dict) -> list[tuple]:
    return [tuple(r.tolist()) for r in batch["input_ids"]]


def assert_masking_follows_eos(batch: dict) -> None:
    """Positions restart right after each EOS (and at 0); labels are -100 exactly where the input is EOS."""
    ids, pos, lab = batch["input_ids"], batch["position_ids"], batch["shift_labels"]
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == EOS
    assert torch.equal(pos == 0, starts)
    assert torch.equal(lab == -100, ids == EOS)
    keep = lab != -100
    assert torch.equal(lab[:, :-1][keep[:, :-1]], ids[:, 1:][keep[:, :-1]])  # labels are the next inputs


# --- packing --------------------------------------------------------------------------------------


def test_pack_window_positions_and_labels():
    window = np.arange(1, 11)  # 10 tokens: seq_len 9; documents start at offsets 3, 7 and 9
    starts = np.array([3, 7, 9])
    ids, labels, pos = pack_window(window, starts, document_masking=True)
    assert ids.tolist() == list(range(1, 10))
    assert labels.tolist() == [2, 3, -100, 5, 6, 7, -100, 9, -100]
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    ids, labels, pos = pack_window(window, starts, document_masking=False)
    assert labels.tolist() == list(range(2, 11)) and pos.tolist() == list(range(9))


# --- sources --------------------------------------------------------------------------------------


def test_hf_source_tokens_equal_the_tokenizer_and_skip_empty_documents(tmp_path):
    docs = texts(30, seed=1)
    rows = [docs[0], {"other": 1}, docs[1], {"text": None}, "", "   \n", *docs[2:]]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    pipe = make_pipe(tmp_path, path=str(path))
    src = pipe.sources["a"]
    assert src.meta["skipped_docs"] == 4 and src.num_docs == 30
    ((tokens, doc_ends),) = src.segments
    assert tokens.dtype == np.uint16 and isinstance(tokens, np.memmap)
    expected = encoded(docs)
    assert tokens.tolist() == [t for e in expected for t in e]
    assert doc_ends.tolist() == np.cumsum([len(e) for e in expected]).tolist()
    assert_masking_follows_eos(pipe.next_batch(0))
    stream_cfg = dict(sources=[{"path": str(path), "streaming": True}], cache_dir=str(tmp_path / "stream"))
    streamed = make_pipe(tmp_path, **stream_cfg).sources["a"]
    assert streamed.segments[0][0].tolist() == tokens.tolist() and streamed.meta["skipped_docs"] == 4
    # a .txt file is one document; invalid UTF-8 bytes become U+FFFD
    txt = tmp_path / "t" / "b.txt"
    txt.parent.mkdir()
    txt.write_bytes(b"first line\nbad \xff byte\n\n" + " ".join(docs).encode())
    pipe = make_pipe(tmp_path, path=str(txt.parent))
    text = txt.read_bytes().decode("utf-8", errors="replace")
    assert pipe.sources["t"].segments[0][0].tolist() == encoded([text])[0]


def _datatrove_shards(out: Path, docs: list[str]) -> None:
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer

    step = DocumentTokenizer(
        output_folder=str(out),
        tokenizer_name_or_path=str(TOKENIZER_DIR / "tokenizer.json"),
        eos_token=TOK.eos_token,
        seed=0,
    )
    documents = [Document(text=t, id=str(i)) for i, t in enumerate(docs)]
    LocalPipelineExecutor(pipeline=[documents, step], tasks=1, logging_dir=str(out.parent / "logs")).run()


def test_datatrove_shards_read_back_as_written(tmp_path):
    pytest.importorskip("datatrove")
    docs = texts(40, seed=2)
    shards = tmp_path / "shards"
    _datatrove_shards(shards, docs)
    (ds_file,) = sorted(shards.glob("*.ds"))
    written = np.fromfile(ds_file, dtype="<u2")
    ends = np.fromfile(str(ds_file) + ".index", dtype="<u8")
    pipe = make_pipe(tmp_path, path=str(shards))
    src = pipe.sources["shards"]
    assert src.meta["kind"] == "datatrove"
    ((tokens, doc_ends),) = src.segments
    assert tokens.tolist() == written.tolist() and doc_ends.tolist() == ends.tolist()
    # datatrove shuffled the documents: as a set, they are the tokenizer's encodings plus EOS
    read = [tuple(tokens[a:b].tolist()) for a, b in zip([0, *doc_ends[:-1].tolist()], doc_ends.tolist())]
    assert sorted(read) == sorted(tuple(e) for e in encoded(docs))
    for step in range(3):
        assert_masking_follows_eos(pipe.next_batch(step))

    # the metadata names another local tokenizer: refused; a Hub name that differs: a warning
    other = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "other.json").write_text(json.dumps(other))
    meta = Path(str(ds_file) + ".metadata")
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join([f"{tmp_path / 'other.json'}|2", *lines[1:]]))
    with pytest.raises(ValueError, match="vocabulary differs"):
        make_pipe(tmp_path, path=str(shards))
    meta.write_text("\n".join(["someone/another-tokenizer|2", *lines[1:]]))
    with pytest.warns(UserWarning, match="not checked"):
        make_pipe(tmp_path, path=str(shards))


# --- order, mixtures, stages, state ----------------------------------------------------------------


def _mixture_cfg(tmp_path: Path) -> dict:
    a = write_jsonl(tmp_path / "a.jsonl", texts(10, seed=3))
    b = write_jsonl(tmp_path / "b.jsonl", texts(10, seed=4))
    c = write_jsonl(tmp_path / "c" / "part.jsonl", texts(60, seed=5))
    return dict(
        stages=[
            {"sources": [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]},
            {"start_step": 7, "name": "anneal", "sources": [{"path": str(c.parent), "name": "c"}, {"path": str(b)}]},
        ]
    )


def test_order_mixture_stages_and_resume(tmp_path):
    cfg = _mixture_cfg(tmp_path)
    steps = 12
    pipe = make_pipe(tmp_path, total_steps=steps, **cfg)
    assert pipe.stage_starts == [(0, "stage0"), (7, "anneal")]
    assert {n: s.num_windows for n, s in pipe.sources.items()}.keys() == {"a", "b", "c"}
    batches, consumed = [], []
    for step in range(steps):
        batches.append(pipe.next_batch(step))
        consumed.append(dict(pipe.consumed_tokens))
    assert sum(consumed[-1].values()) == steps * 8 * 16
    assert consumed[6]["c"] == 0 and consumed[6]["a"] > consumed[6]["b"] > 0  # stage 0: a and b only
    assert consumed[-1]["a"] == consumed[6]["a"]  # stage 1: a no longer drawn
    assert min(pipe.state_dict()["sources"][n]["epoch"] for n in ("a", "b")) >= 1  # the run crossed epochs

    same = make_pipe(tmp_path, total_steps=steps, **cfg)
    other = make_pipe(tmp_path, total_steps=steps, seed=1, **cfg)
    assert all(torch.equal(same.next_batch(s)["input_ids"], batches[s]["input_ids"]) for s in range(steps))
    assert not all(torch.equal(other.next_batch(s)["input_ids"], batches[s]["input_ids"]) for s in range(steps))

    for stop in (4, 9):  # resume mid-epoch in stage 0, and mid-stage 1
        first = make_pipe(tmp_path, total_steps=steps, **cfg)
        for s in range(stop):
            first.next_batch(s)
        state = json.loads(json.dumps(first.state_dict()))  # plain Python values
        resumed = make_pipe(tmp_path, total_steps=steps, **cfg)
        resumed.load_state_dict(state)
        for s in range(stop, steps):
            got = resumed.next_batch(s)
            assert all(torch.equal(got[k], batches[s][k]) for k in got), (stop, s)
        assert resumed.consumed_tokens == consumed[-1]
    jump = make_pipe(tmp_path, total_steps=steps, **cfg)  # no state: the skipped steps' draws are replayed
    assert torch.equal(jump.next_batch(9)["input_ids"], batches[9]["input_ids"])
    with pytest.raises(ValueError, match="already taken"):
        jump.next_batch(3)


def test_stages_change_seq_len_and_resume_across_lengths(tmp_path):
    """A stage with its own seq_len reads rows of that length from its own view of a source (a window of
    seq_len + 1 consecutive tokens, document-masked as any row); resuming mid-stage gives the same batches;
    a state saved by a run at another data.seq_len restores the views at the lengths it holds, starts the
    others at their first window (said in the summary) and keeps its positions and tokens."""
    a = write_jsonl(tmp_path / "a.jsonl", texts(40, seed=3))
    cfg = dict(
        stages=[{"sources": [{"path": str(a)}]}, {"start_step": 3, "seq_len": 32, "sources": [{"path": str(a)}]}]
    )
    steps = 6
    pipe = make_pipe(tmp_path, total_steps=steps, **cfg)
    assert set(pipe.sources) == {"a", "a@32"} and pipe.sources["a@32"].window == 33
    batches = [pipe.next_batch(s) for s in range(steps)]
    assert [b["input_ids"].shape[1] for b in batches] == [16] * 3 + [32] * 3
    assert [pipe.seq_len(s) for s in range(steps)] == [16] * 3 + [32] * 3
    for b in batches:
        assert_masking_follows_eos(b)
    assert pipe.consumed_tokens == {"a": 8 * (3 * 16 + 3 * 32)}
    view = pipe.sources["a@32"]
    k = int(pipe._perm("a@32", 0)[0])  # the first 32-token row: window k of the source's tokens
    tokens, _ = view.read(k)
    assert torch.equal(batches[3]["input_ids"][0], torch.from_numpy(tokens[:-1]))

    first = make_pipe(tmp_path, total_steps=steps, **cfg)
    for s in range(4):  # into the 32-token stage
        first.next_batch(s)
    resumed = make_pipe(tmp_path, total_steps=steps, **cfg)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert all(torch.equal(resumed.next_batch(s)["input_ids"], batches[s]["input_ids"]) for s in (4, 5))

    short = make_pipe(tmp_path, total_steps=steps, path=str(a), seq_len=8)  # an earlier run at 8 tokens
    for s in range(2):
        short.next_batch(s)
    state = json.loads(json.dumps(short.state_dict()))
    later = make_pipe(tmp_path, total_steps=steps, **cfg)  # its data.seq_len is 16: no saved position
    later.load_state_dict(state)
    assert later.consumed_tokens == {"a": 2 * 8 * 8}  # the tokens read at 8 still count
    assert "data source 'a' is read at seq_len 16 from its first window" in later.summary()[-2]
    assert torch.equal(later.next_batch(2)["input_ids"], batches[0]["input_ids"])  # step 2 reads what step 0 did
    assert later.state_dict()["sources"]["a@8"]["cursor"] == state["sources"]["a"]["cursor"]  # kept for later


def test_epoch_permutations_and_weights(tmp_path):
    cfg = _mixture_cfg(tmp_path)
    pipe = make_pipe(tmp_path, global_batch=64, total_steps=40, **cfg)
    n = pipe.num_train["a"]
    one, two = pipe._take("a", n), pipe._take("a", n)  # two epochs of source a
    assert sorted(one.tolist()) == sorted(two.tolist()) == list(range(n)) and one.tolist() != two.tolist()
    fresh = make_pipe(tmp_path, global_batch=64, total_steps=40, **cfg)
    for step in range(7):
        fresh.next_batch(step)
    got = fresh.consumed_tokens
    share = got["a"] / (got["a"] + got["b"])
    assert abs(share - 0.75) < 0.05, share  # 448 draws at weights 3:1


def _dp_worker(tmp: str, model_dir: str, cfg: dict, docs_path: str, out: str) -> None:
    import torch.distributed as dist

    import hf3d
    import hf3d.data.pipeline as pipeline_mod

    start_watchdog(WATCHDOG_S)
    rank = dist.get_rank()
    res = {}
    real_build, builds = pipeline_mod.build_token_cache, []
    pipeline_mod.build_token_cache = lambda *a, **k: (builds.append(a[0].label), real_build(*a, **k))
    dcfg = DataConfig(cache_dir=f"{tmp}/cache", seq_len=16, **cfg)
    kw = dict(global_batch=8, dp_rank=rank, dp_size=2, total_steps=12, local_main=rank == 0, barrier=dist.barrier)
    pipe = DataPipeline(dcfg, TOK, **kw)
    res["builds"] = list(builds)
    res["batches"] = [pipe.next_batch(s) for s in range(12)]
    try:  # tokenising fails on the main process: both ranks raise, neither waits forever
        bad = DataConfig(cache_dir=f"{tmp}/cache", seq_len=16, path=docs_path, text_field="body")
        DataPipeline(bad, TOK, **kw)
    except ValueError as e:
        res["error"] = str(e)

    # one packed row of every document of docs_path (seq_len + 1 = all of its tokens)
    total = sum(len(e) for e in encoded([json.loads(line)["text"] for line in open(docs_path)]))
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=2))
    for masking in (True, False):
        row_cfg = DataConfig(cache_dir=f"{tmp}/cache", seq_len=total - 1, path=docs_path, document_masking=masking)
        row_kw = dict(global_batch=1, dp_rank=0, dp_size=1, total_steps=1, local_main=rank == 0, barrier=dist.barrier)
        row = DataPipeline(row_cfg, TOK, **row_kw).next_batch(0)
        with torch.no_grad():
            res[f"logits_{masking}"] = pm.eval().logits(row["input_ids"], row["position_ids"])
        res[f"row_{masking}"] = row
    report(res, out)


def test_dp_slices_barrier_and_packed_parity(tmp_path):
    cfg = _mixture_cfg(tmp_path)
    docs = texts(4, seed=6, min_words=4, max_words=12)
    docs_path = write_jsonl(tmp_path / "docs.jsonl", docs)
    model_dir = make_model_dir(tmp_path / "llama", "llama", vocab_size=len(TOK))
    spawn(_dp_worker, 2, str(tmp_path), str(model_dir), cfg, str(docs_path), str(tmp_path / "out.pt"))
    res = torch.load(tmp_path / "out.pt", weights_only=False)

    assert sorted(res[0]["builds"]) == ["a", "b", "c"] and res[1]["builds"] == []  # one tokeniser per node
    assert "no field 'body'" in res[0]["error"] and "did not prepare them" in res[1]["error"]
    whole = make_pipe(tmp_path, total_steps=12, **cfg)
    for step in range(12):
        full = whole.next_batch(step)
        parts = [res[r]["batches"][step] for r in (0, 1)]
        for k in full:
            assert torch.equal(torch.cat([p[k] for p in parts]), full[k]), (step, k)
        assert not set(rows_of(parts[0])) & set(rows_of(parts[1]))

    # packed + masked row vs stock transformers on each document alone (per-token losses summed)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    row, logits = res[0]["row_True"], res[0]["logits_True"][0]  # [seq_len, vocab]
    assert torch.equal(res[1]["logits_True"], res[0]["logits_True"])
    packed_loss = torch.nn.functional.cross_entropy(logits, row["shift_labels"][0], reduction="sum")
    stock_loss, offset = 0.0, 0
    for ids in encoded(docs):
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            ref = stock(ids_t).logits[0]
        stock_loss += torch.nn.functional.cross_entropy(ref[:-1], ids_t[0, 1:], reduction="sum").item()
        n = min(len(ids), logits.shape[0] - offset)  # the last document's EOS is a label only
        assert_close(logits[offset : offset + n], ref[:n], atol=LOGITS_ATOL, what=f"logits at offset {offset}")
        offset += len(ids)
    assert abs(packed_loss.item() - stock_loss) <= LOSS_RTOL * abs(stock_loss), (packed_loss.item(), stock_loss)
    # without masking the second document attends to the first: its logits differ from stock's
    first = len(encoded(docs)[0])
    assert (res[0]["logits_False"][0, first:] - logits[first:]).abs().max() > 1e-2
    assert res[0]["row_False"]["position_ids"][0].tolist() == list(range(logits.shape[0]))


# --- eval ------------------------------------------------------------------------------------------


def test_eval_fraction_is_never_trained_on(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", texts(60, seed=7))
    eval_cfg = {"fraction": 0.2, "every": 5, "batches": 2, "batch": 4}
    pipe = make_pipe(tmp_path, global_batch=8, total_steps=40, path=str(path), eval=eval_cfg)
    n, n_train = pipe.sources["a"].num_windows, pipe.num_train["a"]
    assert n_train == n - int(0.2 * n)
    trained = set()
    for step in range(2 * n_train // 8 + 2):  # more than two epochs
        trained |= set(rows_of(pipe.next_batch(step)))
    assert len(trained) == n_train
    evals = pipe.eval_batches()
    assert len(evals) == 2 and all(b["input_ids"].shape == (4, 16) for b in evals)
    held = {r for b in evals for r in rows_of(b)}
    assert held and not held & trained
    again = pipe.eval_batches()
    assert all(torch.equal(x[k], y[k]) for x, y in zip(evals, again) for k in x)
    assert any("held out for eval" in line for line in pipe.summary())

    other = write_jsonl(tmp_path / "held.jsonl", texts(20, seed=8))
    dp = [
        make_pipe(tmp_path, dp_rank=r, dp_size=2, path=str(path), eval={"path": str(other), "every": 5, "batch": 4})
        for r in (0, 1)
    ]
    assert dp[0].eval_every == 5 and dp[0].num_train["a"] == n
    held_src = make_pipe(tmp_path, path=str(other)).sources["held"]
    expected = [tuple(held_src.read(k)[0][:-1].tolist()) for k in range(4)]  # its first windows, in order
    assert rows_of(dp[0].eval_batches()[0]) + rows_of(dp[1].eval_batches()[0]) == expected
    assert make_pipe(tmp_path, path=str(path)).eval_batches() == []


def test_the_eval_rows_of_a_mixture_give_each_source_its_share_and_say_whose_they_are(tmp_path):
    """data.eval.fraction over two sources weighted 0.95 / 0.05, 2 batches of 4 rows: the light source still
    gets a row (7 + 1, not 8 + 0), every row is one of its own source's held-out windows (never trained on),
    `eval_sources()` name that source, `eval_batches()` keeps next_batch's keys (a loop passes them on as they
    are), and the two dp ranks' rows and ids together are the whole eval set's."""
    a = write_jsonl(tmp_path / "a.jsonl", texts(60, seed=7))
    b = write_jsonl(tmp_path / "b.jsonl", texts(30, seed=9))
    sources = [{"path": str(a), "weight": 0.95}, {"path": str(b), "weight": 0.05}]
    eval_cfg = {"fraction": 0.2, "every": 5, "batches": 2, "batch": 4}
    pipe = make_pipe(tmp_path, sources=sources, eval=eval_cfg)
    assert pipe.eval_names == ["a", "b"] and pipe.eval_rows_per_source() == [7, 1]
    held = {
        name: {tuple(src.read(k)[0][:-1].tolist()) for k in range(pipe.num_train[name], src.num_windows)}
        for name, src in pipe.sources.items()
    }
    batches = zip(pipe.eval_batches(), pipe.eval_sources())
    rows = [(row, pipe.eval_names[int(i)]) for e, ids in batches for row, i in zip(rows_of(e), ids)]
    assert sorted(name for _, name in rows) == ["a"] * 7 + ["b"]
    assert all(row in held[name] for row, name in rows)
    dp = [make_pipe(tmp_path, sources=sources, eval=eval_cfg, dp_rank=r, dp_size=2) for r in (0, 1)]
    halves = [
        [(r, int(i)) for r, i in zip(rows_of(e), ids)] for p in dp for e, ids in zip(p.eval_batches(), p.eval_sources())
    ]
    ranks = [x for pair in zip(halves[:2], halves[2:]) for half in pair for x in half]  # batch by batch, rank 0 first
    assert [(row, pipe.eval_names[i]) for row, i in ranks] == rows
    assert any("(a 7 rows, b 1 row)" in line for line in pipe.summary())
    assert all(set(e) == {"input_ids", "shift_labels", "position_ids"} for e in pipe.eval_batches())


# --- the default config and errors ------------------------------------------------------------------


def test_default_config_and_summary(tmp_path):
    pipe = make_pipe(tmp_path, seq_len=128, global_batch=16, total_steps=200, dp_rank=1, dp_size=2)
    batch = pipe.next_batch(0)
    assert batch["input_ids"].shape == (8, 128) and batch["input_ids"].dtype == torch.int64
    assert_masking_follows_eos(batch)
    lines = pipe.summary()
    assert lines[0].startswith("data source shakespeare (json") and "12 documents" in lines[0]


def _bad(tmp: Path) -> dict:
    good = str(write_jsonl(tmp / "good.jsonl", texts(40, seed=9)))
    tiny = str(write_jsonl(tmp / "tiny.jsonl", ["one two"]))
    empty = str(write_jsonl(tmp / "empty.jsonl", ["", {"text": None}]))
    (tmp / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9 au lait and more words"}\n')
    src = lambda **k: {"path": good, **k}  # noqa: E731
    return {
        "negative weight": (dict(sources=[src(weight=-1)]), "weight must be >= 0"),
        "weights sum to zero": (dict(sources=[src(weight=0)]), "weights sum to 0"),
        "stages unsorted": (
            dict(
                stages=[
                    {"sources": [src()]},
                    {"start_step": 5, "sources": [src()]},
                    {"start_step": 3, "sources": [src()]},
                ]
            ),
            "sorted by start_step",
        ),
        "first stage not at 0": (dict(stages=[{"start_step": 2, "sources": [src()]}]), "start_step must be 0"),
        "stage after the run": (dict(stages=[{"sources": [src()]}, {"start_step": 10, "sources": [src()]}]), "only 10"),
        "stage without sources": (dict(stages=[{"sources": []}]), "has no sources"),
        "empty source": (dict(path=empty), "holds 0 tokens"),
        "missing text field": (dict(path=good, text_field="body"), "no field 'body'"),
        "missing file": (dict(path=str(tmp / "nope.jsonl")), "does not exist"),
        "seq_len 1": (dict(path=good, seq_len=1), "at least 2"),
        "shorter than a window": (dict(path=tiny), "fewer than one window"),
        "not UTF-8": (dict(path=str(tmp / "latin1.jsonl")), "not valid UTF-8"),
        "eval path and fraction": (dict(path=good, eval={"path": good, "fraction": 0.1}), "not both"),
        "unknown source key": (dict(sources=[src(wieght=2)]), "did you mean 'weight'"),
        "one name, two sources": (
            dict(stages=[{"sources": [src(name="x")]}, {"start_step": 2, "sources": [{"path": tiny, "name": "x"}]}]),
            "names two different sources",
        ),
    }


def test_user_errors_are_one_line(tmp_path):
    for case, (cfg, fragment) in _bad(tmp_path).items():
        with pytest.raises(ValueError) as info:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                make_pipe(tmp_path, total_steps=10, **cfg)
        message = str(info.value)
        assert fragment in message and "\n" not in message, (case, message)
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
