"""Multiple-choice tasks: rows of {"query", "choices", "gold"}, from a JSONL file, a task hf3d ships, or a Hub
dataset through its prompt mapping (hf3d/evaluation/hub_tasks.py).

A row is read as it is: `query` is the context, each of `choices` a continuation of it (with its leading space,
as lighteval's cloze formulation writes them: " Paris"), `gold` the index of the right one. Every row is checked
when the task is read, so a bad file is refused before any model is loaded, in one line naming the file and
the line.
"""

from __future__ import annotations

import difflib
import random
from pathlib import Path

from ..utils.jsonl import json_lines
from .rows import Row, Task, check_answer_row, check_row

SHIPPED_DIR = Path(__file__).resolve().parent / "tasks"
FEWSHOT_SEPARATOR = "\n\n"


def shipped_tasks() -> dict[str, Path]:
    """The tasks that come with hf3d, by name (their files under hf3d/evaluation/tasks/)."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.jsonl"))}


def known_task_names() -> list[str]:
    from .hub_tasks import HUB_TASKS

    return [*shipped_tasks(), *HUB_TASKS]


def check_spec(spec: str) -> str:
    """What `spec` names: "file", "shipped" or "hub"; one line when it names nothing (no file is read here)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a task is a JSONL path or a task name, got {spec!r}")
    path = Path(spec)
    if spec.endswith(".jsonl") or path.is_file():
        if not path.is_file():
            raise ValueError(f"task file {spec} does not exist: give a JSONL file of {{query, choices, gold}} rows")
        return "file"
    if spec in shipped_tasks():
        return "shipped"
    from .hub_tasks import HUB_TASKS

    if spec in HUB_TASKS:
        return "hub"
    names = known_task_names()
    near = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ValueError(
        f"unknown task {spec!r}: {hint}give a JSONL file of {{query, choices, gold}} rows or one of: "
        + ", ".join(names)
    )


def load_task(spec: str, *, limit: int | None = None) -> Task:
    """A task from a JSONL path, a shipped task's name or a Hub task's name; its first `limit` rows."""
    if limit is not None and limit < 1:
        raise ValueError(f"the limit per task must be a number of rows >= 1, got {limit}")
    kind = check_spec(spec)
    if kind == "file":
        rows, generative = read_rows(Path(spec))
        task = Task(Path(spec).stem, rows, spec, generative)
    elif kind == "shipped":
        rows, generative = read_rows(shipped_tasks()[spec])
        task = Task(spec, rows, f"hf3d (shipped: {shipped_tasks()[spec].name})", generative)
    else:
        from .hub_tasks import load_hub_task

        task = load_hub_task(spec)
    if not task.rows:
        raise ValueError(f"task {task.name!r} ({task.source}) has no rows")
    if limit is not None:
        task.rows = task.rows[:limit]
    return task


def read_rows(path: Path) -> tuple[list[Row], bool]:
    """The rows of a task file and whether they are generative ({query, answer}) rather than multiple-choice
    ({query, choices, gold}); a file holds one kind."""
    rows, kinds = [], set()
    for number, value in json_lines(path):
        where = f"{path} line {number}"
        generative = isinstance(value, dict) and "answer" in value and "choices" not in value
        rows.append(check_answer_row(value, where) if generative else check_row(value, where))
        kinds.add(generative)
        if len(kinds) > 1:
            raise ValueError(
                f"{where}: the file mixes multiple-choice rows {{query, choices, gold}} and generative rows "
                "{query, answer}: one kind a file"
            )
    return rows, kinds == {True}


def context_of(task: Task, index: int, *, num_fewshot: int, seed: int) -> str:
    """The context of row `index`: its query, after `num_fewshot` other rows of the task, each written as its
    query followed by its right choice, separated by a blank line. The rows are drawn without replacement from
    the rest of the task by a generator seeded with (seed, index), so every rank and every run draws the same."""
    row = task.rows[index]
    if num_fewshot == 0:
        return row.query
    others = len(task.rows) - 1
    if num_fewshot > others:
        raise ValueError(
            f"num_fewshot={num_fewshot} but task {task.name!r} has only {others} other rows to draw examples from"
        )
    rng = random.Random(f"{seed}:{index}")
    picks = rng.sample(range(others), num_fewshot)
    shots = [task.rows[i if i < index else i + 1] for i in picks]  # every row but `index`
    return FEWSHOT_SEPARATOR.join([*(s.query + s.choices[s.gold] for s in shots), row.query])
