"""Which attention kernel a run uses, and what packed documents need from it.

Document masking (position ids that restart at each document) costs different things per backend:

- sdpa: transformers' mask builder turns the restarts into a dense [b, 1, s, s] boolean mask, and an
  explicit mask rules out SDPA's flash kernel on GPU (it falls back to the memory-efficient or math one).
- flex_attention: the same rule becomes a BlockMask, which skips the blocks across documents.
- flash_attention_2: no mask at all; `masking_utils.flash_attention_mask` returns None when no padding
  mask is given, and the kernel's varlen entry takes the document boundaries as cumulative lengths. But
  transformers derives those from position ids only for a batch of ONE row (`_is_packed_sequence` in
  modeling_flash_attention_utils); at batch > 1 it silently runs plain causal attention over each whole
  row, across documents. hf3d therefore computes the boundaries itself (`varlen_kwargs`) and passes them
  as `cu_seq_lens_q/k` and `max_length_q/k`, which the flash path takes ahead of the position ids.

"auto" (the default) picks: on CUDA, flash_attention_2 when the flash-attn package imports, else
flex_attention when documents are masked and the layers are compiled (flex_attention is meant to run
compiled: eager, with a document block mask, it ran 0.58x sdpa on an H200), else sdpa; on CPU, and under
context parallelism, sdpa.
"""

from __future__ import annotations

import importlib.util

import torch

AUTO = "auto"
# the kernels that take transformers' dense [b, 1, q, k] boolean mask: it can hold any pattern (a query chunk at
# its offset, documents sharing a prefix) and costs b x q x k bytes; flash and flex attention build no such mask
DENSE_MASK_ATTENTION = ("sdpa", "eager")


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(
    requested: str,
    device: str,
    *,
    document_masking: bool,
    flash_available: bool,
    cp: int = 1,
    compiled: bool = False,
) -> str:
    """The attention backend to build the model with: `requested` itself unless it is "auto"."""
    if requested != AUTO:
        return requested
    if device != "cuda" or cp > 1:  # context parallelism runs sdpa or eager (hf3d.parallel.context)
        return "sdpa"
    if flash_available:
        return "flash_attention_2"
    return "flex_attention" if document_masking and compiled else "sdpa"


def is_flash(attn_implementation: str) -> bool:
    return attn_implementation.startswith("flash_attention")


def varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """The flash varlen arguments for rows [b, s] of packed documents, flattened to b·s tokens: a
    sequence starts at each row's first token and wherever the position does not follow the previous
    one (a row may start inside a document, at a position above 0). max_length is a host int, one
    device sync per stage forward (flash-attn needs it on the host)."""
    b, s = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    index = starts.reshape(-1).nonzero().reshape(-1)
    end = torch.tensor([b * s], device=index.device, dtype=index.dtype)
    cu = torch.cat([index, end]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
