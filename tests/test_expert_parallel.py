"""Mixture-of-experts models over (tp, pp, dp, cp, ep) against stock transformers + torch AdamW, fp32.

One spawn of 4 gloo processes runs every case: Qwen3-MoE at dp=4 x ep=2 (two copies of each expert), at
tp=2 x ep=2 with and without sequence parallelism (and with full activation recompute) and at cp=2 x ep=2,
and Qwen2-MoE (shared expert, a dense layer) at pp=2 x ep=2 under 1f1b and under zbv. Each case checks the
logits after load, 3 training steps with stock's load-balancing loss on (cross-entropy, load-balancing loss,
grad norm), the exported weights, and the expert load of every step (`expert_load`: step 1's equals stock's
top-k picks, each token counted once at every mesh). The recompute case also equals its twin without
recompute: a MoE layer's forward run again inside backward routes its tokens again but must not count them.
The same spawn resumes an ep=2 checkpoint at ep=1 and a tp=2 one at tp=1, initialises both families from
config.json alone, runs aux-loss-free balancing two steps at tp=1 and at tp=2 (with and without sequence
parallelism) against stock's router plus the bias, and runs three mutations (a token routed to the wrong
expert, the router weights skipped, expert gradients reduced over the whole dp group) that the checks must
catch.

Without a spawn, two MoE layers run side by side as stock's blocks (its grouped_mm experts and
load_balancing_loss_func) and as hf3d's (TPMoE and RouterStats at tp = ep = 1), top-2 and top-3: the
outputs and every gradient are stock's bit for bit, the arithmetic in stock's order (its sort of the
assignments, its sum over each token's k slots, the load-balancing gradient through a softmax of its own in
stock's order of operations). hf3d's former orders, planted back one at a time, must each show there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asserts import assert_close  # noqa: E402
from dist import compat, report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, exported, make_model_dir, tiny_config  # noqa: E402
from reference import batches, dp_rows, moe_reference_run, oracle_adamw, saved_names  # noqa: E402

import hf3d  # noqa: E402

STEPS, BATCH, SEQ = 3, 8, 8
CASES = {  # name: (family, ParallelConfig keywords)
    "qwen3-moe/dp4-ep2": ("qwen3-moe", dict(dp=4, ep=2)),
    "qwen3-moe/tp2-ep2": ("qwen3-moe", dict(tp=2, dp=2, ep=2)),
    "qwen3-moe/tp2-sp-ep2": ("qwen3-moe", dict(tp=2, dp=2, ep=2, sequence_parallel=True)),
    # every layer run again inside backward (its all-to-alls too); compared with its twin without "+rc" as well
    "qwen3-moe/tp2-ep2+rc": ("qwen3-moe", dict(tp=2, dp=2, ep=2, recompute="full")),
    "qwen2-moe/pp2-ep2": ("qwen2-moe", dict(pp=2, dp=2, ep=2, num_microbatches=2)),
    "qwen3-moe/cp2-ep2": ("qwen3-moe", dict(dp=2, cp=2, ep=2)),
    # two stages per rank, backward split into input and weight passes: the statistics' chain still closes
    "qwen2-moe/zbv-ep2": ("qwen2-moe", dict(pp=2, dp=2, ep=2, pp_schedule="zbv", num_microbatches=4)),
}
if compat.BEFORE_2_13:  # hf3d refuses the V schedules there (hf3d/utils/compat.py)
    CASES.pop("qwen2-moe/zbv-ep2")
RESUMES = {  # name: (case whose step-2 checkpoint is loaded, ParallelConfig keywords of the resumed run)
    "ep2->ep1": ("qwen3-moe/dp4-ep2", dict(dp=4)),
    "tp2->tp1": ("qwen3-moe/tp2-ep2", dict(dp=4, ep=2)),
}
MUTATION_CASE = "qwen3-moe/dp4-ep2"
INIT_CASES = {"qwen3-moe": "qwen3-moe/dp4-ep2", "qwen2-moe": "qwen2-moe/pp2-ep2"}  # family: mesh of that case
INIT_SEED = 3
# measured on this machine over the six cases: logits |Δ| <= 1.6e-7, loss rel <= 1.0e-7, load-balancing loss
# rel <= 1.2e-7, grad norm rel <= 1.0e-6, weights <= 1.4e-6 of what training changed (AdamW's eps at
# reference.EPS on both sides; 1.1e-5 at torch's default, tests/reference.py says why); the mutations miss by
# 2.5e-4 (loss) and 0.3 (weights) at least
LOSS_RTOL, AUX_RTOL, NORM_RTOL, LOGITS_ATOL, UPDATE_TOL = 1.5e-6, 2e-6, 1e-5, 2e-6, 2e-5
RESUME_RTOL = 1e-6  # measured 0 (ep=2 -> 1) and 1.0e-7 (tp=2 -> 1)
RECOMPUTE_TOL = 1e-6  # recompute vs none, same mesh: losses, grad norms (relative), weights (absolute); measured 0
# aux-loss-free balancing: two steps at lr 0 (the router stays stock's, so the picks of step 2 are stock's
# router plus the bias of step 1); tp=2 ranks route the same tokens, tp=2 with sequence parallelism their own
BIAS_MESHES = {
    "dp4-ep2": dict(dp=4, ep=2),
    "tp2-ep2": dict(tp=2, dp=2, ep=2),
    "tp2-sp-ep2": dict(tp=2, dp=2, ep=2, sequence_parallel=True),
}
BIAS_RATE = 0.01


def _data():
    return batches(STEPS, BATCH, SEQ, VOCAB, seed=5)


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(11))


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------
def _train(pm, data, *, ckpt: Path | None = None) -> dict:
    """STEPS steps on this dp rank's rows; a checkpoint after step 2 when `ckpt` is given."""
    opt = oracle_adamw(pm)
    rows = dp_rows(pm, BATCH)
    out = {"loss": [], "aux": [], "norm": [], "load": []}
    for step, (ids, labels) in enumerate(data, 1):
        out["loss"].append(pm.train_step(ids[rows], labels[rows]).item())
        out["aux"].append(pm.last_aux_loss.item())
        out["load"].append(pm.expert_load().clone())
        out["norm"].append(opt.step().item())
        opt.zero_grad()
        if ckpt is not None and step == 2:
            hf3d.save_checkpoint(ckpt, pm, opt, step=2)
    return out


