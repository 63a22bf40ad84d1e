"""Multiple-choice tasks: rows of {"query", "choices", "gold"}, from a JSONL file, a task hf3d ships, or a Hub
dataset through its prompt mapping (hf3d/evaluation/hub_tasks.py).

A row is read as it is: `query` is the context, each of `choices` a continuation of it (with its leading space,
as lighteval's cloze formulation writes them: " Paris"), `gold` the index of the right one. Every row is checked
when the task is read, so a bad file is refused before any model is loaded, in one line naming the file and
the line.

A task named with the suffix `:mc` is scored in the lettered formulation (lighteval's MCF): a Hub task through
lighteval's template (hf3d/evaluation/hub_tasks.py), a file's or a shipped task's rows as `lettered_task`
writes them.
lighteval's names of SmolLM3's tasks (`hellaswag_cf`, `arc_cf:easy`, `arc_mcf:easy`, ...) name the Hub tasks.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass, replace
from pathlib import Path

from ..utils.jsonl import json_lines
from . import prompts
from .rows import Row, Task, check_answer_row, check_row

SHIPPED_DIR = Path(__file__).resolve().parent / "tasks"
FEWSHOT_SEPARATOR = "\n\n"
LETTERED = ":mc"


@dataclass(frozen=True)
class Spec:
    """What a task spec names: `kind` "file", "shipped" or "hub", the path or name, and the formulation."""

    kind: str
    target: str
    lettered: bool = False
    raw_rows: str | None = None
    """A Hub task's rows from this JSONL file of its dataset's rows (`NAME=FILE`), not from the Hub."""


def shipped_tasks() -> dict[str, Path]:
    """The tasks that come with hf3d, by name (their files under hf3d/evaluation/tasks/)."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.jsonl"))}


def known_task_names() -> list[str]:
    from .hub_tasks import HUB_TASKS

    return [*shipped_tasks(), *HUB_TASKS]


