"""A task's rows and the checks every row passes, wherever it was read from (a JSONL file, a task hf3d ships, a Hub
dataset through its mapping): each bad row is one line naming where it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    query: str
    choices: tuple[str, ...]
    gold: int
    group: str | None = None  # a task scored as the mean of its groups' scores (MMLU's subjects, as lighteval)


@dataclass
class Task:
    """A named list of rows; `source` says where they came from (a path or a Hub dataset). A generative task's
    rows hold their answer as their one choice (hf3d/evaluation/generative.py)."""

    name: str
    rows: list[Row]
    source: str
    generative: bool = False


def check_answer_row(value: dict, where: str) -> Row:
    """A generative row {query, answer}: its answer kept as its one choice."""
    query, answer = value.get("query"), value["answer"]
    if not isinstance(query, str) or not isinstance(answer, str):
        raise ValueError(f"{where}: a generative row is {{query, answer}}, both strings")
    return Row(query, (answer,), 0)


def check_row(value, where: str) -> Row:
    """A Row from a parsed object, or one line saying what is wrong with it and where."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a task row must be an object with query, choices and gold")
    for key in ("query", "choices", "gold"):
        if key not in value:
            raise ValueError(f"{where}: the row has no {key!r} field (a row is {{query, choices, gold}})")
    query, choices, gold = value["query"], value["choices"], value["gold"]
    if not isinstance(query, str):
        raise ValueError(f"{where}: 'query' must be a string, got {type(query).__name__}")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{where}: 'choices' must be a list of strings")
    if not choices:
        raise ValueError(f"{where}: 'choices' is empty: a row needs at least one choice")
    empty = [i for i, c in enumerate(choices) if not c]
    if empty:
        raise ValueError(f"{where}: choices[{empty[0]}] is an empty string: each choice needs at least one character")
    if isinstance(gold, bool) or not isinstance(gold, int):
        raise ValueError(f"{where}: 'gold' must be an integer index into choices, got {gold!r}")
    if not 0 <= gold < len(choices):
        raise ValueError(f"{where}: 'gold' {gold} is outside the {len(choices)} choices (0 to {len(choices) - 1})")
    return Row(query, tuple(choices), gold)
