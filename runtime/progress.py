"""Training progress bars: one task's (``ProgressBar``) and a whole job's (``JobProgress``).

On a terminal a bar redraws one line with ``\\r`` (at most every ``min_interval`` seconds,
so drawing never costs a step's worth of time); anywhere else (a log file, a pod's log, a
pipe) it writes plain lines now and then, which read well after the fact.

``ProgressBar.update`` also reports every step to this process's telemetry
(``flowmill.runtime.telemetry``), which serves it to the operator and the launcher. Under
the local launcher (``FLOWMILL_PROGRESS=off`` in every task's environment) a task's bar
draws nothing: the launcher polls every task and draws one bar for the job
(``JobProgress``), rather than one bar per task fighting over one terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from . import telemetry as tm

ENV_PROGRESS = "FLOWMILL_PROGRESS"  # "off": report progress, draw nothing
POLL_INTERVAL_S = 1.0
POLL_TIMEOUT_S = 0.5
LINE_INTERVAL_S = 5.0
CLEAR_LINE = "\r\x1b[K"


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def render_line(step: int, total: int | None, *, loss: float | None = None,
                rate: float | None = None, checkpoint: int | None = None, desc: str = "",
                bar_width: int | None = None) -> str:
    """``desc  step 120/400  [=====     ]  30%  loss 0.2345  1,234 examples/s  checkpoint
    100``; the bracketed bar only with ``bar_width`` and a total, and what is unknown left
    out."""
    parts = [desc] if desc else []
    if total:
        frac = min(step / total, 1.0)
        parts.append(f"step {step:>{len(str(total))}}/{total}")
        if bar_width:
            filled = int(round(frac * bar_width))
            parts.append("[" + "=" * filled + " " * (bar_width - filled) + "]")
        parts.append(f"{frac * 100:3.0f}%")
    else:
        parts.append(f"step {step}")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if rate:
        parts.append(f"{rate:,.0f} examples/s")
    if checkpoint is not None:
        parts.append(f"checkpoint {checkpoint}")
    return "  ".join(parts)


class ProgressBar:
    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        width: int = 24,
        min_interval: float = 0.1,
        lines: int = 10,
        desc: str = "",
    ):
        if total <= 0:
            raise ValueError(f"progress total must be positive, got {total}")
        self.total = int(total)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self.desc = desc
        self.tty = _isatty(self.stream)
        self.quiet = os.environ.get(ENV_PROGRESS, "").strip().lower() == "off"
        # Off a terminal: about ``lines`` lines over the run, plus the last step.
        self.every = max(1, self.total // max(1, lines))
        self.step = 0
        self.examples = 0
        self.loss: float | None = None
        self.telemetry = tm.telemetry()
        self._last_draw = float("-inf")
        self._width_drawn = 0
        self._closed = False

    def update(self, step: int | None = None, loss: float | None = None, examples: int = 0,
               global_step: int | None = None) -> None:
        """Record progress: ``step`` is the steps done so far (default: one more than before);
        ``global_step``, the job's, goes to the task's telemetry (the job's progress)."""
        self.step = self.step + 1 if step is None else int(step)
        self.examples += int(examples)
        if loss is not None:
            self.loss = float(loss)
        tm.report_step(self.step, self.total, self.loss, int(examples), global_step)
        if self.quiet:
            return
        done = self.step >= self.total
        if self.tty:
            now = time.perf_counter()
            if done or now - self._last_draw >= self.min_interval:
                self._last_draw = now
                self._draw(self.render())
        elif done or self.step % self.every == 0:
            self.stream.write(self.render() + "\n")
            self.stream.flush()

    def rate(self) -> float:
        """Examples per second over the telemetry's recent window."""
        return self.telemetry.examples_per_second()

    def render(self) -> str:
        return render_line(self.step, self.total, loss=self.loss,
                           rate=self.rate() if self.examples else None, desc=self.desc,
                           bar_width=self.width if self.tty else None)

    def _draw(self, line: str) -> None:
        pad = max(0, self._width_drawn - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._width_drawn = len(line)

    def close(self) -> None:
        """End the bar's line on a terminal (the last state is drawn first)."""
        if self._closed:
            return
        self._closed = True
        if self.tty and not self.quiet:
            self._draw(self.render())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class JobProgress:
    """The local launcher's one bar for a job, drawn from its training tasks' endpoints.

    A thread polls every task's ``/progress`` about once a second; ``endpoints`` gives the
    tasks to poll, in task order (chief first), as ``(name, url)``, and is called on every
    round, so tasks started later are found. A task's last snapshot is kept after it
    stops serving (a worker that finished keeps its final step). Lines go to ``stream``
    under ``lock`` (the one the launcher writes task output under); on a terminal whoever
    writes there calls ``erase`` first, and the bar is drawn again on the next round.
    """

    def __init__(self, desc: str, mode: str, backup_workers: int,
                 endpoints: Callable[[], Sequence[tuple[str, str]]], stream: TextIO,
                 lock: threading.Lock, *, interval: float = POLL_INTERVAL_S,
                 line_interval: float = LINE_INTERVAL_S, timeout: float = POLL_TIMEOUT_S):
        self.desc = desc
        self.mode = mode
        self.backup_workers = backup_workers
        self.endpoints = endpoints
        self.stream = stream
        self.lock = lock
        self.interval = interval
        self.line_interval = line_interval
        self.timeout = timeout
        self.tty = _isatty(stream)
        self.snapshots: dict[str, Mapping[str, Any]] = {}
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

    def poll(self) -> dict[str, Any]:
        """One round: fetch every task's snapshot; the job's progress from all of them."""
        names = []
        for name, url in self.endpoints():
            names.append(name)
            snap = tm.fetch_progress(url, self.timeout)
            if snap is not None:
                self.snapshots[name] = snap
        return tm.aggregate([self.snapshots.get(n) for n in names], self.mode,
                            self.backup_workers)

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
