"""Long-context stages: a built model's RoPE changes in place (parallelize.set_rope), and `hf3d train` runs
the shipped SmolLM3 long-context config (examples/configs/smollm3-long-context.yaml) at a tiny size: the
checkpoint of a short-row run -> a stage at 2x its positions with a new rope_theta -> a stage at twice
that seq_len with another rope_theta; a resume in the middle of the last stage; the export.

Tolerance (fp32): logits after set_rope vs stock transformers built with the new settings, abs <= 1e-5
(measured 0.0 at pp=2); the RoPE changes themselves move the logits by > 1e-4 (measured 1.0e-3 for
the new theta, 3.5e-3 for linear scaling), so a model that kept its old rotary buffers fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hf3d without an install
sys.path.insert(0, str(ROOT / "tests"))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, make_model_dir  # noqa: E402
from runs import metrics_records as _records  # noqa: E402

EXAMPLE = ROOT / "examples" / "configs" / "smollm3-long-context.yaml"
TINY_EXAMPLE = ROOT / "examples" / "configs" / "smollm3-long-context-tiny.yaml"
MAX_POS, SEQ, THETA = 16, 32, 2.5e5  # the model's positions; the stage's rows (twice as long) and rope base
LOGITS_ATOL, MOVED = 1e-5, 1e-4


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of `seq` tokens; row 1 packs two documents (positions restart), so masks are not trivial."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    pos = torch.arange(seq).repeat(2, 1)
    pos[1, seq // 3 :] -= seq // 3
    return ids, pos


SETTINGS = {
    "theta": {"rope_theta": THETA, "max_position_embeddings": SEQ},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": SEQ},
}


def _set_rope_worker(model_dir: str, out: str) -> None:
    from transformers import AutoConfig

    import hf3d
    from hf3d.parallelize import set_rope

    start_watchdog(120)
    pmodel = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=1, pp=2, num_microbatches=2))  # a rotary per stage
    base = AutoConfig.from_pretrained(model_dir)
    ids, pos = _batch(SEQ)
    res = {}
    with torch.no_grad():
        res["before"] = pmodel.eval()(input_ids=ids, position_ids=pos).logits
        for name, overrides in SETTINGS.items():
            set_rope(pmodel, overrides, base_config=base)
            res[name] = pmodel(input_ids=ids, position_ids=pos).logits
            res[f"{name}_config"] = pmodel.config.to_dict()
        set_rope(pmodel, {}, base_config=base)  # back to the model's own settings
        res["back"] = pmodel(input_ids=ids, position_ids=pos).logits
    report(res, out)


def test_set_rope_equals_stock_built_with_the_new_settings(tmp_path):
    """After set_rope, the pp=2 model (each rank rebuilds its own stage's rotary) gives the logits of stock
    transformers built with the new rope_theta (or rope_scaling) on the same weights, at a seq_len twice
    the model's max_position_embeddings; set_rope({}) returns to the model's own settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_model_dir(tmp_path / "llama", "llama", max_position_embeddings=MAX_POS)
    spawn(_set_rope_worker, 2, str(model_dir), str(tmp_path / "res.pt"))
    res = torch.load(tmp_path / "res.pt")[0]
    ids, pos = _batch(SEQ)

    def stock(overrides: dict) -> torch.Tensor:
        config = AutoConfig.from_pretrained(model_dir)
        rope = {**config.rope_parameters, **{k: v for k, v in overrides.items() if k == "rope_theta"}}
        rope.update(overrides.get("rope_scaling", {}))
        config.rope_parameters, config.max_position_embeddings = rope, overrides.get("max_position_embeddings", MAX_POS)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, use_cache=False).logits  # no cache: packed rows masked

    own = stock({})
    assert (res["before"] - own).abs().max() <= LOGITS_ATOL
    assert (res["back"] - own).abs().max() <= LOGITS_ATOL
    for name, overrides in SETTINGS.items():
        want = stock(overrides)
        assert (want - own).abs().max() > MOVED, name  # the settings change the logits: the test can fail
        assert (res[name] - want).abs().max() <= LOGITS_ATOL, (name, (res[name] - want).abs().max())
        assert res[f"{name}_config"]["max_position_embeddings"] == SEQ
    assert res["theta_config"]["rope_parameters"] == {"rope_type": "default", "rope_theta": THETA}
    assert res["linear_config"]["rope_parameters"]["factor"] == 2.0


