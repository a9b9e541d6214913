"""The controller's own logic, without a cluster: the order it applies an action in, how
it treats conflicts and API errors, event folding and requeues, settings, and metrics."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from cryptography import x509

from flowmill.operator import apiclient
from flowmill.operator import controller as ctl
from flowmill.operator import workqueue as wq
from flowmill.operator.apiclient import ApiError
from flowmill.operator.manifests import LABEL_JOB, desired_pod, desired_service, metrics_port
from flowmill.operator.metrics import Metrics, MetricsServer, escape_label
from flowmill.operator.status import Action, Condition, Status, format_time
from flowmill.operator.store import Store
from flowmill.runtime.tls import common_name

UID = "uid-1"
NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
TEMPLATE = {"spec": {"containers": [{"name": "flowmill", "image": "flowmill:dev",
                                     "command": ["python", "train.py"]}]}}


def make_job(status: dict | None = None, **run_policy: Any) -> dict:
    return {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "mnist", "namespace": "ml", "uid": UID, "generation": 1,
                     "resourceVersion": "1"},
        "spec": {"replicaSpecs": {"ps": {"replicas": 1},
                                  "worker": {"replicas": 2, "template": TEMPLATE}},
                 "runPolicy": run_policy},
        "status": copy.deepcopy(status or {}),
    }


def error(status: int, message: str = "") -> ApiError:
    return ApiError(status, {404: "Not Found", 409: "Conflict", 403: "Forbidden"}.get(
        status, "Internal Server Error"), json.dumps({"kind": "Status", "message": message}))


class FakeApi:
    """The operator's API client (``apiclient.Kube``) over in-memory objects, as the API
    server keeps them: each write takes the next resourceVersion and returns the object;
    every write is recorded in ``calls``, every read in ``reads``."""

    def __init__(self, job: dict | None) -> None:
        self.job = job
        self.pods: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.policies: dict[str, dict] = {}
        self.secrets: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []  # writes
        self.reads: list[tuple[str, str]] = []
        self.delivered: dict[str, dict] = {}  # uid -> pod, as last delivered to a store
        self.failures: dict[tuple[str, str], ApiError] = {}
        self.revision = 100  # etcd's: every write takes the next one
        self.graceful: set[str] = set()  # pods a delete leaves terminating

    # -- the client's interface

    def get(self, path: str, **query: str) -> dict:
        return self.request("GET", path, query=query)

    def list(self, path: str, each, limit: int = 500, **query: str) -> dict:
        listing = self.get(path, **query)  # one page
        return {**listing, "items": [each(o) for o in listing["items"]]}

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def replace(self, path: str, body: dict) -> dict:
        return self.request("PUT", path, body)

    def delete(self, path: str, body: dict | None = None) -> dict:
        return self.request("DELETE", path, body)

    def request(self, method: str, path: str, body: dict | None = None,
                query: dict | None = None) -> dict:
        parts = path.strip("/").split("/")
        assert parts[2] == "namespaces" or parts[3] == "namespaces", path
        rest = parts[parts.index("namespaces") + 2:]
        plural, name, sub = rest[0], (rest[1:] or [None])[0], (rest[2:] or [None])[0]
        kind = {"pods": "pod", "services": "service", "secrets": "secret",
                "networkpolicies": "network-policy", "trainingjobs": "job"}[plural]
        store = {"pod": self.pods, "service": self.services, "secret": self.secrets,
                 "network-policy": self.policies}.get(kind)
        body = copy.deepcopy(body)
        if kind == "job":
            return copy.deepcopy(self._job(method, name, sub, body))
        if method == "GET" and name is None:
            self.reads.append((f"list-{plural}", query["labelSelector"]))
            return self._list(store, query["labelSelector"])
        if method == "GET":
            self.reads.append((f"get-{kind}", name))
            if name not in store:
                raise error(404)
            return copy.deepcopy(_with_uid(store[name]))
        if method == "POST":
            return copy.deepcopy(self._create(kind, store, body))
        if method == "PUT":
            self._fail(f"replace-{kind}", name)
            if body["metadata"].get("resourceVersion") != store[name]["metadata"].get(
                    "resourceVersion"):
                raise error(409, "the object has been modified")
            body["metadata"]["resourceVersion"] = self._next_rv()
            store[name] = body
            return copy.deepcopy(body)
        assert method == "DELETE"
        if kind == "pod":
            return copy.deepcopy(self._delete_pod(name))
        self._fail(f"delete-{kind}", name)
        return copy.deepcopy(store.pop(name, {}))

    # -- what the API server does

    def _job(self, method: str, name: str, sub: str | None, body: dict | None) -> dict:
        if method == "GET":
            self.reads.append(("get-job", name))
            if self.job is None:
                raise error(404)
            return self.job
        if method == "PUT":
            assert sub == "status"
            self._fail("status", name)
            if body["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]:
                raise error(409, "the object has been modified")
            self.job["status"] = body["status"]
            self.job["metadata"]["resourceVersion"] = self._next_rv()
            return self.job
        assert method == "DELETE"
        self._fail("delete-job", name)
        assert body["preconditions"]["uid"] == self.job["metadata"]["uid"]
        assert body["propagationPolicy"] == "Background"
        self.job = None
        return {"kind": "Status", "status": "Success"}

    def _fail(self, verb: str, name: str) -> None:
        self.calls.append((verb, name))
        if (verb, name) in self.failures:
            raise self.failures[(verb, name)]

    def _next_rv(self) -> str:
        self.revision += 1
        return str(self.revision)

    def _list(self, objects: dict[str, dict], label_selector: str) -> dict:
        key, _, value = label_selector.partition("=")  # "key=value", or "key": has it
        items = [copy.deepcopy(_with_uid(o)) for o in objects.values()
                 if key in o["metadata"]["labels"]
                 and (not value or o["metadata"]["labels"][key] == value)]
        return {"metadata": {"resourceVersion": str(self.revision)}, "items": items}

    def _create(self, kind: str, objects: dict[str, dict], body: dict) -> dict:
        name = body["metadata"]["name"]
        self._fail(f"create-{kind}", name)
        if name in objects:
            raise error(409, f"{kind} {name} already exists")
        obj = copy.deepcopy(body)
        obj["metadata"].setdefault("uid", f"uid-{name}-{self.revision}")
        obj["metadata"]["resourceVersion"] = self._next_rv()
        objects[name] = obj
        if kind == "pod":  # the store has it from the response
            self.delivered[obj["metadata"]["uid"]] = obj
        return obj

    def _delete_pod(self, name: str) -> dict:
        """A Running pod (or one named in ``graceful``) stays, terminating, for its grace
        period; any other is deleted at once, as the API server does with a pod that has
        ended or was never bound."""
        self._fail("delete-pod", name)
        if name not in self.pods:
            raise error(404)
        pod = _with_uid(self.pods[name])
        if name in self.graceful or (pod.get("status") or {}).get("phase") == "Running":
            pod["metadata"].update(deletionTimestamp=format_time(NOW),
                                   deletionGracePeriodSeconds=30)
            pod["metadata"]["resourceVersion"] = self._next_rv()
            return pod
        del self.pods[name]
        return pod

    # -- what the kubelet and the watches do

    def deliver(self, store: Store) -> None:
        """What the watches would have brought the store by now: the job, every pod as it
        is, and the deletion of every pod delivered before and gone since."""
        if self.job is not None:
            store.put_job(copy.deepcopy(self.job))
        pods = {p["metadata"]["uid"]: copy.deepcopy(p)
                for p in map(_with_uid, self.pods.values())}
        for uid, pod in self.delivered.items():
            if uid not in pods:
                store.drop_pod(pod)
        for pod in pods.values():
            store.put_pod(pod)
        self.delivered = pods

    def set_pod(self, pod: dict) -> dict:
        """The kubelet's write: the pod as given, at the next revision."""
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = self._next_rv()
        self.pods[pod["metadata"]["name"]] = pod
        return pod


