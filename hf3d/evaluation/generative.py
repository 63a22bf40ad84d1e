"""Generative tasks: each row's context (with its few-shot rows, each its query and answer) answered by greedy
generation at the model's mesh (ParallelModel.generate), scored by exact match after a normalisation.

The normalisation is GSM8K's: the final number of a text (after "####" when the text has one, as GSM8K's
reference solutions do), its thousands separators and a "$" dropped, a trailing ".0..." dropped: "The total is
$1,234.50." and "#### 1234.5" both give "1234.5". A row is right when the generated text's number equals the
answer's; a text without a number is wrong. The generated text ends at the first stop string (cfg.stop; the
generation stops there too), and a context longer than the window left for it (max_length - max_new_tokens) is
cut from the left.

The rows are split over dp in contiguous blocks; each replica generates its block in batches of batch_rows
(under expert parallelism every rank of the group runs as many batches as the one with most).
"""

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist

from .metrics import TaskResult

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number of `text` (after "####" when there is one), normalised; None when there is none."""
    if "####" in text:
        text = text.split("####")[-1]
    found = NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    number = found[-1].replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to its first stop string."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text


def generate_block(pmodel, tokenizer, contexts: list[str], cfg, window: int) -> tuple[list[str], int]:
    """This replica's contexts answered: (texts cut at the stop strings, contexts cut from the left)."""
    from ..generation.decode import new_tokens
    from ..utils.tokens import cut_left

    keep = window - cfg.max_new_tokens
    if keep < 1:
        raise ValueError(
            f"the evaluation's max_new_tokens={cfg.max_new_tokens} leaves no room for a context in the window of "
            f"{window} tokens: lower max_new_tokens or raise max_length"
        )
    tok = copy.copy(tokenizer)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    shortened = [cut_left(ctx, keep, tok) for ctx in contexts]  # only what the window holds is encoded
    ids = [list(x) for x in tok([ctx for ctx, _ in shortened])["input_ids"]] if contexts else []
    cut = sum(len(x) > keep or chars for x, (_, chars) in zip(ids, shortened))
    ids = [x[-keep:] for x in ids]
    rows = cfg.batch_rows or 8
    chunks = [ids[i : i + rows] for i in range(0, len(ids), rows)]
    if pmodel.lockstep:  # the expert group (ZeRO-3: the shard group) generates together: as many batches everywhere
        most = torch.tensor([len(chunks)], device=pmodel.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pmodel.mesh.get_group("dp"))
        chunks += [None] * (int(most) - len(chunks))
    eos = pmodel.config.eos_token_id if tok.eos_token_id is None else tok.eos_token_id
    texts = []
    for chunk in chunks:
        batch = chunk or [[pad]]
        width = max(len(x) for x in batch)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        out = pmodel.generate(
            input_ids, mask, max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=pad,
            stop_strings=list(cfg.stop) or None, tokenizer=tok,
        )  # fmt: skip
        for row in out[:, width:] if chunk else ():
            texts.append(cut_at_stop(tok.decode(new_tokens(row, eos), skip_special_tokens=True), cfg.stop))
    return texts, cut


def score_generative(pmodel, tokenizer, task, contexts: list[str], cfg, window: int) -> TaskResult:
    """A generative task's exact match at the model's mesh; the same result on every rank."""
    n, d, dp = len(task.rows), pmodel.dp_rank, pmodel.dp_size
    lo, hi = d * n // dp, (d + 1) * n // dp
    texts, cut = generate_block(pmodel, tokenizer, contexts[lo:hi], cfg, window)
    parts = [(texts, cut)]
    if dp > 1:
        parts = [None] * dp
        dist.all_gather_object(parts, (texts, cut), group=pmodel.mesh.get_group("dp"))
    generated = [t for part, _ in parts for t in part]
    assert len(generated) == n, f"{task.name}: {len(generated)} answers for {n} rows"
    samples = []
    for i, (row, text) in enumerate(zip(task.rows, generated)):
        pred, gold = final_number(text), final_number(row.choices[0])
        samples.append(
            {"index": i, "query": contexts[i], "answer": row.choices[0], "generated": text, "pred": pred,
             "gold": gold, "exact_match": pred is not None and pred == gold}
        )  # fmt: skip
    score = sum(s["exact_match"] for s in samples) / n
    result = TaskResult(task.name, task.source, n, {"exact_match": score}, cut=sum(c for _, c in parts))
    result.samples = samples if cfg.log_samples else []
    return result
