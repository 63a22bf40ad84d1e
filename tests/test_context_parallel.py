"""Context parallelism (hf3d.context_parallel) against stock transformers on the whole, unsplit sequence.

Pure functions first (no processes): the head-tail split and its inverse, and the per-chunk masks
against stock's own full-sequence masks (sdpa and eager, full and sliding-window layers, packed
documents that cross the chunk boundaries).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

sys.path.insert(0, str(Path(__file__).parent))

from models import tiny_config  # noqa: E402

from hf3d.context_parallel import (  # noqa: E402
    CPContext,
    build_masks,
    head_tail_chunks,
    split_sequence,
    to_rank_order,
    to_sequence_order,
)


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
