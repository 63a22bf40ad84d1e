"""`checkpoint.push_to_hub`: each checkpoint of a run uploaded to the Hub in the background, on rank 0.

What is pushed for a step is what a user of the Hub wants: a stock HF folder of that checkpoint's weights
(in the training dtype, with the run's record, from which `push_to_hub` makes the model card), converted
from the published checkpoint's files as `hf3d convert to-hf` converts them, committed to the branch
`step_<N>` of the repo. Nothing of it runs in the training loop: `submit` records the checkpoint and queues it
(a lock, a small file write and a queue put), and one worker thread converts, then uploads, one checkpoint after
the other.

- Only a complete checkpoint is pushed: `submit` is called once the save is published (after the marker,
  for an async save in its background publication), and the conversion refuses a checkpoint whose files
  differ from the sizes and CRC-32s its marker records.
- A checkpoint waiting for its push is kept until the push succeeds: it is listed in `<output_dir>/
  hub_pending.json` from `submit` on (so a stop, a kill or a failed push leaves it listed), `pinned()` is
  what keep_last rotation keeps, and a resumed run pushes the listed ones again first. Only
  `checkpoint.drop_pending_pushes` forgets them (`pending_checkpoints`).
- The upload is `hf3d push`'s (hf3d/hf/hub.py): links are not followed, the token is never written, the
  converted folder (in `<output_dir>/hub_push/step_<N>`) replaces only an export of hf3d's. It is removed once
  pushed or failed. Each request gives up after `request_timeout_s` without an answer or a byte moved; a push
  retries for at most `timeout_s`.
- A failure (conversion or upload) is one warning line and a line of `hub_push_error` in the next metrics
  record (every failure since the last record, one line each); the run goes on. `finish` at the end of the run
  waits for the pushes left at most `timeout_s`, or until a stop signal, then names those left undone.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .config import CheckpointPushConfig

STAGING = "hub_push"
"""The folder under output_dir that holds the converted checkpoints until they are pushed."""
PENDING_FILE = "hub_pending.json"
"""The checkpoints under output_dir waiting for their push: {"repo": ..., "steps": {N: {"checkpoint", "error"}}}."""


def branch_of(step: int) -> str:
    """The Hub branch a step's checkpoint goes to."""
    return f"step_{step}"


