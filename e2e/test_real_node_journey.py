"""The user journey on the real node: the chart's operator and the digits job in containers
from the project's image, under the ``restricted`` Pod Security level.

The image (``e2e/image.sh``, the CPU target) is saved with podman and imported into the
real node's containerd; the chart runs the operator from it and the job's pods run it too
(``imagePullPolicy: Never``). Everything a pod needs comes the way it does in a cluster
(``e2e.addons``): the operator reaches the API server through the ``kubernetes`` Service's
ClusterIP (kube-proxy), the tasks find each other by their Services' names (CoreDNS), the
cluster's kube-scheduler places them, and the S3 store is a service outside the cluster, reached at
the host end of the node's link. What differs from ``examples/digits/job.yaml`` as shipped
is only what this cluster needs: the image's name, the node's kind, plain-
http S3, and a shorter run.

Tasks die the way a node loses them: SIGKILL to every process of the container, found by
its cgroup. A task over its memory limit is killed by the kernel's OOM killer, reported
``OOMKilled`` by the kubelet, and the operator's failure policy reads that. No timing is
asserted; the module writes how long each job took to ``real-node-journey.json`` in the
run's log folder.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from .cluster import Cluster
from .images import IMAGE_BUILD_ERROR, inspect, podman_env, save_archive
from .journey import (
    OPERATOR_LABEL,
    RESTORED,
    TIMEOUT,
    Journey,
    TaskPods,
    accuracy,
    condition,
    installed,
    uids,
)
from .polling import eventually
from .realnode import KIND, KIND_LABEL, NODE_NAME, RealNode

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.image,
    pytest.mark.skipif(sys.platform != "linux", reason="containers run on Linux only"),
]

# Where every pod of the module goes: the real node, through the cluster's scheduler.
PLACEMENT = {
    "nodeSelector": {KIND_LABEL: KIND},
    "tolerations": [{"key": KIND_LABEL, "operator": "Equal", "value": KIND,
                     "effect": "NoSchedule"}],
}
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted"
              for mode in ("enforce", "warn", "audit")}


class NodeJourney(Journey):
    """The journey with the job's pods in containers on the real node."""

    def __init__(self, cluster: Cluster, namespace: str, tmp: Path, node: RealNode,
                 image: str) -> None:
        super().__init__(cluster, namespace, tmp)
        self.node, self.image = node, image
        self.timings: dict[str, float] = {}

    def adapt(self, pod_spec: dict, container: dict) -> None:
        container["image"], container["imagePullPolicy"] = self.image, "Never"
        pod_spec.update(copy.deepcopy(PLACEMENT))

    def signal(self, pod: dict, sig: int) -> None:
        assert self.node.signal_container(pod, sig) > 0

    def log(self, pod: str) -> str:
        return self.core.read_namespaced_pod_log(pod, self.ns)

    def timed(self, name: str, phase: str, **kwargs: object) -> dict:
        """Wait for ``phase`` and note how long the job took from its creation."""
        tj = self.phase(name, phase, **kwargs)  # type: ignore[arg-type]
        created = datetime.fromisoformat(tj["metadata"]["creationTimestamp"])
        self.timings[f"{name}_s"] = round(
            (datetime.now(UTC) - created).total_seconds(), 1)
        return tj


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> str:
    """The CPU image of the current sources (built at collection by ``conftest``)."""
    error = request.config.stash.get(IMAGE_BUILD_ERROR, None)
    if error:
        pytest.fail(error)
    built = inspect("cpu", podman_env())
    if built is None:
        pytest.fail("the CPU image is not built: run e2e/image.sh")
    return built.ref


