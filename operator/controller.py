"""The TrainingJob controller: kopf handlers over ``status.observe`` and ``status.decide``.

Run as ``python -m flowmill.operator --standalone --all-namespaces`` (or
``--namespace=...``), which is ``kopf run -m flowmill.operator.controller`` without the
official Kubernetes client (``__main__.py``); the Helm chart does. The handlers only queue
work; every decision comes from the pure functions in ``status.py``.

Why it is built this way:

- Level-triggered. A reconcile looks at the whole job, its pods and its status, never at
  what an event says changed: events only say *which* job to look at. It reads them from
  the watches' store (``store.py``), where its own writes are laid over the watch until
  the watch catches up, so in the steady state a reconcile costs only its writes. The
  pods are read afresh by one LIST per namespace when the process starts and every
  resync period, and a job's own (and the job) after a write refused as stale. Any event
  of a TrainingJob, or of a pod or Kueue Workload labelled ``flowmill.dev/job-name``,
  queues its job (``workqueue.py``: a job whose pod ended first, new jobs last;
  ``workloads.py`` reads and answers Kueue).
  Restarting the operator loses nothing: at start kopf lists every job, each is
  reconciled, and deadlines and TTLs are recomputed from status timestamps.
- Only ``@kopf.on.event`` handlers: no create/update/delete handlers, no timers or
  daemons. So kopf keeps no progress or diff-base annotations on the job, and adds no
  finalizer: deleting a job never waits for the operator (which may be down), and its
  pods and Services go by garbage collection of their ownerReferences. Requeues (a
  deadline or TTL falling due, a periodic resync, back-off after an error, the next
  reading of a running job's progress) are timers in the operator's own event loop; none
  has to survive a restart, for the reason above.
- Progress rides on the reconcile: while a job runs, a reconcile reads its chief's
  ``/progress`` endpoint (by pod IP, with a short timeout) at most every
  ``FLOWMILL_PROGRESS_SECONDS`` into ``status.progress`` and ``status.lastCheckpoint``
  (``status.with_progress``). A failed read changes nothing. The same read judges a
  stall (``stall.py``): when the chief has made no step for the stall timeout (or in a
  mode where a worker can hang alone: async, bounded-staleness, sync with backup
  workers), every running training task's ``/progress`` is read, and, when one is quiet,
  the PS tasks' (their sync state names the worker that sent no gradients); ``decide``
  restarts the tasks holding the job up under their restart policy.
- Status first, with the job's resourceVersion as a precondition. The restart budget
  lives in ``status.restartCount``; writing it before deleting or creating pods means a
  crash in between repeats an action rather than losing its count, and a conflict (the
  spec changed, another writer) throws the decision away and reconciles again, so no
  restart is counted twice.
- One reconcile per job at a time; events arriving meanwhile fold into one more run. A
  reconcile takes the next decision at once when its deletions took effect at once (a
  failed pod has no grace period), so a dead task's replacement is created in the same
  reconcile that counted its failure.
- Creating pods is idempotent: names are deterministic (``<job>-<role>-<index>``), and
  409 AlreadyExists means the pod is there. ps pods are created first and creation stops
  at the first error, so workers never start without their ps tasks.

The operator reads no Secrets: pods name them with ``secretKeyRef``. Nothing here logs a
pod manifest or an API response body, only names, reasons and the API's status message.

The module is long because it is the one place that talks to the API server: the
handlers, one reconcile's reads and writes (status, pods, Services, the job's
NetworkPolicy; its Events go through ``events.py``), the progress reads and the
process's settings; what to do is
decided elsewhere (``status.py``, ``stall.py``), which job goes next in ``workqueue.py``,
the connection and its rate limit in ``apiclient.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf

from flowmill.runtime.addresses import format_address
from flowmill.runtime.cluster import ENV_METRICS_PORT as ENV_TASK_METRICS_PORT
from flowmill.runtime.cluster import PROGRESS_PATH, fetch_progress, identity

from .api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    SpecError,
    TrainingJob,
    main_container_index,
)
from .apiclient import ApiError, Kube, connection_info, load_credentials, path, rate_limit_from_env
from .certificates import new_run
from .errors import Blocked, Conflict, api_error
from .events import Recorder, truncate
from .manifests import (
    ANNOTATION_CA,
    ANNOTATION_RUN,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    POD_GROUP_GROUP,
    POD_GROUP_PLURAL,
    POD_GROUP_VERSION,
    desired_network_policy,
    desired_pod_group,
    desired_services,
    desired_tls_secrets,
    tls_secret_names,
)
from .metrics import Metrics, MetricsServer
from .queueing import KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL, queue_name
from .stall import Stalled, TaskProgress, describe_timeout, holders, quiet_tasks, stall_timeout
from .status import (
    FINISHED,
    Action,
    Status,
    decide,
    observe,
    parse_time,
    task_pods,
    with_progress,
)
from .store import Store, compact
from .workloads import Workloads
from .workqueue import DEFAULT_WORKERS, NEW, NORMAL, URGENT, Scheduler

log = logging.getLogger("flowmill.operator")

# The operator pods' own labels ("k=v,k=v"), which the chart passes: the jobs'
# NetworkPolicies let pods with them read the tasks' metrics.
ENV_OPERATOR_LABELS = "FLOWMILL_OPERATOR_LABELS"


def parse_labels(text: str) -> dict[str, str]:
    """``"a=b,c=d"`` as a dict; entries without ``=`` are ignored."""
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs if k.strip()}

# kopf's own marks (progress, diff-base, finalizer) under our API group, not kopf.zalando.org.
PREFIX = GROUP
FINALIZER = f"{PREFIX}/finalizer"

ENV_METRICS_PORT = "FLOWMILL_METRICS_PORT"  # "off" disables; 0 picks a free port
ENV_METRICS_HOST = "FLOWMILL_METRICS_HOST"
ENV_RESYNC = "FLOWMILL_RESYNC_SECONDS"
ENV_PROGRESS = "FLOWMILL_PROGRESS_SECONDS"  # 0 never reads a job's progress
ENV_WORKERS = "FLOWMILL_RECONCILE_WORKERS"  # reconciles at once (threads, requests in flight)
DEFAULT_METRICS_PORT = 9090
DEFAULT_RESYNC_SECONDS = 300.0
# A running job's progress is read from its chief this often, within this time.
DEFAULT_PROGRESS_SECONDS = 10.0
PROGRESS_TIMEOUT = 2.0
PROGRESS_BACKOFF = 8  # a chief that does not answer is read at most this many times less

REQUEST_TIMEOUT = 30.0  # seconds, for every API call a reconcile makes
MAX_ROUNDS = 3  # decisions taken in one reconcile, while deletions take effect at once


# ---- pure helpers


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff-base: kopf builds one for every watch event (a deep copy of the object, the
    "essence" its change handlers compare), but this operator has event handlers only, so
    nothing reads it; building it was over a third of kopf's CPU per event. Nothing is
    stored on the objects either."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> None:  # type: ignore[override]
        return None

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def configure(settings: kopf.OperatorSettings) -> None:
    """Production settings (see NOTES: kopf)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.persistence.finalizer = FINALIZER
    # Without client-side limits a watch can hang silently and handlers stop (kopf#585).
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = 30
    # Only the pods of TrainingJobs travel over the watch, not every pod in scope.
    settings.watching.label_selectors["", "v1", "pods"] = LABEL_JOB
    # Memory at start and in bursts. kopf lists what exists in one response unless told
    # otherwise, and hands each listed object, parsed whole, to a worker of its own; each
    # worker keeps its latest event until it has been idle this long (5 s by default).
    # With a thousand jobs and pods at start, pages of 100 (not 500, client-go's) left
    # the restarted operator at 99 MB instead of 111-134. The handlers only queue work,
    # so a worker made again costs less than one kept.
    settings.watching.chunk_size = 100
    settings.queueing.idle_timeout = 0.5
    # kopf's own log lines become Events only from warnings up; the controller posts its
    # Events itself (events.py).
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "flowmill-operator"
    # kopf logs "Handler ... succeeded" for every watch event (a thousand jobs: ten
    # thousand lines); the controller logs what it does. With --verbose or --debug they
    # stay.
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


