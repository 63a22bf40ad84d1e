"""Windows of seq_len + 1 tokens -> input_ids, shift_labels, position_ids.

A window `w` of the concatenated documents (each ending with its EOS) gives `input_ids = w[:-1]` and
the pre-shifted labels `shift_labels = w[1:]` (HF's ForCausalLMLoss name: label j is the target of
input j). Consecutive windows do not share a token (see TokenSource).

With document masking, position ids restart at 0 at each document start (a window that starts in
the middle of a document starts at 0 too), and the label whose target is the first token of the
next document is -100. Restarting position ids with no attention mask make HF's mask builder (and
hf3d's) build a block-diagonal causal mask, so no token attends across documents and no document's
last token is trained to predict the next document. Without masking: positions 0..seq_len-1 and
every label kept.
"""

from __future__ import annotations

import numpy as np
import torch

from ..parallel.tensor import IGNORE_INDEX


def pack_window(window: np.ndarray, doc_starts: np.ndarray, *, document_masking: bool) -> tuple[np.ndarray, ...]:
    """(input_ids, shift_labels, position_ids), each int64 [seq_len], from one window [seq_len + 1]
    and the offsets in (0, seq_len + 1) where documents start inside it."""
    seq_len = len(window) - 1
    input_ids = window[:-1].astype(np.int64)
    labels = window[1:].astype(np.int64)
    if not document_masking:
        return input_ids, labels, np.arange(seq_len, dtype=np.int64)
    labels[doc_starts - 1] = IGNORE_INDEX  # the target of input j is token j + 1
    first = np.zeros(seq_len, dtype=np.int64)  # [seq_len] start offset of each input's document
    inside = doc_starts[doc_starts < seq_len]
    first[inside] = inside
    np.maximum.accumulate(first, out=first)
    return input_ids, labels, np.arange(seq_len, dtype=np.int64) - first


def collate(rows: list[tuple[np.ndarray, ...]]) -> dict[str, torch.Tensor]:
    """Packed rows -> {input_ids, shift_labels, position_ids}: LongTensor [rows, seq_len] each."""
    names = ("input_ids", "shift_labels", "position_ids")
    return {name: torch.from_numpy(np.stack([r[i] for r in rows])) for i, name in enumerate(names)}
