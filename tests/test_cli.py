"""The `hf3d` command end to end: a short run of the embedded default, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["run.steps=4", "run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=2", "run.log_every=2"]


def _run(args: list[str], tmp_path: Path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable]) + ["-m", "hf3d", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_train_tp2_writes_metrics_and_a_stock_loadable_model(tmp_path):
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = _run(
        ["train", "examples/configs/tiny-smollm.yaml", "--set", *SHORT, f"run.output_dir={out}"],
        tmp_path,
        launcher=torchrun,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_time_s", "peak_mem_bytes"):
        assert all(key in r for r in records), key
    assert records[-1]["tokens"] == 4 * 4 * 32
    assert records[-1]["loss"] < records[0]["loss"]
    memory = json.loads((out / "memory.json").read_text())
    # fp32 params are their own master weights; AdamW keeps two fp32 moments per element (dp=1)
    assert len(memory) == 2
    assert all(m["master_weights"] == 0 and m["optimizer_state"] == 2 * m["params"] for m in memory)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()
    assert (out / "final" / "tokenizer.json").is_file()


def test_import_and_the_command_line_load_torch_only_when_needed():
    """`import hf3d` imports neither torch nor transformers; the public names and the submodules load on first
    use; `hf3d --help`, `hf3d convert --help` and `hf3d average --help` answer without torch."""
    probe = (
        "import sys, hf3d\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "import hf3d.parallelize\n"  # the submodule does not hide the function of the same name
        "assert callable(hf3d.parallelize) and hf3d.parallelize.__module__ == 'hf3d.parallelize'\n"
        "assert hf3d.ParallelConfig(tp=2).tp == 2 and callable(hf3d.parallel.mesh.init_distributed)\n"
        "assert set(hf3d.__all__) <= set(dir(hf3d)) and all(getattr(hf3d, n) for n in hf3d.__all__)\n"
        "try:\n    hf3d.nope\nexcept AttributeError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "module 'hf3d' has no attribute 'nope'"
    for args in (["--help"], ["convert", "to-hf", "--help"], ["average", "--help"]):
        code = f"import sys; from hf3d.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        code += "assert 'torch' not in sys.modules, 'torch imported'"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage: hf3d" in proc.stdout, proc.stderr[-2000:]


def test_bad_config_is_one_clear_error_and_nonzero_exit(tmp_path):
    proc = _run(
        ["train", "examples/configs/tiny-smollm.yaml", "--set", "parallel.tp=2", f"run.output_dir={tmp_path / 'x'}"],
        tmp_path,
    )
    assert proc.returncode == 1
    assert proc.stderr.count("hf3d train: error:") == 1
    assert "world size 1 is not tp·pp·dp·cp = 2·1·?·1" in proc.stderr
    assert not (tmp_path / "x" / "final").exists()

    proc = _run(["train", "--set", "parallel.nope=1"], tmp_path)
    assert proc.returncode == 1 and "unknown key 'nope' in parallel; known keys: tp, pp" in proc.stderr

    proc = _run(["train", "missing.yaml"], tmp_path)
    assert proc.returncode == 1 and "config file 'missing.yaml' does not exist" in proc.stderr


def test_every_value_the_docs_show_parses():
    """Each `key: a | b | c` of the section table (docs/train.md), and every `--set` of the commands of README.md and
    the user guide in docs/ (all but its list of bad input, and the values that list shows refused), parses as
    written (YAML reads a bare off as false: `precision.fp8: off` is "off")."""
    import re

    from hf3d.train.config import TrainConfig

    guide = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "bad-input.md")]
    readme = "\n".join(p.read_text() for p in guide)  # bad-input.md lists wrong values on purpose
    assert "| `optim` |" in (ROOT / "docs" / "train.md").read_text()  # the section table is where the docs say
    stand_in = {"every_<k>": "every_2", "PATH": "some/checkpoints/step_20"}
    wsd = ["optim.schedule=wsd", "optim.decay_steps=0.1"]  # what a wsd key needs beside it
    tried = 0
    for row in readme.splitlines():
        head = re.match(r"\| `(\w+)` \|", row)
        for key, values in re.findall(r"`(\w+): ([^`]+)`", row) if head else ():
            for value in values.split(" \\| "):
                value = stand_in.get(value, value)
                context = wsd if key == "decay_shape" or value == "wsd" else []
                cfg = TrainConfig.from_yaml(None, [*context, f"{head.group(1)}.{key}={value}", "model.path=x"])
                got = getattr(getattr(cfg, head.group(1)), key)
                assert str(got).lower() == value.lower(), (key, value, got)
                tried += 1
    assert tried >= 20, tried
    wrong = set(re.findall(r"--set (\S+)", (ROOT / "docs" / "bad-input.md").read_text()))  # shown refused on purpose
    for line in re.findall(r"--set ([^\n`]+)", readme):
        sets = [s for s in line.split() if re.fullmatch(r"\w+(\.\w+)+=[^$]+", s)]
        if wrong & set(sets):
            continue
        TrainConfig.from_yaml(str(ROOT / "examples/configs/tiny-smollm.yaml"), sets)


def test_a_refusal_under_torchrun_ends_the_screen_with_hf3ds_line(tmp_path):
    """torchrun ends a failed job with its summary of the workers' failures: the root cause there carries hf3d's one
    line (written to torchelastic's error file), not a pointer to torch's docs, and no hf3d traceback is shown."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hf3d", "train"]
    cmd += [str(ROOT / "examples/configs/tiny-smollm.yaml"), "--set", "run.stepz=3", f"run.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not set(line.strip()) <= set("=-")]
    assert lines[-1].strip().startswith("traceback : hf3d train: error: unknown key 'stepz' in run;"), lines[-8:]
    assert "hf3d/" not in proc.stderr.split("ChildFailedError")[0].split("hf3d train: error")[0]  # no hf3d frames


def test_a_run_without_fp8_prints_nothing_of_torchao():
    """transformers imports torchao (when installed) with its model code; the CUDA-kernel and deprecation records
    that come with it are not printed where they say nothing (hf3d/utils/noise.py)."""
    code = "import hf3d, hf3d.parallelize, transformers.modeling_utils, hf3d.parallel.fp8"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]


