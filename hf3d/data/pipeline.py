"""DataPipeline: the global batch of each step, from stages of weighted mixtures of token sources.

The batch of step t is a function of (seed, t, state): row r of the global batch draws its source
from the weights of the stage that contains t (a generator seeded by (seed, t)); each source hands
out its training windows in a seeded permutation (a new one each epoch) through its own cursor, the
rows drawing it taking successive windows in row order. Every dp rank computes the same global
choice (index arithmetic only) and reads and packs just its rows [d * B / dp, (d + 1) * B / dp), so
dp ranks are disjoint and together cover the global batch. The state is a few integers per source
(cursor, epoch, consumed tokens), so a checkpoint resumes mid-epoch and mid-stage on the same next
batch; taking a later step than the next one replays the skipped steps' draws without reading data.

Stages may read rows of different lengths (data.stages[].seq_len). A source read at two lengths is two
views of its tokens, each with its own windows, permutation and cursor (`name@seq_len`; the plain name
is the view at data.seq_len, which evaluation also reads): a view at a new length starts at its first
window, and the position of each other view is kept in the checkpoint for a stage that returns to it.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .config import DataConfig, SourceConfig
from .held_out import HeldOutRows
from .packing import collate, pack_window
from .sources import (
    TokenSource,
    build_token_cache,
    cache_key,
    default_cache_dir,
    open_datatrove,
    open_token_cache,
    resolve,
)
from .summary import summary_lines

# first words of the generators' seeds: the streams of mixture draws, permutations and eval never meet
_DRAW, _PERM = 0, 1  # _EVAL (2) is held_out.py's


def _window(s: SourceConfig, opened: tuple, seq_len: int, where: str) -> TokenSource:
    segments, meta = opened
    src = TokenSource(s.label, segments, meta, seq_len + 1)
    if src.num_windows == 0:
        raise ValueError(
            f"data source {s.label!r} ({s.path}) holds {src.num_tokens} tokens in {src.num_docs} documents, "
            f"fewer than one window of seq_len + 1 = {seq_len + 1} ({where}); lower data.seq_len (or the stage's) "
            "or add data"
        )
    return src


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """datasets' progress bars (loading, tokenising) on, or off for the block; their setting is restored."""
    import datasets

    if shown or datasets.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


