"""Selective activation recompute (`recompute="selective"`, hf3d/parallel/stage.py) and activation offload.

One spawn of 2 gloo processes, fp32, the tiny 2-layer llama of tests/models.py. Each job trains STEPS AdamW
steps on the same batches with recompute "none" and "selective", and the parent asserts:
- selective equals stock transformers + torch AdamW (reference.py): per-step losses and exported weights;
- selective equals the same mesh without recompute, bit for bit as full recompute does (RECOMPUTE_ATOL);
  at tp2, tp2 with sequence parallelism, pp2 (1f1b) and cp2;
- it is selective: counted at the dispatcher over one tp2 step, selective runs the matmuls and the attention
  kernel as often as no recompute (their outputs kept) and the element-wise ops and the tp all-reduces as often
  as full recompute (run again in backward);
- with attention dropout, selective equals no recompute bit for bit: the recomputed forward draws the first
  forward's masks (tests/test_dropout.py checks the same of full recompute);
- activation_offload on a CPU changes nothing: the same losses, bit for bit.
Without processes: the policy's choice per op, `recomputes` / `recompute_kind`, and the refusals.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from asserts import assert_close
from dist import report, spawn, start_watchdog
from models import VOCAB, exported, make_model_dir
from reference import batches, dp_rows, hf3d_run, reference_run
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import hf3d
from hf3d.parallel.rng import seed_streams
from hf3d.parallel.stage import selective_policy

STEPS, BATCH, SEQ, P = 3, 4, 16, 0.3
LOSS_RTOL = 1e-6  # against stock, per-step loss, relative; measured 1.0e-7 (every mesh)
WEIGHT_ATOL = 4e-6  # against stock, max |Δw| after 3 AdamW steps (eps at reference.EPS); measured 2.6e-7 (tp2, cp2)
RECOMPUTE_ATOL = 1e-7  # selective vs none on the same mesh, losses and weights; measured 0 (bit-identical)
JOBS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2, pp_schedule="1f1b", num_microbatches=2),
    "cp2": dict(cp=2),
}
RECOMPUTES = ("none", "selective")
# aten / c10d ops counted over one tp2 train_step: kept under selective, and recomputed under selective
KEPT = ("aten.mm", "aten._scaled_dot_product_flash_attention_for_cpu")
RECOMPUTED = ("aten.rsqrt", "aten.silu", "aten.mul", "c10d.allreduce_")
WATCHDOG_S = 300


# ------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------
class _OpCounter(TorchDispatchMode):
    """How many times each op runs (by its name without the overload)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _train(path: str, out: Path, **pcfg_kw) -> list[float]:
    pm = hf3d.parallelize(path, hf3d.ParallelConfig(**pcfg_kw))
    losses, _, _ = hf3d_run(pm, batches(STEPS, BATCH, SEQ, VOCAB), dp_rows(pm, BATCH))
    pm.save_pretrained(out)
    return losses


def _op_counts(path: str) -> dict:
    counts = {}
    for recompute in ("none", "full", "selective"):
        pm = hf3d.parallelize(path, hf3d.ParallelConfig(tp=2, recompute=recompute))
        ids, labels = batches(1, BATCH, SEQ, VOCAB)[0]
        with _OpCounter() as counter:
            pm.train_step(ids, labels)
        counts[recompute] = {op: counter.counts[op] for op in KEPT + RECOMPUTED}
    return counts


def _dropout(path: str) -> dict:
    """tp2 with attention dropout: losses and parameters of 2 steps per recompute, the streams seeded alike."""
    res = {}
    for recompute in RECOMPUTES:
        pm = hf3d.parallelize(path, hf3d.ParallelConfig(tp=2, recompute=recompute))
        seed_streams(pm, 0)
        losses, _, _ = hf3d_run(pm, batches(2, BATCH, SEQ, VOCAB, seed=4), slice(None))
        res[recompute] = (losses, [p.detach().clone() for _, p in pm.unique_parameters()])
    return res


