"""hf3d/utils/compat.py, the differences between torch releases, checked on whichever torch runs the suite (2.11, 2.13).

Without processes: the collectives' names are this torch's (the newer where both exist); the wrappers look the
function up on torch.distributed at each call and pass the arguments through (op= only when given), so a swapped
`dist.<name>` sees hf3d's calls; `all_reduce_copy` leaves its input alone.
On 2 gloo processes:
- the values of the all-gather and the reduce-scatter, blocking and async, with no deprecation warning;
- compiled with aot_eager against eager, with dynamo's counters (no graph break, one graph): the sequence-parallel
  pair of hf3d.parallel.tensor (all-gather forward / reduce-scatter backward, and the reverse), and an
  autograd.Function whose forward is `all_reduce_copy` and whose backward is the identity (hf3d's _ReduceFromTP):
  outputs and input gradients equal. The same function with the in-place all-reduce of a clone (what _ReduceFromTP
  ran before) is held to that on torch 2.13+ only: 2.11 compiles it with a zero input gradient (measured).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402

from hf3d.parallel.tensor import _ReduceFromTP  # noqa: E402
from hf3d.utils import compat  # noqa: E402

WATCHDOG_S = 180


def test_names_are_this_torchs():
    newer = hasattr(dist, "all_gather_single")
    assert compat.ALL_GATHER == ("all_gather_single" if newer else "all_gather_into_tensor")
    assert compat.REDUCE_SCATTER == (
        "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    )
    assert callable(getattr(dist, compat.ALL_GATHER)) and callable(getattr(dist, compat.REDUCE_SCATTER))
    assert compat.BEFORE_2_13 == (tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13))


def test_zero3_is_refused_before_2_13_only():
    import pytest

    for stage in (0, 1, 2):
        compat.check_zero_stage(stage)
    if compat.BEFORE_2_13:
        with pytest.raises(ValueError, match="zero_stage=3 needs torch 2.13 or later"):
            compat.check_zero_stage(3)
    else:
        compat.check_zero_stage(3)


def test_calls_reach_torch_at_call_time(monkeypatch):
    calls = []

    def recorder(name):
        return lambda *a, **k: calls.append((name, a, k)) or name

    monkeypatch.setattr(dist, compat.ALL_GATHER, recorder("ag"))
    monkeypatch.setattr(dist, compat.REDUCE_SCATTER, recorder("rs"))
    monkeypatch.setattr(dist, "all_reduce", recorder("ar"))
    out, inp, group = torch.empty(4), torch.ones(2), object()
    assert compat.all_gather_single(out, inp, group=group, async_op=True) == "ag"
    assert compat.reduce_scatter_single(inp, out, group=group) == "rs"
    assert compat.reduce_scatter_single(inp, out, op=dist.ReduceOp.MAX) == "rs"
    x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    summed = compat.all_reduce_copy(x, group)
    assert calls[:3] == [
        ("ag", (out, inp), dict(group=group, async_op=True)),
        ("rs", (inp, out), dict(group=group, async_op=False)),  # no op=: torch's default
        ("rs", (inp, out), dict(op=dist.ReduceOp.MAX, group=None, async_op=False)),
    ]
    (name, (buf,), kw), *rest = calls[3:]
    assert (name, kw, rest) == ("ar", dict(group=group), [])
    assert buf is summed and summed.is_contiguous() and torch.equal(summed, x)
    assert summed.data_ptr() != x.data_ptr()


# ------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------
def _collectives() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = x.new_empty(2 * world, 3)
        compat.all_gather_single(gathered, x)
        gathered_async = x.new_empty(2 * world, 3)
        compat.all_gather_single(gathered_async, x, async_op=True).wait()
        full = torch.arange(4.0 * world).reshape(2 * world, 2) * (rank + 1)
        summed = full.new_empty(2, 2)
        compat.reduce_scatter_single(summed, full)
        summed_async = full.new_empty(2, 2)
        compat.reduce_scatter_single(summed_async, full, async_op=True).wait()
        maxed = full.new_empty(2, 2)
        compat.reduce_scatter_single(maxed, full, op=dist.ReduceOp.MAX)
        reduced = compat.all_reduce_copy(x, dist.group.WORLD)
    return dict(
        gathered=gathered,
        gathered_async=gathered_async,
        summed=summed,
        summed_async=summed_async,
        maxed=maxed,
        reduced=reduced,
        x_after=x,
        warnings=[f"{w.category.__name__}: {w.message}" for w in caught],
    )


def _compiled_pair(fn) -> dict:
    """fn(x, group) eager, then compiled with aot_eager: output, input gradient, dynamo's counters."""
    from torch._dynamo.utils import counters

    def run(f):
        torch.manual_seed(dist.get_rank())
        x = torch.randn(2, 4, 3, requires_grad=True)  # [batch, seq, hidden], seq split over the 2 ranks
        out = f(x, dist.group.WORLD)
        out.square().sum().backward()
        return out.detach(), x.grad

    eager = run(fn)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(torch.compile(fn, backend="aot_eager"))
    return dict(
        eager=eager,
        compiled=compiled,
        breaks=sum(counters["graph_break"].values()),
        graphs=counters["stats"]["unique_graphs"],
    )


