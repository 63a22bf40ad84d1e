"""Misuse gets ONE clear ValueError / TypeError whose message says what is wrong and what to do.

ParallelConfig is checked in this process (it needs no process group). Everything that goes
through hf3d.parallelize / build_optimizer runs on a spawned world of 2 gloo processes, because
there the contract is stronger: every rank must raise the same error before any collective, so
that no rank is left waiting (a final barrier proves it; a watchdog turns a hang into a failure).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM, MistralConfig  # noqa: E402

import hf3d  # noqa: E402
from hf3d.parallel.config import ENV_VARS, PP_SCHEDULES  # noqa: E402

WATCHDOG_S = 300
SUPPORTED = ("llama", "qwen2", "qwen3", "smollm3")


# ------------------------------------------------------------------------------------------------
# ParallelConfig: no process group needed
# ------------------------------------------------------------------------------------------------
def test_unknown_pp_schedule_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(pp=2, pp_schedule="gpipe-typo")
    msg = str(e.value)
    assert "'gpipe-typo'" in msg
    for name in PP_SCHEDULES:
        assert name in msg, f"{name!r} missing from: {msg}"


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(zero_stage=4), ["zero_stage", "0, 1, 2 or 3", "4"]),
        (dict(zero_stage=3, dp_shard=0), ["dp_shard", "positive integer"]),
        (dict(tp=0), ["tp", "positive", "0"]),
        (dict(tp=-2), ["tp", "positive", "-2"]),
        (dict(tp=2.0), ["tp", "positive integer", "2.0"]),
        (dict(pp=0), ["pp", "positive", "0"]),
        (dict(dp=0), ["dp", "positive", "None"]),
        (dict(num_microbatches=0), ["num_microbatches", "positive"]),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_parallel_config_validation(kwargs, words):
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(**kwargs)
    for w in words:
        assert w in str(e.value), f"{w!r} missing from: {e.value}"


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 3])
def test_multi_chunk_schedules_default_to_two_virtual_stages(schedule, pp):
    pcfg = hf3d.ParallelConfig(pp=pp, pp_schedule=schedule)
    assert pcfg.virtual_stages == 2
    assert pcfg.num_stages == 2 * pp


def test_virtual_stages_explicit_values():
    for schedule in ("afab", "1f1b"):
        pcfg = hf3d.ParallelConfig(pp=2, pp_schedule=schedule)
        assert (pcfg.virtual_stages, pcfg.num_stages) == (1, 2)
    pcfg = hf3d.ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3)
    assert (pcfg.virtual_stages, pcfg.num_stages) == (3, 6)
    assert hf3d.ParallelConfig(pp=1, pp_schedule="interleaved-1f1b", virtual_stages=1).num_stages == 1
    # given as 1 is not the same as not given: interleaving one chunk per rank is refused
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=1)
    assert "'interleaved-1f1b' needs virtual_stages >= 2" in str(e.value) and "'1f1b'" in str(e.value), str(e.value)
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ValueError) as e:
            hf3d.ParallelConfig(pp=2, pp_schedule=schedule, virtual_stages=1)
        assert f"{schedule!r} runs exactly 2 virtual stages" in str(e.value), str(e.value)
        assert "virtual_stages=1" in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(pp=2, pp_schedule="1f1b", virtual_stages=2)
    assert "one stage per rank" in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=0)
    assert "virtual_stages must be a positive integer" in str(e.value), str(e.value)


def test_parallel_config_world_size_product():
    """resolve() is what parallelize uses: the message spells out tp * pp * dp * cp."""
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(tp=2, dp=2).resolve(2)
    assert "2 * 1 * 2 * 1 = 4" in str(e.value) and "world size is 2" in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(tp=2, pp=2, pp_schedule="afab").resolve(6)
    assert "6" in str(e.value) and "2 * 2 * 1 = 4" in str(e.value), str(e.value)
    assert hf3d.ParallelConfig(tp=2).resolve(6).dp == 3
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig(tp=2, cp=2, dp=2).resolve(4)
    assert "tp * pp * dp * cp = 2 * 1 * 2 * 2 = 8" in str(e.value), str(e.value)
    assert hf3d.ParallelConfig(tp=2, cp=2).resolve(8).dp == 2


@pytest.fixture
def hf3d_env(monkeypatch):
    """No HF3D_* variable from the calling shell; returns a setter."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    return lambda **env: [monkeypatch.setenv(k, v) for k, v in env.items()]


