"""A pool of daemon threads that a caller hands work to without ever waiting for one.

A task hands off work that may block on a peer (a many-key pull, a large reply) from
threads that must not block: an executor's ``_Send``, a partition about to compute. A
busy pool is never waited for: ``submit`` says False when every thread is busy and the
pool is at its limit, and the caller does the work another way. Threads are started as
needed and then stay (a step hands off the same work every step); daemons, so that one
blocked on a peer never keeps the process from exiting.

A task's gRPC server runs its handlers on a ``DaemonExecutor`` for the same reason, and
one more: ``concurrent.futures.ThreadPoolExecutor`` refuses new work once the
interpreter begins to exit, and gRPC's serving thread dies on that refusal. A request
that reaches a task while its script exits on an error (a peer telling it the failed
step has ended) then left the server unable to stop, and the process never exited.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent import futures


class DaemonPool:
    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, limit
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._threads = 0

    def submit(self, fn: Callable, *args) -> bool:
        """Run ``fn(*args)`` on a thread of the pool; False (and nothing run) when none is
        idle and the pool is at its limit. ``fn`` must not raise."""
        with self._lock:
            if self._idle:
                self._idle -= 1  # that thread takes this job next
                self._jobs.put((fn, args))
                return True
            if self._threads >= self.limit:
                return False
            self._threads += 1
        threading.Thread(target=self._work, args=(fn, args), name=self.name,
                         daemon=True).start()
        return True

    def _work(self, fn: Callable, args: tuple) -> None:
        while True:
            fn(*args)
            del fn, args  # drop the job (and what it holds) while idle
            with self._lock:
                self._idle += 1
            fn, args = self._jobs.get()


class DaemonExecutor(futures.Executor):
    """A thread-pool executor whose threads are daemons and which serves until it is shut
    down, the interpreter's exit included: jobs wait in order when all ``max_workers``
    threads are busy. Its owner shuts it down (no thread outlives that)."""

    def __init__(self, max_workers: int, thread_name_prefix: str):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        self.max_workers, self.name = max_workers, thread_name_prefix
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self.name}: cannot take work after shutdown")
            self._jobs.put((future, fn, args, kwargs))
            if self._idle:
                self._idle -= 1  # an idle thread takes it
                return future
            if len(self._threads) >= self.max_workers:
                return future  # the next thread to finish takes it
            thread = threading.Thread(target=self._work, daemon=True,
                                      name=f"{self.name}_{len(self._threads)}")
            self._threads.append(thread)
        thread.start()
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - the future carries it
                    future.set_exception(e)
            del future, fn, args, kwargs  # drop the job while idle
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            first, self._shut = not self._shut, True
            threads = list(self._threads)
        if first:
            self._stop_threads(len(threads), cancel_futures)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _stop_threads(self, count: int, cancel_futures: bool) -> None:
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in range(count):
            self._jobs.put(None)
