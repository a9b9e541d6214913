"""A TrainingJob in a Kueue queue: Kueue's answers read, the Workload built, the answers
given back, and a queued job's life through admission, preemption and resumption."""

import copy
from datetime import UTC, datetime, timedelta

from flowmill.operator import status as st
from flowmill.operator.api import TrainingJob
from flowmill.operator.controller import admission_events
from flowmill.operator.manifests import LABEL_GENERATION, desired_pod, owner_reference
from flowmill.operator.queueing import (
    ADMITTED,
    EVICTED,
    QUEUED,
    Placement,
    admission_of,
    desired_workload,
    finished_status,
    merge_placement,
    priority_ref,
    released_status,
    workload_name,
)
from flowmill.operator.status import Status, decide, observe

T0 = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
NOW = "2026-12-03T12:00:00Z"
UID = "0a1b2c3d-4e5f"
WORKER = {"spec": {"containers": [{
    "name": "flowmill", "image": "flowmill:dev", "command": ["python", "train.py"],
    "resources": {"limits": {"cpu": "2", "nvidia.com/gpu": 1},
                  "requests": {"memory": "1Gi"}}}]}}
FLAVOR = {"metadata": {"name": "gpu-a"}, "spec": {
    "nodeLabels": {"cloud.example.com/pool": "a100"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}}


def make_job(labels=None, priority_class=None, status=None):
    spec = {"replicaSpecs": {"ps": {"replicas": 1},
                             "worker": {"replicas": 2, "template": copy.deepcopy(WORKER)}}}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "lm", "namespace": "ml", "uid": UID, "generation": 1,
                         "labels": {"kueue.x-k8s.io/queue-name": "team-a", **(labels or {})}},
            "spec": spec, "status": copy.deepcopy(status or {})}


def cond(type, status, reason="", message=""):
    return {"type": type, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": NOW}


def workload(*conditions, admission=None):
    wl = {"metadata": {"name": "trainingjob-lm-0a1b2c3d", "namespace": "ml",
                       "generation": 1, "resourceVersion": "7"},
          "spec": {"queueName": "team-a"}, "status": {"conditions": list(conditions)}}
    if admission:
        wl["status"]["admission"] = admission
    return wl


ADMISSION = {"clusterQueue": "cluster", "podSetAssignments": [
    {"name": "ps", "flavors": {"cpu": "default"}, "count": 1},
    {"name": "worker", "flavors": {"cpu": "default", "nvidia.com/gpu": "gpu-a"}, "count": 2}]}
PENDING = cond("QuotaReserved", "False", "Pending",
               "couldn't assign flavors to pod set worker: insufficient unused quota for "
               "nvidia.com/gpu in flavor gpu-a, 2 more needed")
RESERVED = cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster")
ADMITTED_COND = cond("Admitted", "True", "Admitted", "The workload is admitted")
PREEMPTED = cond("Evicted", "True", "Preempted",
                 "Preempted to accommodate a workload (UID: x) due to prioritization")


def job():
    return TrainingJob.from_dict(make_job())


# ---- reading Kueue's answer


def test_a_workload_not_yet_made_or_not_yet_considered_is_queued():
    a = admission_of(job(), None)
    assert (a.state, a.admitted) == (QUEUED, False)
    assert "team-a" in a.message
    assert admission_of(job(), workload()).state == QUEUED


def test_kueues_reason_for_waiting_is_the_jobs_message():
    a = admission_of(job(), workload(PENDING))
    assert (a.state, a.reason) == (QUEUED, "Pending")
    assert "insufficient unused quota for nvidia.com/gpu" in a.message


def test_quota_reserved_but_checks_pending_is_not_yet_admitted():
    a = admission_of(job(), workload(RESERVED, admission=ADMISSION))
    assert a.state == QUEUED and "admission checks" in a.message


def test_an_admitted_workload_names_each_roles_flavors():
    a = admission_of(job(), workload(RESERVED, ADMITTED_COND, admission=ADMISSION))
    assert a.state == ADMITTED and a.admitted
    assert a.cluster_queue == "cluster"
    assert a.flavors == {"ps": {"cpu": "default"},
                         "worker": {"cpu": "default", "nvidia.com/gpu": "gpu-a"}}
    assert a.describe() == ("admitted by ClusterQueue cluster "
                            "(flavors ps: default; worker: default, gpu-a)")
    placed = a.with_placements({"default": {"spec": {}}, "gpu-a": FLAVOR})
    assert placed.placements["ps"] == Placement({}, ())
    assert placed.placements["worker"] == Placement(
        {"cloud.example.com/pool": "a100"},
        ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},))


