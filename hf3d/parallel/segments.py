"""Rows whose documents share a prefix: the attention masks of scoring rows (hf3d/evaluation).

A multiple-choice example asks for the log-likelihood of n continuations after one context. Packed as n
documents, the context would run n times. Laid out as a tree instead, a row holds units, each unit being
the context once and then its continuations one after another:

    tokens    c c c c | a a | b b b | d        (context, continuations 1, 2 and 3)
    positions 0 1 2 3 | 4 5 | 4 5 6 | 4        (each continuation goes on from the context's end)
    doc       1 1 1 1 | 1 1 | 1 1 1 | 1        (the unit within its row; padding has a doc of its own)
    branch    0 0 0 0 | 1 1 | 2 2 2 | 3        (0: the shared context)

A token attends to the tokens of its own unit that are (a) in the context or in its own continuation and
(b) at a position not after its own, under the layer's rule (causal, or the sliding window) applied to the
positions: each continuation then sees exactly what it would see alone after the context, so its logits
are those of the plain sequence `context + continuation`. The rule is one mask function, given to the
attention implementation's own mask interface (sdpa's boolean mask, eager's additive one), as stock
composes its packed-document masks; under context parallelism the same function builds each query
chunk's mask (hf3d.parallel.context.build_masks).

flash_attention_* takes documents as varlen boundaries and no mask, so it cannot run a tree; with it (and
with flex_attention, not verified on a CPU) scoring packs each (context, continuation) pair as a document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    causal_mask_function,
    remap_positions_for_packed_sequence,
    sliding_window_causal_mask_function,
)

from .attention import DENSE_MASK_ATTENTION

TREE_ATTENTION = DENSE_MASK_ATTENTION  # the implementations whose masks can hold a shared prefix


@dataclass
class Segments:
    """Which unit (`doc`) and which part of it (`branch`: 0 the shared context, k > 0 the k-th continuation)
    each token of the rows belongs to, both [b, S] over the FULL rows (before any context-parallel split)."""

    doc: torch.Tensor
    branch: torch.Tensor

    def to(self, device) -> Segments:
        return Segments(self.doc.to(device), self.branch.to(device))

    def mask_function(self):
        """q may read kv when both are in one unit and kv is in the context or in q's own continuation."""
        doc, branch = self.doc, self.branch

        def same_unit_and_branch(batch_idx, head_idx, q_idx, kv_idx):
            kv_branch = branch[batch_idx, kv_idx]
            same_doc = doc[batch_idx, q_idx] == doc[batch_idx, kv_idx]
            return same_doc & ((kv_branch == 0) | (kv_branch == branch[batch_idx, q_idx]))

        return same_unit_and_branch


def layer_mask_function(config, kind: str):
    """Stock's rule for a layer of `kind` over positions: causal, or causal within the sliding window."""
    if kind == "sliding_attention":
        return sliding_window_causal_mask_function(config.sliding_window)
    return causal_mask_function


def tree_mask_function(config, kind: str, position_ids: torch.Tensor, segments: Segments):
    """The layer's rule on the tokens' positions, within what `segments` lets each token read."""
    on_positions = remap_positions_for_packed_sequence(layer_mask_function(config, kind), position_ids)
    return and_masks(on_positions, segments.mask_function())


def interface_mask(
    config, kind: str, fn, *, batch_size: int, q_length: int, q_offset: int, kv_length: int, dtype, device
):
    """A mask over keys [0, kv_length) for queries [q_offset, q_offset + q_length), built by the attention
    implementation's own mask interface from the mask function `fn` (never the is_causal shortcut)."""
    window = config.sliding_window if kind == "sliding_attention" else None
    return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=0,
        mask_function=fn,
        attention_mask=None,
        allow_is_causal_skip=False,
        local_size=window,
        dtype=dtype,
        config=config,
        device=device,
    )


def tree_masks(config, kinds, position_ids: torch.Tensor, segments: Segments, dtype: torch.dtype) -> dict:
    """{layer kind: mask} for whole rows [b, S] laid out as `segments` says (no context parallelism)."""
    if config._attn_implementation not in TREE_ATTENTION:
        raise ValueError(
            f"rows with shared prefixes need attn_implementation in {TREE_ATTENTION}, not "
            f"{config._attn_implementation!r}"
        )
    b, s = position_ids.shape
    return {
        kind: interface_mask(
            config,
            kind,
            tree_mask_function(config, kind, position_ids, segments),
            batch_size=b,
            q_length=s,
            q_offset=0,
            kv_length=s,
            dtype=dtype,
            device=position_ids.device,
        )
        for kind in kinds
    }
