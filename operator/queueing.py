"""A TrainingJob in a Kueue queue: its Workload, and what Kueue's answer means (pure).

A job labelled ``kueue.x-k8s.io/queue-name`` runs no pod until Kueue admits it. Kueue
has no built-in integration for this kind, so the operator does what Kueue's own job
integrations do, through the API alone (as other external controllers do): it publishes
the job's demand as a ``Workload`` it owns (one pod set per role, each with its pods'
requests), starts the pods once the Workload is admitted, with the node selectors and
tolerations of the ResourceFlavors it was admitted to, and answers an eviction
(preemption, a deactivated Workload) by stopping every pod, then giving the quota back
(QuotaReserved false, admission cleared), after which Kueue queues it again. A finished
job marks its Workload Finished, which frees the quota.

The decisions are here, as pure functions of the objects; ``controller.py`` reads and
writes them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .api import ROLES, TrainingJob

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
WORKLOAD_PLURAL = "workloads"
FLAVOR_PLURAL = "resourceflavors"
WORKLOAD_PRIORITY_PLURAL = "workloadpriorityclasses"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
LABEL_PRIORITY = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass, as Kueue reads it

QUEUED, ADMITTED, EVICTED = "Queued", "Admitted", "Evicted"
# Eviction reasons after which Kueue's own integrations mark the Workload Requeued.
_REQUEUED_REASONS = ("Preempted", "NodeFailures")
_MAX_MESSAGE = 32768  # metav1.Condition's message limit


@dataclass(frozen=True)
class Placement:
    """What the admitted flavors add to a role's pods."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Admission:
    """Where a queued job stands with Kueue.

    ``state``: Queued (no quota yet, or given back after an eviction), Admitted (pods may
    run, with ``placements`` per role), or Evicted (quota still held: stop every pod,
    then give it back). ``reason`` and ``message`` are Kueue's own where it gave any.
    """

    state: str
    reason: str
    message: str
    cluster_queue: str | None = None
    # role -> resource -> the flavor it was admitted to
    flavors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    placements: Mapping[str, Placement] = field(default_factory=dict)

    @property
    def admitted(self) -> bool:
        return self.state == ADMITTED

    def with_placements(self, flavors: Mapping[str, Mapping[str, Any]]) -> Admission:
        """The same admission with each role's placement resolved from the
        ResourceFlavor objects (by name) its pod set was admitted to."""
        out = {}
        for role, by_resource in self.flavors.items():
            selector: dict[str, str] = {}
            tolerations: list[Mapping[str, Any]] = []
            for name in sorted(set(by_resource.values())):
                spec = (flavors.get(name) or {}).get("spec") or {}
                selector.update(spec.get("nodeLabels") or {})
                tolerations += [t for t in spec.get("tolerations") or () if t not in tolerations]
            out[role] = Placement(selector, tuple(tolerations))
        return Admission(self.state, self.reason, self.message, self.cluster_queue,
                         self.flavors, out)

    def describe(self) -> str:
        """The admission for an Event: the ClusterQueue and each role's flavors."""
        roles = "; ".join(f"{role}: {', '.join(sorted(set(f.values())))}"
                          for role, f in self.flavors.items() if f)
        return (f"admitted by ClusterQueue {self.cluster_queue}"
                + (f" (flavors {roles})" if roles else ""))


def queue_name(job: TrainingJob) -> str | None:
    return job.labels.get(LABEL_QUEUE) or None


def workload_name(job: TrainingJob) -> str:
    """``trainingjob-<name>-<uid prefix>``: one per job object, as Kueue names the
    Workloads of its own integrations (kind, name, a hash of the owner)."""
    return f"trainingjob-{job.name}-{(job.uid or '')[:8]}".rstrip("-")


