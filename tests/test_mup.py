"""Spectral µP (hf3d/optim/parametrization.py, docs/mup.md) against its written rules and against stock.

The rules table below is written from docs/mup.md, not read from hf3d: with m = hidden_size / base width,
hidden matrices get stock's init times m^-1/2 and lr / m; the token embedding and vectors (norms, biases)
keep both; readouts (untied head, MoE router, shared-expert gate) get init and lr / m; with tied embeddings
the final norm's weight carries the readout's 1/m (init and lr). The output multiplier α multiplies the init
and lr of the logits' readout: the untied head, or the final norm's weight when tied (α / m).

The oracle of a µP run is stock transformers: `torch.manual_seed(0); from_config` with each tensor times the
table's init scale, trained by torch.optim.AdamW whose groups have lr LR times the table's lr scale (and the
transformers Trainer's weight-decay rule), clipped at CLIP. hf3d at 1x1x1 is checked against it, and every
other mesh (tp2, pp2, dp2 with ZeRO-1, a run saved at tp2 and resumed at dp2) against hf3d at 1x1x1.
Two spawns (1 and 2 processes) run everything; the parent asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asserts import assert_close  # noqa: E402
from dist import spawn_world  # noqa: E402
from models import FAMILIES, VOCAB, exported, tiny_config  # noqa: E402
from reference import BETAS, CLIP, EPS, LR, WD, batches, oracle_adamw, saved_names, train_losses  # noqa: E402

import hf3d  # noqa: E402
from hf3d.parallel.layout import get_pieces  # noqa: E402

BASE = 24  # the tiny models' hidden_size is 48: m = 2
M = 2.0
BATCH, SEQ, STEPS = 4, 16, 3
MUP = dict(parametrization="spectral_mup", mup_base_width=BASE)
ALPHA = 3.0  # an output multiplier the proxy was tuned to
MUP_ALPHA = dict(MUP, mup_output_multiplier=ALPHA)
# fp32, 3 steps (gloo, 2-core CPU). The bounds are 1e-6 (losses, relative) and 1e-5 (weights); the
# largest errors measured sit 4.6x (weights) to 10x (losses) below them. The weight error is AdamW's: it
# divides each gradient by its running magnitude, so float noise in a near-zero gradient (an embedding row
# of a token the batches hardly hold) becomes weight noise near lr times its relative size.
LOSS_RTOL = 1e-6  # per-step loss, relative; measured 1.0e-7 (pp2, dp2 against 1x1x1; tp2: equal)
WEIGHT_ATOL = 2.5e-6  # max |Δw| of the exported weights, AdamW's eps at reference.EPS; measured 1.7e-7 (tp2)
ORACLE_LOSS_RTOL = 3e-6  # hf3d 1x1x1 against stock + AdamW; measured 2.1e-7
ORACLE_WEIGHT_ATOL = 4e-6  # measured 2.8e-7
FP8_LOSS_RTOL = 1e-3  # FP8 tensorwise against fp32 µP, per-step loss; measured 4.7e-5
# world 2: name -> (ParallelConfig kwargs besides µP)
MESHES = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2-zero1": dict(zero_stage=1)}
ALPHA_FAMILIES = ("llama", "qwen2")  # tied, untied


def expected_rule(name: str, shape: tuple, config, alpha: float = 1.0) -> tuple[float, float]:
    """(init scale, lr scale) of an HF parameter, from docs/mup.md's table (m = 2), with output multiplier alpha."""
    if name == "lm_head.weight":  # the logits' readout (tied: the embedding's tensor; the gain is the norm's)
        gain = 1.0 if config.tie_word_embeddings else alpha
        return gain / M, gain / M
    if name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight")):
        return 1 / M, 1 / M  # readouts
    if name == "model.norm.weight" and config.tie_word_embeddings:
        return alpha / M, alpha / M  # the tied readout's gain
    if len(shape) == 1 or name == "model.embed_tokens.weight":
        return 1.0, 1.0
    return M**-0.5, 1 / M  # hidden matrices, experts included


