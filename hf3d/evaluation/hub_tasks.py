"""The benchmarks SmolLM2 and SmolLM3 base training tracked, read from their Hub datasets and written as
{query, choices, gold} rows, in one of two prompt styles (`prompt_style`):

- `lighteval` (the default): the rows SmolLM3's evaluation scored, lighteval 0.13.0's English templates
  (hf3d/evaluation/prompts.py) fed by the fields, gold rules and splits of SmolLM3's task definitions
  (huggingface/smollm, text/evaluation/smollm3/tasks.py: hellaswag_cf, arc_cf:easy, arc_cf:challenge, piqa_cf,
  mmlu_cf, commonsenseqa_cf, winogrande_cf, openbookqa_cf, boolq_cf), as lighteval's prompt preparation leaves
  them. A row lighteval's template skips (a HellaSwag ending that cleans to nothing, a Winogrande sentence without
  exactly one blank) is skipped here too. The lettered formulation (`<task>:mc`, lighteval's MCF) is always
  built this way.
- `harness`: LM Evaluation Harness-style cloze prompts, as SmolLM2's evaluation (lighteval before 0.11) wrote
  them: HellaSwag's activity label and contexts on one line with the harness's cleaning, "Question: ...\nAnswer:"
  with each answer after a space, Winogrande's sentence cut at its blank, BoolQ's passage and question answered
  " no" / " yes"; no capitalisation or whitespace fixes.

GSM8K is generative in both (exact match on the final number). The datasets come through
`datasets.load_dataset` (the HF cache; offline, only what is cached), called from an empty folder of its own:
`datasets` takes a local folder or file named like the repo first, so a folder `Rowan/hellaswag/` in the launch
directory would otherwise replace the benchmark. A task's `source` (results.json's) names the repo, split,
prompts, revision (the cached snapshot's commit), row count and a SHA-256 of the rows as mapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..utils import files
from ..utils.jsonl import json_lines
from . import prompts
from .rows import Row, Task, check_answer_row, check_row

_WORKING_FOLDER = files.Kind("working folder", lambda name: False)
"""The empty folder Hub ids are resolved from: hf3d writes nothing into it."""


@dataclass(frozen=True)
class HubTask:
    """A Hub dataset and its two mappings of a row: `lighteval(line, lettered)` (None: a row lighteval skips)
    and `harness(line)`. `harness_split`: the split SmolLM2's suite read, where it is not `split`; `group`: the
    field whose values lighteval scores as tasks of their own and averages (MMLU's subjects)."""

    repo: str
    subset: str | None
    split: str
    lighteval: Callable[[dict, bool], dict | None]
    harness: Callable[[dict], dict]
    generative: bool = False
    harness_split: str | None = None
    group: str | None = None

    def mapping(self, style: str, lettered: bool) -> Callable[[dict], dict | None]:
        if lettered or style == "lighteval":
            return lambda line: self.lighteval(line, lettered)
        return self.harness

    def split_for(self, style: str, lettered: bool) -> str:
        if style == "harness" and not lettered:
            return self.harness_split or self.split
        return self.split


# ------------------------------------------------------------------------------------------------
# lighteval 0.13.0's templates, fed as SmolLM3's task definitions feed them
# ------------------------------------------------------------------------------------------------
def _letter_or_number(key: str) -> int:
    """ARC's answerKey: "1".."5" (some rows) or a letter."""
    return int(key) - 1 if key.isdigit() else prompts.LETTERS.index(key)


def arc(line: dict, lettered: bool) -> dict:
    gold = _letter_or_number(line["answerKey"])
    return prompts.question(line["question"], list(line["choices"]["text"]), gold, lettered=lettered)


def commonsense_qa(line: dict, lettered: bool) -> dict:
    gold = list(line["choices"]["label"]).index(line["answerKey"].strip())
    return prompts.question(line["question"], list(line["choices"]["text"]), gold, lettered=lettered)


def openbookqa(line: dict, lettered: bool) -> dict:
    gold = prompts.LETTERS.index(line["answerKey"])
    return prompts.question(line["question_stem"], list(line["choices"]["text"]), gold, lettered=lettered)


def piqa(line: dict, lettered: bool) -> dict:
    return prompts.question(line["goal"], [line["sol1"], line["sol2"]], int(line["label"]), lettered=lettered)


def mmlu(line: dict, lettered: bool) -> dict:
    return prompts.question(line["question"], list(line["choices"]), int(line["answer"]), lettered=lettered)


def boolq(line: dict, lettered: bool) -> dict:
    """Yes first: gold 0 when the answer is true."""
    gold = 0 if line["answer"] else 1
    return prompts.question(
        line["question"], ["yes", "no"], gold, context=line["passage"], instruction="", lettered=lettered
    )


def hellaswag(line: dict, lettered: bool) -> dict | None:
    return prompts.hellaswag(
        line["activity_label"], line["ctx_a"], line["ctx_b"], list(line["endings"]), int(line["label"]),
        lettered=lettered,
    )  # fmt: skip


def winogrande(line: dict, lettered: bool) -> dict | None:
    """The sentence before its blank as the context; each option and the rest of the sentence (its leading
    space kept: two spaces after the option) as a continuation. None without exactly one blank or with nothing
    before it (lighteval skips the row)."""
    sentence = line["sentence"]
    if sentence.count("_") != 1:
        return None
    before, after = sentence.split("_")
    if not before.strip():
        return None
    options = [f"{line['option1']} {after}", f"{line['option2']} {after}"]
    return prompts.continuation(before, options, int(line["answer"]) - 1, lettered=lettered)


# ------------------------------------------------------------------------------------------------
# LM Evaluation Harness-style cloze prompts (SmolLM2's)
# ------------------------------------------------------------------------------------------------
def _harness_preprocess(text: str) -> str:
    """LM Evaluation Harness's HellaSwag cleaning: WikiHow's [title] markers become a full stop, other
    bracketed markers go, double spaces become one."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def harness_hellaswag(line: dict) -> dict:
    context = f"{line['activity_label']}: {line['ctx_a']} {line['ctx_b'].capitalize()}"
    return {
        "query": _harness_preprocess(context),
        "choices": [" " + _harness_preprocess(e) for e in line["endings"]],
        "gold": int(line["label"]),
    }


def question_answer(question: str, answers: list[str], gold: int) -> dict:
    return {"query": f"Question: {question}\nAnswer:", "choices": [f" {a}" for a in answers], "gold": gold}


def harness_lettered(line: dict, question_key: str) -> dict:
    """ARC, CommonsenseQA, OpenBookQA: choices {text, label} and an answerKey among the labels."""
    labels = list(line["choices"]["label"])
    return question_answer(line[question_key], list(line["choices"]["text"]), labels.index(line["answerKey"]))


def harness_question(line: dict) -> dict:
    return harness_lettered(line, "question")


def harness_openbookqa(line: dict) -> dict:
    return harness_lettered(line, "question_stem")


def harness_piqa(line: dict) -> dict:
    return question_answer(line["goal"], [line["sol1"], line["sol2"]], int(line["label"]))


def harness_mmlu(line: dict) -> dict:
    return question_answer(line["question"], list(line["choices"]), int(line["answer"]))


def harness_winogrande(line: dict) -> dict:
    before, after = line["sentence"].split("_", 1)
    after = after.strip()
    return {
        "query": before,
        "choices": [f"{line['option1']} {after}", f"{line['option2']} {after}"],
        "gold": int(line["answer"]) - 1,
    }


def harness_boolq(line: dict) -> dict:
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
    "hellaswag": HubTask("Rowan/hellaswag", None, "validation", hellaswag, harness_hellaswag),
    "arc_easy": HubTask("allenai/ai2_arc", "ARC-Easy", "test", arc, harness_question),
    "arc_challenge": HubTask("allenai/ai2_arc", "ARC-Challenge", "test", arc, harness_question),
    "piqa": HubTask("ybisk/piqa", None, "validation", piqa, harness_piqa),
    "mmlu": HubTask("cais/mmlu", "all", "test", mmlu, harness_mmlu, group="subject"),
    "commonsense_qa": HubTask("tau/commonsense_qa", None, "validation", commonsense_qa, harness_question),
    "winogrande": HubTask("allenai/winogrande", "winogrande_xl", "validation", winogrande, harness_winogrande),
    "openbookqa": HubTask(
        "allenai/openbookqa", "main", "validation", openbookqa, harness_openbookqa, harness_split="test"
    ),
    "boolq": HubTask("google/boolq", None, "validation", boolq, harness_boolq),
    "gsm8k": HubTask("openai/gsm8k", "main", "test", lambda line, _: gsm8k(line), gsm8k, generative=True),
}
LIGHTEVAL_NAMES = {
    **{f"{name}_{f}": (task, f == "mcf") for f in ("cf", "mcf") for name, task in (
        ("hellaswag", "hellaswag"), ("piqa", "piqa"), ("mmlu", "mmlu"), ("commonsenseqa", "commonsense_qa"),
        ("winogrande", "winogrande"), ("openbookqa", "openbookqa"),
    )},
    **{f"arc_{f}:{level}": (f"arc_{level}", f == "mcf") for f in ("cf", "mcf") for level in ("easy", "challenge")},
    "boolq_cf": ("boolq", False),
}  # fmt: skip
"""lighteval's names of SmolLM3's tasks (without the suite prefix "custom|"): (hf3d's task, lettered)."""


def load_hub_task(name: str, *, style: str = "lighteval", lettered: bool = False, raw_rows: str | None = None) -> Task:
    """A Hub task's rows in `style` (or lettered), named `name` (`name:mc` when lettered): from the Hub dataset, or
    from `raw_rows`, a JSONL file of that dataset's rows as they are (`hf3d fetch-tasks --raw-dir` writes one)."""
    spec = HUB_TASKS[name]
    split = spec.split_for(style, lettered)
    where = spec.repo + (f" ({spec.subset})" if spec.subset else "") + f", split {split}"
    if raw_rows is not None:
        lines, revision = [value for _, value in json_lines(Path(raw_rows))], "none (a local file)"
        where = f"{raw_rows} (raw rows of {where})"
    else:
        lines = hub_rows(name, spec, split, where)
        revision = _revision(lines)
    to_row = spec.mapping(style, lettered)
    group = spec.group if style == "lighteval" or lettered else None
    mapped = [as_row(spec, to_row, line, f"{where} row {i}", group) for i, line in enumerate(lines)]
    rows = [r for r in mapped if r is not None]
    skipped = f" ({len(mapped) - len(rows)} skipped, as lighteval skips them)" if len(rows) < len(mapped) else ""
    digest = hashlib.sha256(json.dumps([[r.query, list(r.choices), r.gold] for r in rows]).encode()).hexdigest()
    source = (
        f"{where}, {_prompts(style, lettered, spec.generative)}, revision {revision}, {len(rows)} rows{skipped}, "
        f"rows sha256 {digest[:16]}"
    )
    return Task(f"{name}:mc" if lettered else name, rows, source, spec.generative)


def hub_rows(name: str, spec: HubTask, split: str, where: str):
    """The Hub dataset's rows (a `datasets.Dataset`), from the HF cache when the Hub cannot be reached (said at
    once, not after the retries of every request); one line when they cannot be had."""
    import datasets

    away = _hub_unreachable()
    try:
        with _away_from_the_launch_folder(), _cache_only(away is not None):
            return datasets.load_dataset(spec.repo, spec.subset, split=split)
    except Exception as e:  # offline, not cached, gated, renamed: all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = f"it is not in the datasets cache and {away}" if away else f"it could not be loaded ({first[:200]})"
        raise ValueError(
            f"task {name!r} reads the Hub dataset {where}: {why}; run `hf3d fetch-tasks {name}` where the Hub is "
            "reachable (into the cache, or --raw-dir DIR for a file to pass as NAME=FILE), or pass the task as a "
            "JSONL file of {query, choices, gold} rows"
        ) from None


_HUB_AWAY: list[str | None] = []  # the answer of `_hub_unreachable`, asked once a process


def _hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hub cannot be reached, in a few words (HF_HUB_OFFLINE set, no answer within `timeout_s` to one
    request of its address), or None when it answers; asked once a process."""
    import huggingface_hub.constants as hub

    if not _HUB_AWAY:
        if hub.HF_HUB_OFFLINE:
            _HUB_AWAY.append("HF_HUB_OFFLINE is set")
        else:
            from huggingface_hub import get_session

            try:
                get_session().head(hub.ENDPOINT, timeout=timeout_s)
                _HUB_AWAY.append(None)
            except Exception as e:  # no name service, no route, a timeout: the Hub is away
                _HUB_AWAY.append(f"the Hub ({hub.ENDPOINT}) cannot be reached ({type(e).__name__})")
    return _HUB_AWAY[0]


@contextlib.contextmanager
def _cache_only(on: bool):
    """datasets and huggingface_hub in offline mode while on: the cache is read, nothing is requested."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved = getattr(datasets.config, "HF_HUB_OFFLINE", None), hub.HF_HUB_OFFLINE
    if on:
        datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if on:
            datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def fetch_hub_task(name: str, *, style: str = "lighteval", lettered: bool = False, raw_dir: Path | None = None) -> str:
    """Load a Hub task's dataset into the HF cache (`hf3d fetch-tasks`) and, with `raw_dir`, write its rows as they
    are to `raw_dir/<name>.jsonl`, the file `--tasks NAME=FILE` reads on a machine without the Hub; returns the line
    that says what was fetched."""
    spec = HUB_TASKS[name]
    split = spec.split_for(style, lettered)
    where = spec.repo + (f" ({spec.subset})" if spec.subset else "") + f", split {split}"
    rows = hub_rows(name, spec, split, where)
    said = f"{name}: {where}, revision {_revision(rows)}, {len(rows)} rows in the datasets cache"
    if raw_dir is not None:
        out = raw_dir / f"{name}.jsonl"
        files.write_file(out, "".join(json.dumps(dict(line), default=str) + "\n" for line in rows), replace=True)
        said += f"; written to {out} (--tasks {name}={out})"
    return said


def _prompts(style: str, lettered: bool, generative: bool) -> str:
    if generative:
        return "Question/Answer prompts"
    if lettered:
        return "lighteval 0.13.0 lettered prompts (MCF)"
    return "lighteval 0.13.0 cloze prompts (CF)" if style == "lighteval" else "harness-style cloze prompts"


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


def as_row(spec: HubTask, to_row, line: dict, where: str, group: str | None = None) -> Row | None:
    """The row `to_row` maps `line` to, checked, in the group its field `group` names; None for a row the mapping
    skips."""
    try:
        value = to_row(line)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        what = f"{type(e).__name__}: {e}"
        raise ValueError(f"{where}: the row does not have the fields its mapping reads ({what})") from None
    if value is None:
        return None
    row = check_answer_row(value, where) if spec.generative else check_row(value, where)
    return replace(row, group=str(line[group])) if group and group in line else row