def read_pending(out: Path) -> dict[int, dict]:
    """The steps hub_pending.json lists ({step: {"checkpoint": path under out, "error": the last failure or
    None}}), {} when there is none; a record that is not one of hf3d's is refused in one line."""
    path = Path(out) / PENDING_FILE
    if not path.is_file():
        return {}
    try:
        steps = json.loads(path.read_text())["steps"]
        pending = {int(n): {"checkpoint": str(v["checkpoint"]), "error": v.get("error")} for n, v in steps.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ValueError(
            f"{path} is not hf3d's record of the checkpoints waiting for a Hub push: delete it (their checkpoints "
            "are then kept or deleted by keep_last like any other)"
        ) from None
    for entry in pending.values():
        if Path(entry["checkpoint"]).is_absolute() or ".." in Path(entry["checkpoint"]).parts:
            raise ValueError(f"{path} names {entry['checkpoint']!r}, not a checkpoint under {out}: delete the file")
    return pending


def pending_checkpoints(out: Path, *, drop: bool, say: Callable[[str], None]) -> frozenset[Path]:
    """Without checkpoint.push_to_hub (rank 0): the checkpoints an earlier run left waiting for their push, kept
    from rotation and said once; with `drop` (checkpoint.drop_pending_pushes), the record is removed instead."""
    from ..utils import files

    pending = read_pending(out)
    if pending and drop:
        files.remove_file(Path(out) / PENDING_FILE)
        say(f"hf3d: forgot the Hub pushes of steps {sorted(pending)} (checkpoint.drop_pending_pushes): keep_last "
            "treats their checkpoints like any other")  # fmt: skip
        return frozenset()
    if pending:
        say(
            f"hf3d: the checkpoints of steps {sorted(pending)} wait for a Hub push ({PENDING_FILE}): kept; set "
            "checkpoint.push_to_hub to push them, or checkpoint.drop_pending_pushes=true to let keep_last drop them"
        )
    return frozenset(Path(out) / e["checkpoint"] for e in pending.values())


class CheckpointPusher:
    """Rank 0's background converter and uploader of a run's checkpoints."""

    def __init__(self, cfg: CheckpointPushConfig, out: Path, *, say=None, drop: bool = False, retry_wait_s=1.0):
        self.cfg, self.out, self.staging = cfg, Path(out), Path(out) / STAGING
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.retry_wait_s = retry_wait_s
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pending = read_pending(self.out)  # step -> {"checkpoint", "error"}: queued, pushing or failed
        self.waiting: list[int] = []  # steps queued or being pushed
        self.pushed: list[int] = []
        self.failed: list[int] = []
        self.errors: list[str] = []  # for the next metrics record
        self.news: dict = {}
        self._clean()
        if self.pending and drop:
            pending_checkpoints(self.out, drop=True, say=self.say)
            self.pending = {}
        self._retry_pending()
        self.thread = threading.Thread(target=self._work, name="hf3d-hub-push", daemon=True)
        self.thread.start()

    def _clean(self) -> None:
        """What a killed run left in the staging folder: its converted folders (of hf3d's, holding only an
        export's files) go; anything else stays."""
        from ..hf.folders import EXPORT
        from ..utils import files

        for d in sorted(self.staging.iterdir()) if self.staging.is_dir() else []:
            if files.refusal(d, EXPORT) is None:
                files.remove_dir(d, EXPORT)

    def _retry_pending(self) -> None:
        """The pushes an earlier run of this output_dir left undone (stopped, killed, failed), queued first."""
        from ..checkpoint.marker import is_complete

        gone = [n for n, e in self.pending.items() if not is_complete(self.out / e["checkpoint"])]
        for n in gone:
            self.say(f"hf3d: warning: the checkpoint of step {n} that waited for its Hub push is gone or incomplete "
                     f"({self.out / self.pending.pop(n)['checkpoint']}); not pushed")  # fmt: skip
        if self.pending:
            self.say(f"hf3d: pushing to {self.cfg.repo} the checkpoints of steps {sorted(self.pending)} an earlier "
                     "run left unpushed")  # fmt: skip
        for n in sorted(self.pending):
            self.waiting.append(n)
            self.queue.put((self.out / self.pending[n]["checkpoint"], n))
        self._write_pending()

    def _write_pending(self) -> None:
        """hub_pending.json as `pending` says (removed when nothing waits). Called with the lock held, or before
        the worker starts."""
        from ..utils import files

        path = self.out / PENDING_FILE
        if not self.pending:
            if path.is_file():
                files.remove_file(path)
            return
        steps = {str(n): self.pending[n] for n in sorted(self.pending)}
        files.write_file(path, json.dumps({"repo": self.cfg.repo, "steps": steps}, indent=1) + "\n", replace=True)

    # -- the training loop's side: each call returns at once -----------------------------------------
    def submit(self, ckpt: Path, step: int) -> None:
        """Queue the published checkpoint `ckpt` (of `step`) for conversion and upload, kept until pushed."""
        with self.lock:
            self.pending[step] = {"checkpoint": Path(ckpt).relative_to(self.out).as_posix(), "error": None}
            self.waiting.append(step)
            self._write_pending()
        self.queue.put((Path(ckpt), step))

    def pinned(self) -> frozenset[Path]:
        """The checkpoints rotation must not delete now: queued, being pushed, or whose push failed."""
        with self.lock:
            return frozenset(self.out / e["checkpoint"] for e in self.pending.values())

    def take_news(self) -> dict:
        """Since the last call, for a metrics record (scalars and text, as trackers take them): "hub_pushed", the
        newest step pushed, and "hub_push_error", every failure's line (one per line of the text)."""
        with self.lock:
            news, self.news = self.news, {}
            if self.errors:
                news["hub_push_error"], self.errors = "\n".join(self.errors), []
        return news

    def finish(self, *, wait: bool = True, stopped: Callable[[], int] = lambda: 0) -> int:
        """The end of the run: wait for the pushes left (saying so) at most timeout_s, or until `stopped()` returns
        a signal number, then one line of what was pushed and what failed; or, when not `wait` (a stop signal),
        say which are left. Returns the signal that cut the wait short (0: none)."""
        with self.lock:
            left = list(self.waiting)
        if left and not wait:
            self._left_undone(left, "stopped")
            return 0
        if left:
            self.say(f"hf3d: waiting up to {self.cfg.timeout_s:g} s for {len(left)} Hub push(es) of checkpoints "
                     f"(steps {left}) to {self.cfg.repo}")  # fmt: skip
        self.queue.put(None)
        deadline, signum = time.monotonic() + self.cfg.timeout_s, 0
        while self.thread.is_alive() and time.monotonic() < deadline and not (signum := stopped()):
            self.thread.join(0.1)
        if self.thread.is_alive():
            with self.lock:
                left = list(self.waiting)
            why = f"stopped by {signal.Signals(signum).name}" if signum else f"after {self.cfg.timeout_s:g} s"
            self._left_undone(left, why)
            return signum
        from ..hf.folders import EXPORT
        from ..utils import files

        try:  # empty once every converted folder is pushed or removed; anything else there stays
            files.remove_dir(self.staging, EXPORT)
        except (OSError, ValueError):
            pass
        failed = f"; failed: steps {self.failed} (kept for the next resume to push; see the warnings above)"
        self.say(f"hf3d: Hub pushes to {self.cfg.repo}: steps {self.pushed} pushed{failed if self.failed else ''}")
        return 0

    def _left_undone(self, left: list[int], why: str) -> None:
        with self.lock:
            failed = sorted(set(self.pending) - set(left))
        also = f" (and the failed ones of steps {failed})" if failed else ""
        self.say(f"hf3d: not waiting for the Hub pushes of steps {left} ({why}): their checkpoints{also} are kept "
                 f"and listed in {self.out / PENDING_FILE}; a resume of this run pushes them, or push one with "
                 "`hf3d convert to-hf` and `hf3d push --revision step_<N>`")  # fmt: skip

    # -- the worker thread ----------------------------------------------------------------------------
    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            ckpt, step = item
            try:
                url = self._push(ckpt, step)
            except Exception as e:  # noqa: BLE001 - a failed push is reported, the run goes on
                line = (
                    f"the Hub push of checkpoint {ckpt.name} to {self.cfg.repo} (branch {branch_of(step)}) failed: "
                    f"{' '.join(str(e).split()) or type(e).__name__}"
                )
                self.say(f"hf3d: warning: {line}; training goes on, the checkpoint is kept for a later push")
                with self.lock:
                    self.errors.append(line)
                    self.failed.append(step)
                    self.pending[step]["error"] = line
                    self._write_pending()
            else:
                self.say(f"hf3d: pushed checkpoint {ckpt.name} to {self.cfg.repo} branch {branch_of(step)}: {url}")
                with self.lock:
                    self.pushed.append(step)
                    self.news["hub_pushed"] = step
                    self.pending.pop(step, None)
                    self._write_pending()
            finally:
                with self.lock:
                    self.waiting.remove(step)

    def _push(self, ckpt: Path, step: int) -> str:
        from ..checkpoint.convert import checkpoint_to_hf
        from ..hf.folders import EXPORT
        from ..hf.hub import push_to_hub
        from ..utils import files

        deadline = time.monotonic() + self.cfg.timeout_s
        export = self.staging / branch_of(step)
        try:
            checkpoint_to_hf(ckpt, export)  # refuses an incomplete or damaged checkpoint
            return push_to_hub(
                export,
                self.cfg.repo,
                private=self.cfg.private,
                revision=branch_of(step),
                commit_message=f"Checkpoint at step {step}, pushed by hf3d",
                retry_wait_s=self.retry_wait_s,
                request_timeout=self.cfg.request_timeout_s,
                deadline=deadline,
            )
        finally:
            files.remove_dir(export, EXPORT)