def _config(family: str):
    return tiny_config(family)


def _config_dir(root: Path, family: str) -> str:
    d = root / family
    _config(family).save_pretrained(d)
    return str(d)


def _data():
    return batches(STEPS, BATCH, SEQ, VOCAB)


# -- worker side ---------------------------------------------------------------------------------------
def _group_lrs(opt) -> dict[str, float]:
    """HF name -> the lr of the group its master fragments are in (on this rank)."""
    lr_of = {id(m): g["lr"] for g in opt.param_groups for m in g["params"]}
    out: dict[str, set] = {}
    for p, m, _, _ in opt._masters:
        for piece in get_pieces(p):
            out.setdefault(piece.hf_name, set()).add(lr_of[id(m)])
    assert all(len(v) == 1 for v in out.values()), out
    return {k: v.pop() for k, v in out.items()}


def _train(pm, opt, data, out: Path | None) -> list[float]:
    losses = train_losses(pm, opt, data, BATCH)
    if out is not None:
        pm.save_pretrained(out)
    return losses


def _optimizer(pm):
    return oracle_adamw(pm, exclude_from_weight_decay=True)


def _run(cdir: str, out: Path, name: str, **pkw) -> dict:
    """hf3d trained on the test's batches under ParallelConfig(**pkw): its losses and groups' lrs, exported."""
    pm = hf3d.parallelize(cdir, hf3d.ParallelConfig(**pkw), seed=0)
    opt = _optimizer(pm)
    return dict(losses=_train(pm, opt, _data(), out / name), lrs=_group_lrs(opt))


def _worker(world: int, dirs: dict, out: str) -> None:
    out, res = Path(out), {}
    if world == 1:
        res["1x1x1"] = _run(dirs["llama"], out, "1x1x1", **MUP)
        for fam in ALPHA_FAMILIES:  # tied and untied
            res[f"alpha-{fam}"] = _run(dirs[fam], out, f"alpha-{fam}", **MUP_ALPHA)
        res["standard"] = _run(dirs["llama"], out, "standard")
        res["mup-base-is-width"] = _run(dirs["llama"], out, "mup-base-is-width", parametrization="spectral_mup",
                                        mup_base_width=48)  # fmt: skip
        pm = hf3d.parallelize(dirs["llama"], hf3d.ParallelConfig(**MUP), seed=0, fp8="tensorwise")
        pm.save_pretrained(out / "init-llama-fp8")
        opt = _optimizer(pm)
        res["fp8"] = dict(lrs=_group_lrs(opt), losses=_train(pm, opt, _data(), None), fp8=len(pm.fp8_projections))
        for fam in FAMILIES:  # the from-scratch init of every family, and its groups
            pm = hf3d.parallelize(dirs[fam], hf3d.ParallelConfig(**MUP), seed=0)
            pm.save_pretrained(out / f"init-{fam}")
            res[f"lrs-{fam}"] = _group_lrs(_optimizer(pm))
    else:
        for name, pkw in MESHES.items():
            res[name] = _run(dirs["llama"], out, name, **MUP, **pkw)
        res["tp2-alpha"] = _run(dirs["llama"], out, "tp2-alpha", tp=2, **MUP_ALPHA)
        # resume at another mesh: 2 steps at tp2, saved; the 3rd at dp2 (ZeRO-1) from the checkpoint
        data = _data()
        pm = hf3d.parallelize(dirs["llama"], hf3d.ParallelConfig(tp=2, **MUP), seed=0)
        opt = _optimizer(pm)
        first = _train(pm, opt, data[:2], None)
        hf3d.save_checkpoint(out / "ckpt", pm, opt, step=2)
        pm = hf3d.parallelize(dirs["llama"], hf3d.ParallelConfig(**MUP), seed=0)
        opt = _optimizer(pm)
        hf3d.load_checkpoint(out / "ckpt", pm, opt)
        res["resume-tp2-dp2"] = dict(losses=first + _train(pm, opt, data[2:], out / "resume-tp2-dp2"))
        res["resume-tp2-dp2"]["lrs"] = _group_lrs(opt)
        pm = hf3d.parallelize(dirs["llama"], hf3d.ParallelConfig(), seed=0)  # standard parametrization
        opt = _optimizer(pm)
        before = [p.detach().clone() for _, p in pm.unique_parameters()]
        try:
            hf3d.load_checkpoint(out / "ckpt", pm, opt)
        except ValueError as e:
            res["other-parametrization"] = str(e)
        res["untouched"] = all(torch.equal(a, p) for a, (_, p) in zip(before, pm.unique_parameters()))
    torch.save(res, out / f"rank{dist.get_rank()}.pt")


