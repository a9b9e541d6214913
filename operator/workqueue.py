"""Which job to reconcile next: a priority work queue on the operator's event loop.

Why a queue and not a task per event: under a burst (a thousand jobs applied at once)
every job wants a reconcile, and a worker of a running job that just died must not wait
behind all of them, so its replacement is not held up by jobs that have not started. So:

- a job is queued at most once, at the most urgent priority any of its events asked for;
  events that arrive while it is being reconciled fold into one more reconcile after it
  (a job is never reconciled by two workers at once);
- a fixed number of workers take the most urgent job first (``URGENT``: a pod of it ended
  or went; ``NORMAL``: other changes of a job already known, requeues; ``NEW``: a job not
  seen before), oldest first within a priority;
- requeues (a deadline or TTL falling due, the periodic resync, back-off after a failed
  reconcile) are timers on the loop that queue the job when they fire.

Each reconcile runs in a thread of the queue's own pool, one per worker (its API calls
block), so the number of workers bounds the reconciles and the requests in flight.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from .errors import Blocked, Conflict, api_error
from .metrics import Metrics
from .status import FINISHED

log = logging.getLogger("flowmill.operator")

URGENT, NORMAL, NEW = 0, 1, 2
DEFAULT_WORKERS = 8
MIN_REQUEUE = 0.5
MAX_BACKOFF = 60.0
CONFLICT_RETRY = 0.2

Key = tuple[str, str]  # (namespace, name)


class Reconciler(Protocol):
    def reconcile(self, namespace: str, name: str) -> Any: ...


def requeue_delay(phase: str | None, requeue_after: float | None,
                  resync: float) -> float | None:
    """When to look at a job again, events aside: when the action asks (a deadline or
    TTL), and periodically while it is not finished."""
    delays = []
    if requeue_after is not None:
        delays.append(max(requeue_after, MIN_REQUEUE))
    if phase not in FINISHED and resync > 0:
        delays.append(resync)
    return min(delays) if delays else None


def backoff(failures: int) -> float:
    """Seconds before retrying after ``failures`` consecutive failed reconciles."""
    return min(MAX_BACKOFF, MIN_REQUEUE * 2.0 ** max(failures - 1, 0))


class Scheduler:
    """The jobs waiting for a reconcile, the workers that run them, and the timers."""

    def __init__(self, controller: Reconciler, metrics: Metrics, resync: float = 300.0,
                 workers: int = DEFAULT_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"the operator needs at least one reconcile worker, got {workers}")
        self.controller = controller
        self.metrics = metrics
        self.resync = resync
        self.workers = workers
        self._heap: list[tuple[int, int, Key]] = []
        self._queued: dict[Key, int] = {}  # key -> the priority of its live heap entry
        self._running: set[Key] = set()
        self._again: dict[Key, int] = {}  # poked while running: queue again after
        self._seq = itertools.count()
        self._ready: asyncio.Event | None = None
        self._workers: list[asyncio.Task] = []
        # Threads of its own: asyncio's default pool has cpu_count + 4 (6 on two cores),
        # which would cap the workers below their number.
        self._threads = ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix="reconcile")
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._failures: dict[Key, int] = {}
        self._closed = False

    def poke(self, namespace: str, name: str, priority: int = NORMAL) -> None:
        """Reconcile the job soon: queued (or moved up to ``priority``), or once more after
        the reconcile running now."""
        key = (namespace, name)
        if self._closed:
            return
        if key in self._running:
            self._again[key] = min(self._again.get(key, priority), priority)
            return
        if key in self._queued and self._queued[key] <= priority:
            return
        self._queued[key] = priority  # an earlier, less urgent entry is skipped when popped
        heapq.heappush(self._heap, (priority, next(self._seq), key))
        self._start()
        assert self._ready is not None
        self._ready.set()

    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return not self._queued and not self._running

    def queued(self) -> int:
        return len(self._queued)

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: drop its timer and its series."""
        key = (namespace, name)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._failures.pop(key, None)
        self.metrics.set_phase(namespace, name, None)

    async def close(self, timeout: float = 15.0) -> None:
        """Stop taking work; let running reconciles finish (they are short)."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._heap.clear()
        self._queued.clear()
        if self._ready is not None:
            self._ready.set()
        if self._workers:
            _, pending = await asyncio.wait(self._workers, timeout=timeout)
            for task in pending:
                task.cancel()
        self._threads.shutdown(wait=False)

    # ---- workers

    def _start(self) -> None:
        if self._workers:
            return
        self._ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._work(), name=f"reconcile worker {i}")
                         for i in range(self.workers)]

    async def _next(self) -> Key | None:
        assert self._ready is not None
        while not self._closed:
            while self._heap:
                priority, _, key = heapq.heappop(self._heap)
                if self._queued.get(key) == priority:
                    del self._queued[key]
                    return key
            self._ready.clear()
            await self._ready.wait()
        return None

    async def _work(self) -> None:
        while (key := await self._next()) is not None:
            self._running.add(key)
            try:
                delay = await self._once(key)
            finally:
                self._running.discard(key)
            again = self._again.pop(key, None)
            if again is not None:
                self.poke(*key, priority=again)
            self._schedule(key, delay)

    async def _once(self, key: Key) -> float | None:
        namespace, name = key
        start = time.monotonic()
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(
                self._threads, self.controller.reconcile, namespace, name)
        except Conflict:
            return CONFLICT_RETRY
        except Exception as e:  # every other failure: count, report, back off, retry
            self.metrics.count_error()
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            delay = backoff(failures)
            if not isinstance(e, Blocked):
                log.warning("TrainingJob %s/%s: reconcile failed (%d in a row, retry in "
                            "%.1fs): %s", namespace, name, failures, delay, api_error(e))
            return delay
        finally:
            self.metrics.observe_reconcile(time.monotonic() - start)
        self._failures.pop(key, None)
        if outcome.gone:
            self.forget(namespace, name)
            return None
        self.metrics.set_phase(namespace, name, outcome.phase)
        return requeue_delay(outcome.phase, outcome.requeue_after, self.resync)

    def _schedule(self, key: Key, delay: float | None) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if delay is None or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.poke(*key)
