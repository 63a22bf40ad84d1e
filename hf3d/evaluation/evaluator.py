"""Downstream multiple-choice evaluation of a ParallelModel at its own mesh.

An Evaluator prepares its tasks once (rows -> contexts with their few-shot examples -> tokens -> units ->
packed batches of this data-parallel rank's share of the examples) and scores them whenever it runs, so a
training run pays the tokenisation once. Examples are split over dp in contiguous blocks; every rank of a
replica (tp, pp, cp) scores the same block and the replicas' summed log-likelihoods are gathered in block
order, so each task's examples come back in its own order on every rank.

Where the attention can hold a tree (sdpa, eager) the choices of a row share their context: it runs once
(hf3d.parallel.segments). Compiled layers see one batch shape (the last batch is padded with empty rows), and
under expert parallelism every dp rank runs as many batches as the one with most (its experts answer the
others' tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.compile import compiled
from ..parallel.segments import TREE_ATTENTION
from .config import DEFAULT_MAX_LENGTH, TOKENS_PER_FORWARD, TaskEvalConfig
from .metrics import SCORES, TaskResult, macro_average, task_result
from .packing import Batch, empty_batch, make_batches
from .requests import encode_examples, split_space, units_of
from .scoring import pair_sums, query_logprobs
from .tasks import Task, context_of, load_task


@dataclass
class _Prepared:
    """A task ready to score: every example's tokens, and the batches of this dp rank's block [lo, hi)."""

    task: Task
    contexts: list[str]
    examples: list  # requests.Example, all of the task's rows
    lo: int
    hi: int
    batches: list[Batch]
    num_pairs: int  # pairs of this rank's block


@dataclass
class EvalResults:
    """What an evaluation returns: each task's result and the macro average over tasks."""

    tasks: list[TaskResult]
    average: dict[str, float]

    def metrics(self, prefix: str = "downstream") -> dict[str, float]:
        """Flat scalars for metrics.jsonl and trackers: `{prefix}/<task>/<metric>` and `{prefix}/average/<metric>`."""
        out = {f"{prefix}/{r.name}/{k}": v for r in self.tasks for k, v in r.scores.items()}
        out.update({f"{prefix}/average/{k}": v for k, v in self.average.items()})
        return out

    def to_json(self) -> dict:
        return {"results": {r.name: r.to_json() for r in self.tasks}, "average": self.average}

    def table(self) -> str:
        metrics = [k for k in (*SCORES, "exact_match") if k in self.average]
        cell = lambda scores, k: f"{scores[k]:.4f}" if k in scores else "-"
        rows = [(r.name, f"{r.n}", *(cell(r.scores, k) for k in metrics)) for r in self.tasks]
        rows.append(("average", "", *(cell(self.average, k) for k in metrics)))
        head = ("task", "n", *metrics)
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        line = lambda cells: "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )
        return "\n".join([line(head), *(line(r) for r in rows)])


def row_length(pmodel, max_length: int | None) -> int:
    """The scoring rows' length: max_length (default: the model's max_position_embeddings, at most 4096), down
    to a multiple of what the mesh cuts a sequence into (2*cp chunks; tp parts under sequence parallelism)."""
    p = pmodel.pcfg
    max_pos = getattr(pmodel.config, "max_position_embeddings", None)
    window = max_length if max_length is not None else min(max_pos or DEFAULT_MAX_LENGTH, DEFAULT_MAX_LENGTH)
    if max_pos is not None and window > max_pos:
        raise ValueError(
            f"the evaluation's max_length={window} is longer than the model's max_position_embeddings={max_pos}: "
            f"use at most {max_pos}"
        )
    multiple = math.lcm(2 * p.cp if p.cp > 1 else 1, p.cp * p.tp if p.sequence_parallel else 1)
    row = window - window % multiple
    if row < 2:
        raise ValueError(f"the evaluation's max_length={window} is shorter than one row of this mesh ({multiple})")
    return row


