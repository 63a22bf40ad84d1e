"""The benchmarks SmolLM2 and SmolLM3 base training tracked, read from their Hub datasets and written as
{query, choices, gold} rows in the cloze formulation (the log-likelihood of each answer, no letters).

Each mapping follows the prompt lighteval's cloze tasks build: HellaSwag's activity label and contexts with
each ending as a continuation (LM Evaluation Harness's preprocessing of the WikiHow artifacts), "Question:
...\\nAnswer:" with each answer text after a space for ARC, PIQA, MMLU, CommonsenseQA and OpenBookQA,
Winogrande's sentence cut at its blank with each option completing it, BoolQ's passage and question
answered " yes" / " no"; and GSM8K as a generative task (exact match on the final number). lighteval's templates
also normalise capitalisation and end punctuation of a few fields; these mappings do not.

The datasets come through `datasets.load_dataset` (the HF cache; offline, only what is cached), called from an
empty folder of its own: `datasets` takes a local folder or file named like the repo first, so a folder
`Rowan/hellaswag/` in the launch directory would otherwise replace the benchmark. A task's `source` (results.json's)
names the repo, split, revision (the cached snapshot's commit), row count and a SHA-256 of the rows as mapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..utils import files
from .rows import Row, Task, check_answer_row, check_row

_WORKING_FOLDER = files.Kind("working folder", lambda name: False)
"""The empty folder Hub ids are resolved from: hf3d writes nothing into it."""


@dataclass(frozen=True)
class HubTask:
    repo: str
    subset: str | None
    split: str
    to_row: Callable[[dict], dict]
    generative: bool = False


def _harness_preprocess(text: str) -> str:
    """LM Evaluation Harness's HellaSwag cleaning: WikiHow's [title] markers become a full stop, other
    bracketed markers go, double spaces become one."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(line: dict) -> dict:
    context = f"{line['activity_label']}: {line['ctx_a']} {line['ctx_b'].capitalize()}"
    return {
        "query": _harness_preprocess(context),
        "choices": [" " + _harness_preprocess(e) for e in line["endings"]],
        "gold": int(line["label"]),
    }


def question_answer(question: str, answers: list[str], gold: int) -> dict:
    return {"query": f"Question: {question}\nAnswer:", "choices": [f" {a}" for a in answers], "gold": gold}


def lettered(line: dict, question_key: str) -> dict:
    """ARC, CommonsenseQA, OpenBookQA: choices {text, label} and an answerKey among the labels."""
    labels = list(line["choices"]["label"])
    return question_answer(line[question_key], list(line["choices"]["text"]), labels.index(line["answerKey"]))


def piqa(line: dict) -> dict:
    return question_answer(line["goal"], [line["sol1"], line["sol2"]], int(line["label"]))


def mmlu(line: dict) -> dict:
    return question_answer(line["question"], list(line["choices"]), int(line["answer"]))


def winogrande(line: dict) -> dict:
    before, after = line["sentence"].split("_", 1)
    after = after.strip()
    return {
        "query": before,
        "choices": [f"{line['option1']} {after}", f"{line['option2']} {after}"],
        "gold": int(line["answer"]) - 1,
    }


def boolq(line: dict) -> dict:
    question = line["question"].rstrip("?")
    return {
        "query": f"{line['passage']}\nQuestion: {question}?\nAnswer:",
        "choices": [" no", " yes"],
        "gold": int(bool(line["answer"])),
    }


def gsm8k(line: dict) -> dict:
    """GSM8K as SmolLM's base suites score it: "Question: ...\nAnswer:", the reference solution (ending in
    "#### <number>") as the few-shot answer, exact match on the final number."""
    return {"query": f"Question: {line['question']}\nAnswer:", "answer": " " + line["answer"]}


HUB_TASKS = {
    "hellaswag": HubTask("Rowan/hellaswag", None, "validation", hellaswag),
    "arc_easy": HubTask("allenai/ai2_arc", "ARC-Easy", "test", lambda line: lettered(line, "question")),
    "arc_challenge": HubTask("allenai/ai2_arc", "ARC-Challenge", "test", lambda line: lettered(line, "question")),
    "piqa": HubTask("ybisk/piqa", None, "validation", piqa),
    "mmlu": HubTask("cais/mmlu", "all", "test", mmlu),
    "commonsense_qa": HubTask("tau/commonsense_qa", None, "validation", lambda line: lettered(line, "question")),
    "winogrande": HubTask("allenai/winogrande", "winogrande_xl", "validation", winogrande),
    "openbookqa": HubTask("allenai/openbookqa", "main", "test", lambda line: lettered(line, "question_stem")),
    "boolq": HubTask("google/boolq", None, "validation", boolq),
    "gsm8k": HubTask("openai/gsm8k", "main", "test", gsm8k, generative=True),
}


def load_hub_task(name: str) -> Task:
    spec = HUB_TASKS[name]
    where = spec.repo + (f" ({spec.subset})" if spec.subset else "") + f", split {spec.split}"
    try:
        import datasets

        with _away_from_the_launch_folder():
            rows = datasets.load_dataset(spec.repo, spec.subset, split=spec.split)
    except Exception as e:  # offline, not cached, gated, renamed: all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"task {name!r} reads the Hub dataset {where}, which could not be loaded ({first[:200]}): run once "
            "where the Hub is reachable to cache it, or pass the task as a JSONL file of {query, choices, gold} rows"
        ) from None
    revision = _revision(rows)
    rows = [as_row(spec, line, f"{where} row {i}") for i, line in enumerate(rows)]
    digest = hashlib.sha256(json.dumps([[r.query, list(r.choices), r.gold] for r in rows]).encode()).hexdigest()
    source = f"{where}, revision {revision}, {len(rows)} rows, rows sha256 {digest[:16]}"
    return Task(name, rows, source, spec.generative)


@contextlib.contextmanager
def _away_from_the_launch_folder():
    """The working directory an empty folder of its own while `datasets` resolves a Hub id (no local path
    named like the repo can be taken for it); caches given as relative paths are made absolute first."""
    import datasets.config
    import huggingface_hub.constants as hub

    for module, key in ((datasets.config, "HF_DATASETS_CACHE"), (hub, "HF_HUB_CACHE")):
        value = getattr(module, key, None)
        if value is not None and not os.path.isabs(value):  # set relative by HF_HOME=./cache, say
            setattr(module, key, type(value)(os.path.abspath(value)))
    here, empty = os.getcwd(), tempfile.mkdtemp(prefix="hf3d-hub-task-")
    os.chdir(empty)
    try:
        yield
    finally:
        os.chdir(here)
        files.remove_dir(empty, _WORKING_FOLDER)  # empty: datasets writes into its cache, never here


def _revision(rows) -> str:
    """The commit of the cached snapshot the rows were built from (a folder of the datasets cache), or "unknown"."""
    for entry in getattr(rows, "cache_files", None) or []:
        for part in Path(entry.get("filename", "")).parts:
            if re.fullmatch(r"[0-9a-f]{40}", part):
                return part
    return "unknown"


def as_row(spec: HubTask, line: dict, where: str) -> Row:
    try:
        value = spec.to_row(line)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        what = f"{type(e).__name__}: {e}"
        raise ValueError(f"{where}: the row does not have the fields its mapping reads ({what})") from None
    return check_answer_row(value, where) if spec.generative else check_row(value, where)