def _with_uid(obj: dict) -> dict:
    """The object, given a uid if it has none (objects made by hand here): one per name."""
    obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
    return obj


class Controller(ctl.JobController):
    """The controller with its store brought up to date before each reconcile, as the
    operator's watches keep it."""

    fake: FakeApi

    def reconcile(self, namespace, name, now=None):
        self.fake.deliver(self.store)
        return super().reconcile(namespace, name, now)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, body, type, reason, message) -> None:
        assert body["metadata"]["uid"] == UID
        self.events.append((type, reason, message))

    @property
    def reasons(self) -> list[str]:
        return [r for _, r, _ in self.events]


def make_controller(job: dict | None) -> tuple[ctl.JobController, FakeApi, Recorder, Metrics]:
    fake, events, metrics = FakeApi(job), Recorder(), Metrics()
    controller = Controller(fake, metrics, post=events)
    controller.fake = fake
    return controller, fake, events, metrics


def with_state(pod: dict, state: dict, phase: str) -> dict:
    pod = copy.deepcopy(pod)
    pod["status"] = {"phase": phase,
                     "containerStatuses": [{"name": "flowmill", "state": state}]}
    return pod


RUNNING = ({"running": {}}, "Running")


def terminated(code: int) -> tuple[dict, str]:
    return {"terminated": {"exitCode": code}}, "Succeeded" if code == 0 else "Failed"


# ---- one reconcile


def test_new_job_status_first_then_services_then_pods_ps_first():
    controller, fake, events, metrics = make_controller(make_job())
    outcome = controller.reconcile("ml", "mnist", now=NOW)
    writes = [c for c in fake.calls if c[0] != "get"]
    assert writes == [("status", "mnist"),
                      ("create-service", "mnist-ps-0"), ("create-service", "mnist-worker-0"),
                      ("create-service", "mnist-worker-1"),
                      ("create-network-policy", "mnist"),
                      ("create-secret", "mnist-tls"),
                      ("create-pod", "mnist-ps-0"), ("create-pod", "mnist-worker-0"),
                      ("create-pod", "mnist-worker-1")]
    assert fake.job["status"]["phase"] == "Pending"
    assert fake.job["status"]["startTime"] == format_time(NOW)
    assert outcome == ctl.Outcome("Pending", None)
    assert events.reasons == ["CreatingTasks"]
    assert all(svc["metadata"]["ownerReferences"][0]["uid"] == UID
               for svc in fake.services.values())
    assert metrics.render().count("flowmill_operator_pods_created_total 3") == 1


def test_reconcile_is_idempotent():
    controller, fake, events, _ = make_controller(make_job())
    controller.reconcile("ml", "mnist", now=NOW)
    fake.calls.clear()
    # the status counted the new pods already, and their way to running is no news
    controller.reconcile("ml", "mnist", now=NOW)
    for pod in list(fake.pods.values()):
        fake.set_pod(with_state(pod, {"waiting": {"reason": "ContainerCreating"}}, "Pending"))
    controller.reconcile("ml", "mnist", now=NOW)
    assert fake.calls == []
    for pod in list(fake.pods.values()):
        fake.set_pod(with_state(pod, *RUNNING))
    controller.reconcile("ml", "mnist", now=NOW)
    assert fake.calls == [("status", "mnist")] and fake.job["status"]["phase"] == "Running"
    fake.calls.clear()
    events.events.clear()
    controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=5))
    assert fake.calls == []  # nothing written, nothing created
    assert events.events == []


def test_pod_that_already_exists_is_fine_and_creation_stops_at_the_first_error():
    job = make_job()
    controller, fake, events, _ = make_controller(job)
    fake.pods["mnist-ps-0"] = desired_pod(job, "ps", 0, 1)  # listed under another label
    fake.pods["mnist-ps-0"]["metadata"]["labels"][LABEL_JOB] = "other"
    fake.failures[("create-pod", "mnist-worker-0")] = error(500, "etcd is on fire")
    with pytest.raises(ctl.Blocked):
        controller.reconcile("ml", "mnist", now=NOW)
    created = [name for verb, name in fake.calls if verb == "create-pod"]
    assert created == ["mnist-ps-0", "mnist-worker-0"]  # 409 on ps-0 passed; worker-1 not tried
    assert ("Warning", "FailedCreatePod",
            "cannot create pod mnist-worker-0: 500 Internal Server Error: etcd is on fire"
            ) in events.events


