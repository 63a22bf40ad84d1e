"""The benchmarks SmolLM2 and SmolLM3 base training tracked, read from their Hub datasets and written as
{query, choices, gold} rows in the cloze formulation (the log-likelihood of each answer, no letters).

Each mapping follows the prompt lighteval's cloze tasks build: HellaSwag's activity label and contexts with
each ending as a continuation (LM Evaluation Harness's preprocessing of the WikiHow artifacts), "Question:
...\\nAnswer:" with each answer text after a space for ARC, PIQA, MMLU, CommonsenseQA and OpenBookQA,
Winogrande's sentence cut at its blank with each option completing it, BoolQ's passage and question
answered " yes" / " no"; and GSM8K as a generative task (exact match on the final number). lighteval's templates
also normalise capitalisation and end punctuation of a few fields; these mappings do not.

The datasets come through `datasets.load_dataset` (the HF cache; offline, only what is cached).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .tasks import Row, Task, check_answer_row, check_row


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

        rows = datasets.load_dataset(spec.repo, spec.subset, split=spec.split)
    except Exception as e:  # offline, not cached, gated, renamed: all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"task {name!r} reads the Hub dataset {where}, which could not be loaded ({first[:200]}): run once "
            "where the Hub is reachable to cache it, or pass the task as a JSONL file of {query, choices, gold} rows"
        ) from None
    rows = [as_row(spec, line, f"{where} row {i}") for i, line in enumerate(rows)]
    return Task(name, rows, where, spec.generative)


def as_row(spec: HubTask, line: dict, where: str) -> Row:
    try:
        value = spec.to_row(line)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        what = f"{type(e).__name__}: {e}"
        raise ValueError(f"{where}: the row does not have the fields its mapping reads ({what})") from None
    return check_answer_row(value, where) if spec.generative else check_row(value, where)
