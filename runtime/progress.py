"""A training task's progress bar (``ProgressBar``); the launcher draws a whole job's
(``flowmill.launcher.progress.JobProgress``) with the same ``render_line``.

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
import time
from typing import TextIO

from . import telemetry as tm
from .cluster import ENV_PROGRESS

LINE_INTERVAL_S = 5.0
CLEAR_LINE = "\r\x1b[K"


def is_terminal(stream: TextIO) -> bool:
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
        self.tty = is_terminal(self.stream)
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
