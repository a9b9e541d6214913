"""Streams: an opened dataset read one element (or one block of them) at a time, and the
threads that let some stages run ahead of the step that consumes them.

A ``Stream`` has three calls. ``next()`` returns the next element (a tuple of arrays) or
None once the stream has ended (and again after). ``next_block(n)`` returns up to ``n``
consecutive elements stacked (fewer only at the end), so a batch of a random-access source
is one gather instead of ``n`` element reads. ``skip(n)`` moves past ``n`` elements
without producing them where it can (an index moves, nothing is read) and says how many
there were: the fast-forward of a resumed pipeline is made of it.

Datasets whose elements can be read at any index (arrays, fixed-size records, and what is
derived from them by ``shard``, ``take``, ``skip``, a sequential ``map``, ``repeat``)
describe that with a ``Gather``; one ``IndexStream`` serves them all.

The threads (a prefetch buffer's producer, a parallel map's workers) belong to the
pipeline's ``Context``: closing it (the iterator seeks elsewhere, or its session closes)
wakes every wait, stops every thread and joins them. A wait in the thread of a step (the
``get_next`` of a step) also ends when that step is cancelled.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flowmill.kernels.cancellation import Cancellation, CancelledError, waking

from .structure import stack

JOIN_TIMEOUT_S = 10.0
THREAD_PREFIX = "flowmill-data"


class Context:
    """What the stages of one opened pipeline share: its name, being closed, its threads,
    and (per thread) the cancellation of the step reading it."""

    def __init__(self, name: str):
        self.name = name
        self.closed = False
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conditions: list[threading.Condition] = []
        self._threads: list[threading.Thread] = []
        self._closers: list[Callable[[], None]] = []

    @property
    def cancellation(self) -> Cancellation | None:
        """The cancellation of the step this thread reads for (None off a step's thread)."""
        return getattr(self._local, "cancellation", None)

    def set_cancellation(self, cancellation: Cancellation | None) -> None:
        self._local.cancellation = cancellation

    def condition(self) -> threading.Condition:
        """A condition that closing the pipeline notifies."""
        cond = threading.Condition()
        with self._lock:
            self._conditions.append(cond)
        return cond

    def on_close(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._closers.append(fn)

    def start_thread(self, target: Callable[[], None], what: str) -> threading.Thread:
        """A daemon thread of this pipeline (daemon: a user's generator that never returns
        must not keep the process alive)."""
        thread = threading.Thread(
            target=target, name=f"{THREAD_PREFIX}-{self.name}-{what}", daemon=True
        )
        with self._lock:
            if self.closed:
                raise CancelledError(f"iterator {self.name!r} is closed")
            self._threads.append(thread)
        thread.start()
        return thread

    def wait(self, cond: threading.Condition, ready: Callable[[], bool], waiting_for: str):
        """Wait on ``cond`` (held by the caller) until ``ready()``; raise ``CancelledError``
        when the pipeline closes or the step of this thread is cancelled meanwhile."""
        cancellation = self.cancellation
        with waking(cancellation, cond):
            while not ready():
                if self.closed:
                    raise CancelledError(f"iterator {self.name!r} was closed while {waiting_for}")
                if cancellation is not None:
                    cancellation.check(waiting_for)
                cond.wait()

    def close(self) -> None:
        """Wake every wait, stop and join every thread (a thread stuck in user code past
        ``JOIN_TIMEOUT_S`` is left behind: it is a daemon)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            closers, conditions, threads = self._closers, self._conditions, self._threads
        for fn in closers:
            fn()
        for cond in conditions:
            with cond:
                cond.notify_all()
        me = threading.current_thread()
        for thread in threads:
            if thread is not me:
                thread.join(JOIN_TIMEOUT_S)


class Stream:
    """An opened dataset. Subclasses give ``next``; the others default to it."""

    label = "dataset"

    def next(self) -> tuple | None:
        raise NotImplementedError

    def next_block(self, n: int, where: str | None = None) -> tuple | None:
        """Up to ``n`` elements as one block; ``where`` names the stage that batches them
        (in errors)."""
        elements = []
        while len(elements) < n:
            element = self.next()
            if element is None:
                break
            elements.append(element)
        return stack(elements, where or self.label) if elements else None

    def skip(self, n: int) -> int:
        done = 0
        while done < n and self.next() is not None:
            done += 1
        return done


@dataclass(frozen=True)
class Gather:
    """Random access to a dataset: ``count`` elements (None: without end), ``get(i)`` one
    of them, ``take(indices)`` several as a block, ``take_range(a, b)`` a run of them
    (a slice where the source allows one)."""

    count: int | None
    get: Callable[[int], tuple]
    take: Callable[[np.ndarray], tuple]
    take_range: Callable[[int, int], tuple] | None = None

    def range_block(self, a: int, b: int) -> tuple:
        if self.take_range is not None:
            return self.take_range(a, b)
        return self.take(np.arange(a, b, dtype=np.int64))


class IndexStream(Stream):
    """A random-access dataset read in order: skipping is moving an index."""

    def __init__(self, gather: Gather, label: str):
        self.gather, self.label, self.position = gather, label, 0

    def _left(self, n: int) -> int:
        count = self.gather.count
        return n if count is None else max(0, min(n, count - self.position))

    def next(self) -> tuple | None:
        if self.gather.count is not None and self.position >= self.gather.count:
            return None
        element = self.gather.get(self.position)
        self.position += 1
        return element

    def next_block(self, n: int, where: str | None = None) -> tuple | None:
        k = self._left(n)
        if k == 0:
            return None
        a = self.position
        self.position += k
        return self.gather.range_block(a, a + k)

    def skip(self, n: int) -> int:
        k = self._left(n)
        self.position += k
        return k


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class PrefetchStream(Stream):
    """Runs its input in a thread of its own, up to ``size`` elements ahead of the reader.

    The thread starts at the first read, so a resumed pipeline's fast-forward (``skip``
    before any read) goes straight to the input. An error in the input reaches the reader
    in order, after the elements before it, and ends the stream: every later read raises
    it again."""

    def __init__(self, input: Stream, size: int, ctx: Context, label: str):
        self.input, self.size, self.ctx, self.label = input, size, ctx, label
        self._cond = ctx.condition()
        self._buffer: deque = deque()
        self._thread: threading.Thread | None = None
        self._final: _Failed | None = None
        self._ended = False

    def _produce(self) -> None:
        cond, buffer, size = self._cond, self._buffer, self.size
        try:
            while True:
                with cond:
                    self.ctx.wait(cond, lambda: len(buffer) < size, "waiting for room")
                try:
                    item = self.input.next()
                except BaseException as e:  # noqa: BLE001 - handed to the reader, in order
                    item = _Failed(e)
                with cond:
                    buffer.append(item)
                    cond.notify_all()
                if item is None or isinstance(item, _Failed):
                    return
        except CancelledError:
            return  # closed

    def next(self) -> tuple | None:
        if self._ended:
            return None
        if self._final is not None:
            raise self._final.error
        if self._thread is None:
            self._thread = self.ctx.start_thread(self._produce, "prefetch")
        cond, buffer = self._cond, self._buffer
        with cond:
            waiting = f"waiting for the next element of {self.label}"
            self.ctx.wait(cond, lambda: bool(buffer), waiting)
            item = buffer.popleft()
            cond.notify_all()
        if item is None:
            self._ended = True
        elif isinstance(item, _Failed):
            self._final = item
            raise item.error
        return item

    def skip(self, n: int) -> int:
        if self._thread is None and self._final is None and not self._ended:
            return self.input.skip(n)
        return super().skip(n)


class _Job:
    __slots__ = ("element", "index", "result", "error", "done", "dropped")

    def __init__(self, element, index: int):
        self.element, self.index = element, index
        self.result = self.error = None
        self.done = self.dropped = False


class ParallelMapStream(Stream):
    """``apply(element, index)`` on ``workers`` threads, up to twice that many elements in
    flight. Deterministic: results come out in input order, whatever order they finish
    in; otherwise the first finished comes first. The input is read in the reader's
    thread, in order; an error (in the input or in ``apply``) arrives at its place and
    ends the stream."""

    def __init__(self, input: Stream, apply: Callable[[tuple, int], tuple], workers: int,
                 deterministic: bool, ctx: Context, label: str):
        self.input, self.apply, self.workers = input, apply, workers
        self.deterministic, self.ctx, self.label = deterministic, ctx, label
        self._cond = ctx.condition()
        self._window: deque[_Job] = deque()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._input_done = False
        self._index = 0
        self._final: BaseException | None = None
        ctx.on_close(self._stop)

    def _stop(self) -> None:
        for _ in range(self.workers):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self.ctx.closed:
                return
            if job.dropped:
                continue
            try:
                job.result = self.apply(job.element, job.index)
            except BaseException as e:  # noqa: BLE001 - handed to the reader, in order
                job.error = e
            job.element = None
            with self._cond:
                job.done = True
                self._cond.notify_all()

    def _fill(self) -> None:
        window = self._window
        while not self._input_done and len(window) < 2 * self.workers:
            try:
                element = self.input.next()
            except BaseException as e:  # noqa: BLE001 - raised after the elements before it
                self._final, self._input_done = e, True
                return
            if element is None:
                self._input_done = True
                return
            job = _Job(element, self._index)
            self._index += 1
            window.append(job)
            self._jobs.put(job)

    def next(self) -> tuple | None:
        if not self._started:
            self._started = True
            for i in range(self.workers):
                self.ctx.start_thread(self._work, f"map{i}")
        self._fill()
        window, cond = self._window, self._cond
        if not window:
            if self._final is not None:
                raise self._final
            return None
        waiting = f"waiting for {self.label}"
        with cond:
            if self.deterministic:
                job = window[0]
                self.ctx.wait(cond, lambda: job.done, waiting)
            else:
                self.ctx.wait(cond, lambda: any(j.done for j in window), waiting)
                job = next(j for j in window if j.done)
            window.remove(job)
        if job.error is not None:
            self._final, self._input_done = job.error, True
            for other in window:
                other.dropped = True
            window.clear()
            raise job.error
        return job.result

    def skip(self, n: int) -> int:
        done = 0
        while done < n and self._window:  # elements already read: dropped, not awaited
            self._window.popleft().dropped = True
            done += 1
        if done < n:
            if self._final is not None:
                raise self._final
            done += self.input.skip(n - done)
        return done