def test_from_env_reads_every_variable(hf3d_env):
    assert hf3d.ParallelConfig.from_env() == hf3d.ParallelConfig()  # nothing set: the defaults
    hf3d_env(HF3D_TP="2", HF3D_PP=" 2 ", HF3D_DP="3", HF3D_PP_SCHEDULE="zbv", HF3D_NUM_MICROBATCHES="8", HF3D_CP="2")
    pcfg = hf3d.ParallelConfig.from_env()
    assert (pcfg.tp, pcfg.pp, pcfg.dp, pcfg.pp_schedule, pcfg.num_microbatches) == (2, 2, 3, "zbv", 8)
    assert pcfg.cp == 2
    assert pcfg.virtual_stages == 2  # derived as in the constructor
    hf3d_env(HF3D_DP="", HF3D_NUM_MICROBATCHES="")  # set but empty: unset
    pcfg = hf3d.ParallelConfig.from_env()
    assert (pcfg.dp, pcfg.num_microbatches) == (None, 4)  # zbv at pp=2: 2 * pp micro-batches


def test_from_env_overrides_win(hf3d_env):
    hf3d_env(HF3D_TP="4", HF3D_PP="2", HF3D_PP_SCHEDULE="gpipe-typo")
    pcfg = hf3d.ParallelConfig.from_env(tp=1, pp_schedule="afab", zero_stage=0)
    assert (pcfg.tp, pcfg.pp, pcfg.pp_schedule, pcfg.zero_stage) == (1, 2, "afab", 0)
    with pytest.raises(TypeError, match="not_a_field"):
        hf3d.ParallelConfig.from_env(not_a_field=1)


@pytest.mark.parametrize(
    "var,raw,words",
    [
        ("HF3D_TP", "two", ["HF3D_TP", "positive integer", "'two'"]),
        ("HF3D_PP", "0", ["HF3D_PP", "positive integer", "'0'"]),
        ("HF3D_DP", "-1", ["HF3D_DP", "positive integer", "'-1'"]),
        ("HF3D_NUM_MICROBATCHES", "2.5", ["HF3D_NUM_MICROBATCHES", "positive integer", "'2.5'"]),
        ("HF3D_PP_SCHEDULE", "gpipe", ["HF3D_PP_SCHEDULE", "'gpipe'", *PP_SCHEDULES]),
    ],
)
def test_from_env_bad_value_names_the_variable(hf3d_env, var, raw, words):
    hf3d_env(**{var: raw})
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig.from_env()
    for w in words:
        assert w in str(e.value), f"{w!r} missing from: {e.value}"


def test_from_env_inconsistent_values_name_the_variables(hf3d_env):
    """Each value is valid alone; together they break a ParallelConfig rule, and the message says
    which variables were read as well as the rule."""
    hf3d_env(HF3D_PP="2", HF3D_PP_SCHEDULE="dualpipev", HF3D_NUM_MICROBATCHES="2")
    with pytest.raises(ValueError) as e:
        hf3d.ParallelConfig.from_env()
    msg = str(e.value)
    assert "at least 4 micro-batches" in msg, msg
    assert "HF3D_PP=2, HF3D_PP_SCHEDULE=dualpipev, HF3D_NUM_MICROBATCHES=2" in msg, msg


