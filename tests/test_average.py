"""`hf3d average`: the mean of checkpoints saved at different meshes against the mean computed in plain torch.

Three checkpoints of one tiny llama (vocab 101: padded under tp), each trained one AdamW step at its own lr and
saved at its own mesh (tp=2, pp=2, dp=2 with ZeRO-1, where each rank writes part of each bucket), are averaged
by the command; the oracle is the element-wise mean of the three stock models loaded from each run's own
`save_pretrained`, in fp32. The output loads with plain `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import VOCAB, make_model_dir  # noqa: E402
from reference import batches, hf3d_run  # noqa: E402

import hf3d  # noqa: E402
from hf3d.checkpoint.average import average_checkpoints  # noqa: E402
from hf3d.checkpoint.convert import checkpoint_to_hf  # noqa: E402
from hf3d.cli import main as cli_main  # noqa: E402

MESHES = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict()}
LRS = {"tp2": 5e-2, "pp2": 3e-2, "dp2": 1e-2}


def _save_worker(model_dir: str, out: str) -> None:
    start_watchdog(120)
    for name, pkw in MESHES.items():
        pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**pkw))
        rows = slice(2 * pm.dp_rank, 2 * pm.dp_rank + 2) if name == "dp2" else slice(None)
        _, _, opt = hf3d_run(pm, batches(1, 4, 8, VOCAB, seed=len(name) + int(name[-1])), rows, lr=LRS[name])
        hf3d.save_checkpoint(Path(out) / name, pm, opt, step=1)
        pm.save_pretrained(Path(out) / f"{name}-export")
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(tp=2), dtype=torch.bfloat16)  # bf16 + fp32 masters
    _, _, opt = hf3d_run(pm, batches(1, 4, 8, VOCAB, seed=7), slice(None), lr=2e-2)
    hf3d.save_checkpoint(Path(out) / "bf16", pm, opt, step=1)
    if dist.get_rank() == 0:  # one rank alone under the process group, as checkpoint.push_to_hub converts
        checkpoint_to_hf(Path(out) / "tp2", Path(out) / "tp2-alone")  # no collective: rank 1 waits in report
        average_checkpoints([Path(out) / "tp2", Path(out) / "pp2"], Path(out) / "avg-alone", dtype="float32")
    report(None, Path(out) / "done.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("average")
    spawn(_save_worker, 2, str(make_model_dir(root / "model", "llama")), str(root))
    return root


def _state(d: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()


def test_the_mean_of_three_meshes_is_the_plain_torch_mean(saved, capsys):
    runs = [_state(saved / f"{name}-export") for name in MESHES]
    assert not torch.equal(runs[0]["model.embed_tokens.weight"], runs[1]["model.embed_tokens.weight"])
    expected = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}

    ckpts = [str(saved / name) for name in MESHES]
    assert cli_main(["average", *ckpts, "--out", str(saved / "avg32"), "--dtype", "float32"]) == 0
    assert f"wrote {saved / 'avg32'}: the mean of 3 checkpoints" in capsys.readouterr().out
    got = _state(saved / "avg32")  # plain transformers loads it
    assert got.keys() == expected.keys()
    for k in expected:  # the same fp32 sums in the same order, then one division: bit for bit
        assert torch.equal(got[k], expected[k]), k
    assert not torch.equal(got["model.norm.weight"], runs[0]["model.norm.weight"])
    alone = _state(saved / "avg-alone")  # written by rank 0 alone under a process group of 2
    assert all(torch.equal(alone[k], (runs[0][k] + runs[1][k]) / 2) for k in alone)
    tp2 = _state(saved / "tp2-alone")
    assert all(torch.equal(tp2[k], runs[0][k]) for k in tp2)

    average_checkpoints(ckpts, saved / "avg16", max_shard_size=20_000)  # bf16 by default, several shards
    shards = sorted(p.name for p in (saved / "avg16").glob("*.safetensors"))
    assert len(shards) > 1, shards
    model = AutoModelForCausalLM.from_pretrained(saved / "avg16")
    assert model.dtype == torch.bfloat16
    for k, v in model.state_dict().items():  # the fp32 mean, rounded once
        assert torch.equal(v, got[k].to(torch.bfloat16)), k


def test_the_order_of_the_inputs_does_not_matter_beyond_rounding(saved):
    names = list(MESHES)
    a = average_checkpoints([saved / n for n in names], saved / "fwd", dtype="float32")
    b = average_checkpoints([saved / n for n in reversed(names)], saved / "rev", dtype="float32")
    sa, sb = _state(a), _state(b)
    worst = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    assert worst <= 4e-6, worst  # fp32 sums in another order: measured 2.4e-7


def test_a_bf16_run_contributes_its_fp32_masters(saved):
    from safetensors.torch import load_file

    masters = load_file(checkpoint_to_hf(saved / "bf16", saved / "bf16-masters", dtype="float32") / "model.safetensors")
    other = _state(saved / "tp2-export")
    got = _state(average_checkpoints([saved / "bf16", saved / "tp2"], saved / "mixed", dtype="float32"))
    for k in masters:  # fp32 masters, not the bf16 weights upcast: bit for bit the fp32 mean
        assert torch.equal(got[k], (masters[k] + other[k]) / 2), k
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())
