"""Pods on the real node (``e2e.realnode``): the kubelet, containerd and runc, not the stand-in.

Each pod names the node (``spec.nodeName: real-0``), so no scheduler is involved, and runs
the hand-made busybox image (``e2e.ociimage``) that the node imported at start
(``imagePullPolicy: Never``).
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

import pytest
from kubernetes import client, watch

from .cluster import Cluster
from .polling import eventually
from .realnode import BUSYBOX_IMAGE, KIND, KIND_LABEL, RealNode

pytestmark = pytest.mark.e2e

RESTRICTED = {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
              "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pod(node: RealNode, name: str, script: str, *, memory: str = "32Mi",
        restart: str = "Never", grace: int | None = None, **container: Any) -> dict:
    """A one-container busybox pod bound to the real node, running ``sh -c script``."""
    spec: dict[str, Any] = {
        "nodeName": node.name, "restartPolicy": restart,
        "containers": [{
            "name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", script],
            "resources": {"limits": {"memory": memory, "cpu": "250m"}},
            **container,
        }],
    }
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def apply(cluster: Cluster, namespace: str, *objs: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def container_status(p: dict) -> dict:
    return p["status"]["containerStatuses"][0]


def test_node_registered(cluster: Cluster, real_node: RealNode) -> None:
    """Registered by the kubelet itself: Ready, labelled and tainted for opt-in use, with
    the node's own address and containerd as its runtime."""
    node = cluster.get("node", real_node.name)
    assert node is not None
    assert node["metadata"]["labels"][KIND_LABEL] == KIND
    assert {"key": KIND_LABEL, "value": KIND, "effect": "NoSchedule"} in node["spec"]["taints"]
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == cluster.versions["KUBERNETES_VERSION"]
    assert info["containerRuntimeVersion"].startswith("containerd://1.")
    assert {"type": "InternalIP", "address": real_node.node_ip} in node["status"]["addresses"]


