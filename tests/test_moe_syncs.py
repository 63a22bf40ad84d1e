"""Host syncs inside MoE layers, counted: none at ep=1, at ep>1 only the all-to-all's split sizes.

On a GPU a host sync stalls the CPU until every queued kernel has run. This test counts, on CPU, what
would sync there, in every MoE layer's forward and backward of a whole hf3d train_step (stock's
load-balancing loss on, so the router statistics' path runs too), under a TorchDispatchMode that sees
each aten op:

- host reads: `aten._local_scalar_dense` (what .item(), int(t), float(t) and `if t:` become), `aten.equal`,
  and `Tensor.tolist` / `Tensor.numpy`, which read a CPU tensor's memory without any aten op and are
  wrapped for the run;
- ops whose output size depends on the data: nonzero, bincount, unique, masked_select, histc, a boolean
  mask as an index, repeat_interleave without its output_size.

A MoE layer's forward is what runs between its module's forward pre-hook and hook; its backward is what
runs while the autograd engine evaluates a node made during one of those forwards (sequence numbers).
Sanity counts (the grouped GEMMs seen in both phases) show that the attribution sees the layers' ops.

Expected, from hf3d/parallel/expert.py's Dispatch: at ep=1 nothing; at ep>1 one `tolist` of the [2, ep]
rows to send to and receive from each rank per MoE layer forward, none in backward (_AllToAll's backward
swaps the same lists). So per rank and step: MoE layers x micro-batches reads.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, make_model_dir  # noqa: E402
from reference import dp_rows  # noqa: E402

import hf3d  # noqa: E402

BATCH, SEQ = 4, 8
# name: (family, ParallelConfig keywords, parallelize keywords, MoE layer forwards per rank and step, host
# reads expected in them); qwen3-moe has 2 MoE layers of 2, qwen2-moe 3 of 4 (layer 1 dense, tests/models.py).
# The reads: none at ep=1; at ep=2 one per MoE layer forward (Dispatch's split sizes), so layers x micro-batches
CASES_1 = {
    "qwen3-moe/ep1": ("qwen3-moe", {}, {}, 2, 0),
    "qwen3-moe/ep1-bias": ("qwen3-moe", {}, {"moe_load_balance": "bias"}, 2, 0),
    "qwen2-moe/ep1": ("qwen2-moe", {}, {}, 3, 0),
}
CASES_2 = {
    "qwen3-moe/tp2-sp-ep1": ("qwen3-moe", dict(tp=2, sequence_parallel=True), {}, 2, 0),
    "qwen3-moe/dp2-ep2-mb2": ("qwen3-moe", dict(dp=2, ep=2, num_microbatches=2), {}, 2 * 2, 2 * 2),
    "qwen2-moe/dp2-ep2": ("qwen2-moe", dict(dp=2, ep=2), {}, 3, 3),
}

SIZED_BY_DATA = {
    "nonzero",
    "nonzero_numpy",
    "argwhere",
    "bincount",
    "masked_select",
    "histc",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
}
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


class SyncCounter(TorchDispatchMode):
    """Records the host reads and data-sized ops that run inside the given modules' forwards and backwards:
    `found` holds (phase, kind, what, shape); `ops` counts every op per (phase, name)."""

    def __init__(self, modules):
        super().__init__()
        self.inside, self.ranges, self.found, self.ops = 0, [], [], Counter()
        self.hooks = []
        for m in modules:
            self.hooks += [m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave)]

    def _enter(self, module, args):
        self.inside += 1
        self.ranges.append([torch._C._autograd._get_sequence_nr(), None])

    def _leave(self, module, args, out):
        self.ranges[-1][1] = torch._C._autograd._get_sequence_nr()
        self.inside -= 1

    def phase(self) -> str | None:
        node = torch._C._current_autograd_node()
        if node is not None:  # a backward: is this node one a MoE forward made?
            nr = node._sequence_nr()
            return "backward" if any(lo <= nr < hi for lo, hi in self.ranges if hi is not None) else None
        return "forward" if self.inside else None

    def read(self, what: str, t: torch.Tensor) -> None:
        phase = self.phase()
        if phase is not None:
            self.found.append((phase, "host read", what, tuple(t.shape)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        phase = self.phase()
        if phase is not None:
            name = func._opname
            self.ops[phase, name] += 1
            if name in ("_local_scalar_dense", "equal"):
                self.found.append((phase, "host read", str(func), tuple(args[0].shape)))
            elif name in SIZED_BY_DATA:
                self.found.append((phase, "sized by data", str(func), tuple(args[0].shape)))
            elif name in INDEXING and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                self.found.append((phase, "sized by data", f"{func} with a boolean mask", tuple(args[0].shape)))
            elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self.found.append((phase, "sized by data", f"{func} without output_size", tuple(args[0].shape)))
        return func(*args, **kwargs)

    def __enter__(self):
        self.own = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy")}  # None: inherited
        for name in self.own:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def _wrap(self, name, method):
        def wrapper(t, *args, **kwargs):
            self.read(f"Tensor.{name}", t)
            return method(t, *args, **kwargs)

        return wrapper


def _count(pm, ids, labels) -> dict:
    from hf3d.models.moe import TPMoE

    layers = [m for m in pm.modules() if isinstance(m, TPMoE)]
    assert layers, "no MoE layer found"
    counter = SyncCounter(layers)
    with counter:
        pm.train_step(ids, labels)
    return {"found": counter.found, "ops": dict(counter.ops), "forwards": len(counter.ranges)}


def _worker(dirs: dict, cases: dict, ids, out: str) -> None:
    start_watchdog(300)
    res = {}
    for name, (family, kw, pkw, *_) in cases.items():
        pm = hf3d.parallelize(dirs[family], hf3d.ParallelConfig(**kw), **pkw)
        rows = ids[dp_rows(pm, BATCH)]
        res[name] = _count(pm, rows, rows)
    report(res, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-syncs")
    return {f: str(make_model_dir(root / f, f)) for f in ("qwen3-moe", "qwen2-moe")}


def _run(moe_dirs, cases: dict, world: int, out: Path) -> list[dict]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    spawn(_worker, world, moe_dirs, cases, ids, str(out))
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def world1(moe_dirs, tmp_path_factory):
    return _run(moe_dirs, CASES_1, 1, tmp_path_factory.mktemp("syncs-1"))


@pytest.fixture(scope="module")
def world2(moe_dirs, tmp_path_factory):
    return _run(moe_dirs, CASES_2, 2, tmp_path_factory.mktemp("syncs-2"))


def _check(results: list[dict], name: str, forwards: int, reads: int) -> None:
    for rank, r in enumerate(results):
        got = r[name]
        # the attribution sees the layers: two grouped GEMMs per layer forward, two more for each in backward
        ops = {k: v for k, v in got["ops"].items() if k[1] == "_grouped_mm"}
        assert got["forwards"] == forwards, (name, rank, got["forwards"])
        assert ops == {("forward", "_grouped_mm"): 2 * forwards, ("backward", "_grouped_mm"): 4 * forwards}, ops
        # at ep > 1 each forward's one read: the [2, ep] rows to send to and receive from each rank
        want = [("forward", "host read", "Tensor.tolist", (2, 2))] * reads
        found = got["found"]
        summary = dict(Counter((phase, kind, what) for phase, kind, what, _ in found))
        assert found == want, f"{name} rank {rank}: inside MoE layers {summary}, expected {reads} split-size reads"


@pytest.mark.parametrize("name", list(CASES_1))
def test_moe_layers_do_not_sync_at_ep1(world1, name):
    _check(world1, name, *CASES_1[name][3:])


@pytest.mark.parametrize("name", list(CASES_2))
def test_moe_layers_read_only_the_split_sizes(world2, name):
    _check(world2, name, *CASES_2[name][3:])


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()
        return grad * 2


class _Syncing(torch.nn.Module):
    """Every kind of sync the counter looks for, once each in forward, one host read in backward."""

    def forward(self, x):
        i = (x.detach() * 10).long().abs() % 4
        x.sum().item()
        i.tolist()
        i.numpy()
        torch.nonzero(i)
        torch.bincount(i, minlength=4)
        torch.unique(i)
        x[x > 0]
        torch.repeat_interleave(i)
        torch.repeat_interleave(i, output_size=int(i.sum()))  # int(): a host read; output_size: not sized by data
        return _ReadsInBackward.apply(x)


def test_the_counter_sees_each_kind_of_sync():
    """SyncCounter itself: each kind counted, in forward and in backward, and nothing outside the modules."""
    module = _Syncing()
    x = torch.randn(6, requires_grad=True)
    counter = SyncCounter([module])
    with counter:
        x.sum().item()  # outside: not counted
        y = module(x)
        (y * 3).sum().backward()
    assert counter.ranges[0][1] > counter.ranges[0][0]
    got = Counter((phase, kind, what) for phase, kind, what, _ in counter.found)
    sized = "sized by data"
    assert got == {
        ("forward", "host read", "aten._local_scalar_dense.default"): 2,
        ("forward", "host read", "Tensor.tolist"): 1,
        ("forward", "host read", "Tensor.numpy"): 1,
        ("forward", sized, "aten.nonzero.default"): 1,
        ("forward", sized, "aten.bincount.default"): 1,
        ("forward", sized, "aten._unique2.default"): 1,
        ("forward", sized, "aten.index.Tensor with a boolean mask"): 1,
        ("forward", sized, "aten.repeat_interleave.Tensor without output_size"): 1,
        ("backward", "host read", "aten._local_scalar_dense.default"): 1,
    }, got
    assert "tolist" not in torch.Tensor.__dict__ and "numpy" not in torch.Tensor.__dict__  # put back
