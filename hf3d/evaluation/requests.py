"""From a row's text to the token ids that are scored: lighteval 0.13.0's pair rules and left cut, and the units a
row packs into (a context once, then the continuations that share it).

Both rules first move all the context's trailing whitespace to the front of each choice (lighteval's
`tok_encode_pair`: "Answer: " + "Paris" is scored as "Answer:" + " Paris").

- pairwise (the default; lighteval 0.13.0's transformers backend, whatever its pairwise_tokenization says): the
  context is encoded with the tokenizer's special tokens (a BOS where it adds one), a trailing EOS dropped, and
  each choice on its own without special tokens. A choice that fuses with the context's last word ("I saw ge" +
  "ntleman") is scored as these two pieces.
- joint (lighteval's pairwise_tokenization=False, its vLLM backend's default, LM Evaluation Harness's split):
  `whole = encode(context + choice)`, the continuation `whole[len(encode(context)):]` and its context
  `whole[:len(encode(context))]` (the two can differ from encode(context) where the tokenizer merges across the
  boundary). When the choice adds no token the last context token becomes the continuation, as lighteval does;
  when the pair encodes to fewer tokens than the context alone ("I saw ge" + "ntleman": 3 tokens against 4) the
  choice has no token of its own and the row is refused in one line.

An empty context becomes the EOS token (BOS where there is none), as LM Evaluation Harness does, so that the first
continuation token has something to be predicted from.

The window: lighteval reads `(context + continuation)[-max_length:]`, so a context is cut from the left to its
last `window - len(continuation)` tokens; the model reads the context and the continuation but its last token. A
continuation that leaves no context token in the window cannot be scored and is refused. A context far longer than
the window is first cut by characters (hf3d/utils/tokens.py), so only what the window can hold is ever encoded;
the ids kept are the same.
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
    """All the context's trailing whitespace moves to the front of the choice."""
    spaces = len(context) - len(context.rstrip())
    return (context[:-spaces], context[-spaces:] + choice) if spaces else (context, choice)


def pair_ids(context_len: int, whole: list[int], empty_id: int) -> tuple[list[int], list[int]]:
    """Joint: (context, continuation) of one choice from len(encode(context)) and encode(context + choice)."""
    n = context_len
    if n == len(whole):  # the choice added no token: score the last one
        n -= 1
    return whole[:n] or [empty_id], whole[n:]


def empty_context_id(tokenizer) -> int:
    token = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if token is None:
        raise ValueError("scoring needs a tokenizer with an EOS or BOS token (an empty context starts from it)")
    return token


def encode_examples(
    tokenizer, contexts: list[str], choices: list[tuple[str, ...]], *, window: int, where: str, pairwise: bool = True
) -> list[Example]:
    """Each row's choices in tokens (one Example per row) by the pairwise or the joint rule, every context cut from
    the left to fit `window` (see the module docstring). The texts are encoded in two batched tokenizer calls."""
    from ..utils.tokens import cut_left

    shortened = [cut_left(ctx, window, tokenizer) for ctx in contexts]
    pairs = [split_space(ctx, choice) for (ctx, _), row in zip(shortened, choices) for choice in row]
    encoded = (_pairwise if pairwise else _joint)(tokenizer, pairs, empty_context_id(tokenizer))
    examples, k = [], 0
    for i, row in enumerate(choices):
        example = Example([], [], shortened[i][1])
        for j, choice in enumerate(row):
            ctx, cont = encoded[k]
            k += 1
            _check_continuation(cont, f"{where} row {i}: choice {j}", choice, window=window, pairwise=pairwise)
            keep = window - len(cont)
            if len(ctx) > keep:
                ctx, example.cut = ctx[-keep:], True
            example.contexts.append(ctx)
            example.continuations.append(cont)
        examples.append(example)
    return examples


def _pairwise(tokenizer, pairs: list[tuple[str, str]], empty_id: int) -> list[tuple[list[int], list[int]]]:
    unique = list(dict.fromkeys(ctx for ctx, _ in pairs))
    eos = tokenizer.eos_token_id
    encoded = [ids[:-1] if ids and ids[-1] == eos else ids for ids in _encode(tokenizer, unique)]
    contexts = {ctx: ids or [empty_id] for ctx, ids in zip(unique, encoded)}
    continuations = _encode(tokenizer, [cont for _, cont in pairs], special_tokens=False)
    return [(contexts[ctx], cont) for (ctx, _), cont in zip(pairs, continuations)]


def _joint(tokenizer, pairs: list[tuple[str, str]], empty_id: int) -> list[tuple[list[int], list[int]]]:
    unique = list(dict.fromkeys(ctx for ctx, _ in pairs))
    lengths = {ctx: len(ids) for ctx, ids in zip(unique, _encode(tokenizer, unique))}
    wholes = _encode(tokenizer, [ctx + cont for ctx, cont in pairs])
    return [pair_ids(lengths[ctx], whole, empty_id) for (ctx, _), whole in zip(pairs, wholes)]


def _check_continuation(cont: list[int], what: str, choice: str, *, window: int, pairwise: bool) -> None:
    shown = repr(choice if len(choice) <= 40 else choice[:37] + "...")
    if not cont and pairwise:
        raise ValueError(f"{what} ({shown}) encodes to no token: it cannot be scored; give it a visible character")
    if not cont:
        raise ValueError(
            f"{what} ({shown}) has no token of its own: the context and the choice encode to fewer tokens than the "
            "context alone (the choice fuses with the context's last word): score the task with tokenization "
            "pairwise (the default), which encodes the choice on its own"
        )
    if len(cont) >= window:
        raise ValueError(
            f"{what} is {len(cont)} tokens, which with one token of its context is more than the window of {window} "
            "tokens the model reads at once: it cannot be scored; raise the evaluation's max_length (up to the "
            "model's max_position_embeddings) or shorten the choice"
        )


def _encode(tokenizer, texts: list[str], *, special_tokens: bool = True) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]]


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
