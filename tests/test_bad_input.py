"""Every bad input the tests try, and the one line each gets. docs/bad-input.md is generated from here.

`CASES` is the registry: an id, a category, the bad input in a few words, how to trigger it, and the
words its message must contain (they include the "where": the key, the file, the row, the rank).
For each case the tests assert that:

- the message contains those words, is ONE line (no newline) and under 400 characters;
- an error is an exception (Python API) or a non-zero exit with exactly one `... error:` / `failed`
  line on stderr and no traceback (command line); a command that writes an output directory left no
  `final/` in it, and the one run that fails with an earlier checkpoint in its output directory leaves
  that directory byte-identical;
- a case that is not an error by design (blank or missing texts, invalid UTF-8 in a .txt file) behaves
  as documented: the document is skipped and counted in the run's summary line, or the bytes replaced.

How cases run: most in this process (config, data pipeline, checkpoint helpers, `hf3d.cli.main` for
command lines that fail before any process group exists); the ones that need a process group together
in ONE spawned gloo process; five as real `python -m hf3d ...` subprocesses. `python
tests/test_bad_input.py` runs every case and rewrites docs/bad-input.md; `test_the_table_is_current`
fails when the table and the registry disagree.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hf3d without an install
sys.path.insert(0, str(ROOT / "tests"))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, make_model_dir  # noqa: E402

DOC = ROOT / "docs" / "bad-input.md"
TOKENIZER_DIR = ROOT / "examples" / "tokenizer"
TINY_SMOLLM = ROOT / "examples" / "models" / "tiny-smollm"
TINY_MOE = ROOT / "examples" / "models" / "tiny-qwen3-moe"
MAX_MESSAGE = 400
WATCHDOG_S = 300
CATEGORIES = (
    "config file",
    "--set / command line",
    "launch",
    "data files",
    "dataset contents",
    "checkpoints",
    "Python API",
    "evaluation",
    "generation",
)
WORDS = "the of and to a in that is was he for it with as his on be at by had not are but from or have".split()
# one process, a tiny run: fails before its first step in every case below
ONE_PROCESS = [
    "parallel.tp=1",
    "parallel.num_microbatches=1",
    "run.global_batch=4",
    "run.steps=4",
    "data.seq_len=32",
    "data.eval.every=0",
    "optim.warmup_steps=1",
    "run.sample_prompt=null",
]


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    bad: str
    """The bad input, in a few words (the table's second column)."""
    trigger: Callable
    """local: fn(fx) raises, or returns the line that shows the documented behaviour; main: fn(fx) returns
    the argv of `hf3d.cli.main`, or (argv, the output path, where nothing may be left); subprocess: fn(fx)
    returns (hf3d argv, folder that must hold no final/); dist: fn(ctx) in the spawned process, like local."""
    words: tuple[str, ...]
    """What the message must contain, after tmp paths became <tmp> (see placeholders)."""
    how: str = "local"  # local | main | subprocess | dist | dist2 (two ranks)
    error: bool = True
    """False: not an error by design; the returned line shows what happened instead."""
    behaviour: str = ""
    """What happens instead of an error (error=False), for the outcome column."""
    gap: str = ""
    """A known shortfall of the message (listed in the table)."""


@dataclass
class Result:
    outcome: str  # the exception type, "exit N", or what happened instead of an error
    message: str  # the one line, tmp paths replaced by <tmp>
    problems: list  # what broke the contract beyond the words (stderr shape, leftovers)


# ------------------------------------------------------------------------------------------------
# Inputs: small files written once into a temporary folder
# ------------------------------------------------------------------------------------------------
def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 30)))) + "." for _ in range(n)]


def _jsonl(path: Path, rows: list) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r if isinstance(r, dict) else {"text": r}) + "\n" for r in rows))
    return str(path)


def _shard(folder: Path, docs: list[list[int]], tokenizer_name: str, token_bytes: int = 2) -> str:
    """A datatrove-style token shard: <f>.ds (tokens), <f>.ds.index (uint64 document ends), <f>.ds.metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    ds = folder / "00000_00000_doc_shuffled.ds"
    ds.write_bytes(np.concatenate(docs).astype("<u2" if token_bytes == 2 else "<u4").tobytes())
    Path(str(ds) + ".index").write_bytes(np.cumsum([len(d) for d in docs]).astype("<u8").tobytes())
    Path(str(ds) + ".metadata").write_text(f"{tokenizer_name}|{token_bytes}\n")
    return str(folder)


def make_inputs(tmp: Path) -> dict[str, str]:
    """Every file the cases read, under tmp; returns their paths (plain strings: the spawn pickles them)."""
    from transformers import AutoTokenizer

    from hf3d.hf.folders import EXPORT
    from hf3d.utils.files import make_dir

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    d = tmp / "data"
    docs = _texts(30, seed=0)
    fx = {"tmp": str(tmp), "cache": str(tmp / "cache"), "data": str(d)}
    fx["good"] = _jsonl(d / "good.jsonl", docs)
    fx["blank_lines"] = str(d / "blank_lines.jsonl")
    Path(fx["blank_lines"]).write_text("\n\n".join(json.dumps({"text": t}) for t in docs) + "\n\n\n")
    fx["blank_texts"] = _jsonl(d / "blank_texts.jsonl", [docs[0], "", "   \n\t", *docs[1:]])
    fx["null_texts"] = _jsonl(d / "null_texts.jsonl", [docs[0], {"text": None}, *docs[1:], {"text": None}])
    fx["some_missing"] = _jsonl(d / "some_missing.jsonl", [{"body": "x"}, *docs[:10], {"id": 3}, *docs[10:]])
    fx["number_text"] = _jsonl(d / "number_text.jsonl", [*docs, {"text": 12345}])
    fx["all_numbers"] = _jsonl(d / "all_numbers.jsonl", [{"text": i} for i in range(20)])
    fx["no_text_field"] = _jsonl(d / "no_text_field.jsonl", [{"content": t} for t in docs])
    fx["all_empty"] = _jsonl(d / "all_empty.jsonl", ["", {"text": None}, " "])
    fx["one_short_doc"] = _jsonl(d / "one_short_doc.jsonl", ["two words"])
    fx["zero_bytes"] = str(d / "zero_bytes.jsonl")
    Path(fx["zero_bytes"]).write_bytes(b"")
    fx["broken_json"] = str(d / "broken_json.jsonl")
    Path(fx["broken_json"]).write_text(Path(fx["good"]).read_text() + '{"text": "unterminated\n')
    fx["latin1"] = str(d / "latin1.jsonl")
    Path(fx["latin1"]).write_bytes(Path(fx["good"]).read_bytes() + b'{"text": "caf\xe9 cr\xe8me"}\n')
    (d / "txt").mkdir()
    fx["bad_utf8_txt"] = str(d / "txt" / "notes.txt")
    Path(fx["bad_utf8_txt"]).write_bytes(b"a caf\xe9 and a cr\xe8me " + " ".join(docs).encode())
    tasks = d / "tasks"
    tasks.mkdir()
    row = {"query": "Question: which?\nAnswer:", "choices": [" this", " that"], "gold": 0}
    for name, bad in (
        ("no_gold", {k: v for k, v in row.items() if k != "gold"}),
        ("gold_out_of_range", {**row, "gold": 2}),
        ("no_choices", {**row, "choices": []}),
        ("empty_choice", {**row, "choices": [" this", ""]}),
        ("long_choice", {**row, "choices": [" this", " and that," * 20]}),
        ("fused", {**row, "query": "I saw ge", "choices": [" lady", "ntleman"]}),  # "I saw gentleman": fewer tokens
        ("many_choices", {**row, "choices": [f" c{i}" for i in range(27)]}),
    ):
        fx[f"task_{name}"] = _jsonl(tasks / f"{name}.jsonl", [row, row, bad])
    fx["prompts_empty"] = _jsonl(tasks / "prompts_empty.jsonl", [{"prompt": "ROMEO:"}, {"prompt": ""}])
    fx["task_long_line"] = str(tasks / "long_line.jsonl")  # a line of 17 MiB: over the 16 MiB a line may hold
    Path(fx["task_long_line"]).write_text(json.dumps({**row, "prompt": "ROMEO:"}) + "\n" + " " * (17 << 20) + "\n")
    fx["task_latin1"] = str(tasks / "latin1.jsonl")
    Path(fx["task_latin1"]).write_bytes(json.dumps(row).encode() + b'\n{"query": "caf\xe9"}\n')
    fx["task_deep"] = str(tasks / "deep.jsonl")
    Path(fx["task_deep"]).write_text(json.dumps(row) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    fx["task_not_json"] = str(tasks / "not_json.jsonl")
    Path(fx["task_not_json"]).write_text(json.dumps(row) + "\n{'query': 'single quotes'}\n")
    fx["csv"] = str(d / "table.csv")
    Path(fx["csv"]).write_text("text\nhello\n")
    (d / "mixed").mkdir()
    _jsonl(d / "mixed" / "a.jsonl", docs)
    (d / "mixed" / "b.txt").write_text(" ".join(docs))
    fx["mixed"] = str(d / "mixed")
    (d / "empty_folder").mkdir()
    fx["empty_folder"] = str(d / "empty_folder")
    fx["bad_parquet"] = str(d / "broken.parquet")
    Path(fx["bad_parquet"]).write_bytes(b"PAR1 this is not parquet")

    # datatrove shards: the model's tokenizer, then the same shards under other metadata
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in docs]
    own = str(TOKENIZER_DIR / "tokenizer.json")
    fx["shards"] = _shard(d / "shards", ids, own)
    other = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "other-tokenizer.json").write_text(json.dumps(other))
    fx["shards_other_vocab"] = _shard(d / "shards_other_vocab", ids, str(d / "other-tokenizer.json"))
    fx["shards_no_index"] = _shard(d / "shards_no_index", ids, own)
    os.remove(Path(fx["shards_no_index"]) / "00000_00000_doc_shuffled.ds.index")
    fx["shards_no_metadata"] = _shard(d / "shards_no_metadata", ids, own)
    os.remove(Path(fx["shards_no_metadata"]) / "00000_00000_doc_shuffled.ds.metadata")
    fx["shards_bad_metadata"] = _shard(d / "shards_bad_metadata", ids, own)
    (Path(fx["shards_bad_metadata"]) / "00000_00000_doc_shuffled.ds.metadata").write_text(f"{own}|3\n")
    fx["shards_short_index"] = _shard(d / "shards_short_index", ids, own)
    index = Path(fx["shards_short_index"]) / "00000_00000_doc_shuffled.ds.index"
    index.write_bytes(index.read_bytes()[:-8])  # the last document's end is gone

    # config files
    c = tmp / "configs"
    c.mkdir()
    files = {
        "invalid_yaml": "model:\n  path: [unclosed\n",
        "not_mapping": "- model\n- data\n",
        "unknown_section": "optimizer:\n  lr: 1.0e-3\n",
        "unknown_key": "optim:\n  learning_rate: 1.0e-3\n",
        "wrong_type": "run:\n  steps: many\n",
        "section_scalar": "run: 5\n",
        "nested_key": "data:\n  stages:\n    - sources:\n        - path: a.jsonl\n          wieght: 2\n",
        "bad_tuple": "optim:\n  betas: [0.9]\n",
    }
    for name, text in files.items():
        (c / f"{name}.yaml").write_text(text)
        fx[f"yaml_{name}"] = str(c / f"{name}.yaml")

    # models and checkpoints
    fx["llama"] = str(make_model_dir(tmp / "models" / "llama", "llama"))
    fx["llama_wide"] = str(make_model_dir(tmp / "models" / "llama-wide", "llama", hidden_size=72))
    (tmp / "models" / "bin-only").mkdir()
    shutil.copy(Path(fx["llama"]) / "config.json", tmp / "models" / "bin-only")
    (tmp / "models" / "bin-only" / "pytorch_model.bin").write_bytes(b"")
    fx["bin_only"] = str(tmp / "models" / "bin-only")
    ck = tmp / "ckpt"
    (ck / "partial" / "checkpoints" / "step_3").mkdir(parents=True)  # an interrupted save: no marker
    (ck / "partial" / "checkpoints" / "step_3" / "__0_0.distcp").write_bytes(b"")
    fx["partial_root"] = str(ck / "partial" / "checkpoints")
    fx["partial_step"] = str(ck / "partial" / "checkpoints" / "step_3")
    (ck / "old-version").mkdir()
    (ck / "old-version" / "hf3d_checkpoint.json").write_text(json.dumps({"format": "hf3d", "version": 99}))
    fx["old_version"] = str(ck / "old-version")
    (ck / "garbled").mkdir()
    (ck / "garbled" / "hf3d_checkpoint.json").write_text('{"format": "hf3d", "vers')
    fx["garbled"] = str(ck / "garbled")
    fx["blocker"] = str(ck / "a-file")
    Path(fx["blocker"]).write_text("not a folder\n")
    (ck / "not-hf").mkdir()
    (ck / "not-hf" / "notes.txt").write_text("keep me\n")
    fx["not_hf"] = str(ck / "not-hf")
    # crafted checkpoints: a .metadata that would run `touch <tmp>/code-ran`, a data file named outside the folder
    from crafted import global_pickle, rewrite_metadata, write_crafted

    from hf3d.checkpoint.convert import hf_to_checkpoint

    honest = hf_to_checkpoint(fx["llama"], ck / "honest")
    shutil.copytree(honest, ck / "crafted")
    payload = global_pickle("torch.distributed.checkpoint.metadata", "os.system", f"touch {tmp}/code-ran")
    write_crafted(ck / "crafted", ".metadata", payload)
    fx["crafted"], fx["code_ran"] = str(ck / "crafted"), str(tmp / "code-ran")
    shutil.copytree(honest, ck / "bytes-entry")  # a weight declared as DCP bytes: a pickle DCP would torch.load
    fx["bytes_entry"] = str(_bytes_entry(ck / "bytes-entry", tmp / "code-ran"))
    for name in ("thesis", "staged.tmp"):  # folders of the user's, at a checkpoint's path and at its staging path
        (tmp / name / "src").mkdir(parents=True)
        (tmp / name / "src" / "thesis.tex").write_text("years of work\n")
    fx["thesis"], fx["staged"] = str(tmp / "thesis"), str(tmp / "staged")
    fx["stock_export"] = str(make_model_dir(tmp / "stock-export", "llama", seed=1))  # stock's, not hf3d's
    shutil.copytree(fx["llama"], tmp / "dangling-card")
    (tmp / "dangling-card" / "README.md").symlink_to(tmp / "written-through-the-card")
    fx["dangling_card"] = str(tmp / "dangling-card")
    (tmp / "linked-run").mkdir()
    (tmp / "linked-run" / "metrics.jsonl").symlink_to(tmp / "written-through-metrics")
    fx["linked_run"] = str(tmp / "linked-run")
    shutil.copytree(honest, ck / "outside")

    def outside(metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "../" + info.relative_path

    rewrite_metadata(ck / "outside", outside)
    fx["outside"] = str(ck / "outside")
    shutil.copytree(honest, ck / "inconsistent")  # its .metadata lists one weight fewer than its config has

    def drop_a_weight(metadata) -> None:
        del metadata.state_dict_metadata[next(k for k in metadata.state_dict_metadata if "layers.1." in k)]

    rewrite_metadata(ck / "inconsistent", drop_a_weight)
    fx["inconsistent"] = str(ck / "inconsistent")
    fx["honest"] = str(honest)
    fx["wide_ckpt"] = str(hf_to_checkpoint(fx["llama_wide"], ck / "wide"))  # another model: hidden size 72
    _crafted_reads(fx, tmp, honest)
    _crafted_sizes(fx, tmp, honest)
    _crafted_indexes(fx, tmp)
    _model_folders(fx, tmp)
    shutil.copytree(honest, ck / "honest-copy")  # a copy: its owner file names the folder it was made as
    annotated = hf_to_checkpoint(fx["llama"], ck / "annotated")  # hf3d's own, then the user's notes in it
    (annotated / "NOTES.md").write_text("the loss spike at step 40\n")
    make_dir(tmp / "an-export", EXPORT)
    shutil.copy(Path(fx["llama"]) / "config.json", tmp / "an-export")
    make_dir(tmp / "foreign-run" / "final", EXPORT)  # an earlier export of hf3d's, the user's notes in it
    shutil.copy(Path(fx["llama"]) / "config.json", tmp / "foreign-run" / "final")
    (tmp / "foreign-run" / "final" / "my_notes.txt").write_text("keep me\n")
    fx["foreign_run"] = str(tmp / "foreign-run")
    shutil.copytree(fx["llama"], tmp / "models" / "linked")  # its tokenizer.json links to a file elsewhere
    (tmp / "secret.txt").write_text("not for upload\n")
    (tmp / "models" / "linked" / "tokenizer.json").symlink_to(tmp / "secret.txt")
    fx["linked"] = str(tmp / "models" / "linked")
    fx["run"] = str(tmp / "run")  # the spawned process saves a checkpoint of the tiny SmolLM here
    # ... and two here, the newest truncated (its marker intact)
    fx["damaged_root"] = str(ck / "damaged" / "checkpoints")
    fx["damaged_step"] = str(ck / "damaged" / "checkpoints" / "step_2")
    fx["hf_home"] = str(tmp / "hf-home")
    return fx


def _model_folders(fx: dict, tmp: Path) -> None:
    """What `hf3d generate` and `hf3d eval` read: the tiny SmolLM with weights (seeded) and its tokenizer, its
    config.json alone, a training run's output folder, an empty folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_SMOLLM)).save_pretrained(tmp / "models" / "smollm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_SMOLLM / name, tmp / "models" / "smollm")
    fx["smollm"] = str(tmp / "models" / "smollm")
    (tmp / "a-file").write_text("not a folder\n")
    fx["a_file"] = str(tmp / "a-file")
    (tmp / "eval-samples" / "samples_shakespeare-word.jsonl").mkdir(parents=True)
    fx["eval_samples_folder"] = str(tmp / "eval-samples")
    (tmp / "models" / "config-only").mkdir()
    shutil.copy(TINY_SMOLLM / "config.json", tmp / "models" / "config-only")
    fx["config_only"] = str(tmp / "models" / "config-only")
    (tmp / "a-run" / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp / "a-run" / "metrics.jsonl").write_text("")
    fx["a_run"] = str(tmp / "a-run")
    (tmp / "models" / "empty").mkdir()
    fx["no_model"] = str(tmp / "models" / "empty")


