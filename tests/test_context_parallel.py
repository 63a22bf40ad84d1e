"""Context parallelism (hf3d.parallel.context) against stock transformers on the whole, unsplit sequence.

Every distributed case uses packed documents (position ids that restart, documents crossing the chunk
boundaries at every cp here, labels at document starts ignored) and checks, in fp32 on gloo, against
the stock model on the full rows (+ torch AdamW, clip_grad_norm_): the logits before training, eval_loss,
the loss and grad norm of 3 steps, and the exported weights after them.
- world 2: cp=2 (sdpa; eager logits; recompute="full" with the plain head), a cp=2 checkpoint
  resumed at dp=2 (cp=1) and the reverse, and three mutations that the logits check must catch: K/V put
  back in rank order instead of sequence order (wrong chunk order), one K/V block masked out for every
  later query chunk (a block skipped), and the position ids of each chunk restarted at 0.
- world 4: cp=2 x tp=2 (with and without sequence parallelism), cp=2 x pp=2 under every schedule,
  cp=2 x dp=2 and cp=4.
Families: CP_FAMILIES (llama; smollm3 joins by itself when tests/models.py has it).
Pure functions (no processes): the head-tail split and its inverse, and the per-chunk masks against
stock's own full-sequence masks (sdpa and eager, full and sliding-window layers, packed documents).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

sys.path.insert(0, str(Path(__file__).parent))

from dist import V_SCHEDULES, compat, report, spawn, start_watchdog  # noqa: E402
from models import FAMILIES, VOCAB, make_model_dir, tiny_config  # noqa: E402
from reference import batches, dp_rows, oracle_adamw, reference_run  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf3d  # noqa: E402
from hf3d.parallel.context import (
    CPContext,
    build_masks,
    head_tail_chunks,
    split_sequence,
    to_rank_order,
    to_sequence_order,
)

# the hook for SmolLM3 (NoPE layers, sliding window): its family joins every case here once
# tests/models.py defines it
CP_FAMILIES = ["llama"] + [f for f in ("smollm3",) if f in FAMILIES]
BATCH, SEQ, STEPS, LAYERS = 4, 24, 3, 4  # SEQ: 2*cp chunks at cp 2 and 4, and S/cp divisible by tp=2
WATCHDOG_S = 500
# measured over every llama case here (smollm3 passes within the same bounds): max|Δlogits| 2.4e-7,
# loss rel 1.0e-7 (eval loss 2.1e-7), grad norm rel 1.2e-7, max|Δw| after 3 steps 3.1e-7 (AdamW's eps at
# reference.EPS on both sides; 6.8e-6 at torch's default, tests/reference.py says why); mutated logits move by
# 2.3e-3 to 0.62
LOGITS_ATOL = 5e-6
LOSS_RTOL = 4e-6
NORM_RTOL = 2.5e-6
WEIGHT_ATOL = 5e-6
MUTATION_MIN = 100 * LOGITS_ATOL  # a mutated run's logits must be at least this far from stock's


def _packed_positions(batch: int, seq: int) -> torch.Tensor:
    """Position ids that restart (documents of 7, 10, ... tokens: they cross every chunk boundary at the
    sizes used here); the last row is one unbroken document."""
    rows = []
    for r in range(batch - 1):
        lengths, total = [], 0
        while total < seq:
            lengths.append(min(7 + 3 * ((len(lengths) + r) % 3), seq - total))
            total += lengths[-1]
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    rows.append(torch.arange(seq))
    return torch.stack(rows)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_and_order_round_trip(cp):
    s = 2 * cp * 3
    x = torch.arange(2 * s).reshape(2, s)
    parts = torch.stack([split_sequence(x, cp, r) for r in range(cp)])
    assert torch.equal(to_sequence_order(parts), x)
    assert torch.equal(to_rank_order(x, cp), parts)
    c = s // (2 * cp)
    for r in range(cp):  # rank r holds chunk r then chunk 2cp-1-r
        assert head_tail_chunks(cp, r) == (r, 2 * cp - 1 - r)
        assert torch.equal(parts[r, 0, :c], torch.arange(r * c, (r + 1) * c))
        assert torch.equal(parts[r, 0, c:], torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    # every rank does the same causal work: (r + 1) + (2cp - r) blocks of keys
    assert {sum(i + 1 for i in head_tail_chunks(cp, r)) for r in range(cp)} == {2 * cp + 1}


def test_seq_len_rule():
    """S must cut into 2*cp chunks, and under sequence parallelism each rank's S/cp tokens into tp parts."""
    from hf3d.parallel.config import check_cp_seq_len

    check_cp_seq_len(30, cp=1, tp=4, sequence_parallel=True)  # no cp: no rule here
    check_cp_seq_len(24, cp=2, tp=3, sequence_parallel=True)  # 24 = 6 chunks of 4; 12 tokens per rank, 3 | 12
    with pytest.raises(ValueError, match=r"seq_len=30 is not a multiple of 4 \(2\*cp = 4\)"):
        check_cp_seq_len(30, cp=2, tp=1, sequence_parallel=False, where="seq_len")
    with pytest.raises(ValueError, match=r"seq_len=32 is not a multiple of 12 \(2\*cp = 4 and cp\*tp = 6 under"):
        check_cp_seq_len(32, cp=2, tp=3, sequence_parallel=True, where="seq_len")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("packed", [True, False])