# ------------------------------------------------------------------------------------------------
# Errors raised through parallelize / build_optimizer, on every rank of a world of 2
# ------------------------------------------------------------------------------------------------
def _attempt(res: dict, name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # record what was raised; the parent asserts on it
        res[name] = (type(e).__name__, str(e))
    else:
        res[name] = ("no error", "")


def _error_world(paths: dict, out: str) -> None:
    start_watchdog(WATCHDOG_S)
    P, C, res = hf3d.parallelize, hf3d.ParallelConfig, {}
    _attempt(res, "tp_not_dividing_heads", lambda: P(paths["llama"], C(tp=4)))
    _attempt(res, "world_size_product", lambda: P(paths["llama"], C(tp=2, dp=2)))
    _attempt(res, "world_not_divisible", lambda: P(paths["llama-kvrep"], C(tp=4)))
    _attempt(res, "unknown_model_type_dir", lambda: P(paths["mistral"], C()))
    mistral = AutoModelForCausalLM.from_pretrained(paths["mistral"])
    _attempt(res, "unknown_model_type_instance", lambda: P(mistral, C()))
    _attempt(res, "missing_shard", lambda: P(paths["missing-shard"], C(tp=2)))
    _attempt(res, "truncated_half", lambda: P(paths["truncated-half"], C(tp=2)))
    _attempt(res, "truncated_header", lambda: P(paths["truncated-header"], C(tp=2)))
    _attempt(res, "no_such_path", lambda: P("./does/not/exist", C()))
    _attempt(res, "nested_not_an_id", lambda: P("a/b/c", C()))
    _attempt(res, "a_file", lambda: P(paths["a-file"], C()))
    _attempt(res, "dir_without_config", lambda: P(paths["no-config"], C()))
    _attempt(res, "dir_without_safetensors", lambda: P(paths["no-safetensors"], C()))
    _attempt(res, "hub_id_offline", lambda: P("hf3d-no-such-org/no-such-model", C()))

    pm = P(paths["llama"], C(tp=2, sequence_parallel=True, num_microbatches=3))
    ids = torch.randint(1, 101, (3, 7))
    _attempt(res, "sp_seq_not_multiple_forward", lambda: pm(ids))
    _attempt(res, "sp_seq_not_multiple_train", lambda: pm.train_step(ids, ids))
    ids = torch.randint(1, 101, (4, 8))
    _attempt(res, "labels_shape", lambda: pm.train_step(ids, ids[:, :-1]))
    _attempt(res, "microbatches_not_dividing_rows", lambda: pm.train_step(ids, ids))
    # tp=2 pads the vocabulary of 101 to 102, so id 101 would hit a zero padding row, not an IndexError
    ids = torch.randint(1, VOCAB, (3, 8))
    _attempt(res, "id_equal_vocab_tp2", lambda: pm.train_step(_put(ids, (2, 7), VOCAB), ids))
    _attempt(res, "id_equal_vocab_tp2_forward", lambda: pm(_put(ids, (1, 3), VOCAB)))

    build, adamw = hf3d.build_optimizer, torch.optim.AdamW
    _attempt(res, "optimizer_string", lambda: build(pm, "adamw", lr=1e-3))
    _attempt(res, "optimizer_not_an_optimizer", lambda: build(pm, torch.nn.Linear, lr=1e-3))
    _attempt(res, "optimizer_unknown_kwarg", lambda: build(pm, adamw, lr=1e-3, not_a_kwarg=1))
    _attempt(res, "optimizer_bad_lr_type", lambda: build(pm, adamw, lr="x"))
    _attempt(res, "optimizer_zero_stage", lambda: build(pm, adamw, lr=1e-3, zero_stage=5))
    _attempt(res, "optimizer_bucket_size", lambda: build(pm, adamw, lr=1e-3, bucket_size=0))

    _token_id_cases(res, P(paths["llama"], C()))  # tp=1, dp=2

    report(res, Path(out) / "errors.pt")  # its barrier: no rank is stuck in a collective another skipped


def _put(t: torch.Tensor, pos: tuple[int, int], value: int) -> torch.Tensor:
    t = t.clone()
    t[pos] = value
    return t


def _token_id_cases(res: dict, pm) -> None:
    """Ids and labels outside the vocabulary at tp=1, dp=2: each rank passes its own dp rows."""
    assert pm.dp_size == 2
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))  # the same on both ranks
    _attempt(res, "id_equal_vocab_tp1", lambda: pm.train_step(_put(ids, (1, 4), VOCAB), ids))
    _attempt(res, "id_negative", lambda: pm.train_step(_put(ids, (0, 2), -1), ids))
    _attempt(res, "label_too_big", lambda: pm.train_step(ids, _put(ids, (2, 3), VOCAB + 5)))
    _attempt(res, "label_negative_not_ignore", lambda: pm.train_step(ids, _put(ids, (3, 0), -2)))
    _attempt(res, "id_equal_vocab_tp1_forward", lambda: pm(_put(ids, (0, 0), VOCAB)))
    # only dp rank 1 holds a bad id: dp rank 0 must raise too instead of waiting in the step's all-reduce
    mine = _put(ids, (1, 6), VOCAB) if pm.dp_rank == 1 else ids
    _attempt(res, "bad_id_on_one_dp_rank", lambda: pm.train_step(mine, ids))
    # -100 labels and ids up to vocab_size - 1 are valid: the check must not fire on them
    edge = _put(_put(ids, (0, 1), VOCAB - 1), (0, 2), 0)
    _attempt(res, "valid_edges_pass", lambda: pm.train_step(edge, _put(edge, (1, 1), -100)))
    _attempt(res, "valid_edges_pass_forward", lambda: pm(edge))