def _crafted_reads(fx: dict, tmp: Path, honest: Path) -> None:
    """Files whose words would make a reader allocate or read what is not on disk: a weight stored as one element
    expanded to n x n, boxes sharing their bytes, a data file linked to another checkpoint's (under a marker that
    lists no files), safetensors headers whose shapes and byte ranges disagree."""
    from crafted import craft_expanded, edit_safetensors_header, link_data_file, rewrite_metadata

    from hf3d.checkpoint.convert import hf_to_checkpoint

    ck = tmp / "ckpt"
    for name, n in (("expanded", 4), ("expanded-huge", 65536)):
        craft_expanded(shutil.copytree(honest, ck / name), "lm_extra.weight", n)
        fx[name.replace("-", "_")] = str(ck / name)

    def share_bytes(metadata) -> None:  # the two norms of layer 0 read the same stored bytes
        index = {i.fqn: i for i in metadata.storage_data}
        a, b = (index[f"model/model.layers.0.{n}.weight"] for n in ("input_layernorm", "post_attention_layernorm"))
        metadata.storage_data[b] = metadata.storage_data[a]

    rewrite_metadata(shutil.copytree(honest, ck / "shared-bytes"), share_bytes)
    fx["shared_bytes"] = str(ck / "shared-bytes")
    other = hf_to_checkpoint(fx["stock_export"], ck / "other-model")
    link_data_file(shutil.copytree(honest, ck / "linked-data"), other / "__0_0.distcp")
    fx["linked_data"] = str(ck / "linked-data")

    def shape(name: str, value: list) -> None:
        header_path = shutil.copytree(fx["llama"], tmp / "models" / name) / "model.safetensors"
        edit_safetensors_header(header_path, lambda h: h["model.norm.weight"].update(shape=value))
        fx[name.replace("-", "_")] = str(header_path.parent)

    shape("wider-than-its-bytes", [2, 48])  # 96 values over the 48 values' bytes: the next tensor's bytes
    shape("negative-shape", [-1, 48])
    header_path = shutil.copytree(fx["llama"], tmp / "models" / "overlapping") / "model.safetensors"

    def overlap(header: dict) -> None:  # the second norm's range laid over the first's
        header["model.layers.0.post_attention_layernorm.weight"]["data_offsets"] = header[
            "model.layers.0.input_layernorm.weight"
        ]["data_offsets"]

    edit_safetensors_header(header_path, overlap)
    fx["overlapping"] = str(header_path.parent)


def _crafted_sizes(fx: dict, tmp: Path, honest: Path) -> None:
    """Checkpoints whose words would make a reader leave the folder or allocate what the files do not hold: data
    under a folder that links to another checkpoint (marker listing it or not), a stored box whose data.pkl inflates
    to 64 MiB, an extra.pt that does, a .metadata declaring a 1.9 GB bytes object, a stored row counted as 4096
    boxes, a 2^20 x 2^20 weight of which one element is stored."""
    import crafted

    ck = tmp / "ckpt"
    other = Path(fx["tmp"]) / "ckpt" / "other-model"
    for name, listed in (("linked-folder", False), ("linked-folder-listed", True)):
        crafted.link_data_folder(shutil.copytree(honest, ck / name), other, listed=listed)
        fx[name.replace("-", "_")] = str(ck / name)
    crafted.craft_inflating_box(shutil.copytree(honest, ck / "inflating-box"), 64 << 20)
    extra = shutil.copytree(honest, ck / "inflating-extra")
    crafted.inflating_archive(extra / "extra.pt", 64 << 20)
    crafted.reseal(extra)
    crafted.write_crafted(shutil.copytree(honest, ck / "counted"), ".metadata", crafted.counted_pickle(1_900_000_000))
    crafted.craft_repeated_box(shutil.copytree(honest, ck / "repeated-box"), "lm_extra.weight", 4096)
    for name in ("partial-tensor", "partial-tensor-copy"):
        crafted.craft_partial_tensor(shutil.copytree(honest, ck / name), "lm_extra.weight", 1 << 20)
    for name in (
        "inflating-box",
        "inflating-extra",
        "counted",
        "repeated-box",
        "partial-tensor",
        "partial-tensor-copy",
    ):
        fx[name.replace("-", "_")] = str(ck / name)


def _crafted_indexes(fx: dict, tmp: Path) -> None:
    """HF folders whose index names shards outside the folder or is malformed, whose safetensors header nests JSON
    too deep or declares more bytes than the file has, or whose weights file links to one outside."""
    from crafted import nested_json

    models, private = tmp / "models", tmp / "private"
    private.mkdir()
    shutil.copy(Path(fx["llama"]) / "model.safetensors", private / "model.safetensors")
    indexes = {
        "index-outside": {"weight_map": {"model.norm.weight": "../private/model.safetensors"}},
        "index-absolute": {"weight_map": {"model.norm.weight": str(private / "model.safetensors")}},
        "index-no-map": {"metadata": {}},
        "index-list-map": {"weight_map": ["model.safetensors"]},
        "index-number": {"weight_map": {"model.norm.weight": 3}},
        "index-deep": None,
    }
    for name, index in indexes.items():
        folder = shutil.copytree(fx["llama"], models / name)
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors.index.json").write_text(
            nested_json(100000) if index is None else json.dumps(index)
        )
        fx[name.replace("-", "_")] = str(folder)
    deep = shutil.copytree(fx["llama"], models / "header-deep") / "model.safetensors"
    header = nested_json(100000).encode()
    deep.write_bytes(len(header).to_bytes(8, "little") + header)
    long = shutil.copytree(fx["llama"], models / "header-long") / "model.safetensors"
    long.write_bytes((1 << 40).to_bytes(8, "little") + long.read_bytes()[8:])
    linked = shutil.copytree(fx["llama"], models / "linked-weights")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(private / "model.safetensors")
    fx.update(header_deep=str(deep.parent), header_long=str(long.parent), linked_weights=str(linked))


def _leftovers(out: str) -> list[str]:
    """What a refused command left at its output path: the output itself, or a staging or trash folder."""
    out = Path(out)
    left = [p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f"{out.name}.tmp")]
    left += [p.name for p in out.parent.iterdir() if p.name.startswith(".hf3d-trash.")]
    return [f"left behind: {', '.join(left)}"] if left else []


# ------------------------------------------------------------------------------------------------
# Helpers the cases use
# ------------------------------------------------------------------------------------------------
def _yaml(fx, name: str, *overrides: str):
    from hf3d.train.config import TrainConfig

    return TrainConfig.from_yaml(fx[f"yaml_{name}"], list(overrides))


def _eval(fx, tasks: str, *more: str, model: str = "smollm") -> list[str]:
    """An `hf3d eval` command line on the tiny SmolLM (seeded weights, the embedded tokenizer)."""
    return ["eval", fx[model], "--tasks", tasks, "--output-dir", fx["tmp"] + "/eval-out", *more]


def _set(*overrides: str):
    from hf3d.train.config import TrainConfig

    return TrainConfig.from_yaml(None, list(overrides))


def _check_run(*overrides: str, world_size: int = 1) -> list[str]:
    from transformers import AutoConfig

    from hf3d.train.checks import check_run

    cfg = _set("parallel.tp=1", *overrides)
    return check_run(cfg, world_size=world_size, model_config=AutoConfig.from_pretrained(TINY_SMOLLM))


def _check_run_dropout(*overrides: str) -> list[str]:
    """check_run of the tiny SmolLM example with attention dropout 0.1 in its config."""
    from transformers import AutoConfig

    from hf3d.train.checks import check_run

    model_config = AutoConfig.from_pretrained(TINY_SMOLLM, attention_dropout=0.1)
    return check_run(_set("parallel.tp=1", *overrides), world_size=1, model_config=model_config)


def _check_moe_run(*overrides: str, world_size: int) -> list[str]:
    """check_run of the tiny Qwen3-MoE example (8 experts)."""
    from transformers import AutoConfig

    from hf3d.train.checks import check_run

    cfg = _set("parallel.tp=1", f"model.path={TINY_MOE}", *overrides)
    return check_run(cfg, world_size=world_size, model_config=AutoConfig.from_pretrained(TINY_MOE))


def _check_other_router() -> list[str]:
    from transformers import MixtralConfig

    from hf3d.train.checks import check_run

    return check_run(_set("parallel.tp=1"), world_size=1, model_config=MixtralConfig(num_hidden_layers=1))


def _long_stage(fx, **keys) -> str:
    """--set data.stages=[...]: a first stage, then a stage `long` from step 2 with `keys` (YAML flow values)."""
    extra = "".join(f"{k}: {v}, " for k, v in keys.items())
    good = f"sources: [{{path: {fx['good']}}}]"
    return f"data.stages=[{{{good}}}, {{name: long, start_step: 2, {extra}{good}}}]"