class Evaluator:
    """Tasks prepared for one ParallelModel (collective: every rank of the mesh builds one alike)."""

    def __init__(
        self,
        pmodel,
        tasks: list[Task],
        tokenizer,
        cfg: TaskEvalConfig,
        *,
        default_rows: int | None = None,
        share_context: bool | None = None,
    ):
        """default_rows: rows per forward when cfg.batch_rows is unset; share_context: choices read their
        context once (default: where the attention can hold a tree), else each pair is a document."""
        self.pmodel, self.cfg = pmodel, cfg
        self.row_len = row_length(pmodel, cfg.max_length)
        self.rows = cfg.batch_rows or default_rows or max(1, TOKENS_PER_FORWARD // self.row_len)
        can_share = pmodel.config._attn_implementation in TREE_ATTENTION
        if share_context and not can_share:
            raise ValueError(
                f"share_context needs attn_implementation in {TREE_ATTENTION}, the model runs "
                f"{pmodel.config._attn_implementation!r}"
            )
        self.tree = can_share if share_context is None else share_context
        layers = [layer for stage in pmodel.stages for layer in stage.layers]
        self.full_batches = pmodel.pcfg.ep > 1 or any(compiled(layer) for layer in layers)
        self.pad_id = 0
        self.tasks, self.tokenizer = tasks, tokenizer
        self.prepared = {i: self._prepare(t, tokenizer) for i, t in enumerate(tasks) if not t.generative}
        self.contexts = {i: self._contexts(t) for i, t in enumerate(tasks) if t.generative}
        if pmodel.lockstep:  # every rank of an expert group (or of ZeRO-3's shard group) runs every forward
            self._same_number_of_batches()

    def _contexts(self, task: Task) -> list[str]:
        cfg = self.cfg
        return [context_of(task, i, num_fewshot=cfg.num_fewshot, seed=cfg.fewshot_seed) for i in range(len(task.rows))]

    def _prepare(self, task: Task, tokenizer) -> _Prepared:
        n = len(task.rows)
        contexts = self._contexts(task)
        where = f"task {task.name!r}"
        choices = [row.choices for row in task.rows]
        pairwise = self.cfg.tokenization == "pairwise"
        examples = encode_examples(tokenizer, contexts, choices, window=self.row_len, where=where, pairwise=pairwise)
        d, dp = self.pmodel.dp_rank, self.pmodel.dp_size
        lo, hi = d * n // dp, (d + 1) * n // dp
        units, pairs = [], 0
        for example in examples[lo:hi]:
            units += units_of(example, pairs, window=self.row_len, share=self.tree)
            pairs += len(example.continuations)
        batches = make_batches(
            units, row_len=self.row_len, rows_per_batch=self.rows, tree=self.tree, pad_id=self.pad_id,
            full_batches=self.full_batches,
        )  # fmt: skip
        return _Prepared(task, contexts, examples, lo, hi, batches, pairs)

    def _same_number_of_batches(self) -> None:
        counts = torch.tensor([len(p.batches) for p in self.prepared.values()], device=self.pmodel.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.pmodel.mesh.get_group("dp"))
        for p, most in zip(self.prepared.values(), counts.tolist()):
            p.batches += [
                empty_batch(row_len=self.row_len, rows=self.rows, tree=self.tree, pad_id=self.pad_id)
                for _ in range(most - len(p.batches))
            ]

    def summary(self) -> list[str]:
        """One line per task, as a run prints it at start: rows, tokens, padding, contexts cut from the left."""
        lines = [
            f"eval task {self.tasks[i].name} ({self.tasks[i].source}): {len(c)} rows, generative: greedy, at most "
            f"{self.cfg.max_new_tokens} new tokens, stopped at {self.cfg.stop!r}, exact match on the final number"
            for i, c in self.contexts.items()
        ]
        for p in self.prepared.values():
            tokens = sum(b.tokens for b in p.batches)
            room = sum(b.input_ids.numel() for b in p.batches)
            cut = sum(ex.cut for ex in p.examples)
            shared = "contexts shared by their choices" if self.tree else "each choice a document of its own"
            shared += f", {self.cfg.tokenization} tokenization"
            lines.append(
                f"eval task {p.task.name} ({p.task.source}): {len(p.task.rows)} rows, {p.num_pairs} choices on this "
                f"replica in {tokens:,} tokens ({shared}), {room // self.row_len} rows of {self.row_len} in "
                f"{len(p.batches)} batch(es) ({1 - tokens / max(room, 1):.0%} padding); {cut} context(s) cut from the "
                f"left to fit {self.row_len} tokens"
            )
        return lines

    def run(self, *, progress: bool = True) -> EvalResults:
        """Score every task; the same results on every rank. Collective over the whole mesh."""
        pm = self.pmodel
        was_training = pm.training
        pm.eval()
        try:
            results = [self._run_task(i, progress) for i in range(len(self.tasks))]
        finally:
            pm.train(was_training)
        return EvalResults(results, macro_average(results))

    def _run_task(self, i: int, progress: bool) -> TaskResult:
        if i in self.prepared:
            return self._score(self.prepared[i], progress)
        from .generative import score_generative

        return score_generative(self.pmodel, self.tokenizer, self.tasks[i], self.contexts[i], self.cfg, self.row_len)

    def _score(self, p: _Prepared, progress: bool) -> TaskResult:
        from tqdm.auto import tqdm

        pm = self.pmodel
        sums = torch.zeros(p.num_pairs, dtype=torch.float64)
        show = progress and dist.get_rank() == 0
        for batch in tqdm(p.batches, desc=f"eval {p.task.name}", unit="batch", disable=not show):
            sums += pair_sums(query_logprobs(pm, batch), batch, p.num_pairs)
        logprobs = [v for part in self._gather(sums) for v in part.tolist()]  # each replica's block, in dp order
        return self._result(p, logprobs)

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every replica's tensor (in dp order); the sizes differ by a few pairs."""
        pm = self.pmodel
        if pm.dp_size == 1:
            return [local]
        group, device = pm.mesh.get_group("dp"), pm.device
        size = torch.tensor([len(local)], device=device)
        sizes = [torch.empty_like(size) for _ in range(pm.dp_size)]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.float64, device=device)
        padded[: len(local)] = local.to(device)
        parts = [torch.empty_like(padded) for _ in range(pm.dp_size)]
        dist.all_gather(parts, padded, group=group)
        return [part[: int(s)].cpu() for part, s in zip(parts, sizes)]

    def _result(self, p: _Prepared, logprobs: list[float]) -> TaskResult:
        examples, k = [], 0
        for i, (row, ex) in enumerate(zip(p.task.rows, p.examples)):
            m = len(row.choices)
            sample = {
                "index": i,
                "query": p.contexts[i],
                "choices": list(row.choices),
                "gold": row.gold,
                "choices_logprob": logprobs[k : k + m],
                "choices_tokens": ex.continuations,
                "choices_chars": [len(c) for c in row.choices],
                "choices_bytes": [len(split_space(p.contexts[i], c)[1].encode()) for c in row.choices],
            }
            if row.group is not None:
                sample["group"] = row.group
            examples.append(sample)
            k += m
        assert k == len(logprobs), f"{p.task.name}: {len(logprobs)} scores for {k} choices"
        cut = sum(ex.cut for ex in p.examples)  # every rank tokenised every row
        result = task_result(p.task.name, p.task.source, examples, cut=cut, num_fewshot=self.cfg.num_fewshot)
        if not self.cfg.log_samples:
            result.samples = []
        return result


