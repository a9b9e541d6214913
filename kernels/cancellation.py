"""One step's cancellation (TensorFlow's ``CancellationManager``).

A kernel that blocks on state (a queue's dequeue, an accumulator's take, a staleness
clock's wait) registers how to wake it; ending the step (``cancel``) wakes every one, and
each raises ``CancelledError`` instead of waiting on. Without this, a step whose client
went away (its process died) would keep waiting on a parameter server and take what the
client's next incarnation was waiting for: a token, a batch of gradients.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class CancelledError(RuntimeError):
    """The step a kernel waited in was ended (aborted, or its client restarted)."""


class Cancellation:
    def __init__(self, what: str = "step"):
        self.what = what
        self._lock = threading.Lock()
        self._wakes: dict[int, Callable[[], None]] = {}
        self._next = 0
        self.error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return self.error is not None

    def register(self, wake: Callable[[], None]) -> int:
        """Call ``wake`` when the step is cancelled (at once, if it already is)."""
        with self._lock:
            if self.error is None:
                self._next += 1
                self._wakes[self._next] = wake
                return self._next
        wake()
        return 0

    def deregister(self, key: int) -> None:
        with self._lock:
            self._wakes.pop(key, None)

    def cancel(self, error: BaseException) -> None:
        """End the step: every registered waiter wakes (outside this lock: a wake takes
        its state's own lock)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            wakes, self._wakes = list(self._wakes.values()), {}
        for wake in wakes:
            wake()

    def check(self, waiting_for: str) -> None:
        """Raise ``CancelledError`` if the step was cancelled while ``waiting_for``."""
        if self.error is not None:
            raise CancelledError(
                f"{self.what} was cancelled while {waiting_for}: "
                f"{type(self.error).__name__}: {self.error}"
            )


@contextlib.contextmanager
def waking(cancellation: Cancellation | None, cond: threading.Condition) -> Iterator[None]:
    """While a wait on ``cond`` lasts, cancelling its step notifies ``cond`` (the waiter then
    sees ``cancellation.cancelled`` and raises)."""
    if cancellation is None:
        yield
        return

    def wake() -> None:
        with cond:
            cond.notify_all()

    key = cancellation.register(wake)
    try:
        yield
    finally:
        cancellation.deregister(key)
