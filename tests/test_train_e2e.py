"""`hf3d train` end to end on 4 gloo processes (tp=2 x pp=2): the loss falls, evaluation runs, checkpoints
are written, and a run resumed from a middle checkpoint trains the same steps to the same numbers. Also the
launch through `accelerate launch` with the shipped CPU config file, and the outputs a user looks at
(progress bar, log lines, resolved config, loss curve, sample, model card inputs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from asserts import assert_close  # noqa: E402
from runs import metrics_records as _records  # noqa: E402

CONFIG = "examples/configs/tiny-smollm.yaml"
STEPS = 12
SETTINGS = [
    f"run.steps={STEPS}",
    "run.global_batch=8",
    "run.log_every=4",
    "data.seq_len=32",
    "data.eval.every=6",
    "data.eval.batches=1",
    "optim.warmup_steps=2",
    "checkpoint.every=4",
    "checkpoint.keep_last=0",
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.num_microbatches=2",
]


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n)]


def _train(launcher: list[str], out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*launcher, "-m", "hf3d", "train", CONFIG, "--set", *SETTINGS, f"run.output_dir={out}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    full = _train(_torchrun(4), base / "full")
    resumed = _train(_torchrun(4), base / "resumed", f"checkpoint.resume={base / 'full' / 'checkpoints' / 'step_8'}")
    return base, full, resumed


def test_tp2_pp2_loss_falls_eval_runs_and_checkpoints_are_written(runs):
    base, proc, _ = runs
    out = base / "full"
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals] == [6, 12]
    assert evals[1][1] < evals[0][1]
    for key in (
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "tokens_per_sec_per_device",
        "tflops",
        "consumed_tokens",
        "peak_mem_bytes",
        "data_time_pct",
    ):
        assert all(key in r for r in records), key
    assert records[-1]["consumed_tokens"] == STEPS * 8 * 32
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_12",
        "step_4",
        "step_8",
    ]
    # what the user sees: the resolved config once, the derived values, log lines, the curve, the export
    assert proc.stdout.count("hf3d: resolved config") == 1
    assert "tokens per step: 256" in proc.stdout
    assert f"step 12/{STEPS}: loss" in proc.stdout and "eval_loss" in proc.stdout
    assert (out / "config.yaml").is_file() and (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    final = out / "final"
    assert (final / "loss_curve.png").is_file()
    summary = json.loads((final / "hf3d_training.json").read_text())
    assert summary["final_eval_loss"] == evals[-1][1] and summary["datasets"] == ["shakespeare"]
    assert (out / "sample.txt").read_text().startswith("ROMEO:")
    model = AutoModelForCausalLM.from_pretrained(final)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_resume_from_a_middle_checkpoint_trains_the_same_steps(runs):
    base, _, proc = runs
    full, resumed = _records(base / "full"), _records(base / "resumed")
    assert [r["step"] for r in resumed] == [9, 10, 11, 12]
    assert "8 steps done, training goes on at step 9" in proc.stdout
    for a, b in zip(full[8:], resumed):  # the same mesh: bit for bit
        for key in ("loss", "lr", "grad_norm", "consumed_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert full[-1]["eval_loss"] == resumed[-1]["eval_loss"]


def test_a_longer_resumed_run_says_how_the_lr_moves_and_its_checkpoint_carries_the_card(runs, tmp_path):
    """Resuming step 8 of the 12-step cosine run with run.steps=16 rebuilds the schedule over 16 steps: one
    line gives the old and new length and the lr before and after. The new run starts from an export
    (model.path: a local folder), and `convert to-hf` of its checkpoint writes the run's record, from
    which the card says where it continued from."""
    from hf3d.checkpoint.convert import checkpoint_to_hf
    from hf3d.hf.hub import write_model_card

    base, _, _ = runs
    out = tmp_path / "longer"
    proc = _train(
        [sys.executable],
        out,
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.num_microbatches=1",
        "run.steps=16",
        "checkpoint.every=8",
        "run.save_final=false",
        f"model.path={base / 'full' / 'final'}",
        f"checkpoint.resume={base / 'full' / 'checkpoints' / 'step_8'}",
    )
    full, longer = _records(base / "full"), _records(out)
    lines = [line for line in proc.stdout.splitlines() if "run.steps changed" in line]
    assert lines == [
        f"hf3d: run.steps changed from 12 to 16 since the checkpoint: the cosine schedule now spans 16 steps "
        f"instead of 12: lr {full[7]['lr']:.3g} at step 8, lr {longer[0]['lr']:.3g} at step 9"
    ], proc.stdout[-3000:]
    assert longer[0]["lr"] > 1.1 * full[8]["lr"]  # the jump the line warns about
    hf = checkpoint_to_hf(out / "checkpoints" / "step_16", tmp_path / "hf")
    summary = json.loads((hf / "hf3d_training.json").read_text())
    assert [step for step, _ in summary["loss_curve"]] == list(range(9, 17))
    assert summary["hyperparameters"]["steps"] == 16 and summary["datasets"] == ["shakespeare"]
    assert summary["started_from"] == "final" and summary["base_model"] is None
    card = write_model_card(hf, summary).read_text()
    assert "Continued from `final` (local weights)" in card and "from scratch" not in card


def test_init_from_a_checkpoint_is_not_a_resume(runs, tmp_path):
    """A run that continues another run's checkpoint with every load_* switch off: the weights come from
    step 8 (at another mesh: one process), but the step counter, the lr schedule (warm-up again), the
    optimizer state and the data position all start over."""
    base, _, _ = runs
    out = tmp_path / "fresh"
    off = [f"checkpoint.load_{k}=false" for k in ("optimizer", "scheduler", "step", "data_position")]
    one_process = ["parallel.tp=1", "parallel.pp=1", "parallel.num_microbatches=1", "run.steps=3"]
    proc = _train(
        [sys.executable],
        out,
        *one_process,
        *off,
        "data.eval.every=0",
        "checkpoint.every=0",
        "run.sample_prompt=null",
        f"checkpoint.resume={base / 'full' / 'checkpoints' / 'step_8'}",
    )
    assert "restored: weights only" in proc.stdout
    fresh, full = _records(out), _records(base / "full")
    assert [r["step"] for r in fresh] == [1, 2, 3]
    assert fresh[0]["lr"] == full[0]["lr"]  # warm-up again: lr / warmup_steps
    assert fresh[0]["consumed_tokens"] == 8 * 32  # the data starts over ...
    assert fresh[0]["consumed_tokens/shakespeare"] == 8 * 32
    # ... on the first rows of the data order, with step 8's weights: the first batch of the full run,
    # scored by a model that has trained 8 steps, is far below that run's own first loss
    assert fresh[0]["loss"] < full[0]["loss"] - 0.5


def test_stages_example_config_checks_out():
    """examples/configs/smollm3-style-stages.yaml: three stages, WSD, the last stage starting where the
    decay starts (said in the derived values), and a stage moved past the run refused with one line."""
    from transformers import AutoConfig

    from hf3d.train.checks import check_run
    from hf3d.train.config import TrainConfig

    path = "examples/configs/smollm3-style-stages.yaml"
    cfg = TrainConfig.from_yaml(str(ROOT / path))
    model_config = AutoConfig.from_pretrained(ROOT / cfg.model.path)
    lines = check_run(cfg, world_size=2, model_config=model_config)
    assert [s.name for s in cfg.data.resolved_stages()] == ["stable-1", "stable-2", "decay"]
    assert "data stage 'decay' starts at step 181 (start_step 180), with the lr decay" in lines
    assert any("lr decay (1-sqrt): steps 181..200 (20 steps)" in line for line in lines)
    late = TrainConfig.from_yaml(str(ROOT / path), ["run.steps=150"])
    with pytest.raises(
        ValueError, match=r"data stage 'decay' \(start_step 180\) would start at step 181, after the run's last step"
    ):
        check_run(late, world_size=2, model_config=model_config)


def test_weight_decay_patterns_pick_the_parameters_without_decay():
    from hf3d.train.config import OptimConfig

    rule = OptimConfig(exclude_from_weight_decay=["*norm*", "*.bias"]).no_decay_rule()
    assert rule("model.layers.0.input_layernorm.weight", None) and rule("model.layers.0.self_attn.q_proj.bias", None)
    assert not rule("model.layers.0.mlp.gate_up_proj.weight", None) and not rule("model.embed_tokens.weight", None)
    assert OptimConfig(exclude_from_weight_decay=True).no_decay_rule() is True
    assert OptimConfig().no_decay_rule() is True  # the default: the Trainer's rule, as build_optimizer applies it


@pytest.mark.parametrize("family", ["llama", "llama-kvrep", "qwen2", "qwen3"])
def test_default_weight_decay_rule_is_the_transformers_trainers(family):
    """hf3d train's default (exclude_from_weight_decay: true) leaves undecayed exactly what the transformers
    Trainer leaves undecayed: biases and norm weights (Qwen3's q_norm / k_norm too); embeddings decay."""
    from models import tiny_config  # tests/ is on sys.path (pytest's prepend import mode)
    from transformers import Trainer

    from hf3d.optim.zero import no_decay_names

    model = AutoModelForCausalLM.from_config(tiny_config(family))
    names = {n for n, _ in model.named_parameters()}
    assert no_decay_names(model) == names - set(Trainer.get_decay_parameter_names(None, model))
    assert "model.embed_tokens.weight" not in no_decay_names(model)


def test_accelerate_launch_with_the_shipped_cpu_config(tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate/cpu.yaml"]
    out = tmp_path / "acc"
    _train(
        launcher,
        out,
        "parallel.pp=1",
        "run.steps=3",
        "data.eval.every=0",
        "checkpoint.every=0",
        "run.sample_prompt=null",
    )
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (out / "final" / "config.json").is_file()


def _loop_steps(stdout: str) -> list[tuple[float, float]]:
    """(loss, grad norm) of each `step N: loss X grad_norm Y` line of examples/accelerate_loop.py."""
    found = re.findall(r"^step \d+: loss (\S+) grad_norm (\S+)$", stdout, flags=re.M)
    return [(float(a), float(b)) for a, b in found]


def test_an_fsdp2_accelerate_config_runs_the_loop_as_zero3(tmp_path):
    """examples/accelerate_loop.py under `accelerate launch` with the shipped FSDP2 config, at tp 1 (2 processes,
    dp2) and tp 2 (4 processes, dp2): the config maps onto ZeRO-3, and the losses and grad norms are those of the
    same loop at ZeRO-1 (the plain CPU config, dp2: the docs' launch of the loop, which exits 0 and writes a stock HF
    directory, as each run here does). The losses, printed to 6 decimals, agreed to every digit; the
    grad norms by 1.1e-5 relative at most (tiny-smollm's 192k-element tied embedding: the fp32 sums of squares run
    over other groupings at each stage, and both stages are 5-6e-6 from stock's clip_grad_norm_ on these rows)."""
    acc = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    loop = ["examples/accelerate_loop.py", "--steps", "3", "--rows", "2", "--seq-len", "32"]
    runs = {  # name: (config, processes, HF3D_TP)
        "zero1-dp2": ("examples/accelerate/cpu.yaml", 2, 1),
        "fsdp2-dp2": ("examples/accelerate/fsdp2-cpu.yaml", 2, 1),
        "fsdp2-tp2-dp2": ("examples/accelerate/fsdp2-cpu.yaml", 4, 2),
    }
    steps, meshes = {}, {}
    for name, (config, n, tp) in runs.items():
        cmd = [*acc, config, "--num_processes", str(n), *loop, "--output-dir", str(tmp_path / name)]
        env = {**os.environ, "HF3D_TP": str(tp)}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "wrote" in proc.stdout and (tmp_path / name / "final" / "model.safetensors").is_file()
        steps[name] = _loop_steps(proc.stdout)
        meshes[name] = re.search(r"^mesh: .*$", proc.stdout, flags=re.M).group(0)
    assert meshes == {
        "zero1-dp2": "mesh: tp=1 pp=1 dp=2 cp=1, zero_stage=1",
        "fsdp2-dp2": "mesh: tp=1 pp=1 dp=2 cp=1, zero_stage=3",
        "fsdp2-tp2-dp2": "mesh: tp=2 pp=1 dp=2 cp=1, zero_stage=3",
    }
    assert len(steps["zero1-dp2"]) == 3
    for name in ("fsdp2-dp2", "fsdp2-tp2-dp2"):
        got, want = zip(*steps[name]), zip(*steps["zero1-dp2"])
        (loss, norm), (want_loss, want_norm) = got, want
        assert_close(loss, want_loss, atol=3e-6, what=f"{name} loss")
        assert_close(norm, want_norm, rtol=2e-4, what=f"{name} grad norm")


def test_the_trainer_example_runs_as_the_docs_launch_it(tmp_path):
    """examples/trainer.py under torchrun, a few steps: it exits 0 (it ends with hf3d.finish) and writes a stock HF
    directory (examples/accelerate_loop.py's docs launch runs in the FSDP2 test above, as its ZeRO-1 baseline)."""
    cmd = [*_torchrun(2), "examples/trainer.py", "--steps", "2", "--rows", "2", "--seq-len", "32"]
    proc = subprocess.run([*cmd, "--output-dir", str(tmp_path / "trainer")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "wrote" in proc.stdout
    assert (tmp_path / "trainer" / "model.safetensors").is_file()


def test_smollm2_135m_continued_config_runs_two_steps_on_a_local_random_checkpoint(tmp_path):
    """The shipped continued-pretraining config, its real shape at tp=3, against a locally saved random
    checkpoint of that shape (no Hub here): the same config with the model, the data source and the
    run length pointed at local things, the sequence shortened to fit a CPU test, and fp32 instead of
    the config's bf16 (bf16 matmuls take a slow path on this CPU: the two steps took 24 s each, 4 s in fp32)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import SMOLLM2_135M

    model_dir = tmp_path / "smollm2-135m-random"
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_135M)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer").save_pretrained(model_dir)
    out = tmp_path / "run"
    cmd = [
        *_torchrun(3),
        "-m",
        "hf3d",
        "train",
        "examples/configs/smollm2-135m-continued.yaml",
        "--set",
        f"model.path={model_dir}",
        "model.dtype=float32",
        "parallel.tp=3",
        "parallel.num_microbatches=1",
        "run.steps=2",
        "run.global_batch=2",
        "data.seq_len=64",
        "data.sources=[{path: examples/data/poems.jsonl}]",
        "data.num_proc=1",
        "data.eval.every=2",
        "data.eval.batches=1",
        "optim.warmup_steps=1",
        "optim.decay_steps=1",
        "model.rope_theta=200000",
        "run.report_to=[]",
        "run.sample_prompt=null",
        f"run.output_dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2] and "eval_loss" in records[-1]
    assert "z_loss" in records[0] and records[0]["lr"] == 5e-4
    exported = LlamaConfig.from_pretrained(out / "final")
    assert (exported.hidden_size, exported.num_hidden_layers, exported.vocab_size) == (576, 30, 49152)
    assert exported.rope_parameters["rope_theta"] == 200000  # the long-context override reaches the export
