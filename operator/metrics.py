"""The operator's Prometheus metrics, in the text exposition format, served over stdlib HTTP.

A handful of series do not justify a client library: the operator keeps its counters in
one small thread-safe object (reconciles run in worker threads) and renders them on each
scrape. Names follow Prometheus conventions (``_total`` counters, ``_seconds`` units).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .status import PHASES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PATH = "/metrics"

# Reconciles are a few API calls: most take milliseconds, a slow API server seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RESTART_KINDS = ("task", "job")

PREFIX = "flowmill_operator"


class Metrics:
    """What the operator counts. Every method is safe to call from any thread."""

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self._lock = threading.Lock()
        self._buckets = tuple(sorted(buckets))
        if not self._buckets or any(not math.isfinite(b) for b in self._buckets):
            raise ValueError(f"histogram buckets must be finite and not empty, "
                             f"got {self._buckets}")
        self._phases: dict[tuple[str, str], str] = {}
        self._restarts = dict.fromkeys(RESTART_KINDS, 0)
        self._errors = 0
        self._pods_created = 0
        self._pods_deleted = 0
        self._latency_counts = [0] * len(self._buckets)
        self._latency_sum = 0.0
        self._latency_count = 0

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """The job's phase as last written (None: the job is gone or has no phase yet)."""
        with self._lock:
            if phase is None:
                self._phases.pop((namespace, name), None)
            else:
                self._phases[(namespace, name)] = phase

    def count_restarts(self, kind: str, n: int = 1) -> None:
        if kind not in RESTART_KINDS:
            raise ValueError(f"restart kind must be one of {', '.join(RESTART_KINDS)}, "
                             f"got {kind!r}")
        with self._lock:
            self._restarts[kind] += n

    def count_error(self) -> None:
        with self._lock:
            self._errors += 1

    def count_pods(self, created: int = 0, deleted: int = 0) -> None:
        with self._lock:
            self._pods_created += created
            self._pods_deleted += deleted

    def observe_reconcile(self, seconds: float) -> None:
        with self._lock:
            for i, bound in enumerate(self._buckets):
                if seconds <= bound:
                    self._latency_counts[i] += 1
                    break
            self._latency_sum += seconds
            self._latency_count += 1

    def jobs_by_phase(self) -> dict[str, int]:
        with self._lock:
            phases = list(self._phases.values())
        counts = dict.fromkeys(PHASES, 0)
        for phase in phases:
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    def render(self) -> str:
        """All series in the text exposition format (version 0.0.4)."""
        jobs = self.jobs_by_phase()
        with self._lock:
            restarts = dict(self._restarts)
            errors, created, deleted = self._errors, self._pods_created, self._pods_deleted
            cumulative, running = [], 0
            for n in self._latency_counts:
                running += n
                cumulative.append(running)
            total, count = self._latency_sum, self._latency_count
        lines: list[str] = []
        _family(lines, "trainingjobs", "gauge",
                "TrainingJobs by phase, as this operator last wrote it.",
                [({"phase": p}, n) for p, n in jobs.items()])
        _family(lines, "restarts_total", "counter",
                "Restarts decided: task (failed tasks recreated) and job (whole job restarted).",
                [({"kind": k}, n) for k, n in restarts.items()])
        _family(lines, "reconcile_errors_total", "counter",
                "Reconciles that ended in an error (retried with back-off).", [({}, errors)])
        _family(lines, "pods_created_total", "counter", "Task pods created.", [({}, created)])
        _family(lines, "pods_deleted_total", "counter", "Task pods deleted.", [({}, deleted)])
        name = f"{PREFIX}_reconcile_duration_seconds"
        lines.append(f"# HELP {name} Time to reconcile one TrainingJob (read, decide, act).")
        lines.append(f"# TYPE {name} histogram")
        for bound, n in zip(self._buckets, cumulative, strict=True):
            lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {n}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {count}')
        lines.append(f"{name}_sum {_number(total)}")
        lines.append(f"{name}_count {count}")
        return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, help: str,
            samples: list[tuple[Mapping[str, str], float]]) -> None:
    name = f"{PREFIX}_{name}"
    lines.append(f"# HELP {name} {help}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{_labels(labels)} {_number(value)}")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


class MetricsServer:
    """``GET /metrics`` on a background thread; ``close()`` stops it."""

    def __init__(self, metrics: Metrics, host: str = "0.0.0.0", port: int = 9090) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path.split("?", 1)[0] != PATH:
                    self.send_error(404, f"only {PATH} is served")
                    return
                body = metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # one line per scrape would drown the operator's own log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="flowmill-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
