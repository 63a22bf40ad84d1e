"""`hf3d push` end to end against an in-memory Hub-compatible server (tests/hub_server.py).

The round trip runs the real command in a subprocess (HF_ENDPOINT is read when huggingface_hub
is imported), downloads the repo back with stock snapshot_download and compares every tensor.
The other cases call the same command in this process (a subprocess costs seconds of imports),
with huggingface_hub's endpoint, Xet switch and token file patched to what HF_ENDPOINT,
HF_HUB_DISABLE_XET=1 and an empty HF_HOME would have set.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants as hub_constants
import pytest
import torch
import yaml
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hub_server import FakeHub  # noqa: E402
from models import make_model_dir  # noqa: E402

from hf3d import cli  # noqa: E402
from hf3d.checkpoint.marker import MARKER  # noqa: E402
from hf3d.hf.hub import HubError, push_to_hub, write_model_card  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_test9f3Kq2ZtW7mXcR4vBn8LpYs"
SUMMARY = {
    "base_model": "HuggingFaceTB/SmolLM2-135M",
    "datasets": ["HuggingFaceFW/fineweb-edu", "data/shakespeare.txt"],
    "license": "mit",
    "hyperparameters": {"lr": 3e-4, "global_batch": 8, "seq_len": 64, "steps": 40},
    "parallel": {"tp": 2, "pp": 2, "dp": 1, "schedule": "1f1b"},
    "tokens_seen": 20480,
    "final_loss": 3.21875,
    "loss_curve": [[step, 6.0 - 0.07 * step] for step in range(1, 41)],
}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = make_model_dir(tmp_path / "tiny-llama", "llama")
    (path / "hf3d_training.json").write_text(json.dumps(SUMMARY))
    return path


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """In-process equivalent of HF_ENDPOINT=<url> HF_HUB_DISABLE_XET=1 HF_TOKEN=TOKEN; returns set_endpoint."""
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return lambda url: monkeypatch.setattr(hub_constants, "ENDPOINT", url)


def _push(model_dir: Path, *args: str) -> int:
    return cli.main(["push", str(model_dir), "user/tiny", "--retries", "2", "--retry-wait", "0.01", *args])


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    cmd = [sys.executable, "-m", "hf3d", "push", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=120)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("hf3d push: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def _assert_no_token(*texts: str, dirs: tuple[Path, ...] = ()) -> None:
    for text in texts:
        assert TOKEN not in text
    for d in dirs:
        for f in d.rglob("*"):
            assert not f.is_file() or TOKEN.encode() not in f.read_bytes(), f


def test_push_round_trip_with_card(model_dir, tmp_path):
    with FakeHub(TOKEN) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf")}
        proc = _run_cli([str(model_dir), "user/tiny", "--private", "--commit-message", "first push"], env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"{hub.url}/user/tiny/commit/" in proc.stdout
        assert hub.repos["user/tiny"]["private"] is True
        assert hub.files("user/tiny")["model.safetensors"].lfs  # weights went through LFS
        assert hub.calls("POST", "/api/validate-yaml") == 1  # the card's metadata was accepted
        out = Path(snapshot_download("user/tiny", endpoint=hub.url, token=TOKEN, local_dir=tmp_path / "download"))

    expected = {".gitattributes", "README.md", "config.json", "generation_config.json", "model.safetensors"}
    assert {f.name for f in out.iterdir() if f.is_file()} == expected | {"hf3d_training.json"}
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    pulled = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert original.keys() == pulled.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, pulled[name]), name

    card = (out / "README.md").read_text()
    assert card == (model_dir / "README.md").read_text()  # written into the model dir, then uploaded
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "transformers"
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert meta["datasets"] == ["HuggingFaceFW/fineweb-edu"]  # the local file stays out of the metadata
    assert meta["license"] == "mit"
    assert "hf3d" in meta["tags"]
    assert "`shakespeare.txt`" in body and "data/" not in body  # a local path: its name only
    assert "| lr | 0.0003 |" in body and "| seq_len | 64 |" in body
    assert "tp=2 × pp=2 × dp=1 (4 processes)" in body and "| 2 | 2 | 1 | 1f1b |" in body
    assert "Tokens seen: 20,480" in body and "Final training loss: 3.2188" in body
    assert "| 1 | 5.9300 |" in body and "| 40 | 3.2000 |" in body  # first and last point of the curve
    assert 'from_pretrained("user/tiny")' in body
    assert json.loads((out / "hf3d_training.json").read_text()) == SUMMARY
    _assert_no_token(proc.stdout, proc.stderr, card, dirs=(out, model_dir))


def test_push_without_token_says_how_to_log_in(model_dir, hub_env, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")  # and no token file: hub_env points HF_TOKEN_PATH at a missing file
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf3d push: error: no Hugging Face token found")
    assert "export HF_TOKEN=" in err and "hf auth login" in err
    assert hub.requests == []  # no repo created, nothing asked
    assert not (model_dir / "README.md").exists()


def test_server_down_is_one_clear_error(model_dir, hub_env, capsys, caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub_env(f"http://127.0.0.1:{port}")
    assert _push(model_dir) == 1
    err = capsys.readouterr().err
    line = _error_line(err)
    assert "could not reach the Hub while creating the repo user/tiny" in line
    assert f"at http://127.0.0.1:{port} (after 3 attempts" in line and "check the network" in line
    retries = [r.getMessage() for r in caplog.records if r.name == "hf3d.hf.hub"]
    assert [m.split("; ")[-1] for m in retries] == ["retry 1 of 2 in 0.01 s", "retry 2 of 2 in 0.02 s"]
    _assert_no_token(err, caplog.text)


@pytest.mark.parametrize("existing", [False, True], ids=["new-repo", "existing-repo"])
def test_no_write_access_is_refused_without_a_commit(model_dir, hub_env, capsys, existing):
    with FakeHub(TOKEN, read_only=("user/tiny",)) as hub:
        if existing:  # someone else's repo: creating answers 403, then the upload itself answers 403
            hub.repos["user/tiny"] = {"private": False, "branches": {}, "commits": {}}
            hub._new_commit("user/tiny", "main", {})
        hub_env(hub.url)
        assert _push(model_dir) == 1
        assert hub.calls("POST", r"/api/models/user/tiny/commit/.*") == 0
        if existing:
            assert hub.files("user/tiny") == {}
        else:
            assert "user/tiny" not in hub.repos
    line = _error_line(capsys.readouterr().err)
    assert "no write access (403)" in line and "user/tiny" in line and "write permission for 'user'" in line
    assert ("uploading to" if existing else "creating the repo") in line


def test_wrong_token_is_refused(model_dir, hub_env, capsys):
    with FakeHub("hf_another_token") as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 1
    line = _error_line(capsys.readouterr().err)
    assert "refused the token (401)" in line and "hf auth login" in line
    _assert_no_token(line)


def test_transient_503_is_retried(model_dir, hub_env, capsys):
    with FakeHub(TOKEN, fail_first=2) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 0, capsys.readouterr().err
        assert [status for _, _, status in hub.requests[:3]] == [503, 503, 200]
        assert hub.files("user/tiny")["model.safetensors"].data == (model_dir / "model.safetensors").read_bytes()
    assert "pushed" in capsys.readouterr().out


def test_files_the_hub_leaves_out_fail_the_push(model_dir, hub_env, capsys):
    with FakeHub(TOKEN, ignored=(".safetensors",)) as hub:  # as a .gitignore in the repo would
        hub_env(hub.url)
        assert _push(model_dir) == 1
    line = _error_line(capsys.readouterr().err)
    assert "incomplete" in line and "model.safetensors" in line


def test_push_to_a_branch(model_dir, hub_env, capsys):
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir, "--revision", "step-40") == 0, capsys.readouterr().err
        assert "config.json" in hub.files("user/tiny", "step-40")
        assert set(hub.files("user/tiny", "main")) == {".gitattributes"}


def test_a_failed_commit_leaves_no_branch_it_made(model_dir, hub_env, capsys):
    """Commits answered 503: the branch the push made is deleted (no `step_N` holding only .gitattributes); a
    branch that was there before stays. Mutation: not deleting leaves step-41 behind."""
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir, "--revision", "step-40") == 0, capsys.readouterr().err
        hub.fail_commits = True
        assert _push(model_dir, "--revision", "step-41") == 1
        assert _push(model_dir, "--revision", "step-40") == 1
        assert set(hub.repos["user/tiny"]["branches"]) == {"main", "step-40"}
    assert "the Hub answered 503 while uploading to user/tiny" in capsys.readouterr().err


def test_a_card_with_broken_metadata_is_refused(model_dir, hub_env, capsys):
    (model_dir / "README.md").write_text("---\ntags: [hf3d\n---\n# my model\n")  # the user's own card is kept
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 1
        assert hub.calls("POST", r"/api/models/user/tiny/commit/.*") == 0
    line = _error_line(capsys.readouterr().err)
    assert "the Hub refused README.md while uploading to user/tiny" in line and "Invalid metadata" in line


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_not_a_model_dir(model_dir, hub_env, capsys, missing):
    (model_dir / missing).unlink()
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 1
        assert hub.requests == []
    line = _error_line(capsys.readouterr().err)
    assert "is not an HF model directory" in line and missing.replace("model", "*") in line


def test_token_in_a_file_is_never_uploaded(model_dir, hub_env, capsys):
    (model_dir / "notes.txt").write_text(f"token={TOKEN}\n")
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 1
        assert hub.requests == []
    line = _error_line(capsys.readouterr().err)
    assert "notes.txt contains your Hub token" in line
    _assert_no_token(line)


@pytest.mark.parametrize("link", ["file", "folder"])
def test_links_leaving_the_folder_are_never_uploaded(model_dir, hub_env, capsys, tmp_path, link):
    """A crafted folder linking a local file (or folder) into the upload: refused before any request."""
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "id_rsa").write_text("PRIVATE KEY\n")
    if link == "file":
        (model_dir / "tokenizer.json").symlink_to(secret / "id_rsa")
    else:
        (model_dir / "extra").symlink_to(secret)
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 1
        assert hub.requests == []
    line = _error_line(capsys.readouterr().err)
    if link == "file":
        assert f"{model_dir}/tokenizer.json is a link to {secret}/id_rsa, outside {model_dir}" in line, line
    else:
        assert f"{model_dir}/extra is a link to a folder" in line, line


def test_minimal_card_and_summary_checks(tmp_path):
    card = write_model_card(make_model_dir(tmp_path / "m", "qwen3"), {}).read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta == {
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": ["hf3d", "text-generation"],
    }
    assert "Qwen3ForCausalLM (2 layers, hidden size 48)" in body and "No training summary" in body
    with pytest.raises(ValueError, match=r"\[step, loss\] pairs"):
        write_model_card(tmp_path / "m", {"loss_curve": [1.0, 2.0]})
    with pytest.raises(ValueError, match="'tokens_seen'"):
        write_model_card(tmp_path / "m", {"tokens_seen": "many"})


def test_the_card_shows_the_runs_scores_and_the_hub_ids_a_local_run_names(tmp_path):
    """The run's last downstream evaluation is a table of the card; export.base_model and export.datasets name the
    Hub ids of a local start and local data in the card's metadata (a local path never reaches it)."""
    from hf3d.train.config import TrainConfig
    from hf3d.train.finish import training_summary

    sets = ["export.base_model=HuggingFaceTB/SmolLM2-135M", "export.datasets=[HuggingFaceFW/fineweb-edu]"]
    cfg = TrainConfig.from_yaml(str(ROOT / "examples" / "configs" / "tiny-smollm.yaml"), sets)
    metrics = tmp_path / "metrics.jsonl"
    record = {"step": 4, "loss": 3.5, "consumed_tokens": 512, "downstream/arc_easy/acc": 0.31}
    metrics.write_text(json.dumps(record) + "\n")
    summary = training_summary(cfg, metrics, record)
    assert summary["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert summary["datasets"] == ["shakespeare", "HuggingFaceFW/fineweb-edu"]
    card = write_model_card(make_model_dir(tmp_path / "m", "llama"), summary).read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["datasets"] == ["HuggingFaceFW/fineweb-edu"]
    assert (
        "### Downstream evaluation at step 4\n\n| task | metric | score |\n|---|---|---|\n| arc_easy | acc | 0.3100 |"
        in body
    )
    with pytest.raises(ValueError, match="export.datasets\\[0\\] 'my data' is not a Hub repo id"):
        TrainConfig.from_yaml(str(ROOT / "examples" / "configs" / "tiny-smollm.yaml"), ["export.datasets=[my data]"])


def test_train_pushes_its_final_model_with_the_run_card(tmp_path):
    """`export.push_to_hub` at the end of `hf3d train`: the card carries this run's figures, and the
    token shows up in no output of the run."""
    out = tmp_path / "run"
    with FakeHub(TOKEN) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf")}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
        sets = ["parallel.tp=1", "run.steps=3", "run.global_batch=2", "data.seq_len=32", "optim.warmup_steps=1"]
        sets += ["checkpoint.every=0", f"run.output_dir={out}", "export.push_to_hub=user/run"]
        cmd = [sys.executable, "-m", "hf3d", "train", "examples/configs/tiny-smollm.yaml", "--set", *sets]
        proc = subprocess.run(cmd, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        pushed = hub.files("user/run")
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "hf3d_training.json"} <= set(pushed)
    summary = json.loads((out / "final" / "hf3d_training.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["loss_curve"] == [[i + 1, loss] for i, loss in enumerate(losses)]
    assert summary["tokens_seen"] == 3 * 2 * 32 and summary["parallel"]["tp"] == 1
    card = (out / "final" / "README.md").read_text()
    assert f"Final training loss: {losses[-1]:.4f}" in card and "hf3d" in card
    _assert_no_token(proc.stdout, proc.stderr, dirs=(out,))


def test_card_shows_the_loss_curve_png_and_eval_loss_and_uploads_the_png(model_dir, hub_env, tmp_path, capsys):
    """A loss_curve.png (drawn by hf3d.train.plots from a metrics.jsonl with eval points) is linked at the
    top of the card's loss-curve section and lands in the same commit; final_eval_loss is shown with
    its perplexity; Hub datasets link to their pages."""
    pytest.importorskip("matplotlib")
    from hf3d.hf.hub import LOSS_CURVE_FILE
    from hf3d.train.plots import plot_loss_curve

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 6.0 - 0.07 * s, "tokens": 512 * s} for s in range(1, 41)]
    rows += [{"step": 20, "eval_loss": 4.9}, {"step": 40, "eval_loss": 3.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_loss_curve(metrics, model_dir / LOSS_CURVE_FILE, title="tiny")
    assert png == model_dir / "loss_curve.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (model_dir / "hf3d_training.json").write_text(json.dumps({**SUMMARY, "final_eval_loss": 3.0}))
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        assert _push(model_dir) == 0, capsys.readouterr().err
        pushed = hub.files("user/tiny")
        assert pushed["loss_curve.png"].data == png.read_bytes()
        assert hub.calls("POST", r"/api/models/user/tiny/commit/.*") == 1  # one commit with everything
    body = (model_dir / "README.md").read_text().split("---\n", 2)[2]
    section = body[body.index("### Loss curve") :].splitlines()
    assert section[:3] == ["### Loss curve", "", "![loss curve](loss_curve.png)"]
    assert "- Final eval loss: 3.0000 (perplexity 20.0855)" in body  # exp(3) = 20.0855
    assert "[HuggingFaceFW/fineweb-edu](https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu)" in body
    assert "`shakespeare.txt`" in body


def test_card_of_a_run_without_summary_curve_still_shows_the_png(tmp_path):
    path = make_model_dir(tmp_path / "m", "llama")
    (path / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    body = write_model_card(path, {"final_loss": 2.5}).read_text().split("---\n", 2)[2]
    assert body.rstrip().endswith("### Loss curve\n\n![loss curve](loss_curve.png)")
    assert "Final eval loss" not in body
    with pytest.raises(ValueError, match="'final_eval_loss'"):
        write_model_card(path, {"final_eval_loss": "low"})


def test_the_starting_point_of_a_run_is_recorded(tmp_path):
    """A Hub id is the base model; a local export or checkpoint is named (its folder only) and its own
    record, or config.json's _name_or_path, gives the Hub model it descends from; a config-only folder
    is a run from scratch."""
    from hf3d.train.finish import starting_point

    assert starting_point("HuggingFaceTB/SmolLM2-135M") == ("HuggingFaceTB/SmolLM2-135M", None)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "config.json").write_text("{}")
    assert starting_point(str(scratch)) == (None, None)
    export = tmp_path / "exported"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"")
    (export / "config.json").write_text(json.dumps({"_name_or_path": "org/from-config"}))
    assert starting_point(str(export)) == ("org/from-config", "exported")
    (export / "hf3d_training.json").write_text(json.dumps({"base_model": "org/base"}))
    assert starting_point(str(export)) == ("org/base", "exported")
    card = write_model_card(export, {"base_model": "org/base", "started_from": "exported"}).read_text()
    assert "- Continued from `exported` (local weights of [org/base](https://huggingface.co/org/base))" in card
    assert "base_model: org/base" in card


def _train_with_pushes(
    tmp_path: Path, hub: FakeHub, *sets: str, wait_for: int | None = None, popen: bool = False
) -> subprocess.CompletedProcess | subprocess.Popen:
    """`hf3d train` of 3 steps (unless `sets` say otherwise), a checkpoint each and keep_last=1, pushing to
    user/ckpts on `hub`; with `wait_for`, each conversion for the Hub held until step `wait_for` is published."""
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf")}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    run = ["parallel.tp=1", "run.steps=3", "run.global_batch=2", "data.seq_len=32", "optim.warmup_steps=1"]
    run += ["data.eval.every=0", "run.sample_prompt=null", f"run.output_dir={tmp_path / 'run'}"]
    run += ["checkpoint.every=1", "checkpoint.keep_last=1", "checkpoint.push_to_hub.repo=user/ckpts", *sets]
    start = ["-m", "hf3d"] if wait_for is None else ["-c", LATE_CONVERSIONS]
    cmd = [sys.executable, *start, "train", "examples/configs/tiny-smollm.yaml", "--set", *run]
    env = {**base, **env, "WAIT_FOR": str(wait_for)}
    if popen:
        env["PYTHONUNBUFFERED"] = "1"  # one stream, in the order written
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# `hf3d train` whose checkpoint conversions for the Hub start only once `latest` names step WAIT_FOR (or after
# 120 s): with WAIT_FOR=3, keep_last=1 rotation has run after steps 2 and 3 by then, so every earlier checkpoint
# survives only if it is pinned; with a step the run never reaches, every push is still waiting when it stops
LATE_CONVERSIONS = """
import os, sys, time
from pathlib import Path
import hf3d.checkpoint.convert as convert
from hf3d.cli import main
real, wanted = convert.checkpoint_to_hf, "step_" + os.environ["WAIT_FOR"]
def after_the_last_save(ckpt, export, *args, **kwargs):
    latest, t0 = Path(ckpt).parent / "latest", time.monotonic()
    while not (latest.is_file() and latest.read_text().strip() == wanted) and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    return real(ckpt, export, *args, **kwargs)
convert.checkpoint_to_hf = after_the_last_save
sys.exit(main())
"""


def test_train_pushes_its_checkpoints_each_to_its_branch(tmp_path):
    """`checkpoint.push_to_hub` (every: 2) with async saves (queued from their background publication; the
    docs' offline example runs the synchronous ones): the saves of steps 2 and 3 (the last) converted and
    pushed in the background to branches step_2 and step_3, private; not step 1's. keep_last=1 rotation
    leaves the pushes whole; the last one is the run's own final export, bit for bit."""
    with FakeHub(TOKEN) as hub:
        proc = _train_with_pushes(tmp_path, hub, "checkpoint.push_to_hub.every=2", "checkpoint.async=true")
        assert proc.returncode == 0, proc.stderr[-3000:]
        repo = hub.repos["user/ckpts"]
        branches = {b: hub.files("user/ckpts", b) for b in ("step_2", "step_3")}
    assert repo["private"] is True and set(repo["branches"]) == {"main", "step_2", "step_3"}
    out = tmp_path / "run"
    for step, pushed in branches.items():
        assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "hf3d_training.json"} <= set(
            pushed
        ), step
        assert f"hf3d: pushed checkpoint {step} to user/ckpts branch {step}" in proc.stderr
    final = (out / "final" / "model.safetensors").read_bytes()
    assert branches["step_3"]["model.safetensors"].data == final  # the step's weights, as the final export
    assert branches["step_2"]["model.safetensors"].data != final
    summary = json.loads(branches["step_2"]["hf3d_training.json"].data)
    assert [p[0] for p in summary["loss_curve"]] == [1, 2]  # the record of the run up to that step
    assert "hf3d: Hub pushes to user/ckpts: steps [2, 3] pushed" in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_3"]
    assert not (out / "hub_push").exists()  # converted folders removed once pushed
    _assert_no_token(proc.stdout, proc.stderr, dirs=(out,))


def test_rotation_in_a_run_keeps_the_checkpoints_waiting_for_their_push(tmp_path):
    """keep_last=1 and a push of every checkpoint, each conversion held until the last step is published: the
    run's rotation leaves steps 1 and 2 for their pushes (pinned), all three reach their branches whole, and
    once pushed the two are dropped, leaving keep_last's one."""
    with FakeHub(TOKEN) as hub:
        proc = _train_with_pushes(tmp_path, hub, wait_for=3)
        assert proc.returncode == 0, proc.stderr[-3000:]
        branches = {b: hub.files("user/ckpts", b) for b in ("step_1", "step_2", "step_3")}
    assert "hf3d: Hub pushes to user/ckpts: steps [1, 2, 3] pushed" in proc.stderr, proc.stderr[-3000:]
    weights = [pushed["model.safetensors"].data for pushed in branches.values()]
    assert len(set(weights)) == 3  # three steps' weights, each its own
    out = tmp_path / "run"
    assert weights[-1] == (out / "final" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_3"]


def test_a_stop_signal_leaves_the_waiting_pushes_said_and_their_checkpoints_kept(tmp_path):
    """SIGTERM while the pushes of steps 1 and 2 wait (their conversions held): the run saves the step it
    stopped at, says which pushes it abandons and how to push them, ends on the resume line with 143 without
    waiting for them, and every checkpoint it names is still on disk (keep_last=1 dropped none of them)."""
    with FakeHub(TOKEN) as hub:
        proc = _train_with_pushes(tmp_path, hub, "run.steps=1000", wait_for=1000, popen=True)
        ckpts, t0 = tmp_path / "run" / "checkpoints", time.monotonic()
        while not (ckpts / "step_2" / MARKER).is_file() and proc.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        screen, _ = proc.communicate(timeout=60)  # well inside the 120 s the conversions are held
        assert proc.returncode == 143, screen[-3000:]
        assert "user/ckpts" not in hub.repos or set(hub.repos["user/ckpts"]["branches"]) <= {"main"}
    lines = screen.splitlines()
    said = next(line for line in lines if "not waiting for the Hub pushes of steps" in line)
    left = [int(n) for n in said.split("steps [", 1)[1].split("]", 1)[0].split(", ")]
    assert left[:2] == [1, 2], said
    assert "a resume of this run pushes them, or push one with `hf3d convert to-hf` and `hf3d push" in said
    assert lines[-1].startswith("hf3d: stopped by SIGTERM after step ") and lines[-1].endswith("exit code 143")
    assert lines.index(said) < len(lines) - 1
    for n in left:
        assert (ckpts / f"step_{n}" / MARKER).is_file(), n  # each push the run leaves can still be made


def _pusher_run(tmp_path: Path, hub: FakeHub, hub_env, steps: list[int], *, damaged: int | None = None):
    """Checkpoints of steps `steps` (weights-only, from a tiny llama) pushed through CheckpointPusher in this
    process; returns (the lines it said, the metrics news, the seconds each submit took)."""
    from hf3d.checkpoint.convert import hf_to_checkpoint
    from hf3d.train.config import CheckpointPushConfig
    from hf3d.train.hub_push import CheckpointPusher

    hub_env(hub.url)
    src = make_model_dir(tmp_path / "m", "llama")
    ckpts = {n: hf_to_checkpoint(src, tmp_path / "run" / "checkpoints" / f"step_{n}") for n in steps}
    if damaged is not None:
        data = max(ckpts[damaged].glob("*.distcp"), key=lambda f: f.stat().st_size)
        data.write_bytes(data.read_bytes()[:-8])  # truncated after its marker was written
    lines: list[str] = []
    pusher = CheckpointPusher(CheckpointPushConfig(repo="user/ckpts"), tmp_path / "run", say=lines.append)
    took = []
    for n, ckpt in ckpts.items():
        t0 = time.perf_counter()
        pusher.submit(ckpt, n)
        took.append(time.perf_counter() - t0)
        assert ckpt in pusher.pinned()  # rotation keeps it until converted (a conversion takes 0.1 s or more)
    pusher.finish()
    return lines, pusher.take_news(), took


def test_checkpoint_pushes_refuse_a_damaged_checkpoint_and_never_hold_the_caller(tmp_path, hub_env):
    with FakeHub(TOKEN) as hub:
        lines, news, took = _pusher_run(tmp_path, hub, hub_env, [1, 2], damaged=1)
        branches = dict(hub.repos["user/ckpts"]["branches"])
        pushed = hub.files("user/ckpts", "step_2")
    assert "step_1" not in branches and "step_2" in branches  # the damaged one sent nothing
    assert max(took) < 0.05, took  # a lock and a queue put: measured 5e-5 s; a conversion and a push take seconds
    (warning,) = [line for line in lines if line.startswith("hf3d: warning:")]
    assert "the Hub push of checkpoint step_1 to user/ckpts (branch step_1) failed: checkpoint" in warning
    assert "is damaged" in warning and "training goes on" in warning and "\n" not in warning
    kept = "; training goes on, the checkpoint is kept for a later push"
    assert news == {"hub_push_error": warning.removeprefix("hf3d: warning: ").removesuffix(kept), "hub_pushed": 2}
    assert lines[-1] == (
        "hf3d: Hub pushes to user/ckpts: steps [2] pushed; failed: steps [1] (kept for the next resume to push; see "
        "the warnings above)"
    )
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).state_dict()
    from safetensors.torch import load

    got = load(pushed["model.safetensors"].data)
    assert all(torch.equal(got[k], v) for k, v in original.items() if k in got) and got.keys() <= original.keys()
    assert not (tmp_path / "run" / "hub_push").exists()


def test_a_refused_checkpoint_push_is_one_line(tmp_path, hub_env):
    from hf3d.hf.folders import EXPORT
    from hf3d.utils import files

    staging = tmp_path / "run" / "hub_push"
    files.make_dir(staging / "step_3", EXPORT)  # what a killed run left: removed at the start
    (staging / "mine").mkdir()  # a user's folder there: kept
    (staging / "mine" / "notes.txt").write_text("keep me")
    with FakeHub(TOKEN, read_only=("user/ckpts",)) as hub:
        lines, news, _ = _pusher_run(tmp_path, hub, hub_env, [4])
    (warning,) = [line for line in lines if line.startswith("hf3d: warning:")]
    assert "checkpoint step_4 to user/ckpts (branch step_4) failed: no write access (403)" in warning
    assert "hub_pushed" not in news and "no write access (403)" in news["hub_push_error"]
    assert [p.name for p in staging.iterdir()] == ["mine"]
    assert (staging / "mine" / "notes.txt").read_text() == "keep me"


def test_rotation_keeps_a_checkpoint_pinned_for_its_push(tmp_path):
    from hf3d.checkpoint.convert import hf_to_checkpoint
    from hf3d.checkpoint.rotation import finish_save

    src = make_model_dir(tmp_path / "m", "llama")
    root = tmp_path / "checkpoints"
    one, two = (hf_to_checkpoint(src, root / f"step_{n}") for n in (1, 2))
    finish_save(root, 1, two, pinned={one})
    assert one.is_dir()  # still being converted for the Hub
    finish_save(root, 1, two)
    assert not one.exists()


# -- a Hub that hangs or fails: the run is never held for good, and no checkpoint waiting for a push is lost ------
@contextlib.contextmanager
def _silent_hub():
    """A server that accepts connections (the kernel's backlog does) and never answers a byte."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}")


def _checkpoints(tmp_path: Path, steps: list[int]) -> dict[int, Path]:
    from hf3d.checkpoint.convert import hf_to_checkpoint

    src = make_model_dir(tmp_path / "m", "llama")
    return {n: hf_to_checkpoint(src, tmp_path / "run" / "checkpoints" / f"step_{n}") for n in steps}


def _pending(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "hub_pending.json").read_text())


def test_a_hanging_hub_ends_the_wait_at_the_timeout_and_keeps_the_checkpoints(tmp_path, hub_env):
    """Every request hangs: each gives up after request_timeout_s, a push retries for at most timeout_s, and the
    end of the run waits at most timeout_s, then names the pushes left; every checkpoint stays listed and pinned.
    Mutation: joining the worker without a timeout holds finish() for good (the 4 s bound fails)."""
    from hf3d.train.config import CheckpointPushConfig
    from hf3d.train.hub_push import CheckpointPusher

    ckpts = _checkpoints(tmp_path, [1, 2])
    lines: list[str] = []
    with _silent_hub() as hub:
        hub_env(hub.url)
        cfg = CheckpointPushConfig(repo="user/ckpts", timeout_s=1.5, request_timeout_s=0.3)
        pusher = CheckpointPusher(cfg, tmp_path / "run", say=lines.append, retry_wait_s=0.05)
        for n, ckpt in ckpts.items():
            pusher.submit(ckpt, n)
        t0 = time.monotonic()
        assert pusher.finish() == 0
        took = time.monotonic() - t0
    assert took < 1.5 + 2.5, took  # timeout_s and the last poll; measured 1.6 s
    with _silent_hub() as hub:  # one request gives up after request_timeout (huggingface_hub's default: never)
        hub_env(hub.url)
        failed: list[str] = []

        def push() -> None:
            try:
                push_to_hub(ckpts[1].parent.parent.parent / "m", "user/x", retries=1, retry_wait_s=0.01,
                            request_timeout=0.3)  # fmt: skip
            except HubError as e:
                failed.append(str(e))

        worker = threading.Thread(target=push, daemon=True)
        worker.start()
        worker.join(10)  # measured 0.7 s: two attempts of 0.3 s
        assert not worker.is_alive() and "could not reach the Hub while creating the repo" in failed[0], failed
    said = next(line for line in lines if "not waiting for the Hub pushes of steps" in line)
    assert "(after 1.5 s): their checkpoints" in said and str(tmp_path / "run" / "hub_pending.json") in said
    assert sorted(_pending(tmp_path)["steps"]) == ["1", "2"]
    assert pusher.pinned() == frozenset(ckpts.values()) and all(c.is_dir() for c in ckpts.values())


def test_a_failing_hub_keeps_every_checkpoint_records_every_failure_and_a_resume_pushes_them(tmp_path, hub_env):
    """503 on every request: the three pushes fail, each failure is a line of the next record's hub_push_error,
    keep_last=1 rotation keeps all three (pinned), hub_pending.json lists them with their errors; a new pusher on
    the same output_dir (a resume) against a Hub that answers pushes the three first, then forgets them.
    Mutations: unpinning once converted (rotation deletes steps 1-2), keeping only the newest failure."""
    from hf3d.checkpoint.rotation import finish_save
    from hf3d.train.config import CheckpointPushConfig
    from hf3d.train.hub_push import CheckpointPusher

    ckpts, out = _checkpoints(tmp_path, [1, 2, 3]), tmp_path / "run"
    cfg = CheckpointPushConfig(repo="user/ckpts")
    lines: list[str] = []
    with FakeHub(TOKEN, fail_first=10**9) as hub:
        hub_env(hub.url)
        pusher = CheckpointPusher(cfg, out, say=lines.append, retry_wait_s=0.01)
        for n, ckpt in ckpts.items():
            pusher.submit(ckpt, n)
        pusher.finish()
    news = pusher.take_news()
    errors = news["hub_push_error"].splitlines()
    assert [e.split(" to user/ckpts")[0] for e in errors] == [f"the Hub push of checkpoint step_{n}" for n in (1, 2, 3)]
    assert all("answered 503" in e for e in errors) and "hub_pushed" not in news
    finish_save(out / "checkpoints", 1, ckpts[3], pinned=pusher.pinned())
    assert all((c / MARKER).is_file() for c in ckpts.values())
    assert [v["error"] for v in _pending(tmp_path)["steps"].values()] == errors
    lines.clear()
    with FakeHub(TOKEN) as hub:
        hub_env(hub.url)
        again = CheckpointPusher(cfg, out, say=lines.append)
        assert again.pinned() == frozenset(ckpts.values())
        again.finish()
        assert set(hub.repos["user/ckpts"]["branches"]) == {"main", "step_1", "step_2", "step_3"}
    assert lines[0] == "hf3d: pushing to user/ckpts the checkpoints of steps [1, 2, 3] an earlier run left unpushed"
    assert lines[-1] == "hf3d: Hub pushes to user/ckpts: steps [1, 2, 3] pushed"
    assert not (out / "hub_pending.json").exists() and not again.pinned()


def test_checkpoints_waiting_for_a_push_are_kept_without_push_to_hub_until_dropped(tmp_path):
    """A resume without checkpoint.push_to_hub keeps what hub_pending.json lists (said once); drop_pending_pushes
    forgets them; a record that is not hf3d's is refused in one line."""
    from hf3d.train.hub_push import pending_checkpoints
    from hf3d.utils import files

    out = tmp_path / "run"
    out.mkdir()
    record = {"repo": "user/ckpts", "steps": {"4": {"checkpoint": "checkpoints/step_4", "error": "answered 503"}}}
    files.write_file(out / "hub_pending.json", json.dumps(record), replace=True)
    lines: list[str] = []
    assert pending_checkpoints(out, drop=False, say=lines.append) == {out / "checkpoints" / "step_4"}
    assert lines == [
        "hf3d: the checkpoints of steps [4] wait for a Hub push (hub_pending.json): kept; set checkpoint.push_to_hub "
        "to push them, or checkpoint.drop_pending_pushes=true to let keep_last drop them"
    ]
    assert pending_checkpoints(out, drop=True, say=lines.append) == frozenset()
    assert not (out / "hub_pending.json").exists() and "forgot the Hub pushes of steps [4]" in lines[-1]
    for bad in ('{"steps": [1]}', '{"steps": {"1": {"checkpoint": "../../elsewhere"}}}'):
        files.write_file(out / "hub_pending.json", bad, replace=True)
        with pytest.raises(ValueError, match=r"hub_pending.json (is not hf3d's record|names '\.\./\.\./elsewhere')"):
            pending_checkpoints(out, drop=False, say=lines.append)


def test_a_stop_signal_ends_the_wait_for_a_hanging_hub_at_once(tmp_path):
    """`hf3d train` whose Hub never answers, timeout_s=600: the end of the run waits; SIGTERM then ends it within
    seconds with 143, naming the pushes left, every checkpoint kept (keep_last=1) and listed for the resume."""
    with _silent_hub() as hub:
        proc = _train_with_pushes(tmp_path, hub, "run.steps=2", "checkpoint.push_to_hub.timeout_s=600", popen=True)
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "hf3d: waiting up to 600 s for" in line:
                break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    screen = "".join(seen) + rest
    assert proc.returncode == 143, screen[-3000:]
    assert took < 10, took  # measured 0.3 s: the wait polls the signal every 0.1 s
    said = next(line for line in screen.splitlines() if "not waiting for the Hub pushes of steps" in line)
    assert "(stopped by SIGTERM)" in said
    out = tmp_path / "run"
    assert sorted(_pending(tmp_path)["steps"]) == ["1", "2"]
    assert all((out / "checkpoints" / f"step_{n}" / MARKER).is_file() for n in (1, 2))
