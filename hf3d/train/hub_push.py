"""`checkpoint.push_to_hub`: each checkpoint of a run uploaded to the Hub in the background, on rank 0.

What is pushed for a step is what a user of the Hub wants: a stock HF folder of that checkpoint's weights
(in the training dtype, with the run's record, from which `push_to_hub` makes the model card), converted
from the published checkpoint's files as `hf3d convert to-hf` converts them, committed to the branch
`step_<N>` of the repo. Nothing of it runs in the training loop: `submit` pins the checkpoint and queues it
(a lock and a queue put), and one worker thread converts, then uploads, one checkpoint after the other.

- Only a complete checkpoint is pushed: `submit` is called once the save is published (after the marker,
  for an async save in its background publication), and the conversion refuses a checkpoint whose files
  differ from the sizes and CRC-32s its marker records.
- keep_last rotation never deletes a checkpoint still queued or being converted: `pinned()` is what
  `finish_save` keeps; once converted (into `<output_dir>/hub_push/step_<N>`, a folder of hf3d's own), it is
  unpinned, and the next rotation (or the end of the run, `finish`) drops it.
- The upload is `hf3d push`'s (hf3d/hf/hub.py): links are not followed, the token is never written, the
  converted folder replaces only an export of hf3d's (`check_output_dir`). It is removed once pushed.
- A failure (conversion or upload) is one warning line and a `hub_push_error` in the next metrics record;
  the run goes on. `finish` at the end of the run waits for the pushes left and says so.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from .config import CheckpointPushConfig

STAGING = "hub_push"
"""The folder under output_dir that holds the converted checkpoints until they are pushed."""


def branch_of(step: int) -> str:
    """The Hub branch a step's checkpoint goes to."""
    return f"step_{step}"


class CheckpointPusher:
    """Rank 0's background converter and uploader of a run's checkpoints."""

    def __init__(self, cfg: CheckpointPushConfig, out: Path, *, say: Callable[[str], None] | None = None):
        self.cfg, self.staging = cfg, Path(out) / STAGING
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pins: set[Path] = set()
        self.waiting: list[int] = []  # steps queued or being pushed
        self.pushed: list[int] = []
        self.failed: list[int] = []
        self.news: dict = {}  # for the next metrics record
        self._clean()
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

    # -- the training loop's side: each call returns at once -----------------------------------------
    def submit(self, ckpt: Path, step: int) -> None:
        """Queue the published checkpoint `ckpt` (of `step`) for conversion and upload, pinned until converted."""
        with self.lock:
            self.pins.add(Path(ckpt))
            self.waiting.append(step)
        self.queue.put((Path(ckpt), step))

    def pinned(self) -> frozenset[Path]:
        """The checkpoints rotation must not delete now (queued or being converted)."""
        with self.lock:
            return frozenset(self.pins)

    def take_news(self) -> dict:
        """Since the last call, for a metrics record (scalars and text, as trackers take them): "hub_pushed", the
        newest step pushed, and "hub_push_error", the newest failure's line."""
        with self.lock:
            news, self.news = self.news, {}
        return news

    def finish(self, *, wait: bool = True) -> None:
        """The end of the run: wait for the pushes left (saying so), then one line of what was pushed and what
        failed; or, when not `wait` (a stop signal), say which are abandoned."""
        with self.lock:
            left = list(self.waiting)
        if left and not wait:
            self.say(f"hf3d: not waiting for the Hub pushes of steps {left} (stopped); push them with "
                     "`hf3d convert to-hf` and `hf3d push --revision step_<N>`")  # fmt: skip
            return
        if left:
            self.say(f"hf3d: waiting for {len(left)} Hub push(es) of checkpoints (steps {left}) to {self.cfg.repo}")
        self.queue.put(None)
        self.thread.join()
        from ..hf.folders import EXPORT
        from ..utils import files

        try:  # empty once every converted folder is pushed or removed; anything else there stays
            files.remove_dir(self.staging, EXPORT)
        except (OSError, ValueError):
            pass
        failed = f"; failed: steps {self.failed} (see the warnings above)" if self.failed else ""
        self.say(f"hf3d: Hub pushes to {self.cfg.repo}: steps {self.pushed} pushed{failed}")

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
                self.say(f"hf3d: warning: {line}; training goes on")
                with self.lock:
                    self.news["hub_push_error"] = line
                    self.failed.append(step)
            else:
                self.say(f"hf3d: pushed checkpoint {ckpt.name} to {self.cfg.repo} branch {branch_of(step)}: {url}")
                with self.lock:
                    self.pushed.append(step)
                    self.news["hub_pushed"] = step
            finally:
                with self.lock:
                    self.pins.discard(ckpt)
                    self.waiting.remove(step)

    def _push(self, ckpt: Path, step: int) -> str:
        from ..checkpoint.convert import checkpoint_to_hf
        from ..hf.folders import EXPORT
        from ..hf.hub import push_to_hub
        from ..utils import files

        export = self.staging / branch_of(step)
        try:
            checkpoint_to_hf(ckpt, export)  # refuses an incomplete or damaged checkpoint
        finally:
            with self.lock:
                self.pins.discard(ckpt)  # converted (or not convertible): rotation may drop it now
        try:
            return push_to_hub(
                export,
                self.cfg.repo,
                private=self.cfg.private,
                revision=branch_of(step),
                commit_message=f"Checkpoint at step {step}, pushed by hf3d",
            )
        finally:
            files.remove_dir(export, EXPORT)
