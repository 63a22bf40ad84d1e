"""The attention backend: what "auto" resolves to per device, and packed documents under flash attention.

flash-attn needs CUDA, so the flash path is checked on CPU with a stand-in registered under
"flash_attention_2": it runs causal attention over the varlen sequences it is given, and, given none,
over each whole row, as transformers' flash path does at batch > 1 (a batch of one row is the only case
where transformers derives the sequences from position ids itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist import report, spawn, start_watchdog  # noqa: E402
from models import make_model_dir  # noqa: E402

from hf3d.parallel.attention import resolve_attn_implementation, varlen_kwargs  # noqa: E402


@pytest.mark.parametrize(
    "device, masking, flash, expected",
    [
        ("cpu", True, True, "sdpa"),
        ("cpu", False, False, "sdpa"),
        ("cuda", True, True, "flash_attention_2"),
        ("cuda", False, True, "flash_attention_2"),
        ("cuda", True, False, "flex_attention"),  # a block mask, not sdpa's dense one (compiled layers)
        ("cuda", False, False, "sdpa"),
    ],
)
def test_auto_attention_depends_on_the_device(device, masking, flash, expected):
    resolved = resolve_attn_implementation(
        "auto", device, document_masking=masking, flash_available=flash, compiled=True
    )
    assert resolved == expected
    for explicit in ("eager", "sdpa", "flex_attention", "flash_attention_2"):  # a user's choice is kept
        kept = resolve_attn_implementation(explicit, device, document_masking=masking, flash_available=flash)
        assert kept == explicit


def test_a_cpu_run_resolves_to_sdpa():
    from hf3d.train.config import ModelConfig

    assert ModelConfig().attn_implementation == "auto"
    assert resolve_attn_implementation("auto", "cpu", document_masking=True, flash_available=True) == "sdpa"


def test_varlen_boundaries_restart_per_document_and_per_row():
    # row 0: two documents; row 1 starts inside a document (position 3), then a new one
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [3, 4, 5, 0, 1, 2, 3, 4]])
    kw = varlen_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 8, 11, 16] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_q"] == kw["max_length_k"] == 5


def _stand_in_flash(module, q, k, v, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs):
    """Causal attention over each varlen sequence of the flattened batch; q [b, heads, s, d]."""
    assert attention_mask is None, "flash takes no mask"
    b, h, s, d = q.shape
    cu = cu_seq_lens_q.tolist() if cu_seq_lens_q is not None else list(range(0, b * s + 1, s))
    q, k, v = (x.transpose(0, 1).reshape(x.shape[1], b * s, d) for x in (q, k, v))
    k, v = (x.repeat_interleave(h // x.shape[0], dim=0) for x in (k, v))
    out = torch.empty_like(q)
    for a, e in zip(cu[:-1], cu[1:]):
        out[:, a:e] = F.scaled_dot_product_attention(q[:, a:e], k[:, a:e], v[:, a:e], is_causal=True, scale=scaling)
    return out.reshape(h, b, s, d).permute(1, 2, 0, 3), None


def _flash_worker(model_dir, out):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf3d

    start_watchdog(120)
    ALL_ATTENTION_FUNCTIONS._global_mapping["flash_attention_2"] = _stand_in_flash
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig())
    res = {"auto": pm.config._attn_implementation}
    pm.eval()
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (2, 16))
    pos = torch.tensor([list(range(6)) + list(range(10)), list(range(3, 11)) + list(range(8))])
    with torch.no_grad():
        res["sdpa"] = pm.logits(ids, pos)  # dense document mask
        pm.config._attn_implementation = "flash_attention_2"
        res["flash"] = pm.logits(ids, pos)
    report(res, out)


def test_flash_attention_keeps_packed_documents_apart_at_batch_2(tmp_path):
    """Two packed rows (one starting mid-document) under the flash path give the logits of sdpa's dense
    document mask: hf3d hands the kernel the document boundaries, which transformers would not derive
    from position ids at batch > 1 (without them, the rows attend across documents: max |Δ| 0.37)."""
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    spawn(_flash_worker, 1, model_dir, tmp_path / "out.pt")
    (res,) = torch.load(tmp_path / "out.pt")
    assert res["auto"] == "sdpa"  # a CPU run
    delta = (res["flash"] - res["sdpa"]).abs().max().item()
    assert delta < 2e-6, delta  # measured 1.2e-7 (0.37 without the boundaries)
