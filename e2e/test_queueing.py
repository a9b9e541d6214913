"""TrainingJobs in a Kueue queue: the chart's operator and a real Kueue, on the real
scheduler. The digits example is applied as a user would, labelled with its LocalQueue.

A ClusterQueue has quota for one digits job at a time (4 tasks of 200m CPU: 800m of
1000m). A second job waits (Queued, with Kueue's own message) and starts when the first
ends; a job of higher priority preempts a running one, which is suspended (its chief
commits the step it reached), then re-admitted and resumed from that checkpoint, with
no restart counted. No timing is asserted; every wait polls with a generous bound.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import yaml

from .cluster import Cluster
from .journey import RESTORED, TIMEOUT, Journey, condition, installed, stand_in_values
from .kueue import Kueue
from .polling import REFUSED, eventually

pytestmark = pytest.mark.e2e

QUEUE = "team"
CLUSTER_QUEUE = "flowmill-e2e"
FLAVOR = "flowmill-e2e-cpu"
LOW, HIGH = "flowmill-e2e-low", "flowmill-e2e-high"
KUEUE = "kueue.x-k8s.io/v1beta2"


def objects(ns: str) -> list[dict]:
    """A flavor, a ClusterQueue with room for one digits job (preempting lower
    priorities within it), the namespace's LocalQueue, and two PriorityClasses."""
    return [
        {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
         "spec": {"nodeLabels": {"flowmill.dev/node-stand-in": "true"}}},
        {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
         "spec": {"namespaceSelector": {},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{
                      "coveredResources": ["cpu", "memory"],
                      "flavors": [{"name": FLAVOR, "resources": [
                          {"name": "cpu", "nominalQuota": "1"},
                          {"name": "memory", "nominalQuota": "4Gi"}]}]}]}},
        {"apiVersion": KUEUE, "kind": "LocalQueue",
         "metadata": {"name": QUEUE, "namespace": ns},
         "spec": {"clusterQueue": CLUSTER_QUEUE}},
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
         "metadata": {"name": LOW}, "value": 100},
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
         "metadata": {"name": HIGH}, "value": 1000},
    ]


class Queued(Journey):
    def submit(self, name: str, priority: str | None = None, **kwargs: object) -> None:
        """The digits example, labelled with the LocalQueue (and given a priority)."""
        path = self.manifest(name, **kwargs)
        doc = yaml.safe_load(path.read_text())
        doc["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = QUEUE
        if priority:
            doc["spec"]["priorityClassName"] = priority
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.cluster.kubectl("apply", "-n", self.ns, "-f", str(path))

    def admitted_column(self, name: str) -> str:
        """The ADMITTED column of ``kubectl get tj -o wide`` (cells may be empty: read by
        position)."""
        header, row = self.cluster.kubectl("get", "tj", name, "-n", self.ns,
                                           "-o", "wide").stdout.splitlines()
        start = header.index("ADMITTED")
        return row[start:].split()[0]

    def workload(self, job: str) -> dict:
        (wl,) = [w for w in self.custom.list_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", self.ns, "workloads")["items"]
            if w["metadata"]["labels"].get("flowmill.dev/job-name") == job]
        return wl

    def reason(self, name: str, type: str) -> str | None:
        tj = self.job(name) or {}
        cond = condition(tj, type) if tj.get("status") else None
        return cond["reason"] if cond and cond["status"] == "True" else None


@pytest.fixture(scope="module")
def queued(cluster: Cluster, kueue: Kueue,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queued]:
    ns = f"queueing-{uuid.uuid4().hex[:6]}"
    tmp = tmp_path_factory.mktemp("queueing")
    with installed(cluster, ns, tmp, stand_in_values()):
        text = "\n---\n".join(json.dumps(o) for o in objects(ns))
        cluster.kubectl("apply", "-f", "-", input=text)
        try:
            yield Queued(cluster, ns, tmp)
        finally:
            cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                            input=text, check=False)