class DataPipeline(HeldOutRows):
    """Global batches for training and evaluation; see the module docstring for the order."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer,
        *,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        total_steps: int,
        local_main: bool = True,
        barrier: Callable[[], None] | None = None,
        show_progress: bool = True,
    ):
        if global_batch < 1 or global_batch % dp_size:
            raise ValueError(f"the global batch ({global_batch}) must be a positive multiple of dp={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.cfg, self.global_batch, self.dp_rank, self.dp_size = cfg, global_batch, dp_rank, dp_size
        self.total_steps = total_steps
        self.stages = cfg.resolved_stages()
        for i, stage in enumerate(self.stages):
            if stage.start_step >= total_steps:
                raise ValueError(
                    f"data.stages[{i}] ({stage.name}) would start at step {stage.start_step + 1} (start_step "
                    f"{stage.start_step}), but the run has only {total_steps} steps; move or remove it"
                )
        self.eval_every = cfg.eval.every
        self.eval_batch = cfg.eval.batch or global_batch
        if self.eval_every and self.eval_batch % dp_size:
            raise ValueError(f"data.eval.batch ({self.eval_batch}) must be a multiple of dp={dp_size}")

        specs: dict[str, SourceConfig] = {}
        for stage in self.stages:
            for s in stage.sources:
                specs.setdefault(s.label, s)
        eval_spec = cfg.eval.source() if self.eval_every else None
        if eval_spec is not None:
            if "eval" in specs:
                raise ValueError("a training source may not be named 'eval' (the name of data.eval's source)")
            specs["eval"] = eval_spec
        with _progress_bars(show_progress):  # a node's main process tokenises; a job shows the bars once
            tokens = self._open(specs, tokenizer, local_main, barrier)
        self._build_views(tokens)
        self.eval_source = None
        if eval_spec is not None:
            self.eval_source = _window(eval_spec, tokens["eval"], cfg.seq_len, "data.eval")

        # training windows of each source: all of them, or all but the held-out tail (eval.fraction)
        self.num_train = {name: src.num_windows for name, src in self.sources.items()}
        if self.eval_every and cfg.eval.fraction:
            for s in self.stages[0].sources:
                n = self.sources[s.label].num_windows
                held = max(1, int(n * cfg.eval.fraction))
                if n - held < 1:
                    raise ValueError(
                        f"data source {s.label!r} has {n} windows: too few to hold out data.eval.fraction="
                        f"{cfg.eval.fraction} and still train; lower the fraction or use data.eval.path"
                    )
                self.num_train[s.label] = n - held
        self._state = {name: dict(cursor=0, epoch=0, consumed_tokens=0) for name in self.sources}
        self._kept: dict[str, dict] = {}  # restored views no stage of this run reads (another seq_len)
        self.resume_notes: list[str] = []  # what a restore could not continue (summary lines)
        self._next_step = 0
        self._perms: dict[str, tuple[int, np.ndarray]] = {}
        self._eval: list[dict] | None = None

    # --- building / opening the sources ---------------------------------------------------------

    def _build_views(self, tokens: dict[str, tuple]) -> None:
        """self.sources: view -> TokenSource (windows of its seq_len + 1), and which source and seq_len each is."""
        self.view_source: dict[str, str] = {}
        self.view_seq_len: dict[str, int] = {}
        self.stage_views = [[self._view(s.label, stage.seq_len) for s in stage.sources] for stage in self.stages]
        self.sources: dict[str, TokenSource] = {}
        for stage, views in zip(self.stages, self.stage_views):
            for s, view in zip(stage.sources, views):
                if view not in self.sources:
                    where = f"data stage {stage.name}"
                    self.sources[view] = _window(s, tokens[s.label], stage.seq_len, where)
                    self.view_source[view], self.view_seq_len[view] = s.label, stage.seq_len

    def _view(self, label: str, seq_len: int) -> str:
        return label if seq_len == self.cfg.seq_len else f"{label}@{seq_len}"

    def _open(self, specs: dict[str, SourceConfig], tokenizer, local_main: bool, barrier) -> dict[str, tuple]:
        """Each source's tokenised (segments, meta), tokenising on the node's main process when not cached."""
        cfg = self.cfg
        resolved = {name: resolve(s) for name, s in specs.items()}
        root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        datasets_cache = str(root / "datasets") if cfg.cache_dir else None
        folders = {
            name: root / cache_key(specs[name], res, tokenizer)
            for name, res in resolved.items()
            if res.kind != "datatrove"
        }
        error = None
        if local_main:  # tokenise on one process per node; the others wait at the barrier
            try:
                for name, folder in folders.items():
                    if not (folder / "meta.json").is_file():
                        build_token_cache(
                            specs[name],
                            resolved[name],
                            tokenizer,
                            folder,
                            num_proc=cfg.num_proc,
                            datasets_cache=datasets_cache,
                        )
            except Exception as e:  # noqa: BLE001 - re-raised after the barrier, so the others do not hang
                error = e
        if barrier is not None:
            barrier()
        if error is not None:
            raise error
        out = {}
        for name, s in specs.items():
            if name in folders:
                segments, meta = open_token_cache(folders[name], s)
            else:
                segments, meta = open_datatrove(s, resolved[name].files, tokenizer)
            meta["kind"] = resolved[name].kind
            out[name] = (segments, meta)
        return out

    # --- the order ----------------------------------------------------------------------------

    def stage_index(self, step: int) -> int:
        starts = [s.start_step for s in self.stages]
        return int(np.searchsorted(starts, step, side="right")) - 1

    @property
    def stage_starts(self) -> list[tuple[int, str]]:
        return [(s.start_step, s.name) for s in self.stages]

    def seq_len(self, step: int) -> int:
        """The row length of `step` (its stage's seq_len)."""
        return self.stages[self.stage_index(step)].seq_len

    def _choices(self, step: int) -> tuple[list[str], np.ndarray]:
        """The stage's source views and each global row's source index [global_batch]."""
        i = self.stage_index(step)
        sources, names = self.stages[i].sources, self.stage_views[i]
        if len(sources) == 1:
            return names, np.zeros(self.global_batch, dtype=np.int64)
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        rng = np.random.default_rng([self.cfg.seed, _DRAW, step, 0])
        return names, rng.choice(len(sources), size=self.global_batch, p=weights / weights.sum())

    def _perm(self, name: str, epoch: int) -> np.ndarray:
        cached = self._perms.get(name)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.cfg.seed, _PERM, zlib.crc32(name.encode()), epoch])
            n = self.num_train[name]
            cached = (epoch, rng.permutation(n).astype(np.int32 if n < 2**31 else np.int64))
            self._perms[name] = cached
        return cached[1]

    def _take(self, name: str, count: int) -> np.ndarray:
        """The next `count` training windows of source `name`, advancing its cursor (and epoch)."""
        st, n = self._state[name], self.num_train[name]
        out = []
        while count > 0:
            k = min(count, n - st["cursor"])
            out.append(self._perm(name, st["epoch"])[st["cursor"] : st["cursor"] + k])
            st["cursor"] += k
            count -= k
            if st["cursor"] == n:
                st["cursor"], st["epoch"] = 0, st["epoch"] + 1
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _advance(self, step: int) -> list[tuple[str, int]]:
        """(source, window) of every global row of `step`; advances the state past `step`."""
        names, choice = self._choices(step)
        rows: list[tuple[str, int] | None] = [None] * self.global_batch
        for i, name in enumerate(names):
            idx = np.flatnonzero(choice == i)
            for r, k in zip(idx, self._take(name, len(idx))):
                rows[r] = (name, int(k))
            self._state[name]["consumed_tokens"] += len(idx) * self.view_seq_len[name]
        self._next_step = step + 1
        return rows

    def _mine(self, rows: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """This dp rank's part of a global batch's rows."""
        per = len(rows) // self.dp_size
        return rows[self.dp_rank * per : (self.dp_rank + 1) * per]

    def _pack(self, rows: list[tuple[str, int]], source: dict[str, TokenSource] | None = None) -> dict:
        packed = []
        for name, k in self._mine(rows):
            tokens, starts = (source or self.sources)[name].read(k)
            packed.append(pack_window(tokens, starts, document_masking=self.cfg.document_masking))
        return collate(packed)

    def next_batch(self, step: int) -> dict:
        """This dp rank's rows of step `step`: input_ids, shift_labels, position_ids, LongTensor
        [global_batch / dp, seq_len]. Steps are taken in order; a skipped step's draws are replayed."""
        if step < self._next_step:
            raise ValueError(
                f"the batch of step {step} was already taken (the next is step {self._next_step}); "
                "take batches in step order, or load the state saved before that step"
            )
        while self._next_step < step:
            self._advance(self._next_step)
        return self._pack(self._advance(step))

    @property
    def consumed_tokens(self) -> dict[str, int]:
        """Training tokens (inputs) drawn from each source so far, over all dp ranks (all its seq_lens)."""
        out = dict.fromkeys(self.view_source.values(), 0)
        for view, st in self._state.items():
            out[self.view_source[view]] += st["consumed_tokens"]
        for st in self._kept.values():
            out[st["source"]] += st["consumed_tokens"]
        return out

    # --- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        views = {}
        for name, st in self._state.items():
            views[name] = {**st, "num_windows": self.num_train[name], "source": self.view_source[name]}
            views[name]["seq_len"] = self.view_seq_len[name]
        return {
            "next_step": self._next_step,
            "seed": self.cfg.seed,
            "seq_len": self.cfg.seq_len,
            "sources": {**self._kept, **views},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict, also one saved at other seq_lens: a source's view at a seq_len the state
        does not hold starts at its first window, and views no stage reads now are kept for later saves."""
        if state["seed"] != self.cfg.seed:
            raise ValueError(
                f"the saved data state has data.seed={state['seed']}, the config {self.cfg.seed}; "
                f"resume with data.seed={state['seed']}"
            )
        labels, restored = set(self.view_source.values()), set()
        for name, saved in state["sources"].items():
            label, seq_len = saved.get("source", name), int(saved.get("seq_len", state["seq_len"]))
            view = self._view(label, seq_len)
            if label not in labels:
                continue  # a source of an earlier configuration, no longer used
            if view not in self._state:
                self._kept[view] = {**saved, "source": label, "seq_len": seq_len}
                continue
            if saved["num_windows"] != self.num_train[view]:
                raise ValueError(
                    f"data source {label!r} had {saved['num_windows']} training windows when saved and has "
                    f"{self.num_train[view]} now (of {seq_len + 1} tokens): its data or eval split changed; resume "
                    "with the same data"
                )
            self._state[view] = {k: int(saved[k]) for k in ("cursor", "epoch", "consumed_tokens")}
            restored.add(view)
        for view in [v for v in self._state if v not in restored]:  # in stage order: the notes read the same each run
            label = self.view_source[view]
            others = sorted(k["seq_len"] for k in self._kept.values() if k["source"] == label)
            if others:
                self.resume_notes.append(
                    f"data source {label!r} is read at seq_len {self.view_seq_len[view]} from its first window: the "
                    f"checkpoint holds its position at seq_len {', '.join(map(str, others))} only (kept for those)"
                )
        self._next_step = int(state["next_step"])

    # --- reporting --------------------------------------------------------------------------------

    def summary(self) -> list[str]:
        """Lines for the start of a run: each source, each stage, the eval split (hf3d/data/summary.py)."""
        return summary_lines(self)
