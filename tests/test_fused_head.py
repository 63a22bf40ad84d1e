"""The fused output head (`VocabParallelLMHead.fused_loss_terms`, used by train_step at pp=1) against
the plain math it replaces: `F.linear` over the whole vocabulary, then `F.cross_entropy` and the z-loss
term, on one process, in fp64-free fp32.

Cases cover what the fused head does differently: several chunks of tokens, ignored targets, a vocab
padded to a multiple of tp (padded columns must take no probability), tp=2 with and without sequence
parallelism (the hidden states' gradient is a partial sum reduced by copy_to_tp / gather_seq), the
z-loss gradient, and an upstream gradient other than 1. Checked: the objective and its parts, the
gradient of the hidden states and of the weight, each as the largest error relative to the largest
reference value. Measured here: at most 6e-7 (fp32); the tolerance is 1e-5. A wrong sign of the
z-loss term, a padded column left in the softmax or a missing reduction each give errors above 1e-3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asserts import assert_close  # noqa: E402
from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB as VOCAB_MODEL  # noqa: E402

from hf3d.parallel import tensor as tp_mod  # noqa: E402
from hf3d.parallel.tensor import IGNORE_INDEX, VocabParallelLMHead  # noqa: E402

TOL = 1e-5
CHUNK_RTOL, CHUNK_ATOL = 6e-6, 2e-6  # training at two chunk sizes: measured 4.1e-7 relative, 1.2e-7 apart
HIDDEN, VOCAB = 24, 101  # 101 over tp=2: 51 columns each, the last one padding
BATCH, SEQ = 2, 40


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB + 1, HIDDEN, generator=g) * 0.5  # padded row included
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[0, ::3] = IGNORE_INDEX
    upstream = torch.tensor(0.75)
    return weight, x, targets, upstream


def _reference(weight, x, targets, upstream, z_loss):
    """Plain autograd over the unpadded vocabulary: what the fused head must equal."""
    w = weight[:VOCAB].clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    logits = F.linear(xr, w).flatten(0, 1)
    t = targets.flatten()
    n = (t != IGNORE_INDEX).sum().float()
    ce = F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum") / n
    lse = torch.logsumexp(logits, dim=-1).masked_fill(t == IGNORE_INDEX, 0.0)
    z = z_loss * lse.square().sum() / n
    ((ce + z) * upstream).backward()
    grad_w = torch.cat([w.grad, torch.zeros(1, HIDDEN)])  # the padded row gets no gradient
    return {"objective": (ce + z).detach(), "ce": ce.detach(), "z": z.detach(), "grad_x": xr.grad, "grad_w": grad_w}


def _fused(weight, x, targets, upstream, z_loss, *, group=None, rank=0, world=1, sp=False):
    num_local = weight.shape[0] // world
    head = VocabParallelLMHead(
        num_local, HIDDEN, vocab_start=rank * num_local, vocab_size=VOCAB, group=group, sequence_parallel=sp
    )
    head.weight = torch.nn.Parameter(weight[rank * num_local : (rank + 1) * num_local].clone())
    s_local = SEQ // world if sp else SEQ
    xr = x[:, rank * s_local : (rank + 1) * s_local].clone().requires_grad_(True) if sp else x.clone()
    xr.requires_grad_(True)
    n = (targets != IGNORE_INDEX).sum().float()
    objective, ce, z = head.fused_loss_terms(xr, targets, n, z_loss=z_loss)
    (objective * upstream).backward()
    return {"objective": objective.detach(), "ce": ce, "z": z, "grad_x": xr.grad, "grad_w": head.weight.grad}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _compare(got: dict, ref: dict, *, rank=0, world=1, sp=False) -> dict:
    num_local = ref["grad_w"].shape[0] // world
    s_local = SEQ // world
    ref_x = ref["grad_x"][:, rank * s_local : (rank + 1) * s_local] if sp else ref["grad_x"]
    return {
        "objective": _err(got["objective"], ref["objective"]),
        "ce": _err(got["ce"], ref["ce"]),
        "z": _err(got["z"], ref["z"]) if ref["z"].item() else got["z"].abs().item(),
        "grad_x": _err(got["grad_x"], ref_x),
        "grad_w": _err(got["grad_w"], ref["grad_w"][rank * num_local : (rank + 1) * num_local]),
    }


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("chunk_rows", [7, 256])
def test_one_rank_matches_the_plain_head(monkeypatch, z_loss, chunk_rows):
    monkeypatch.setitem(tp_mod.LOSS_CHUNK_MIN_ROWS, "cpu", chunk_rows)
    monkeypatch.setattr(tp_mod, "LOSS_CHUNK_ELEMENTS", 1)  # chunks of exactly chunk_rows tokens
    weight, x, targets, upstream = _case(0)
    weight = weight[:VOCAB]  # one rank: no padding
    ref = _reference(torch.cat([weight, torch.zeros(1, HIDDEN)]), x, targets, upstream, z_loss)
    got = _fused(weight, x, targets, upstream, z_loss)
    got["grad_w"] = torch.cat([got["grad_w"], torch.zeros(1, HIDDEN)])
    errors = _compare(got, ref)
    assert_close(errors, dict.fromkeys(errors, 0.0), atol=TOL, what="relative error of")


def _tp2(out: str) -> None:
    start_watchdog(120)
    tp_mod.LOSS_CHUNK_MIN_ROWS["cpu"], tp_mod.LOSS_CHUNK_ELEMENTS = 16, 1  # 5 chunks of 16 tokens
    rank = dist.get_rank()
    res = {}
    for sp in (False, True):
        for z_loss in (0.0, 1e-2):
            weight, x, targets, upstream = _case(1)
            ref = _reference(weight, x, targets, upstream, z_loss)
            got = _fused(weight, x, targets, upstream, z_loss, group=dist.group.WORLD, rank=rank, world=2, sp=sp)
            res[(sp, z_loss)] = _compare(got, ref, rank=rank, world=2, sp=sp)
    report(res, out)


def test_tp2_matches_the_plain_head(tmp_path):
    out = tmp_path / "tp2.pt"
    spawn(_tp2, 2, str(out))
    for rank, res in enumerate(torch.load(out)):
        for case, errors in res.items():
            assert_close(errors, dict.fromkeys(errors, 0.0), atol=TOL, what=f"rank {rank} {case}: relative error of")


# -- the chunk size each device takes, in training, against stock --------------------------------------
CHUNKED_BATCH, CHUNKED_SEQ, CHUNKED_STEPS = 20, 128, 3  # 2560 tokens a step: 10 chunks of 256 rows, 2 of 2048


def _train_at_chunk_sizes(model_dir: str, out: str) -> None:
    from reference import batches, hf3d_run

    import hf3d

    start_watchdog(180)
    res = {}
    data = batches(CHUNKED_STEPS, CHUNKED_BATCH, CHUNKED_SEQ, VOCAB_MODEL)
    tp_mod.LOSS_CHUNK_ELEMENTS = 1  # chunks of exactly the device's rows (this vocabulary is tiny)
    for device, rows in dict(tp_mod.LOSS_CHUNK_MIN_ROWS).items():
        tp_mod.LOSS_CHUNK_MIN_ROWS["cpu"] = rows  # this CPU runs the head as `device` would
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
        losses, norms, _ = hf3d_run(pm, data, slice(None))
        res[device] = (rows, losses, norms, {n: p.detach().clone() for n, p in pm.named_parameters()})
    report(res, out)


def test_each_devices_chunk_size_trains_as_stock(tmp_path):
    """The fused head at the CPU's 256 rows per chunk and at the GPU's 2048 (more than one chunk each), three
    AdamW steps against stock transformers: losses and grad norms within float noise, and the two runs' weights
    within it of each other. Measured: losses 4.1e-7 and grad norms 1.8e-7 relative, weights 1.2e-7 apart."""
    from models import make_model_dir
    from reference import reference_run

    model_dir = make_model_dir(tmp_path / "llama", "llama")
    spawn(_train_at_chunk_sizes, 1, str(model_dir), str(tmp_path / "res.pt"))
    res = torch.load(tmp_path / "res.pt")[0]
    assert [rows for rows, *_ in res.values()] == [256, 2048]
    ref_losses, ref_norms, _ = reference_run(model_dir, batches_for_stock())
    for device, (rows, losses, norms, _) in res.items():
        assert_close(losses, ref_losses, rtol=CHUNK_RTOL, what=f"{device} ({rows} rows) loss")
        assert_close(norms, ref_norms, rtol=CHUNK_RTOL, what=f"{device} ({rows} rows) grad norm")
    cpu, cuda = res["cpu"][3], res["cuda"][3]
    assert_close({n: (cpu[n] - cuda[n]).abs().max().item() for n in cpu}, dict.fromkeys(cpu, 0.0), atol=CHUNK_ATOL)


def batches_for_stock():
    from reference import batches

    return batches(CHUNKED_STEPS, CHUNKED_BATCH, CHUNKED_SEQ, VOCAB_MODEL)
