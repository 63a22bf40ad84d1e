"""Accuracy from the choices' summed log-likelihoods, raw and normalised as lighteval normalises them.

    acc             the choice with the highest summed log-likelihood is the gold one
    acc_norm        the same, each sum divided by its choice's length in characters (lighteval's
                    LogProbCharNorm; the length of the choice as the row gives it, its leading space included)
    acc_norm_token  each sum divided by its continuation's number of tokens (lighteval's LogProbTokenNorm)

A tie goes to the first of the tied choices. A task's score is the mean over its examples; the average is the
mean over tasks (a macro average: every task counts alike, whatever its size), each metric over the tasks that
have it (generative tasks score exact_match, hf3d/evaluation/generative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

METRICS = ("acc", "acc_norm", "acc_norm_token")


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
    choices_chars and gold."""
    hits = dict.fromkeys(METRICS, 0)
    for ex in examples:
        picks = predictions(ex["choices_logprob"], [len(t) for t in ex["choices_tokens"]], ex["choices_chars"])
        ex["pred"], ex["pred_norm"], ex["pred_norm_token"] = picks["acc"], picks["acc_norm"], picks["acc_norm_token"]
        for metric, pick in picks.items():
            hits[metric] += int(pick == ex["gold"])
    n = len(examples)
    scores = {metric: hits[metric] / n for metric in METRICS}
    return TaskResult(name, source, n, scores, cut=cut, num_fewshot=num_fewshot, samples=examples)


def macro_average(results: list[TaskResult]) -> dict[str, float]:
    """Each metric's mean over the tasks that have it (multiple-choice: acc, acc_norm, acc_norm_token;
    generative: exact_match)."""
    out = {}
    for metric in (*METRICS, "exact_match"):
        scores = [r.scores[metric] for r in results if metric in r.scores]
        if scores:
            out[metric] = sum(scores) / len(scores)
    return out