def load_tasks(cfg: TaskEvalConfig) -> list[Task]:
    """The tasks of `cfg`, each read and checked (before any model work); names must differ."""
    if not cfg.tasks:
        raise ValueError("no evaluation tasks given: name at least one task (a JSONL file or a known task name)")
    tasks = [load_task(spec, limit=cfg.limit, prompt_style=cfg.prompt_style) for spec in cfg.tasks]
    names = [t.name for t in tasks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"two tasks are named {twice[0]!r} (a task is named after its file, a Hub task by hf3d's name, "
            "lighteval's names included): name each task once, or rename one file"
        )
    return tasks


def evaluate_tasks(pmodel, tasks, tokenizer=None, **options) -> EvalResults:
    """Score multiple-choice tasks on `pmodel` at its own mesh; collective, the same results on every rank.

    tasks: task names or JSONL paths (see TaskEvalConfig.tasks), or a TaskEvalConfig; options: its other
    fields (limit, num_fewshot, fewshot_seed, max_length, batch_rows, prompt_style, tokenization, log_samples),
    and `progress` (a bar on rank 0). tokenizer: default the one of the model's folder."""
    progress = options.pop("progress", True)
    cfg = tasks if isinstance(tasks, TaskEvalConfig) else TaskEvalConfig(tasks=list(tasks), **options)
    if tokenizer is None:
        if pmodel.tokenizer_dir is None:
            raise ValueError("the model came without a folder to read a tokenizer from: pass tokenizer=")
        from ..utils.tokens import load_tokenizer

        tokenizer = load_tokenizer(pmodel.tokenizer_dir)
    return Evaluator(pmodel, load_tasks(cfg), tokenizer, cfg).run(progress=progress)