def test_the_tokenizers_hf3d_loads_say_nothing_of_a_text_longer_than_the_model(tmp_path, caplog):
    """transformers warns once a tokenizer that a text is longer than model_max_length ("... will result in indexing
    errors"): under hf3d's commands the line comes after hf3d's own refusal, or is wrong (a document is cut into
    windows). Every tokenizer hf3d's commands load comes from utils.tokens.load_tokenizer, which has it said already;
    only the export's sample loads one as stock does."""
    import logging
    import re
    import shutil

    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from hf3d.utils.tokens import load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(ROOT / "examples" / "models" / "tiny-smollm", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 8}))
    text = "ROMEO: " + "but soft, what light through yonder window breaks " * 4
    said = {}
    transformers_logging.enable_propagation()  # its records reach caplog (they go to its own handler otherwise)
    try:
        for name, load in (("stock", AutoTokenizer.from_pretrained), ("hf3d", load_tokenizer)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="transformers"):
                assert len(load(str(folder))(text)["input_ids"]) > 8
            said[name] = [r.getMessage()[:40] for r in caplog.records if "Token indices sequence" in r.getMessage()]
    finally:
        transformers_logging.disable_propagation()
    assert said == {"stock": ["Token indices sequence length is longer "], "hf3d": []}
    loads = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "hf3d").rglob("*.py")
        if re.search(r"AutoTokenizer\.from_pretrained\(", path.read_text())
    }
    assert loads == {"hf3d/utils/tokens.py", "hf3d/train/finish.py"}, loads