def _resumed_loss(path: str, ckpt: Path, kw: dict, data) -> float:
    pm = hf3d.parallelize(path, hf3d.ParallelConfig(**kw))
    opt = oracle_adamw(pm)
    assert hf3d.load_checkpoint(ckpt, pm, opt) == 2
    ids, labels = data[2]
    rows = dp_rows(pm, BATCH)
    return pm.train_step(ids[rows], labels[rows]).item()


def _mutations(path: str, ids, data, out: Path, res: dict) -> None:
    """Each mutation runs the case again with one thing made wrong; the parent checks that it shows."""
    from hf3d.optim import zero as optim
    from hf3d.parallel import expert as expert_parallel

    kw = CASES[MUTATION_CASE][1]
    init, combine, groups = expert_parallel.Dispatch.__init__, expert_parallel.Dispatch.combine, optim.reduction_groups

    def wrong_expert(self, index, num_experts, group):  # every token to the next expert
        init(self, (index + 1) % num_experts, num_experts, group)

    def unweighted(self, y, weights):
        return combine(self, y, torch.ones_like(weights))

    def one_group(pmodel, params):  # expert gradients summed over every dp rank
        return [(dist.group.WORLD if pmodel.pcfg.tp == 1 else None, params, None)]

    for name, target, attr, fake in (
        ("wrong-expert", expert_parallel.Dispatch, "__init__", wrong_expert),
        ("unweighted", expert_parallel.Dispatch, "combine", unweighted),
        ("one-group", optim, "reduction_groups", one_group),
    ):
        original = getattr(target, attr)
        setattr(target, attr, fake)
        try:
            pm = hf3d.parallelize(path, hf3d.ParallelConfig(**kw))
            with torch.no_grad():
                res[f"mutation/{name}/logits"] = pm.logits(ids)
            res[f"mutation/{name}/train"] = _train(pm, data)
            pm.save_pretrained(out / f"mutation-{name}")
        finally:
            setattr(target, attr, original)
    assert (expert_parallel.Dispatch.__init__, expert_parallel.Dispatch.combine, optim.reduction_groups) == (
        init,
        combine,
        groups,
    )


