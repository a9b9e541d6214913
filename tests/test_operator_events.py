"""The operator's Events: posted in order by a thread of their own over real HTTPS (the
e2e tests read them back from kube-apiserver with kubectl), retried when the failure may
pass, dropped and counted when the queue is full; a reconcile never waits for them."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_operator_apiclient import Server

from flowmill.operator.apiclient import Credentials, Kube
from flowmill.operator.events import MESSAGE_LIMIT, Recorder, event_body

JOB = {"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
       "metadata": {"name": "mnist", "namespace": "ml", "uid": "u-1", "resourceVersion": "7"}}
NOW = datetime(2026, 12, 3, 10, 0, 5, 123456, tzinfo=UTC)


@pytest.fixture
def server(tmp_path: Path):
    s = Server(tmp_path)
    yield s
    s.close()


def recorder(server: Server, **kw) -> Recorder:
    kube = Kube(Credentials(server.url, ca_file=str(server.ca_file), token="t"))
    return Recorder(kube, clock=lambda: NOW, instance="operator-0", **kw)


def test_an_event_is_a_core_v1_event_about_the_object():
    body = event_body(JOB, "Warning", "InvalidSpec", "x" * 2000, NOW, "operator-0")
    assert body["metadata"] == {"generateName": "mnist.", "namespace": "ml"}
    assert body["involvedObject"] == {"apiVersion": "flowmill.dev/v1alpha1",
                                      "kind": "TrainingJob", "name": "mnist",
                                      "namespace": "ml", "uid": "u-1", "resourceVersion": "7"}
    assert (body["type"], body["reason"], body["count"]) == ("Warning", "InvalidSpec", 1)
    assert len(body["message"]) == MESSAGE_LIMIT and body["message"].endswith("...")
    assert body["source"] == {"component": "flowmill-operator"}
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2026-12-03T10:00:05Z"


def test_events_are_posted_in_order_and_a_passing_failure_is_tried_again(server):
    server.replies = [(201, {}), (503, {"message": "etcd leader changed"}), (201, {}),
                      (422, {"message": "Event is invalid"}), (201, {})]
    rec = recorder(server, retry_delays=(0.0, 0.0))
    for reason in ("Created", "Running", "Bad", "Succeeded"):
        rec.post(JOB, "Normal", reason, f"job {reason.lower()}")
    rec.close()
    posts = [(method, where, json.loads(body)["reason"])
             for method, where, _, body in server.requests]
    assert posts == [("POST", "/api/v1/namespaces/ml/events", "Created"),
                     ("POST", "/api/v1/namespaces/ml/events", "Running"),  # 503 ...
                     ("POST", "/api/v1/namespaces/ml/events", "Running"),  # ... again
                     ("POST", "/api/v1/namespaces/ml/events", "Bad"),  # 422: not again
                     ("POST", "/api/v1/namespaces/ml/events", "Succeeded")]
    assert (rec.posted, rec.dropped) == (3, 1)


def test_a_full_queue_drops_new_events_and_posting_never_blocks():
    entered, gate = threading.Event(), threading.Event()
    sent: list[str] = []

    class SlowApi:  # an API server that has stopped answering
        def create(self, where: str, body: dict) -> dict:
            entered.set()
            gate.wait(10)
            sent.append(body["reason"])
            return {}

    rec = Recorder(SlowApi(), limit=2)  # type: ignore[arg-type]
    rec.post(JOB, "Normal", "E0", "")
    assert entered.wait(5)
    start = time.monotonic()
    for i in range(1, 10):
        rec.post(JOB, "Normal", f"E{i}", "")
    assert time.monotonic() - start < 5  # no post waited for the API server
    gate.set()
    rec.close()
    # One was in flight, two waited; the other seven were dropped and counted.
    assert sent == ["E0", "E1", "E2"] and rec.dropped == 7


def test_a_failure_that_may_pass_gives_up_after_its_retries(server):
    server.replies = [(500, {}), (500, {}), (500, {})]
    rec = recorder(server, retry_delays=(0.0, 0.0))
    rec.post(JOB, "Normal", "Created", "")
    rec.close()
    assert len(server.requests) == 3 and (rec.posted, rec.dropped) == (0, 1)