def _make_broken_checkpoints(root: Path, family_dirs: dict) -> dict[str, str]:
    paths = {"llama": str(family_dirs["llama"]), "llama-kvrep": str(family_dirs["llama-kvrep"])}

    # a family hf3d has no adapter for (llama-like, so nothing else is wrong with it)
    cfg = MistralConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "mistral")
    paths["mistral"] = str(root / "mistral")

    # a sharded checkpoint (index + 11 files) with one shard deleted
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(
        root / "missing-shard", max_shard_size="20KB"
    )
    weight_map = json.loads((root / "missing-shard" / "model.safetensors.index.json").read_text())["weight_map"]
    victim = weight_map["model.layers.0.self_attn.q_proj.weight"]
    assert len(set(weight_map.values())) > 2, "not sharded"
    (root / "missing-shard" / victim).unlink()
    paths["missing-shard"], paths["missing-shard-file"] = str(root / "missing-shard"), victim

    # a single-file checkpoint cut in half (header intact, data short), and one cut inside its header
    for name, keep in (("truncated-half", 0.5), ("truncated-header", None)):
        shutil.copytree(family_dirs["llama"], root / name)
        f = root / name / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: int(len(data) * keep)] if keep else data[:40])
        paths[name] = str(root / name)

    paths["a-file"] = str(Path(family_dirs["llama"]) / "config.json")
    (root / "no-config").mkdir()
    shutil.copy(Path(family_dirs["llama"]) / "model.safetensors", root / "no-config")
    paths["no-config"] = str(root / "no-config")
    (root / "no-safetensors").mkdir()
    shutil.copy(Path(family_dirs["llama"]) / "config.json", root / "no-safetensors")
    (root / "no-safetensors" / "pytorch_model.bin").write_bytes(b"")  # weights, but not safetensors
    paths["no-safetensors"] = str(root / "no-safetensors")
    return paths


