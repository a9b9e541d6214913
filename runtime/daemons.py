"""A pool of daemon threads that a caller hands work to without ever waiting for one.

A task hands off work that may block on a peer (a many-key pull, a large reply) from
threads that must not block: an executor's ``_Send``, a partition about to compute. A
busy pool is never waited for: ``submit`` says False when every thread is busy and the
pool is at its limit, and the caller does the work another way. Threads are started as
needed and then stay (a step hands off the same work every step); daemons, so that one
blocked on a peer never keeps the process from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


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