def resolve(spec: str) -> Spec:
    """What `spec` names (no file is read here); one line when it names nothing."""
    from .hub_tasks import HUB_TASKS, LIGHTEVAL_NAMES

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a task is a JSONL path or a task name, got {spec!r}")
    if "=" in spec:
        return _raw_rows_spec(spec)
    if spec in LIGHTEVAL_NAMES:
        return Spec("hub", *LIGHTEVAL_NAMES[spec])
    lettered = spec.endswith(LETTERED) and len(spec) > len(LETTERED)
    base = spec[: -len(LETTERED)] if lettered else spec
    path = Path(base)
    if base.endswith(".jsonl") or path.is_file():
        if not path.is_file():
            raise ValueError(f"task file {base} does not exist: give a JSONL file of {{query, choices, gold}} rows")
        return Spec("file", base, lettered)
    if base in shipped_tasks():
        return Spec("shipped", base, lettered)
    if base in HUB_TASKS:
        if lettered and HUB_TASKS[base].generative:
            raise ValueError(f"task {spec!r}: {base} is generative, it has no lettered formulation: name it {base!r}")
        return Spec("hub", base, lettered)
    names = known_task_names()
    near = difflib.get_close_matches(base, [*names, *LIGHTEVAL_NAMES], n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ValueError(
        f"unknown task {spec!r}: {hint}give a JSONL file of {{query, choices, gold}} rows or one of: "
        + ", ".join(names)
        + f" (a multiple-choice task with {LETTERED!r} after it: its lettered formulation)"
    )


def _raw_rows_spec(spec: str) -> Spec:
    """`NAME=FILE`: the Hub task NAME (`:mc` and lighteval's names too), its rows read from FILE, a JSONL of its
    dataset's rows as they are (what `hf3d fetch-tasks --raw-dir` writes), mapped by the same prompts."""
    name, path = spec.split("=", 1)
    named = resolve(name)
    if named.kind != "hub":
        raise ValueError(
            f"task {spec!r}: NAME=FILE takes a Hub task's name ({name!r} is not one) and a JSONL file of its "
            "dataset's rows; a file of {query, choices, gold} rows is given as its path alone"
        )
    if not Path(path).is_file():
        raise ValueError(f"task {spec!r}: the file {path} does not exist: give a JSONL file of the dataset's rows")
    return replace(named, raw_rows=path)


def fetch_tasks(specs: str, *, prompt_style: str = "lighteval", raw_dir: str | None = None) -> list[str]:
    """`hf3d fetch-tasks`: the Hub tasks of the comma-separated `specs` into the HF datasets cache and, with
    `raw_dir`, each one's dataset rows as they are into `raw_dir/<name>.jsonl` (`--tasks NAME=FILE` reads it where
    the Hub is not at hand); a line per task. Everything is checked before the first download."""
    from ..utils import files
    from .hub_tasks import fetch_hub_task

    named = [resolve(s.strip()) for s in specs.split(",") if s.strip()]
    other = [s.target for s in named if s.kind != "hub" or s.raw_rows is not None]
    if not named or other:
        raise ValueError(f"fetch-tasks fetches Hub tasks by name ({', '.join(_hub_names())}), got {specs!r}")
    out = None
    if raw_dir is not None:
        files.check_output(raw_dir, "--raw-dir", folder=True)
        out = Path(raw_dir)
        out.mkdir(parents=True, exist_ok=True)
    return [fetch_hub_task(s.target, style=prompt_style, lettered=s.lettered, raw_dir=out) for s in named]


def _hub_names() -> list[str]:
    from .hub_tasks import HUB_TASKS

    return list(HUB_TASKS)


def check_spec(spec: str) -> str:
    """What `spec` names: "file", "shipped" or "hub"; one line when it names nothing (no file is read here)."""
    return resolve(spec).kind


def load_task(spec: str, *, limit: int | None = None, prompt_style: str = "lighteval") -> Task:
    """A task from a JSONL path, a shipped task's name or a Hub task's name (its rows in `prompt_style`), in the
    formulation the spec names; its first `limit` rows."""
    if limit is not None and limit < 1:
        raise ValueError(f"the limit per task must be a number of rows >= 1, got {limit}")
    s = resolve(spec)
    if s.kind == "hub":
        from .hub_tasks import load_hub_task

        task = load_hub_task(s.target, style=prompt_style, lettered=s.lettered, raw_rows=s.raw_rows)
    else:
        path = Path(s.target) if s.kind == "file" else shipped_tasks()[s.target]
        rows, generative = read_rows(path)
        name = path.stem if s.kind == "file" else s.target
        task = Task(name, rows, s.target if s.kind == "file" else f"hf3d (shipped: {path.name})", generative)
        if s.lettered:
            task = lettered_task(task)
    if not task.rows:
        raise ValueError(f"task {task.name!r} ({task.source}) has no rows")
    if limit is not None:
        task.rows = task.rows[:limit]
    return task


def lettered_task(task: Task) -> Task:
    """A task of rows read as they are, in the lettered formulation, named `<name>:mc`: each row's query
    right-stripped, a line " A. <choice>" per choice (the choice stripped), then "Answer:"; the continuations
    " A", " B", ... (lighteval's continuation template under MCF, without its capitalisation fixes)."""
    if task.generative:
        raise ValueError(
            f"task {task.name!r} is generative ({{query, answer}} rows): it has no lettered formulation; name it "
            f"without {LETTERED!r}"
        )
    rows = []
    for i, row in enumerate(task.rows):
        if len(row.choices) > len(prompts.LETTERS):
            raise ValueError(
                f"task {task.name!r} row {i}: {len(row.choices)} choices, the lettered formulation has letters for "
                f"{len(prompts.LETTERS)}: score the task without {LETTERED!r}"
            )
        listed = prompts.options([c.strip() for c in row.choices])
        query = f"{row.query.rstrip()}\n{listed}Answer:"
        rows.append(replace(row, query=query, choices=tuple(prompts.letters(len(row.choices)))))
    return Task(f"{task.name}{LETTERED}", rows, f"{task.source}, lettered", task.generative)


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
    query followed by its right choice, separated by a blank line (the line breaks a later part starts with
    dropped: lighteval's prepared queries start with one). The rows are drawn without replacement from the rest
    of the task by a generator seeded with (seed, index), so every rank and every run draws the same."""
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
    parts = [*(s.query + s.choices[s.gold] for s in shots), row.query]
    return FEWSHOT_SEPARATOR.join([parts[0], *(p.lstrip("\n") for p in parts[1:])])