@pytest.fixture(scope="module")
def errors(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    paths = _make_broken_checkpoints(root, family_dirs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # read by the children at import: no network for the Hub id case
        spawn(_error_world, 2, paths, str(root))
    results = torch.load(root / "errors.pt", weights_only=False)
    assert len(results) == 2
    return results, paths


# case: (exception type, substrings the message must contain); "{key}" is filled from the paths
EXPECTED = {
    "tp_not_dividing_heads": (
        "ValueError",
        ["tp=4", "6 query heads", "2 KV heads", "Valid tp values: 1, 2, 6"],
    ),
    "world_size_product": ("ValueError", ["tp * pp * dp * cp = 2 * 1 * 2 * 1 = 4", "world size is 2"]),
    "world_not_divisible": ("ValueError", ["world size 2", "tp * pp * cp = 4 * 1 * 1 = 4"]),
    "unknown_model_type_dir": ("ValueError", ["'mistral'", "not supported", "supported:", *SUPPORTED]),
    "unknown_model_type_instance": ("ValueError", ["'mistral'", "not supported", "supported:", *SUPPORTED]),
    "missing_shard": ("ValueError", ["{missing-shard-file}", "missing"]),
    "truncated_half": ("ValueError", ["{truncated-half}/model.safetensors", "truncated"]),
    "truncated_header": ("ValueError", ["{truncated-header}/model.safetensors", "truncated"]),
    "no_such_path": ("ValueError", ["'./does/not/exist'", "neither", "Hub model id"]),
    "nested_not_an_id": ("ValueError", ["'a/b/c'", "neither", "Hub model id"]),
    "a_file": ("ValueError", ["{a-file}", "neither"]),
    "dir_without_config": ("ValueError", ["{no-config}", "config.json"]),
    "dir_without_safetensors": ("ValueError", ["{no-safetensors}", "model.safetensors", "safetensors"]),
    "hub_id_offline": ("ValueError", ["'hf3d-no-such-org/no-such-model'", "could not fetch"]),
    "sp_seq_not_multiple_forward": ("ValueError", ["sequence_parallel", "(7)", "tp=2"]),
    "sp_seq_not_multiple_train": ("ValueError", ["sequence_parallel", "(7)", "tp=2"]),
    "labels_shape": ("ValueError", ["labels", "(4, 7)", "(4, 8)"]),
    "microbatches_not_dividing_rows": ("ValueError", ["num_microbatches=3", "4 rows"]),
    "id_equal_vocab_tp2": ("ValueError", ["input_ids[2, 7] = 101", "vocab_size=101", "[0, 101)", "tokenizer"]),
    "id_equal_vocab_tp2_forward": ("ValueError", ["input_ids[1, 3] = 101", "vocab_size=101", "[0, 101)"]),
    "id_equal_vocab_tp1": ("ValueError", ["input_ids[1, 4] = 101 on dp rank 0", "vocab_size=101", "[0, 101)"]),
    "id_negative": ("ValueError", ["input_ids[0, 2] = -1 on dp rank 0", "vocab_size=101"]),
    "label_too_big": ("ValueError", ["labels[2, 3] = 106 on dp rank 0", "-100", "[0, 101)"]),
    "label_negative_not_ignore": ("ValueError", ["labels[3, 0] = -2 on dp rank 0", "-100", "[0, 101)"]),
    "id_equal_vocab_tp1_forward": ("ValueError", ["input_ids[0, 0] = 101", "vocab_size=101"]),
    "bad_id_on_one_dp_rank": ("ValueError", ["input_ids[1, 6] = 101 on dp rank 1", "vocab_size=101"]),
    "valid_edges_pass": ("no error", []),
    "valid_edges_pass_forward": ("no error", []),
    "optimizer_string": ("TypeError", ["torch.optim.Optimizer", "'adamw'"]),
    "optimizer_not_an_optimizer": ("TypeError", ["torch.optim.Optimizer", "Linear"]),
    "optimizer_unknown_kwarg": ("TypeError", ["AdamW", "not_a_kwarg"]),
    "optimizer_bad_lr_type": ("TypeError", ["AdamW", "'x'"]),
    "optimizer_zero_stage": ("ValueError", ["zero_stage", "0, 1, 2 or 3", "5"]),
    "optimizer_bucket_size": ("ValueError", ["bucket_size", "positive", "0"]),
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_error_message(errors, case):
    results, paths = errors
    want_type, words = EXPECTED[case]
    words = [w.format_map(paths) if w.startswith("{") else w for w in words]
    for rank, res in enumerate(results):
        got_type, msg = res[case]
        assert got_type == want_type, f"rank {rank}: {case} raised {got_type}: {msg}"
        for w in words:
            assert w in msg, f"rank {rank}: {case}: {w!r} missing from the message: {msg}"
        assert len(msg) < 600, f"rank {rank}: {case}: the message is not short and clear: {msg}"


def test_numbers_yaml_reads_as_strings_are_taken_as_numbers():
    """YAML reads 3e-4 (no dot) as a string; a config field that is a number takes it as one, and
    anything else is one clear message naming the key."""
    from hf3d.train.trainer import TrainConfig

    cfg = TrainConfig.from_yaml(None, ["optim.lr=3e-4", "optim.eps=1e-8", "run.global_batch=8"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.eps == 1e-8 and cfg.run.global_batch == 8
    with pytest.raises(ValueError, match="optim.lr must be a number, got 'fast'"):
        TrainConfig.from_yaml(None, ["optim.lr=fast"])
