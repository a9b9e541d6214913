"""This process's training progress, for whoever watches the job.

A training loop reports each step (``report_step``, which ``ProgressBar.update`` calls)
and the checkpoint code each committed checkpoint (``report_checkpoint``); ``snapshot`` is
the record as JSON. With ``FLOWMILL_METRICS_PORT`` set (the operator and the local
launcher set it for every task) the first report starts an HTTP endpoint on a
daemon thread: ``GET /progress`` serves the snapshot, which the operator turns into the
job's ``status.progress`` and ``status.lastCheckpoint`` and the launcher into its one bar
for the whole job; ``GET /metrics`` serves the same numbers to Prometheus.

Reporting sits on the training step's path, so it only takes an uncontended lock and sets
a few numbers: no I/O, no formatting. The time between two reports is the task's step
time: the snapshot carries the median of the recent ones (``stepSeconds``) and how long
ago the last step ended (``sinceStepSeconds``, on this process's own clock, so a reader's
clock skew does not matter), which is how the launcher and the operator tell a stalled
task (``flowmill.operator.stall``); ``/metrics`` has them as a histogram.

A task's server adds what it holds and has done (``set_source``; ``server_stats``): its
variables, the tensors it served, the updates applied on it, the restarts of its peers it
saw, and the state of the sync accumulators and staleness clock it keeps. PS tasks serve
that from the start (``serve_now``); training tasks from their first step, and at exit
they leave their last snapshot in the file ``FLOWMILL_PROGRESS_FINAL`` names, if any.

Examples per second are measured over the last ``RATE_WINDOW_S`` seconds (a rate since the
start would hide a slowdown for the rest of a long run), from at most one mark per
``RATE_RESOLUTION_S``, so the record stays small however fast steps come.

The endpoint binds the pod's own address when that is a loopback one (several pods share
one host's loopback in a test cluster, each on its own 127.x address, all on the same
port) and every interface otherwise (a pod's network namespace is its own, and
``kubectl port-forward`` dials localhost).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from flowmill.kernels import device_memory

from .addresses import format_address
from .cluster import (
    ENV_METRICS_PORT,
    ENV_PROGRESS_FINAL,
    ENV_VAR,
    METRICS_PATH,
    PROGRESS_PATH,
    ClusterSpecError,
    TaskConfig,
    bind_host,
)
from .local_devices import gpu_count

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RATE_WINDOW_S = 10.0
RATE_RESOLUTION_S = 0.1
STEP_WINDOW = 64  # step times kept for the median
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0)
# A source of more numbers: snapshot fields, and (name, type, help, value) families.
Family = tuple[str, str, str, float | None]
Source = Callable[[], tuple[dict[str, Any], list[Family]]]
SUM_MODES = ("async", "bounded-staleness")  # each worker's step is an update of its own


def format_time(t: float) -> str:
    """RFC 3339 in UTC, to the second (as Kubernetes writes its timestamps)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Telemetry:
    """One task's progress record. Every method is safe to call from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 environ: Mapping[str, str] = os.environ) -> None:
        self._lock = threading.Lock()
        self._clock, self._wall, self._environ = clock, wall, environ
        self._step = 0
        self._global_step: int | None = None
        self._total: int | None = None
        self._loss: float | None = None
        self._examples = 0
        self._updated: float | None = None  # wall time of the last step reported
        # (monotonic time, examples so far) at report times; the first one at or before
        # the window's start is kept as its base.
        self._marks: deque[tuple[float, int]] = deque()
        self._checkpoint: tuple[int, str, float] | None = None
        self._started = clock()
        self._last_step_at: float | None = None  # monotonic time of the last report
        self._durations: deque[float] = deque(maxlen=STEP_WINDOW)
        self._bucket_counts = [0] * len(STEP_BUCKETS)
        self._duration_sum = 0.0
        self._duration_count = 0
        self._source: Source | None = None
        self._by_script = False  # the script reports its steps itself (a ProgressBar)
        self._counted = 0  # train-op runs, for a script that reports none

    def set_source(self, source: Source | None) -> None:
        """Where the snapshot's and the metrics' other numbers come from (a task's server)."""
        self._source = source

    def _forget_counted(self) -> None:
        with self._lock:
            self._last_step_at = None
            self._durations.clear()
            self._bucket_counts = [0] * len(STEP_BUCKETS)
            self._duration_sum, self._duration_count = 0.0, 0

    def count_step(self) -> None:
        """The session ran the op ``minimize`` returned: a script that reports no steps
        itself (no ``ProgressBar``) still shows its step count in the job's progress."""
        with self._lock:
            if self._by_script:
                return
            self._counted += 1
            step = self._counted
        self.report_step(step, None, None, 0, counted=True)

    def report_step(self, step: int, total: int | None, loss: float | None,
                    examples: int, global_step: int | None = None, counted: bool = False
                    ) -> None:
        now = self._clock()
        if not counted and not self._by_script:
            self._by_script = True
            if self._counted:  # what counting recorded before the script's first report
                self._forget_counted()
        wall = self._wall()
        with self._lock:
            self._step = int(step)
            if global_step is not None:
                self._global_step = int(global_step)
            if total is not None:
                self._total = int(total)
            if loss is not None:
                self._loss = float(loss)
            self._examples += int(examples)
            self._updated = wall
            if self._last_step_at is not None:
                self._observe_step(now - self._last_step_at)
            self._last_step_at = now
            marks = self._marks
            if len(marks) >= 2 and now - marks[-2][0] < RATE_RESOLUTION_S:
                marks[-1] = (now, self._examples)
            else:
                marks.append((now, self._examples))
            while len(marks) > 2 and marks[1][0] <= now - RATE_WINDOW_S:
                marks.popleft()

    def _observe_step(self, seconds: float) -> None:
        """One step's time, into the median's window and the histogram (under the lock)."""
        self._durations.append(seconds)
        self._duration_sum += seconds
        self._duration_count += 1
        for i, bound in enumerate(STEP_BUCKETS):
            if seconds <= bound:
                self._bucket_counts[i] += 1
                break

    def report_checkpoint(self, step: int, uri: str) -> None:
        wall = self._wall()
        with self._lock:
            self._checkpoint = (int(step), str(uri), wall)

    def examples_per_second(self) -> float:
        """Examples per second over the last ``RATE_WINDOW_S`` (0 before two reports)."""
        now = self._clock()
        with self._lock:
            marks = list(self._marks)
        return _rate(marks, now, RATE_WINDOW_S)

    def task(self) -> dict[str, Any] | None:
        text = self._environ.get(ENV_VAR)
        if not text:
            return None
        try:
            config = TaskConfig.from_json(text)
        except (ClusterSpecError, AttributeError, TypeError):
            return None
        return {"role": config.role, "index": config.index}

    def snapshot(self) -> dict[str, Any]:
        """The record as JSON-ready values (a loss that is not finite is ``None``)."""
        return self._read()[0]

    def _read(self) -> tuple[dict[str, Any], list[Family]]:
        """The snapshot and the source's metric families, from one reading of the source
        (a server's numbers take a walk over its resources)."""
        now = self._clock()
        with self._lock:
            step, total, loss = self._step, self._total, self._loss
            global_step = self._global_step
            examples, updated, checkpoint = self._examples, self._updated, self._checkpoint
            marks = list(self._marks)
            durations = sorted(self._durations)
            last = self._last_step_at
        out: dict[str, Any] = {}
        task = self.task()
        if task is not None:
            out["task"] = task
        out.update(step=step, total=total, loss=_finite(loss), examples=examples,
                   examplesPerSecond=_rate(marks, now, RATE_WINDOW_S),
                   updated=format_time(updated) if updated is not None else None)
        if global_step is not None:
            out["globalStep"] = global_step
        if checkpoint is not None:
            out["lastCheckpoint"] = {"step": checkpoint[0], "uri": checkpoint[1],
                                     "time": format_time(checkpoint[2])}
        if durations:
            out["stepSeconds"] = round(durations[len(durations) // 2], 6)
        if last is not None:
            out["sinceStepSeconds"] = round(now - last, 3)
        out["uptimeSeconds"] = round(now - self._started, 3)
        source = self._source
        fields, families = source() if source is not None else ({}, [])
        out.update(fields)
        return out, families

    def prometheus(self) -> str:
        """The snapshot in Prometheus' text exposition format (version 0.0.4)."""
        snap, more = self._read()
        labels = ""
        if "task" in snap:
            labels = f'{{role="{snap["task"]["role"]}",index="{snap["task"]["index"]}"}}'
        with self._lock:
            loss = self._loss  # NaN and infinities are valid sample values here
        families: list[tuple[str, str, str, float | None]] = [
            ("flowmill_step", "gauge", "Training steps this task has done.", snap["step"]),
            ("flowmill_total_steps", "gauge", "Training steps this task will do.",
             snap["total"]),
            ("flowmill_loss", "gauge", "The loss of this task's last step.", loss),
            ("flowmill_examples_total", "counter", "Examples this task has trained on.",
             snap["examples"]),
            ("flowmill_examples_per_second", "gauge",
             f"Examples per second over the last {RATE_WINDOW_S:g} seconds.",
             snap["examplesPerSecond"]),
        ]
        ckpt = snap.get("lastCheckpoint")
        if ckpt is not None:
            with self._lock:
                committed = self._checkpoint[2] if self._checkpoint else None
            families += [
                ("flowmill_last_checkpoint_step", "gauge",
                 "Step of the last checkpoint this task committed.", ckpt["step"]),
                ("flowmill_last_checkpoint_timestamp_seconds", "gauge",
                 "When the last checkpoint was committed (Unix time).", committed),
            ]
        if "globalStep" in snap:
            families.append(("flowmill_global_step", "gauge",
                             "The job's global step as this task last saw it.",
                             snap["globalStep"]))
        families += more + _gpu_memory()
        lines = []
        for name, kind, help, value in families:
            if value is None:
                continue
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
                      f"{name}{labels} {_number(value)}"]
        lines += self._step_histogram(labels)
        return "\n".join(lines) + "\n"

    def _step_histogram(self, labels: str) -> list[str]:
        """``flowmill_step_seconds``: the time between two reported steps."""
        with self._lock:
            counts, total, n = list(self._bucket_counts), self._duration_sum, self._duration_count
        if not n:
            return []
        name = "flowmill_step_seconds"
        inner = labels[1:-1] + "," if labels else ""
        out = [f"# HELP {name} Time between two steps of this task.",
               f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(STEP_BUCKETS, counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{{inner}le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{{inner}le="+Inf"}} {n}',
                f"{name}_sum{labels} {_number(total)}", f"{name}_count{labels} {n}"]
        return out


def _gpu_memory() -> list[tuple[str, str, str, float | None]]:
    """Where the task computes on GPUs: what CuPy's memory pool holds for it."""
    if gpu_count() == 0:
        return []
    used, held = device_memory("GPU") or (None, None)
    return [
        ("flowmill_gpu_memory_used_bytes", "gauge",
         "Bytes of this task's live arrays on its GPUs (CuPy's memory pool).", used),
        ("flowmill_gpu_memory_held_bytes", "gauge",
         "Bytes CuPy's memory pool holds on this task's GPUs, freed blocks included.", held),
    ]


def _rate(marks: Sequence[tuple[float, int]], now: float, window: float) -> float:
    """Examples per second over ``[now - window, now]``, the count at the window's start
    interpolated between the marks around it (so a pause before the window does not
    dilute the rate); over the time since the first mark while the window is not full."""
    if len(marks) < 2:
        return 0.0
    start = now - window
    base_t, base_n = marks[0]
    if base_t < start:
        for (t0, n0), (t1, n1) in zip(marks, marks[1:], strict=False):
            if t1 >= start:
                share = (start - t0) / (t1 - t0) if t1 > t0 else 1.0
                base_t, base_n = start, n0 + (n1 - n0) * share
                break
        else:  # nothing reported within the window
            return 0.0
    span = now - base_t
    return (marks[-1][1] - base_n) / span if span > 0 else 0.0


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


# ---- the endpoint


class TelemetryServer:
    """``GET /progress`` and ``GET /metrics`` of one ``Telemetry`` on a daemon thread."""

    def __init__(self, telemetry: Telemetry, host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                if path == PROGRESS_PATH:
                    body = json.dumps(telemetry.snapshot()).encode()
                    kind = "application/json"
                elif path == METRICS_PATH:
                    body = telemetry.prometheus().encode()
                    kind = METRICS_CONTENT_TYPE
                else:
                    self.send_error(404, f"only {PROGRESS_PATH} and {METRICS_PATH} are served")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a line per poll would drown the task's own output

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._httpd = Server((host, port), Handler)
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="flowmill-telemetry", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{format_address(self.host, self.port)}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


# ---- the job's progress from its tasks'


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return _finite(float(value))


def aggregate(snapshots: Sequence[Mapping[str, Any] | None], mode: str,
              backup_workers: int = 0) -> dict[str, Any]:
    """The job's progress from the snapshots of its training tasks, in task order (the
    chief first, then the workers; None for a task not heard from yet).

    The job's step: the highest global step any task saw, where tasks report it; else
    from the tasks' own steps: under ``sync`` every step takes an update from all but
    ``backup_workers`` tasks, so it is the step that many tasks have reached (with no
    backup workers, the smallest); under ``async`` and ``bounded-staleness`` every task's
    step is an update of its own, so they add up, and so do the totals. The loss is the
    first task's (the chief, or worker 0), examples per second add up over the tasks, and
    the last checkpoint is the newest any task reported.
    """
    steps = [(_int(s.get("step")) if s else None) or 0 for s in snapshots]
    totals = [_int(s.get("total")) if s else None for s in snapshots]
    if mode in SUM_MODES:
        step = sum(steps)
        total = sum(totals) if totals and None not in totals else None  # type: ignore[arg-type]
    else:
        needed = max(1, len(steps) - max(0, backup_workers))
        step = sorted(steps, reverse=True)[needed - 1] if steps else 0
        known = [t for t in totals if t is not None]
        total = max(known) if known else None
    seen = [_int(s.get("globalStep")) for s in snapshots if s]
    seen = [g for g in seen if g is not None]
    if seen:
        step = max(seen)
    first = snapshots[0] if snapshots else None
    rates = [_num(s.get("examplesPerSecond")) for s in snapshots if s]
    checkpoints = [s.get("lastCheckpoint") for s in snapshots if s]
    checkpoints = [c for c in checkpoints if isinstance(c, Mapping) and _int(c.get("step"))
                   is not None]
    newest = max(checkpoints, key=lambda c: c["step"], default=None)
    return {
        "step": step,
        "total": total,
        "loss": _num(first.get("loss")) if first else None,
        "examplesPerSecond": sum(r for r in rates if r is not None),
        "lastCheckpoint": dict(newest) if newest is not None else None,
    }


# ---- the process's record

_telemetry = Telemetry()
_server: TelemetryServer | None = None
_server_tried = False
_server_lock = threading.Lock()
_server_settled = threading.Event()  # the attempt to start it is over, served or not


def telemetry() -> Telemetry:
    """This process's record (the one ``report_step`` and ``report_checkpoint`` write)."""
    return _telemetry


def report_step(step: int, total: int | None, loss: float | None, examples: int,
                global_step: int | None = None) -> None:
    """This task has done ``step`` steps of its own (of ``total``, when known); the last
    one's loss and the examples it trained on; the job's global step, when known."""
    _telemetry.report_step(step, total, loss, examples, global_step)
    if not _server_tried:
        _start_server()


def count_step() -> None:
    """A training step the script does not report itself (see ``Telemetry.count_step``)."""
    _telemetry.count_step()
    if not _server_tried:
        _start_server()


def report_checkpoint(step: int, uri: str) -> None:
    """A checkpoint at ``step`` was committed at ``uri``, now."""
    _telemetry.report_checkpoint(step, uri)
    if not _server_tried:
        _start_server()


def snapshot() -> dict[str, Any]:
    return _telemetry.snapshot()


def serve_now(source: Source | None = None) -> TelemetryServer | None:
    """Serve this process's record now, not at its first step, with ``source``'s numbers
    (a PS task, which reports no steps); None when ``FLOWMILL_METRICS_PORT`` is unset or
    the port cannot be had (said once on stderr)."""
    if source is not None:
        _telemetry.set_source(source)
    _start_server()
    return server(timeout=10.0)


def server(timeout: float | None = 0.0) -> TelemetryServer | None:
    """The endpoint, once a report has started it (None when ``FLOWMILL_METRICS_PORT`` is
    unset or it could not bind); waits up to ``timeout`` seconds for it to start."""
    if _server_tried:
        _server_settled.wait(timeout)
    return _server


def _start_server() -> None:
    """Once per process, off the step's path (binding, and the imports that choose the
    address, take a while): serve the record if ``FLOWMILL_METRICS_PORT`` says where, and
    leave the last snapshot where ``FLOWMILL_PROGRESS_FINAL`` says at exit."""
    global _server_tried
    with _server_lock:
        if _server_tried:
            return
        _server_tried = True
    final = os.environ.get(ENV_PROGRESS_FINAL, "").strip()
    if final:
        atexit.register(_write_final, final)
    threading.Thread(target=_serve, name="flowmill-telemetry-start", daemon=True).start()


def _write_final(path: str) -> None:
    """The snapshot at exit, for a reader that can no longer poll this process."""
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(_telemetry.snapshot(), f)
        os.replace(tmp, path)
    except OSError:
        pass  # the bar then shows the last step it polled


def _serve() -> None:
    """A port that cannot be had is reported once; training goes on without the endpoint."""
    global _server
    text = os.environ.get(ENV_METRICS_PORT, "").strip()
    host = "?"
    try:
        if not text:
            return
        if not text.isdigit() or int(text) > 65535:
            raise ValueError(f"{ENV_METRICS_PORT} must be a port number, got {text!r}")
        host = bind_host()
        _server = TelemetryServer(_telemetry, host, int(text))
    except (OSError, ValueError) as e:
        print(f"flowmill: not serving training progress on {host}:{text}: {e}",
              file=sys.stderr, flush=True)
    finally:
        _server_settled.set()