# --- the shipped example ------------------------------------------------------------------------------
SCALE = 1024  # 32768 -> 32, 65536 -> 64 tokens per row
TINY = dict(seq_len=16, steps=6, switch=3, rows=4)  # the "4k" checkpoint's rows; stage 2 from step 3


def _tiny_model(tmp: Path) -> Path:
    """examples/models/tiny-smollm (config only: initialised from scratch) with 16 positions."""
    model_dir = tmp / "tiny-16"
    shutil.copytree(ROOT / "examples" / "models" / "tiny-smollm", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": TINY["seq_len"]}))
    return model_dir


def _hf3d(launcher: list[str], *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*launcher, "-m", "hf3d", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _tiny_example(tmp: Path, model_path: Path, out: Path) -> Path:
    """The shipped tiny variant (examples/configs/smollm3-long-context-tiny.yaml), from `model_path`, into `out`."""
    cfg = yaml.safe_load(TINY_EXAMPLE.read_text())
    cfg["model"]["path"] = str(model_path)
    cfg["run"].update(output_dir=str(out), report_to=[])
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_tiny_variant_is_the_recipe_at_1_1024_of_its_rows():
    """The small variant docs/long-context.md and the example's comments point to is the full recipe scaled: the same
    stages, RoPE bases, schedule and recompute, rows and positions / 1024, cp=2 on 2 processes, local data only."""
    big, tiny = yaml.safe_load(EXAMPLE.read_text()), yaml.safe_load(TINY_EXAMPLE.read_text())
    pairs = list(zip(big["data"]["stages"], tiny["data"]["stages"]))
    assert len(pairs) == 2 and [t["start_step"] for _, t in pairs] == [0, TINY["switch"]]
    for b, t in pairs:
        assert (t["name"], t["rope_theta"]) == (b["name"], b["rope_theta"])
        assert (t["seq_len"], t["max_position_embeddings"]) == (
            b["seq_len"] // SCALE,
            b["max_position_embeddings"] // SCALE,
        )
        assert all(not Path(s["path"]).is_absolute() and (ROOT / s["path"]).is_file() for s in t["sources"])
    assert (tiny["parallel"]["cp"], tiny["parallel"]["tp"], tiny["parallel"]["recompute"]) == (2, 1, "full")
    assert {k: tiny["optim"][k] for k in ("schedule", "decay_shape")} == {
        k: big["optim"][k] for k in ("schedule", "decay_shape")
    }
    assert (tiny["data"]["seq_len"], tiny["run"]["steps"], tiny["run"]["global_batch"]) == (
        TINY["seq_len"],
        TINY["steps"],
        TINY["rows"],
    )


def test_the_long_context_example_ships_the_smollm3_recipe(tmp_path):
    """The shipped file: the real Hub id, bf16, cp=4, 32k at theta 2M then 64k at theta 5M; it passes
    check_run against a 4k-position SmolLM3-3B-shaped config (Llama-shaped here) on 8 processes."""
    from transformers import LlamaConfig

    from hf3d.train.checks import check_run
    from hf3d.train.config import TrainConfig

    raw = yaml.safe_load(EXAMPLE.read_text())
    assert raw["model"]["path"] == "HuggingFaceTB/SmolLM3-3B" and raw["model"]["dtype"] == "bfloat16"
    assert raw["parallel"]["cp"] == 4
    stages = [(s["seq_len"], s["rope_theta"], s["max_position_embeddings"]) for s in raw["data"]["stages"]]
    assert stages == [(32768, 2e6, 32768), (65536, 5e6, 65536)]
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = TrainConfig.from_yaml(str(path))
    shape = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16)
    four_k = LlamaConfig(**shape, num_key_value_heads=4, vocab_size=128256, max_position_embeddings=4096)
    lines = check_run(cfg, world_size=8, model_config=four_k)
    assert any(
        "data stage 'long-64k' starts at step 2001 (start_step 2000)" in line and "seq_len 65536" in line
        for line in lines
    )
    assert any("rope_theta 5000000.0" in line for line in lines)


def test_the_long_context_example_runs_switches_resumes_and_exports(tmp_path):
    """At a tiny size, on 2 processes (cp=2): a 1-process run at 16-token rows writes a checkpoint; the
    example starts from it (model.path) at 32-token rows and theta 2M, doubles to 64 at theta 5M from step
    4 on (each row split over the 2 cp ranks), exports the last stage's settings and marks the stages
    on the loss curve; a run resumed after step 4 (in the middle of the 64-token stage) repeats steps 5
    and 6 bit for bit, which it cannot with the wrong seq_len or RoPE."""
    model_dir = _tiny_model(tmp_path)
    short = tmp_path / "short"
    _hf3d(
        [sys.executable],
        "train",
        "examples/configs/tiny-smollm.yaml",
        "--set",
        f"model.path={model_dir}",
        f"data.seq_len={TINY['seq_len']}",
        "data.eval.every=0",
        "parallel.tp=1",
        "parallel.num_microbatches=1",
        "run.steps=2",
        f"run.global_batch={TINY['rows']}",
        "run.sample_prompt=null",
        "run.save_final=false",
        "optim.warmup_steps=1",
        "checkpoint.every=2",
        f"run.output_dir={short}",
    )
    start = short / "checkpoints" / "step_2"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    full = _hf3d(torchrun, "train", str(_tiny_example(tmp_path, start, tmp_path / "full")))
    resumed_cfg = _tiny_example(tmp_path, start, tmp_path / "resumed")
    step_4 = tmp_path / "full" / "checkpoints" / "step_4"
    resumed = _hf3d(torchrun, "train", str(resumed_cfg), "--set", f"checkpoint.resume={step_4}")

    records = _records(tmp_path / "full")
    rows, seq = TINY["rows"], [32] * TINY["switch"] + [64] * (TINY["steps"] - TINY["switch"])
    assert [r["stage"] for r in records] == [0] * 3 + [1] * 3
    assert [b["consumed_tokens"] - a["consumed_tokens"] for a, b in zip(records, records[1:])] == [
        rows * s for s in seq[1:]
    ]
    assert "hf3d: step 4: data stage 'long-64k', seq_len 64; the model's RoPE is now" in full.stdout  # 1-based
    assert "hf3d: data packing: seq_len 32 (steps 1..3), 64 (steps 4..6), document masking" in full.stdout
    assert "'rope_theta': 5000000.0" in full.stdout
    config = json.loads((tmp_path / "full" / "final" / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e6}
    assert config["max_position_embeddings"] == 64
    summary = json.loads((tmp_path / "full" / "final" / "hf3d_training.json").read_text())
    assert summary["hyperparameters"]["seq_len"] == 64
    assert (tmp_path / "full" / "loss_curve.png").is_file()

    again = _records(tmp_path / "resumed")
    assert [r["step"] for r in again] == [5, 6]
    for a, b in zip(records[4:], again):  # the same mesh: bit for bit
        for key in ("loss", "grad_norm", "lr", "consumed_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert "step 5: data stage 'long-64k'" in resumed.stdout
    final = json.loads((tmp_path / "resumed" / "final" / "config.json").read_text())
    assert final["rope_parameters"] == config["rope_parameters"]
