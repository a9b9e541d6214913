"""Threads for tests that run steps concurrently: bounded waits, errors carried back."""

from __future__ import annotations

import threading
import time

JOIN_TIMEOUT = 60.0


class Worker(threading.Thread):
    """Runs ``fn(*args)`` in a daemon thread and keeps its result or exception."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result = None
        self.error: BaseException | None = None

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def finish(self) -> Worker:
        self.join(JOIN_TIMEOUT)
        assert not self.is_alive(), f"thread running {self.fn!r} is still blocked"
        return self

    def value(self):
        """The result, once finished; its exception is raised here."""
        self.finish()
        if self.error is not None:
            raise self.error
        return self.result


def finish_all(threads) -> None:
    """Wait for every thread; the first failure is raised as soon as it happens (the
    others may be blocked because of it)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if any(t.error is not None for t in threads):
            break
        time.sleep(0.002)
    errors = [t.error for t in threads if t.error is not None]
    if errors:
        raise errors[0]
    for t in threads:
        t.finish()


def wait_until(predicate, what: str, timeout: float = JOIN_TIMEOUT, interval: float = 0.001):
    """Poll ``predicate`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(interval)
    return got