def _world4(dirs: dict, ids, data, out: str) -> None:
    start_watchdog(600)
    out, res = Path(out), {}
    for name, (family, kw) in CASES.items():
        pm = hf3d.parallelize(dirs[family], hf3d.ParallelConfig(**kw))
        with torch.no_grad():
            res[f"{name}/logits"] = pm.logits(ids)
        ckpt = out / f"ckpt-{name.replace('/', '-')}"
        res[f"{name}/train"] = _train(pm, data, ckpt=ckpt)
        pm.save_pretrained(out / name.replace("/", "-"))
    for name, (case, kw) in RESUMES.items():
        ckpt = out / f"ckpt-{case.replace('/', '-')}"
        res[f"resume/{name}"] = _resumed_loss(dirs[CASES[case][0]], ckpt, kw, data)
    _mutations(dirs[CASES[MUTATION_CASE][0]], ids, data, out, res)
    for mesh, kw in BIAS_MESHES.items():
        pm = hf3d.parallelize(
            dirs["qwen3-moe"], hf3d.ParallelConfig(**kw), moe_load_balance="bias", moe_bias_rate=BIAS_RATE
        )
        opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=0.0)
        rows = dp_rows(pm, BATCH)
        run = res[f"bias/{mesh}"] = {"load": [], "bias": [], "aux": []}
        for ids, labels in data[:2]:
            pm.train_step(ids[rows], labels[rows])
            opt.step()
            opt.zero_grad()
            run["load"].append(pm.expert_load().clone())
            run["bias"].append(pm.router_stats.bias.clone())
            run["aux"].append(pm.last_aux_loss)
    for family, case in INIT_CASES.items():  # sharded init from config.json alone
        pm = hf3d.parallelize(dirs[f"{family}-config"], hf3d.ParallelConfig(**CASES[case][1]), seed=INIT_SEED)
        pm.save_pretrained(out / f"init-{family}")
    report(res, out / "results.pt")


# ------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    dirs = {f: str(make_model_dir(root / f, f)) for f in ("qwen3-moe", "qwen2-moe")}
    for f in INIT_CASES:  # the same config, no weights: initialised from scratch
        (root / f"{f}-config").mkdir()
        tiny_config(f).save_pretrained(root / f"{f}-config")
        dirs[f"{f}-config"] = str(root / f"{f}-config")
    return dirs