def job_of(meta: Mapping[str, Any]) -> str | None:
    """The TrainingJob a pod (or Workload) belongs to: its controlling owner, else its job
    label."""
    for ref in meta.get("ownerReferences") or ():
        if (ref.get("controller") and ref.get("kind") == KIND
                and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")):
            return ref.get("name")
    return (meta.get("labels") or {}).get(LABEL_JOB)


def pod_priority(event_type: str | None, pod: Mapping[str, Any]) -> int:
    """How soon a pod's event should reconcile its job: first when the pod ended, is
    going or went (a task to replace, a job to restart or finish), else in turn."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if event_type == "DELETED" or meta.get("deletionTimestamp") \
            or status.get("phase") in ("Failed", "Succeeded"):
        return URGENT
    if any("terminated" in (c.get("state") or {}) for c in status.get("containerStatuses") or ()):
        return URGENT
    return NORMAL


def status_body(old: Mapping[str, Any], new: Status) -> dict[str, Any]:
    """The status to write: ``new`` in full, plus what kopf may keep under ``status.kopf``."""
    body = new.to_dict()
    if "kopf" in old:
        body["kopf"] = old["kopf"]
    return body


def events_for(old_phase: str | None, action: Action) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events a decision calls for: one per phase
    transition, and one for what the action does unless that says the same. A job that
    becomes Pending as its pods are created gets one Event: the creation says why."""
    out: list[tuple[str, str, str]] = []
    new_phase = action.status.phase
    if new_phase is not None and new_phase != old_phase:
        # Pending has no condition of its own: Running (False) says why.
        cond = action.status.condition(new_phase) or action.status.condition("Running")
        reason = (cond.reason if cond else "") or new_phase
        detail = (cond.message if cond else "") or ""
        transition = f"phase {old_phase or '(none)'} -> {new_phase}"
        if action.kind == "create" and reason == "TasksPending":
            return [("Normal", action.reason, truncate(f"{transition}: {action.message}"))]
        message = transition + (f": {detail}" if detail else "")
        warning = new_phase == "Failed" or (new_phase == "Restarting" and action.warning)
        out.append(("Warning" if warning else "Normal", reason, message))
    if action.kind != "wait" and action.reason and all(r != action.reason for _, r, _ in out):
        out.append(("Warning" if action.warning else "Normal", action.reason, action.message))
    return [(t, r, truncate(m)) for t, r, m in out]


def admission_events(old: Mapping[str, Any], new: Status) -> list[tuple[str, str, str]]:
    """The Events of a queued job's way through Kueue: Queued when it starts to wait for
    quota (again), Admitted when it may run. (An eviction is the action's own Event.)"""
    before = Status.from_dict(old)
    out = []
    for type in ("Queued", "Admitted"):
        cond, was = new.condition(type), before.condition(type)
        if cond is not None and cond.status == "True" and (was is None or was.status != "True"):
            out.append(("Normal", type, cond.message))
    return out


def endpoint(pod: Mapping[str, Any]) -> str | None:
    """The base URL of a running pod's task endpoints (``/progress``, ``/metrics``): its IP
    and the port its task container was given in ``FLOWMILL_METRICS_PORT``. None while it
    is not running or has no such port (a pod from before the port was given)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" \
            or not status.get("podIP"):
        return None
    spec = pod.get("spec") or {}
    if not spec.get("containers"):
        return None
    container = spec["containers"][main_container_index(pod)]
    port = next((e.get("value") for e in container.get("env") or ()
                 if e.get("name") == ENV_TASK_METRICS_PORT), None)
    if isinstance(port, str) and port.isdigit() and 0 < int(port) < 65536:
        return f"http://{format_address(status['podIP'], int(port))}"
    return None


def task_endpoints(job: TrainingJob, pods: Sequence[Mapping[str, Any]]
                   ) -> dict[tuple[str, int], str]:
    """(role, index) -> endpoint base URL, for every running pod of the job's current tasks."""
    out = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_JOB) != job.name:
            continue
        url = endpoint(pod)
        index = labels.get(LABEL_INDEX, "")
        if url is not None and index.isdigit():
            out[(labels.get(LABEL_ROLE), int(index))] = url
    return out


