"""A queued TrainingJob's Kueue Workload, read and written (``queueing.py`` decides).

Each reconcile of a job labelled ``kueue.x-k8s.io/queue-name`` reads its Workload (made
on first sight), which says whether the job may run (``queueing.admission_of``), and,
after the job's own status and pods are written, answers Kueue: the quota of an evicted
job is given back once none of its pods is left running, and a finished job's Workload
is marked Finished. Status writes carry the Workload's resourceVersion, so an answer
based on a stale read is refused (409) and the reconcile runs again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .api import ROLES, TrainingJob
from .apiclient import ApiError, Kube, path
from .errors import Blocked, Conflict, api_error
from .manifests import desired_pod, owner_reference
from .queueing import (
    EVICTED,
    FLAVOR_PLURAL,
    KUEUE_GROUP,
    KUEUE_VERSION,
    WORKLOAD_PLURAL,
    WORKLOAD_PRIORITY_PLURAL,
    Admission,
    admission_of,
    desired_workload,
    finished_status,
    flavor_names,
    owned_by,
    priority_ref,
    released_status,
    workload_name,
)
from .status import FINISHED, Status, format_time

log = logging.getLogger("flowmill.operator")

KUEUE_API = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
FLAVOR_TTL = 30.0  # seconds a ResourceFlavor read is reused (they change rarely)

Post = Callable[[Mapping[str, Any], str, str, str], None]


class Workloads:
    def __init__(self, api: Kube, post: Post) -> None:
        self.api = api
        self.post = post
        self._flavors: dict[str, tuple[float, Mapping[str, Any]]] = {}

    def admission(self, raw: Mapping[str, Any], job: TrainingJob
                  ) -> tuple[Admission, dict[str, Any] | None]:
        """Kueue's answer for the job and its Workload (made here if there is none)."""
        name = workload_name(job)
        workload = self._get(job.namespace, name)
        if workload is not None and not owned_by(workload, job.uid):
            self.post(raw, "Warning", "WorkloadConflict",
                      f"Workload {name} exists and is not this job's (delete or rename it)")
            raise Blocked(f"Workload {name} is not this job's")
        if workload is None:
            if Status.from_dict(job.status).phase in FINISHED:
                return admission_of(job, None), None
            workload = self._create(raw, job)
        admission = admission_of(job, workload)
        if admission.admitted:
            admission = admission.with_placements(
                {n: self._flavor(raw, n) for n in flavor_names(admission)})
        return admission, workload

    def answer(self, job: TrainingJob, workload: Mapping[str, Any] | None,
               admission: Admission, status: Status,
               pods: Sequence[Mapping[str, Any]]) -> None:
        """Tell Kueue what became of the job: finished (quota freed), or, evicted, stopped
        (quota given back once no pod of it is left running)."""
        if workload is None:
            return
        now = format_time(datetime.now(UTC))
        new = None
        if status.phase in FINISHED:
            cond = status.condition(status.phase)
            new = finished_status(workload, status.phase == "Succeeded",
                                  cond.message if cond else status.phase, now)
        elif admission.state == EVICTED and not any(_running(p) for p in pods):
            new = released_status(workload, now)
            if new is not None:
                log.info("TrainingJob %s/%s: stopped after eviction (%s); quota given back",
                         job.namespace, job.name, admission.reason)
        if new is not None:
            self._write_status(workload, new)

    # -- reads and writes

    def _get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.api.get(path(KUEUE_API, WORKLOAD_PLURAL, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def _create(self, raw: Mapping[str, Any], job: TrainingJob) -> dict[str, Any]:
        templates = {role: desired_pod(job, role, 0) for role in ROLES
                     if job.spec.replica_specs.replicas(role)}
        body = desired_workload(job, templates, owner_reference(job), self._priority(raw, job))
        name = body["metadata"]["name"]
        try:
            made = self.api.create(path(KUEUE_API, WORKLOAD_PLURAL, job.namespace), body)
        except ApiError as e:
            if e.status == 409:
                raise Conflict(f"Workload {name} made meanwhile") from None
            message = f"cannot create Workload {name}: {api_error(e)}"
            if e.status == 404:
                message += " (is Kueue installed? the job's kueue.x-k8s.io/queue-name " \
                           "label asks for it)"
            self.post(raw, "Warning", "FailedCreateWorkload", message)
            raise Blocked(message) from None
        log.info("TrainingJob %s/%s: Workload %s made for LocalQueue %s", job.namespace,
                 job.name, name, body["spec"]["queueName"])
        return made

    def _priority(self, raw: Mapping[str, Any], job: TrainingJob) -> int | None:
        ref = priority_ref(job)
        if ref is None:
            return None
        group, kind, name = ref
        try:
            if group == KUEUE_GROUP:
                obj = self.api.get(path(KUEUE_API, WORKLOAD_PRIORITY_PLURAL, name=name))
            else:
                obj = self.api.get(path("scheduling.k8s.io/v1", "priorityclasses", name=name))
            return int(obj["value"])
        except ApiError as e:
            message = f"cannot read {kind} {name}: {api_error(e)}"
            self.post(raw, "Warning", "PriorityClassNotFound", message)
            raise Blocked(message) from None

    def _flavor(self, raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
        now = time.monotonic()
        cached = self._flavors.get(name)
        if cached is not None and now - cached[0] < FLAVOR_TTL:
            return cached[1]
        try:
            flavor = self.api.get(path(KUEUE_API, FLAVOR_PLURAL, name=name))
        except ApiError as e:
            message = f"cannot read ResourceFlavor {name}: {api_error(e)}"
            self.post(raw, "Warning", "FailedReadResourceFlavor", message)
            raise Blocked(message) from None
        self._flavors[name] = (now, flavor)
        return flavor

    def _write_status(self, workload: Mapping[str, Any], status: dict[str, Any]) -> None:
        meta = workload["metadata"]
        try:
            self.api.replace(path(KUEUE_API, WORKLOAD_PLURAL, meta["namespace"], meta["name"],
                                  "status"), {**workload, "status": status})
        except ApiError as e:
            if e.status in (404, 409):
                raise Conflict(f"Workload {meta['name']}: {api_error(e)}") from None
            raise


def _running(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Pending", "Running", None)


