"""From a row's text to the token ids that are scored: lighteval's pair rule, the left cut, and the units a row
packs into (a context once, then the continuations that share it).

The pair rule (lighteval's `tok_encode_pair`): a trailing space of the context moves to the front of each
choice; then `whole = encode(context + choice)`, `context_ids = encode(context)` and the continuation is
`whole[len(context_ids):]`, its context `whole[:len(context_ids)]` (the two can differ from context_ids where
the tokenizer merges across the boundary). When the choice adds no token of its own, the last context token
becomes the continuation, as lighteval does. The tokenizer adds its special tokens as it does by default (a
BOS where it has one). An empty context becomes the EOS token (BOS where there is none), as LM Evaluation
Harness does, so that the first continuation token has something to be predicted from.

The window: what the model reads for one choice is its context and its continuation but the last token. When
that exceeds the window, the context is cut from the left, keeping the last `window + 1 - len(continuation)`
tokens (lighteval's `(context + continuation)[-(window + 1):][:-1]`). A continuation longer than the window
itself cannot be scored and is refused. A context far longer than the window is first cut by characters
(hf3d/utils/tokens.py), so only what the window can hold is ever encoded; the ids kept are the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Example:
    """One row's choices in tokens: each choice's context (usually all alike) and continuation."""

    contexts: list[list[int]]
    continuations: list[list[int]]
    cut: bool  # a context was cut from the left to fit the window


@dataclass
class Unit:
    """One context and the continuations read after it, each (pair number, token ids). In a row the unit takes
    len(context) + sum(len(continuation) - 1) positions: a continuation's last token is predicted, never read."""

    context: list[int]
    branches: list[tuple[int, list[int]]]

    @property
    def length(self) -> int:
        return len(self.context) + sum(len(ids) - 1 for _, ids in self.branches)


def split_space(context: str, choice: str) -> tuple[str, str]:
    """A trailing space of the context moves to the front of the choice."""
    spaces = len(context) - len(context.rstrip())
    return (context[:-spaces], context[-spaces:] + choice) if spaces else (context, choice)


def pair_ids(context_ids: list[int], whole: list[int], empty_id: int) -> tuple[list[int], list[int]]:
    """(context, continuation) of one choice from encode(context) and encode(context + choice)."""
    n = len(context_ids)
    if n == len(whole):  # the choice added no token: score the last one
        n -= 1
    return whole[:n] or [empty_id], whole[n:]


def empty_context_id(tokenizer) -> int:
    token = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if token is None:
        raise ValueError("scoring needs a tokenizer with an EOS or BOS token (an empty context starts from it)")
    return token


def encode_examples(tokenizer, contexts: list[str], choices: list[tuple[str, ...]], *, window: int, where: str):
    """Each row's choices in tokens (one Example per row), every context cut from the left to fit `window`
    (see the module docstring). The texts are encoded in two batched tokenizer calls."""
    from ..utils.tokens import cut_left

    shortened = [cut_left(ctx, window, tokenizer) for ctx in contexts]
    contexts = [ctx for ctx, _ in shortened]
    pairs = [split_space(ctx, choice) for ctx, row in zip(contexts, choices) for choice in row]
    unique = list(dict.fromkeys(ctx for ctx, _ in pairs))
    encoded = dict(zip(unique, _encode(tokenizer, unique)))
    wholes = _encode(tokenizer, [ctx + choice for ctx, choice in pairs])
    empty_id = empty_context_id(tokenizer)
    examples, k = [], 0
    for i, row in enumerate(choices):
        example = Example([], [], shortened[i][1])
        for j in range(len(row)):
            ctx, cont = pair_ids(encoded[pairs[k][0]], wholes[k], empty_id)
            k += 1
            if len(cont) > window:
                raise ValueError(
                    f"{where} row {i}: choice {j} is {len(cont)} tokens, more than the window of {window} tokens the "
                    "model reads at once: it cannot be scored; raise the evaluation's max_length (up to the model's "
                    "max_position_embeddings) or shorten the choice"
                )
            keep = window + 1 - len(cont)
            if len(ctx) > keep:
                ctx, example.cut = ctx[-keep:], True
            example.contexts.append(ctx)
            example.continuations.append(cont)
        examples.append(example)
    return examples


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts)["input_ids"]]


def units_of(example: Example, first_pair: int, *, window: int, share: bool) -> list[Unit]:
    """The units of one example, its pairs numbered from `first_pair` in choice order. With `share`, the choices
    whose contexts are equal read that context once (several units when they do not fit `window` together);
    without, each choice is a unit of its own."""
    pairs = [(first_pair + j, ctx, cont) for j, (ctx, cont) in enumerate(zip(example.contexts, example.continuations))]
    if not share:
        return [Unit(ctx, [(p, cont)]) for p, ctx, cont in pairs]
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for p, ctx, cont in pairs:
        groups.setdefault(tuple(ctx), []).append((p, cont))
    units = []
    for ctx, branches in groups.items():
        unit = Unit(list(ctx), [])
        for branch in branches:
            if unit.branches and unit.length + len(branch[1]) - 1 > window:
                units.append(unit)
                unit = Unit(list(ctx), [])
            unit.branches.append(branch)
        units.append(unit)
    return units