def test_a_hub_model_on_the_wrong_world_size_is_refused_before_any_hub_lookup(tmp_path):
    """The long-context recipe names a Hub model and 8 processes: on 1 process the world size is refused at once,
    offline, before transformers looks the model up (it would retry the Hub first)."""
    cmd = [sys.executable, "-m", "hf3d", "train", str(ROOT / "examples/configs/smollm3-long-context.yaml")]
    cmd += ["--set", f"run.output_dir={tmp_path / 'out'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("hf3d train: error: world size 1 is not tp·pp·dp·cp")
    assert not (tmp_path / "hf-home").exists() and not (tmp_path / "out").exists()


def _parsers(parser, path: tuple[str, ...]):
    """(command path, parser) for `parser` and each of its subcommands, recursively."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_subcommand_and_option_has_help_text():
    """`hf3d X --help` explains each option: the test walks every subcommand's parser (train, eval, generate,
    convert to-hf / from-hf, push, and any added later) and fails on an option or a positional without help
    text, or a subcommand whose --help opens with no description."""
    import argparse

    from hf3d.cli import build_parser

    parsers = dict(_parsers(build_parser(), ("hf3d",)))
    assert {("hf3d", c) for c in ("train", "eval", "generate", "convert", "push")} <= set(parsers)
    assert {("hf3d", "convert", "to-hf"), ("hf3d", "convert", "from-hf")} <= set(parsers)
    bare = [
        f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
        for path, p in parsers.items()
        for a in p._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not (a.help or "").strip()
    ]  # a subcommand's own help is its description, below
    assert not bare, f"no help text: {bare}"
    undescribed = [" ".join(path) for path, p in parsers.items() if len(path) > 1 and not (p.description or "").strip()]
    assert not undescribed, f"--help opens with no description: {undescribed}"


def test_every_set_flag_counts():
    """`--set a=1 --set b=2` keeps both values (argparse's default would keep only the last flag's)."""
    from hf3d.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "c.yaml", "--set", "run.steps=3", "--set", "parallel.tp=2", "data.seq_len=64"])
    assert args.set == ["run.steps=3", "parallel.tp=2", "data.seq_len=64"]
    required = {"eval": ["--tasks", "t", "--output-dir", "o"], "generate": []}
    for sub, extra in required.items():
        args = parser.parse_args([sub, "m", *extra, "--set", "parallel.tp=2", "--set", "parallel.pp=2"])
        assert args.set == ["parallel.tp=2", "parallel.pp=2"], sub


def test_every_reader_of_the_parallel_keys_names_them_as_a_file_writes_them():
    """ParallelConfig's own checks name `ParallelConfig.key` (for Python callers); each place that reads the keys
    from a file or a command line (hf3d train's YAML and --set, hf3d plan --mesh, hf3d eval / generate --set)
    names `parallel.key` instead, by one rule in build_section, whatever check refused the value."""
    import pytest

    from hf3d.evaluation.command import parallel_config
    from hf3d.plan.command import _mesh_option
    from hf3d.train.config import TrainConfig

    readers = {
        "hf3d train --set": lambda k, v: TrainConfig.from_yaml(None, [f"parallel.{k}={v}"]),
        "hf3d plan --mesh": lambda k, v: _mesh_option(f"{k}={v}"),
        "hf3d eval --set": lambda k, v: parallel_config([f"parallel.{k}={v}"]),
    }
    bad = {"tp": "0", "dp": "-1", "dp_shard": "0", "pp_schedule": "gpipe", "compile": "maybe"}
    bad |= {"recompute": "some", "activation_offload": "maybe"}
    for reader, read in readers.items():
        for key, value in bad.items():
            with pytest.raises(ValueError) as e:
                read(key, value)
            assert f"parallel.{key}" in str(e.value) and "ParallelConfig" not in str(e.value), (reader, str(e.value))
    with pytest.raises(ValueError, match=r"unknown ParallelConfig\.pp_schedule 'gpipe'"):
        __import__("hf3d").ParallelConfig(pp_schedule="gpipe")  # the Python caller's name for it
