"""The hang watchdog of `hf3d train` (run.hang_timeout).

A rank that stops making progress (a stuck collective, a straggler, a peer gone without exiting) would hold the
job until the process group's timeout, whose error says only that a collective timed out. Here a daemon thread
per rank watches the time since the last finished step and, past the deadline, has every rank say where it is;
one line names the ranks that did not get as far as the others, and every rank ends with EXIT_HANG (4), which
torchrun's --max-restarts restarts from the last checkpoint.

- The hot path stays cheap: at each phase change the main thread assigns one tuple (step, mark, phase, since,
  exempt) and, at a step's end, a time. The thread polls every tenth of the timeout (0.05-5 s): its own clock,
  and one store read (has a rank raised the alarm?). No collective, no store write per step.
- Long phases are not hangs. The first step of the run and of each data stage (compile, warm-up) and the phases
  a `long` block marks (evaluation, downstream evaluation, samples, checkpoint save) stop this rank's clock,
  and its thread counts the rank in a job-wide `busy` counter in the store while it is in one (a write only
  when that changes). A rank past its deadline that sees a busy peer (rank 0 pruning checkpoints alone while
  the others wait in the next step) starts its clock again. The end of the run (export) is not watched.
- The alarm. A rank past its deadline publishes its report (step, phase, the innermost frames of its main
  thread: a rank blocked in a C++ collective or in a sleep has released the GIL, so its thread runs) and counts
  itself in `reported`; the others see the count at their next poll and publish theirs. The first rank to take
  faults' "reported" key (the key faults.fail takes: a hang and an error never both print) waits until every
  rank reported or a short window passed, prints the line and publishes it. A rank that published nothing is
  named silent: its process or node is gone, or C code holds its GIL.
- Who is behind: the ranks at the lowest (step, mark) position (every rank counts its marks in the same
  order); among those, the ones not waiting in a collective (innermost frame in torch.distributed, or a
  `.wait(` call) when some of them are. The others are said to wait, with the frame they wait in.
- Leaving: each rank writes the line into torchrun's error file, then all wait on one store key and leave with
  os._exit(4) together, so that no rank sees a peer's sockets close first and leaves through faults.fail (3).
  Nothing is published halfway: a checkpoint being written is left without its marker, as a kill leaves it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import linecache
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from ..utils.faults import EXIT_HANG, REPORTED_KEY, RunState, exit_now, tell_the_launcher

BATCH, FORWARD, OPTIMIZER, AFTER = "loading the batch", "forward and backward", "optimizer step", "after the step"
AUTO_FLOOR_S = 120.0  # auto never waits less: a slow filesystem or a host hiccup is not a hang
AUTO_STEPS = 20  # auto waits this many times the longest step seen (the run's first and stage starts left out)
AUTO_SHARE = 0.8  # auto stays under this share of run.collective_timeout_s, which would end the run first
FRAMES = 8  # innermost frames of the main thread each rank publishes
NAMED = 4  # ranks named one by one in the line; more are counted
LEAVE_WAIT_S = 10.0  # how much longer than the report window a rank waits for the line, and for its peers


def auto_timeout(longest_step_s: float, collective_timeout_s: float) -> float:
    """run.hang_timeout=auto: AUTO_STEPS x the longest step measured so far, at least AUTO_FLOOR_S, at most
    AUTO_SHARE x run.collective_timeout_s."""
    return min(max(AUTO_FLOOR_S, AUTO_STEPS * longest_step_s), AUTO_SHARE * collective_timeout_s)


def _short(path: str) -> str:
    """A source path relative to the sys.path entry it lives under (torch/distributed/..., hf3d/train/...)."""
    path = os.path.abspath(path)
    roots = [os.path.abspath(p) for p in sys.path if p]
    under = [r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(under, key=len)).replace(os.sep, "/") if under else path


def _waiting(frames: list[list], raw) -> bool:
    """Whether the innermost frame waits for peers: it is in torch.distributed, or its line calls `.wait(`."""
    if not frames:
        return False
    if frames[0][1].startswith("torch/distributed/"):
        return True
    return raw is not None and ".wait(" in linecache.getline(raw.f_code.co_filename, raw.f_lineno)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _limit(s: float) -> str:
    return f"{s:g}" if s < 10 else f"{s:.0f}"


def _ranks(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-2, 5`."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in runs)
    return ("ranks " if len(ranks) > 1 else "rank ") + text


def _who(rank: int, coords: dict | None) -> str:
    where = ", ".join(f"{k}={v}" for k, v in (coords or {}).items())
    return f"rank {rank}" + (f" ({where})" if where else "")


def _frame(frames: list[list]) -> str:
    """`fn (file:line)` of the innermost frame, and `via fn (hf3d/...:line)`, the innermost of hf3d's below it."""
    if not frames:
        return "no Python frame"
    text = "{} ({}:{})".format(*frames[0])
    if not frames[0][1].startswith("hf3d/"):
        via = next((f for f in frames[1:] if f[1].startswith("hf3d/")), None)
        text += " via {} ({}:{})".format(*via) if via else ""
    return text


