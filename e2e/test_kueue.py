"""Kueue in the e2e cluster (``e2e.kueue``): quota, admission and the status a job
controller writes, with Workloads made by hand as a job controller would make them.

Every queue has room for one of the tests' workloads (1 CPU; each asks for 600m). Every wait
is bounded (at most 60 s).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from flowmill.operator.queueing import released_status

from .cluster import Cluster
from .kueue import GROUP, Kueue
from .polling import REFUSED, eventually

pytestmark = pytest.mark.e2e

V1BETA2 = f"{GROUP}/v1beta2"
WORKLOADS = f"workloads.{GROUP}"
QUEUE = "queue"  # the LocalQueue in each test's namespace
TIMEOUT = 60


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def condition(wl: dict, kind: str) -> dict | None:
    return next((c for c in wl.get("status", {}).get("conditions", []) if c["type"] == kind),
                None)


def new_condition(kind: str, status: str, reason: str, message: str, wl: dict) -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now(), "observedGeneration": wl["metadata"]["generation"]}


def apply(cluster: Cluster, *objects: dict) -> None:
    cluster.kubectl("apply", "-f", "-",
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))


def create_workload(cluster: Cluster, namespace: str, name: str,
                    priority: int | None = None) -> None:
    """A Workload of one pod (600m CPU) in the queue, as a job controller would create it
    for its job (with the priority its job's class gives it, when it has one)."""
    container = {"name": "main", "image": "flowmill.local/none",
                 "resources": {"requests": {"cpu": "600m", "memory": "256Mi"}}}
    spec: dict = {"queueName": QUEUE, "podSets": [{"name": "main", "count": 1, "template": {
        "spec": {"restartPolicy": "Never", "containers": [container]}}}]}
    if priority is not None:
        spec["priority"] = priority
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": V1BETA2, "kind": "Workload", "metadata": {"name": name}, "spec": spec}))


def wait_condition(cluster: Cluster, namespace: str, name: str, kind: str,
                   status: str) -> dict:
    """The workload once its condition ``kind`` has ``status``; fails with its status."""
    seen: list[dict] = [{}]

    def check() -> dict | None:
        seen[0] = cluster.get(WORKLOADS, name, namespace) or {}
        c = condition(seen[0], kind)
        return seen[0] if c and c["status"] == status else None
    try:
        return eventually(f"{name}: {kind}={status}", check, TIMEOUT)
    except AssertionError as e:
        raise AssertionError(f"{e}; status: {json.dumps(seen[0].get('status'))}") from None


def finish(cluster: Cluster, namespace: str, name: str) -> None:
    """What a job controller does when its job ends: condition Finished=True, applied to
    the status subresource (server-side apply merges it into the conditions by type)."""
    wl = cluster.get(WORKLOADS, name, namespace)
    assert wl is not None
    cluster.kubectl("apply", "--server-side", "--subresource=status",
                    "--field-manager=flowmill-e2e-job", "-f", "-", input=json.dumps({
                        "apiVersion": V1BETA2, "kind": "Workload",
                        "metadata": {"name": name, "namespace": namespace},
                        "status": {"conditions": [new_condition(
                            "Finished", "True", "Succeeded", "the job succeeded", wl)]}}))


def acknowledge_eviction(cluster: Cluster, namespace: str, name: str) -> None:
    """What a job controller does once the job of an evicted workload has stopped: give
    back the quota reservation with the status the operator writes
    (``queueing.released_status``: QuotaReserved=False, Admitted=False, Requeued True when
    preempted, no admission). A full status update, so that a concurrent change is a
    conflict, not lost; on a conflict it reads the workload again and retries, as a
    controller's next reconcile would."""
    for _ in range(5):
        wl = cluster.get(WORKLOADS, name, namespace)
        assert wl is not None
        status = released_status(wl, now())
        assert status is not None, wl.get("status")
        out = cluster.kubectl("replace", "--subresource=status", "-f", "-",
                              input=json.dumps({**wl, "status": status}), check=False)
        if out.returncode == 0:
            return
        assert "the object has been modified" in out.stderr, out.stderr
    raise AssertionError(f"{name}: the acknowledgement conflicted 5 times")


@pytest.fixture
def queues(cluster: Cluster, kueue: Kueue, namespace: str) -> Iterator[str]:
    """A ResourceFlavor and a ClusterQueue (1 CPU, 1 GiB; a workload preempts those of
    lower priority in it), both named after the namespace, and the LocalQueue ``queue`` in
    it; yields the ClusterQueue's name. Removed afterwards: the workloads first, as Kueue
    keeps a ClusterQueue that still holds quota."""
    name = namespace
    quota = [{"name": "cpu", "nominalQuota": "1"}, {"name": "memory", "nominalQuota": "1Gi"}]
    apply(cluster,
          {"apiVersion": V1BETA2, "kind": "ResourceFlavor", "metadata": {"name": name}},
          {"apiVersion": V1BETA2, "kind": "ClusterQueue", "metadata": {"name": name},
           "spec": {"namespaceSelector": {},
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [{
               "coveredResources": ["cpu", "memory"],
               "flavors": [{"name": name, "resources": quota}]}]}},
          {"apiVersion": V1BETA2, "kind": "LocalQueue",
           "metadata": {"name": QUEUE, "namespace": namespace},
           "spec": {"clusterQueue": name}})
    yield name
    cluster.kubectl("delete", WORKLOADS, "--all", "-n", namespace, timeout=TIMEOUT)
    cluster.kubectl("delete", f"clusterqueues.{GROUP}/{name}", f"resourceflavors.{GROUP}/{name}",
                    timeout=TIMEOUT)


def test_quota_admits_one_workload_until_it_finishes(cluster: Cluster, namespace: str,
                                                     queues: str) -> None:
    create_workload(cluster, namespace, "first")
    first = wait_condition(cluster, namespace, "first", "Admitted", "True")
    assert condition(first, "QuotaReserved")["status"] == "True"
    admission = first["status"]["admission"]
    assert admission["clusterQueue"] == queues
    assert admission["podSetAssignments"][0]["flavors"] == {"cpu": queues, "memory": queues}

    create_workload(cluster, namespace, "second")
    second = wait_condition(cluster, namespace, "second", "QuotaReserved", "False")
    reserved = condition(second, "QuotaReserved")
    assert reserved["reason"] == "Pending"
    assert f"insufficient unused quota for cpu in flavor {queues}" in reserved["message"]
    assert "admission" not in second["status"]

    finish(cluster, namespace, "first")
    second = wait_condition(cluster, namespace, "second", "Admitted", "True")
    assert second["status"]["admission"]["clusterQueue"] == queues
    first = cluster.get(WORKLOADS, "first", namespace)
    assert condition(first, "Finished")["status"] == "True"
    assert first["status"]["admission"] == admission  # Kueue leaves it; the quota is free


def test_preemption_holds_quota_until_the_job_controller_acknowledges(
        cluster: Cluster, namespace: str, queues: str) -> None:
    """A preempted workload stays active: Kueue counts its quota as used until the job
    controller says its job has stopped, so the preemptor waits for that, not for Kueue."""
    create_workload(cluster, namespace, "low")
    wait_condition(cluster, namespace, "low", "Admitted", "True")
    create_workload(cluster, namespace, "high", priority=100)

    low = wait_condition(cluster, namespace, "low", "Evicted", "True")
    assert condition(low, "Evicted")["reason"] == "Preempted"
    assert condition(low, "Preempted")["status"] == "True"
    assert condition(low, "QuotaReserved")["status"] == "True"
    assert "admission" in low["status"]
    # Held for as long as nobody acknowledges: the preemptor stays without quota.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        high = cluster.get(WORKLOADS, "high", namespace) or {}
        reserved = condition(high, "QuotaReserved")
        assert reserved is None or reserved["status"] == "False", high.get("status")
        time.sleep(0.5)

    acknowledge_eviction(cluster, namespace, "low")
    high = wait_condition(cluster, namespace, "high", "Admitted", "True")
    assert high["status"]["admission"]["clusterQueue"] == queues
    low = wait_condition(cluster, namespace, "low", "QuotaReserved", "False")
    assert "admission" not in low["status"]
    assert condition(low, "Requeued")["status"] == "True"  # it queues again, behind "high"
    assert condition(low, "Admitted")["status"] == "False"


def test_deactivation_frees_quota_at_once_and_leaves_the_reservation_to_acknowledge(
        cluster: Cluster, namespace: str, queues: str) -> None:
    """A deactivated workload (spec.active false) leaves Kueue's queues and its quota
    cache at once: the next workload is admitted while the deactivated one still shows its
    reservation, which only the job controller's acknowledgement removes."""
    create_workload(cluster, namespace, "first")
    wait_condition(cluster, namespace, "first", "Admitted", "True")
    create_workload(cluster, namespace, "second")
    wait_condition(cluster, namespace, "second", "QuotaReserved", "False")

    cluster.kubectl("patch", WORKLOADS, "first", "-n", namespace, "--type=merge",
                    "-p", '{"spec": {"active": false}}')
    first = wait_condition(cluster, namespace, "first", "Evicted", "True")
    assert condition(first, "Evicted")["reason"] == "Deactivated"
    second = wait_condition(cluster, namespace, "second", "Admitted", "True")
    assert second["status"]["admission"]["clusterQueue"] == queues
    first = cluster.get(WORKLOADS, "first", namespace)
    assert condition(first, "QuotaReserved")["status"] == "True"
    assert "admission" in first["status"]

    acknowledge_eviction(cluster, namespace, "first")
    first = wait_condition(cluster, namespace, "first", "QuotaReserved", "False")
    assert "admission" not in first["status"]
    assert condition(first, "Requeued")["status"] == "False"  # inactive: not queued again
    second = cluster.get(WORKLOADS, "second", namespace)
    assert condition(second, "Admitted")["status"] == "True"


def test_v1beta1_is_served_through_the_conversion_webhook(cluster: Cluster, namespace: str,
                                                          queues: str) -> None:
    create_workload(cluster, namespace, "first")
    wait_condition(cluster, namespace, "first", "Admitted", "True")
    out = cluster.kubectl("get", f"workloads.v1beta1.{GROUP}", "-n", namespace, "-o", "json")
    (wl,) = json.loads(out.stdout)["items"]
    assert wl["apiVersion"] == f"{GROUP}/v1beta1"
    assert wl["metadata"]["name"] == "first" and wl["spec"]["queueName"] == QUEUE
    assert wl["status"]["admission"]["clusterQueue"] == queues
    out = cluster.kubectl("get", f"clusterqueues.v1beta1.{GROUP}", queues, "-o", "json")
    assert json.loads(out.stdout)["apiVersion"] == f"{GROUP}/v1beta1"


def test_kueue_needs_no_more_than_its_cluster_role(cluster: Cluster, kueue: Kueue) -> None:
    """Kueue ran as ``flowmill:kueue`` with the ClusterRole it ships, and nothing it asked
    for was refused (run last: after the other tests' queues and workloads)."""
    log = (cluster.log_dir / "kueue.log").read_text(errors="replace")
    assert "Starting workers" in log
    refused = [line for line in log.splitlines() if REFUSED.search(line)]
    assert not refused, refused[:5]
