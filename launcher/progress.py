"""The local launcher's one progress bar for a whole job, drawn from its training tasks'
``/progress`` endpoints with the line a task's own ``ProgressBar`` draws."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from flowmill.runtime import telemetry as tm
from flowmill.runtime.cluster import fetch_progress
from flowmill.runtime.progress import CLEAR_LINE, LINE_INTERVAL_S, is_terminal, render_line

POLL_INTERVAL_S = 1.0
POLL_TIMEOUT_S = 0.5


class JobProgress:
    """The local launcher's one bar for a job, drawn from its training tasks' endpoints.

    A thread polls every task's ``/progress`` about once a second; ``endpoints`` gives the
    tasks to poll, in task order (chief first), as ``(name, url)``, and is called on every
    round, so tasks started later are found. A task that no longer serves is read from
    the snapshot it left at exit (``finals`` gives its file), so the last line shows the
    steps done after the last poll; else its last polled snapshot is kept. Lines go to ``stream``
    under ``lock`` (the one the launcher writes task output under); on a terminal whoever
    writes there calls ``erase`` first, and the bar is drawn again on the next round.
    """

    def __init__(self, desc: str, mode: str, backup_workers: int,
                 endpoints: Callable[[], Sequence[tuple[str, str]]], stream: TextIO,
                 lock: threading.Lock, *, interval: float = POLL_INTERVAL_S,
                 line_interval: float = LINE_INTERVAL_S, timeout: float = POLL_TIMEOUT_S,
                 finals: Callable[[str], str | None] | None = None):
        self.desc = desc
        self.mode = mode
        self.backup_workers = backup_workers
        self.endpoints = endpoints
        self.stream = stream
        self.lock = lock
        self.interval = interval
        self.line_interval = line_interval
        self.timeout = timeout
        self.finals = finals  # task -> the file it leaves its last snapshot in at exit
        self.tty = is_terminal(stream)
        self.snapshots: dict[str, Mapping[str, Any]] = {}
        # (job step, loss) at each poll that found a new step: the run's loss curve when
        # its script writes no summaries (``flowmill.launcher.plot``).
        self.history: list[tuple[int, float]] = []
        self.fetched: dict[str, float] = {}  # task -> monotonic time its snapshot was read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = 0  # width of the line on screen (terminal), 0 when none
        self._last_line = ""  # the last plain line written (elsewhere)
        self._last_line_at = float("-inf")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self.snapshots.clear()  # a new run's tasks (after a restart) start afresh
        self.fetched.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="flowmill-progress",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Poll once more, draw the last state, end the line; returns once the thread is
        done."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()

    def last(self, name: str) -> tuple[Mapping[str, Any] | None, float | None]:
        """A task's last snapshot and when it was read (monotonic), or (None, None)."""
        with self.lock:
            return self.snapshots.get(name), self.fetched.get(name)

    def poll(self) -> dict[str, Any]:
        """One round: fetch every task's snapshot; the job's progress from all of them."""
        names = []
        for name, url in self.endpoints():
            names.append(name)
            snap = fetch_progress(url, self.timeout)
            if snap is None and self.finals is not None:  # gone: what it left at exit
                snap = _read_final(self.finals(name))
            if snap is not None:
                with self.lock:
                    self.snapshots[name] = snap
                    self.fetched[name] = time.monotonic()
        progress = tm.aggregate([self.snapshots.get(n) for n in names], self.mode,
                                self.backup_workers)
        step, loss = progress.get("step"), progress.get("loss")
        if isinstance(step, int) and loss is not None and (
                not self.history or step > self.history[-1][0]):
            self.history.append((step, float(loss)))
        return progress

    def line(self, progress: Mapping[str, Any]) -> str:
        ckpt = progress.get("lastCheckpoint") or {}
        return render_line(progress["step"], progress["total"], loss=progress["loss"],
                           rate=progress["examplesPerSecond"], checkpoint=ckpt.get("step"),
                           desc=self.desc, bar_width=24 if self.tty else None)

    def erase(self) -> None:
        """Clear the bar from the terminal line (call under ``lock``, before writing)."""
        if self._shown:
            self.stream.write(CLEAR_LINE)
            self._shown = 0

    def _loop(self) -> None:
        heard = False
        while True:
            stopping = self._stop.is_set()
            progress = self.poll()
            heard = heard or bool(self.snapshots)
            if heard:
                self._show(self.line(progress), final=stopping)
            if stopping:
                return
            self._stop.wait(self.interval)

    def _show(self, line: str, final: bool) -> None:
        with self.lock:
            if self.tty:
                pad = max(0, self._shown - len(line))
                self.stream.write("\r" + line + " " * pad + ("\n" if final else ""))
                self._shown = 0 if final else len(line)
            else:
                now = time.monotonic()
                due = now - self._last_line_at >= self.line_interval
                if line == self._last_line or not (due or final):
                    return
                self.stream.write(f"flowmill: {line}\n")
                self._last_line, self._last_line_at = line, now
            self.stream.flush()


def _read_final(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    try:
        with open(path) as f:
            snap = json.load(f)
    except (OSError, ValueError):
        return None
    return snap if isinstance(snap, dict) else None