def test_an_evicted_workload_holding_quota_is_evicted_and_once_released_queued():
    evicted = workload(RESERVED, ADMITTED_COND, PREEMPTED, admission=ADMISSION)
    a = admission_of(job(), evicted)
    assert (a.state, a.reason) == (EVICTED, "Preempted")
    assert "prioritization" in a.message
    released = copy.deepcopy(evicted)
    released["status"] = released_status(evicted, NOW)
    assert admission_of(job(), released).state == QUEUED


def test_flavor_placement_joins_the_template_which_wins_on_a_shared_label():
    spec = {"nodeSelector": {"cloud.example.com/pool": "mine"},
            "tolerations": [{"key": "spot", "operator": "Exists"}]}
    merge_placement(spec, Placement({"cloud.example.com/pool": "a100", "zone": "b"},
                                    ({"key": "gpu", "operator": "Exists"},
                                     {"key": "spot", "operator": "Exists"})))
    assert spec["nodeSelector"] == {"cloud.example.com/pool": "mine", "zone": "b"}
    assert spec["tolerations"] == [{"key": "spot", "operator": "Exists"},
                                   {"key": "gpu", "operator": "Exists"}]
    untouched = {"containers": []}
    merge_placement(untouched, None)
    merge_placement(untouched, Placement())
    assert untouched == {"containers": []}


# ---- the Workload


def test_the_workload_has_a_pod_set_per_role_with_the_pods_requests():
    j = job()
    templates = {role: desired_pod(j, role, 0) for role in ("ps", "worker")}
    wl = desired_workload(j, templates, owner_reference(j), None)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == workload_name(j) == "trainingjob-lm-0a1b2c3d"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == UID
    assert wl["metadata"]["ownerReferences"][0]["controller"] is True
    assert wl["spec"]["queueName"] == "team-a"
    assert "priority" not in wl["spec"]
    sets = {p["name"]: p for p in wl["spec"]["podSets"]}
    assert {n: p["count"] for n, p in sets.items()} == {"ps": 1, "worker": 2}
    worker = sets["worker"]["template"]["spec"]["containers"][0]["resources"]
    # limits stand for the requests the template left out, as the API server defaults them
    assert worker["requests"] == {"cpu": "2", "nvidia.com/gpu": "1", "memory": "1Gi"}
    ps = sets["ps"]["template"]["spec"]["containers"][0]["resources"]
    assert ps["requests"] == {"cpu": "2", "memory": "1Gi"}  # the worker's, without GPUs


def test_the_jobs_priority_class_or_a_workload_priority_class_label_sets_its_priority():
    j = TrainingJob.from_dict(make_job(priority_class="high"))
    assert priority_ref(j) == ("scheduling.k8s.io", "PriorityClass", "high")
    wl = desired_workload(j, {r: desired_pod(j, r, 0) for r in ("ps", "worker")},
                          owner_reference(j), 1000)
    assert wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassRef"] == {"group": "scheduling.k8s.io",
                                              "kind": "PriorityClass", "name": "high"}
    j = TrainingJob.from_dict(make_job(labels={"kueue.x-k8s.io/priority-class": "urgent"},
                                       priority_class="high"))
    assert priority_ref(j) == ("kueue.x-k8s.io", "WorkloadPriorityClass", "urgent")
    assert priority_ref(job()) is None