def test_pod_runs_and_logs_through_the_kubelet(cluster: Cluster, real_node: RealNode,
                                               namespace: str) -> None:
    """Running (held there until `kubectl exec` lets it go), then Succeeded, in a containerd
    container; `kubectl logs` reads its output through the kubelet's API."""
    script = ("echo hello from $(hostname); i=0; "
              "while [ ! -e /work/done ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done; "
              "echo released")
    hello = pod(real_node, "hello", script,
                volumeMounts=[{"name": "work", "mountPath": "/work"}])
    hello["spec"]["volumes"] = [{"name": "work", "emptyDir": {}}]
    apply(cluster, namespace, hello)
    p = cluster.wait_pod(namespace, "hello", ("Running",))
    assert container_status(p)["containerID"].startswith("containerd://")
    assert p["status"]["hostIP"] == real_node.node_ip
    # exec: apiserver -> kubelet -> containerd's streaming server (logs: apiserver -> kubelet).
    cluster.kubectl("exec", "-n", namespace, "hello", "--", "touch", "/work/done")
    p = cluster.wait_pod(namespace, "hello", ("Succeeded", "Failed"))
    term = container_status(p)["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (0, "Completed")
    logs = cluster.kubectl("logs", "-n", namespace, "hello").stdout
    assert logs.splitlines() == ["hello from hello", "released"]


def test_pod_is_non_root_read_only_without_capabilities(cluster: Cluster, real_node: RealNode,
                                                        namespace: str) -> None:
    """The image's user (1000) with runAsNonRoot, a read-only root file system and every
    capability dropped: as the container sees itself."""
    script = ("echo uid=$(id -u) gid=$(id -g); "
              "if touch /probe 2>/dev/null; then echo root-writable; else echo root-read-only; fi; "
              "grep -E '^Cap(Eff|Prm|Bnd):' /proc/self/status")
    apply(cluster, namespace, pod(real_node, "restricted", script, securityContext=RESTRICTED))
    p = cluster.wait_pod(namespace, "restricted", ("Succeeded", "Failed"))
    logs = cluster.kubectl("logs", "-n", namespace, "restricted").stdout
    assert p["status"]["phase"] == "Succeeded", logs
    assert "uid=1000 gid=1000" in logs
    assert "root-read-only" in logs and "root-writable" not in logs
    caps = dict(re.findall(r"^(Cap\w+):\s+([0-9a-f]+)$", logs, re.MULTILINE))
    assert caps == {"CapEff": "0" * 16, "CapPrm": "0" * 16, "CapBnd": "0" * 16}, logs


def test_pod_has_its_own_ip_and_network_namespace(cluster: Cluster, real_node: RealNode,
                                                  namespace: str) -> None:
    """The CNI bridge gives the pod a network namespace of its own (not the node's) and an
    address from the node's pod range (not the node's address), reported as status.podIP."""
    script = "readlink /proc/self/ns/net; ip -4 -o addr show dev eth0"
    apply(cluster, namespace, pod(real_node, "net", script))
    p = cluster.wait_pod(namespace, "net", ("Succeeded", "Failed"))
    logs = cluster.kubectl("logs", "-n", namespace, "net").stdout
    assert p["status"]["phase"] == "Succeeded", logs
    netns = re.search(r"net:\[(\d+)\]", logs)
    assert netns, logs
    assert int(netns.group(1)) != real_node.netns_inode()
    inet = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", logs)
    assert inet, logs
    ip = inet.group(1)
    assert p["status"]["podIP"] == ip != real_node.node_ip
    assert ipaddress.IPv4Address(ip) in real_node.pod_cidr


def test_memory_limit_oom_kill(cluster: Cluster, real_node: RealNode, namespace: str) -> None:
    """A container that touches 256 MiB under a 32 MiB limit is killed by the kernel's OOM
    killer in its cgroup and reported OOMKilled, exit code 137: in state.terminated when it
    is not restarted, in lastState when it is."""
    script = "exec dd if=/dev/zero of=/dev/null bs=256M count=1"
    apply(cluster, namespace, pod(real_node, "oom", script),
          pod(real_node, "oom-again", script, restart="Always"))
    p = cluster.wait_pod(namespace, "oom", ("Failed", "Succeeded"))
    term = container_status(p)["state"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("OOMKilled", 137), term

    def last_oom() -> dict | None:
        got = cluster.get("pod", "oom-again", namespace)
        statuses = (got or {}).get("status", {}).get("containerStatuses") or [{}]
        return statuses[0].get("lastState", {}).get("terminated")
    last = eventually("oom-again's lastState", last_oom, timeout=120)
    assert (last["reason"], last["exitCode"]) == ("OOMKilled", 137), last


def test_sigterm_and_grace_period(cluster: Cluster, real_node: RealNode,
                                  namespace: str) -> None:
    """Deleting a pod sends SIGTERM: one that traps it writes its termination message and
    exits 0 by itself; one that ignores it is SIGKILLed (137) once
    terminationGracePeriodSeconds has run out."""
    ready = "echo ready; while :; do sleep 1; done"
    apply(cluster, namespace,
          pod(real_node, "trapper", "trap 'echo got SIGTERM > /dev/termination-log; exit 0' "
              f"TERM; {ready}", grace=30),
          pod(real_node, "stubborn", f"trap '' TERM; {ready}", grace=3))
    for name in ("trapper", "stubborn"):
        cluster.wait_pod(namespace, name, ("Running",))
        eventually(f"{name} ready", lambda n=name: "ready" in cluster.kubectl(
            "logs", "-n", namespace, n).stdout, timeout=60)
    core = client.CoreV1Api(cluster.api())
    rv = core.list_namespaced_pod(namespace).metadata.resource_version
    cluster.kubectl("delete", "pod", "trapper", "stubborn", "-n", namespace, "--wait=false")
    # Every version of the two pods until they are gone. The last one, DELETED, carries
    # the final container state the kubelet reported; the first with a deletionTimestamp,
    # the deadline the grace period set (the kubelet's final delete moves it to "now").
    final: dict[str, Any] = {}
    deadline: dict[str, Any] = {}
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_pod, namespace, resource_version=rv,
                       timeout_seconds=120):
        meta = ev["object"].metadata
        if meta.deletion_timestamp and meta.name not in deadline:
            deadline[meta.name] = meta.deletion_timestamp
        if ev["type"] == "DELETED":
            final[meta.name] = ev["object"]
            if len(final) == 2:
                w.stop()
    assert set(final) == {"trapper", "stubborn"}, "pods not deleted within 120 s"

    trapped = final["trapper"].status.container_statuses[0].state.terminated
    assert (trapped.exit_code, trapped.reason) == (0, "Completed")
    assert trapped.message.strip() == "got SIGTERM"

    killed = final["stubborn"].status.container_statuses[0].state.terminated
    assert (killed.exit_code, killed.reason) == (137, "Error")
    assert not killed.message
    # The deadline is the deletion time plus the grace period: SIGKILL came after it
    # (the kubelet starts its grace timer only once it sees the deletion).
    assert killed.finished_at >= deadline["stubborn"]