def _stages(fx, *starts: int) -> str:
    """--set data.stages=[...]: one stage per start step, each of the good source; the last is named anneal."""
    stages = [f"{{start_step: {s}, sources: [{{path: {fx['good']}}}]}}" for s in starts]
    stages[-1] = stages[-1].replace("{start_step", "{name: anneal, start_step")
    return f"data.stages=[{', '.join(stages)}]"


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _pipe(fx, *, global_batch: int = 4, total_steps: int = 10, dp_size: int = 1, **cfg):
    from hf3d.data import DataConfig, DataPipeline

    cfg.setdefault("seq_len", 16)
    cfg.setdefault("cache_dir", fx["cache"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DataPipeline(
            DataConfig(**cfg),
            _tokenizer(),
            global_batch=global_batch,
            dp_rank=0,
            dp_size=dp_size,
            total_steps=total_steps,
        )


def _source_line(fx, path: str) -> str:
    """The run's summary line of the one source at `path`: what `hf3d train` prints at start."""
    return _pipe(fx, path=path).summary()[0]


def _nodes_disagree(fx) -> None:
    """Two ranks as two nodes (hosts h0, h1), node 1 started with another `--set run.steps`."""
    from hf3d.train.agreement import check_config

    rank = _rank()
    cfg = _set(*ONE_PROCESS, *(["run.steps=5"] if rank == 1 else []))
    check_config(cfg, node=rank, host=f"h{rank}")


def _nodes_read_other_data(fx) -> None:
    """Two ranks as two nodes, each with its own good.jsonl: node 1's holds one document more."""
    from hf3d.train.agreement import check_data

    rank = _rank()
    path = fx["good"] if rank == 0 else _jsonl(Path(fx["tmp"]) / "node1" / "good.jsonl", _texts(31, seed=0))
    check_data(_pipe(fx, path=path), _tokenizer(), node=rank, host=f"h{rank}")


def _skipped(fx, key: str, count: int) -> str:
    line = _source_line(fx, fx[key])
    assert f"({count} empty or missing skipped)" in line, line
    return line


def _txt_replaced(fx) -> str:
    pipe = _pipe(fx, path=str(Path(fx["bad_utf8_txt"]).parent))
    tokens, _ = pipe.sources["txt"].read(0)
    text = _tokenizer().decode(tokens.tolist())
    assert text.startswith("a caf\ufffd and a cr\ufffdme"), text[:40]
    return pipe.summary()[0] + " (the bytes read as U+FFFD)"


def _blank_lines(fx) -> str:
    line = _source_line(fx, fx["blank_lines"])
    assert "30 documents" in line and "skipped" not in line, line
    return line


def _env(**env: str):
    """A contextmanager setting environment variables for an in-process call."""

    @contextlib.contextmanager
    def ctx():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return ctx()


def _from_env(fx, **env: str):
    import hf3d

    with _env(**env):
        return hf3d.ParallelConfig.from_env()


def _without_cxx(fn):
    """fn() while inductor finds no C++ compiler (its search list holds only a program that does not exist)."""
    from torch._inductor import config

    with config.patch({"cpp.cxx": ("hf3d-no-such-cxx",)}):
        return fn()


def _lr_scheduler_lr_mismatch(fx):
    from hf3d.train.lr_schedules import ScheduleConfig, build_lr_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    return build_lr_scheduler(opt, ScheduleConfig(lr=3e-3), 10)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _data_state(fx, **change):
    pipe = _pipe(fx, path=fx["good"])
    state = pipe.state_dict()
    if "seq_len" in change:  # the state of a run at another seq_len: no position at this one
        state["sources"]["good"]["seq_len"] = change["seq_len"]
        pipe.load_state_dict(state)
        return pipe.summary()[-1]
    state["sources"]["good"]["num_windows"] += 7
    pipe.load_state_dict(state)


def _step_taken(fx):
    pipe = _pipe(fx, path=fx["good"])
    pipe.next_batch(3)
    pipe.next_batch(2)


def _compatible(fx):
    from transformers import AutoConfig

    from hf3d.checkpoint.load import check_compatible

    check_compatible(Path(fx["llama_wide"]), AutoConfig.from_pretrained(fx["llama"]))


def _resolve(fx, spec: str, root: str):
    from hf3d.checkpoint import resolve_resume

    return resolve_resume(spec, Path(root))


def _marker(fx, key: str):
    from hf3d.checkpoint import read_marker

    return read_marker(fx[key])


def _push_local(fx, repo_id: str):
    from hf3d.hf.hub import push_to_hub

    return push_to_hub(fx["llama"], repo_id, token="hf_not_used")


def _auto_over_damaged(fx) -> str:
    """`resume: auto` over a damaged newest checkpoint: the previous one, and the warning line printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        found = _resolve(fx, "auto", fx["damaged_root"])
    lines = err.getvalue().splitlines()
    return f"{lines[0] if len(lines) == 1 else lines} -> resumes from {found}"


def _rewind(fx):
    """`checkpoint.resume:` step_4 of the output folder that holds step_8 (no replace_later_steps): the check
    `hf3d train` runs once the resume is resolved, before anything is written (a run whose folder holds them)."""
    from crafted import fake_checkpoint

    from hf3d.train.build import _refuse_replacing_later_saves

    root = Path(fx["tmp"]) / "rewound" / "checkpoints"
    step_4, _ = (fake_checkpoint(root / f"step_{n}", n, sequence=i) for i, n in enumerate((4, 8), 1))
    checkpoint = SimpleNamespace(resume=str(step_4), load_step=True, replace_later_steps=False)
    run = SimpleNamespace(cfg=SimpleNamespace(checkpoint=checkpoint), out=root.parent, start=4, resume_from=step_4)
    return _refuse_replacing_later_saves(run)


def _check_optimizer(*overrides: str):
    from hf3d.train.build import check_optimizer

    return check_optimizer(_set("parallel.tp=1", *overrides), world_size=1)


def _ckpt(fx) -> str:
    return str(Path(fx["run"]) / "checkpoints" / "step_2")


# ------------------------------------------------------------------------------------------------
# Cases run in the spawned gloo process (one process: a process group is all they need)
# ------------------------------------------------------------------------------------------------
def _ids(ctx, pos=None, value=None) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    if pos is not None:
        ids[pos] = value
    return ids


def _train_shards(ctx):
    """Shards tokenised with a 2000-token tokenizer, fed to a model of vocab 101: the step refuses the ids."""
    from hf3d.data import DataConfig, DataPipeline

    fx = ctx["fx"]
    cfg = DataConfig(path=fx["shards"], seq_len=16, cache_dir=fx["cache"])
    pipe = DataPipeline(cfg, _tokenizer(), global_batch=2, dp_rank=0, dp_size=1, total_steps=2)
    batch = pipe.next_batch(0)
    return ctx["pm"].train_step(batch["input_ids"], shift_labels=batch["shift_labels"])


def _bytes_entry(ckpt: Path, sentinel: Path) -> Path:
    """The checkpoint with one weight declared as DCP bytes whose bytes are a pickle that would `touch sentinel`."""
    from crafted import global_pickle, reseal
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from hf3d.checkpoint import SafeReader

    metadata = SafeReader(ckpt).read_metadata()
    key = "model/model.layers.0.mlp.down_proj.weight"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    payload = global_pickle("os", "system", f"touch {sentinel}")
    (ckpt / "__crafted.distcp").write_bytes(payload)
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__crafted.distcp", 0, len(payload))
    (ckpt / ".metadata").write_bytes(__import__("pickle").dumps(metadata))
    reseal(ckpt)
    return ckpt


def _load_bytes_entry(ctx):
    import hf3d

    try:
        return hf3d.load_checkpoint(ctx["fx"]["bytes_entry"], ctx["pm"], ctx["opt"])
    finally:
        assert not Path(ctx["fx"]["code_ran"]).exists(), "the crafted bytes entry ran its command"


def _load_crafted(ctx):
    import hf3d

    try:
        return hf3d.load_checkpoint(ctx["fx"]["crafted"], ctx["pm"], ctx["opt"])
    finally:
        assert not Path(ctx["fx"]["code_ran"]).exists(), "the crafted .metadata ran its command"


def _load_other_shape(ctx):
    import hf3d

    return hf3d.load_checkpoint(ctx["wide_ckpt"], ctx["pm"], ctx["opt"])


def _muon(ctx, pm=None, **kw):
    """build_optimizer(pm, torch.optim.Muon, lr=0.02, **kw) on the context's model unless another is given: every
    case refuses it before the optimizer touches the model."""
    import hf3d

    return hf3d.build_optimizer(ctx["pm"] if pm is None else pm, torch.optim.Muon, lr=0.02, **kw)


def _muon_hsdp(ctx):
    import hf3d

    return _muon(ctx, hf3d.parallelize(ctx["fx"]["llama"], hf3d.ParallelConfig(zero_stage=1, dp_shard=1)))


def _load_muon_into_adamw(ctx):
    """A checkpoint saved by Muon (with AdamW) loaded into the context's AdamW optimizer."""
    import hf3d

    pm = hf3d.parallelize(ctx["fx"]["llama"], hf3d.ParallelConfig())
    ckpt = Path(ctx["fx"]["tmp"]) / "ckpt" / "muon" / "step_1"
    hf3d.save_checkpoint(ckpt, pm, _muon(ctx, pm), step=1)
    return hf3d.load_checkpoint(ckpt, ctx["pm"], ctx["opt"])


def _dist_world(fx: dict, out: str) -> None:
    import torch.distributed as dist

    import hf3d
    from hf3d.checkpoint import finish_save

    start_watchdog(WATCHDOG_S)
    os.chdir(ROOT)
    # the earlier run whose output directory a failing `hf3d train` must leave intact
    smol = hf3d.parallelize(str(TINY_SMOLLM), hf3d.ParallelConfig())
    opt = hf3d.build_optimizer(smol, torch.optim.AdamW, lr=3e-3)
    hf3d.save_checkpoint(Path(fx["run"]) / "checkpoints" / "step_2", smol, opt, step=2)
    finish_save(Path(fx["run"]) / "checkpoints", keep_last=2, published=Path(fx["run"]) / "checkpoints" / "step_2")
    # two checkpoints of a run, the newest one's largest file cut in half (its marker intact)
    for step in (1, 2):
        hf3d.save_checkpoint(Path(fx["damaged_root"]) / f"step_{step}", smol, opt, step=step)
    largest = max(Path(fx["damaged_step"]).iterdir(), key=lambda f: f.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    # a checkpoint of another shape (hidden 72, not 48)
    wide = hf3d.parallelize(fx["llama_wide"], hf3d.ParallelConfig())
    wide_ckpt = Path(fx["tmp"]) / "ckpt" / "wide" / "step_1"
    hf3d.save_checkpoint(wide_ckpt, wide, step=1)

    res = _attempt_dist_cases(fx, "dist", wide_ckpt=wide_ckpt, smol=smol, smol_opt=opt)
    dist.barrier()
    report(res, out)


def _zero3_optimizer(ctx: dict, cls, **kw):
    import hf3d

    pm = hf3d.parallelize(ctx["fx"]["llama"], hf3d.ParallelConfig(zero_stage=3))
    return hf3d.build_optimizer(pm, cls, lr=1e-3, **kw)


def _two_rank_world(fx: dict, out: str) -> None:
    """The cases that need a second rank ("dist2"), on 2 processes; rank 0's outcomes are reported."""
    start_watchdog(WATCHDOG_S)
    os.chdir(ROOT)
    report(_attempt_dist_cases(fx, "dist2"), out)


def _attempt_dist_cases(fx: dict, how: str, **more) -> dict[str, tuple[str, str]]:
    """{case id: outcome} of the cases run `how`, each given a tiny Llama on the default mesh with its
    optimizer (ctx "pm", "opt"), `fx` and `more`."""
    import hf3d

    pm = hf3d.parallelize(fx["llama"], hf3d.ParallelConfig())
    ctx = {"fx": fx, "pm": pm, "opt": hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3), **more}
    return {c.id: _attempt(c, lambda c=c: c.trigger(ctx)) for c in CASES if c.how == how}


# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------
def _hub_pending_not_hf3ds(fx):
    from hf3d.train.hub_push import pending_checkpoints

    out = Path(fx["tmp"]) / "pending-run"
    out.mkdir(exist_ok=True)
    (out / "hub_pending.json").write_text('{"steps": [1, 2]}')
    return pending_checkpoints(out, drop=False, say=print)


def _launch_flags(fx, flags: str) -> list[str]:
    """`hf3d train FLAGS --set run.output_dir=...` (an output folder the refusal must leave unmade)."""
    return ["train", *flags.split(), "--set", f"run.output_dir={fx['tmp']}/launch-flags"]


def _c(id, category, bad, trigger, words, **kw) -> Case:
    return Case(id, category, bad, trigger, tuple(words), **kw)


CFG, SET, LAUNCH, FILES, CONTENTS, CKPT, API, EVAL, GEN = CATEGORIES
CASES: list[Case] = [
    # --- config file -------------------------------------------------------------------------------
    _c(
        "config-missing",
        CFG,
        "config file that does not exist",
        lambda fx: _yaml({"yaml_x": fx["tmp"] + "/nope.yaml"}, "x"),
        ["config file '<tmp>/nope.yaml' does not exist"],
    ),
    _c(
        "config-invalid-yaml",
        CFG,
        "config file that is not valid YAML",
        lambda fx: _yaml(fx, "invalid_yaml"),
        ["config file '<tmp>/configs/invalid_yaml.yaml' is not valid YAML"],
    ),
    _c(
        "config-not-mapping",
        CFG,
        "config file holding a list, not sections",
        lambda fx: _yaml(fx, "not_mapping"),
        ["'<tmp>/configs/not_mapping.yaml' must be a mapping of sections"],
    ),
    _c(
        "config-unknown-section",
        CFG,
        "section name misspelt (`optimizer:`)",
        lambda fx: _yaml(fx, "unknown_section"),
        ["unknown config section 'optimizer'", "did you mean 'optim'?"],
    ),
    _c(
        "config-unknown-key",
        CFG,
        "unknown key in a section (`optim.learning_rate`)",
        lambda fx: _yaml(fx, "unknown_key"),
        ["unknown key 'learning_rate' in optim", "known keys: lr"],
    ),
    _c(
        "config-nested-unknown-key",
        CFG,
        "misspelt key in a nested list (`data.stages[0].sources[0].wieght`)",
        lambda fx: _yaml(fx, "nested_key"),
        ["unknown key 'wieght' in data.stages[0].sources[0]", "did you mean 'weight'?"],
    ),
    _c(
        "config-wrong-type",
        CFG,
        "a word where a number goes (`run.steps: many`)",
        lambda fx: _yaml(fx, "wrong_type"),
        ["run.steps must be an integer, got 'many'"],
    ),
    _c(
        "config-section-scalar",
        CFG,
        "a section given a value (`run: 5`)",
        lambda fx: _yaml(fx, "section_scalar"),
        ["run must be a mapping of key: value, got 5"],
    ),
    _c(
        "config-tuple-length",
        CFG,
        "`optim.betas` with one value",
        lambda fx: _yaml(fx, "bad_tuple"),
        ["optim.betas must be a list of 2 values, got 1"],
    ),
    _c(
        "config-model-dtype",
        CFG,
        "`model.dtype: float64`",
        lambda fx: _set("model.dtype=float64"),
        ["model.dtype must be one of float32, bfloat16, float16", "'float64'"],
    ),
    _c(
        "config-bool",
        CFG,
        "`run.save_final: maybe`",
        lambda fx: _set("run.save_final=maybe"),
        ["run.save_final must be true or false, got 'maybe'"],
    ),
    _c(
        "config-push-without-final",
        CFG,
        "`export.push_to_hub` with `run.save_final: false`",
        lambda fx: _set("export.push_to_hub=me/model", "run.save_final=false"),
        ["export.push_to_hub needs run.save_final=true"],
    ),
    _c(
        "config-ckpt-push-repo",
        CFG,
        "`checkpoint.push_to_hub.repo` that is not a Hub repo id",
        lambda fx: _set("checkpoint.push_to_hub.repo=me/my run"),
        ["checkpoint.push_to_hub.repo 'me/my run' is not a Hub repo id", "NAMESPACE/NAME"],
    ),
    _c(
        "config-ckpt-push-no-repo",
        CFG,
        "`checkpoint.push_to_hub` without a repo",
        lambda fx: _set("checkpoint.push_to_hub.private=true"),
        ["checkpoint.push_to_hub.repo is missing", "my-user/my-run"],
    ),
    _c(
        "config-ckpt-push-every",
        CFG,
        "`checkpoint.push_to_hub.every: 0`",
        lambda fx: _set("checkpoint.push_to_hub.repo=me/run", "checkpoint.push_to_hub.every=0"),
        ["checkpoint.push_to_hub.every must be >= 1", "got 0"],
    ),
    _c(
        "config-ckpt-push-timeout",
        CFG,
        "`checkpoint.push_to_hub.timeout_s: 0`",
        lambda fx: _set("checkpoint.push_to_hub.repo=me/run", "checkpoint.push_to_hub.timeout_s=0"),
        ["checkpoint.push_to_hub.timeout_s must be a number of seconds > 0, got 0"],
    ),
    _c(
        "config-ckpt-push-unknown-key",
        CFG,
        "`checkpoint.push_to_hub.branch` (no such key)",
        lambda fx: _set("checkpoint.push_to_hub.repo=me/run", "checkpoint.push_to_hub.branch=dev"),
        ["unknown key 'branch' in checkpoint.push_to_hub", "known keys: repo, every, private"],
    ),
    _c(
        "config-ckpt-push-no-checkpoints",
        CFG,
        "`checkpoint.push_to_hub` with `checkpoint.every: 0`",
        lambda fx: _set("checkpoint.push_to_hub.repo=me/run", "checkpoint.every=0"),
        ["checkpoint.push_to_hub needs checkpoints", "checkpoint.every"],
    ),
    _c(
        "config-min-lr-above-lr",
        CFG,
        "`optim.min_lr` above `optim.lr`",
        lambda fx: _set("optim.lr=1e-4", "optim.min_lr=1e-3"),
        ["optim.min_lr (0.001) is above optim.lr (0.0001)", "set min_lr <= lr"],
    ),
    _c(
        "config-wsd-without-decay",
        CFG,
        "`optim.schedule: wsd` with no decay window",
        lambda fx: _set("optim.schedule=wsd"),
        ["optim.schedule: wsd needs optim.decay_steps", "optim.decay_start"],
    ),
    _c(
        "config-decay-on-cosine",
        CFG,
        "`optim.decay_steps` with `schedule: cosine`",
        lambda fx: _set("optim.decay_steps=10"),
        ["optim.decay_steps apply to optim.schedule: wsd only, not 'cosine'"],
    ),
    _c(
        "config-warmup-fraction",
        CFG,
        "`optim.warmup_steps: 1.5` (a fraction above 1)",
        lambda fx: _set("optim.warmup_steps=1.5"),
        ["optim.warmup_steps = 1.5", "must be in (0, 1)", "as an int"],
    ),
    _c(
        "config-eval-without-data",
        CFG,
        "`data.eval.every` with no eval path or fraction",
        lambda fx: _set("data.eval.every=10", "data.eval.fraction=0"),
        ["data.eval.every is set but there is no eval data", "data.eval.path or data.eval.fraction"],
    ),
    _c(
        "config-seq-len",
        CFG,
        "`data.seq_len: 1`",
        lambda fx: _set("data.seq_len=1"),
        ["data.seq_len must be at least 2, got 1"],
    ),
    _c(
        "config-pp-schedule",
        CFG,
        "unknown `parallel.pp_schedule`",
        lambda fx: _set("parallel.pp_schedule=gpipe"),
        ["unknown parallel.pp_schedule 'gpipe'", "known schedules: afab, 1f1b"],
    ),
    _c(
        "config-recompute",
        CFG,
        "unknown `parallel.recompute` (`some`)",
        lambda fx: _set("parallel.recompute=some"),
        ['parallel.recompute must be "none", "full" or "every_<k>"', "or \"selective\", got 'some'"],
    ),
    _c(
        "config-recompute-split-backward",
        CFG,
        "`parallel.recompute: selective` with `parallel.pp_schedule: zbv` at pp 2",
        lambda fx: _set("parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.recompute=selective"),
        ["recompute is not supported with pp_schedule 'zbv'", "use pp_schedule '1f1b' or 'interleaved-1f1b'"],
    ),
    _c(
        "config-activation-offload",
        CFG,
        "`parallel.activation_offload: maybe`",
        lambda fx: _set("parallel.activation_offload=maybe"),
        ["parallel.activation_offload must be true or false, got 'maybe'"],
    ),
    _c(
        "config-moe-load-balance",
        CFG,
        "`moe.load_balance: fair` (unknown)",
        lambda fx: _set("moe.load_balance=fair"),
        ["moe.load_balance must be one of aux_loss, bias, none, got 'fair'"],
    ),
    _c(
        "config-fp8-recipe",
        CFG,
        "`precision.fp8: fp4` (unknown)",
        lambda fx: _set("precision.fp8=fp4"),
        ["precision.fp8 recipe must be one of off, tensorwise, rowwise, got 'fp4'"],
    ),
    _c(
        "config-fp8-true",
        CFG,
        "`precision.fp8: on` (YAML reads on / yes / true as true; a bare off is fine)",
        lambda fx: _set("precision.fp8=on"),
        ["precision.fp8 must be off, tensorwise or rowwise, got true (YAML's on / yes / true)"],
    ),
    _c(
        "config-tp-zero",
        CFG,
        "`parallel.tp: 0`",
        lambda fx: _set("parallel.tp=0"),
        ["parallel.tp must be a positive integer, got 0"],
    ),
    _c(
        "config-parametrization",
        CFG,
        "unknown `parallel.parametrization`",
        lambda fx: _set("parallel.parametrization=mup"),
        ["parallel.parametrization must be one of standard, spectral_mup, got 'mup'"],
    ),
    _c(
        "config-mup-no-base-width",
        CFG,
        "`parallel.parametrization: spectral_mup` without `parallel.mup_base_width`",
        lambda fx: _set("parallel.parametrization=spectral_mup"),
        ["parallel.parametrization 'spectral_mup' needs parallel.mup_base_width", "hidden_size of the proxy"],
    ),
    _c(
        "config-mup-base-width-standard",
        CFG,
        "`parallel.mup_base_width` under standard parametrization",
        lambda fx: _set("parallel.mup_base_width=64"),
        ["parallel.mup_base_width=64 is set but parallel.parametrization is 'standard'"],
    ),
    _c(
        "config-mup-base-width-too-large",
        CFG,
        "`parallel.mup_base_width: 512` for a model of hidden_size 96",
        lambda fx: _check_run("parallel.parametrization=spectral_mup", "parallel.mup_base_width=512"),
        ["parallel.mup_base_width=512 is larger than the model's hidden_size=96", "use a value <= 96"],
    ),
    _c(
        "config-mup-output-multiplier",
        CFG,
        "`parallel.mup_output_multiplier: 0` under spectral_mup",
        lambda fx: _set(
            "parallel.parametrization=spectral_mup", "parallel.mup_base_width=48", "parallel.mup_output_multiplier=0"
        ),
        ["parallel.mup_output_multiplier must be a positive number", "got 0"],
    ),
    _c(
        "config-mup-output-multiplier-standard",
        CFG,
        "`parallel.mup_output_multiplier` under standard parametrization",
        lambda fx: _set("parallel.mup_output_multiplier=4"),
        ["parallel.mup_output_multiplier=4.0 is set but parallel.parametrization is 'standard'"],
    ),
    _c(
        "config-optim-name-muon",
        CFG,
        "`optim.name: lion` (hf3d train builds adamw or muon)",
        lambda fx: _set("optim.name=lion"),
        ["optim.name must be adamw or muon, got 'lion'"],
    ),
    _c(
        "config-muon-with-adamw",
        CFG,
        "`optim.muon:` settings while `optim.name` is adamw (the default)",
        lambda fx: _set("optim.muon.lr=0.01"),
        ["optim.muon is set but optim.name is adamw", "set optim.name: muon, or remove optim.muon"],
    ),
    _c(
        "config-state-precision-muon",
        CFG,
        "`optim.state_precision: 8bit` with `optim.name: muon`",
        lambda fx: _set("optim.name=muon", "optim.state_precision=8bit"),
        ["optim.state_precision must be fp32, bf16 or 8bit", "with optim.name: muon; use bf16"],
    ),
    _c(
        "config-muon-unknown-key",
        CFG,
        "`optim.muon.betas` (an AdamW setting, which optim.betas holds)",
        lambda fx: _set("optim.name=muon", "optim.muon.betas=[0.9,0.95]"),
        ["unknown key 'betas' in optim.muon", "known keys: lr, momentum"],
    ),
    _c(
        "config-checkpoint-every",
        CFG,
        "`checkpoint.every: -1`",
        lambda fx: _set("checkpoint.every=-1"),
        ["checkpoint.every must be a number of steps >= 0, got -1"],
    ),
    _c(
        "config-on-nonfinite",
        CFG,
        "`run.on_nonfinite: ignore`",
        lambda fx: _set("run.on_nonfinite=ignore"),
        ["run.on_nonfinite must be skip or stop, got 'ignore'"],
    ),
    _c(
        "config-hang-timeout",
        CFG,
        "`run.hang_timeout: -1`",
        lambda fx: _set("run.hang_timeout=-1"),
        ["run.hang_timeout must be auto, 0 (off) or a number of seconds below run.collective_timeout_s", "got -1.0"],
    ),
    _c(
        "config-hang-timeout-word",
        CFG,
        "`run.hang_timeout: soon`",
        lambda fx: _set("run.hang_timeout=soon"),
        ["run.hang_timeout must be auto, 0 (off) or a number of seconds", "(600)", "got 'soon'"],
    ),
    _c(
        "config-source-weight",
        CFG,
        "a data source with a negative weight",
        lambda fx: _set(f"data.sources=[{{path: {fx['good']}, weight: -1}}]"),
        ["data source 'good': weight must be >= 0, got -1"],
    ),
    _c(
        "config-stage-order",
        CFG,
        "data stages out of order",
        lambda fx: _set(_stages(fx, 0, 5, 3)),
        ["data.stages must be sorted by start_step: stage 2 starts at 3, not after stage 1 (5)"],
    ),
    _c(
        "config-stage-seq-len",
        CFG,
        "a data stage with `seq_len: 1`",
        lambda fx: _set(_long_stage(fx, seq_len=1)),
        ["data.stages[1].seq_len must be at least 2, got 1"],
    ),
    _c(
        "config-stage-rope-theta",
        CFG,
        "a data stage with `rope_theta: -1`",
        lambda fx: _set(_long_stage(fx, rope_theta=-1)),
        ["data.stages[1].rope_theta must be > 0, got -1.0"],
    ),
    _c(
        "config-eval-fraction-stage-seq-len",
        CFG,
        "`data.eval.fraction` with a first-stage source read at another seq_len later",
        lambda fx: _set(_long_stage(fx, seq_len=64), "data.seq_len=32", "data.eval.fraction=0.1", "data.eval.every=2"),
        ["data.eval.fraction holds out", "data.stages[1] reads 'good' at seq_len 64", "use data.eval.path"],
    ),
    # --- --set and the command line (hf3d.cli.main in this process; real subprocesses) ------------------
    _c(
        "set-no-equals",
        SET,
        "`--set run.steps` (no value)",
        lambda fx: ["train", "--set", "run.steps"],
        ["hf3d train: error: --set expects section.key=value, got 'run.steps'"],
        how="main",
    ),
    _c(
        "set-no-section",
        SET,
        "`--set steps=5` (no section)",
        lambda fx: ["train", "--set", "steps=5"],
        ["hf3d train: error: --set expects section.key=value, got 'steps=5'"],
        how="main",
    ),
    _c(
        "set-through-a-value",
        SET,
        "`--set run.steps.x=1` (steps is not a section)",
        lambda fx: ["train", "--set", "run.steps=5", "run.steps.x=1"],
        ["hf3d train: error: --set 'run.steps.x=1': 'steps' is not a mapping"],
        how="main",
    ),
    _c(
        "set-bad-number",
        SET,
        "`--set optim.lr=fast`",
        lambda fx: ["train", "--set", "optim.lr=fast"],
        ["hf3d train: error: optim.lr must be a number, got 'fast'"],
        how="main",
    ),
    _c(
        "set-unknown-key",
        SET,
        "`--set parallel.nope=1`",
        lambda fx: ["train", "--set", "parallel.nope=1"],
        ["hf3d train: error: unknown key 'nope' in parallel", "known keys: tp, pp"],
        how="main",
    ),
    _c(
        "cli-unknown-command",
        SET,
        "`hf3d frobnicate`",
        lambda fx: ["frobnicate"],
        ["hf3d: error: argument command: invalid choice: 'frobnicate'", "'train'"],
        how="main",
    ),
    _c(
        "cli-unknown-flag",
        SET,
        "`hf3d train --steps 5` (not a flag; real subprocess)",
        lambda fx: (["train", "--steps", "5"], None),
        ["hf3d: error: unrecognized arguments: --steps"],
        how="subprocess",
    ),
    _c(
        "cli-model-path",
        SET,
        "`hf3d train --set model.path=` a folder that does not exist (real subprocess)",
        lambda fx: (
            [
                "train",
                "examples/configs/tiny-smollm.yaml",
                "--set",
                *ONE_PROCESS,
                f"model.path={fx['tmp']}/no-model",
                f"run.output_dir={fx['tmp']}/run-no-model",
            ],
            f"{fx['tmp']}/run-no-model",
        ),
        ["hf3d train: ", "model.path '<tmp>/no-model' does not exist", "NAMESPACE/NAME"],
        how="subprocess",
    ),
    _c(
        "cli-resume-bad-data",
        SET,
        "resume a run (checkpoint step_2 in its output dir) with a data path that does not exist (real "
        "subprocess; the output dir is left byte-identical)",
        lambda fx: (
            [
                "train",
                "examples/configs/tiny-smollm.yaml",
                "--set",
                *ONE_PROCESS,
                f"data.path={fx['data']}/missing.jsonl",
                f"run.output_dir={fx['run']}",
            ],
            fx["run"],
        ),
        ["hf3d train: rank 0", "data source 'missing': '<tmp>/data/missing.jsonl' does not exist"],
        how="subprocess",
    ),
    _c(
        "cli-convert-incomplete",
        SET,
        "`hf3d convert to-hf` of an interrupted checkpoint (no marker; real subprocess)",
        lambda fx: (["convert", "to-hf", fx["partial_step"], f"{fx['tmp']}/hf-out"], f"{fx['tmp']}/hf-out"),
        ["hf3d convert: error: <tmp>/ckpt/partial/checkpoints/step_3 is not a complete hf3d checkpoint"],
        how="subprocess",
    ),
    _c(
        "cli-resume-damaged",
        SET,
        "`checkpoint.resume: PATH` of a checkpoint whose largest file was truncated (marker intact; real subprocess)",
        lambda fx: (
            [
                "train",
                "examples/configs/tiny-smollm.yaml",
                "--set",
                *ONE_PROCESS,
                f"checkpoint.resume={fx['damaged_step']}",
                f"run.output_dir={fx['tmp']}/run-damaged",
            ],
            f"{fx['tmp']}/run-damaged",
        ),
        ["hf3d train: ", "checkpoint <tmp>/ckpt/damaged/checkpoints/step_2 is damaged", "bytes where"],
        how="subprocess",
    ),
    _c(
        "cli-convert-damaged",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose largest file was truncated",
        lambda fx: ["convert", "to-hf", fx["damaged_step"], f"{fx['tmp']}/hf-damaged"],
        ["hf3d convert: error: checkpoint <tmp>/ckpt/damaged/checkpoints/step_2 is damaged", "bytes where"],
        how="main",
    ),
    _c(
        "cli-plan-heads",
        SET,
        "`hf3d plan --mesh tp=4` for a model of 6 query heads and 2 KV heads",
        lambda fx: ["plan", fx["llama"], "--nproc", "4", "--mesh", "tp=4", "--only-config"],
        ["hf3d plan: error: tp=4 does not fit this llama model: 6 query heads, 2 KV heads", "Valid tp values: 1, 2"],
        how="main",
    ),
    _c(
        "cli-plan-layers",
        SET,
        "`hf3d plan --mesh pp=8` for a model of 2 decoder layers",
        lambda fx: ["plan", fx["llama"], "--nproc", "8", "--mesh", "pp=8", "--only-config"],
        ["hf3d plan: error: pp=8 x virtual_stages=1 = 8 pipeline stages for a model with 2 decoder layers", "lower pp"],
        how="main",
    ),
    _c(
        "cli-plan-experts",
        SET,
        "`hf3d plan --mesh ep=3` for a model of 8 experts",
        lambda fx: ["plan", str(ROOT / "examples/models/tiny-qwen3-moe"), "--nproc", "6", "--mesh", "ep=3"],
        ["hf3d plan: error: ep=3 does not divide this qwen3_moe model's 8 experts", "use an ep that divides 8"],
        how="main",
    ),
    _c(
        "cli-plan-memory",
        SET,
        "`hf3d plan --gpu-memory '80 gigs'`",
        lambda fx: ["plan", fx["llama"], "--nproc", "2", "--gpu-memory", "80 gigs"],
        ["hf3d plan: error: --gpu-memory '80 gigs' is not understood", "write it like 5GB, 500MB, 2GiB"],
        how="main",
    ),
    _c(
        "cli-plan-mesh-key",
        SET,
        "`hf3d plan --mesh tensor=2` (not a parallel key)",
        lambda fx: ["plan", fx["llama"], "--nproc", "2", "--mesh", "tensor=2"],
        ["hf3d plan: error: --mesh: unknown key 'tensor' in parallel", "known keys: tp, pp, dp"],
        how="main",
    ),
    _c(
        "cli-plan-flash-cp",
        SET,
        "`hf3d plan --mesh cp=2 --attn-implementation flash_attention_2` (a kernel context parallelism cannot run)",
        lambda fx: [
            "plan",
            fx["llama"],
            "--nproc",
            "2",
            "--mesh",
            "cp=2",
            "--attn-implementation",
            "flash_attention_2",
        ],
        ["hf3d plan: error: cp=2 cannot run with attn_implementation='flash_attention_2'", "or use cp=1"],
        how="main",
    ),
    _c(
        "cli-plan-no-config",
        SET,
        "`hf3d plan` of a folder without a config.json",
        lambda fx: ["plan", fx["tmp"], "--nproc", "2"],
        ["has no config.json: hf3d plan reads a model's config offline"],
        how="main",
    ),
    _c(
        "cli-average-one",
        SET,
        "`hf3d average` of a single checkpoint",
        lambda fx: (["average", fx["honest"], "--out", f"{fx['tmp']}/avg-one"], f"{fx['tmp']}/avg-one"),
        ["hf3d average: error: hf3d average needs at least 2 checkpoints to average, got 1"],
        how="main",
    ),
    _c(
        "cli-average-twice",
        SET,
        "`hf3d average` given the same checkpoint twice",
        lambda fx: (["average", fx["honest"], fx["honest"], "--out", f"{fx['tmp']}/avg-2"], f"{fx['tmp']}/avg-2"),
        ["<tmp>/ckpt/honest is given twice", "each checkpoint counts once"],
        how="main",
    ),
    _c(
        "cli-average-other-model",
        SET,
        "`hf3d average` of checkpoints of two different models (hidden size 48 and 72, head_dim 8 and 12)",
        lambda fx: (["average", fx["honest"], fx["wide_ckpt"], "--out", f"{fx['tmp']}/avg-w"], f"{fx['tmp']}/avg-w"),
        ["<tmp>/ckpt/wide is not the same model as <tmp>/ckpt/honest", "config key head_dim (8 vs 12)"],
        how="main",
    ),
    _c(
        "cli-average-missing-tensor",
        SET,
        "`hf3d average` of checkpoints where one lacks a weight the other has (.metadata rewritten, marker resealed)",
        lambda fx: (
            ["average", fx["honest"], fx["inconsistent"], "--out", f"{fx['tmp']}/avg-m"],
            f"{fx['tmp']}/avg-m",
        ),
        ["<tmp>/ckpt/inconsistent is not the same model", "only <tmp>/ckpt/honest has the tensor 'model.layers.1."],
        how="main",
    ),
    _c(
        "cli-average-incomplete",
        SET,
        "`hf3d average` of an interrupted checkpoint (no marker)",
        lambda fx: (["average", fx["honest"], fx["partial_step"], "--out", f"{fx['tmp']}/avg-p"], f"{fx['tmp']}/avg-p"),
        ["hf3d average: error: <tmp>/ckpt/partial/checkpoints/step_3 is not a complete hf3d checkpoint"],
        how="main",
    ),
    _c(
        "cli-push-no-token",
        SET,
        "`hf3d push` with no Hub token (real subprocess)",
        lambda fx: (["push", fx["llama"], "me/tiny"], None),
        ["hf3d push: error: no Hugging Face token found", "HF_TOKEN"],
        how="subprocess",
        gap="does not name the model folder",
    ),
    _c(
        "cli-convert-bin-only",
        SET,
        "`hf3d convert from-hf` of a folder with .bin weights only",
        lambda fx: ["convert", "from-hf", fx["bin_only"], f"{fx['tmp']}/from-bin"],
        ["hf3d convert: error: <tmp>/models/bin-only holds PyTorch .bin weights", "re-save it"],
        how="main",
    ),
    _c(
        "cli-convert-shard-size",
        SET,
        "`hf3d convert to-hf --max-shard-size lots`",
        lambda fx: ["convert", "to-hf", _ckpt(fx), f"{fx['tmp']}/hf-size", "--max-shard-size", "lots"],
        ["hf3d convert: error: --max-shard-size 'lots' is not understood", "like 5GB"],
        how="main",
    ),
    _c(
        "cli-convert-out-not-empty",
        SET,
        "`hf3d convert to-hf` into a folder holding other files",
        lambda fx: ["convert", "to-hf", _ckpt(fx), fx["not_hf"]],
        ["hf3d convert: error: <tmp>/ckpt/not-hf is a folder hf3d did not make", "never deletes or replaces it"],
        how="main",
    ),
    _c(
        "cli-convert-out-under-a-file",
        SET,
        "`hf3d convert from-hf` into a path under a file",
        lambda fx: ["convert", "from-hf", fx["smollm"], f"{fx['a_file']}/ckpt"],
        ["hf3d convert: error: <tmp>/a-file/ckpt lies under <tmp>/a-file, which is a file: choose another output"],
        how="main",
    ),
    _c(
        "cli-convert-crafted-metadata",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose .metadata would run a command (os.system as a dotted name)",
        lambda fx: ["convert", "to-hf", fx["crafted"], f"{fx['tmp']}/hf-crafted"],
        [
            "hf3d convert: error: <tmp>/ckpt/crafted/.metadata refers to torch.distributed.checkpoint.metadata."
            "os.system",
            "refusing to load it",
        ],
        how="main",
    ),
    _c(
        "cli-convert-bytes-entry",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose .metadata declares a weight as DCP bytes (a pickle DCP would load)",
        lambda fx: ["convert", "to-hf", fx["bytes_entry"], f"{fx['tmp']}/hf-bytes-entry"],
        [
            "hf3d convert: error: <tmp>/ckpt/bytes-entry/.metadata declares the entry "
            "'model/model.layers.0.mlp.down_proj.weight' as BytesStorageMetadata, not a tensor",
            "never unpickles an entry",
        ],
        how="main",
    ),
    _c(
        "cli-convert-from-hf-user-folder",
        SET,
        "`hf3d convert from-hf` into a folder of the user's (src/thesis.tex)",
        lambda fx: ["convert", "from-hf", fx["llama"], fx["thesis"]],
        ["hf3d convert: error: <tmp>/thesis is a folder hf3d did not make", "move it away"],
        how="main",
    ),
    _c(
        "cli-push-dangling-card",
        SET,
        "`hf3d push` of a folder whose README.md is a link to a file that does not exist",
        lambda fx: ["push", fx["dangling_card"], "me/tiny"],
        [
            "hf3d push: error: <tmp>/dangling-card/README.md is a link to <tmp>/written-through-the-card",
            "which does not exist; hf3d writes through no link",
        ],
        how="main",
    ),
    _c(
        "cli-convert-data-outside",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose metadata names data files under '..'",
        lambda fx: ["convert", "to-hf", fx["outside"], f"{fx['tmp']}/hf-outside"],
        ["hf3d convert: error: <tmp>/ckpt/outside/.metadata names the data file '../__0_", "outside the checkpoint"],
        how="main",
    ),
    _c(
        "cli-convert-expanded-stride",
        SET,
        "`hf3d convert to-hf` of a checkpoint holding a 4 x 4 weight stored as one element with strides (0, 0)",
        lambda fx: (["convert", "to-hf", fx["expanded"], f"{fx['tmp']}/hf-expanded"], f"{fx['tmp']}/hf-expanded"),
        ["<tmp>/ckpt/expanded/__expanded.distcp at byte 0", "strides (0, 0)", "refusing to read it"],
        how="main",
    ),
    _c(
        "cli-convert-expanded-huge",
        SET,
        "`hf3d convert to-hf` of a checkpoint holding a 65536 x 65536 weight stored as one element (1,577 bytes)",
        lambda fx: (["convert", "to-hf", fx["expanded_huge"], f"{fx['tmp']}/hf-huge"], f"{fx['tmp']}/hf-huge"),
        ["<tmp>/ckpt/expanded-huge/.metadata: the box of 'model/lm_extra.weight'", "needs 17179869184 bytes"],
        how="main",
    ),
    _c(
        "cli-convert-shared-bytes",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose .metadata points two weights at the same stored bytes",
        lambda fx: (["convert", "to-hf", fx["shared_bytes"], f"{fx['tmp']}/hf-shared"], f"{fx['tmp']}/hf-shared"),
        ["<tmp>/ckpt/shared-bytes/.metadata declares items of", "that overlap or run past"],
        how="main",
    ),
    _c(
        "cli-convert-linked-data",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose data file links to another's (its marker lists no files)",
        lambda fx: (["convert", "to-hf", fx["linked_data"], f"{fx['tmp']}/hf-linked"], f"{fx['tmp']}/hf-linked"),
        ["checkpoint <tmp>/ckpt/linked-data is damaged: __0_0.distcp is a link or not a regular file"],
        how="main",
    ),
    _c(
        "cli-from-hf-shape-past-its-bytes",
        SET,
        "`hf3d convert from-hf` of a safetensors whose header gives a tensor more values than its byte range holds",
        lambda fx: (["convert", "from-hf", fx["wider_than_its_bytes"], f"{fx['tmp']}/ck-wide"], f"{fx['tmp']}/ck-wide"),
        ["model.safetensors: 'model.norm.weight' is F32 of shape [2, 48] (384 bytes)", "its header gives it bytes"],
        how="main",
    ),
    _c(
        "cli-from-hf-negative-shape",
        SET,
        "`hf3d convert from-hf` of a safetensors whose header gives a tensor a negative dimension",
        lambda fx: (["convert", "from-hf", fx["negative_shape"], f"{fx['tmp']}/ck-neg"], f"{fx['tmp']}/ck-neg"),
        ["the header entry 'model.norm.weight' is not a tensor", "a shape of whole numbers >= 0"],
        how="main",
    ),
    _c(
        "cli-from-hf-overlapping-tensors",
        SET,
        "`hf3d convert from-hf` of a safetensors whose header lays two tensors over the same bytes",
        lambda fx: (["convert", "from-hf", fx["overlapping"], f"{fx['tmp']}/ck-overlap"], f"{fx['tmp']}/ck-overlap"),
        ["model.safetensors: the bytes of 'model.layers.0.", "overlap those of"],
        how="main",
    ),
    _c(
        "cli-convert-linked-folder",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose .metadata names sub/__0_0.distcp, sub a link to another checkpoint",
        lambda fx: (
            ["convert", "to-hf", fx["linked_folder"], f"{fx['tmp']}/hf-linked-folder"],
            f"{fx['tmp']}/hf-linked-folder",
        ),
        ["<tmp>/ckpt/linked-folder/sub/__0_0.distcp, a data file its .metadata names", "in a linked folder"],
        how="main",
    ),
    _c(
        "cli-convert-linked-folder-listed",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose marker lists sub/__0_0.distcp, sub a link to another checkpoint",
        lambda fx: (
            ["convert", "to-hf", fx["linked_folder_listed"], f"{fx['tmp']}/hf-linked-listed"],
            f"{fx['tmp']}/hf-linked-listed",
        ),
        ["checkpoint <tmp>/ckpt/linked-folder-listed is damaged: sub/__0_0.distcp is a link", "lies below a link"],
        how="main",
    ),
    _c(
        "cli-convert-inflating-box",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose stored box holds a data.pkl deflated from 64 MiB of zeros (65 KB)",
        lambda fx: (
            ["convert", "to-hf", fx["inflating_box"], f"{fx['tmp']}/hf-inflating"],
            f"{fx['tmp']}/hf-inflating",
        ),
        [
            "<tmp>/ckpt/inflating-box/__inflating.distcp at byte 0: its record 'archive/data.pkl' is compressed",
            "refusing to inflate it",
        ],
        how="main",
    ),
    _c(
        "cli-convert-inflating-extra",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose extra.pt holds a data.pkl deflated from 64 MiB of zeros",
        lambda fx: (
            ["convert", "to-hf", fx["inflating_extra"], f"{fx['tmp']}/hf-inflating-extra"],
            f"{fx['tmp']}/hf-inflating-extra",
        ),
        ["<tmp>/ckpt/inflating-extra/extra.pt: its record 'archive/data.pkl' is compressed"],
        how="main",
    ),
    _c(
        "cli-convert-counted",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose .metadata declares a bytes object of 1.9 GB in 1,011 bytes",
        lambda fx: (["convert", "to-hf", fx["counted"], f"{fx['tmp']}/hf-counted"], f"{fx['tmp']}/hf-counted"),
        ["<tmp>/ckpt/counted/.metadata is not a whole pickle", "expected 1900000000 bytes in a bytes8"],
        how="main",
    ),
    _c(
        "cli-convert-repeated-box",
        SET,
        "`hf3d convert to-hf` of a checkpoint whose .metadata lists one stored row of a 4096 x 4096 weight 4096 times",
        lambda fx: (["convert", "to-hf", fx["repeated_box"], f"{fx['tmp']}/hf-repeated"], f"{fx['tmp']}/hf-repeated"),
        ["<tmp>/ckpt/repeated-box/.metadata declares two boxes of 'model/lm_extra.weight' at [0, 0]"],
        how="main",
    ),
    _c(
        "cli-average-partial-tensor",
        SET,
        "`hf3d average` of checkpoints declaring a 2^20 x 2^20 weight of which one element is stored",
        lambda fx: (
            ["average", fx["partial_tensor"], fx["partial_tensor_copy"], "--out", f"{fx['tmp']}/avg-x"],
            f"{fx['tmp']}/avg-x",
        ),
        [
            "<tmp>/ckpt/partial-tensor/.metadata declares 'model/lm_extra.weight' of size [1048576, 1048576]",
            "stored only in part",
        ],
        how="main",
    ),
    _c(
        "cli-from-hf-index-outside",
        SET,
        "`hf3d convert from-hf` of a folder whose index names '../private/model.safetensors'",
        lambda fx: (["convert", "from-hf", fx["index_outside"], f"{fx['tmp']}/ck-ix-out"], f"{fx['tmp']}/ck-ix-out"),
        [
            "<tmp>/models/index-outside/model.safetensors.index.json names the shard '../private/model.safetensors'",
            "not a file name inside",
        ],
        how="main",
    ),
    _c(
        "cli-from-hf-index-absolute",
        SET,
        "`hf3d convert from-hf` of a folder whose index names a shard by an absolute path",
        lambda fx: (["convert", "from-hf", fx["index_absolute"], f"{fx['tmp']}/ck-ix-abs"], f"{fx['tmp']}/ck-ix-abs"),
        ["index.json names the shard '<tmp>/private/model.safetensors'", "hf3d reads no weights from outside"],
        how="main",
    ),
    _c(
        "cli-from-hf-index-no-map",
        SET,
        "`hf3d convert from-hf` of a folder whose index has no weight_map",
        lambda fx: (["convert", "from-hf", fx["index_no_map"], f"{fx['tmp']}/ck-ix-none"], f"{fx['tmp']}/ck-ix-none"),
        ["<tmp>/models/index-no-map/model.safetensors.index.json has no weight_map"],
        how="main",
    ),
    _c(
        "cli-from-hf-index-list-map",
        SET,
        "`hf3d convert from-hf` of a folder whose index's weight_map is a list",
        lambda fx: (["convert", "from-hf", fx["index_list_map"], f"{fx['tmp']}/ck-ix-list"], f"{fx['tmp']}/ck-ix-list"),
        ["<tmp>/models/index-list-map/model.safetensors.index.json has no weight_map"],
        how="main",
    ),
    _c(
        "cli-from-hf-index-number",
        SET,
        "`hf3d convert from-hf` of a folder whose index maps a tensor to the number 3",
        lambda fx: (["convert", "from-hf", fx["index_number"], f"{fx['tmp']}/ck-ix-num"], f"{fx['tmp']}/ck-ix-num"),
        ["<tmp>/models/index-number/model.safetensors.index.json has no weight_map"],
        how="main",
    ),
    _c(
        "cli-from-hf-index-deep",
        SET,
        "`hf3d convert from-hf` of a folder whose index is JSON nested 100000 deep",
        lambda fx: (["convert", "from-hf", fx["index_deep"], f"{fx['tmp']}/ck-ix-deep"], f"{fx['tmp']}/ck-ix-deep"),
        ["<tmp>/models/index-deep/model.safetensors.index.json nests JSON deeper than hf3d parses"],
        how="main",
    ),
    _c(
        "cli-from-hf-header-deep",
        SET,
        "`hf3d convert from-hf` of a safetensors whose header is JSON nested 100000 deep",
        lambda fx: (["convert", "from-hf", fx["header_deep"], f"{fx['tmp']}/ck-hd-deep"], f"{fx['tmp']}/ck-hd-deep"),
        ["<tmp>/models/header-deep/model.safetensors is not a readable safetensors file", "nests JSON too deep"],
        how="main",
    ),
    _c(
        "cli-from-hf-header-long",
        SET,
        "`hf3d convert from-hf` of a safetensors whose header length is 2^40 bytes",
        lambda fx: (["convert", "from-hf", fx["header_long"], f"{fx['tmp']}/ck-hd-long"], f"{fx['tmp']}/ck-hd-long"),
        [
            "<tmp>/models/header-long/model.safetensors is not a readable safetensors file",
            "header length beyond the end of the file",
        ],
        how="main",
    ),
    _c(
        "cli-from-hf-linked-weights",
        SET,
        "`hf3d convert from-hf` of a folder whose model.safetensors links to a file outside it",
        lambda fx: (["convert", "from-hf", fx["linked_weights"], f"{fx['tmp']}/ck-lw"], f"{fx['tmp']}/ck-lw"),
        ["<tmp>/models/linked-weights/model.safetensors is a link to <tmp>/private/model.safetensors, outside"],
        how="main",
    ),
    # --- launch: the world vs the config ---------------------------------------------------------------
    _c(
        "set-python-tag",
        SET,
        "`--set` with a YAML python tag (`run.steps=!!python/object/apply:os.system [...]`)",
        lambda fx: [
            "train",
            str(TINY_SMOLLM.parent.parent / "configs" / "tiny-smollm.yaml"),
            "--set",
            'run.steps=!!python/object/apply:os.system ["true"]',
        ],  # fmt: skip
        [
            "--set 'run.steps=!!python/object/apply:os.system [\"true\"]': the value is not YAML hf3d reads",
            "write a plain value",
        ],  # fmt: skip
        how="main",
    ),
    _c(
        "launch-tp-does-not-fit",
        LAUNCH,
        "`parallel.tp: 3` for a model of 6 query and 2 KV heads, on 1 process",
        lambda fx: _check_run("parallel.tp=3", world_size=1),
        ["parallel.tp=3 does not fit this llama model: 6 query heads, 2 KV heads", "Valid tp values: 1, 2"],
    ),
    _c(
        "launch-muon-zero2",
        LAUNCH,
        "`optim.name: muon` with `parallel.zero_stage: 2`",
        lambda fx: _check_optimizer("optim.name=muon", "parallel.zero_stage=2"),
        ["optim.name: muon runs at parallel.zero_stage 0 or 1", "got parallel.zero_stage=2", "parallel.zero_stage: 1"],
    ),
    _c(
        "launch-ep-experts",
        LAUNCH,
        "`parallel.ep: 3` for a MoE model of 8 experts, on 3 processes",
        lambda fx: _check_moe_run("parallel.ep=3", world_size=3),
        ["parallel.ep=3 does not divide this qwen3_moe model's 8 experts", "use an ep that divides 8"],
    ),
    _c(
        "launch-ep-dp",
        LAUNCH,
        "`parallel.ep: 4` on 2 processes (dp = 2)",
        lambda fx: _check_moe_run("parallel.ep=4", world_size=2),
        ["parallel.ep=4 does not divide dp=2", "use an ep that divides 2"],
    ),
    _c(
        "launch-ep-dense",
        LAUNCH,
        "`parallel.ep: 2` for a dense model",
        lambda fx: _check_run("parallel.ep=2", world_size=2),
        ["parallel.ep=2 needs a mixture-of-experts model; this llama model has no experts"],
    ),
    _c(
        "launch-moe-router",
        LAUNCH,
        "a MoE family whose router hf3d does not implement (Mixtral)",
        lambda fx: _check_other_router(),
        ["model_type 'mixtral' is a mixture-of-experts family whose router hf3d does not implement", "qwen3_moe"],
    ),
    _c(
        "launch-flash-attention",
        LAUNCH,
        "`model.attn_implementation: flash_attention_2` without the flash-attn package",
        lambda fx: _check_run("model.attn_implementation=flash_attention_2"),
        ["model.attn_implementation='flash_attention_2' needs the flash_attn package", 'pip install "hf3d[gpu]"'],
    ),
    _c(
        "launch-final-foreign",
        LAUNCH,
        "`run.output_dir` whose final/ holds a file of the user's beside an earlier export",
        lambda fx: _check_run(f"run.output_dir={fx['foreign_run']}"),
        ["<tmp>/foreign-run/final holds 'my_notes.txt', which hf3d does not write there", "choose a new output path"],
    ),
    _c(
        "launch-output-dir-a-file",
        LAUNCH,
        "`run.output_dir` that is a file",
        lambda fx: _check_run(f"run.output_dir={fx['a_file']}"),
        ["run.output_dir <tmp>/a-file is a file: give the path of a folder"],
    ),
    _c(
        "launch-metrics-link",
        LAUNCH,
        "`run.output_dir` whose metrics.jsonl is a link to a file elsewhere",
        lambda fx: _check_run(f"run.output_dir={fx['linked_run']}"),
        ["<tmp>/linked-run/metrics.jsonl is a link; hf3d never writes through a link nor replaces one"],
    ),
    _c(
        "launch-world-size",
        LAUNCH,
        "1 process launched for `parallel.tp: 2`",
        lambda fx: _check_run("parallel.tp=2", world_size=1),
        ["world size 1 is not tp·pp·dp·cp = 2·1·?·1", "hf3d train --nproc-per-node 2"],
    ),
    _c(
        "launch-dp-product",
        LAUNCH,
        "`parallel.dp: 3` on 4 processes",
        lambda fx: _check_run("parallel.dp=3", world_size=4),
        ["world size 4 is not tp·pp·dp=3·cp = 1·1·3·1"],
    ),
    _c(
        "launch-cp-world-size",
        LAUNCH,
        "2 processes launched for `parallel.tp: 2, cp: 2`",
        lambda fx: _check_run("parallel.tp=2", "parallel.cp=2", world_size=2),
        ["world size 2 is not tp·pp·dp·cp = 2·1·?·2", "hf3d train --nproc-per-node 4", "parallel.tp/pp/dp/cp"],
    ),
    _c(
        "launch-cp-seq-len",
        LAUNCH,
        "`data.seq_len` not divisible by 2·cp",
        lambda fx: _check_run("parallel.cp=2", "data.seq_len=30", world_size=2),
        ["data.seq_len=30 is not a multiple of 4 (2*cp = 4)", "use a sequence length that is a multiple of 4"],
    ),
    _c(
        "launch-global-batch",
        LAUNCH,
        "`run.global_batch` not divisible by dp · micro-batches",
        lambda fx: _check_run("run.global_batch=6", "parallel.num_microbatches=2", world_size=2),
        ["run.global_batch=6 is not divisible by dp·num_microbatches = 2·2 = 4", "use a multiple of 4"],
    ),
    _c(
        "launch-seq-len",
        LAUNCH,
        "`data.seq_len` beyond the model's positions",
        lambda fx: _check_run("data.seq_len=1024"),
        ["data.seq_len=1024 is longer than the model's max_position_embeddings=512"],
    ),
    _c(
        "launch-stage-seq-len",
        LAUNCH,
        "a data stage's `seq_len` beyond the model's positions, RoPE unchanged",
        lambda fx: _check_run("run.steps=10", _long_stage(fx, seq_len=1024)),
        [
            "data.stages[1].seq_len=1024 is longer than the model's max_position_embeddings=512 in data stage 'long'",
            "no RoPE setting changes",
        ],
    ),
    _c(
        "launch-stage-rope-max-pos",
        LAUNCH,
        "a data stage that changes `rope_theta` for longer rows but not `max_position_embeddings`",
        lambda fx: _check_run("run.steps=10", _long_stage(fx, seq_len=1024, rope_theta="1.0e+6")),
        ["data.stages[1].seq_len=1024", "of data stage 'long', which changes RoPE (rope_theta)", "at least 1024"],
    ),
    _c(
        "launch-stage-rope-scaling",
        LAUNCH,
        "a data stage's `rope_scaling` without the keys of its type",
        lambda fx: _check_run("run.steps=10", _long_stage(fx, rope_scaling="{rope_type: linear}")),
        ["data.stages[1] (long): the RoPE settings", "Missing required keys", "{'factor'}"],
    ),
    _c(
        "launch-stage-after-end",
        LAUNCH,
        "a data stage starting after `run.steps`",
        lambda fx: _check_run("run.steps=10", _stages(fx, 0, 20)),
        ["data stage 'anneal' (start_step 20) would start at step 21, after the run's last step (10)"],
    ),
    _c(
        "launch-warmup-too-long",
        LAUNCH,
        "`optim.warmup_steps` as long as the run (a short try of a long run's config)",
        lambda fx: next(line for line in _check_run("run.steps=30", "optim.warmup_steps=30") if "warm-up" in line),
        ["optim.warmup_steps=30 does not fit the 30-step run, so it warms up over 3 steps, a tenth of the run"],
        error=False,
        behaviour="the run warms up over a tenth of the run and says so in its derived values",
    ),
    _c(
        "launch-warmup-too-long-short-run",
        LAUNCH,
        "`optim.warmup_steps` as long as a run shorter than 20 steps (a tenth of it is under 2 steps)",
        lambda fx: next(line for line in _check_run("run.steps=10", "optim.warmup_steps=10") if "warm-up" in line),
        ["optim.warmup_steps=10 does not fit the 10-step run, so it does not warm up"],
        error=False,
        behaviour="the run does not warm up (a one-step warm-up would run at the peak lr) and says so",
    ),
    _c(
        "launch-wsd-warmup-too-long",
        LAUNCH,
        "`optim.schedule: wsd` whose warm-up runs into its decay (20 warm-up steps, a 10-step try)",
        lambda fx: _check_run("run.steps=10", "optim.warmup_steps=20", "optim.schedule=wsd", "optim.decay_steps=0.1"),
        [
            "optim.warmup_steps (20) + optim.decay_steps (1) do not fit in the run",
            "set optim.warmup_steps to at most 9",
        ],
    ),
    _c(
        "launch-env-tp",
        LAUNCH,
        "`HF3D_TP=two` in the environment",
        lambda fx: _from_env(fx, HF3D_TP="two"),
        ["HF3D_TP must be a positive integer, got 'two'"],
    ),
    _c(
        "launch-env-schedule",
        LAUNCH,
        "`HF3D_PP_SCHEDULE=gpipe` in the environment",
        lambda fx: _from_env(fx, HF3D_PP_SCHEDULE="gpipe"),
        ["HF3D_PP_SCHEDULE='gpipe' is not a pipeline schedule", "known: afab"],
    ),
    _c(
        "launch-env-compile",
        LAUNCH,
        "`HF3D_COMPILE=maybe` in the environment",
        lambda fx: _from_env(fx, HF3D_COMPILE="maybe"),
        ["HF3D_COMPILE must be 1 or 0 (true or false), or auto, got 'maybe'"],
    ),
    _c(
        "launch-compile-dropout",
        LAUNCH,
        "`parallel.compile: true` for a model with attention dropout",
        lambda fx: _check_run_dropout("parallel.compile=true"),
        ["parallel.compile=True cannot run with attention_dropout=0.1", "set the model's attention_dropout to 0"],
    ),
    _c(
        "launch-compile-no-cxx",
        LAUNCH,
        "`parallel.compile: true` on CPU where inductor finds no C++ compiler",
        lambda fx: _without_cxx(lambda: _check_run("parallel.compile=true")),
        ["parallel.compile=True on CPU needs a C++ compiler", "hf3d-no-such-cxx", "install g++", "CXX"],
    ),
    _c(
        "launch-nproc-zero",
        LAUNCH,
        "`hf3d train --nproc-per-node 0`",
        lambda fx: ["train", "--nproc-per-node", "0", "--set", f"run.output_dir={fx['tmp']}/nproc-zero"],
        ["hf3d train: error: --nproc-per-node must be at least 1, got 0"],
        how="main",
    ),
    _c(
        "launch-nproc-abbreviated",
        LAUNCH,
        "`hf3d train --nproc 2` (the launch option abbreviated)",
        lambda fx: ["train", "--nproc", "2", "--set", f"run.output_dir={fx['tmp']}/nproc-short"],
        ["spell the launch flags in full (--nproc-per-node N, ...)"],
        how="main",
    ),
    _c(
        "launch-nnodes-word",
        LAUNCH,
        "`hf3d train --nnodes two`",
        lambda fx: ["train", "--nnodes", "two", "--set", f"run.output_dir={fx['tmp']}/nnodes-word"],
        ["hf3d train: error: --nnodes takes N or MIN:MAX (whole numbers), got 'two'"],
        how="main",
    ),
    _c(
        "launch-nnodes-reversed",
        LAUNCH,
        "`hf3d train --nnodes 4:2` (MIN above MAX)",
        lambda fx: ["train", "--nnodes", "4:2", "--set", f"run.output_dir={fx['tmp']}/nnodes-reversed"],
        ["hf3d train: error: --nnodes 4:2: need 1 <= MIN <= MAX"],
        how="main",
    ),
    _c(
        "launch-nodes-no-endpoint",
        LAUNCH,
        "`hf3d train --nnodes 2` without `--rdzv-endpoint`",
        lambda fx: ["train", "--nnodes", "2", "--set", f"run.output_dir={fx['tmp']}/no-endpoint"],
        ["--nnodes 2 needs --rdzv-endpoint HOST:PORT, the same on every node", "a machine that stays up"],
        how="main",
    ),
    _c(
        "launch-node-rank-outside",
        LAUNCH,
        "`hf3d train --nnodes 2 --node-rank 2`",
        lambda fx: [
            "train",
            *"--nnodes 2 --node-rank 2 --rdzv-endpoint h:29500 --set".split(),
            f"run.output_dir={fx['tmp']}/r",
        ],
        ["--node-rank 2 is not a node of --nnodes 2 (0 to 1)"],
        how="main",
    ),
    _c(
        "launch-rdzv-backend",
        LAUNCH,
        "`hf3d train --rdzv-backend etcd` (not a backend hf3d launches with)",
        lambda fx: [
            "train",
            *"--nnodes 2 --rdzv-backend etcd --rdzv-endpoint h:2379 --set".split(),
            f"run.output_dir={fx['tmp']}/b",
        ],
        ["--rdzv-backend must be one of c10d, etcd-v2, static, got 'etcd'"],
        how="main",
    ),
    _c(
        "launch-etcd-missing",
        LAUNCH,
        "`hf3d train --rdzv-backend etcd-v2` where python-etcd is not installed",
        lambda fx: [
            "train",
            *"--nnodes 2 --rdzv-backend etcd-v2 --rdzv-endpoint h:2379 --set".split(),
            f"run.output_dir={fx['tmp']}/e",
        ],
        ["--rdzv-backend etcd-v2 needs the python-etcd package on every node", "or use --rdzv-backend c10d"],
        how="main",
    ),
    _c(
        "launch-rdzv-conf",
        LAUNCH,
        "`hf3d train --rdzv-conf last_call_timeout` (no value)",
        lambda fx: [
            "train",
            *"--nnodes 1:2 --rdzv-endpoint h:1 --rdzv-conf last_call_timeout --set".split(),
            f"run.output_dir={fx['tmp']}/c",
        ],
        ["--rdzv-conf takes KEY=VALUE,KEY=VALUE; 'last_call_timeout' is not KEY=VALUE"],
        how="main",
    ),
    _c(
        "launch-max-restarts",
        LAUNCH,
        "`hf3d train --nproc-per-node 2 --max-restarts -1`",
        lambda fx: _launch_flags(fx, "--nproc-per-node 2 --max-restarts -1"),
        ["hf3d train: error: --max-restarts must be 0 or more, got -1"],
        how="main",
    ),
    _c(
        "launch-nodes-config",
        LAUNCH,
        "one node of a job started with another `--set` value (2 ranks as 2 nodes)",
        lambda ctx: _nodes_disagree(ctx["fx"]),
        ["node 1 (host h1, rank 1) runs another config than node 0", "run.steps is 5 there, 4 on node 0", "--set"],
        how="dist2",
    ),
    _c(
        "launch-nodes-data",
        LAUNCH,
        "one node of a job whose copy of the data file holds one document more (2 ranks as 2 nodes)",
        lambda ctx: _nodes_read_other_data(ctx["fx"]),
        ["node 1 (host h1, rank 1) reads other data than node 0", "source 'good' num_tokens is", "same data files"],
        how="dist2",
    ),
    # --- data files ------------------------------------------------------------------------------------
    _c(
        "data-missing-file",
        FILES,
        "a data file that does not exist",
        lambda fx: _pipe(fx, path=fx["data"] + "/nope.jsonl"),
        ["data source 'nope': '<tmp>/data/nope.jsonl' does not exist"],
    ),
    _c(
        "data-glob-no-match",
        FILES,
        "a glob that matches nothing",
        lambda fx: _pipe(fx, path=fx["data"] + "/2031/*.jsonl"),
        ["data source '2031': the pattern '<tmp>/data/2031/*.jsonl' matches no files"],
    ),
    _c(
        "data-empty-folder",
        FILES,
        "a folder with no data files",
        lambda fx: _pipe(fx, path=fx["empty_folder"]),
        ["data source 'empty_folder': the folder '<tmp>/data/empty_folder' holds no .jsonl"],
    ),
    _c(
        "data-unknown-format",
        FILES,
        "a .csv file (format not told)",
        lambda fx: _pipe(fx, path=fx["csv"]),
        ["data source 'table.csv': cannot tell the format of '<tmp>/data/table.csv'", "set kind"],
    ),
    _c(
        "data-mixed-formats",
        FILES,
        "a folder mixing .jsonl and .txt",
        lambda fx: _pipe(fx, path=fx["mixed"]),
        ["data source 'mixed': '<tmp>/data/mixed' mixes formats (json, text)", "one source per format"],
    ),
    _c(
        "data-zero-bytes",
        FILES,
        "an empty (0-byte) .jsonl file",
        lambda fx: _pipe(fx, path=fx["zero_bytes"]),
        ["data source 'zero_bytes': '<tmp>/data/zero_bytes.jsonl' is empty (0 bytes)", "remove it"],
    ),
    _c(
        "data-broken-json",
        FILES,
        "a .jsonl whose last line is cut off",
        lambda fx: _pipe(fx, path=fx["broken_json"]),
        ["data source 'broken_json': could not load '<tmp>/data/broken_json.jsonl'", "JSON parse error", "row 30"],
    ),
    _c(
        "data-broken-parquet",
        FILES,
        "a .parquet file that is not parquet",
        lambda fx: _pipe(fx, path=fx["bad_parquet"]),
        ["data source 'broken': could not load '<tmp>/data/broken.parquet'", "not a parquet file"],
    ),
    _c(
        "data-hub-offline",
        FILES,
        "a Hub dataset id that cannot be fetched (offline)",
        lambda fx: _pipe(fx, path="hf3d-no-such-org/no-such-dataset"),
        ["data source 'hf3d-no-such-org/no-such-dataset': could not load Hub dataset"],
    ),
    _c(
        "data-shard-no-index",
        FILES,
        "datatrove shard without its .ds.index",
        lambda fx: _pipe(fx, path=fx["shards_no_index"]),
        ["data source 'shards_no_index':", "00000_00000_doc_shuffled.ds' has no .index", "save_index=True"],
    ),
    _c(
        "data-shard-no-metadata",
        FILES,
        "datatrove shard without its .ds.metadata",
        lambda fx: _pipe(fx, path=fx["shards_no_metadata"]),
        [
            "datatrove shard '<tmp>/data/shards_no_metadata/00000_00000_doc_shuffled.ds' has no",
            ".ds.metadata",
            "re-tokenise",
        ],
    ),
    _c(
        "data-shard-bad-metadata",
        FILES,
        "datatrove metadata with a token size of 3 bytes",
        lambda fx: _pipe(fx, path=fx["shards_bad_metadata"]),
        ["shards_bad_metadata/00000_00000_doc_shuffled.ds.metadata: expected '<tokenizer>|<2 or 4>'", "'3'"],
    ),
    _c(
        "data-shard-short-index",
        FILES,
        "datatrove index that ends before the tokens do",
        lambda fx: _pipe(fx, path=fx["shards_short_index"]),
        ["data source 'shards_short_index':", "but its index ends elsewhere", "re-tokenise"],
    ),
    # --- dataset contents ----------------------------------------------------------------------------
    _c(
        "contents-blank-lines",
        CONTENTS,
        "empty lines between and after the rows of a .jsonl",
        _blank_lines,
        ["data source blank_lines (json, <tmp>/data/blank_lines.jsonl)", "30 documents"],
        error=False,
        behaviour="blank lines are not rows",
    ),
    _c(
        "contents-blank-text",
        CONTENTS,
        'rows whose text is "" or whitespace',
        lambda fx: _skipped(fx, "blank_texts", 2),
        ["data source blank_texts", "30 documents (2 empty or missing skipped)"],
        error=False,
        behaviour="skipped, counted in the summary",
    ),
    _c(
        "contents-null-text",
        CONTENTS,
        "rows whose text is null",
        lambda fx: _skipped(fx, "null_texts", 2),
        ["data source null_texts", "30 documents (2 empty or missing skipped)"],
        error=False,
        behaviour="skipped, counted in the summary",
    ),
    _c(
        "contents-field-missing-some",
        CONTENTS,
        "the text field missing in some rows",
        lambda fx: _skipped(fx, "some_missing", 2),
        ["data source some_missing", "30 documents (2 empty or missing skipped)"],
        error=False,
        behaviour="skipped, counted in the summary",
    ),
    _c(
        "contents-number-in-one-row",
        CONTENTS,
        "a number instead of text in one row",
        lambda fx: _skipped(fx, "number_text", 1),
        ["data source number_text", "30 documents (1 empty or missing skipped)"],
        error=False,
        behaviour="skipped, counted in the summary",
        gap="a non-text value is counted as 'empty or missing'",
    ),
    _c(
        "contents-field-missing-all",
        CONTENTS,
        "the text field missing in every row",
        lambda fx: _pipe(fx, path=fx["no_text_field"]),
        ["data source 'no_text_field': no field 'text' in '<tmp>/data/no_text_field.jsonl'", "content", "text_field"],
    ),
    _c(
        "contents-numbers-only",
        CONTENTS,
        "a text field holding numbers in every row",
        lambda fx: _pipe(fx, path=fx["all_numbers"]),
        ["data source 'all_numbers': field 'text' of '<tmp>/data/all_numbers.jsonl' holds int64, not text"],
    ),
    _c(
        "contents-non-utf8-jsonl",
        CONTENTS,
        "non-UTF-8 (latin-1) bytes in a .jsonl",
        lambda fx: _pipe(fx, path=fx["latin1"]),
        ["data source 'latin1': '<tmp>/data/latin1.jsonl' is not valid UTF-8", "re-encode it as UTF-8"],
    ),
    _c(
        "contents-non-utf8-txt",
        CONTENTS,
        "non-UTF-8 bytes in a .txt",
        _txt_replaced,
        ["data source txt (text, <tmp>/data/txt)", "1 documents", "U+FFFD"],
        error=False,
        behaviour="invalid bytes read as U+FFFD",
    ),
    _c(
        "contents-empty-dataset",
        CONTENTS,
        "a dataset whose every text is empty",
        lambda fx: _pipe(fx, path=fx["all_empty"]),
        ["data source 'all_empty' (<tmp>/data/all_empty.jsonl) holds 0 tokens in 0 documents", "add data"],
    ),
    _c(
        "contents-shorter-than-window",
        CONTENTS,
        "a source shorter than one window of seq_len + 1",
        lambda fx: _pipe(fx, path=fx["one_short_doc"]),
        ["data source 'one_short_doc' (<tmp>/data/one_short_doc.jsonl) holds 4 tokens", "lower data.seq_len"],
    ),
    _c(
        "contents-shard-other-tokenizer",
        CONTENTS,
        "datatrove shards written with a tokenizer of another vocabulary",
        lambda fx: _pipe(fx, path=fx["shards_other_vocab"]),
        ["data source 'shards_other_vocab': written with the tokenizer '<tmp>/data/other-tokenizer.json'"],
    ),
    _c(
        "contents-shard-ids-beyond-vocab",
        CONTENTS,
        "datatrove shards whose token ids exceed the model's vocabulary (101)",
        _train_shards,
        ["input_ids[0, 0] = 292", "vocab_size=101", "tokenizer and the model"],
        how="dist",
        gap="names the batch row, not the shard it came from",
    ),
    # --- checkpoints ---------------------------------------------------------------------------------
    _c(
        "ckpt-resume-not-a-checkpoint",
        CKPT,
        "`checkpoint.resume:` a folder that holds no checkpoint",
        lambda fx: _resolve(fx, fx["data"], fx["run"] + "/checkpoints"),
        ["checkpoint.resume='<tmp>/data' is neither a complete checkpoint nor a folder of them"],
    ),
    _c(
        "ckpt-resume-all-incomplete",
        CKPT,
        "`resume: auto` over interrupted saves only",
        lambda fx: _resolve(fx, "auto", fx["partial_root"]),
        ["<tmp>/ckpt/partial/checkpoints holds checkpoint folders but none is complete (step_3)"],
    ),
    _c(
        "ckpt-resume-older-replaces-later",
        CKPT,
        "`checkpoint.resume:` step_4 of the run's own folder, which holds step_8 (another trajectory's)",
        _rewind,
        [
            "the run goes on at step 5 from <tmp>/rewound/checkpoints/step_4",
            "(step_8) that its saves would replace",
            "set checkpoint.replace_later_steps: true",
        ],  # fmt: skip
    ),
    _c(
        "ckpt-bytes-entry",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose .metadata declares a weight as DCP bytes (a pickle)",
        _load_bytes_entry,
        [
            "<tmp>/ckpt/bytes-entry/.metadata declares the entry 'model/model.layers.0.mlp.down_proj.weight' as "
            "BytesStorageMetadata, not a tensor",
            "may have been crafted to run code",
        ],
        how="dist",
    ),
    _c(
        "ckpt-hub-pending-not-hf3ds",
        CKPT,
        "an output_dir whose hub_pending.json (the checkpoints waiting for a Hub push) is not hf3d's record",
        _hub_pending_not_hf3ds,
        ["<tmp>/pending-run/hub_pending.json is not hf3d's record of the checkpoints waiting for a Hub push"],
    ),
    _c(
        "ckpt-old-version",
        CKPT,
        "a checkpoint marker of another format version",
        lambda fx: _marker(fx, "old_version"),
        ["<tmp>/ckpt/old-version/hf3d_checkpoint.json is not an hf3d checkpoint of format version 1"],
    ),
    _c(
        "ckpt-garbled-marker",
        CKPT,
        "a truncated hf3d_checkpoint.json",
        lambda fx: _marker(fx, "garbled"),
        ["hf3d_checkpoint.json is damaged", "resume from another one"],
    ),
    _c(
        "ckpt-other-shape",
        CKPT,
        "config of a checkpoint of another shape (hidden 72 vs 48)",
        _compatible,
        ["checkpoint <tmp>/models/llama-wide does not fit this model", "hidden_size=72 (model has 48)"],
    ),
    _c(
        "ckpt-load-other-shape",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint of another shape",
        _load_other_shape,
        ["checkpoint <tmp>/ckpt/wide/step_1 does not fit this model", "hidden_size=72 (model has 48)"],
        how="dist",
    ),
    _c(
        "ckpt-load-muon-into-adamw",
        CKPT,
        "`hf3d.load_checkpoint` of a Muon run's checkpoint with an AdamW optimizer (a resume with `optim.name: adamw`)",
        _load_muon_into_adamw,
        ["the optimizer state was saved by Muon with AdamW", "this run uses an element-wise optimizer"],
        how="dist",
    ),
    _c(
        "ckpt-load-incomplete",
        CKPT,
        "`hf3d.load_checkpoint` of an interrupted save",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["partial_step"], ctx["pm"]),
        ["<tmp>/ckpt/partial/checkpoints/step_3 is not a complete hf3d checkpoint (no hf3d_checkpoint.json"],
        how="dist",
    ),
    _c(
        "ckpt-load-crafted",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose .metadata would run a command",
        _load_crafted,
        ["<tmp>/ckpt/crafted/.metadata refers to torch.distributed.checkpoint.metadata.os.system", "refusing"],
        how="dist",
    ),
    _c(
        "ckpt-load-inconsistent",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose .metadata lists one weight fewer than its config has "
        "(marker resealed)",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["inconsistent"], ctx["pm"], ctx["opt"]),
        ["could not load the checkpoint <tmp>/ckpt/inconsistent", "Missing key", "use another checkpoint"],
        how="dist",
    ),
    _c(
        "ckpt-load-damaged",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose largest file was truncated (marker intact)",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["damaged_step"], ctx["smol"], ctx["smol_opt"]),
        ["checkpoint <tmp>/ckpt/damaged/checkpoints/step_2 is damaged", "bytes where", "use another checkpoint"],
        how="dist",
    ),
    _c(
        "ckpt-resume-damaged",
        CKPT,
        "`checkpoint.resume: PATH` of a checkpoint whose largest file was truncated",
        lambda fx: _resolve(fx, fx["damaged_step"], fx["damaged_root"]),
        ["checkpoint <tmp>/ckpt/damaged/checkpoints/step_2 is damaged", "bytes where"],
    ),
    _c(
        "ckpt-auto-damaged",
        CKPT,
        "`checkpoint.resume: auto` when the newest checkpoint's largest file was truncated",
        _auto_over_damaged,
        [
            "hf3d: warning: skipping the damaged checkpoint <tmp>/ckpt/damaged/checkpoints/step_2",
            "bytes where",
            "-> resumes from <tmp>/ckpt/damaged/checkpoints/step_1",
        ],
        error=False,
        behaviour="one warning line; resumes from the previous checkpoint",
    ),
    _c(
        "ckpt-load-linked-data",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose data file links to another checkpoint's (its marker lists no "
        "files)",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["linked_data"], ctx["pm"], ctx["opt"]),
        ["checkpoint <tmp>/ckpt/linked-data is damaged: __0_0.distcp is a link or not a regular file"],
        how="dist",
    ),
    _c(
        "ckpt-load-linked-folder",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose .metadata names sub/__0_0.distcp, sub a link to another one",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["linked_folder"], ctx["pm"], ctx["opt"]),
        ["<tmp>/ckpt/linked-folder/sub/__0_0.distcp, a data file its .metadata names", "in a linked folder"],
        how="dist",
    ),
    _c(
        "ckpt-load-linked-folder-listed",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose marker lists sub/__0_0.distcp, sub a link to another",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["linked_folder_listed"], ctx["pm"], ctx["opt"]),
        ["checkpoint <tmp>/ckpt/linked-folder-listed is damaged: sub/__0_0.distcp is a link", "lies below a link"],
        how="dist",
    ),
    _c(
        "ckpt-load-inflating-box",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose stored box holds a data.pkl deflated from 64 MiB of zeros",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["inflating_box"], ctx["pm"], ctx["opt"]),
        ["could not load the checkpoint <tmp>/ckpt/inflating-box", "its record 'archive/data.pkl' is compressed"],
        how="dist",
    ),
    _c(
        "ckpt-load-inflating-extra",
        CKPT,
        "`hf3d.load_checkpoint(extra={})` of a checkpoint whose extra.pt holds a data.pkl deflated from 64 MiB",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["inflating_extra"], ctx["pm"], ctx["opt"], extra={}),
        ["<tmp>/ckpt/inflating-extra/extra.pt: its record 'archive/data.pkl' is compressed"],
        how="dist",
    ),
    _c(
        "ckpt-load-counted",
        CKPT,
        "`hf3d.load_checkpoint` of a checkpoint whose .metadata declares a bytes object of 1.9 GB in 1,011 bytes",
        lambda ctx: __import__("hf3d").load_checkpoint(ctx["fx"]["counted"], ctx["pm"], ctx["opt"]),
        ["<tmp>/ckpt/counted/.metadata is not a whole pickle", "expected 1900000000 bytes in a bytes8"],
        how="dist",
    ),
    _c(
        "ckpt-save-over-export",
        CKPT,
        "`hf3d.save_checkpoint` at a folder that is an export of hf3d's",
        lambda ctx: __import__("hf3d").save_checkpoint(
            Path(ctx["fx"]["foreign_run"]).parent / "an-export", ctx["pm"], ctx["opt"], step=1
        ),
        ["<tmp>/an-export is an hf3d folder of another kind (export, not checkpoint)", "never deletes or replaces"],
        how="dist",
    ),
    _c(
        "ckpt-save-over-copy",
        CKPT,
        "`hf3d.save_checkpoint` at a copy (cp -r) of an hf3d checkpoint",
        lambda ctx: __import__("hf3d").save_checkpoint(
            Path(ctx["fx"]["tmp"]) / "ckpt" / "honest-copy", ctx["pm"], ctx["opt"], step=1
        ),
        ["<tmp>/ckpt/honest-copy is a copy or a move of a folder hf3d made elsewhere", "move it away"],
        how="dist",
    ),
    _c(
        "ckpt-save-annotated",
        CKPT,
        "`hf3d.save_checkpoint` at hf3d's own checkpoint after the user added NOTES.md to it",
        lambda ctx: __import__("hf3d").save_checkpoint(
            Path(ctx["fx"]["tmp"]) / "ckpt" / "annotated", ctx["pm"], ctx["opt"], step=1
        ),
        ["<tmp>/ckpt/annotated holds 'NOTES.md', which hf3d does not write there", "never deletes or replaces it"],
        how="dist",
    ),
    _c(
        "ckpt-save-unwritable",
        CKPT,
        "`hf3d.save_checkpoint` under a path that is a file",
        lambda ctx: __import__("hf3d").save_checkpoint(
            Path(ctx["fx"]["blocker"]) / "step_1", ctx["pm"], ctx["opt"], step=1
        ),
        ["<tmp>/ckpt/a-file/step_1 lies under <tmp>/ckpt/a-file, which is a file: choose another output path"],
        how="dist",
    ),
    _c(
        "ckpt-save-unshared",
        CKPT,
        "`hf3d.save_checkpoint` under another path on each rank (as a disk of each machine is, unshared)",
        lambda ctx: __import__("hf3d").save_checkpoint(
            Path(ctx["fx"]["tmp"]) / "ckpt" / "unshared" / f"rank{_rank()}" / "step_1", ctx["pm"], ctx["opt"], step=1
        ),
        ["could not write the checkpoint", "rank 1:", "is not there on this rank", "the same checkpoint path"],
        how="dist2",
    ),
    _c(
        "ckpt-data-seq-len",
        CKPT,
        "resume data state saved with another `data.seq_len`",
        lambda fx: _data_state(fx, seq_len=64),
        ["data source 'good' is read at seq_len 16 from its first window", "its position at seq_len 64 only"],
        error=False,
        behaviour="the source starts over at the new seq_len (a long-context stage); its old position is kept",
    ),
    _c(
        "ckpt-data-changed",
        CKPT,
        "resume data state after the data changed",
        lambda fx: _data_state(fx),
        ["data source 'good' had", "training windows when saved", "resume with the same data"],
    ),
    # --- Python API ----------------------------------------------------------------------------------
    _c(
        "api-parallelize-missing",
        API,
        "`hf3d.parallelize` of a path that does not exist",
        lambda ctx: __import__("hf3d").parallelize("./does/not/exist", __import__("hf3d").ParallelConfig()),
        ["'./does/not/exist'", "neither", "Hub model id"],
        how="dist",
    ),
    _c(
        "api-parallelize-tp",
        API,
        "`hf3d.parallelize(..., ParallelConfig(tp=3))` of a 6-head model, on 1 process",
        lambda ctx: __import__("hf3d").parallelize(str(TINY_SMOLLM), __import__("hf3d").ParallelConfig(tp=3)),
        ["tp=3 does not fit this llama model", "Valid tp values: 1, 2"],
        how="dist",
    ),
    _c(
        "api-parallelize-fp8-recipe",
        API,
        "`hf3d.parallelize(..., fp8='fp4')` (no such recipe)",
        lambda ctx: __import__("hf3d").parallelize(ctx["fx"]["llama"], fp8="fp4"),
        ["fp8 recipe must be one of off, tensorwise, rowwise, got 'fp4'"],
        how="dist",
    ),
    _c(
        "api-fp8-all-gather",
        API,
        '`hf3d.FP8Config("tensorwise", all_gather="yes")`',
        lambda ctx: __import__("hf3d").FP8Config("tensorwise", all_gather="yes"),
        ["fp8 all_gather must be true or false, got 'yes'"],
    ),
    _c(
        "api-parallelize-flash-attention",
        API,
        "`hf3d.parallelize(..., attn_implementation='flash_attention_2')` without the package",
        lambda ctx: __import__("hf3d").parallelize(ctx["fx"]["llama"], attn_implementation="flash_attention_2"),
        ["attn_implementation='flash_attention_2' needs the flash_attn package", 'pip install "hf3d[gpu]"'],
        how="dist",
    ),
    _c(
        "api-parallelize-compile-no-cxx",
        API,
        "`hf3d.parallelize(..., compile=True)` on CPU where inductor finds no C++ compiler",
        lambda ctx: _without_cxx(lambda: __import__("hf3d").parallelize(ctx["fx"]["llama"], compile=True)),
        ["compile=True on CPU needs a C++ compiler", "set compile to false"],
        how="dist",
    ),
    _c(
        "api-parallelize-linked-file",
        API,
        "`hf3d.parallelize` of a folder whose tokenizer.json links to a file elsewhere",
        lambda ctx: __import__("hf3d").parallelize(ctx["fx"]["linked"]),
        ["<tmp>/models/linked/tokenizer.json is a link to <tmp>/secret.txt, outside <tmp>/models/linked"],
        how="dist",
    ),
    _c(
        "api-save-checkpoint-user-folder",
        API,
        "`hf3d.save_checkpoint` at a folder of the user's (src/thesis.tex)",
        lambda ctx: __import__("hf3d").save_checkpoint(ctx["fx"]["thesis"], ctx["pm"], ctx["opt"], step=1),
        ["<tmp>/thesis is a folder hf3d did not make (it has no .hf3d-made)", "never deletes or replaces it"],
        how="dist",
    ),
    _c(
        "api-save-checkpoint-foreign-staging",
        API,
        "`hf3d.save_checkpoint(PATH)` where PATH.tmp is a folder of the user's",
        lambda ctx: __import__("hf3d").save_checkpoint(ctx["fx"]["staged"], ctx["pm"], ctx["opt"], step=1),
        ["<tmp>/staged.tmp is a folder hf3d did not make", "move it away or choose a new output path"],
        how="dist",
    ),
    _c(
        "api-save-pretrained-stock-export",
        API,
        "`save_pretrained` into a model folder that stock transformers wrote (only model files in it)",
        lambda ctx: ctx["pm"].save_pretrained(ctx["fx"]["stock_export"]),
        ["<tmp>/stock-export is a folder hf3d did not make", "never deletes or replaces it"],
        how="dist",
    ),
    _c(
        "api-save-pretrained-foreign",
        API,
        "`save_pretrained` into a folder holding a file of the user's",
        lambda ctx: ctx["pm"].save_pretrained(ctx["fx"]["not_hf"]),
        ["<tmp>/ckpt/not-hf is a folder hf3d did not make", "never deletes or replaces it", "move it away"],
        how="dist",
    ),
    _c(
        "api-trainer-push-token",
        API,
        "`hf3d.Trainer` with TrainingArguments(push_to_hub=True, hub_token=...)",
        lambda ctx: __import__("hf3d").Trainer(
            model=ctx["pm"],
            args=__import__("transformers").TrainingArguments(
                output_dir=ctx["fx"]["tmp"] + "/trainer",
                use_cpu=True,
                push_to_hub=True,
                hub_model_id="me/x",
                hub_token="hf_x",
            ),
        ),
        ["push_to_hub=True, hub_token=...", "inside training_args.bin", "HF_TOKEN"],
        how="dist",
    ),
    _c(
        "api-train-step-id",
        API,
        "`train_step` with a token id >= vocab_size",
        lambda ctx: ctx["pm"].train_step(_ids(ctx, (1, 4), VOCAB), _ids(ctx)),
        ["input_ids[1, 4] = 101", "vocab_size=101", "[0, 101)"],
        how="dist",
    ),
    _c(
        "api-train-step-label",
        API,
        "`train_step` with a label of -2",
        lambda ctx: ctx["pm"].train_step(_ids(ctx), _ids(ctx, (0, 3), -2)),
        ["labels[0, 3] = -2", "-100 (ignored) or in [0, 101)"],
        how="dist",
    ),
    _c(
        "api-train-step-z-loss",
        API,
        "`train_step(..., z_loss=-1)`",
        lambda ctx: ctx["pm"].train_step(_ids(ctx), _ids(ctx), z_loss=-1.0),
        ["z_loss must be a finite number >= 0", "-1.0"],
        how="dist",
    ),
    _c(
        "api-optimizer-string",
        API,
        "`build_optimizer(pmodel, 'adamw')`",
        lambda ctx: __import__("hf3d").build_optimizer(ctx["pm"], "adamw", lr=1e-3),
        ["optimizer_cls must be a torch.optim.Optimizer subclass, got 'adamw'"],
        how="dist",
    ),
    _c(
        "api-muon-zero2",
        API,
        "`build_optimizer(pmodel, torch.optim.Muon, zero_stage=2)`",
        lambda ctx: _muon(ctx, zero_stage=2),
        ["Muon runs at zero_stage 0 or 1 without dp_shard (got zero_stage=2)", "use zero_stage 0 or 1"],
        how="dist",
    ),
    _c(
        "api-muon-hsdp",
        API,
        "`build_optimizer(pmodel, torch.optim.Muon)` on a model built with `ParallelConfig(dp_shard=1)` (HSDP) on 2 "
        "processes",
        _muon_hsdp,
        ["Muon runs at zero_stage 0 or 1 without dp_shard", "dp_shard=1", "HSDP"],
        how="dist2",
    ),
    _c(
        "api-muon-params-norm",
        API,
        "`build_optimizer(pmodel, torch.optim.Muon, muon_params=['*norm*'])`: norm weights (1-D)",
        lambda ctx: _muon(ctx, muon_params=["*norm*"]),
        ["muon_params picks model.layers.0.input_layernorm.weight of shape [48]", "2-D matrices only", "AdamW"],
        how="dist",
    ),
    _c(
        "api-muon-adamw-key",
        API,
        "`build_optimizer(pmodel, torch.optim.Muon, adamw={'beta': ...})`",
        lambda ctx: _muon(ctx, adamw={"beta": (0.9, 0.95)}),
        ["adamw= has keys AdamW does not take: ['beta']", "betas"],
        how="dist",
    ),
    _c(
        "api-muon-kwarg",
        API,
        "`build_optimizer(pmodel, torch.optim.Muon, betas=...)`: an AdamW setting given to Muon",
        lambda ctx: _muon(ctx, betas=(0.9, 0.95)),
        ["torch.optim.Muon does not take betas", "adamw={...}"],
        how="dist",
    ),
    _c(
        "api-muon-8bit-states",
        API,
        "`build_optimizer(pmodel, torch.optim.Muon, state_precision='8bit')`: 8-bit states are torchao's AdamW's",
        lambda ctx: _muon(ctx, state_precision="8bit"),
        ["state_precision='8bit' is torchao's AdamW8bit", "Muon has no 8-bit state", "use 'bf16'"],
        how="dist",
    ),
    _c(
        "api-state-precision",
        API,
        "`build_optimizer(pmodel, torch.optim.AdamW, state_precision='fp16')`",
        lambda ctx: __import__("hf3d").build_optimizer(ctx["pm"], torch.optim.AdamW, state_precision="fp16"),
        ["state_precision must be one of fp32, bf16, 8bit", "'fp16'"],
        how="dist",
    ),
    _c(
        "api-cp-attention",
        API,
        "`parallelize(..., ParallelConfig(cp=2), attn_implementation='flex_attention')`",
        lambda ctx: __import__("hf3d").parallelize(
            ctx["fx"]["llama"], __import__("hf3d").ParallelConfig(cp=2), attn_implementation="flex_attention"
        ),
        ["cp=2 cannot run with attn_implementation='flex_attention'", "sdpa or eager", "or use cp=1"],
        how="dist",
    ),
    _c(
        "api-cp-world-size",
        API,
        "`ParallelConfig(tp=2, dp=2, cp=2)` on 4 processes",
        lambda fx: __import__("hf3d").ParallelConfig(tp=2, dp=2, cp=2).resolve(4),
        ["tp * pp * dp * cp = 2 * 1 * 2 * 2 = 8", "world size is 4"],
    ),
    _c(
        "api-parallel-config",
        API,
        "`ParallelConfig(zero_stage=4)`",
        lambda fx: __import__("hf3d").ParallelConfig(zero_stage=4),
        ["zero_stage must be 0, 1, 2 or 3, got 4"],
    ),
    _c(
        "api-activation-offload",
        API,
        '`ParallelConfig(activation_offload="yes")`',
        lambda fx: __import__("hf3d").ParallelConfig(activation_offload="yes"),
        ["ParallelConfig.activation_offload must be true or false, got 'yes'"],
    ),
    _c(
        "api-dp-shard-divides",
        API,
        "`ParallelConfig(zero_stage=3, dp_shard=3)` on 4 processes",
        lambda fx: __import__("hf3d").ParallelConfig(zero_stage=3, dp_shard=3).resolve(4),
        ["dp_shard=3 does not divide dp=4", "use one of [1, 2, 4]"],
    ),
    _c(
        "api-dp-shard-zero0",
        API,
        "`ParallelConfig(zero_stage=0, dp_shard=2)` on 4 processes",
        lambda fx: __import__("hf3d").ParallelConfig(zero_stage=0, dp_shard=2).resolve(4),
        ["dp_shard=2 with zero_stage=0", "use zero_stage 1, 2 or 3 with dp_shard"],
    ),
    _c(
        "launch-fsdp1-config",
        LAUNCH,
        "`accelerate launch` with an FSDP1 config (`fsdp_version: 1`), read by `ParallelConfig.from_env()`",
        lambda fx: _from_env(fx, ACCELERATE_USE_FSDP="true", FSDP_VERSION="1"),
        ["the accelerate launch config (fsdp_config) asks for FSDP1", "set fsdp_version to 2"],
    ),
    _c(
        "launch-fsdp-offload",
        LAUNCH,
        "`accelerate launch` with FSDP2 and `fsdp_offload_params: true`",
        lambda fx: _from_env(fx, ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_OFFLOAD_PARAMS="true"),
        ["asks for CPU offload of the parameters, which hf3d does not build"],
    ),
    _c(
        "api-trainer-fsdp1",
        API,
        "`ParallelConfig.from_env(training_args=TrainingArguments(fsdp=True, fsdp_config={'version': 1}))`",
        lambda fx: __import__("hf3d").ParallelConfig.from_env(
            training_args=SimpleNamespace(fsdp_plugin_args={"fsdp_version": 1})
        ),
        ["TrainingArguments(fsdp=..., fsdp_config=...) asks for FSDP1", "set fsdp_version to 2"],
    ),
    _c(
        "api-zero3-whole-tensor-optimizer",
        API,
        "`build_optimizer(pmodel, torch.optim.Adafactor)` on a model built with `zero_stage=3`",
        lambda ctx: _zero3_optimizer(ctx, torch.optim.Adafactor),
        ["Adafactor updates each parameter as a whole tensor", "FSDP2's dim-0 shards under zero_stage=3"],
        how="dist2",
    ),
    _c(
        "api-zero3-optimizer-stage",
        API,
        "`build_optimizer(pmodel, zero_stage=1)` on a model built with `zero_stage=3`",
        lambda ctx: _zero3_optimizer(ctx, torch.optim.AdamW, zero_stage=1),
        ["zero_stage=1 for a model built with ParallelConfig(zero_stage=3)", "leave build_optimizer's zero_stage"],
        how="dist2",
    ),
    _c(
        "api-scheduler-lr",
        API,
        "`build_lr_scheduler` on an optimizer of another lr",
        _lr_scheduler_lr_mismatch,
        ["optimizer param group 0 has lr 0.001 but the schedule's peak lr is 0.003", "lr=optim.lr"],
    ),
    _c(
        "api-pipeline-batch",
        API,
        "`DataPipeline` with a global batch not divisible by dp",
        lambda fx: _pipe(fx, path=fx["good"], global_batch=3, dp_size=2),
        ["the global batch (3) must be a positive multiple of dp=2"],
    ),
    _c(
        "api-pipeline-step-order",
        API,
        "`next_batch` of a step already taken",
        _step_taken,
        ["the batch of step 2 was already taken (the next is step 4)"],
    ),
    _c(
        "api-push-linked-file",
        API,
        "`push_to_hub` of a folder whose tokenizer.json links to a file elsewhere",
        lambda fx: __import__("hf3d.hf.hub").hf.hub.push_to_hub(fx["linked"], "me/model", token="hf_not_used"),
        ["<tmp>/models/linked/tokenizer.json is a link to <tmp>/secret.txt", "hf3d uploads no file from outside"],
    ),
    _c(
        "api-push-repo-id",
        API,
        "`push_to_hub` to a repo id with a space",
        lambda fx: _push_local(fx, "me/my model"),
        ["'me/my model' is not a Hub repo id", "NAMESPACE/NAME"],
    ),
    # --- evaluation (hf3d eval, the evals: section) ---------------------------------------------------------
    _c(
        "eval-set-parallel-value",
        EVAL,
        "`hf3d eval --set parallel.pp_schedule=gpipe` (a mesh value ParallelConfig refuses)",
        lambda fx: _eval(fx, "shakespeare-word", "--set", "parallel.pp_schedule=gpipe"),
        ["hf3d eval: error: unknown parallel.pp_schedule 'gpipe'; known schedules: afab, 1f1b"],
        how="main",
    ),
    _c(
        "eval-missing-field",
        EVAL,
        "a task row without `gold`",
        lambda fx: _eval(fx, fx["task_no_gold"]),
        ["hf3d eval: error: <tmp>/data/tasks/no_gold.jsonl line 3: the row has no 'gold' field"],
        how="main",
    ),
    _c(
        "eval-line-too-long",
        EVAL,
        "a task file with a line of 17 MiB (a whole book as one row)",
        lambda fx: _eval(fx, fx["task_long_line"]),
        ["long_line.jsonl line 2 is longer than 16 MiB, the most hf3d reads as one row or prompt: shorten it"],
        how="main",
    ),
    _c(
        "eval-not-utf8",
        EVAL,
        "a task file with a latin-1 byte",
        lambda fx: _eval(fx, fx["task_latin1"]),
        ["latin1.jsonl line 2 is not valid UTF-8 (byte 0xe9 at column 15); re-encode the file as UTF-8"],
        how="main",
    ),
    _c(
        "eval-json-too-deep",
        EVAL,
        "a task file with a line of JSON nested 100,000 deep",
        lambda fx: _eval(fx, fx["task_deep"]),
        ["deep.jsonl line 2 nests JSON deeper than hf3d parses: flatten the row"],
        how="main",
    ),
    _c(
        "eval-gold-range",
        EVAL,
        "`gold` 2 in a row of two choices",
        lambda fx: _eval(fx, fx["task_gold_out_of_range"]),
        ["gold_out_of_range.jsonl line 3: 'gold' 2 is outside the 2 choices (0 to 1)"],
        how="main",
    ),
    _c(
        "eval-empty-choices",
        EVAL,
        "a task row with an empty choice list",
        lambda fx: _eval(fx, fx["task_no_choices"]),
        ["no_choices.jsonl line 3: 'choices' is empty"],
        how="main",
    ),
    _c(
        "eval-empty-choice",
        EVAL,
        "a task row with an empty choice string",
        lambda fx: _eval(fx, fx["task_empty_choice"]),
        ["empty_choice.jsonl line 3: choices[1] is an empty string"],
        how="main",
    ),
    _c(
        "eval-not-json",
        EVAL,
        "a task line that is not JSON",
        lambda fx: _eval(fx, fx["task_not_json"]),
        ["not_json.jsonl line 2 is not valid JSON"],
        how="main",
    ),
    _c(
        "eval-task-file-missing",
        EVAL,
        "a task file that does not exist",
        lambda fx: _eval(fx, fx["tmp"] + "/nope.jsonl"),
        ["task file <tmp>/nope.jsonl does not exist"],
        how="main",
    ),
    _c(
        "eval-output-dir-a-file",
        EVAL,
        "`--output-dir` that is a file",
        lambda fx: ["eval", fx["smollm"], "--tasks", "shakespeare-word", "--output-dir", fx["a_file"]],
        ["hf3d eval: error: --output-dir <tmp>/a-file is a file: give the path of a folder"],
        how="main",
    ),
    _c(
        "eval-samples-file-a-folder",
        EVAL,
        "`--log-samples` where `samples_<task>.jsonl` is a folder",
        lambda fx: [
            "eval",
            fx["smollm"],
            "--tasks",
            "shakespeare-word",
            "--log-samples",
            "--output-dir",
            fx["eval_samples_folder"],
        ],  # fmt: skip
        ["--output-dir: the file <tmp>/eval-samples/samples_shakespeare-word.jsonl is a folder or not a regular file"],
        how="main",
    ),
    _c(
        "eval-raw-rows-not-hub",
        EVAL,
        "`--tasks shakespeare-word=FILE` (NAME=FILE names a Hub task's raw rows)",
        lambda fx: _eval(fx, f"shakespeare-word={fx['a_file']}"),
        ["NAME=FILE takes a Hub task's name ('shakespeare-word' is not one) and a JSONL file of its dataset's rows"],
        how="main",
    ),
    _c(
        "eval-fetch-not-hub",
        EVAL,
        "`hf3d fetch-tasks shakespeare-word` (a shipped task, nothing to fetch)",
        lambda fx: ["fetch-tasks", "shakespeare-word"],
        ["hf3d fetch-tasks: error: fetch-tasks fetches Hub tasks by name (hellaswag, arc_easy,"],
        how="main",
    ),
    _c(
        "eval-unknown-task",
        EVAL,
        "a misspelt task name (`hellaswagg`)",
        lambda fx: _eval(fx, "hellaswagg"),
        ["unknown task 'hellaswagg'", "did you mean 'hellaswag'?", "shakespeare-word"],
        how="main",
    ),
    _c(
        "eval-hub-offline",
        EVAL,
        "a Hub task (`hellaswag`) offline, not cached",
        lambda fx: _eval(fx, "hellaswag"),
        [
            "task 'hellaswag' reads the Hub dataset Rowan/hellaswag, split validation: it is not in the datasets cache "
            "and the Hub (https://huggingface.co) cannot be reached",
            "run `hf3d fetch-tasks hellaswag`",
        ],
        how="main",
    ),
    _c(
        "eval-set-not-mesh",
        EVAL,
        "`hf3d eval --set run.steps=4` (only the mesh is set there)",
        lambda fx: _eval(fx, "shakespeare-word", "--set", "run.steps=4"),
        ["--set expects parallel.KEY=VALUE", "got 'run.steps=4'", "--limit"],
        how="main",
    ),
    _c(
        "eval-train-unknown-task",
        EVAL,
        "`evals.tasks` naming an unknown task in `hf3d train`",
        lambda fx: _set("evals.tasks=[arc]"),
        ["evals.tasks: unknown task 'arc'", "arc_easy"],
    ),
    _c(
        "eval-window",
        EVAL,
        "a choice longer than the window the model reads (`--max-length 8`; real subprocess)",
        lambda fx: (_eval(fx, fx["task_long_choice"], "--max-length", "8"), fx["tmp"] + "/eval-out"),
        [
            "rank 0 (pp=0, dp=0, cp=0, tp=0) failed",
            "task 'long_choice' row 2: choice 1 is",
            "more than the window of 8",
        ],
        how="subprocess",
    ),
    _c(
        "eval-prompt-style",
        EVAL,
        "`hf3d eval --prompt-style lm-eval` (an unknown prompt style)",
        lambda fx: _eval(fx, "shakespeare-word", "--prompt-style", "lm-eval"),
        ["the evaluation's prompt_style must be lighteval or harness, got 'lm-eval'"],
        how="main",
    ),
    _c(
        "eval-train-tokenization",
        EVAL,
        "`evals.tokenization: joined` in `hf3d train` (an unknown rule)",
        lambda fx: _set("evals.tasks=[shakespeare-word]", "evals.tokenization=joined"),
        ["evals.tokenization must be pairwise or joint, got 'joined'"],
    ),
    _c(
        "eval-lettered-generative",
        EVAL,
        "`--tasks gsm8k:mc` (the lettered formulation of a generative task)",
        lambda fx: _eval(fx, "gsm8k:mc"),
        ["task 'gsm8k:mc': gsm8k is generative, it has no lettered formulation", "name it 'gsm8k'"],
        how="main",
    ),
    _c(
        "eval-lettered-too-many-choices",
        EVAL,
        "a task of 27 choices a row scored lettered (`FILE:mc`)",
        lambda fx: _eval(fx, fx["task_many_choices"] + ":mc"),
        ["task 'many_choices' row 2: 27 choices, the lettered formulation has letters for 26", "without ':mc'"],
        how="main",
    ),
    _c(
        "eval-fused-choice-joint",
        EVAL,
        'a choice that fuses with the context\'s last word ("I saw ge" + "ntleman") under `--tokenization joint`; '
        "real subprocess",
        lambda fx: (_eval(fx, fx["task_fused"], "--tokenization", "joint"), fx["tmp"] + "/eval-out"),
        [
            "rank 0 (pp=0, dp=0, cp=0, tp=0) failed",
            "task 'fused' row 2: choice 1 ('ntleman') has no token of its own",
            "tokenization pairwise",
        ],
        how="subprocess",
    ),
    # --- generation (hf3d generate, ParallelModel.generate) ------------------------------------------------
    _c(
        "generate-output-a-folder",
        GEN,
        "`--output` onto a folder",
        lambda fx: ["generate", fx["smollm"], "--prompt", "a", "--output", fx["tmp"]],
        ["hf3d generate: error: --output <tmp> is a folder or not a regular file: give the path of a file"],
        how="main",
    ),
    _c(
        "generate-output-under-a-file",
        GEN,
        "`--output` under a file",
        lambda fx: ["generate", fx["smollm"], "--prompt", "a", "--output", f"{fx['a_file']}/out.jsonl"],
        ["--output <tmp>/a-file/out.jsonl lies under <tmp>/a-file, which is a file: choose another path"],
        how="main",
    ),
    _c(
        "generate-empty-prompt",
        GEN,
        '`hf3d generate --prompt ""`',
        lambda fx: ["generate", fx["smollm"], "--prompt", ""],
        ["hf3d generate: error: --prompt is empty"],
        how="main",
    ),
    _c(
        "generate-empty-prompt-in-file",
        GEN,
        "an empty prompt in `--prompts FILE`",
        lambda fx: ["generate", fx["smollm"], "--prompts", fx["prompts_empty"]],
        ["prompts_empty.jsonl line 2: the prompt is empty"],
        how="main",
    ),
    _c(
        "generate-prompts-line-too-long",
        GEN,
        "a line of 17 MiB in `--prompts FILE`",
        lambda fx: ["generate", fx["smollm"], "--prompts", fx["task_long_line"]],
        ["long_line.jsonl line 2 is longer than 16 MiB, the most hf3d reads as one row or prompt: shorten it"],
        how="main",
    ),
    _c(
        "generate-both-prompts",
        GEN,
        "`--prompt` and `--prompts` together",
        lambda fx: ["generate", fx["smollm"], "--prompt", "a", "--prompts", fx["prompts_empty"]],
        ["give exactly one of --prompt TEXT and --prompts FILE"],
        how="main",
    ),
    _c(
        "generate-run-folder",
        GEN,
        "a training run's output folder as the model (not one of its checkpoints)",
        lambda fx: ["generate", fx["a_run"], "--prompt", "a"],
        ["model <tmp>/a-run is a training run's folder", "<tmp>/a-run/checkpoints/step_<N>", "<tmp>/a-run/final"],
        how="main",
    ),
    _c(
        "generate-missing-model",
        GEN,
        "a model path that does not exist",
        lambda fx: ["generate", fx["tmp"] + "/nowhere/checkpoints/step_9", "--prompt", "a"],
        ["model <tmp>/nowhere/checkpoints/step_9 does not exist", "give an hf3d checkpoint (a step_<N> folder)"],
        how="main",
    ),
    _c(
        "generate-empty-folder",
        GEN,
        "an empty folder as the model",
        lambda fx: ["generate", fx["no_model"], "--prompt", "a"],
        ["model <tmp>/models/empty holds no model (no config.json)"],
        how="main",
    ),
    _c(
        "generate-config-only",
        GEN,
        "a folder of a config.json alone (no weights: a model to train from scratch)",
        lambda fx: ["generate", fx["config_only"], "--prompt", "a"],
        ["model <tmp>/models/config-only holds a config.json but no weights"],
        how="main",
    ),
    _c(
        "generate-unfinished-checkpoint",
        GEN,
        "a checkpoint whose save was interrupted (no marker)",
        lambda fx: ["generate", fx["partial_step"], "--prompt", "a"],
        ["<tmp>/ckpt/partial/checkpoints/step_3 is a checkpoint whose save did not finish", "use another step_<N>"],
        how="main",
    ),
    _c(
        "generate-no-tokenizer",
        GEN,
        "a model folder with weights and no tokenizer",
        lambda fx: ["generate", fx["llama"], "--prompt", "a"],
        ["model <tmp>/models/llama has no tokenizer", "copy the tokenizer files"],
        how="main",
    ),
    _c(
        "generate-model-is-a-file",
        GEN,
        "a file as the model",
        lambda fx: ["generate", fx["blocker"], "--prompt", "a"],
        ["model <tmp>/ckpt/a-file is a file"],
        how="main",
    ),
    _c(
        "generate-unknown-option",
        GEN,
        "`hf3d generate --num-beams 4` (an option it does not have; real subprocess)",
        lambda fx: (["generate", fx["smollm"], "--prompt", "a", "--num-beams", "4"], None),
        ["hf3d: error: unrecognized arguments: --num-beams 4"],
        how="subprocess",
    ),
    _c(
        "generate-past-the-window",
        GEN,
        "`--max-new-tokens` past the model's window (real subprocess)",
        lambda fx: (["generate", fx["smollm"], "--prompt", "ROMEO:", "--max-new-tokens", "600"], None),
        ["hf3d generate: rank 0", "600 new tokens after a prompt of", "window of 512 tokens", "at most 507"],
        how="subprocess",
    ),
    _c(
        "generate-long-prompt",
        GEN,
        "`ParallelModel.generate` on a prompt longer than the model's window",
        lambda ctx: ctx["pm"].generate(torch.ones(1, 130, dtype=torch.long), max_new_tokens=4),
        ["a prompt of 130 tokens leaves no room in the model's window of 128 tokens", "shorten the prompt"],
        how="dist",
    ),
    _c(
        "generate-empty-row",
        GEN,
        "`ParallelModel.generate` on a row whose attention mask is all zeros",
        lambda ctx: ctx["pm"].generate(torch.ones(2, 4, dtype=torch.long), torch.tensor([[1] * 4, [0] * 4])),
        ["prompt 1 is empty: every prompt needs at least one token"],
        how="dist",
    ),
    _c(
        "generate-unknown-keyword",
        GEN,
        "`ParallelModel.generate(num_beams=4)`",
        lambda ctx: ctx["pm"].generate(torch.ones(1, 4, dtype=torch.long), num_beams=4),
        ["generate does not take num_beams", "it takes max_new_tokens"],
        how="dist",
    ),
    _c(
        "generate-sampling-without-seed",
        GEN,
        "`ParallelModel.generate(do_sample=True)` on 2 processes without a seed",
        lambda ctx: ctx["pm"].generate(torch.ones(1, 4, dtype=torch.long), do_sample=True, max_new_tokens=2),
        ["do_sample on several processes needs seed=", "every rank of a replica must draw the same tokens"],
        how="dist2",
    ),
]


