"""A small training progress bar: step/total, loss and examples per second.

On a terminal it redraws one line with ``\\r`` (at most every ``min_interval`` seconds,
so drawing never costs a step's worth of time); anywhere else (a log file, a pod's log,
a pipe) it writes plain lines at a fixed step interval, which read well after the fact.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        # Off a terminal: about ``lines`` lines over the run, plus the last step.
        self.every = max(1, self.total // max(1, lines))
        self.step = 0
        self.examples = 0
        self.loss: float | None = None
        self._start = time.perf_counter()
        self._last_draw = float("-inf")
        self._width_drawn = 0
        self._closed = False

    def update(self, step: int | None = None, loss: float | None = None, examples: int = 0) -> None:
        """Record progress: ``step`` is the steps done so far (default: one more than before)."""
        self.step = self.step + 1 if step is None else int(step)
        self.examples += int(examples)
        if loss is not None:
            self.loss = float(loss)
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
        elapsed = time.perf_counter() - self._start
        return self.examples / elapsed if elapsed > 0 else 0.0

    def render(self) -> str:
        frac = min(self.step / self.total, 1.0)
        digits = len(str(self.total))
        parts = [self.desc] if self.desc else []
        parts.append(f"step {self.step:>{digits}}/{self.total}")
        if self.tty:
            filled = int(round(frac * self.width))
            parts.append("[" + "=" * filled + " " * (self.width - filled) + "]")
        parts.append(f"{frac * 100:3.0f}%")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.examples:
            parts.append(f"{self.rate():,.0f} examples/s")
        return "  ".join(parts)

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
        if self.tty:
            self._draw(self.render())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
