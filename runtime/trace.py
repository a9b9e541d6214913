"""Step traces: where each task's time goes, as Chrome trace events (Perfetto,
``chrome://tracing``).

With ``FLOWMILL_TRACE=<directory>`` in its environment a process records, from its start,
a span for every step its sessions run (``step``), every partition it runs for another
task (``RunGraph``), and every kernel call (named by its node, its category the op type:
``AccumulatorApplyGradient``, ``_Recv``, ``MatMul``, ...), and writes them at exit to
``<directory>/trace-<task>-<pid>.json``. The local launcher passes the variable to every
task and merges their files into ``<directory>/trace.json`` when the job ends, one
process row per task on one wall clock.

Off (the default), nothing is wrapped: the executor compiles its plain kernels and a
step pays nothing. On, each kernel call pays two clock reads and an append; a process
keeps at most ``MAX_EVENTS`` events (the rest are counted, not kept).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV_VAR = "FLOWMILL_TRACE"
MAX_EVENTS = 1_000_000
MERGED_NAME = "trace.json"


class Tracer:
    """One process's events, written to ``directory`` at exit."""

    def __init__(self, directory: str | os.PathLike, task: str):
        self.directory = Path(directory)
        self.task = task
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()

    def complete(self, name: str, cat: str, start_ns: int, end_ns: int, args=None) -> None:
        tid = threading.get_ident()
        event = {"name": name, "cat": cat, "ph": "X", "ts": start_ns / 1e3,
                 "dur": (end_ns - start_ns) / 1e3, "pid": self.pid, "tid": tid}
        if args:
            event["args"] = args
        with self._lock:
            if tid not in self._threads:
                self._threads[tid] = threading.current_thread().name
            if len(self.events) < MAX_EVENTS:
                self.events.append(event)
            else:
                self.dropped += 1

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self.complete(name, cat, start, time.time_ns(), args or None)

    def wrap(self, fn: Callable, name: str, cat: str) -> Callable:
        """``fn`` recording a span per call."""
        clock, complete = time.time_ns, self.complete

        def traced(*args):
            start = clock()
            try:
                return fn(*args)
            finally:
                complete(name, cat, start, clock())

        return traced

    def flush(self) -> Path | None:
        """Write every event so far to this process's file (replaced whole each time); a
        process that recorded nothing (the launcher itself) writes none."""
        if not self.events:
            return None
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid,
                 "args": {"name": self.task}}]
        with self._lock:
            meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                      "args": {"name": name}} for tid, name in self._threads.items()]
            body = {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                    "otherData": {"task": self.task, "dropped_events": self.dropped}}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace-{self.task.replace('/', '_')}-{self.pid}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)
        return path


def merge(directory: str | os.PathLike) -> Path | None:
    """Every task's file in ``directory`` as one trace; None when there is none."""
    directory = Path(directory)
    events: list = []
    dropped = 0
    for path in sorted(directory.glob("trace-*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a task killed while writing: its trace is lost, not the others'
        events += body.get("traceEvents", [])
        dropped += body.get("otherData", {}).get("dropped_events", 0)
    if not events:
        return None
    out = directory / MERGED_NAME
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                               "otherData": {"dropped_events": dropped}}))
    return out


def _from_env() -> Tracer | None:
    directory = os.environ.get(ENV_VAR, "").strip()
    if not directory:
        return None
    from .cluster import ClusterSpecError, from_env

    try:
        config = from_env()
    except ClusterSpecError:
        config = None  # the task reports its own bad config; the trace just says "local"
    task = f"{config.role}-{config.index}" if config is not None else "local"
    tracer = Tracer(directory, task)
    atexit.register(tracer.flush)
    return tracer


# This process's tracer, or None: read once, when the runtime loads.
TRACER: Tracer | None = _from_env()