def test_pods_that_cannot_be_made_leave_the_status_as_it_is():
    """A quota or a webhook refusing the pods: the next tries write no status (its write
    would bring the job straight back, past the back-off)."""
    controller, fake, events, _ = make_controller(make_job())
    fake.failures[("create-pod", "mnist-ps-0")] = error(403, "exceeded quota")
    for _ in range(3):
        with pytest.raises(ctl.Blocked):
            controller.reconcile("ml", "mnist", now=NOW)
    assert [verb for verb, _ in fake.calls].count("status") == 1
    assert events.reasons.count("FailedCreatePod") == 3
    del fake.failures[("create-pod", "mnist-ps-0")]
    controller.reconcile("ml", "mnist", now=NOW)
    assert {p["metadata"]["labels"]["flowmill.dev/restart-generation"]
            for p in fake.pods.values()} == {str(fake.job["status"]["restartGeneration"])}


def test_a_new_process_reads_a_namespaces_pods_once_for_all_its_jobs():
    controller, fake, _, _ = make_controller(make_job())
    controller.reconcile("ml", "mnist", now=NOW)
    other = make_job()
    other["metadata"].update(name="other", uid="uid-2")
    other_pod = desired_pod(other, "worker", 0, 1)
    fake.pods["other-worker-0"] = with_state(other_pod, *RUNNING)
    fake.reads.clear()
    fresh = ctl.JobController(fake, Metrics(), post=lambda *a: None)  # a restart
    fake.delivered = {}
    fake.deliver(fresh.store)
    fresh.reconcile("ml", "mnist", now=NOW)
    assert fake.reads == [("list-pods", LABEL_JOB)]  # no job read, one list for all
    assert [p["metadata"]["name"] for p in fresh.store.pods("ml", "other")] == [
        "other-worker-0"]


def test_status_conflict_drops_the_decision():
    controller, fake, events, _ = make_controller(make_job())
    fake.failures[("status", "mnist")] = error(409)
    with pytest.raises(ctl.Conflict):
        controller.reconcile("ml", "mnist", now=NOW)
    assert [c for c in fake.calls if c[0] != "status"] == []
    assert events.events == []


def test_failed_worker_counted_before_its_pod_is_deleted():
    job = make_job()
    controller, fake, events, metrics = make_controller(job)
    controller.reconcile("ml", "mnist", now=NOW)
    job = fake.job
    fake.pods = {
        "mnist-ps-0": with_state(desired_pod(job, "ps", 0, 1), *RUNNING),
        "mnist-worker-0": with_state(desired_pod(job, "worker", 0, 1), *terminated(1)),
        "mnist-worker-1": with_state(desired_pod(job, "worker", 1, 1), *RUNNING),
    }
    fake.calls.clear()
    fake.graceful.add("mnist-worker-0")  # a sidecar still runs: the pod lingers
    controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=10))
    assert fake.calls == [("status", "mnist"), ("delete-pod", "mnist-worker-0")]
    assert fake.job["status"]["restartCount"] == 1
    assert fake.job["status"]["phase"] == "Restarting"
    assert 'flowmill_operator_restarts_total{kind="task"} 1' in metrics.render()
    assert events.reasons[-1] == "RestartingTasks"
    assert events.events[-1][0] == "Warning"
    # The watch has not yet shown the pod terminating: the store's copy (the DELETE's
    # response) does, so the failure is not counted again.
    fake.calls.clear()
    controller.store.put_pod({**with_state(fake.pods["mnist-worker-0"], *terminated(1)),
                              "metadata": {**fake.pods["mnist-worker-0"]["metadata"],
                                           "resourceVersion": "1"}})
    ctl.JobController.reconcile(controller, "ml", "mnist", now=NOW + timedelta(seconds=11))
    assert fake.job["status"]["restartCount"] == 1
    assert [verb for verb, _ in fake.calls if verb != "status"] == []


def test_a_failed_pod_deleted_at_once_is_replaced_in_the_same_reconcile():
    job = make_job()
    controller, fake, events, _ = make_controller(job)
    controller.reconcile("ml", "mnist", now=NOW)
    for name, pod in list(fake.pods.items()):
        state = terminated(1) if name == "mnist-worker-0" else RUNNING
        fake.set_pod(with_state(pod, *state))
    old_uid = fake.pods["mnist-worker-0"]["metadata"]["uid"]
    fake.calls.clear()
    fake.reads.clear()
    controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=10))
    # status (counted) first, the delete, then the next round: status and the new pod
    assert fake.calls == [("status", "mnist"), ("delete-pod", "mnist-worker-0"),
                          ("status", "mnist"), ("create-pod", "mnist-worker-0")]
    assert fake.pods["mnist-worker-0"]["metadata"]["uid"] != old_uid
    assert fake.job["status"]["restartCount"] == 1
    assert fake.reads == []  # the job and its pods came from the store, and nothing else
    # was read: its Services, policy and this run's certificates are known to be there
    assert events.reasons.count("RestartingTasks") == 1


def test_ttl_deletes_the_job_with_a_uid_precondition():
    done = format_time(NOW - timedelta(seconds=100))
    status = {"phase": "Succeeded", "completionTime": done, "startTime": done,
              "conditions": [{"type": "Created", "status": "True"},
                             {"type": "Running", "status": "False"},
                             {"type": "Succeeded", "status": "True", "reason": "Succeeded"}],
              "replicaStatuses": {"worker": {"completedIndexes": "0-1"}}}
    controller, fake, events, _ = make_controller(make_job(status, ttlSecondsAfterFinished=10))
    outcome = controller.reconcile("ml", "mnist", now=NOW)
    assert outcome.gone and fake.job is None
    assert ("delete-job", "mnist") in fake.calls
    assert "TTLExpired" in events.reasons