@pytest.fixture(scope="module")
def journey(cluster: Cluster, real_node: RealNode, image: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeJourney]:
    """The image imported into the node, the chart installed from it in a namespace of
    its own at the ``restricted`` level, and the job's S3 Secret naming the store's
    address as the node's pods reach it."""
    t0 = time.monotonic()
    archive = save_archive(image, podman_env())
    saved = time.monotonic() - t0
    real_node.import_archive(archive)
    imported = time.monotonic() - t0 - saved
    s3 = urllib.parse.urlsplit(cluster.s3.endpoint)
    endpoint = f"http://{real_node.expose(s3.port, 's3')}"
    repository, tag = image.rsplit(":", 1)
    ns = f"real-journey-{uuid.uuid4().hex[:6]}"
    tmp = tmp_path_factory.mktemp("real-journey")
    values = {
        "rbac": {"scope": "namespace"},
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        **copy.deepcopy(PLACEMENT),
        # Read the chief's progress often: these runs are short.
        "extraEnv": [{"name": "FLOWMILL_PROGRESS_SECONDS", "value": "1"}],
        "s3_endpoint": endpoint,
        "namespace_labels": RESTRICTED,
    }
    t1 = time.monotonic()
    with installed(cluster, ns, tmp, values):
        j = NodeJourney(cluster, ns, tmp, real_node, image)
        j.timings |= {"image_save_s": round(saved, 1), "image_import_s": round(imported, 1),
                      "helm_install_s": round(time.monotonic() - t1, 1),
                      "image_mb": round(archive.stat().st_size / 2**20)}
        yield j
        (cluster.log_dir / "real-node-journey.json").write_text(json.dumps(j.timings))
        print(json.dumps({"real_node_journey": j.timings}))


def on_node(journey: NodeJourney, pod: dict) -> None:
    """The pod ran on the real node, in a container from the image, with an address of
    the node's pod network."""
    assert pod["spec"]["nodeName"] == journey.node.name == NODE_NAME
    (container,) = pod["spec"]["containers"]
    assert container["image"] == journey.image, container["image"]
    status = pod["status"]["containerStatuses"][0]
    assert status["containerID"].startswith("containerd://"), status
    assert ipaddress.ip_address(pod["status"]["podIP"]) in journey.node.pod_cidr


def test_operator_runs_from_the_image(journey: NodeJourney) -> None:
    """The chart's Deployment pod: the image, the chart's command, the real node, and the
    API server reached in-cluster, through the ``kubernetes`` Service."""
    (pod,) = journey.pods(OPERATOR_LABEL)
    assert pod["status"]["phase"] == "Running"
    on_node(journey, pod)
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "flowmill.operator"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # Ready (helm --wait) can come a moment before kopf logs its start-up's end.
    eventually("the operator's start-up in its log", lambda: "Activity 'start' succeeded" in
               journey.log(pod["metadata"]["name"]), 60)


