"""Kubernetes Events about jobs, posted in order by one thread of their own.

Why not kopf's poster (``kopf.event``): it posts each object's Events from a task of its
own over kopf's HTTP session, which opens a connection for every post in flight and keeps
each open afterwards with its read buffer; a thousand jobs applied at once left about
forty idle connections and several MB in the operator. Here, as client-go's event
broadcaster does, an Event goes into a bounded queue and one thread posts the queue in
order over one kept-alive connection of the controller's own client, under its rate
limit. A reconcile never waits for an Event. When the queue is full (the API server is
down or slow) new Events are dropped and counted, as client-go drops them; a post that
fails for a reason that may pass (no answer, 429, 5xx) is tried again a few times.

The Events are ``core/v1`` ones, as ``kubectl describe`` and ``kubectl get events`` show
them: ``firstTimestamp``/``lastTimestamp``, ``count`` 1, ``source.component`` (the "From"
column), named after the object they are about (``<name>.<unique suffix>``).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from .apiclient import ApiError, Kube, path

log = logging.getLogger("flowmill.operator")

COMPONENT = "flowmill-operator"
MESSAGE_LIMIT = 1024  # characters; longer messages are cut, marked with "..."
QUEUE_LIMIT = 1000  # Events waiting to be posted (client-go's broadcaster holds as many)
RETRY_DELAYS = (0.5, 1.0, 2.0)  # seconds, after a post that may succeed later
_STOP = object()


def truncate(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT - 3] + "..."


def event_body(obj: Mapping[str, Any], type: str, reason: str, message: str,
               now: datetime, instance: str) -> dict[str, Any]:
    """A ``core/v1`` Event about ``obj``."""
    meta = obj.get("metadata") or {}
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name', 'object')}.",
                     "namespace": meta.get("namespace") or "default"},
        "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                           "name": meta.get("name"), "namespace": meta.get("namespace"),
                           "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": type, "reason": reason, "message": truncate(message),
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def retryable(e: ApiError) -> bool:
    return e.status in (0, 429) or e.status >= 500


class Recorder:
    """``post(obj, type, reason, message)`` queues an Event; a thread posts them."""

    def __init__(self, api: Kube, limit: int = QUEUE_LIMIT,
                 retry_delays: tuple[float, ...] = RETRY_DELAYS,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 instance: str | None = None) -> None:
        self.api = api
        self.retry_delays = retry_delays
        self.clock = clock
        self.instance = instance or socket.gethostname()
        self.dropped = 0  # full queue, or a post that failed for good
        self.posted = 0
        self._count_lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=limit)
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def post(self, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        body = event_body(obj, type, reason, message, self.clock(), self.instance)
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            dropped = self._count_drop()
            if dropped == 1 or dropped % 100 == 0:
                log.warning("Events are arriving faster than the API server takes them: "
                            "%d dropped so far (latest: %s %s)", dropped, reason,
                            body["involvedObject"]["name"])

    def close(self, timeout: float = 5.0) -> None:
        """Post what is queued (for up to ``timeout`` seconds), then stop."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _count_drop(self) -> int:
        with self._count_lock:
            self.dropped += 1
            return self.dropped

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            try:
                if body is _STOP:
                    return
                self._send(body)
            finally:
                self._queue.task_done()

    def _send(self, body: dict[str, Any]) -> None:
        where = path("v1", "events", body["metadata"]["namespace"])
        for delay in (*self.retry_delays, None):
            try:
                self.api.create(where, body)
                with self._count_lock:
                    self.posted += 1
                return
            except ApiError as e:
                if delay is None or not retryable(e):
                    self._count_drop()
                    # A namespace gone or being deleted refuses Events: nothing to report.
                    level = (logging.DEBUG if e.status == 404 or "being terminated" in e.message
                             else logging.WARNING)
                    log.log(level, "Event %s about %s not posted: %s", body["reason"],
                            body["involvedObject"]["name"], e.message or e)
                    return
            except Exception as e:  # never let one Event stop the thread
                self._count_drop()
                log.warning("Event %s about %s not posted: %r", body["reason"],
                            body["involvedObject"]["name"], e)
                return
            time.sleep(delay)
