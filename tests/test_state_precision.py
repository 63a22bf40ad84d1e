"""Lower-precision optimizer states (hf3d/optim/precision.py): bf16 moments for AdamW and Muon, torchao's 8-bit AdamW.

At dp2 (ZeRO-1) each option trains two steps, saves, trains two more; a fresh model at tp2 loads the checkpoint and
trains the same two: the resumed losses equal the continued ones (bf16 states go through the checkpoint's fp32 and
back unchanged; torchao's 8-bit states are quantised again from their fp32 values). The state's bytes per rank are
the arithmetic of the option over this rank's fragments, and training stays close to fp32 states.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asserts import assert_close  # noqa: E402
from dist import spawn_world, start_watchdog  # noqa: E402
from models import VOCAB, make_model_dir  # noqa: E402
from reference import CLIP, batches, dp_rows, train_on  # noqa: E402

import hf3d  # noqa: E402

CASES = {  # name: (optimizer class name, state precision)
    "adamw-fp32": ("AdamW", "fp32"),
    "adamw-bf16": ("AdamW", "bf16"),
    "adamw-8bit": ("AdamW", "8bit"),
    "muon-fp32": ("Muon", "fp32"),
    "muon-bf16": ("Muon", "bf16"),
}
KWARGS = {"AdamW": dict(lr=2e-3, weight_decay=0.1), "Muon": dict(lr=0.01, weight_decay=0.1, adamw=dict(lr=2e-3))}
# measured (gloo, 2-core CPU; the resume runs at tp2, the continued run at dp2, so another mesh's float noise is in
# both): fp32 2.1e-7, bf16 0 (AdamW) and 1.3e-6 (Muon: its bf16 Newton-Schulz), 8-bit 3.1e-7 relative (the moments
# quantised again from their fp32 values); bf16 / 8-bit states against fp32 states over the 4 steps: 4.2e-6 / 7.2e-7
RESUME_RTOL = {"fp32": 3e-6, "bf16": 2e-5, "8bit": 5e-6}
AGAINST_FP32_RTOL = 6e-5


def _build(pm, cls_name: str, precision: str):
    cls = getattr(torch.optim, cls_name)
    return hf3d.build_optimizer(pm, cls, max_grad_norm=CLIP, state_precision=precision, **KWARGS[cls_name])


def _eight_bit_bytes(opt) -> int:
    """torchao's rule: fragments of at least 4096 elements (a multiple of its 256-element block) hold uint8 codes, an
    fp32 scale per block and a 256-entry fp32 code map per state; smaller ones fp32 state."""
    total = 0
    for _, m, _, _ in opt._masters:
        n = m.numel()
        total += 2 * (n + n // 256 * 4 + 256 * 4) if n >= 4096 and n % 256 == 0 else 2 * n * 4
    return total


def _case(path, cls_name, precision, out) -> dict:
    data = batches(4, 8, 16, VOCAB)
    pm = hf3d.parallelize(path, hf3d.ParallelConfig())
    opt = _build(pm, cls_name, precision)
    first = train_on(pm, opt, data[:2], dp_rows(pm, 8))[0]
    report = opt.memory_report()
    hf3d.save_checkpoint(f"{out}/ckpt", pm, opt, step=2)
    continued = train_on(pm, opt, data[2:], dp_rows(pm, 8))[0]
    res = dict(first=first, continued=continued, state=report["optimizer_state"])
    if precision == "8bit":
        res["arithmetic"] = _eight_bit_bytes(opt)
    pm2 = hf3d.parallelize(path, hf3d.ParallelConfig(tp=2))
    opt2 = _build(pm2, cls_name, precision)
    hf3d.load_checkpoint(f"{out}/ckpt", pm2, opt2)
    res["resumed"] = train_on(pm2, opt2, data[2:], dp_rows(pm2, 8))[0]
    return res


def _worker(world: int, path: str, out: str) -> None:
    start_watchdog(600)
    res = {name: _case(path, c, p, f"{out}/{name}") for name, (c, p) in CASES.items() if _available(p)}
    torch.save(res, f"{out}/rank{torch.distributed.get_rank()}.pt")


def _available(precision: str) -> bool:
    import importlib.util

    return precision != "8bit" or importlib.util.find_spec("torchao") is not None


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    path = str(make_model_dir(tmp_path_factory.mktemp("precision-model") / "llama", "llama"))
    return spawn_world(_worker, 2, tmp_path_factory.mktemp("precision"), path)


@pytest.mark.parametrize("name", [n for n, (_, p) in CASES.items() if _available(p)])
def test_a_resume_at_another_mesh_keeps_the_states(world, name):
    res = world[0][name]
    worst = assert_close(res["resumed"], res["continued"], rtol=RESUME_RTOL[CASES[name][1]], what=f"{name} resumed")
    print(f"{name}: resumed against continued {worst:.2g}")


@pytest.mark.parametrize("cls_name", ["AdamW", "Muon"])
def test_bf16_states_hold_half_the_bytes_and_train_alike(world, cls_name):
    for rank in (0, 1):
        fp32, bf16 = world[rank][f"{cls_name.lower()}-fp32"], world[rank][f"{cls_name.lower()}-bf16"]
        assert bf16["state"] * 2 == fp32["state"], (rank, bf16["state"], fp32["state"])
        got, want = bf16["first"] + bf16["continued"], fp32["first"] + fp32["continued"]
        worst = assert_close(got, want, rtol=AGAINST_FP32_RTOL)
        print(f"{cls_name} bf16 against fp32 states: {worst:.2g}")


def test_eight_bit_states_are_torchaos_arithmetic(world):
    if "adamw-8bit" not in world[0]:
        pytest.skip("torchao is not installed")
    for rank in (0, 1):
        res, fp32 = world[rank]["adamw-8bit"], world[rank]["adamw-fp32"]
        assert res["state"] == res["arithmetic"] < fp32["state"]
        worst = assert_close(res["first"] + res["continued"], fp32["first"] + fp32["continued"], rtol=AGAINST_FP32_RTOL)
        print(f"8-bit against fp32 states: {worst:.2g}")


@pytest.mark.parametrize(
    ("cls", "precision", "words"),
    [(torch.optim.Muon, "8bit", "Muon has no 8-bit state"), (torch.optim.AdamW, "fp16", "must be one of")],
)
def test_a_precision_the_optimizer_cannot_take_is_refused(cls, precision, words):
    from hf3d.optim import precision as p

    with pytest.raises(ValueError, match=words):
        p.check(precision, cls, muon=cls is torch.optim.Muon)
