"""Sharded from-scratch initialisation (hf3d/parallel/init_weights.py) against stock `from_config`.

What is checked:
- `hf3d.parallelize(config_only_dir, pcfg, seed=s)` exported with `save_pretrained` equals
  `torch.manual_seed(s); AutoModelForCausalLM.from_config(config)` bit for bit (torch.equal, every
  tensor; a tied lm_head is not exported), for llama (tied), qwen2 (untied, q/k/v biases), qwen3
  (tied, q/k norms) and smollm3 (tied, NoPE and sliding-window layers) at tp=1 (dp=4), tp=2 (dp=2),
  pp=2 (dp=2) and tp=2 x pp=2, seeds 0 and 1; the two seeds give different weights; bf16 is the
  fp32 init cast to bf16; the caller's global RNG state is left as it was; the example model dir
  (config + tokenizer, no weights) loads and its export carries the tokenizer files.
- tp=3 (6 query / 3 KV heads) exports the same model as tp=1.
- memory: one tp=3 rank's peak RSS above its own baseline is <= 0.6x stock from_config's (measured
  by rank 3 of the 4-process world before anything else), each in a fresh process, on a 24-layer
  shape (benchmarks/bench_init_memory.py measures the SmolLM2-135M shape).

Spawning gloo processes costs seconds, so one spawn per world size runs every case of that size;
ranks write exports and measurements, and the parent compares them with stock.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import exported, tiny_config  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import hf3d  # noqa: E402
from hf3d.models import get_adapter  # noqa: E402
from hf3d.parallel.init_weights import has_weights  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "smollm3")
MESHES = {"tp1": dict(tp=1), "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2pp2": dict(tp=2, pp=2)}
SEEDS = (0, 1)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny-smollm"
TP3 = dict(num_attention_heads=6, num_key_value_heads=3)  # llama shape that takes tp=3
# 24 layers, 6/3 heads, tied, ~165 MiB fp32: big enough that the weights, not the ~10 MiB that
# building a mesh and two meta skeletons costs, decide the ratio
MEMORY = dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=24, vocab_size=2048, **TP3)
MEMORY_BOUND = 0.6
WATCHDOG_S = 300


# ------------------------------------------------------------------------------------------------
# Code run on every rank of a spawned world (module level: spawn pickles it by name)
# ------------------------------------------------------------------------------------------------
def _world4(dirs: dict, out: str) -> None:
    start_watchdog(WATCHDOG_S)
    res: dict = {}
    if dist.get_rank() == 3:  # first, in this fresh process: stock's memory (the others wait in parallelize)
        config = AutoConfig.from_pretrained(dirs["memory"])
        res["stock_peak"] = _peak_above_baseline(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    rng_before = torch.get_rng_state()
    for fam in FAMILIES:
        for mesh, kw in MESHES.items():
            for seed in SEEDS if mesh == "tp2pp2" else SEEDS[:1]:
                pm = hf3d.parallelize(dirs[fam], hf3d.ParallelConfig(**kw), seed=seed)
                pm.save_pretrained(Path(out) / f"{fam}-{mesh}-s{seed}")
    pm = hf3d.parallelize(dirs["qwen2"], hf3d.ParallelConfig(tp=2), seed=0, dtype=torch.bfloat16)
    pm.save_pretrained(Path(out) / "qwen2-tp2-s0-bf16")
    res["rng_untouched"] = torch.equal(rng_before, torch.get_rng_state())
    pm = hf3d.parallelize(dirs["example"], hf3d.ParallelConfig(tp=2, pp=2), seed=0)
    res["example_tokenizer_dir"] = str(pm.tokenizer_dir)
    pm.save_pretrained(Path(out) / "example-tp2pp2-s0")
    report(res, Path(out) / "results.pt")


def _peak_above_baseline(fn) -> int | None:
    """Peak RSS while fn() runs minus RSS before, in bytes (the kernel's peak is reset first)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    base = status("VmRSS")
    keep = fn()
    peak = status("VmHWM") - base
    del keep
    return peak


def _world3(dirs: dict, out: str) -> None:
    start_watchdog(WATCHDOG_S)
    # first, in a fresh process: memory of one tp=3 rank
    res = {"peak": _peak_above_baseline(lambda: hf3d.parallelize(dirs["memory"], hf3d.ParallelConfig(tp=3)))}
    for tp in (1, 3):
        pm = hf3d.parallelize(dirs["tp3"], hf3d.ParallelConfig(tp=tp), seed=5)
        pm.save_pretrained(Path(out) / f"tp3shape-tp{tp}")
    report(res, Path(out) / "results.pt")


# ------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------
def _stock(config, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd = AutoModelForCausalLM.from_config(config).state_dict()
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ from stock, e.g. {differ[:3]}"


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("config-only")
    configs = {f: tiny_config(f) for f in FAMILIES}
    configs.update(tp3=tiny_config("llama", **TP3), memory=tiny_config("llama", **MEMORY))
    for name, config in configs.items():
        config.save_pretrained(root / name)
    return {**{k: str(root / k) for k in configs}, "example": str(EXAMPLE)}


@pytest.fixture(scope="module")
def world4(config_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("init-world4")
    spawn(_world4, 4, config_dirs, str(out))
    return torch.load(out / "results.pt", weights_only=False), out


@pytest.fixture(scope="module")
def world3(config_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("init-world3")
    spawn(_world3, 3, config_dirs, str(out))
    return torch.load(out / "results.pt", weights_only=False), out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh", MESHES)
def test_equals_stock_from_config(world4, family, mesh):
    _, out = world4
    for seed in SEEDS if mesh == "tp2pp2" else SEEDS[:1]:
        want = _stock(tiny_config(family), seed)
        _assert_equal(exported(out / f"{family}-{mesh}-s{seed}"), want, f"{family} {mesh} seed {seed}")


@pytest.mark.parametrize("family", FAMILIES)
def test_seed_changes_every_random_tensor(world4, family):
    _, out = world4
    a, b = exported(out / f"{family}-tp2pp2-s0"), exported(out / f"{family}-tp2pp2-s1")
    for name in a:
        random = "proj.weight" in name or "embed" in name or name == "lm_head.weight"
        assert torch.equal(a[name], b[name]) != random, name  # norms (ones) and biases (zeros) do not change


def test_bf16_is_the_fp32_init_cast(world4):
    _, out = world4
    want = {k: v.to(torch.bfloat16) for k, v in _stock(tiny_config("qwen2"), 0).items()}
    _assert_equal(exported(out / "qwen2-tp2-s0-bf16"), want, "qwen2 tp2 bf16")


def test_global_rng_untouched(world4):
    results, _ = world4
    assert all(r["rng_untouched"] for r in results)


def test_example_dir_without_weights(world4):
    """The example model (config + tokenizer, no weights) loads; its export carries the tokenizer."""
    results, out = world4
    assert {r["example_tokenizer_dir"] for r in results} == {str(EXAMPLE)}
    export = out / "example-tp2pp2-s0"
    assert (export / "tokenizer.json").read_bytes() == (EXAMPLE / "tokenizer.json").read_bytes()
    _assert_equal(exported(export), _stock(AutoConfig.from_pretrained(EXAMPLE), 0), "example tp2pp2")


def test_tp3_equals_tp1(world3):
    _, out = world3
    get_adapter("llama").check_tp(tiny_config("llama", **TP3), 3)  # raises if tp=3 were not valid
    tp1 = exported(out / "tp3shape-tp1")
    _assert_equal(exported(out / "tp3shape-tp3"), tp1, "tp=3 vs tp=1")
    _assert_equal(tp1, _stock(tiny_config("llama", **TP3), 5), "tp=1 vs stock")


def test_memory_one_tp3_rank_vs_stock(world3, world4):
    results, stock = world3[0], world4[0][3]["stock_peak"]
    if stock is None or any(r["peak"] is None for r in results):
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    worst = max(r["peak"] for r in results)
    assert worst <= MEMORY_BOUND * stock, (
        f"worst tp=3 rank peaked {worst / 2**20:.1f} MiB above its baseline, stock from_config "
        f"{stock / 2**20:.1f} MiB: ratio {worst / stock:.2f} > {MEMORY_BOUND}"
    )


def test_only_a_directory_without_any_weights_starts_from_scratch(tmp_path):
    """A directory with weights hf3d cannot read (.bin) must not be silently re-initialised:
    parallelize then refuses it through SafetensorsSource's message. A training checkpoint
    (config.json, DCP files, rng_<rank>.pt) holds no HF weights: `hf3d train` initialises, then loads it."""
    tiny_config("llama").save_pretrained(tmp_path)
    for name in ("__0_0.distcp", "rng_0.pt", "extra.pt", "tokenizer.json"):
        (tmp_path / name).write_bytes(b"")
    assert not has_weights(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert has_weights(tmp_path)