# ------------------------------------------------------------------------------------------------
# Running the cases
# ------------------------------------------------------------------------------------------------
def placeholders(text: str, tmp: str) -> str:
    """Machine paths out of a message: the temporary folder -> <tmp>, the repository -> <repo>."""
    for path, name in ((os.path.realpath(tmp), "<tmp>"), (tmp, "<tmp>"), (str(ROOT), "<repo>")):
        text = text.replace(path, name)
    return text


def _attempt(case: Case, fn) -> tuple[str, str]:
    """(outcome, raw message) of a local or dist case."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fn()
    except Exception as e:  # the case's error: what the parent asserts on
        return type(e).__name__, str(e)
    if not case.error:
        return f"no error: {case.behaviour}", str(got)
    return "no error", repr(got)[:200]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hf3d") and ("error:" in line or "failed" in line)]


def _stderr_result(code: int, stderr: str) -> tuple[str, str, list[str]]:
    lines, problems = _error_lines(stderr), []
    if len(lines) != 1:
        problems.append(f"{len(lines)} error lines on stderr: {stderr[-1500:]!r}")
    if "Traceback" in stderr:
        problems.append(f"a traceback on stderr: {stderr[-1500:]!r}")
    if code == 0:
        problems.append("exit 0")
    return f"exit {code}", (lines[0] if lines else stderr.strip()[-300:]), problems


def _run_main(argv: list[str]) -> tuple[str, str, list[str]]:
    from hf3d.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return _stderr_result(code, err.getvalue())


def _snapshot(folder: str) -> dict[str, str]:
    """{relative path: sha256} of every file under folder ({} when it does not exist)."""
    root = Path(folder)
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _subprocess_env(fx: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC"))}
    env.pop("HF_TOKEN", None)
    env.pop("HUGGING_FACE_HUB_TOKEN", None)
    # no network, and a Hub home of its own: no token file, so `hf3d push` has no token
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=fx["hf_home"], TOKENIZERS_PARALLELISM="false")
    return env


def run_all(tmp: Path) -> dict[str, Result]:
    """Every case of CASES -> its Result (the order: subprocesses start first and run alongside)."""
    tmp = Path(os.path.realpath(tmp))
    fx = make_inputs(tmp)
    results: dict[str, Result] = {}
    procs = {}

    def start(case: Case) -> None:
        argv, out_dir = case.trigger(fx)
        before = _snapshot(out_dir) if out_dir else {}
        cmd = [sys.executable, "-m", "hf3d", *argv]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_subprocess_env(fx), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs[case.id] = (proc, out_dir, before)

    late = {"cli-resume-bad-data", "cli-resume-damaged"}  # need the checkpoints the spawned process writes
    for case in CASES:
        if case.how == "subprocess" and case.id not in late:
            start(case)

    spawn(_dist_world, 1, fx, str(tmp / "dist.pt"))
    (dist_res,) = torch.load(tmp / "dist.pt", weights_only=False)
    spawn(_two_rank_world, 2, fx, str(tmp / "dist2.pt"))
    dist_res.update(torch.load(tmp / "dist2.pt", weights_only=False)[0])
    for case in CASES:
        if case.how == "subprocess" and case.id in late:
            start(case)

    with _env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"):
        for case in CASES:
            if case.how == "local":
                outcome, msg = _attempt(case, lambda c=case: c.trigger(fx))
                results[case.id] = Result(outcome, msg, [])
            elif case.how == "main":
                argv = case.trigger(fx)
                argv, out = argv if isinstance(argv, tuple) else (argv, None)
                outcome, msg, problems = _run_main(argv)
                results[case.id] = Result(outcome, msg, problems + (_leftovers(out) if out else []))
            elif case.how in ("dist", "dist2"):
                outcome, msg = dist_res[case.id]
                results[case.id] = Result(outcome, msg, [])

    for case_id, (proc, out_dir, before) in procs.items():
        _, stderr = proc.communicate(timeout=600)
        outcome, msg, problems = _stderr_result(proc.returncode, stderr)
        if out_dir and (Path(out_dir) / "final").exists():
            problems.append(f"{out_dir}/final exists: the failed run looks finished")
        if out_dir and _snapshot(out_dir) != before:
            problems.append(f"{out_dir} changed: {sorted(set(_snapshot(out_dir)) ^ set(before))}")
        results[case_id] = Result(outcome, msg, problems)
    kept = procs["cli-resume-bad-data"][2]  # what the failed resume had to leave as it was
    if not any(k.startswith("checkpoints/step_2/") for k in kept):
        results["cli-resume-bad-data"].problems.append(f"no checkpoint in the output dir to keep intact: {kept}")
    for r in results.values():
        r.message = placeholders(r.message, str(tmp))
    return results


def check(case: Case, result: Result) -> list[str]:
    """What is wrong with a case's result; [] when it keeps the contract."""
    msg, bad = result.message, list(result.problems)
    if case.error and (result.outcome.startswith("no error") or result.outcome == "exit 0"):
        bad.append(f"expected an error, got {result.outcome}: {msg}")
    if not case.error and not result.outcome.startswith("no error"):
        bad.append(f"not an error by design, got {result.outcome}: {msg}")
    bad += [f"{w!r} missing from: {msg}" for w in case.words if w not in msg]
    if "\n" in msg or len(msg) > MAX_MESSAGE:
        bad.append(f"not one short line ({len(msg)} characters): {msg!r}")
    return bad


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------
HEADER = """# Bad input and the message it gets

Every row is a bad input that `tests/test_bad_input.py` tries. The test checks that each gets ONE line
(under 400 characters) that contains the words the registry names for it (what is wrong, and where: the
key, the file, the row or the rank), an exception from the Python API or a non-zero exit from `hf3d`
with no traceback, no `final/` folder for a run that failed, and, for the resumed run, an output folder
left byte-identical. Rows whose outcome starts with "no error" are not errors by design (the document is
skipped and counted in the summary line the run prints, or the bytes replaced). The "known gap" notes
are messages that keep the contract only in part.

Regenerate with `python tests/test_bad_input.py` (under a minute on 2 CPU cores); `<tmp>` stands for the
test's temporary folder. `test_the_table_is_current` fails when these rows and the registry disagree.
"""
COLUMNS = ("id", "category", "bad input", "message", "outcome")


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "'") if text else ""


