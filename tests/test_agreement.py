"""Every node of a job runs the same config, versions and data (hf3d/train/agreement.py): the comparison in this
process, on hand-made gathers and on real data pipelines, then one real launch of two torchrun agents where node 1
is given another --set value."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from runs import free_port
from transformers import AutoTokenizer

from hf3d.data import DataConfig, DataPipeline
from hf3d.data.sources import tokenizer_fingerprint
from hf3d.train import agreement
from hf3d.train.agreement import Entry, config_line, data_line, flat_config
from hf3d.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
YAML = "examples/configs/tiny-smollm.yaml"
TOKENIZER_DIR = ROOT / "examples" / "tokenizer"
SMALL = ["run.steps=3", "run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=1", "checkpoint.every=0"]
VERSIONS = agreement.versions()
LAUNCH_LIMIT_S = 120  # two agents that fail at the config check: measured 11 s on 2 cores


def _config(*overrides: str) -> dict:
    return flat_config(TrainConfig.from_yaml(str(ROOT / YAML), [*SMALL, *overrides]))


def _job(nodes: list[dict], *, ranks_per_node: int = 2, versions: list[dict] | None = None) -> list[Entry]:
    """A gather of `ranks_per_node` ranks per node, node n on host h{n}, each rank holding its node's config."""
    return [
        Entry(n * ranks_per_node + i, n, f"h{n}", {"config": cfg, "versions": (versions or [VERSIONS] * len(nodes))[n]})
        for n, cfg in enumerate(nodes)
        for i in range(ranks_per_node)
    ]


# --- config and versions -----------------------------------------------------------------------------------


def test_the_same_config_passes_and_node_local_keys_may_differ():
    base = _config()
    assert config_line(_job([base, base, base])) is None
    local = _config("data.cache_dir=/local/disk/tokens", "data.num_proc=8")
    assert config_line(_job([base, local])) is None  # where each node caches its tokens, and with how many processes


def test_another_set_value_names_the_node_its_host_ranks_the_key_and_both_values():
    line = config_line(_job([_config(), _config("run.steps=4")]))
    assert line == (
        "node 1 (host h1, ranks 2-3) runs another config than node 0: run.steps is 4 there, 3 on node 0; give "
        "every node the same YAML and --set"
    )
    # the first node that differs, in rank order, with the first key in the config's order
    line = config_line(_job([_config(), _config(), _config("optim.lr=1e-3", "checkpoint.keep_last=3")]))
    assert line.startswith("node 2 (host h2, ranks 4-5) runs another config than node 0: optim.lr is 0.001 there, ")
    assert "0.003 on node 0" in line
    # every section counts, nested keys and lists of sections by key and index
    nested = config_line(_job([_config(), _config("data.eval.every=7")]))
    assert "data.eval.every is 7 there, 50 on node 0" in nested
    two = '[{"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 2}]}]'
    other = config_line(_job([_config(f"data.stages={two}"), _config(f"data.stages={two.replace('2', '3')}")]))
    assert "data.stages[0].sources[1].weight is 3.0 there, 2.0 on node 0" in other
    fewer = config_line(
        _job([_config(f"data.stages={two}"), _config('data.stages=[{"sources": [{"path": "a.jsonl"}]}]')])
    )
    assert "data.stages[0].sources length is 1 there, 2 on node 0" in fewer
    for section in ("model.dtype=bfloat16", "samples.every=5", "evals.limit=3", "moe.bias_update_rate=0.5"):
        key, value = section.split("=")
        assert f"{key} is " in config_line(_job([_config(), _config(section)])), section


def test_a_rank_of_rank_0s_node_and_ranks_that_are_not_contiguous():
    base, odd = _config(), _config("run.seed=5")
    job = _job([base, base])
    job[1] = Entry(1, 0, "h0", {"config": odd, "versions": VERSIONS})
    assert config_line(job).startswith("rank 1 (node 0, host h0) runs another config than rank 0: run.seed is 5 there")
    # without torchrun's node rank the host names the place; only the ranks of that host that differ are listed
    job = [
        Entry(r, None, f"h{r // 3}", {"config": odd if r in (3, 5) else base, "versions": VERSIONS}) for r in range(6)
    ]
    assert config_line(job).startswith("ranks 3, 5 (host h1) runs another config than rank 0")
    assert agreement._ranks_text([0, 1, 4, 5, 7]) == "ranks 0-1, 4-5, 7"


def test_another_version_is_named_before_the_config_it_may_explain():
    old = {**VERSIONS, "torch": "2.11.0+cu126 (CUDA 12.6)"}
    line = config_line(_job([_config(), _config("run.steps=4")], versions=[VERSIONS, old]))
    assert line == (
        f"node 1 (host h1, ranks 2-3) runs other versions than node 0: torch is '2.11.0+cu126 (CUDA 12.6)' there, "
        f"{VERSIONS['torch']!r} on node 0; install the same versions on every node (one environment, one hf3d "
        "checkout)"
    )
    assert set(VERSIONS) >= {"hf3d", "python", "torch", "transformers", "accelerate", "numpy"}
    assert "(source " in VERSIONS["hf3d"]  # another checkout of the same version differs too


def test_one_process_gathers_and_computes_nothing(monkeypatch):
    def never(*_):
        raise AssertionError("a run of one process computed what it compares")

    monkeypatch.setattr(agreement, "versions", never)
    monkeypatch.setattr(agreement, "data_fingerprint", never)
    cfg = TrainConfig.from_yaml(str(ROOT / YAML), SMALL)
    assert agreement.check_config(cfg) is None  # no process group here
    assert agreement.check_data(None, None) is None