def test_chunk_masks_are_stock_masks(impl, kind, packed):
    """Each query chunk's mask over its causal prefix of keys is the matching block of stock's full
    mask, and stock masks every key after that prefix (so reading only the prefix loses nothing)."""
    cfg = tiny_config("llama", sliding_window=5)
    cfg._attn_implementation = impl
    s, cp = 24, 3
    pos = _packed_positions(3, s) if packed else torch.arange(s).repeat(3, 1)
    build = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
    full = build(
        config=cfg,
        inputs_embeds=torch.empty(3, s, 1),
        attention_mask=None,
        cache=None,
        position_ids=pos,
        allow_is_causal_skip=False,
    )
    blocked = False if impl == "sdpa" else torch.finfo(torch.float32).min
    c = s // (2 * cp)
    for r in range(cp):
        m = build_masks(cfg, kind, pos, CPContext(None, r, cp), torch.float32)
        for i, mask, end in zip(head_tail_chunks(cp, r), m.masks, m.kv_ends):
            assert end == (i + 1) * c
            block = full[:, :, i * c : (i + 1) * c]
            assert torch.equal(mask, block[..., :end]), (r, i)
            assert (block[..., end:] == blocked).all()


# ------------------------------------------------------------------------------------------------
# Distributed cases (spawned; module-level so that spawn pickles them by name)
# ------------------------------------------------------------------------------------------------
def _data():
    """STEPS batches of (ids, labels) and the packed position ids; labels at document starts ignored."""
    pos = _packed_positions(BATCH, SEQ)
    out = []
    for ids, labels in batches(STEPS, BATCH, SEQ, VOCAB):
        labels = labels.masked_fill(pos == 0, -100)
        out.append((ids, labels))
    return out, pos


def _train(pm, data, pos, rows: slice, steps=range(STEPS), opt=None):
    opt = opt or oracle_adamw(pm)
    losses, norms = [], []
    for i in steps:
        ids, labels = data[i]
        losses.append(pm.train_step(ids[rows], labels[rows], position_ids=pos[rows]).item())
        norms.append(opt.step().item())
        opt.zero_grad()
    return losses, norms, opt


def _case(res, out, name, path, data, pos, *, train=True, attn="sdpa", **pcfg):
    pm = hf3d.parallelize(path, hf3d.ParallelConfig(**pcfg), attn_implementation=attn)
    rows = dp_rows(pm, BATCH)
    ids, labels = data[0]
    with torch.no_grad():
        r = {"logits": pm.eval()(input_ids=ids[rows], position_ids=pos[rows]).logits.detach().clone()}
    pm.train()
    loss_sum, count = pm.eval_loss(ids[rows], labels=labels[rows], position_ids=pos[rows])
    r["eval_loss"] = (loss_sum / count).item()
    if train:
        r["losses"], r["norms"], _ = _train(pm, data, pos, rows)
        pm.save_pretrained(Path(out) / name)
    r["rows"] = rows
    res[name] = r
    return pm


