"""The held-out rows of a DataPipeline: which windows evaluation reads, batch by batch, and from which source.

With data.eval.fraction the last windows of each first-stage source are held out of training, and the eval
rows are drawn from them by the first stage's weights (each source its share, at least one row where there are
enough); with data.eval.path they are that file's windows. The draw is seeded apart from training's streams.
"""

from __future__ import annotations

import numpy as np
import torch

from .sources import TokenSource

_EVAL = 2  # first word of the eval generator's seed (pipeline.py's streams are 0 and 1)


class HeldOutRows:
    """DataPipeline's evaluation methods; they read the pipeline's sources, eval settings and packing."""

    def eval_rows_per_source(self) -> list[int]:
        """Held-out rows of each first-stage source in the eval batches (data.eval.fraction): its share of them by
        weight (largest remainders), and at least one for every source of positive weight where there are rows
        enough, so that each has an eval loss of its own."""
        return _shares([s.weight for s in self.stages[0].sources], self.eval_batch * self.cfg.eval.batches)

    @property
    def eval_names(self) -> list[str]:
        """The sources the eval rows come from, in the order of the eval batches' `source_ids`: the first stage's
        (data.eval.fraction), or "eval" (data.eval.path); [] when evaluation is off."""
        if not self.eval_every:
            return []
        return ["eval"] if self.eval_source is not None else [s.label for s in self.stages[0].sources]

    def eval_batches(self) -> list[dict]:
        """This dp rank's rows of each eval batch (like next_batch's); the same every call; [] when off."""
        if not self.eval_every:
            return []
        if self._eval is None:
            picks, sources, b = *self._eval_picks(), self.eval_batch
            self._eval = [self._pack(picks[i : i + b], sources) for i in range(0, len(picks), b)]
        return self._eval

    def eval_sources(self) -> list[torch.Tensor]:
        """Where the rows of `eval_batches()` come from, batch by batch: this dp rank's rows' indices into
        `eval_names`, LongTensor [rows]; [] when evaluation is off."""
        if not self.eval_every:
            return []
        (picks, _), b = self._eval_picks(), self.eval_batch
        index = {name: i for i, name in enumerate(self.eval_names)}
        mine = [self._mine(picks[i : i + b]) for i in range(0, len(picks), b)]
        return [torch.tensor([index[name] for name, _ in rows], dtype=torch.long) for rows in mine]

    def _eval_picks(self) -> tuple[list[tuple[str, int]], dict[str, TokenSource]]:
        """(source, window) of every global eval row, batch after batch, and the sources they are read from."""
        rows = self.eval_batch * self.cfg.eval.batches
        if self.eval_source is not None:
            return [("eval", k % self.eval_source.num_windows) for k in range(rows)], {"eval": self.eval_source}
        # the held-out tail of each first-stage source, its share of the rows by the first stage's weights
        names = [s.label for s in self.stages[0].sources]
        rng = np.random.default_rng([self.cfg.seed, _EVAL, 0, 0])
        order = rng.permutation(np.repeat(np.arange(len(names)), self.eval_rows_per_source()))
        return _held_out_rows([names[i] for i in order], self.num_train, self.sources), self.sources


def _shares(weights: list[float], rows: int) -> list[int]:
    """`rows` split by `weights` (largest remainders), at least one row for each positive weight where the
    largest share can give one."""
    w = np.array(weights, dtype=np.float64)
    exact = w / w.sum() * rows
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: rows - counts.sum()]] += 1
    for i in np.flatnonzero((counts == 0) & (w > 0)):
        most = int(np.argmax(counts))
        if counts[most] > 1:
            counts[most], counts[i] = counts[most] - 1, 1
    return counts.tolist()


def _held_out_rows(names: list[str], num_train: dict[str, int], sources: dict[str, TokenSource]) -> list[tuple]:
    """(source, window) for rows drawn from `names` in order: each source's held-out windows (those after its
    training windows) one after another, from the first again when a source has fewer than it is drawn."""
    seen = dict.fromkeys(names, 0)
    picks = []
    for name in names:
        held = sources[name].num_windows - num_train[name]
        picks.append((name, num_train[name] + seen[name] % held))
        seen[name] += 1
    return picks