def _condition(obj: Mapping[str, Any], type: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == type:
            return c
    return None


def _true(obj: Mapping[str, Any], type: str) -> bool:
    c = _condition(obj, type)
    return c is not None and c.get("status") == "True"


def admission_of(job: TrainingJob, workload: Mapping[str, Any] | None) -> Admission:
    """What Kueue has decided about the job, from its Workload (None: not made yet)."""
    queue = queue_name(job)
    if workload is None:
        return Admission(QUEUED, "Pending", f"waiting for Kueue (LocalQueue {queue})")
    status = workload.get("status") or {}
    admission = status.get("admission") or None
    evicted = _condition(workload, "Evicted")
    if admission and evicted is not None and evicted.get("status") == "True":
        return Admission(EVICTED, evicted.get("reason") or EVICTED,
                         evicted.get("message") or "evicted by Kueue",
                         admission.get("clusterQueue"), _flavors(admission))
    if admission and _true(workload, "Admitted"):
        return Admission(ADMITTED, "Admitted", "", admission.get("clusterQueue"),
                         _flavors(admission))
    if admission:
        return Admission(QUEUED, "Pending",
                         f"quota reserved in ClusterQueue {admission.get('clusterQueue')}; "
                         "waiting for its admission checks")
    reserved = _condition(workload, "QuotaReserved")
    if reserved is not None and reserved.get("message"):
        return Admission(QUEUED, reserved.get("reason") or "Pending", reserved["message"])
    return Admission(QUEUED, "Pending", f"waiting for Kueue (LocalQueue {queue})")


def _flavors(admission: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    return {a["name"]: dict(a.get("flavors") or {})
            for a in admission.get("podSetAssignments") or () if a.get("name")}


def merge_placement(pod_spec: dict[str, Any], placement: Placement | None) -> None:
    """Add an admitted flavor's node selector and tolerations to a pod spec (in place);
    the template's own selector wins where both name a label."""
    if placement is None:
        return
    if placement.node_selector:
        pod_spec["nodeSelector"] = {**placement.node_selector,
                                    **(pod_spec.get("nodeSelector") or {})}
    if placement.tolerations:
        have = list(pod_spec.get("tolerations") or ())
        pod_spec["tolerations"] = have + [dict(t) for t in placement.tolerations
                                          if t not in have]


# ---- the Workload


def priority_ref(job: TrainingJob) -> tuple[str, str, str] | None:
    """(group, kind, name) of the class that gives the job its priority in the queue: a
    WorkloadPriorityClass named by the ``kueue.x-k8s.io/priority-class`` label, else the
    pods' PriorityClass (``spec.priorityClassName``)."""
    name = job.labels.get(LABEL_PRIORITY)
    if name:
        return (KUEUE_GROUP, "WorkloadPriorityClass", name)
    if job.spec.priority_class_name:
        return ("scheduling.k8s.io", "PriorityClass", job.spec.priority_class_name)
    return None


def desired_workload(job: TrainingJob, pod_templates: Mapping[str, Mapping[str, Any]],
                     owner: Mapping[str, Any], priority: int | None) -> dict[str, Any]:
    """The job's Workload: one pod set per role (its pod as the operator makes it, so
    the requests Kueue counts are the ones the scheduler will see), owned by the job."""
    pod_sets = []
    for role in ROLES:
        count = job.spec.replica_specs.replicas(role)
        if count == 0:
            continue
        spec = copy.deepcopy(dict(pod_templates[role]["spec"]))
        spec["containers"] = [_with_requests(c) for c in spec["containers"]]
        pod_sets.append({"name": role, "count": count, "template": {"spec": spec}})
    spec: dict[str, Any] = {"queueName": queue_name(job), "podSets": pod_sets}
    ref = priority_ref(job)
    if ref is not None and priority is not None:
        group, kind, name = ref
        spec["priorityClassRef"] = {"group": group, "kind": kind, "name": name}
        spec["priority"] = priority
    return {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
        "kind": "Workload",
        "metadata": {"name": workload_name(job), "namespace": job.namespace,
                     "labels": {"flowmill.dev/job-name": job.name},
                     "ownerReferences": [dict(owner)]},
        "spec": spec,
    }


def _with_requests(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container whose requests name its limits where it gave none, as the API server
    defaults them (Kueue counts requests)."""
    out = dict(container)
    resources = dict(out.get("resources") or {})
    limits = resources.get("limits") or {}
    if limits:
        resources["requests"] = {**limits, **(resources.get("requests") or {})}
        out["resources"] = resources
    return out


# ---- answering Kueue


def _set_condition(conditions: list[dict[str, Any]], type: str, status: str, reason: str,
                   message: str, now: str, generation: int | None) -> None:
    """metav1.Condition semantics: lastTransitionTime moves only when status does."""
    new = {"type": type, "status": status, "reason": reason,
           "message": message[:_MAX_MESSAGE], "lastTransitionTime": now}
    if generation is not None:
        new["observedGeneration"] = generation
    for i, c in enumerate(conditions):
        if c.get("type") == type:
            if c.get("status") == status:
                new["lastTransitionTime"] = c.get("lastTransitionTime") or now
            conditions[i] = new
            return
    conditions.append(new)


def released_status(workload: Mapping[str, Any], now: str) -> dict[str, Any] | None:
    """The Workload status that gives an evicted job's quota back once its pods are gone
    (what Kueue's job integrations write: Requeued, QuotaReserved false with the
    eviction's message, no admission, Admitted false); None when there is none to give."""
    status = copy.deepcopy(dict(workload.get("status") or {}))
    evicted = _condition(workload, "Evicted")
    if not status.get("admission") or evicted is None or evicted.get("status") != "True":
        return None
    generation = (workload.get("metadata") or {}).get("generation")
    conditions = list(status.get("conditions") or ())
    reason, message = evicted.get("reason") or EVICTED, evicted.get("message") or ""
    _set_condition(conditions, "Requeued",
                   "True" if reason in _REQUEUED_REASONS else "False", reason, message, now,
                   generation)
    _set_condition(conditions, "QuotaReserved", "False", "Pending", message, now, generation)
    if _true(workload, "Admitted"):
        _set_condition(conditions, "Admitted", "False", "NoReservation",
                       "The workload has no reservation", now, generation)
    status["conditions"] = conditions
    status.pop("admission", None)
    return status


def finished_status(workload: Mapping[str, Any], succeeded: bool, message: str,
                    now: str) -> dict[str, Any] | None:
    """The Workload status marking it Finished (its quota freed); None when it already is."""
    if _true(workload, "Finished"):
        return None
    status = copy.deepcopy(dict(workload.get("status") or {}))
    conditions = list(status.get("conditions") or ())
    _set_condition(conditions, "Finished", "True", "Succeeded" if succeeded else "Failed",
                   message, now, (workload.get("metadata") or {}).get("generation"))
    status["conditions"] = conditions
    return status


def flavor_names(admission: Admission) -> list[str]:
    return sorted({name for f in admission.flavors.values() for name in f.values()})


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs: Iterable[Mapping[str, Any]] = (obj.get("metadata") or {}).get("ownerReferences") or ()
    return any(r.get("controller") and r.get("uid") == uid for r in refs)