def _at(report: dict) -> str:
    return f"step {report['step']}, {report['phase']}, in {_frame(report['frames'])}"


def _listed(items: list[str], noun: str) -> str:
    more = len(items) - NAMED
    return "; ".join(items[:NAMED]) + (f"; and {more} more {noun}" if more > 0 else "")


def describe_hang(reports: list[dict], *, world_size: int, coords_of: Callable[[int], dict | None]) -> str:
    """Where the ranks are, in one line (without the command and the timeout), from each rank's published report:
    the ranks behind the others (coordinates, step, phase, frame, for how long), the silent ones, then where the
    others wait. `coords_of(rank)` gives a silent rank's mesh coordinates."""
    seen = {r["rank"] for r in reports}
    silent = [r for r in range(world_size) if r not in seen]
    lowest = min(((r["step"], r["mark"]) for r in reports), default=None)
    candidates = [r for r in reports if (r["step"], r["mark"]) == lowest]
    active = [r for r in candidates if not r["waiting"]]
    behind = active or ([] if silent else candidates)
    others = [r for r in reports if r not in behind]
    parts = []
    if behind:
        said = [f"{_who(r['rank'], r['coords'])} at {_at(r)} for {_seconds(r['for_s'])}" for r in behind]
        if world_size == 1:
            lead = "it is stuck: "
        elif others or silent:
            lead = f"{_ranks([r['rank'] for r in behind])} did not get as far as the others: "
        else:
            lead = "no rank is behind the others: "
        parts.append(lead + _listed(said, "ranks"))
    if silent:
        said = [_who(r, coords_of(r)) for r in silent]
        parts.append(f"{_ranks(silent)} published nothing (process or node gone?): " + _listed(said, "ranks"))
    groups: dict[str, list[int]] = {}
    for r in others:
        groups.setdefault(_at(r), []).append(r["rank"])
    waits = [f"{_ranks(ranks)} {'wait' if len(ranks) > 1 else 'waits'} at {at}" for at, ranks in groups.items()]
    if waits:
        parts.append(_listed(waits, "places"))
    return "; ".join(parts)