# -- parent side ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("mup")
    return dict(root=root, dirs={fam: _config_dir(root / "models", fam) for fam in FAMILIES})


@pytest.fixture(scope="module")
def world1(env):
    return spawn_world(_worker, 1, env["root"], env["dirs"])


@pytest.fixture(scope="module")
def world2(env):
    return spawn_world(_worker, 2, env["root"], env["dirs"])


def _stock_init(family: str, alpha: float = 1.0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Stock's from-scratch model (seed 0) with the table's init scales applied; its saved-name state dict."""
    from transformers import AutoModelForCausalLM

    config = _config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3:  # stock's fused experts: per-expert matrices of one rule
                p.mul_(M**-0.5)
            else:
                p.mul_(expected_rule(name, tuple(p.shape), config, alpha)[0])
    return model, saved_names(model.state_dict(), getattr(config, "moe_intermediate_size", 0))


def _oracle(family: str, alpha: float = 1.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Stock + torch AdamW with the table's per-parameter lrs and the Trainer's weight-decay rule."""
    from hf3d.optim.zero import no_decay_names

    model, _ = _stock_init(family, alpha)
    skip = no_decay_names(model)
    groups = [
        dict(
            params=[p],
            lr=LR * expected_rule(n, tuple(p.shape), model.config, alpha)[1],
            weight_decay=0.0 if n in skip else WD,
        )
        for n, p in model.named_parameters()
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    losses = []
    for ids, labels in _data():
        loss = model(ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rules_equal_the_written_table(family):
    """Every HF parameter of every family gets the init and lr scale of docs/mup.md's table, from its name and
    global shape; m = 1 gives 1 everywhere."""
    from hf3d.models import get_adapter
    from hf3d.optim.parametrization import build_parametrization

    config = _config(family)
    adapter = get_adapter(config.model_type)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    shapes = adapter.disk_shapes(shapes)
    par = build_parametrization(
        "spectral_mup", BASE, config, shapes, adapter.fan_axes, final_norm_name="model.norm.weight"
    )
    for n, shape in shapes.items():
        rule = par.rule(n)
        assert (rule.init_scale, rule.lr_scale) == pytest.approx(expected_rule(n, shape, config), rel=1e-12), n
    same = build_parametrization(
        "spectral_mup", 48, config, shapes, adapter.fan_axes, final_norm_name="model.norm.weight"
    )
    assert {(r.init_scale, r.lr_scale) for r in same.rules.values()} == {(1.0, 1.0)}
    gain = build_parametrization(
        "spectral_mup", BASE, config, shapes, adapter.fan_axes, final_norm_name="model.norm.weight",
        output_multiplier=ALPHA,
    )  # fmt: skip
    for n, shape in shapes.items():
        rule = gain.rule(n)
        assert (rule.init_scale, rule.lr_scale) == pytest.approx(expected_rule(n, shape, config, ALPHA), rel=1e-12), n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_is_stock_times_the_rules(world1, family):
    """From scratch, µP's weights are stock's seeded draws times the table's init scale, tensor for tensor;
    the optimizer puts each HF parameter in the group of lr LR times the table's lr scale."""
    _, want = _stock_init(family)
    got = exported(world1["out"] / f"init-{family}")
    config = _config(family)
    assert set(got) == set(want) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    shapes = {k: tuple(v.shape) for k, v in want.items()}
    lrs = world1[0][f"lrs-{family}"]
    for n, lr in lrs.items():
        assert lr == pytest.approx(LR * expected_rule(n, shapes[n], config)[1], rel=1e-12), n
    assert set(lrs) == set(got)


def test_fp8_keeps_the_rules(world1):
    """With FP8 projections (torchao, tensorwise) µP's init and groups are the same, and the run follows the
    fp32 one."""
    fp8 = world1[0]["fp8"]
    assert fp8["fp8"] > 0 and fp8["lrs"] == world1[0]["1x1x1"]["lrs"]
    a, b = exported(world1["out"] / "init-llama-fp8"), exported(world1["out"] / "init-llama")
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert_close(fp8["losses"], world1[0]["1x1x1"]["losses"], rtol=FP8_LOSS_RTOL, what="fp8 loss")


def test_1x1x1_matches_stock_with_the_rules(world1):
    """hf3d µP at 1x1x1 equals stock + AdamW with the table's per-parameter lrs and init."""
    losses, sd = _oracle("llama")
    run = world1[0]["1x1x1"]
    assert_close(run["losses"], losses, rtol=ORACLE_LOSS_RTOL, what="loss")
    got = exported(world1["out"] / "1x1x1")
    assert_close({k: got[k] for k in got}, {k: sd[k] for k in got}, atol=ORACLE_WEIGHT_ATOL, what="weights")


@pytest.mark.parametrize("family", ALPHA_FAMILIES)
def test_output_multiplier_matches_stock(world1, family):
    """With an output multiplier, hf3d µP at 1x1x1 equals stock + AdamW whose logits' readout (the untied
    head; tied: the final norm's weight) has init and lr times it, on top of the table."""
    losses, sd = _oracle(family, ALPHA)
    run = world1[0][f"alpha-{family}"]
    assert_close(run["losses"], losses, rtol=ORACLE_LOSS_RTOL, what="loss")
    got = exported(world1["out"] / f"alpha-{family}")
    assert_close({k: got[k] for k in got}, {k: sd[k] for k in got}, atol=ORACLE_WEIGHT_ATOL, what="weights")
    if family == "llama":
        assert run["losses"] != world1[0]["1x1x1"]["losses"]  # the gain makes another run than α = 1


@pytest.mark.parametrize("name", [*MESHES, "resume-tp2-dp2", "tp2-alpha"])
def test_mesh_equals_1x1x1(world1, world2, name):
    """µP at tp2, pp2, dp2 with ZeRO-1, and saved at tp2 then resumed at dp2, equals µP at 1x1x1: losses on
    every rank, exported weights, and each HF parameter's group lr on every rank."""
    one = "alpha-llama" if name.endswith("alpha") else "1x1x1"
    ref = world1[0][one]
    for r in range(2):
        assert_close(world2[r][name]["losses"], ref["losses"], rtol=LOSS_RTOL, what=f"rank {r} loss")
        lrs = world2[r][name]["lrs"]
        assert lrs == {k: ref["lrs"][k] for k in lrs}, f"rank {r}: a parameter in another lr group than at 1x1x1"
    got, want = exported(world2["out"] / name), exported(world1["out"] / one)
    assert set(got) == set(want)
    assert_close(got, want, atol=WEIGHT_ATOL, what=f"{name} weights")


def test_width_equal_to_base_is_standard(world1):
    """mup_base_width == hidden_size: every scale is 1, so the run is standard parametrization's, bit for bit."""
    std, mup = world1[0]["standard"], world1[0]["mup-base-is-width"]
    assert mup["losses"] == std["losses"]
    assert mup["lrs"] == std["lrs"] == {k: LR for k in std["lrs"]}
    a, b = exported(world1["out"] / "standard"), exported(world1["out"] / "mup-base-is-width")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert world1[0]["1x1x1"]["losses"] != std["losses"]  # while m = 2 is another run


def test_resume_under_another_parametrization_is_refused(world2):
    """A µP checkpoint's optimizer state does not load into a standard-parametrization optimizer: one line,
    before anything is read."""
    for r in range(2):
        msg = world2[r].get("other-parametrization", "")
        assert msg.startswith("the optimizer state was saved under other µP lr scales (spectral_mup, 1, 0.5)"), msg
        assert "than this run's (standard parametrization)" in msg and "\n" not in msg
        assert world2[r]["untouched"]


def test_base_width_larger_than_the_model_is_refused():
    from hf3d.models import get_adapter
    from hf3d.optim.parametrization import build_parametrization

    config = _config("llama")
    with pytest.raises(ValueError, match="mup_base_width=96 is larger than this model's hidden_size=48"):
        build_parametrization("spectral_mup", 96, config, {}, get_adapter("llama").fan_axes, final_norm_name="x")


def test_lr_schedule_keeps_each_groups_scale():
    """hf3d train's schedule scales every group's lr by the same factor: µP's ratios stay, and the lr it logs
    (base_lr) is the schedule's value, before the scales."""
    from hf3d.train.lr_schedules import ScheduleConfig, base_lr, build_lr_scheduler

    w = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    opt = torch.optim.AdamW([dict(params=[w[0]], lr=1e-2, lr_scale=1.0), dict(params=[w[1]], lr=2.5e-3, lr_scale=0.25)])
    sched = build_lr_scheduler(opt, ScheduleConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, schedule="cosine"), 10)
    for _ in range(4):
        opt.step()
        sched.step()
        a, b = (g["lr"] for g in opt.param_groups)
        assert b == pytest.approx(0.25 * a, rel=1e-12) and base_lr(opt) == pytest.approx(a, rel=1e-12)
    bad = torch.optim.AdamW([dict(params=[w[0]], lr=1e-2, lr_scale=0.5)])  # lr not scaled: refused
    with pytest.raises(ValueError, match="optimizer param group 0 has lr 0.02"):
        build_lr_scheduler(bad, ScheduleConfig(lr=1e-2), 10)


def test_train_config_takes_the_keys():
    from hf3d.train.config import TrainConfig

    keys = ["parallel.parametrization=spectral_mup", "parallel.mup_base_width=48", "parallel.mup_output_multiplier=4"]
    cfg = TrainConfig.from_yaml(None, keys)
    assert (cfg.parallel.parametrization, cfg.parallel.mup_base_width) == ("spectral_mup", 48)
    assert cfg.parallel.mup_output_multiplier == 4.0
    assert cfg.to_dict()["parallel"]["mup_base_width"] == 48


def test_a_mup_run_says_so_at_start():
    """`hf3d train` under spectral µP prints one line: the widths, the groups' lr scales, the output multiplier;
    under SP nothing."""
    from types import SimpleNamespace

    from hf3d.train.build import _mup_lines
    from hf3d.train.config import TrainConfig

    keys = ["parallel.parametrization=spectral_mup", "parallel.mup_base_width=48", "parallel.mup_output_multiplier=4"]
    w = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [dict(params=[w[0]], lr_scale=1.0), dict(params=[w[1]], lr_scale=0.25), dict(params=[w[2]], lr_scale=0.25)]
    run = SimpleNamespace(cfg=TrainConfig.from_yaml(None, keys), opt=torch.optim.AdamW(groups, lr=1e-3),
                          pmodel=SimpleNamespace(config=SimpleNamespace(hidden_size=192)))  # fmt: skip
    assert _mup_lines(run) == [
        "spectral µP: hidden_size 192 over mup_base_width 48 (4x); lr scales 0.25, 1 across 3 parameter groups "
        f"(optim.lr {run.cfg.optim.lr:g} is the proxy's); output multiplier 4"
    ]
    run.cfg = TrainConfig.from_yaml(None, [])
    assert _mup_lines(run) == []