def _mutations(res, path, data, pos):
    """This rank's own logits (before any gather) with one deliberate bug each, patched in this process."""
    import hf3d.parallel.context as cpm

    ids, _ = data[0]
    pm = hf3d.parallelize(path, hf3d.ParallelConfig(cp=2))
    res["mutation/cp_rank"] = pm.cp_rank

    def loss():  # the local logits [b, S/cp, vocab] of this rank's tokens
        with torch.no_grad():
            return pm.lm_head.full_logits(pm.stages[0](pm.cp.split(ids), position_ids=pos)).clone()

    res["mutation/none"] = loss()
    original_order, original_masks = cpm.to_sequence_order, cpm.build_masks
    original_positions = cpm.CPContext.local_positions
    cpm.to_sequence_order = lambda parts, dim=1: torch.cat(list(parts), dim=dim)  # rank order, not sequence order
    res["mutation/chunk-order"] = loss()
    cpm.to_sequence_order = original_order

    def skip_block(config, kind, position_ids, ctx, dtype, segments=None):
        m = original_masks(config, kind, position_ids, ctx, dtype, segments)
        for i, mask in zip(head_tail_chunks(ctx.size, ctx.rank), m.masks):
            if i > 0:  # sdpa: a bool mask; chunk 0's keys never reach a later query chunk
                mask[..., : m.chunk] = False
        return m

    cpm.build_masks = skip_block
    res["mutation/kv-block-skipped"] = loss()
    cpm.build_masks = original_masks

    def restarted(self, position_ids):
        c = position_ids.shape[1] // (2 * self.size)
        return torch.arange(c).repeat(2).expand(position_ids.shape[0], -1)

    cpm.CPContext.local_positions = restarted
    res["mutation/positions-per-chunk"] = loss()
    cpm.CPContext.local_positions = original_positions


def _checkpoints(res, out, path, data, pos):
    """Step 1 at one mesh, checkpoint, steps 2-3 at the other: cp=2 -> dp=2 and dp=2 -> cp=2."""
    for first, second in (({"cp": 2}, {"dp": 2}), ({"dp": 2}, {"cp": 2})):
        tag = f"ckpt/{'cp2' if 'cp' in first else 'dp2'}-to-{'cp2' if 'cp' in second else 'dp2'}"
        losses = []
        for k, cfg in enumerate((first, second)):
            pm = hf3d.parallelize(path, hf3d.ParallelConfig(**cfg))
            rows = dp_rows(pm, BATCH)
            opt = oracle_adamw(pm)
            if k == 0:
                losses += _train(pm, data, pos, rows, steps=range(1), opt=opt)[0]
                hf3d.save_checkpoint(Path(out) / tag, pm, opt, step=1)
            else:
                assert hf3d.load_checkpoint(Path(out) / tag, pm, opt) == 1
                losses += _train(pm, data, pos, rows, steps=range(1, STEPS), opt=opt)[0]
        res[tag] = losses


def _world2(dirs, data, pos, out):
    start_watchdog(WATCHDOG_S)
    res = {}
    for f in CP_FAMILIES:
        _case(res, out, f"{f}/cp2", dirs[f], data, pos, cp=2)
        _case(res, out, f"{f}/cp2-eager", dirs[f], data, pos, train=False, attn="eager", cp=2)
        pm = _case(res, out, f"{f}/cp2-recompute", dirs[f], data, pos, train=False, cp=2, recompute="full")
        pm.fused_loss = False  # the plain head under recompute
        res[f"{f}/cp2-recompute"].update(zip(("losses", "norms"), _train(pm, data, pos, slice(None))[:2]))
        pm.save_pretrained(Path(out) / f"{f}/cp2-recompute")
    _mutations(res, dirs["llama"], data, pos)
    _checkpoints(res, out, dirs["llama"], data, pos)
    report(res, Path(out) / "results.pt")


WORLD4_CASES = {
    "cp2-tp2": dict(cp=2, tp=2),
    "cp2-tp2-sp": dict(cp=2, tp=2, sequence_parallel=True),
    "cp2-dp2": dict(cp=2, dp=2),
    "cp4": dict(cp=4),
    **{
        f"cp2-pp2-{s}": dict(cp=2, pp=2, pp_schedule=s, num_microbatches=4)
        for s in ("afab", "1f1b", "interleaved-1f1b", *(() if compat.BEFORE_2_13 else V_SCHEDULES))
    },
}