class Watchdog:
    """One rank's watchdog: `begin`, `enter`, `finished` and `long` from the training loop (cheap), `start`
    and `stop` around it. `timeout`: seconds, "auto", or 0 (off: the marks cost a tuple assignment each)."""

    _serial = itertools.count()  # each watchdog of a process its own store keys; every rank starts them alike

    def __init__(
        self,
        timeout: float | str,
        *,
        collective_timeout_s: float,
        state: RunState,
        world_size: int,
        store,
        warmups: frozenset[int] = frozenset(),
        coords_of: Callable[[int], dict | None] = lambda rank: None,
        command: str = "hf3d train",
        leave: Callable[[int], None] = exit_now,
    ):
        self.timeout, self.collective_timeout_s = timeout, collective_timeout_s
        self.state, self.world_size, self.store = state, world_size, store
        self.warmups, self.coords_of, self.command, self.leave = warmups, coords_of, command, leave
        self.prefix = f"hf3d/watchdog/{next(self._serial)}/"
        self.line: str | None = None  # the line this rank printed or received
        now = time.monotonic()
        self._at = (0, 0, "starting", now, True)  # step, mark, phase, since, exempt: the main thread's one write
        self._progress = now  # the end of the last finished step or long phase (main thread)
        self._armed = False  # the run's first step has finished (main thread)
        self._step_t0, self._longest = now, 0.0
        self._busy_published = False  # this rank counted in the store's busy counter (thread)
        self._peer_busy_at = float("-inf")  # when the thread last saw a busy peer
        self._holding = False  # a peer was busy at the thread's last look
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner = None  # the frame that started the watchdog: gone from the stack, the thread quits
        self._thread_id = threading.get_ident()

    @classmethod
    def for_run(cls, run, state: RunState) -> Watchdog:
        """The watchdog of a built `hf3d train` run (hf3d/train/build.Run), not started yet."""
        import torch.distributed as dist

        p, world = run.cfg.parallel, dist.get_world_size()

        def coords_of(rank: int) -> dict | None:
            placed = RunState(rank=rank)
            placed.place(p.tp, p.pp, world, cp=p.cp)
            return placed.coords

        stage_starts = {s for s, _ in run.pipe.stage_starts if s > run.start}
        return cls(
            run.cfg.run.hang_timeout,
            collective_timeout_s=run.cfg.run.collective_timeout_s,
            state=state,
            world_size=world,
            store=dist.distributed_c10d._get_default_store(),
            warmups=frozenset({run.start + 1} | {s + 1 for s in stage_starts}),
            coords_of=coords_of,
        )

    # --- the main thread: cheap marks ------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step `step` (1-based) starts with its batch; a warm-up step (the run's first, a data stage's first)
        stops the clock."""
        now = time.monotonic()
        self._step_t0 = now
        self._at = (step, 0, BATCH, now, step in self.warmups)

    def enter(self, phase: str) -> None:
        step, mark, _, _, exempt = self._at
        self._at = (step, mark + 1, phase, time.monotonic(), exempt)

    def finished(self) -> None:
        """The step's update is done: progress."""
        now = time.monotonic()
        step, mark, _, _, exempt = self._at
        if not exempt:
            self._longest = max(self._longest, now - self._step_t0)
        self._progress, self._armed = now, True
        self._at = (step, mark + 1, AFTER, now, False)

    @contextlib.contextmanager
    def long(self, phase: str) -> Iterator[None]:
        """A phase that may last long (evaluation, checkpoint save): the clock stops, and starts again at its end."""
        step, mark, _, _, _ = self._at
        self._at = (step, mark + 1, phase, time.monotonic(), True)
        yield
        self._progress = now = time.monotonic()
        self._at = (step, mark + 2, AFTER, now, False)

    def start(self) -> Watchdog:
        """Start the thread (not when the timeout is 0); it watches the calling thread while the caller's frame is
        on its stack."""
        if self.timeout != 0:
            self._owner, self._thread_id = sys._getframe(1), threading.get_ident()
            self._thread = threading.Thread(target=self._watch, name="hf3d-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._owner = None

    # --- the thread ----------------------------------------------------------------------------------------
    def limit_s(self) -> float:
        """The seconds without progress that make a hang, now."""
        if self.timeout == "auto":
            return auto_timeout(self._longest, self.collective_timeout_s)
        return float(self.timeout)

    def _poll_s(self) -> float:
        return min(max(self.limit_s() / 10, 0.05), 5.0)

    def _window_s(self) -> float:
        """How long the first rank to report waits for the others' reports."""
        return max(4 * self._poll_s(), 1.0)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll_s()):
            try:
                alarm = self._due() or (self.world_size > 1 and self.store.add(self._key("reported"), 0) > 0)
            except Exception:  # the store is unreachable (its host is gone): the collectives will say so
                continue
            if alarm and not self._stopped.is_set():
                if self._owner_gone():  # the loop that started it left without stop(): nothing to watch
                    return
                try:
                    self._report_and_leave()
                except Exception as e:  # the store stopped answering halfway: say what this rank knows
                    report = self._report()
                    print(
                        f"{self.command}: hang: no rank finished a step in {_limit(self.limit_s())} s, and the job's "
                        f"store did not answer ({type(e).__name__}: {' '.join(str(e).split())}); "
                        f"{_who(report['rank'], report['coords'])} is at {_at(report)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.leave(EXIT_HANG)
                return

    def _due(self) -> bool:
        """This rank's deadline passed, and no peer is in a long phase."""
        _, _, _, _, exempt = self._at
        if self.world_size > 1 and exempt != self._busy_published:
            self.store.add(self._key("busy"), 1 if exempt else -1)
            self._busy_published = exempt
        if exempt or not self._armed:
            return False
        now = time.monotonic()
        late = now - max(self._progress, self._peer_busy_at) >= self.limit_s()
        if self.world_size > 1 and (late or self._holding):  # held: look each poll until the peers are done
            self._holding = self.store.add(self._key("busy"), 0) > 0
            if self._holding:
                self._peer_busy_at = now
                return False
        return late

    def _owner_gone(self) -> bool:
        frame = sys._current_frames().get(self._thread_id)
        while frame is not None:
            if frame is self._owner:
                return False
            frame = frame.f_back
        return True

    def _report(self) -> dict:
        """Where this rank is: its coordinates, step, phase and mark, how long it has been there, its frames."""
        step, mark, phase, since, _ = self._at
        raw = sys._current_frames().get(self._thread_id)
        frames, frame = [], raw
        while frame is not None and len(frames) < FRAMES:
            frames.append([frame.f_code.co_name, _short(frame.f_code.co_filename), frame.f_lineno])
            frame = frame.f_back
        return {
            "rank": self.state.rank,
            "coords": self.state.coords,
            "step": step,
            "mark": mark,
            "phase": phase,
            "for_s": time.monotonic() - since,
            "frames": frames,
            "waiting": _waiting(frames, raw),
        }

    def _report_and_leave(self) -> None:
        """Publish this rank's report; the first rank to report prints the line; every rank leaves with EXIT_HANG."""
        store, rank = self.store, self.state.rank
        store.set(self._key(f"report/{rank}"), json.dumps(self._report()))
        store.add(self._key("reported"), 1)
        if store.add(REPORTED_KEY, 1) == 1:
            self._tell(self._collect())
        verdict = self._wait_for("verdict", self._window_s() + LEAVE_WAIT_S)
        if verdict is not None:
            self.line = json.loads(verdict)["line"]
            tell_the_launcher(self.line)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        ready = store.add(self._key("ready"), 1)
        if verdict is None or ready >= json.loads(verdict)["ranks"]:
            store.set(self._key("go"), "1")
        self._wait_for("go", LEAVE_WAIT_S)
        self.leave(EXIT_HANG)

    def _collect(self) -> list[dict]:
        """Every rank's report, once all have published or the window (a few polls) has passed."""
        end = time.monotonic() + self._window_s()
        while self.store.add(self._key("reported"), 0) < self.world_size and time.monotonic() < end:
            time.sleep(0.05)
        keys = [self._key(f"report/{r}") for r in range(self.world_size)]
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]

    def _tell(self, reports: list[dict]) -> None:
        from tqdm.auto import tqdm

        limit = _limit(self.limit_s())
        setting = f"auto: {limit} s" if self.timeout == "auto" else f"{self.timeout:g}"
        where = describe_hang(reports, world_size=self.world_size, coords_of=self.coords_of)
        self.line = (
            f"{self.command}: hang: no rank finished a step in {limit} s (run.hang_timeout={setting}): {where}; "
            f"every rank ends with exit code {EXIT_HANG}"
        )
        tqdm.write(self.line, file=sys.stderr)  # on a line of its own, below rank 0's progress bar
        sys.stderr.flush()
        self.store.set(self._key("verdict"), json.dumps({"line": self.line, "ranks": len(reports)}))

    def _wait_for(self, name: str, timeout_s: float) -> bytes | None:
        try:
            self.store.wait([self._key(name)], datetime.timedelta(seconds=timeout_s))
            return self.store.get(self._key(name))
        except Exception:  # the reporter or a peer is gone: leave all the same
            return None