def test_service_of_an_earlier_job_is_removed_before_pods_start():
    job = make_job()
    controller, fake, events, _ = make_controller(job)
    old = desired_service(job, "ps", 0)
    old["metadata"]["ownerReferences"][0]["uid"] = "uid-of-an-earlier-job"
    fake.services["mnist-ps-0"] = old
    with pytest.raises(ctl.Blocked):
        controller.reconcile("ml", "mnist", now=NOW)
    assert ("delete-service", "mnist-ps-0") in fake.calls
    assert not fake.pods
    assert "ServiceConflict" in events.reasons


def test_gone_and_invalid_jobs():
    controller, *_ = make_controller(None)
    assert controller.reconcile("ml", "mnist") == ctl.Outcome(None, None, gone=True)
    bad = make_job()
    bad["spec"]["replicaSpecs"]["worker"]["replicas"] = 0
    controller, fake, events, metrics = make_controller(bad)
    assert controller.reconcile("ml", "mnist") == ctl.Outcome(None, None)
    assert events.reasons == ["InvalidSpec"] and fake.calls == []
    assert "flowmill_operator_reconcile_errors_total 1" in metrics.render()


# ---- pure helpers


def test_events_for_phase_transitions_and_actions():
    cond = Condition("Failed", "True", "BackoffLimitExceeded", "over budget")
    status = Status(phase="Failed", conditions=(cond,))
    action = Action("fail", status, reason="BackoffLimitExceeded", message="over budget",
                    warning=True)
    assert ctl.events_for("Running", action) == [
        ("Warning", "BackoffLimitExceeded", "phase Running -> Failed: over budget")]
    assert ctl.events_for("Failed", Action("wait", status)) == []
    create = Action("create", Status(phase="Pending"), reason="CreatingTasks", message="x" * 2000)
    (first, second) = ctl.events_for(None, create)
    assert first == ("Normal", "Pending", "phase (none) -> Pending")
    pending = Status(phase="Pending", conditions=(
        Condition("Running", "False", "Resumed", "resuming"),))
    assert ctl.events_for("Suspended", Action("wait", pending)) == [
        ("Normal", "Resumed", "phase Suspended -> Pending: resuming")]
    assert second[:2] == ("Normal", "CreatingTasks") and len(second[2]) == 1024
    # A new job: one Event, not one for Pending and one for the pods
    new = Status(phase="Pending", conditions=(
        Condition("Running", "False", "TasksPending", "waiting for 3 task(s)"),))
    assert ctl.events_for(None, Action("create", new, reason="CreatingTasks",
                                       message="creating 3 pod(s): a, b, c")) == [
        ("Normal", "CreatingTasks", "phase (none) -> Pending: creating 3 pod(s): a, b, c")]