@pytest.fixture(scope="module")
def world4(moe_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep-world4")
    spawn(_world4, 4, moe_dirs, _ids(), _data(), str(out))
    results = torch.load(out / "results.pt", weights_only=False)
    assert len(results) == 4
    return results, out


@pytest.fixture(scope="module")
def references(moe_dirs):
    """Stock runs per (family, forwards per step): dp x micro-batches contiguous chunks of the rows."""
    out = {}
    for family, kw in CASES.values():
        forwards = kw["dp"] * kw.get("num_microbatches", 1)
        if (family, forwards) not in out:
            out[family, forwards] = moe_reference_run(moe_dirs[family], _data(), forwards)
    return out


def _reference(references, case: str):
    family, kw = CASES[case]
    return references[family, kw["dp"] * kw.get("num_microbatches", 1)]


def _stock_logits(path: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(_ids()).logits


def _stock_picks(path: str, ids: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[MoE layers, E]: stock's top-k experts of every token of `ids` counted per expert, picked by the router's
    probabilities (plus `bias` [MoE layers, E], as aux-loss-free balancing picks)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        probs = [logits.softmax(-1) for logits in model(ids, output_router_logits=True).router_logits]
    if bias is not None:
        probs = [p + b for p, b in zip(probs, bias)]
    cfg = model.config
    picks = [p.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten() for p in probs]
    return torch.stack([torch.bincount(i, minlength=cfg.num_experts) for i in picks]).float()


def _update_error(saved: dict, ref: dict, original: dict) -> float:
    """||w - w_ref|| / ||w_ref - w_0|| over every tensor: the error relative to what training changed."""
    assert sorted(saved) == sorted(ref)
    num = sum(float((saved[k] - ref[k]).square().sum()) for k in ref)
    den = sum(float((ref[k] - original[k]).square().sum()) for k in ref)
    return (num / den) ** 0.5


def _check_case(results, out: Path, moe_dirs, references, case: str, prefix: str = "") -> None:
    family = CASES[case][0]
    stock = _stock_logits(moe_dirs[family])
    losses, auxes, norms, ref_sd = _reference(references, case)
    for rank, r in enumerate(results):
        key = prefix or case
        assert_close(r[f"{key}/logits"], stock, atol=LOGITS_ATOL, what=f"{key} logits, rank {rank}")
        run = r[f"{key}/train"]
        assert_close(run["loss"], losses, rtol=LOSS_RTOL, what=f"{key} loss, rank {rank}")
        assert_close(run["aux"], auxes, rtol=AUX_RTOL, what=f"{key} load-balancing loss, rank {rank}")
        assert_close(run["norm"], norms, rtol=NORM_RTOL, what=f"{key} grad norm, rank {rank}")
    folder = out / (f"mutation-{prefix.split('/')[1]}" if prefix else case.replace("/", "-"))
    original = exported(Path(moe_dirs[family]))
    err = _update_error(exported(folder), ref_sd, original)
    assert err <= UPDATE_TOL, f"{prefix or case}: exported weights off stock's by {err:.2e} of the update"


@pytest.mark.parametrize("case", list(CASES))
def test_moe_training_matches_stock(world4, moe_dirs, references, case):
    results, out = world4
    _check_case(results, out, moe_dirs, references, case)


def test_the_pipeline_case_leaves_experts_empty(moe_dirs):
    """Stock's routing of the pp=2 case's forwards leaves an expert with no token (so a rank receives nothing
    for one of its experts): the dispatch's empty groups are exercised, not assumed."""
    model = AutoModelForCausalLM.from_pretrained(moe_dirs["qwen2-moe"], dtype=torch.float32)
    cfg, forwards = model.config, CASES["qwen2-moe/pp2-ep2"][1]["dp"] * 2
    empty = 0
    with torch.no_grad():
        for ids, _ in _data():
            for chunk in ids.chunk(forwards):
                for logits in model(chunk, output_router_logits=True).router_logits:
                    picks = logits.softmax(-1).topk(cfg.num_experts_per_tok).indices.flatten()
                    empty += int((torch.bincount(picks, minlength=cfg.num_experts) == 0).sum())
    assert empty > 0


BLOCK_TOKENS, BLOCK_FORWARDS = 32, 2  # the load-balancing loss weighs coef / forwards, as moe_reference_run's


def _block_gradients(top_k: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Two MoE layers of a tiny Qwen3-MoE (router weights large enough that the picks spread), each on tokens of
    its own, forward and backward of sum(y * g) + coef / forwards * stock's load-balancing loss over both: stock's
    blocks against hf3d's at tp = ep = 1. {what: (stock's, hf3d's)}."""
    import copy

    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from hf3d.models.common import TPContext
    from hf3d.models.moe import EPContext, TPMoE
    from hf3d.parallel.expert import RouterStats

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3-moe", num_experts_per_tok=top_k), dtype=torch.float32)
    cfg = model.config
    assert cfg._experts_implementation == "grouped_mm", cfg._experts_implementation  # stock's default, whose order
    blocks = [layer.mlp for layer in model.model.layers[:2]]
    with torch.no_grad():
        for b in blocks:
            b.gate.weight.normal_(0, 0.2)
    xs = [torch.randn(1, BLOCK_TOKENS, cfg.hidden_size) for _ in blocks]
    gs = [torch.randn(1, BLOCK_TOKENS, cfg.hidden_size) * 1e-2 for _ in blocks]
    coef = cfg.router_aux_loss_coef

    stock, logits = [copy.deepcopy(b) for b in blocks], []
    for b in stock:
        b.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
    stock_x = [x.clone().requires_grad_() for x in xs]
    stock_y = [b(x) for b, x in zip(stock, stock_x)]
    aux = load_balancing_loss_func(tuple(logits), cfg.num_experts, top_k)
    (sum((y * g).sum() for y, g in zip(stock_y, gs)) + coef * (aux / BLOCK_FORWARDS)).backward()

    stats = RouterStats(cfg.num_experts, [0, 1], aux=True, shard_groups=[])
    stats.rows, stats.coef = BLOCK_TOKENS, coef / BLOCK_FORWARDS
    stats.start_step("cpu")
    stats.start(None, "cpu")
    ours = []
    for i, b in enumerate(blocks):
        b = copy.deepcopy(b)
        moe = TPMoE(
            b, f"model.layers.{i}.mlp", TPContext(None, 0, 1, dtype=torch.float32), EPContext(None, 0, 1, stats)
        )
        with torch.no_grad():  # tp = 1: stock's fused [E, 2I, H] and [E, H, I] are hf3d's stacks as they are
            moe.grouped_experts.gate_up.copy_(b.experts.gate_up_proj)
            moe.grouped_experts.down.copy_(b.experts.down_proj)
        ours.append(moe)
    our_x = [x.clone().requires_grad_() for x in xs]
    our_y = [m(x) for m, x in zip(ours, our_x)]
    term, our_aux = stats.close(stats.stop())
    (sum((y * g).sum() for y, g in zip(our_y, gs)) + term).backward()

    out = {"load-balancing loss": (aux.detach(), our_aux.detach())}
    for i, (s, m) in enumerate(zip(stock, ours)):
        out[f"layer {i} output"] = (stock_y[i].detach(), our_y[i].detach())
        out[f"layer {i} input gradient"] = (stock_x[i].grad, our_x[i].grad)
        out[f"layer {i} router gradient"] = (s.gate.weight.grad, m.router.grad)
        out[f"layer {i} gate_up gradient"] = (s.experts.gate_up_proj.grad, m.grouped_experts.gate_up.grad)
        out[f"layer {i} down gradient"] = (s.experts.down_proj.grad, m.grouped_experts.down.grad)
    return out


def _differing(pairs: dict) -> list[str]:
    return [what for what, (a, b) in pairs.items() if not torch.equal(a, b)]


@pytest.mark.parametrize("top_k", [2, 3])
def test_a_moe_layer_is_stocks_bit_for_bit(top_k):
    """Forward, backward and the load-balancing loss of hf3d's MoE layers equal stock's to the bit: the float
    noise of a different order is what AdamW turns into weight error on near-zero gradients (tests/test_sharding.py)."""
    different = _differing(_block_gradients(top_k))
    assert not different, f"top-{top_k}: {different}"


def _old_sort(init):
    def sort(self, index, num_experts, group):  # each expert's rows in token order (a stable sort)
        init(self, index, num_experts, group)
        self.order = torch.sort(index.reshape(-1), stable=True).indices
        self.rows = self.order // self.k

    return sort


def _old_combine(self, y, top_k_weights):  # each token's k outputs added in expert order (index_add)
    weights = top_k_weights.reshape(-1)[self.order].unsqueeze(-1)
    return y.new_zeros((self.num_tokens, y.shape[-1])).index_add(0, self.rows, y * weights)


def _old_route(self, x):  # the load-balancing loss fed the router's own probabilities, one scale on the counts
    import torch.nn.functional as F

    from hf3d.parallel.expert import expert_counts

    logits = F.linear(x, self.router)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    weights, index = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    stats = self.ep.stats
    counts = expert_counts(index, stats.num_experts).to(torch.float32)
    stats.load[stats.layers.index(self.layer)] += counts
    n = stats.rows * stats.num_layers
    stats.chain = _OldTally.apply(stats.chain, probs.sum(0), counts, stats.coef * stats.num_experts / (n * n))
    return weights.to(logits.dtype), index


class _OldTally(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chain, prob_sums, counts, scale):
        ctx.scale = scale
        return chain + torch.stack([counts, prob_sums.detach()])

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.scale * grad[0], None, None


@pytest.mark.parametrize(
    "mutation, top_k, shows_in",
    [
        ("stable sort", 2, "gate_up gradient"),
        ("expert-order sum", 3, "output"),
        ("load balancing through the router's softmax", 2, "router gradient"),
    ],
)
def test_the_bitwise_check_catches_the_former_orders(mutation, top_k, shows_in):
    """hf3d's former orders, each planted back alone, show in the bitwise check where they act."""
    from hf3d.models.moe import TPMoE
    from hf3d.parallel import expert

    target, attr = {
        "stable sort": (expert.Dispatch, "__init__"),
        "expert-order sum": (expert.Dispatch, "combine"),
        "load balancing through the router's softmax": (TPMoE, "route"),
    }[mutation]
    original = getattr(target, attr)
    fake = {
        "stable sort": _old_sort(original),
        "expert-order sum": _old_combine,
        "load balancing through the router's softmax": _old_route,
    }[mutation]
    setattr(target, attr, fake)
    try:
        different = _differing(_block_gradients(top_k))
    finally:
        setattr(target, attr, original)
    assert any(shows_in in what for what in different), f"{mutation}: only {different} differ"


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_at_another_ep_or_tp(world4, references, name):
    results, _ = world4
    case = RESUMES[name][0]
    want = _reference(references, case)[0][2]
    for rank, r in enumerate(results):
        assert_close(r[f"resume/{name}"], want, rtol=RESUME_RTOL, what=f"{name} step-3 loss, rank {rank}")


@pytest.mark.parametrize("family", list(INIT_CASES))
def test_sharded_init_is_stock_from_config(world4, moe_dirs, family):
    """An ep=2 model made from config.json alone equals `torch.manual_seed(s); from_config(cfg)` bit for bit."""
    _, out = world4
    torch.manual_seed(INIT_SEED)
    stock = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    want = saved_names(stock.state_dict(), stock.config.moe_intermediate_size)
    got = exported(out / f"init-{family}")
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"{len(different)} tensors differ from stock's init, e.g. {different[:3]}"


@pytest.mark.parametrize("mesh", list(BIAS_MESHES))
def test_bias_balancing_moves_towards_the_mean_load(world4, moe_dirs, mesh):
    """moe_load_balance="bias": no loss term, and after each step each expert's bias moved by the rate towards
    the mean load of the whole step (every rank's tokens, each counted once), the same on every rank. The
    load of each step is stock's: its router's picks on the step's rows, plus the bias in step 2."""
    results, _ = world4
    cfg = tiny_config("qwen3-moe")
    data, bias = _data(), torch.zeros(cfg.num_hidden_layers, cfg.num_experts)  # every layer is a MoE layer
    for step in range(2):
        load = _stock_picks(moe_dirs["qwen3-moe"], data[step][0], bias)
        assert load.sum() == BATCH * SEQ * cfg.num_experts_per_tok * cfg.num_hidden_layers
        bias = bias + BIAS_RATE * torch.sign(load.mean(dim=1, keepdim=True) - load)
        assert (bias != 0).any()
        for rank, r in enumerate(results):
            run = r[f"bias/{mesh}"]
            assert torch.equal(run["load"][step], load), f"{mesh} step {step + 1} rank {rank}: {run['load'][step]}"
            assert torch.equal(run["bias"][step], bias), f"{mesh} step {step + 1} rank {rank}: {run['bias'][step]}"
            assert run["aux"][step] is None


@pytest.mark.parametrize("case", list(CASES))
def test_expert_load_counts_each_pick_once(world4, moe_dirs, case):
    """`expert_load()` after every step: each token's top-k picks in each MoE layer once, whatever the mesh
    (tp ranks route the same tokens, sequence-parallel and cp ranks their own, a layer run again by recompute
    counts nothing); step 1's are stock's picks of the step's rows (the weights are still stock's)."""
    results, _ = world4
    family = CASES[case][0]
    want = _stock_picks(moe_dirs[family], _data()[0][0])
    for rank, r in enumerate(results):
        loads = r[f"{case}/train"]["load"]
        assert torch.equal(loads[0], want), f"{case} rank {rank}: step 1 load {loads[0]}, stock's {want}"
        for step, load in enumerate(loads[1:], 2):
            assert torch.equal(load.sum(1), want.sum(1)), f"{case} rank {rank}: step {step} load {load}"


def test_moe_recompute_equals_no_recompute(world4):
    """Full activation recompute of MoE layers (router, token exchange and experts run again inside backward):
    the same losses, load-balancing losses, grad norms and expert loads as without, and the same weights."""
    results, out = world4
    name = "qwen3-moe/tp2-ep2+rc"
    twin = name.removesuffix("+rc")
    for rank, r in enumerate(results):
        got, want = r[f"{name}/train"], r[f"{twin}/train"]
        for what in ("loss", "aux", "norm"):
            assert_close(got[what], want[what], rtol=RECOMPUTE_TOL, what=f"{name} {what}, rank {rank}")
        assert all(torch.equal(a, b) for a, b in zip(got["load"], want["load"], strict=True)), (rank, got["load"])
    with_rc, without = exported(out / name.replace("/", "-")), exported(out / twin.replace("/", "-"))
    assert sorted(with_rc) == sorted(without)
    assert_close(with_rc, without, atol=RECOMPUTE_TOL, what=f"{name} exported weights")


@pytest.mark.parametrize("mutation", ["wrong-expert", "unweighted", "one-group"])
def test_mutations_are_caught(world4, moe_dirs, references, mutation):
    results, out = world4
    with pytest.raises(AssertionError):
        _check_case(results, out, moe_dirs, references, MUTATION_CASE, prefix=f"mutation/{mutation}")


def test_the_moe_example_runs_as_the_docs_launch_it(tmp_path):
    """`torchrun --nproc-per-node 2 -m hf3d train examples/configs/qwen3-moe-tiny.yaml` (ep=2), a few steps:
    metrics.jsonl has the load-balancing loss and the expert load, and stock loads the export."""
    import json
    import subprocess

    root, out = Path(__file__).resolve().parents[1], tmp_path / "run"
    settings = [f"run.output_dir={out}", "run.steps=3", "optim.warmup_steps=1", "data.eval.every=0"]
    settings += ["checkpoint.every=0", "run.sample_prompt=null"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hf3d", "train"]
    cmd += ["examples/configs/qwen3-moe-tiny.yaml", "--set", *settings]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "mesh pp=1 dp=2 ep=2 cp=1 tp=1" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["moe/aux_loss"] > 0 and r["moe/dropped_tokens"] == 0
        assert 1.0 <= r["moe/load_imbalance"] <= 4.0  # max / mean picks of 8 experts, top-2: at most 8 / 2
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 8