def _world(dirs: dict, out: str) -> None:
    start_watchdog(WATCHDOG_S)
    out, res = Path(out), {}
    for name, kw in JOBS.items():
        for recompute in RECOMPUTES:
            res[name, recompute] = _train(dirs["plain"], out / f"{name}-{recompute}", recompute=recompute, **kw)
    res["offload"] = _train(dirs["plain"], out / "offload", tp=2, recompute="selective", activation_offload=True)
    res["op_counts"] = _op_counts(dirs["plain"])
    res["dropout"] = _dropout(dirs["dropout"])
    report(res, out / "results.pt")


# ------------------------------------------------------------------------------------------------
# parent side
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute")
    dirs = {
        "plain": str(make_model_dir(root / "plain", "llama")),
        "dropout": str(make_model_dir(root / "dropout", "llama", attention_dropout=P)),
    }
    spawn(_world, 2, dirs, str(root))
    return torch.load(root / "results.pt", weights_only=False), root, dirs


@pytest.fixture(scope="module")
def stock(world):
    _, _, dirs = world
    losses, _, state = reference_run(dirs["plain"], batches(STEPS, BATCH, SEQ, VOCAB))
    return losses, state


@pytest.mark.parametrize("name", sorted(JOBS))
def test_selective_equals_stock_and_no_recompute(world, stock, name):
    results, root, _ = world
    stock_losses, stock_state = stock
    none = exported(root / f"{name}-none")
    selective = exported(root / f"{name}-selective")
    for r in results:
        assert_close(r[name, "selective"], stock_losses, rtol=LOSS_RTOL, what=f"{name} selective loss vs stock")
        assert_close(r[name, "selective"], r[name, "none"], atol=RECOMPUTE_ATOL, what=f"{name} loss vs none")
    stock_saved = {k: stock_state[k] for k in selective}  # the tied lm_head is not saved, as stock leaves it out
    assert_close(selective, stock_saved, atol=WEIGHT_ATOL, what=f"{name} selective weights vs stock")
    assert_close(selective, none, atol=RECOMPUTE_ATOL, what=f"{name} selective weights vs none")


def test_selective_keeps_the_matmuls_and_recomputes_the_rest(world):
    counts = world[0][0]["op_counts"]
    for op in KEPT:  # run once forward and once backward's own way: never again
        assert counts["selective"][op] == counts["none"][op] < counts["full"][op], (op, counts)
    for op in RECOMPUTED:  # the element-wise ops and the tp all-reduces run again, as under full recompute
        assert counts["none"][op] < counts["selective"][op] == counts["full"][op], (op, counts)


def test_selective_replays_the_first_forwards_dropout_masks(world):
    for r in world[0]:
        got, want = r["dropout"]["selective"], r["dropout"]["none"]
        assert_close(got[0], want[0], atol=RECOMPUTE_ATOL, what="loss with dropout, selective vs none")
        for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
            assert_close(a, b, atol=RECOMPUTE_ATOL, what=f"parameter {i} with dropout, selective vs none")


def test_activation_offload_changes_nothing_on_cpu(world):
    results, root, _ = world
    for r in results:
        assert r["offload"] == r["tp2", "selective"]
    assert_close(exported(root / "offload"), exported(root / "tp2-selective"), atol=RECOMPUTE_ATOL, what="weights")


# ------------------------------------------------------------------------------------------------
# no processes
# ------------------------------------------------------------------------------------------------
def test_the_policy_keeps_matmul_and_attention_outputs_only():
    aten = torch.ops.aten
    kept = (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    )
    for op in kept:
        assert selective_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    # element-wise ops, softmax, a matmul into a given buffer (inductor's mm out=), an in-place collective
    recomputed = (
        aten.mul.Tensor,
        aten.rsqrt.default,
        aten._softmax.default,
        aten.mm.out,
        torch.ops.c10d.allreduce_.default,
    )
    for op in recomputed:
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op