def test_requeue_delay_and_backoff():
    assert wq.requeue_delay("Running", None, 300) == 300
    assert wq.requeue_delay("Running", 12.5, 300) == 12.5
    assert wq.requeue_delay("Running", -3, 300) == wq.MIN_REQUEUE
    assert wq.requeue_delay("Succeeded", None, 300) is None
    assert wq.requeue_delay("Succeeded", 40, 300) == 40
    assert wq.requeue_delay("Running", None, 0) is None
    assert [wq.backoff(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert wq.backoff(50) == wq.MAX_BACKOFF


def test_job_of_prefers_the_controlling_owner():
    owner = {"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob", "name": "a",
             "controller": True, "uid": "u"}
    assert ctl.job_of({"labels": {LABEL_JOB: "b"}, "ownerReferences": [owner]}) == "a"
    other = {**owner, "apiVersion": "batch/v1", "kind": "Job"}
    assert ctl.job_of({"labels": {LABEL_JOB: "b"}, "ownerReferences": [other]}) == "b"
    assert ctl.job_of({}) is None


def test_status_body_keeps_kopf_state_only():
    status = Status(phase="Running")
    body = ctl.status_body({"kopf": {"progress": {}}, "stale": 1}, status)
    assert body["kopf"] == {"progress": {}} and "stale" not in body
    assert body["phase"] == "Running"


def test_api_error_shows_status_and_message_only():
    e = error(403, "pods is forbidden")
    assert ctl.api_error(e) == "403 Forbidden: pods is forbidden"
    assert ctl.api_error(ValueError("x")) == "ValueError: x"


def test_configure_sets_production_settings():
    settings = kopf.OperatorSettings()
    ctl.configure(settings)
    assert settings.persistence.finalizer == "flowmill.dev/finalizer"
    assert settings.persistence.progress_storage.prefix == "flowmill.dev"
    # Event handlers only: no diff-base is built, stored or read.
    body = kopf.Body({"metadata": {"name": "j", "annotations": {}}, "spec": {"a": 1}})
    assert settings.persistence.diffbase_storage.build(body=body) is None
    assert settings.persistence.diffbase_storage.fetch(body=body) is None
    assert settings.watching.server_timeout < settings.watching.client_timeout
    assert settings.posting.level >= 30
    assert list(settings.watching.label_selectors.values()) == [LABEL_JOB]
    assert settings.watching.chunk_size == 100 and settings.queueing.idle_timeout < 1
    assert not logging.getLogger("kopf.objects").isEnabledFor(logging.INFO)  # per event
    assert logging.getLogger("kopf.objects").isEnabledFor(logging.WARNING)


def test_connection_info_carries_the_token_and_certificates():
    creds = apiclient.Credentials("https://k8s:6443", ca_file="/ca", cert_file="/crt",
                                  key_file="/key", token="abc")
    info = apiclient.connection_info(creds, kopf.OperatorSettings())
    assert (info.server, info.scheme, info.token) == ("https://k8s:6443", "Bearer", "abc")
    assert (info.ca_path, info.certificate_path, info.private_key_path) == (
        "/ca", "/crt", "/key")


# ---- scheduling


class FakeController:
    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = outcomes
        self.calls = 0
        self.order: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def reconcile(self, namespace: str, name: str) -> ctl.Outcome:
        self.gate.wait(10)
        self.calls += 1
        self.order.append(name)
        result = self.outcomes[min(self.calls, len(self.outcomes)) - 1]
        if isinstance(result, Exception):
            raise result
        return result


async def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_events_during_a_reconcile_fold_into_one_more():
    async def main() -> None:
        fake = FakeController([ctl.Outcome("Running", None)])
        fake.gate.clear()
        scheduler = wq.Scheduler(fake, Metrics(), resync=0)
        for _ in range(5):
            scheduler.poke("ml", "mnist")
        await asyncio.sleep(0.05)
        for _ in range(5):
            scheduler.poke("ml", "mnist")
        fake.gate.set()
        await _until(lambda: scheduler.idle())
        assert fake.calls == 2
        await scheduler.close()

    asyncio.run(main())


def test_requeue_errors_back_off_and_gone_jobs_are_forgotten(monkeypatch):
    monkeypatch.setattr(wq, "MIN_REQUEUE", 0.01)
    monkeypatch.setattr(wq, "backoff", lambda n: 0.01)

    async def main() -> None:
        metrics = Metrics()
        fake = FakeController([RuntimeError("boom"), ctl.Outcome("Running", 0.0),
                               ctl.Outcome(None, None, gone=True)])
        scheduler = wq.Scheduler(fake, metrics, resync=0)
        scheduler.poke("ml", "mnist")
        await _until(lambda: fake.calls == 3 and scheduler.idle())
        await asyncio.sleep(0.05)
        assert fake.calls == 3  # gone: no timer left
        text = metrics.render()
        assert "flowmill_operator_reconcile_errors_total 1" in text
        assert "flowmill_operator_reconcile_duration_seconds_count 3" in text
        assert metrics.jobs_by_phase()["Running"] == 0
        await scheduler.close()

    asyncio.run(main())


def test_a_dead_workers_job_goes_before_a_burst_of_new_jobs():
    async def main() -> None:
        fake = FakeController([ctl.Outcome("Running", None)])
        fake.gate.clear()
        scheduler = wq.Scheduler(fake, Metrics(), resync=0, workers=1)
        scheduler.poke("ml", "first", wq.NEW)
        await _until(lambda: scheduler.queued() == 0)  # taken: blocked in its reconcile
        for i in range(50):
            scheduler.poke("ml", f"new-{i}", wq.NEW)
        scheduler.poke("ml", "running", wq.NORMAL)
        scheduler.poke("ml", "new-7", wq.URGENT)  # moved up, queued once
        scheduler.poke("ml", "dead-worker", wq.URGENT)
        scheduler.poke("ml", "dead-worker", wq.NEW)  # a lower priority does not move it back
        fake.gate.set()
        await _until(scheduler.idle)
        assert fake.order[:4] == ["first", "new-7", "dead-worker", "running"]
        assert fake.order[4:] == [f"new-{i}" for i in range(50) if i != 7]
        await scheduler.close()

    asyncio.run(main())


def test_workers_bound_the_reconciles_at_once():
    async def main() -> None:
        fake = FakeController([ctl.Outcome("Running", None)])
        fake.gate.clear()
        scheduler = wq.Scheduler(fake, Metrics(), resync=0, workers=3)
        for i in range(10):
            scheduler.poke("ml", f"job-{i}")
        await _until(lambda: scheduler.queued() == 7)
        await asyncio.sleep(0.05)
        assert scheduler.queued() == 7 and fake.calls == 0
        fake.gate.set()
        await _until(scheduler.idle)
        assert sorted(fake.order) == sorted(f"job-{i}" for i in range(10))
        await scheduler.close()

    asyncio.run(main())


def test_the_watch_echo_of_the_operators_own_writes_queues_nothing():
    class Pokes:
        def __init__(self) -> None:
            self.pokes: list[tuple[str, int]] = []

        def poke(self, namespace: str, name: str, priority: int = wq.NORMAL) -> None:
            self.pokes.append((name, priority))

    memo = SimpleNamespace(store=Store(ctl.job_of), scheduler=Pokes())
    job = make_job()
    pod = desired_pod(job, "worker", 0, 1)
    pod["metadata"].update(uid="p1", resourceVersion="7")

    def event(handler, type, obj):
        asyncio.run(handler(event={"type": type, "object": obj}, name=obj["metadata"]["name"],
                            namespace="ml", meta=obj["metadata"], memo=memo))

    event(ctl.job_event, None, job)  # kopf's first listing: a job not seen before
    memo.store.put_job({**job, "metadata": {**job["metadata"], "resourceVersion": "2"}})
    event(ctl.job_event, "MODIFIED", {**job, "metadata": {**job["metadata"],
                                                          "resourceVersion": "2"}})
    memo.store.put_pod(pod)  # the create's response
    event(ctl.pod_event, "ADDED", pod)  # ... and its echo
    event(ctl.pod_event, "MODIFIED", {**with_state(pod, *terminated(1)), "metadata": {
        **pod["metadata"], "resourceVersion": "8"}})
    assert memo.scheduler.pokes == [("mnist", wq.NEW), ("mnist", wq.URGENT)]


def test_pod_events_that_end_a_task_are_urgent():
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Running", "containerStatuses": [
        {"name": "flowmill", "state": {"running": {}}}]}}
    assert ctl.pod_priority("MODIFIED", pod) == wq.NORMAL
    assert ctl.pod_priority("DELETED", pod) == wq.URGENT
    assert ctl.pod_priority("MODIFIED", {**pod, "metadata": {
        "deletionTimestamp": "2025-01-01T00:00:00Z"}}) == wq.URGENT
    ended = copy.deepcopy(pod)
    ended["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1}}
    assert ctl.pod_priority("MODIFIED", ended) == wq.URGENT  # before the pod's phase says so
    assert ctl.pod_priority(None, {**pod, "status": {"phase": "Failed"}}) == wq.URGENT


def test_the_rate_limit_lets_a_burst_through_then_spaces_requests(monkeypatch):
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    limit = apiclient.RateLimit(10, 3, clock=lambda: now[0], sleep=sleep)
    waits = [limit.acquire() for _ in range(5)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3:] == [pytest.approx(0.1), pytest.approx(0.1)]
    now[0] += 10  # idle: the bucket fills up to its burst, no further
    assert [limit.acquire() for _ in range(4)][:3] == [0.0, 0.0, 0.0] and now[0] > 10.0
    assert apiclient.RateLimit(0, 1).acquire() == 0.0  # qps 0: no limit
    monkeypatch.setenv(apiclient.ENV_QPS, "20")
    monkeypatch.setenv(apiclient.ENV_BURST, "30")
    assert (apiclient.rate_limit_from_env().qps, apiclient.rate_limit_from_env().burst) == (20, 30)
    monkeypatch.setenv(apiclient.ENV_BURST, "lots")
    with pytest.raises(ValueError, match="FLOWMILL_API_BURST must be a whole number"):
        apiclient.rate_limit_from_env()
    monkeypatch.setenv(apiclient.ENV_QPS, "-1")
    monkeypatch.setenv(apiclient.ENV_BURST, "30")
    with pytest.raises(ValueError, match="qps >= 0"):
        apiclient.rate_limit_from_env()


def test_close_stops_timers():
    async def main() -> None:
        fake = FakeController([ctl.Outcome("Running", 0.2)])
        scheduler = wq.Scheduler(fake, Metrics(), resync=0)
        scheduler.poke("ml", "mnist")
        await _until(lambda: fake.calls == 1 and scheduler.idle())
        await scheduler.close()
        scheduler.poke("ml", "mnist")
        await asyncio.sleep(0.4)
        assert fake.calls == 1

    asyncio.run(main())


# ---- metrics


def test_metrics_render_every_family():
    m = Metrics(buckets=(0.1, 1.0))
    m.set_phase("ml", "a", "Running")
    m.set_phase("ml", "b", "Running")
    m.set_phase("ml", "c", "Failed")
    m.set_phase("ml", "c", None)
    m.count_restarts("task", 2)
    m.count_restarts("job")
    m.count_error()
    m.count_pods(created=3, deleted=1)
    for seconds in (0.05, 0.5, 5.0):
        m.observe_reconcile(seconds)
    text = m.render()
    for line in [
        "# TYPE flowmill_operator_trainingjobs gauge",
        'flowmill_operator_trainingjobs{phase="Running"} 2',
        'flowmill_operator_trainingjobs{phase="Failed"} 0',
        "# TYPE flowmill_operator_restarts_total counter",
        'flowmill_operator_restarts_total{kind="task"} 2',
        'flowmill_operator_restarts_total{kind="job"} 1',
        "flowmill_operator_reconcile_errors_total 1",
        "flowmill_operator_pods_created_total 3",
        "flowmill_operator_pods_deleted_total 1",
        "# TYPE flowmill_operator_reconcile_duration_seconds histogram",
        'flowmill_operator_reconcile_duration_seconds_bucket{le="0.1"} 1',
        'flowmill_operator_reconcile_duration_seconds_bucket{le="1.0"} 2',
        'flowmill_operator_reconcile_duration_seconds_bucket{le="+Inf"} 3',
        "flowmill_operator_reconcile_duration_seconds_sum 5.55",
        "flowmill_operator_reconcile_duration_seconds_count 3",
    ]:
        assert line in text.splitlines(), line
    assert text.endswith("\n")
    with pytest.raises(ValueError, match="restart kind"):
        m.count_restarts("pod")
    with pytest.raises(ValueError, match="buckets"):
        Metrics(buckets=())


def test_label_values_are_escaped():
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def test_metrics_server_serves_metrics_only():
    m = Metrics()
    m.count_error()
    server = MetricsServer(m, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert "flowmill_operator_reconcile_errors_total 1" in r.read().decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}/", timeout=5)
        assert e.value.code == 404
    finally:
        server.close()


def test_metrics_port_from_the_environment(monkeypatch):
    monkeypatch.setenv(ctl.ENV_METRICS_PORT, "off")
    assert ctl.start_metrics_server(Metrics()) is None
    monkeypatch.setenv(ctl.ENV_METRICS_PORT, "nine")
    with pytest.raises(ValueError, match=ctl.ENV_METRICS_PORT):
        ctl.start_metrics_server(Metrics())
    monkeypatch.setenv(ctl.ENV_METRICS_PORT, "0")
    monkeypatch.setenv(ctl.ENV_METRICS_HOST, "127.0.0.1")
    server = ctl.start_metrics_server(Metrics())
    assert server is not None and server.port > 0
    server.close()


# ---- progress from the chief's endpoint


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def running_pods(job: dict, ip: str = "127.0.0.1") -> dict[str, dict]:
    """Every task of ``job`` running, on pod IP ``ip``."""
    pods = {}
    for role, i in (("ps", 0), ("worker", 0), ("worker", 1)):
        pod = with_state(desired_pod(job, role, i, 1), *RUNNING)
        pod["status"]["podIP"] = ip
        pods[pod["metadata"]["name"]] = pod
    return pods


def test_progress_url_is_the_chiefs_or_worker_0s():
    from flowmill.operator.api import TrainingJob

    job = make_job()
    pods = running_pods(job, ip="10.1.2.3")
    parsed = TrainingJob.from_dict(job)
    assert ctl.progress_url(parsed, list(pods.values())) == "http://10.1.2.3:9090/progress"
    # Not while worker 0's pod is not running, is going, or was made without the port.
    for change in ({"status": {"phase": "Pending", "podIP": "10.1.2.3"}},
                   {"status": {"phase": "Running"}},
                   {"metadata": {**pods["mnist-worker-0"]["metadata"],
                                 "deletionTimestamp": format_time(NOW)}}):
        assert ctl.progress_url(parsed, list({**pods, "mnist-worker-0": {
            **pods["mnist-worker-0"], **change}}.values())) is None
    bare = copy.deepcopy(pods)
    container = bare["mnist-worker-0"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "FLOWMILL_METRICS_PORT"]
    assert ctl.progress_url(parsed, list(bare.values())) is None
    # With a chief, the chief's.
    job["spec"]["replicaSpecs"]["chief"] = {"replicas": 1}
    chief = with_state(desired_pod(job, "chief", 0, 1), *RUNNING)
    chief["status"]["podIP"] = "10.1.2.9"
    parsed = TrainingJob.from_dict(job)
    assert ctl.progress_url(parsed, list(pods.values())) is None
    assert ctl.progress_url(parsed, [*pods.values(), chief]) == \
        "http://10.1.2.9:9090/progress"


def test_a_chief_that_does_not_answer_is_read_less_and_less_often(monkeypatch):
    job = make_job()
    job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "metrics", "containerPort": free_port()}]  # nothing listens there
    controller, fake, _, _ = make_controller(job)
    controller.progress_every = 10.0
    reads = []
    monkeypatch.setattr(ctl, "fetch_progress", lambda url, timeout: reads.append(url))
    clock = [100.0]
    monkeypatch.setattr(ctl.time, "monotonic", lambda: clock[0])
    controller.reconcile("ml", "mnist", now=NOW)
    fake.pods = running_pods(fake.job)
    delays = []
    for _ in range(6):
        outcome = controller.reconcile("ml", "mnist", now=NOW)
        delays.append(outcome.requeue_after)
        clock[0] += outcome.requeue_after
    assert delays == [20.0, 40.0, 80.0, 80.0, 80.0, 80.0]
    assert len(reads) == 6
    monkeypatch.setattr(ctl, "fetch_progress", lambda url, timeout: {"step": 1})
    assert controller.reconcile("ml", "mnist", now=NOW).requeue_after == 10.0  # answered