def test_the_jobs_scheduler_and_priority_class_reach_pods_that_name_none():
    j = TrainingJob.from_dict({**make_job(priority_class="high"),
                               "spec": {**make_job(priority_class="high")["spec"],
                                        "schedulerName": "gang"}})
    spec = desired_pod(j, "worker", 0)["spec"]
    assert (spec["schedulerName"], spec["priorityClassName"]) == ("gang", "high")
    raw = make_job(priority_class="high")
    raw["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["priorityClassName"] = "own"
    assert desired_pod(raw, "worker", 0)["spec"]["priorityClassName"] == "own"
    assert "schedulerName" not in desired_pod(make_job(), "worker", 0)["spec"]


# ---- answering Kueue


def test_an_eviction_is_acknowledged_by_giving_the_quota_back():
    evicted = workload(RESERVED, ADMITTED_COND, PREEMPTED, admission=ADMISSION)
    out = released_status(evicted, "2026-12-03T12:05:00Z")
    assert "admission" not in out
    got = {c["type"]: c for c in out["conditions"]}
    assert got["QuotaReserved"]["status"] == "False"
    assert got["QuotaReserved"]["reason"] == "Pending"
    assert got["QuotaReserved"]["lastTransitionTime"] == "2026-12-03T12:05:00Z"
    assert got["Admitted"]["status"] == "False"
    assert got["Requeued"]["status"] == "True" and got["Requeued"]["reason"] == "Preempted"
    assert got["Evicted"] == PREEMPTED  # Kueue's own condition is left to Kueue
    assert evicted["status"]["admission"] == ADMISSION  # the input is not changed
    assert released_status(workload(PENDING), NOW) is None
    deactivated = workload(RESERVED, ADMITTED_COND, cond("Evicted", "True",
                                                         "InactiveWorkload", "deactivated"),
                           admission=ADMISSION)
    got = {c["type"]: c for c in released_status(deactivated, NOW)["conditions"]}
    assert got["Requeued"]["status"] == "False"


def test_a_finished_job_marks_its_workload_finished_once():
    wl = workload(RESERVED, ADMITTED_COND, admission=ADMISSION)
    out = finished_status(wl, True, "TrainingJob lm succeeded", NOW)
    got = {c["type"]: c for c in out["conditions"]}
    assert got["Finished"]["status"] == "True" and got["Finished"]["reason"] == "Succeeded"
    assert out["admission"] == ADMISSION
    wl["status"] = out
    assert finished_status(wl, True, "again", NOW) is None
    failed = finished_status(workload(RESERVED, ADMITTED_COND), False, "x", NOW)
    assert failed["conditions"][-1]["reason"] == "Failed"


# ---- a queued job's life


class QueuedWorld:
    """The operator's reconcile over a queued job, with Kueue's answer set by the test."""

    def __init__(self, raw):
        self.job = raw
        self.pods = {}
        self.now = T0
        self.workload = workload()
        self.flavors = {"default": {"spec": {}}, "gpu-a": FLAVOR}
        self.events = []

    def reconcile(self, seconds=1):
        self.now += timedelta(seconds=seconds)
        pods = list(self.pods.values())
        admission = admission_of(TrainingJob.from_dict(self.job), self.workload)
        if admission.admitted:
            admission = admission.with_placements(self.flavors)
        old = self.job.get("status") or {}
        action = decide(self.job, pods, observe(self.job, pods, self.now, admission),
                        self.now, (), admission)
        self.job["status"] = action.status.to_dict()
        self.events += [r for _, r, _ in admission_events(old, action.status)]
        for name in action.delete:
            self.pods[name]["metadata"]["deletionTimestamp"] = st.format_time(self.now)
        for manifest in action.create:
            created = copy.deepcopy(manifest)
            created["status"] = {"phase": "Running", "containerStatuses": [
                {"name": "flowmill", "state": {"running": {}}}],
                "conditions": [{"type": "Ready", "status": "True"}]}
            self.pods[manifest["metadata"]["name"]] = created
        if action.kind != "wait":
            self.events.append(action.reason)
        return action

    def conditions(self):
        return {c["type"]: c for c in self.job["status"]["conditions"]}

    def gone(self):
        self.pods = {n: p for n, p in self.pods.items()
                     if not p["metadata"].get("deletionTimestamp")}


def test_life_of_a_queued_job_admitted_preempted_and_resumed():
    world = QueuedWorld(make_job())
    world.workload = workload(PENDING)
    assert world.reconcile().kind == "wait"
    assert not world.pods
    assert world.job["status"]["phase"] == "Pending"
    got = world.conditions()
    assert got["Queued"]["status"] == "True"
    assert "insufficient unused quota" in got["Queued"]["message"]
    assert got["Admitted"]["status"] == "False"
    assert got["Running"]["reason"] == "Queued"
    assert world.events == ["Queued"]
    queued_at = got["Queued"]["lastTransitionTime"]
    assert world.reconcile(5).kind == "wait"
    assert world.conditions()["Queued"]["lastTransitionTime"] == queued_at

    # Admitted: every pod, with the admitted flavor's node labels and tolerations.
    world.workload = workload(RESERVED, ADMITTED_COND, admission=ADMISSION)
    action = world.reconcile()
    assert action.kind == "create" and len(action.create) == 3
    worker = world.pods["lm-worker-0"]["spec"]
    assert worker["nodeSelector"] == {"cloud.example.com/pool": "a100"}
    assert worker["tolerations"][-1]["key"] == "gpu"
    assert "nodeSelector" not in world.pods["lm-ps-0"]["spec"]
    got = world.conditions()
    assert (got["Queued"]["status"], got["Admitted"]["status"]) == ("False", "True")
    assert "ClusterQueue cluster" in got["Admitted"]["message"]
    assert "Admitted" in world.events
    assert world.reconcile().kind == "wait"
    assert world.job["status"]["phase"] == "Running"

    # Preempted: every pod asked to stop, the job suspended, nothing counted.
    world.workload = workload(RESERVED, ADMITTED_COND, PREEMPTED, admission=ADMISSION)
    action = world.reconcile()
    assert action.kind == "suspend" and action.reason == "Preempted"
    # The training tasks first: the chief's last checkpoint needs the ps tasks.
    assert set(action.delete) == {"lm-worker-0", "lm-worker-1"}
    assert world.job["status"]["phase"] == "Suspended"
    assert world.conditions()["Suspended"]["reason"] == "Preempted"
    assert world.conditions()["Admitted"]["status"] == "False"
    assert world.job["status"]["restartCount"] == 0
    assert world.reconcile().kind == "wait"  # the workers are still stopping
    for name in ("lm-worker-0", "lm-worker-1"):
        world.pods[name]["status"] = {"phase": "Failed", "containerStatuses": [
            {"name": "flowmill", "state": {"terminated": {"exitCode": 143}}}]}
    action = world.reconcile()
    assert action.delete == ("lm-ps-0",)
    assert world.job["status"]["restartCount"] == 0
    world.gone()
    world.workload["status"] = released_status(world.workload, NOW)
    world.workload["status"]["conditions"].append(PENDING)
    assert world.reconcile().kind == "wait"
    assert world.job["status"]["phase"] == "Suspended"
    assert world.conditions()["Queued"]["status"] == "True"

    # Re-admitted: a new run (newer pods), resumed, the budget untouched.
    world.workload = workload(RESERVED, ADMITTED_COND, admission=ADMISSION)
    action = world.reconcile()
    assert action.kind == "create" and len(action.create) == 3
    assert world.job["status"]["phase"] == "Pending"
    assert world.conditions()["Running"]["reason"] == "Resumed"
    assert int(world.pods["lm-worker-0"]["metadata"]["labels"][LABEL_GENERATION]) >= 2
    assert world.reconcile().kind == "wait"
    assert world.job["status"]["phase"] == "Running"
    assert world.job["status"]["restartCount"] == 0
    assert world.events.count("Admitted") == 2 and "Preempted" in world.events


def test_a_job_without_a_queue_is_untouched_by_admission():
    raw = make_job()
    del raw["metadata"]["labels"]
    s = observe(raw, [], T0)
    assert s.condition("Queued") is None and s.condition("Admitted") is None
    assert decide(raw, [], s, T0).kind == "create"


def test_conditions_other_than_the_phases_survive_a_phase_change():
    s = Status(conditions=(st.Condition("Queued", "False", "Admitted", "x", NOW, 1),))
    out = st.with_phase(s, job(), "Running", "AllTasksRunning", "ok", T0)
    assert [c.type for c in out.conditions] == ["Created", "Running", "Queued"]
