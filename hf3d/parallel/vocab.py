"""Token ids and labels outside the vocabulary: found without a host sync, reported in one line."""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from .tensor import IGNORE_INDEX


def check_vocab(pmodel, input_ids: torch.Tensor, labels: torch.Tensor, labels_name: str) -> None:
    """Raise on an id outside the vocabulary in any dp replica's rows (collective over dp)."""
    out_of_vocab = vocab_flag(pmodel, input_ids, labels)
    if pmodel.dp_size > 1:
        dist.all_reduce(out_of_vocab, group=pmodel.mesh.get_group("dp"))
    if out_of_vocab.item():
        dp_group = pmodel.mesh.get_group("dp") if pmodel.dp_size > 1 else None
        raise_out_of_vocab(pmodel, input_ids, labels, dp_group=dp_group, labels_name=labels_name)


def vocab_flag(pmodel, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """1.0 when an id is outside [0, vocab_size) or a label is neither -100 nor inside it, else 0.0.
    One min/max reduction per tensor and no host sync; where the bad value sits is found only on failure."""
    v = pmodel.config.vocab_size
    flag = torch.zeros((), device=input_ids.device)
    tensors = [input_ids] if labels is None else [input_ids, labels.masked_fill(labels == IGNORE_INDEX, 0)]
    for t in tensors:
        if t.numel():
            lo, hi = torch.aminmax(t)
            flag = torch.maximum(flag, ((lo < 0) | (hi >= v)).float())
    return flag


def drop_out_of_vocab(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Targets outside [0, vocab_size) ignored (-100), without a host sync: a step whose check was deferred
    runs its forward on them before it is refused. Input ids need no such care: the vocab-parallel
    embedding reads zeros for ids outside its rows."""
    bad = (targets >= vocab_size) | ((targets < 0) & (targets != IGNORE_INDEX))
    return targets.masked_fill(bad, IGNORE_INDEX)


def raise_out_of_vocab(
    pmodel, input_ids: torch.Tensor, labels: torch.Tensor | None, *, dp_group, labels_name: str = "labels"
) -> NoReturn:
    """Raise one ValueError naming the first bad value. With dp_group this is collective over dp: every
    dp rank reports the same value, also the ranks whose own rows are all valid."""
    v = pmodel.config.vocab_size
    found = torch.full((5,), -1, dtype=torch.int64, device=input_ids.device)  # [dp rank, tensor, row, col, value]
    checks = [(input_ids < 0) | (input_ids >= v)]
    if labels is not None:
        checks.append(((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= v))
    for which, (tensor, bad) in enumerate(zip((input_ids, labels), checks)):
        hits = bad.nonzero()
        if len(hits):
            row, col = hits[0].tolist()
            found = torch.tensor([pmodel.dp_rank, which, row, col, int(tensor[row, col])], device=found.device)
            break
    if dp_group is not None:
        everyone = [torch.empty_like(found) for _ in range(pmodel.dp_size)]
        dist.all_gather(everyone, found, group=dp_group)
        found = next(f for f in everyone if f[0] >= 0)
    dp_rank, which, row, col, value = found.tolist()
    where = f" on dp rank {dp_rank}" if dp_group is not None else ""
    if which == 0:
        what, rule = f"input_ids[{row}, {col}] = {value}{where}", f"token ids must be in [0, {v})"
    else:
        what = f"{labels_name}[{row}, {col}] = {value}{where}"
        rule = f"{labels_name} must be -100 (ignored) or in [0, {v})"
    raise ValueError(
        f"{what} is outside the model's vocabulary (vocab_size={v}): {rule}; "
        "check that the tokenizer and the model match"
    )