def test_a_running_job_reads_its_progress_from_worker_0():
    from flowmill.runtime import telemetry as tm

    record = tm.Telemetry()
    record.report_step(12, 100, 0.75, 32)
    record.report_checkpoint(10, "s3://bucket/mnist/10")
    server = tm.TelemetryServer(record, "127.0.0.1", 0)
    try:
        job = make_job()
        job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]["ports"] = [
            {"name": "metrics", "containerPort": server.port}]
        controller, fake, _, _ = make_controller(job)
        controller.progress_every = 3600.0
        controller.reconcile("ml", "mnist", now=NOW)
        fake.pods = running_pods(fake.job)
        outcome = controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=5))
        status = fake.job["status"]
        assert status["phase"] == "Running"
        assert status["progress"]["step"] == 12 and status["progress"]["loss"] == 0.75
        assert status["lastCheckpoint"]["step"] == 10
        assert status["lastCheckpoint"]["uri"] == "s3://bucket/mnist/10"
        assert outcome.requeue_after is not None and outcome.requeue_after <= 3600.0
        # Not read again before it is due: the write above brings the job straight back.
        record.report_step(13, 100, 0.5, 32)
        fake.calls.clear()
        outcome = controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=6))
        assert fake.calls == [] and fake.job["status"]["progress"]["step"] == 12
        assert 0 < outcome.requeue_after <= 3600.0
        controller.progress_every = 0.0001
        controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=7))
        assert fake.job["status"]["progress"]["step"] == 13
    finally:
        server.close()
    # The endpoint gone (the fetch fails): what was seen stays.
    time.sleep(0.001)
    controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=8))
    assert fake.job["status"]["progress"]["step"] == 13
    assert fake.job["status"]["lastCheckpoint"]["step"] == 10
    # Reading progress can be turned off.
    controller.progress_every = 0
    assert controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=9)).requeue_after \
        is None


