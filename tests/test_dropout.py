"""Dropout under the mesh (hf3d/parallel/rng.py): per-rank streams, stock's statistics, bit-exact resume.

The tiny models have attention_dropout 0 elsewhere; here it is on. One world of 2 processes at tp=2:
- resume: 4 steps straight == 2 steps, save, a fresh model and optimizer (seeded otherwise), load,
  2 steps, bit for bit (losses and weights); the same resume without restoring the RNG streams must
  differ (so the test can see a missing restore);
- masks: eager attention returns its weights after dropout, so the zeros are the mask. The two tp
  ranks' masks over their heads differ, the kept fraction is 1 - p within 5 standard deviations,
  and kept weights are the eval-mode weights / (1 - p), as stock's dropout;
- recompute: a step with full activation recompute equals one without, bit for bit (the recomputed
  forward draws the first forward's masks);
- dropout 0, and eval mode: no fork, no draw (the streams' states are untouched).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, make_model_dir  # noqa: E402
from reference import batches, oracle_adamw  # noqa: E402

import hf3d  # noqa: E402
from hf3d.checkpoint import load  # noqa: E402
from hf3d.parallel.rng import DropoutRNG, seed_streams  # noqa: E402

BATCH, SEQ, P = 4, 16, 0.3


def _opt(pm):
    return oracle_adamw(pm)


def _fresh(model_dir, seed: int, **pkw):
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=2, **pkw))
    seed_streams(pm, seed)
    return pm, _opt(pm)


def _train(pm, opt, data) -> list[float]:
    losses = []
    for ids, labels in data:
        losses.append(pm.train_step(ids, labels).item())
        opt.step()
        opt.zero_grad()
    return losses


def _params(pm) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in pm.unique_parameters()]


def _resume(dirs, out: str) -> dict:
    data, res = batches(4, BATCH, SEQ, VOCAB, seed=3), {}
    pm, opt = _fresh(dirs["dropout"], 0)
    res["straight"], straight_params = _train(pm, opt, data), _params(pm)
    pm, opt = _fresh(dirs["dropout"], 0)
    _train(pm, opt, data[:2])
    hf3d.save_checkpoint(f"{out}/step_2", pm, opt, step=2)
    for name, restore in (("resumed", load._restore_rng), ("not_restored", lambda *a: None)):
        pm, opt = _fresh(dirs["dropout"], 1)  # a new process seeds its streams: the checkpoint's must win
        load._restore_rng, saved = restore, load._restore_rng
        try:
            step = hf3d.load_checkpoint(f"{out}/step_2", pm, opt)
        finally:
            load._restore_rng = saved
        res[name] = _train(pm, opt, data[step:])
        res[f"{name}_params_equal"] = all(torch.equal(a, b) for a, b in zip(_params(pm), straight_params))
    return res


def _masks(dirs) -> dict:
    pm = hf3d.parallelize(dirs["eager"], hf3d.ParallelConfig(tp=2), attn_implementation="eager")
    seed_streams(pm, 0)
    attn = pm.hf_model.model.layers["0"].self_attn
    hidden = torch.randn(BATCH, 32, pm.config.hidden_size, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(32).expand(BATCH, 32)
    cos_sin = pm.hf_model.model.rotary_emb(hidden, position_ids=pos)
    with torch.no_grad():
        pm.eval()
        state = pm.dropout_rng.state()
        _, eval_weights = attn(hidden, cos_sin, attention_mask=None)  # no mask: every weight > 0
        eval_untouched = pm.dropout_rng.state() is state
        pm.train()
        _, weights = attn(hidden, cos_sin, attention_mask=None)  # [batch, heads on this rank, s, s]
    kept = weights != 0
    scaled = torch.allclose(weights[kept], (eval_weights / (1 - P))[kept], rtol=1e-6, atol=0)
    return dict(kept=kept, all_positive=bool((eval_weights > 0).all()), scaled=scaled, eval_untouched=eval_untouched)


def _recompute(dirs) -> dict:
    data, res = batches(2, BATCH, SEQ, VOCAB, seed=4), {}
    for name in ("none", "full"):
        pm, opt = _fresh(dirs["dropout"], 0, recompute=name)
        res[name] = (_train(pm, opt, data), _params(pm))
    return dict(
        losses_equal=res["none"][0] == res["full"][0],
        params_equal=all(torch.equal(a, b) for a, b in zip(res["none"][1], res["full"][1])),
    )


def _no_dropout(dirs) -> dict:
    pm, opt = _fresh(dirs["plain"], 0)
    stream, default = pm.dropout_rng.state(), torch.get_rng_state()
    _train(pm, opt, batches(1, BATCH, SEQ, VOCAB))
    return dict(
        stream_untouched=pm.dropout_rng.state() is stream, default_untouched=torch.equal(torch.get_rng_state(), default)
    )


def _world(dirs, out: str) -> None:
    start_watchdog(240)
    res = dict(resume=_resume(dirs, out), masks=_masks(dirs), recompute=_recompute(dirs), no_dropout=_no_dropout(dirs))
    report(res, f"{out}/res.pt")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout")
    dirs = {
        "dropout": make_model_dir(root / "dropout", "llama", attention_dropout=P),
        "eager": make_model_dir(root / "eager", "llama", attention_dropout=P),
        "plain": make_model_dir(root / "plain", "llama"),
    }
    spawn(_world, 2, dirs, str(root))
    return torch.load(root / "res.pt")


def test_a_resume_at_the_same_mesh_is_bit_for_bit_with_dropout(world):
    for rank in (0, 1):
        got = world[rank]["resume"]
        assert got["resumed"] == got["straight"][2:]  # NaN != NaN: a NaN fails
        assert got["resumed_params_equal"]
        # the same resume without the RNG streams restored draws other masks: this test would see it
        assert got["not_restored"] != got["straight"][2:] and not got["not_restored_params_equal"]


def test_tp_ranks_draw_their_own_masks_with_stock_statistics(world):
    masks = [world[rank]["masks"] for rank in (0, 1)]
    assert all(m["all_positive"] and m["scaled"] for m in masks)
    assert not torch.equal(masks[0]["kept"], masks[1]["kept"])  # identical masks on other heads: the bug
    kept = torch.cat([m["kept"] for m in masks], dim=1)  # [batch, all 6 heads, s, s]
    n = kept.numel()  # 4 * 6 * 32 * 32 = 24576 draws: sd of the kept fraction sqrt(p(1-p)/n) = 0.0029
    bound = 5 * (P * (1 - P) / n) ** 0.5
    assert abs(kept.float().mean().item() - (1 - P)) <= bound
    for rank in (0, 1):
        per_head = masks[rank]["kept"].float().mean(dim=(0, 2, 3))  # 4096 draws each: sd 0.0072
        assert ((per_head - (1 - P)).abs() <= 5 * (P * (1 - P) / 4096) ** 0.5).all()


def test_recompute_replays_the_first_forwards_masks(world):
    assert world[0]["recompute"] == dict(losses_equal=True, params_equal=True)


def test_no_dropout_and_eval_mode_draw_nothing(world):
    for rank in (0, 1):
        assert world[rank]["no_dropout"] == dict(stream_untouched=True, default_untouched=True)
        assert world[rank]["masks"]["eval_untouched"]


def test_streams_differ_over_every_mesh_coordinate():
    """The tensor-parallel stream differs over pp, dp, cp and tp; the shared one (torch's default generator)
    is the same on the tp ranks of one (pp, dp, cp) coordinate and differs over pp, dp and cp."""
    coords = [(pp, dp, cp, tp) for pp in (0, 1) for dp in (0, 1) for cp in (0, 1) for tp in (0, 1)]
    tp_states, shared = {}, {}
    with torch.random.fork_rng(devices=[]):
        for c in coords:
            rng = DropoutRNG(c, torch.device("cpu"))
            seed_streams(types.SimpleNamespace(pp_rank=c[0], dp_rank=c[1], cp_rank=c[2], dropout_rng=rng), 7)
            tp_states[c], shared[c] = bytes(rng.state().numpy()), torch.initial_seed()
    assert len(set(tp_states.values())) == len(coords)
    assert all(shared[(pp, dp, cp, 0)] == shared[(pp, dp, cp, 1)] for pp, dp, cp, _ in coords)
    assert len(set(shared.values())) == 8


def test_a_stream_seeded_on_first_use_records_its_seed():
    """A stream that nothing seeded takes `torch.initial_seed()` when first used; a checkpoint taken before
    any use records that seed, not None."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        saved = DropoutRNG((0, 0, 0, 0), torch.device("cpu")).state_dict()
        again = DropoutRNG((0, 0, 0, 0), torch.device("cpu"))
        again.manual_seed(1234)
    assert saved["seed"] == 1234
    assert torch.equal(saved["state"], again.state())