def _world4(dirs, data, pos, out):
    start_watchdog(WATCHDOG_S)
    res = {}
    for f in CP_FAMILIES:
        for case, pcfg in WORLD4_CASES.items():
            _case(res, out, f"{f}/{case}", dirs[f], data, pos, **pcfg)
    report(res, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def cp_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp-models")
    return {f: str(make_model_dir(root / f, f, num_hidden_layers=LAYERS)) for f in CP_FAMILIES}


@pytest.fixture(scope="module")
def stock(cp_dirs):
    """{family: (logits sdpa, logits eager, eval loss, (losses, norms, state dict))} of stock on full rows."""
    data, pos = _data()
    ids, labels = data[0]
    out = {}
    for f, path in cp_dirs.items():
        refs = []
        for attn in ("sdpa", "eager"):
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
            with torch.no_grad():
                refs.append(model(ids, labels=labels, position_ids=pos, use_cache=False))
        out[f] = (refs[0].logits, refs[1].logits, refs[0].loss.item(), reference_run(path, data, position_ids=pos))
    return out


def _spawn(world, fn, cp_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cp-world{world}")
    data, pos = _data()
    spawn(fn, world, cp_dirs, data, pos, str(out))
    results = torch.load(out / "results.pt", weights_only=False)
    assert len(results) == world
    return results, out


@pytest.fixture(scope="module")
def world2(cp_dirs, tmp_path_factory):
    return _spawn(2, _world2, cp_dirs, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(cp_dirs, tmp_path_factory):
    return _spawn(4, _world4, cp_dirs, tmp_path_factory)


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no safetensors in {path}"
    return out


def _check(results, out, stock, family, case, *, attn="sdpa", trained=True):
    logits_sdpa, logits_eager, ref_loss, (ref_losses, ref_norms, ref_sd) = stock[family]
    ref_logits = logits_eager if attn == "eager" else logits_sdpa
    key = f"{family}/{case}"
    for rank, r in enumerate(results):
        res = r[key]
        err = (res["logits"] - ref_logits[res["rows"]]).abs().max().item()
        assert err <= LOGITS_ATOL, f"{key} rank {rank}: max|Δlogits| {err:.2e}"
        rel = abs(res["eval_loss"] - ref_loss) / ref_loss
        assert rel <= LOSS_RTOL, f"{key} rank {rank}: eval loss {res['eval_loss']!r} vs stock {ref_loss!r}"
        if not trained:
            continue
        for step, (a, b) in enumerate(zip(res["losses"], ref_losses, strict=True)):
            assert abs(a - b) <= LOSS_RTOL * b, f"{key} rank {rank} step {step}: loss {a!r} vs stock {b!r}"
        for step, (a, b) in enumerate(zip(res["norms"], ref_norms, strict=True)):
            assert abs(a - b) <= NORM_RTOL * b, f"{key} rank {rank} step {step}: grad norm {a!r} vs stock {b!r}"
    if trained:
        saved = _safetensors(out / family / case)
        assert set(saved) <= set(ref_sd) and "model.embed_tokens.weight" in saved
        for k, w in saved.items():
            err = (w - ref_sd[k]).abs().max().item()
            assert err <= WEIGHT_ATOL, f"{key}: {k} max|Δw| {err:.2e} after {STEPS} steps"


@pytest.mark.parametrize("family", CP_FAMILIES)
@pytest.mark.parametrize("case", ["cp2", "cp2-recompute"])
def test_cp2_matches_stock(world2, stock, family, case):
    results, out = world2
    _check(results, out, stock, family, case)


@pytest.mark.parametrize("family", CP_FAMILIES)
def test_cp2_eager_logits(world2, stock, family):
    results, out = world2
    _check(results, out, stock, family, "cp2-eager", attn="eager", trained=False)


@pytest.mark.parametrize("family", CP_FAMILIES)
@pytest.mark.parametrize("case", list(WORLD4_CASES))
def test_world4_matches_stock(world4, stock, family, case):
    results, out = world4
    _check(results, out, stock, family, case)


def test_mutations_fail_parity(world2, stock):
    """Each deliberate bug moves a rank's own logits far past LOGITS_ATOL from stock's logits of the same
    tokens (the parity checks above would fail); the unmutated run stays within it."""
    for r in world2[0]:
        ref = split_sequence(stock["llama"][0], 2, r["mutation/cp_rank"])
        assert (r["mutation/none"] - ref).abs().max().item() <= LOGITS_ATOL
        for bug in ("chunk-order", "kv-block-skipped", "positions-per-chunk"):
            err = (r[f"mutation/{bug}"] - ref).abs().max().item()
            assert err >= MUTATION_MIN, f"mutation {bug}: logits only {err:.1e} off stock: parity cannot see it"


@pytest.mark.parametrize("direction", ["cp2-to-dp2", "dp2-to-cp2"])
def test_checkpoint_across_cp(world2, stock, direction):
    """A checkpoint written at cp=2 resumes at cp=1 (dp=2), and the reverse: steps 2-3 match stock."""
    ref_losses = stock["llama"][3][0]
    for r in world2[0]:
        for step, (a, b) in enumerate(zip(r[f"ckpt/{direction}"], ref_losses, strict=True)):
            assert abs(a - b) <= LOSS_RTOL * b, f"{direction} step {step}: loss {a!r} vs stock {b!r}"