def test_a_stalled_sync_job_s_holder_is_read_off_its_ps_and_its_pod_recreated():
    """Each task serves its own record on its own loopback address, as pods do: both
    workers quiet, the PS's accumulators waiting for worker 1's gradients."""
    from flowmill.runtime import telemetry as tm

    class Clock:
        t = 1000.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    records = {}
    for i in (0, 1):
        records[("worker", i)] = tm.Telemetry(clock)
        records[("worker", i)].report_step(7, 100, 0.5, 32, global_step=7)
    ps = tm.Telemetry(clock)
    ps.set_source(lambda: ({"sync": {"step": 7, "accumulators": 6, "workers": [0],
                                     "waitingTakes": 1}}, []))
    records[("ps", 0)] = ps
    clock.t += 9.0  # nine seconds since the last step of either worker
    first = tm.TelemetryServer(records[("worker", 0)], "127.0.0.2", 0)
    port = first.port
    servers = [first]
    try:
        ips = {("worker", 0): "127.0.0.2", ("worker", 1): "127.0.0.3", ("ps", 0): "127.0.0.4"}
        for key in (("worker", 1), ("ps", 0)):
            servers.append(tm.TelemetryServer(records[key], ips[key], port))
        job = make_job(stallTimeoutSeconds=5)
        job["spec"]["training"] = {"mode": "sync"}
        job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]["ports"] = [
            {"name": "metrics", "containerPort": port}]
        controller, fake, events, _ = make_controller(job)
        controller.progress_every = 0.0001
        controller.reconcile("ml", "mnist", now=NOW)
        pods = running_pods(fake.job)
        for pod in pods.values():
            labels = pod["metadata"]["labels"]
            key = (labels["flowmill.dev/replica-type"], int(labels["flowmill.dev/replica-index"]))
            pod["status"]["podIP"] = ips[key]
            pod["status"]["containerStatuses"][0]["state"] = {
                "running": {"startedAt": format_time(NOW)}}
        fake.pods = pods
        time.sleep(0.001)
        controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=600))
        assert fake.pods["mnist-worker-1"]["metadata"].get("deletionTimestamp")
        assert not fake.pods["mnist-worker-0"]["metadata"].get("deletionTimestamp")
        status = fake.job["status"]
        assert status["restartCount"] == 1 and status["phase"] == "Restarting"
        stalled = [m for _, r, m in events.events if r == "TaskStalled"]
        assert stalled and "worker-1 (pod mnist-worker-1) is stalled: sent no gradients for " \
            "step 7 for 9s while the job waits for them (1 of 2 needed are in) " \
            "(spec.runPolicy.stallTimeoutSeconds 5)" in stalled[0]
    finally:
        for server in servers:
            server.close()