def gather_then_scatter(x, group):
    """forward all-gather then reduce-scatter; backward all-gather then reduce-scatter: 2 * world * x."""
    from hf3d.parallel.tensor import gather_seq, reduce_scatter_seq

    return reduce_scatter_seq(gather_seq(x, group) * 2.0, group)


def scatter_then_gather(x, group):
    """forward reduce-scatter then all-gather (and the reverse in backward)."""
    from hf3d.parallel.tensor import gather_seq, reduce_scatter_seq

    return gather_seq(reduce_scatter_seq(x * 3.0, group).sin(), group)


class _SumInPlace(torch.autograd.Function):
    """hf3d.parallel.tensor's _ReduceFromTP (forward all_reduce_copy, backward the identity) with the in-place
    all-reduce of a clone that torch 2.11 compiles wrong."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def summed_copy(x, group):
    return _ReduceFromTP.apply(x * 2.0, group).cos()


def summed_in_place(x, group):
    return _SumInPlace.apply(x * 2.0, group).cos()


def _world2(out: str) -> None:
    start_watchdog(WATCHDOG_S)
    res = dict(
        collectives=_collectives(),
        gather_then_scatter=_compiled_pair(gather_then_scatter),
        scatter_then_gather=_compiled_pair(scatter_then_gather),
        summed_copy=_compiled_pair(summed_copy),
        summed_in_place=_compiled_pair(summed_in_place),
    )
    report(res, Path(out) / "results.pt")


# ------------------------------------------------------------------------------------------------
# parent side
# ------------------------------------------------------------------------------------------------
def test_on_two_ranks(tmp_path):
    spawn(_world2, 2, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert len(results) == 2
    world = 2
    xs = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]
    fulls = [torch.arange(4.0 * world).reshape(2 * world, 2) * (r + 1) for r in range(world)]
    for rank, res in enumerate(results):
        c = res["collectives"]
        assert torch.equal(c["gathered"], torch.cat(xs)) and torch.equal(c["gathered_async"], torch.cat(xs))
        want = sum(fulls)[2 * rank : 2 * rank + 2]
        assert torch.equal(c["summed"], want) and torch.equal(c["summed_async"], want)
        assert torch.equal(c["maxed"], torch.maximum(*fulls)[2 * rank : 2 * rank + 2])
        assert torch.equal(c["reduced"], sum(xs)) and torch.equal(c["x_after"], xs[rank])
        assert c["warnings"] == [], f"rank {rank}: {c['warnings']}"

        torch.manual_seed(rank)
        x = torch.randn(2, 4, 3)
        out, grad = res["gather_then_scatter"]["eager"]
        torch.testing.assert_close(out, 2.0 * world * x, msg="gather then reduce-scatter, eager")
        torch.testing.assert_close(grad, (2.0 * world) ** 2 * 2 * x, msg="its gradient, eager")
        for name in ("gather_then_scatter", "scatter_then_gather", "summed_copy", "summed_in_place"):
            r = res[name]
            assert r["breaks"] == 0, f"{name}: {r['breaks']} graph break(s) under compile"
            assert r["graphs"] == 1, f"{name}: {r['graphs']} dynamo graph(s)"
            torch.testing.assert_close(r["compiled"][0], r["eager"][0], msg=f"{name} output, compiled vs eager")
            if name == "summed_in_place" and compat.BEFORE_2_13:
                continue  # torch 2.11 compiles it with a zero input gradient, what all_reduce_copy avoids
            torch.testing.assert_close(r["compiled"][1], r["eager"][1], msg=f"{name} input grad, compiled vs eager")
        assert torch.count_nonzero(res["summed_copy"]["eager"][1]) > 0