def test_digits_job_succeeds_in_containers(journey: NodeJourney) -> None:
    name = "digits"
    journey.apply(name, max_steps=600)
    tj = journey.timed(name, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 0, status
    chief = journey.log(f"{name}-worker-0")
    assert "global step 600" in chief, chief[-2000:]
    assert accuracy(chief) > 0.85, chief[-2000:]
    found = journey.checkpoints(name)
    assert max(found) == 600 and sorted(found) == [400, 500, 600], found
    manifest = journey.read_json(found[600])
    assert sorted(s["name"] for s in manifest["shards"]) == ["ps-0", "ps-1"]
    assert status["progress"]["step"] > 0 and status["lastCheckpoint"]["step"] % 100 == 0
    # Worker 0 stays, Succeeded (the kubelet may report the pod's phase a moment after its
    # container's exit, which the operator acted on), on the node.
    pod = eventually("worker 0's pod Succeeded", lambda: (
        p if (p := journey.live_pods(name)[f"{name}-worker-0"])["status"]["phase"] ==
        "Succeeded" else None), 60)
    on_node(journey, pod)
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed", terminated


def test_killed_worker_container_is_recreated(journey: NodeJourney) -> None:
    name = "digits-worker-lost"
    journey.apply(name, max_steps=1000)
    journey.wait_checkpoint(name)
    victim = f"{name}-worker-1"
    old = journey.kill(name, victim)
    eventually(f"a new pod for {victim}", lambda: (
        (pod := journey.live_pods(name).get(victim)) and pod["metadata"]["uid"] != old),
        TIMEOUT)
    tj = journey.timed(name, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 1, status
    assert status["replicaStatuses"]["worker"]["restarts"] == 1, status
    assert status["replicaStatuses"].get("ps", {}).get("restarts", 0) == 0, status
    restarting = journey.events(name).get("RestartingTasks", [])
    assert any(victim in m and "137" in m for m in restarting), restarting
    assert "global step 1000" in journey.log(f"{name}-worker-0")


def test_killed_ps_container_restarts_the_job_from_its_checkpoint(
    journey: NodeJourney,
) -> None:
    name = "digits-ps-lost"
    journey.apply(name, max_steps=1000)
    first = journey.wait_checkpoint(name)
    before = uids(journey.live_pods(name))
    journey.kill(name, f"{name}-ps-0")
    tj = journey.timed(name, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 1, journey.events(name)
    # Which end reaches the operator first is the kubelet's affair (it reports each pod's
    # status on its own): the ps task's (137), or that of a worker which lost it and asked
    # for the whole job to restart (75). Either restarts the job, once.
    restarts = {r: s.get("restarts", 0) for r, s in status["replicaStatuses"].items()}
    assert sum(restarts.values()) == 1, status
    restarting = journey.events(name).get("RestartingJob", [])
    assert len(restarting) == 1 and (f"{name}-ps-0) exited with code 137" in restarting[0]
                                     or "exited with code 75" in restarting[0]), restarting
    assert not set(before.values()) & set(uids(journey.live_pods(name)).values())
    chief = journey.log(f"{name}-worker-0")
    restored = RESTORED.search(chief)
    assert restored and int(restored.group(1)) >= first, chief[-3000:]
    assert "global step 1000" in chief, chief[-3000:]


def test_operator_pod_deleted_mid_run(journey: NodeJourney) -> None:
    name = "digits-operator-lost"
    journey.apply(name, max_steps=1000)
    journey.wait_checkpoint(name)
    tasks = uids(journey.live_pods(name))
    assert len(tasks) == 4
    seen = TaskPods(journey, name)
    on_node(journey, journey.replace_operator(seen))
    tj = journey.timed(name, "Succeeded", each=seen)
    # Never two pods for one task; the new operator took the job over as it stood.
    assert len(seen.most) == 4 and max(seen.most.values()) == 1, seen.most
    assert seen.ever == {n: {u} for n, u in tasks.items()}, seen.ever
    assert uids(journey.live_pods(name)).items() <= tasks.items()
    assert tj["status"]["restartCount"] == 0


def test_task_over_its_memory_limit_is_oom_killed(journey: NodeJourney) -> None:
    """A worker that outgrows its memory limit is killed by the kernel (the container's
    cgroup), the kubelet reports ``OOMKilled`` with exit code 137, and the operator's
    ExitCode policy reads it: retryable, so the task is recreated until ``backoffLimit``,
    then the job fails, saying so."""
    name = "oom"
    grow = "import time; b = b'x' * (512 << 20); time.sleep(60)"
    job = {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 0},
                "worker": {"replicas": 1, "restartPolicy": "ExitCode", "template": {"spec": {
                    "containers": [{
                        "name": "flowmill", "image": journey.image,
                        "command": ["python", "-c", grow],
                        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                                      "limits": {"memory": "128Mi"}}}]}}},
            },
            "runPolicy": {"backoffLimit": 1},
        },
    }
    journey.adapt(job["spec"]["replicaSpecs"]["worker"]["template"]["spec"],
                  job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0])
    journey.cluster.kubectl("apply", "-n", journey.ns, "-f", "-", input=yaml.safe_dump(job))
    tj = journey.timed(name, "Failed")
    failed = condition(tj, "Failed")
    assert failed is not None and failed["reason"] == "BackoffLimitExceeded", tj["status"]
    assert "exited with code 137 (OOMKilled)" in failed["message"], failed
    assert tj["status"]["restartCount"] == 1, tj["status"]
    restarting = journey.events(name).get("RestartingTasks", [])
    assert any("137 (OOMKilled)" in m for m in restarting), restarting