def test_the_jobs_network_policy_admits_its_own_pods_and_the_operator_on_metrics(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "flowmill-system")
    monkeypatch.setenv(ctl.ENV_OPERATOR_LABELS,
                       "app.kubernetes.io/name=flowmill,app.kubernetes.io/instance=fm")
    job = make_job()
    controller, fake, events, _ = make_controller(job)
    controller.reconcile("ml", "mnist", now=NOW)
    policy = fake.policies["mnist"]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == UID
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"flowmill.dev/job-name": "mnist"}}
    assert spec["policyTypes"] == ["Ingress"]
    own, operator = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"flowmill.dev/job-name": "mnist"}}}]}
    assert operator["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "flowmill-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "flowmill",
                                        "app.kubernetes.io/instance": "fm"}}}]
    ports = {metrics_port(job, role) for role in ("ps", "worker")}
    assert operator["ports"] == [{"port": p, "protocol": "TCP"} for p in sorted(ports)]


def test_an_earlier_jobs_network_policy_is_replaced_and_a_refused_one_does_not_block():
    controller, fake, events, _ = make_controller(make_job())
    fake.policies["mnist"] = {"metadata": {"name": "mnist", "ownerReferences": [
        {"uid": "old-uid", "controller": True}]}}
    controller.reconcile("ml", "mnist", now=NOW)
    assert ("delete-network-policy", "mnist") in fake.calls
    assert fake.policies["mnist"]["metadata"]["ownerReferences"][0]["uid"] == UID

    controller, fake, events, _ = make_controller(make_job())
    fake.failures[("create-network-policy", "mnist")] = error(403, "forbidden")
    controller.reconcile("ml", "mnist", now=NOW)
    assert "NetworkPolicyUnavailable" in events.reasons
    assert len(fake.pods) == 3  # the job runs, unfenced


# ---- the job's certificates (spec.security.tls)


def _secret_files(fake: FakeApi, name: str = "mnist-tls") -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in fake.secrets[name]["data"].items()}


def test_each_task_gets_a_certificate_naming_it_and_mounts_only_its_own():
    controller, fake, _, _ = make_controller(make_job())
    controller.reconcile("ml", "mnist", now=NOW)
    files = _secret_files(fake)
    assert sorted(files) == ["ca.crt", "ps-0.crt", "ps-0.key", "worker-0.crt", "worker-0.key",
                             "worker-1.crt", "worker-1.key"]  # the CA's key is not kept
    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    for task in ("ps-0", "worker-0", "worker-1"):
        cert = x509.load_pem_x509_certificate(files[f"{task}.crt"])
        cert.verify_directly_issued_by(ca)
        assert common_name(files[f"{task}.crt"]) == task
        assert cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == [task]
    secret = fake.secrets["mnist-tls"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    assert secret["metadata"]["annotations"]["flowmill.dev/run-generation"] == "0"
    pod = fake.pods["mnist-worker-1"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "flowmill-tls"]
    assert volume["secret"] == {"secretName": "mnist-tls", "items": [
        {"key": "ca.crt", "path": "ca.crt"}, {"key": "worker-1.crt", "path": "tls.crt"},
        {"key": "worker-1.key", "path": "tls.key"}]}
    (main,) = pod["spec"]["containers"]
    assert {"name": "FLOWMILL_TLS_DIR", "value": "/var/run/flowmill/tls"} in main["env"]
    assert {"name": "flowmill-tls", "mountPath": "/var/run/flowmill/tls",
            "readOnly": True} in main["volumeMounts"]


def test_certificates_are_issued_once_per_run_and_rotate_with_a_whole_job_restart():
    job = make_job()
    controller, fake, _, _ = make_controller(job)
    controller.reconcile("ml", "mnist", now=NOW)
    first = _secret_files(fake)["ca.crt"]
    # A recreated worker of the same run keeps trusting its peers: same CA.
    del fake.pods["mnist-worker-1"]
    controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=1))
    controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=2))
    assert "mnist-worker-1" in fake.pods
    assert _secret_files(fake)["ca.crt"] == first
    assert [v for v, _ in fake.calls].count("replace-secret") == 0
    # The ps task fails: the whole job restarts, and the new run gets a new CA.
    fake.pods["mnist-ps-0"] = with_state(fake.pods["mnist-ps-0"], *terminated(137))
    for i in range(3, 8):
        controller.reconcile("ml", "mnist", now=NOW + timedelta(seconds=i))
    assert fake.job["status"]["runGeneration"] >= 1
    assert fake.pods and all(
        int(p["metadata"]["labels"]["flowmill.dev/restart-generation"])
        >= fake.job["status"]["runGeneration"] for p in fake.pods.values())
    files = _secret_files(fake)
    assert files["ca.crt"] != first
    assert fake.secrets["mnist-tls"]["metadata"]["annotations"][
        "flowmill.dev/run-generation"] == str(fake.job["status"]["runGeneration"])
    x509.load_pem_x509_certificate(files["ps-0.crt"]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(files["ca.crt"]))


def test_a_users_secret_of_the_same_name_blocks_the_job_and_an_earlier_jobs_is_replaced():
    controller, fake, events, _ = make_controller(make_job())
    fake.secrets["mnist-tls"] = {"metadata": {"name": "mnist-tls"}, "data": {"x": "eQ=="}}
    with pytest.raises(ctl.Blocked):
        controller.reconcile("ml", "mnist", now=NOW)
    assert "SecretConflict" in events.reasons
    assert fake.secrets["mnist-tls"]["data"] == {"x": "eQ=="}  # left alone
    assert not fake.pods
    fake.secrets["mnist-tls"]["metadata"]["ownerReferences"] = [
        {"kind": "TrainingJob", "uid": "an-earlier-job", "controller": True}]
    controller.reconcile("ml", "mnist", now=NOW)
    assert "ca.crt" in _secret_files(fake) and len(fake.pods) == 3


def test_a_job_without_tls_gets_no_secret_and_no_mount():
    job = make_job()
    job["spec"]["security"] = {"tls": False}
    controller, fake, _, _ = make_controller(job)
    controller.reconcile("ml", "mnist", now=NOW)
    assert fake.secrets == {} and len(fake.pods) == 3
    (main,) = fake.pods["mnist-worker-0"]["spec"]["containers"]
    assert "FLOWMILL_TLS_DIR" not in {e["name"] for e in main["env"]}
    assert "volumes" not in fake.pods["mnist-worker-0"]["spec"]