def render(results: dict[str, Result]) -> str:
    counts = {c: sum(1 for case in CASES if case.category == c) for c in CATEGORIES}
    lines = [HEADER, f"{len(CASES)} rows: " + ", ".join(f"{c} {n}" for c, n in counts.items()) + ".", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for case in CASES:
        r = results[case.id]
        outcome = r.outcome + (f"; known gap: {case.gap}" if case.gap else "")
        row = [case.id, case.category, case.bad.replace("`", ""), "`" + _cell(r.message) + "`", outcome]
        lines.append("| " + " | ".join(c if i == 3 else _cell(c) for i, c in enumerate(row)) + " |")
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> list[dict[str, str]]:
    """The table's rows as {column: text}, escapes undone."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| id |", "| --- |")):
            continue
        body, cells, cell, i = line[2:-2], [], "", 0
        while i < len(body):
            if body[i] == "\\" and i + 1 < len(body):
                cell, i = cell + body[i + 1], i + 2
            elif body.startswith(" | ", i):
                cells.append(cell)
                cell, i = "", i + 3
            else:
                cell, i = cell + body[i], i + 1
        rows.append(dict(zip(COLUMNS, [*cells, cell])))
    return rows


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
def test_registry_is_well_formed():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= 40
    assert {c.category for c in CASES} == set(CATEGORIES)
    assert all(c.words and c.how in ("local", "main", "subprocess", "dist", "dist2") for c in CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Result]:
    return run_all(tmp_path_factory.mktemp("bad-input"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(results, case):
    problems = check(case, results[case.id])
    assert not problems, f"{case.id}: " + "; ".join(problems)


def test_the_table_is_current():
    """docs/bad-input.md lists the registry's cases, in order, with messages that hold each case's words."""
    rows = parse_table(DOC.read_text())
    assert [r["id"] for r in rows] == [c.id for c in CASES], "the table's ids differ: python tests/test_bad_input.py"
    for row, case in zip(rows, CASES):
        assert row["category"] == case.category and row["bad input"] == case.bad.replace("`", ""), case.id
        message = row["message"].strip("`")
        assert all(w.replace("`", "'") in message for w in case.words), (case.id, message)
        assert row["outcome"].startswith("no error") != case.error, (case.id, row["outcome"])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        got = run_all(Path(tmp))
    failed = {c.id: check(c, got[c.id]) for c in CASES if check(c, got[c.id])}
    for case_id, problems in failed.items():
        print(f"{case_id}: {'; '.join(problems)}", file=sys.stderr)
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render(got))
    print(f"wrote {DOC} ({len(CASES)} rows, {len(failed)} failing)")
    sys.exit(1 if failed else 0)