def test_a_second_job_waits_in_the_queue_until_the_first_ends(queued: Queued) -> None:
    queued.submit("first", max_steps=2000, interval=100_000)
    eventually("first admitted", lambda: queued.reason("first", "Admitted"), TIMEOUT)
    queued.submit("second", max_steps=200, interval=100_000)

    # Queued at once ("waiting for Kueue"), then with Kueue's own message once it has
    # looked at the Workload.
    tj = eventually("second queued for quota, in Kueue's words",
                    lambda: queued.reason("second", "Queued") and "insufficient unused quota "
                    "for cpu" in condition(queued.job("second"), "Queued")["message"]
                    and queued.job("second"), TIMEOUT)
    assert tj["status"]["phase"] == "Pending", tj["status"]
    assert condition(tj, "Admitted")["status"] == "False"
    assert queued.admitted_column("second") == "False"
    assert queued.live_pods("second") == {}  # holds nothing while it waits
    wl = queued.workload("second")
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("ps", 2), ("worker", 2)]
    assert wl["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]

    # The first runs where its flavor says, and its end frees the quota.
    first = queued.live_pods("first")
    assert first and all(p["spec"]["nodeSelector"] == {"flowmill.dev/node-stand-in": "true"}
                         for p in first.values())
    assert queued.admitted_column("first") == "True"
    queued.phase("first", "Succeeded")
    # (written to the Workload right after the job's own status)
    finished = eventually("first's Workload Finished", lambda: condition(
        queued.workload("first"), "Finished"), TIMEOUT)
    assert finished["status"] == "True" and finished["reason"] == "Succeeded", finished

    tj = queued.phase("second", "Succeeded")
    assert condition(tj, "Admitted")["status"] == "True"
    assert condition(tj, "Queued")["status"] == "False"
    events = queued.events("second")
    assert "Queued" in events and "Admitted" in events, events
    assert any(f"ClusterQueue {CLUSTER_QUEUE}" in m for m in events["Admitted"]), events


def test_a_preempted_job_resumes_from_its_checkpoint_with_its_budget_untouched(
    queued: Queued,
) -> None:
    """A low-priority job runs; a high-priority one arrives and Kueue evicts the first.
    Its pods are asked to stop: the chief commits the step it reached (no checkpoint
    interval falls due in this run). Once the high one has finished, the low one is
    admitted again and resumes from that checkpoint; backoffLimit 0 is not spent."""
    low = "low"
    queued.submit(low, priority=LOW, max_steps=3000, interval=100_000, backoffLimit=0)
    eventually(f"{low} past step 100", lambda: queued.step(low) >= 100, TIMEOUT)
    # spec.priorityClassName reaches the pods, which the API server gives its value.
    pods = queued.live_pods(low).values()
    assert {(p["spec"]["priorityClassName"], p["spec"]["priority"]) for p in pods} == {
        (LOW, 100)}, [p["spec"].get("priorityClassName") for p in pods]
    queued.submit("high", priority=HIGH, max_steps=200, interval=100_000)

    eventually(f"{low} preempted", lambda: queued.reason(low, "Suspended") == "Preempted",
               TIMEOUT)
    saved = eventually(f"{low}'s chief to commit the step it reached",
                       lambda: sorted(queued.checkpoints(low)), TIMEOUT)
    queued.phase("high", "Succeeded")

    tj = queued.phase(low, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 0, status
    assert condition(tj, "Admitted")["status"] == "True"
    chief = f"{low}-worker-0"
    assert "exiting with code 143" in queued.all_logs(chief)
    restored = RESTORED.search(queued.log(chief))
    assert restored and int(restored.group(1)) == saved[0], queued.log(chief)[-3000:]
    assert 100 <= saved[0] < 3000, saved
    events = queued.events(low)
    assert any("Preempted" in m or "prioritization" in m
               for m in events.get("Preempted", [])), events
    assert len(events.get("Admitted", [])) >= 2 and "Resumed" in events, events
    wl = queued.workload(low)
    requeued = condition(wl, "Requeued")
    assert requeued and requeued["reason"] == "Preempted", wl["status"]


def test_operator_was_never_refused(queued: Queued) -> None:
    """Every Workload, flavor and priority read and write the operator made was allowed
    by the chart's RBAC."""
    logs = queued.cluster.kubectl("logs", "-n", queued.ns, "-l",
                                  "app.kubernetes.io/instance=fm", "--tail=-1").stdout
    refused = [ln for ln in logs.splitlines() if REFUSED.search(ln)]
    assert refused == [], "\n".join(refused)