# --- data ---------------------------------------------------------------------------------------------------


def _pipe(path: Path, cache: Path) -> DataPipeline:
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = DataConfig(path=str(path), seq_len=16, cache_dir=str(cache))
    return DataPipeline(cfg, tok, global_batch=4, dp_rank=0, dp_size=1, total_steps=4)


def _shards(folder: Path, ids: np.ndarray, doc_ends: np.ndarray) -> Path:
    """A datatrove-style shard of token ids, as DocumentTokenizer writes it, under the model's tokenizer."""
    folder.mkdir(parents=True)
    ds = folder / "00000.ds"
    ds.write_bytes(ids.astype("<u2").tobytes())
    Path(f"{ds}.index").write_bytes(doc_ends.astype("<u8").tobytes())
    Path(f"{ds}.metadata").write_text(f"{TOKENIZER_DIR / 'tokenizer.json'}|2\n")
    return folder


def _data_job(*fingerprints: dict) -> list[Entry]:
    return [Entry(r, r, f"h{r}", {"data": fp}) for r, fp in enumerate(fingerprints)]


def test_data_fingerprints_pass_copies_and_refuse_other_files(tmp_path):
    rows = [json.dumps({"text": line}) for line in (ROOT / "examples/data/poems.jsonl").read_text().splitlines()[:40]]
    original = tmp_path / "node0" / "corpus.jsonl"
    original.parent.mkdir()
    original.write_text("\n".join(rows) + "\n")
    copy = tmp_path / "node1" / "corpus.jsonl"  # another path and mtime: another cache key, the same tokens
    copy.parent.mkdir()
    shutil.copy(original, copy)
    os.utime(copy, (1, 1))
    other = tmp_path / "node2" / "corpus.jsonl"  # one document less
    other.parent.mkdir()
    other.write_text("\n".join(rows[:-1]) + "\n")
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    a, b, c = (
        agreement.data_fingerprint(_pipe(p, tmp_path / f"cache{i}"), tok) for i, p in enumerate([original, copy, other])
    )
    assert a == b and data_line(_data_job(a, b)) is None
    assert a["sources"] == ["corpus"] and a["tokenizer"] == tokenizer_fingerprint(tok)
    line = data_line(_data_job(a, b, c))
    assert line.startswith("node 2 (host h2, rank 2) reads other data than node 0: source 'corpus' num_tokens is ")
    assert line.endswith("; give every node the same data files (copies are fine) and the same tokenizer")
    n_a, n_c = a["source 'corpus' num_tokens"], c["source 'corpus' num_tokens"]
    assert f"num_tokens is {n_c} there, {n_a} on node 0" in line and n_c < n_a

    # the same counts, one token id changed: the sample of token ids tells
    ids = np.asarray(np.load(next((tmp_path / "cache0").glob("*/tokens.npy"))), dtype=np.int64)
    ends = np.asarray(np.load(next((tmp_path / "cache0").glob("*/doc_ends.npy"))), dtype=np.int64)
    edited = ids.copy()
    edited[0] = (edited[0] + 1) % len(tok)
    same = agreement.data_fingerprint(_pipe(_shards(tmp_path / "x" / "shards", ids, ends), tmp_path / "c3"), tok)
    changed = agreement.data_fingerprint(_pipe(_shards(tmp_path / "y" / "shards", edited, ends), tmp_path / "c4"), tok)
    assert {k: v for k, v in same.items() if "token sample" not in k} == {
        k: v for k, v in changed.items() if "token sample" not in k
    }
    line = data_line(_data_job(same, same, changed))
    assert line.startswith("node 2 (host h2, rank 2) reads other data than node 0: source 'shards' token sample is '")
    key = "source 'shards' token sample"
    assert f"{changed[key]!r} there, {same[key]!r} on node 0" in line


# --- one real launch ------------------------------------------------------------------------------------------


def test_two_agents_with_another_set_value_stop_before_any_step(tmp_path):
    """Node 1 trains 4 steps, node 0 three: both agents end non-zero at the config check, one line for the job.
    The c10d rendezvous numbers the agents of one host by their process ids: the one started first is node 0."""
    out, port = tmp_path / "run", free_port()
    t0 = time.perf_counter()
    agents = []
    for node, extra in ((0, []), (1, ["run.steps=4"])):
        launch = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        launch += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hf3d-agreement"]
        argv = ["-m", "hf3d", "train", YAML, "--set", "parallel.tp=1", *SMALL, "run.save_final=false"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launch, *argv, f"run.output_dir={out}", *extra]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [agent.communicate(timeout=300) for agent in agents]
    seconds = time.perf_counter() - t0
    assert [a.returncode != 0 for a in agents] == [True, True], outputs
    assert seconds < LAUNCH_LIMIT_S
    stderr = "".join(err for _, err in outputs)
    lines = [line for line in stderr.splitlines() if line.startswith("hf3d train")]
    assert len(lines) == 1, stderr[-3000:]
    assert "failed before the first step: ValueError: node 1 (host " in lines[0]
    assert lines[0].endswith("runs another config than node 0: run.steps is 4 there, 3 on node 0; give every node "
                             "the same YAML and --set")  # fmt: skip
    assert not any("resolved config" in o for o, _ in outputs)  # it stopped before the model and the data
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