def progress_url(job: TrainingJob, pods: Sequence[Mapping[str, Any]]) -> str | None:
    """Where the chief (or, without one, worker 0) serves its progress; None while it has
    no running pod with the port."""
    role = "chief" if job.spec.replica_specs.replicas("chief") else "worker"
    base = task_endpoints(job, pods).get((role, 0))
    return None if base is None else base + PROGRESS_PATH


def running_seconds(job: TrainingJob, pods: Sequence[Mapping[str, Any]],
                    now: datetime) -> dict[tuple[str, int], float]:
    """How long each running task's container has run."""
    out = {}
    for t in task_pods(job, pods):
        started = parse_time(t.started_at) if t.state == "running" and t.live else None
        if started is not None:
            out[(t.role, t.index)] = max(0.0, (now - started).total_seconds())
    return out


def reads_every_task(job: TrainingJob) -> bool:
    """Whether a worker can hang while the chief still steps (async, bounded staleness,
    sync with backup workers): then every task is read, not only the chief."""
    training = job.spec.training
    return training.mode != "sync" or training.backup_workers > 0


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def deleted_at_once(pod: Mapping[str, Any]) -> bool:
    """Whether a DELETE's response says the pod is gone already: no grace period to wait
    out (it was not running, or was asked to go now) and no finalizer to wait for."""
    meta = pod.get("metadata") or {}
    if meta.get("finalizers"):
        return False
    return not meta.get("deletionTimestamp") or not meta.get("deletionGracePeriodSeconds")


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return ref.get("uid")
    return None


# ---- one reconcile (blocking API calls; runs in a worker thread)


@dataclass(frozen=True)
class Outcome:
    phase: str | None
    requeue_after: float | None
    gone: bool = False


