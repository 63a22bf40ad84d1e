"""Accuracy from the choices' summed log-likelihoods, raw and normalised as lighteval normalises them, and the gold
choice's bits per byte.

    acc             the choice with the highest summed log-likelihood is the gold one
    acc_norm        the same, each sum divided by its choice's length in characters (lighteval's
                    LogProbCharNorm; the length of the choice as the row gives it, its leading space included)
    acc_norm_token  each sum divided by its continuation's number of tokens (lighteval's LogProbTokenNorm as it
                    is defined; lighteval 0.13.0's transformers backend divides by the row's longest
                    continuation instead, which makes its acc_norm_token its acc)
    bpb             the gold continuation's negative log-likelihood in bits over its UTF-8 bytes (the choice and
                    the context's trailing whitespace moved in front of it), per row: -logprob / ln 2 / bytes

A tie goes to the first of the tied choices. A task's score is the mean over its examples (bpb too: the mean of
the rows' bits per byte, as OLMo's in-loop evaluations average theirs), or, for a task whose rows carry groups
(MMLU's subjects under lighteval's prompts), the mean over groups of each group's mean, as lighteval averages the
tasks it scores each subject as. The average is the mean over tasks (a macro average: every task counts alike,
whatever its size), each metric over the tasks that have it (generative tasks score exact_match,
hf3d/evaluation/generative.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METRICS = ("acc", "acc_norm", "acc_norm_token")  # the ones that pick a choice
SCORES = (*METRICS, "bpb")


def argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def predictions(logprobs: list[float], num_tokens: list[int], num_chars: list[int]) -> dict[str, int]:
    """The choice each metric picks: {acc: index, acc_norm: index, acc_norm_token: index}."""
    return {
        "acc": argmax(logprobs),
        "acc_norm": argmax([lp / c for lp, c in zip(logprobs, num_chars)]),
        "acc_norm_token": argmax([lp / t for lp, t in zip(logprobs, num_tokens)]),
    }


def bits_per_byte(logprob: float, num_bytes: int) -> float:
    return -logprob / math.log(2) / num_bytes


@dataclass
class TaskResult:
    """One task's scores, and with log_samples its examples as `samples_<task>.jsonl` lines."""

    name: str
    source: str
    n: int
    scores: dict[str, float]
    cut: int = 0  # examples whose context was cut from the left to fit the window
    num_fewshot: int = 0
    samples: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**self.scores, "n": self.n, "cut": self.cut, "num_fewshot": self.num_fewshot, "source": self.source}


def task_result(name: str, source: str, examples: list[dict], *, cut: int, num_fewshot: int) -> TaskResult:
    """examples: one dict per row in the task's order, with choices_logprob, choices_tokens (ids per choice),
    choices_chars, choices_bytes, gold and, in a task of groups, group."""
    per_row = {metric: [] for metric in SCORES}
    for ex in examples:
        picks = predictions(ex["choices_logprob"], [len(t) for t in ex["choices_tokens"]], ex["choices_chars"])
        ex["pred"], ex["pred_norm"], ex["pred_norm_token"] = picks["acc"], picks["acc_norm"], picks["acc_norm_token"]
        for metric, pick in picks.items():
            per_row[metric].append(float(pick == ex["gold"]))
        gold = ex["gold"]
        per_row["bpb"].append(bits_per_byte(ex["choices_logprob"][gold], ex["choices_bytes"][gold]))
    groups = [ex.get("group") for ex in examples]
    scores = {metric: _mean(values, groups) for metric, values in per_row.items()}
    return TaskResult(name, source, len(examples), scores, cut=cut, num_fewshot=num_fewshot, samples=examples)


def _mean(values: list[float], groups: list[str | None]) -> float:
    """The mean of `values`, or with groups the mean of each group's mean."""
    if all(g is None for g in groups):
        return sum(values) / len(values)
    by_group: dict[str | None, list[float]] = {}
    for value, group in zip(values, groups):
        by_group.setdefault(group, []).append(value)
    return sum(sum(v) / len(v) for v in by_group.values()) / len(by_group)


def macro_average(results: list[TaskResult]) -> dict[str, float]:
    """Each metric's mean over the tasks that have it (multiple-choice: acc, acc_norm, acc_norm_token, bpb;
    generative: exact_match)."""
    out = {}
    for metric in (*SCORES, "exact_match"):
        scores = [r.scores[metric] for r in results if metric in r.scores]
        if scores:
            out[metric] = sum(scores) / len(scores)
    return out