class JobController:
    """Reads a job and its pods, calls observe + decide, and applies the action."""

    def __init__(self, api: Kube, metrics: Metrics,
                 post: Callable[[Mapping[str, Any], str, str, str], None],
                 progress_every: float = DEFAULT_PROGRESS_SECONDS,
                 store: Store | None = None) -> None:
        self.store = store or Store(job_of)
        # Jobs whose Services and NetworkPolicy (for the job's uid), certificates and
        # PodGroup (for the run) were made or found since their pods were last read
        # afresh: a pod recreated later needs no request for them.
        self._ensured: dict[tuple[str, str], tuple[str, int]] = {}  # job -> (uid, run)
        self.api = api
        self._namespace_locks: dict[str, threading.Lock] = {}
        # Who the jobs' NetworkPolicies let read the tasks' metrics: this operator's pods
        # (the chart passes their labels and the namespace they run in).
        self.operator_namespace = os.environ.get("POD_NAMESPACE") or None
        self.operator_labels = parse_labels(os.environ.get(ENV_OPERATOR_LABELS, ""))
        self.metrics = metrics
        self.post = post
        self.progress_every = progress_every
        # job -> (monotonic time of its last read, reads unanswered in a row)
        self._progress_read: dict[tuple[str, str], tuple[float, int]] = {}
        self.workloads = Workloads(api, post)

    def reconcile(self, namespace: str, name: str, now: datetime | None = None) -> Outcome:
        """Bring the job one step on, or a few: when a round's deletions took effect at
        once (a failed pod is deleted without grace), the next round creates the
        replacements without waiting for the watch to say they are gone."""
        outcome, again = self._round(namespace, name, now)
        for _ in range(MAX_ROUNDS - 1):
            if not again:
                break
            outcome, again = self._round(namespace, name, None)
        return outcome

    def _round(self, namespace: str, name: str, now: datetime | None) -> tuple[Outcome, bool]:
        raw = self._read_job(namespace, name)
        if raw is None:
            self._progress_read.pop((namespace, name), None)
            self._ensured.pop((namespace, name), None)
            self.store.forget(namespace, name)
            return Outcome(None, None, gone=True), False
        old = raw.get("status") or {}
        old_phase = old.get("phase")
        try:
            job = TrainingJob.from_dict(raw)
        except SpecError as e:
            # The API server validated it; this is a schema the operator does not know.
            self.metrics.count_error()
            self.post(raw, "Warning", "InvalidSpec", str(e))
            log.warning("TrainingJob %s/%s: invalid spec: %s", namespace, name, e)
            return Outcome(old_phase, None), False
        if job.deleting:
            return Outcome(old_phase, None), False
        pods = self._read_pods(namespace, name)
        admission, workload = (self.workloads.admission(raw, job) if queue_name(job)
                               else (None, None))
        now = now or datetime.now(UTC)
        status, progress_due, stalled = self._with_progress(
            job, pods, observe(job, pods, now, admission), now)
        action = decide(job, pods, status, now, stalled, admission)

        # 1. status (the restart count) first
        written = self._write_status(raw, old, action.status)
        for type, reason, message in (events_for(old_phase, action)
                                      + admission_events(old, action.status)):
            self.post(raw, type, reason, message)
        if written and action.kind in ("recreate", "restart_job"):
            n = action.status.restart_count - Status.from_dict(old).restart_count
            if n > 0:
                self.metrics.count_restarts("task" if action.kind == "recreate" else "job", n)
        if action.kind != "wait" or written:
            log.info("TrainingJob %s/%s: %s, phase %s%s", namespace, name, action.kind,
                     action.status.phase, f" ({action.reason})" if action.reason else "")
        # 2. pods to delete, 3. Services and pods to create, 4. the job itself
        gone = self._delete_pods(namespace, name, action.delete)
        if action.create:
            run = (job.uid, action.status.run_generation)
            done = self._ensured.get((namespace, name))
            if done is None or done[0] != job.uid:
                self._ensure_services(raw, job)
                self._ensure_network_policy(raw, job)
            if done != run:
                self._ensure_credentials(raw, job, action.status.run_generation,
                                         first=Status.from_dict(old).start_time is None)
                self._ensure_pod_group(raw, job)
            self._ensured[(namespace, name)] = run
            self._create_pods(raw, action.create)
        if admission is not None:  # 5. Kueue told what became of the job
            self.workloads.answer(job, workload, admission, action.status, pods)
        if action.delete_job:
            self._delete_job(job)
            return Outcome(action.status.phase, None, gone=True), False
        again = bool(action.delete) and gone and not action.create \
            and action.status.phase not in FINISHED
        return Outcome(action.status.phase, _sooner(action.requeue_after, progress_due)), again

    def _with_progress(self, job: TrainingJob, pods: Sequence[Mapping[str, Any]],
                       status: Status, now: datetime
                       ) -> tuple[Status, float | None, list[Stalled]]:
        """While the job runs: its chief's progress, read at most every ``progress_every``
        seconds (the status write it causes brings the job back at once, and must not read
        again); in how many seconds to read it next; and the tasks holding it up, if it
        has stalled. A chief that does not answer is asked half as often each time, down
        to once every ``PROGRESS_BACKOFF`` periods, until it answers again: a thousand
        jobs whose tasks serve no progress cost a thousand reads a minute, not six."""
        key = (job.namespace, job.name)
        url = progress_url(job, pods) if status.phase == "Running" else None
        if url is None or self.progress_every <= 0:
            self._progress_read.pop(key, None)
            return status, None, []
        clock = time.monotonic()
        last, misses = self._progress_read.get(key, (None, 0))
        every = self.progress_every * min(2 ** misses, PROGRESS_BACKOFF)
        if last is not None and clock - last < every:
            return status, last + every - clock, []
        chief = fetch_progress(url, PROGRESS_TIMEOUT)
        misses = 0 if chief is not None else min(misses + 1, PROGRESS_BACKOFF)
        every = self.progress_every * min(2 ** misses, PROGRESS_BACKOFF)
        self._progress_read[key] = (clock, misses)
        stalled = self._stalled(job, pods, chief, now)
        return with_progress(status, chief), every, stalled

    def _stalled(self, job: TrainingJob, pods: Sequence[Mapping[str, Any]],
                 chief: Mapping[str, Any] | None, now: datetime) -> list[Stalled]:
        """The tasks holding a stalled job up (``stall.holders``), read from the tasks'
        endpoints: the others only when the chief is quiet or a worker can hang alone."""
        spec = job.spec
        replicas = spec.training_tasks()
        running = running_seconds(job, pods, now)
        configured = spec.run_policy.stall_timeout_seconds
        views = {}
        first = replicas[0]
        if first in running:
            views[first] = TaskProgress(*first, running[first], chief)
            if not reads_every_task(job) and \
                    not quiet_tasks([views[first]], stall_timeout(configured, [views[first]])):
                return []
        endpoints = task_endpoints(job, pods)  # read only past the chief's check
        for key in replicas[1:]:
            if key in running and key in endpoints:
                views[key] = TaskProgress(*key, running[key],
                                          fetch_progress(endpoints[key] + PROGRESS_PATH,
                                                         PROGRESS_TIMEOUT))
        tasks = list(views.values())
        timeout = stall_timeout(configured, tasks)
        if not quiet_tasks(tasks, timeout):
            return []
        coordination = []
        if spec.training.mode != "async":
            coordination = [fetch_progress(endpoints[(role, i)] + PROGRESS_PATH,
                                           PROGRESS_TIMEOUT)
                            if (role, i) in endpoints else None
                            for role, i in spec.tasks() if role == "ps"]
        found = holders(spec.training.mode, replicas, tasks, coordination, timeout,
                        spec.training.backup_workers)
        limit = describe_timeout(configured, timeout)
        return [Stalled(s.role, s.index, f"{s.reason} ({limit})") for s in found]

    def _read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The job from the store; read afresh when the store has not seen it or a write
        found it behind."""
        raw = self.store.job(namespace, name)
        if raw is not None and not self.store.stale(namespace, name):
            return raw
        try:
            raw = self.api.get(path(API_VERSION, PLURAL, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        self.store.put_job(raw)
        return self.store.job(namespace, name)

    def _read_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """The job's pods from the store; one LIST when the store has not read them yet
        (a new job, a new process), when that read is older than the refill period, or
        after a write was refused as stale."""
        pods = self.store.pods(namespace, name)
        if pods is not None:
            return pods
        self._ensured.pop((namespace, name), None)  # look at its Services again, too
        if self.store.namespace_due(namespace):
            # One LIST of every job's pods in the namespace (a new process, the periodic
            # fresh read): the other reconciles of the namespace wait for it.
            with self._namespace_locks.setdefault(namespace, threading.Lock()):
                if self.store.namespace_due(namespace):
                    self.store.fill_namespace(namespace, self.api.list(
                        path("v1", "pods", namespace), compact, labelSelector=LABEL_JOB))
            pods = self.store.pods(namespace, name)
            if pods is not None:
                return pods
        return self.store.fill(namespace, name, self.api.get(
            path("v1", "pods", namespace), labelSelector=f"{LABEL_JOB}={name}"))

    def _write_status(self, raw: Mapping[str, Any], old: Mapping[str, Any],
                      status: Status) -> bool:
        new = status_body(old, status)
        if new == old:
            return False
        meta = raw["metadata"]
        # The whole object with metadata.resourceVersion: a precondition. The status
        # subresource takes only .status from it.
        body = {**raw, "status": new}
        try:
            written = self.api.replace(
                path(API_VERSION, PLURAL, meta["namespace"], meta["name"], "status"), body)
        except ApiError as e:
            if e.status in (404, 409):
                # Written on a stale read: read the job and its pods afresh next time.
                self.store.unfill(meta["namespace"], meta["name"])
                raise Conflict(api_error(e)) from None
            raise
        self.store.put_job(written)
        return True

    def _delete_pods(self, namespace: str, job: str, names: Sequence[str]) -> bool:
        """Delete the pods; whether every one is gone at once (a pod that is not running,
        Failed or Succeeded or never bound, is deleted without grace)."""
        gone = True
        for pod in names:
            try:
                obj = self.api.delete(path("v1", "pods", namespace, pod))
            except ApiError as e:
                if e.status != 404:
                    raise
                self.store.unfill(namespace, job)  # the store thought it was there
                gone = False
                continue
            self.metrics.count_pods(deleted=1)
            if obj.get("kind") != "Pod" or "metadata" not in obj:
                gone = False  # a Status body: the pod goes, but not known how soon
            elif deleted_at_once(obj):
                self.store.drop_pod(obj)
            else:
                self.store.put_pod(obj)
                gone = False
        return gone

    def _ensure_services(self, raw: Mapping[str, Any], job: TrainingJob) -> None:
        """Every task's Service, owned by this job, before any pod starts.

        Created first, read only when one exists: a new job costs a create per Service. A
        Service of the same name left by an earlier job of the same name is deleted
        (garbage collection would do so later, leaving the task without one)."""
        taken = []
        for svc in desired_services(job):
            try:
                self.api.create(path("v1", "services", job.namespace), svc)
            except ApiError as e:
                if e.status != 409:
                    self._blocked(raw, "FailedCreateService",
                                  f"Service {svc['metadata']['name']}", e)
                taken.append(svc["metadata"]["name"])
        if not taken:
            return
        listing = self.api.get(path("v1", "services", job.namespace),
                               labelSelector=f"{LABEL_JOB}={job.name}")
        have = {s["metadata"]["name"]: s for s in listing.get("items") or ()}
        waiting = []
        for name in taken:
            existing = have.get(name)
            if existing is not None and _controller_uid(existing) == job.uid:
                continue
            if existing is not None and not existing["metadata"].get("deletionTimestamp"):
                self._delete_service(job.namespace, name)
            waiting.append(name)  # an earlier job's, or not labelled as this job's
        if waiting:
            message = (f"waiting for Service(s) {', '.join(waiting[:3])} of an earlier job "
                       "(or not labelled as this job's) to go before creating pods")
            self.post(raw, "Warning", "ServiceConflict", message)
            raise Blocked(message)

    def _ensure_network_policy(self, raw: Mapping[str, Any], job: TrainingJob) -> None:
        """The job's NetworkPolicy, before its pods (one of an earlier job of the same name
        is replaced). A cluster without the API, or an operator not allowed to make one,
        gets a Warning Event and the job runs unfenced: the policy is a fence, not a
        precondition. Created first, read only when one exists."""
        policy = desired_network_policy(job, self.operator_namespace, self.operator_labels)
        name = policy["metadata"]["name"]
        policies = path("networking.k8s.io/v1", "networkpolicies", job.namespace)
        try:
            try:
                self.api.create(policies, policy)
                return
            except ApiError as e:
                if e.status != 409:
                    raise
            existing = self.api.get(path("networking.k8s.io/v1", "networkpolicies",
                                         job.namespace, name))
            if _controller_uid(existing) == job.uid:
                return
            self.api.delete(path("networking.k8s.io/v1", "networkpolicies", job.namespace, name))
            self.api.create(policies, policy)
        except ApiError as e:
            if e.status == 409:  # made meanwhile (another reconcile of the job)
                return
            if e.status in (403, 404):
                self.post(raw, "Warning", "NetworkPolicyUnavailable",
                          f"cannot create NetworkPolicy {name}: {api_error(e)}; the job's "
                          "tasks take traffic from anywhere the network allows")
                return
            raise

    def _ensure_credentials(self, raw: Mapping[str, Any], job: TrainingJob,
                            run_generation: int, first: bool = False) -> None:
        """With spec.security.tls, this run's CA and task certificates in the job's
        Secret(s), before its pods. They are issued anew when the Secrets belong to an
        earlier run (a whole-job restart or a resume rotates them: the earlier run's
        certificates are trusted no more) or do not agree on their CA (a crash half-way
        through writing them). Read first, except for a job's ``first`` pods: then they
        are created, and read only if one exists already."""
        if not job.spec.security.tls:
            return
        if first and self._create_credentials(raw, job, run_generation):
            return
        existing: dict[str, dict[str, Any] | None] = {}
        for name in tls_secret_names(job):
            try:
                existing[name] = self.api.get(path("v1", "secrets", job.namespace, name))
            except ApiError as e:
                if e.status != 404:
                    self._blocked(raw, "FailedCreateSecret", f"Secret {name}", e)
                existing[name] = None
        foreign = []
        for name, sec in existing.items():
            refs = [r for r in (sec or {}).get("metadata", {}).get("ownerReferences") or ()
                    if r.get("controller")]
            if sec is None or any(r.get("uid") == job.uid for r in refs):
                continue
            if any(r.get("kind") == KIND for r in refs):  # an earlier job's of the same name
                self._delete_secret(job.namespace, name)
                existing[name] = None
            else:
                foreign.append(name)
        if foreign:
            message = (f"Secret {foreign[0]} exists and is not this job's: the job's "
                       "certificates cannot be written there (delete or rename it)")
            self.post(raw, "Warning", "SecretConflict", message)
            raise Blocked(message)
        notes = [(sec["metadata"].get("annotations") or {}) if sec is not None else {}
                 for sec in existing.values()]
        if (all(n.get(ANNOTATION_RUN) == str(run_generation) for n in notes)
                and len({n.get(ANNOTATION_CA) for n in notes}) == 1):
            return
        authority, issued = new_run(job.name, (identity(role, i) for role, i in job.spec.tasks()))
        for secret in desired_tls_secrets(job, run_generation, authority.cert, issued):
            name = secret["metadata"]["name"]
            have = existing[name]
            try:
                if have is None:
                    self.api.create(path("v1", "secrets", job.namespace), secret)
                else:
                    secret["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
                    self.api.replace(path("v1", "secrets", job.namespace, name), secret)
            except ApiError as e:
                # 409: written meanwhile by another reconcile; the next one looks again.
                self._blocked(raw, "FailedCreateSecret", f"Secret {name}", e)
        log.info("TrainingJob %s/%s: issued certificates for run %d (%d tasks)",
                 job.namespace, job.name, run_generation, len(issued))

    def _create_credentials(self, raw: Mapping[str, Any], job: TrainingJob,
                            run_generation: int) -> bool:
        """Issue and create the run's Secrets; False when one exists (not this call's)."""
        authority, issued = new_run(job.name, (identity(role, i) for role, i in job.spec.tasks()))
        for secret in desired_tls_secrets(job, run_generation, authority.cert, issued):
            try:
                self.api.create(path("v1", "secrets", job.namespace), secret)
            except ApiError as e:
                if e.status == 409:
                    return False
                self._blocked(raw, "FailedCreateSecret", f"Secret {secret['metadata']['name']}",
                              e)
        log.info("TrainingJob %s/%s: issued certificates for run %d (%d tasks)",
                 job.namespace, job.name, run_generation, len(issued))
        return True

    def _ensure_pod_group(self, raw: Mapping[str, Any], job: TrainingJob) -> None:
        """With runPolicy.gangScheduling, the job's PodGroup before its pods; one of an
        earlier job of the same name, or of other tasks (replicaSpecs changed between
        runs), is replaced. Read first: most reconciles that create pods find it."""
        if not job.spec.run_policy.gang_scheduling:
            return
        want = desired_pod_group(job)
        groups = path(f"{POD_GROUP_GROUP}/{POD_GROUP_VERSION}", POD_GROUP_PLURAL, job.namespace)
        try:
            have: dict[str, Any] | None = self.api.get(f"{groups}/{job.name}")
        except ApiError as e:
            if e.status != 404:
                self._blocked(raw, "FailedCreatePodGroup", f"PodGroup {job.name}", e)
            have = None
        if have is not None:
            refs = [r for r in have["metadata"].get("ownerReferences") or ()
                    if r.get("controller")]
            if not any(r.get("kind") == KIND for r in refs):
                message = (f"PodGroup {job.name} exists and is not this job's: the job's "
                           "pods cannot be scheduled as a gang (delete or rename it)")
                self.post(raw, "Warning", "PodGroupConflict", message)
                raise Blocked(message)
            if any(r.get("uid") == job.uid for r in refs) and \
                    have.get("spec", {}).get("schedulingPolicy") == \
                    want["spec"]["schedulingPolicy"]:
                return
            try:
                self.api.delete(f"{groups}/{job.name}")
            except ApiError as e:
                if e.status != 404:
                    raise
        try:
            self.api.create(groups, want)
        except ApiError as e:
            # 409: the old one still finalizing, or made meanwhile: the next reconcile looks
            # again.
            self._blocked(raw, "FailedCreatePodGroup", f"PodGroup {job.name}", e)

    def _delete_secret(self, namespace: str, name: str) -> None:
        self._delete(path("v1", "secrets", namespace, name))

    def _delete_service(self, namespace: str, name: str) -> None:
        self._delete(path("v1", "services", namespace, name))

    def _delete(self, where: str) -> None:
        try:
            self.api.delete(where)
        except ApiError as e:
            if e.status != 404:
                raise

    def _create_pods(self, raw: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> None:
        for pod in pods:
            meta = pod["metadata"]
            try:
                made = self.api.create(path("v1", "pods", meta["namespace"]), pod)
            except ApiError as e:
                if e.status == 409:
                    # Already there (an earlier run of this decision made it) though the
                    # store did not show it: read the job's pods afresh next time.
                    self.store.unfill(meta["namespace"], raw["metadata"]["name"])
                    continue
                self._blocked(raw, "FailedCreatePod", f"pod {meta['name']}", e)
            else:
                self.metrics.count_pods(created=1)
                self.store.put_pod(made)

    def _blocked(self, raw: Mapping[str, Any], reason: str, what: str,
                 e: ApiError) -> None:
        message = f"cannot create {what}: {api_error(e)}"
        self.post(raw, "Warning", reason, message)
        raise Blocked(message) from None

    def _delete_job(self, job: TrainingJob) -> None:
        # The uid precondition: never delete a newer job that took the name meanwhile.
        options = {"apiVersion": "v1", "kind": "DeleteOptions",
                   "preconditions": {"uid": job.uid}, "propagationPolicy": "Background"}
        try:
            self.api.delete(path(API_VERSION, PLURAL, job.namespace, job.name), options)
        except ApiError as e:
            if e.status not in (404, 409):
                raise


# ---- wiring


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, got {text!r}")
    return int(text)


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None


def start_metrics_server(metrics: Metrics) -> MetricsServer | None:
    port = os.environ.get(ENV_METRICS_PORT, str(DEFAULT_METRICS_PORT)).strip()
    if port.lower() == "off":
        return None
    if not port.isdigit():
        raise ValueError(f"{ENV_METRICS_PORT} must be a port number or 'off', got {port!r}")
    host = os.environ.get(ENV_METRICS_HOST, "0.0.0.0")
    server = MetricsServer(metrics, host, int(port))
    log.info("serving Prometheus metrics on http://%s:%d/metrics", host, server.port)
    return server


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    api = Kube(await asyncio.to_thread(load_credentials), rate_limit_from_env(),
               timeout=REQUEST_TIMEOUT)
    metrics = Metrics()
    memo.metrics_server = start_metrics_server(metrics)
    resync = _env_float(ENV_RESYNC, DEFAULT_RESYNC_SECONDS)
    store = memo.store = Store(job_of, refill_after=resync if resync > 0 else 300.0)
    # Events have a connection and a rate limit of their own: under a burst of new jobs
    # they would otherwise wait behind every reconcile's writes (client-go's recorders
    # have their own client, too).
    recorder = memo.recorder = Recorder(Kube(api.creds, rate_limit_from_env(),
                                             timeout=REQUEST_TIMEOUT))
    controller = JobController(api, metrics, recorder.post, progress_every=_env_float(
        ENV_PROGRESS, DEFAULT_PROGRESS_SECONDS), store=store)
    memo.scheduler = Scheduler(controller, metrics, resync,
                               workers=_env_int(ENV_WORKERS, DEFAULT_WORKERS))
    memo.api = api


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(load_credentials(), settings)


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    scheduler = memo.get("scheduler")
    if scheduler is not None:
        await scheduler.close()
    recorder = memo.get("recorder")
    if recorder is not None:
        await asyncio.to_thread(recorder.close)
    server = memo.get("metrics_server")
    if server is not None:
        server.close()
    api = memo.get("api")
    if api is not None:
        api.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(event: kopf.RawEvent, name: str, namespace: str, memo: kopf.Memo,
                    **_: Any) -> None:
    # Deleted too: the reconcile finds it gone and forgets it (after any in flight).
    known = memo.store.job(namespace, name) is not None
    if event["type"] == "DELETED":
        memo.store.drop_job(event["object"])  # the reconcile finds it gone either way
    elif not memo.store.put_job(event["object"]):
        return  # the echo of this operator's own write: reconciled already
    memo.scheduler.poke(namespace, name, NORMAL if known else NEW)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(event: kopf.RawEvent, meta: Mapping[str, Any], namespace: str,
                    memo: kopf.Memo, **_: Any) -> None:
    job = job_of(meta)
    if not job:
        return
    news = (memo.store.drop_pod(event["object"]) if event["type"] == "DELETED"
            else memo.store.put_pod(event["object"]))
    if news:  # not the echo of this operator's own create or deletion
        memo.scheduler.poke(namespace, job, pod_priority(event["type"], event["object"]))


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL, labels={LABEL_JOB: kopf.PRESENT})
async def workload_event(meta: Mapping[str, Any], namespace: str, memo: kopf.Memo,
                         **_: Any) -> None:
    """Kueue admitted, evicted or requeued a queued job's Workload (served only where
    Kueue's API is installed)."""
    job = job_of(meta)
    if job:
        memo.scheduler.poke(namespace, job)
