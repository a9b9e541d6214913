"""Smoke tests of the e2e harness itself: the control plane, node stand-in, helm and S3.

Every wait polls with a generous deadline; nothing asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import secrets
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from .cluster import Cluster
from .polling import eventually

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parent / "charts" / "smoke"


def pod_manifest(name: str, code: str, restart: str = "Never", **extra: object) -> str:
    """A Pod running ``python -c code`` (JSON is valid YAML for ``kubectl apply``)."""
    container = {"name": "main", "image": "python:3.11-slim",
                 "command": ["python", "-c", textwrap.dedent(code)]}
    container.update(extra.pop("container", {}))  # type: ignore[arg-type]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, **extra.pop("metadata", {})},  # type: ignore[dict-item]
           "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5,
                    "containers": [container], **extra}}
    return json.dumps(pod)



def test_pod_succeeds(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "hello", "import os; print('hello from', os.environ['POD_NAME'])",
        container={"env": [{"name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}))
    pod = cluster.wait_pod(namespace, "hello", ("Succeeded", "Failed"))
    assert pod["status"]["phase"] == "Succeeded"
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 0 and state["reason"] == "Completed"
    assert "hello from hello" in cluster.pod_log(namespace, "hello")
    assert pod["status"]["podIP"].startswith("127.")


def test_kubectl_logs(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    input=pod_manifest("talker", "print('line one'); print('line two')"))
    cluster.wait_pod(namespace, "talker", ("Succeeded",))
    out = cluster.kubectl("logs", "-n", namespace, "talker").stdout
    assert out.splitlines() == ["line one", "line two"]


def test_failing_pod_reports_exit_code(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    input=pod_manifest("fails", "import sys; print('bye'); sys.exit(3)"))
    pod = cluster.wait_pod(namespace, "fails", ("Succeeded", "Failed"))
    assert pod["status"]["phase"] == "Failed"
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3 and state["reason"] == "Error"


def test_on_failure_restarts_in_place(cluster: Cluster, namespace: str) -> None:
    # Fails on the first run, succeeds on the second: the marker file survives restarts.
    code = """
        import os, sys
        marker = os.path.join(os.environ["HOME"], "ran-once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(7)
        print("second run")
    """
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    input=pod_manifest("flaky", code, restart="OnFailure"))
    pod = cluster.wait_pod(namespace, "flaky", ("Succeeded", "Failed"))
    assert pod["status"]["phase"] == "Succeeded"
    cs = pod["status"]["containerStatuses"][0]
    assert cs["restartCount"] == 1
    assert cs["lastState"]["terminated"]["exitCode"] == 7


def test_always_restarts_crashing_container(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "crasher", "import sys; print('crash', flush=True); sys.exit(2)", restart="Always"))

    def restarted_twice() -> dict | None:
        pod = cluster.get("pod", "crasher", namespace)
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount", 0) >= 2 else None

    pod = eventually("two restarts", restarted_twice)
    assert isinstance(pod, dict) and pod["status"]["phase"] == "Running"
    cs = pod["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 2
    assert "crash" in cluster.pod_log(namespace, "crasher", restart=0)
    previous = cluster.kubectl("logs", "-n", namespace, "crasher", "--previous").stdout
    assert previous.strip() == "crash"


def test_env_from_secret_configmap_and_init_container(cluster: Cluster, namespace: str) -> None:
    code = """
        import os
        for k in ("FROM_SECRET", "FROM_CM", "MY_NS", "MY_IP", "CM_ALL_x", "EXPANDED"):
            print(k, os.environ.get(k))
        print("init said", open(os.environ["HOME"] + "/../init-out").read())
    """
    env = [
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
        {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "x"}}},
        {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "EXPANDED", "value": "ns=$(MY_NS)"},
    ]
    init = {"name": "init", "image": "python:3.11-slim", "command": [
        "python", "-c", "import os; open(os.environ['HOME'] + '/../init-out', 'w').write('hi')"]}
    # Created before its Secret exists: the container waits (CreateContainerConfigError).
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "envy", code, initContainers=[init],
        container={"env": env, "envFrom": [{"configMapRef": {"name": "cm"},
                                             "prefix": "CM_ALL_"}]}))
    cluster.kubectl("create", "configmap", "-n", namespace, "cm", "--from-literal=x=from-cm")
    cluster.kubectl("create", "secret", "generic", "-n", namespace, "s",
                    "--from-literal=pw=s3cret")
    pod = cluster.wait_pod(namespace, "envy", ("Succeeded", "Failed"))
    log = cluster.pod_log(namespace, "envy", "main")
    assert pod["status"]["phase"] == "Succeeded", log
    assert "FROM_SECRET s3cret" in log and "FROM_CM from-cm" in log
    assert f"MY_NS {namespace}" in log and f"MY_IP {pod['status']['podIP']}" in log
    assert "CM_ALL_x from-cm" in log and f"EXPANDED ns={namespace}" in log
    assert "init said hi" in log


def test_pod_that_does_not_fit_stays_pending(cluster: Cluster, namespace: str) -> None:
    """The kube-scheduler, not the node stand-in, says why: no node has the CPU."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "huge", "print('never')", container={"resources": {"requests": {"cpu": "1000"}}}))

    def unschedulable() -> dict | None:
        pod = cluster.get("pod", "huge", namespace) or {}
        conds = pod.get("status", {}).get("conditions", [])
        return next((c for c in conds if c["type"] == "PodScheduled"
                     and c.get("reason") == "Unschedulable"), None)

    cond = eventually("the Unschedulable condition", unschedulable)
    assert f"0/{len(cluster.node_names)} nodes are available" in cond["message"], cond
    assert "Insufficient cpu" in cond["message"], cond
    pod = cluster.get("pod", "huge", namespace)
    assert pod is not None and pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_scheduler_places_pods_by_zone_and_gpus(cluster: Cluster, namespace: str) -> None:
    """The stand-in's nodes are real Node objects, each in its own zone with
    ``nvidia.com/gpu`` capacity: the scheduler follows a zone selector, and places GPU
    requests only where GPUs are left."""
    nodes = {n: cluster.get("node", n) for n in cluster.node_names}
    zones = {n: node["metadata"]["labels"]["topology.kubernetes.io/zone"]
             for n, node in nodes.items()}
    assert len(set(zones.values())) == len(nodes), zones
    gpus = {n: int(node["status"]["allocatable"]["nvidia.com/gpu"]) for n, node in nodes.items()}
    assert all(g >= 1 for g in gpus.values()), gpus
    last = cluster.node_names[-1]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "zoned", "print('here')", nodeSelector={"topology.kubernetes.io/zone": zones[last]}))
    pod = cluster.wait_pod(namespace, "zoned", ("Succeeded", "Failed"))
    assert pod["spec"]["nodeName"] == last and pod["status"]["phase"] == "Succeeded"
    # One more GPU than the cluster has: every pod but one is placed, each on a node with
    # a GPU left; the last waits, the scheduler saying why.
    total = sum(gpus.values())
    for i in range(total + 1):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
            f"gpu-{i}", "import time; time.sleep(600)",
            container={"resources": {"limits": {"nvidia.com/gpu": 1}}}))

    def placed() -> dict[str, str] | None:
        pods = {f"gpu-{i}": cluster.get("pod", f"gpu-{i}", namespace) or {}
                for i in range(total + 1)}
        bound = {n: p["spec"].get("nodeName") for n, p in pods.items()
                 if p.get("spec", {}).get("nodeName")}
        waiting = [p for p in pods.values() if any(
            c.get("reason") == "Unschedulable" for c in p.get("status", {}).get(
                "conditions", []))]
        return bound if len(bound) == total and len(waiting) == 1 else None

    bound = eventually("every GPU taken and one pod waiting", placed)
    assert Counter(bound.values()) == {n: g for n, g in gpus.items() if g}, bound


def test_delete_kills_process(cluster: Cluster, namespace: str) -> None:
    code = """
        import os, signal, sys, time
        def on_term(*_):
            print("got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("pid", os.getpid(), flush=True)
        time.sleep(3600)
    """
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest("sleeper", code))
    cluster.wait_pod(namespace, "sleeper", ("Running",))
    line = eventually("the pid line", lambda: next(
        (ln for ln in cluster.pod_log(namespace, "sleeper").splitlines()
         if ln.startswith("pid ")), None))
    pid = int(str(line).split()[1])
    os.kill(pid, 0)  # alive
    cluster.kubectl("delete", "pod", "-n", namespace, "sleeper", "--timeout=120s")
    assert cluster.get("pod", "sleeper", namespace) is None

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    eventually("the process to exit", gone)
    assert "got SIGTERM" in cluster.pod_log(namespace, "sleeper")


def test_delete_sigkills_after_grace_period(cluster: Cluster, namespace: str) -> None:
    code = """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pid", os.getpid(), flush=True)
        time.sleep(3600)
    """
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "stubborn", code, terminationGracePeriodSeconds=2))
    cluster.wait_pod(namespace, "stubborn", ("Running",))
    line = eventually("the pid line", lambda: next(
        (ln for ln in cluster.pod_log(namespace, "stubborn").splitlines()
         if ln.startswith("pid ")), None))
    pid = int(str(line).split()[1])
    cluster.kubectl("delete", "pod", "-n", namespace, "stubborn", "--timeout=120s")
    assert cluster.get("pod", "stubborn", namespace) is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_helm_install_runs_deployment(cluster: Cluster, namespace: str) -> None:
    cluster.helm("install", "smoke", str(CHART), "-n", namespace, "--wait",
                 "--timeout", "180s")
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l",
                          "app.kubernetes.io/instance=smoke", "-o", "json").stdout
    pods = json.loads(out)["items"]
    assert len(pods) == 1 and pods[0]["status"]["phase"] == "Running"
    name = pods[0]["metadata"]["name"]
    eventually("the chart's message in the pod log",
               lambda: "hello from the smoke chart" in cluster.pod_log(namespace, name))
    cluster.helm("uninstall", "smoke", "-n", namespace, "--wait", "--timeout", "180s")
    eventually("the Deployment's pods to go", lambda: not json.loads(cluster.kubectl(
        "get", "pods", "-n", namespace, "-o", "json").stdout)["items"])


def test_service_name_resolves_to_pod_ip(cluster: Cluster, namespace: str) -> None:
    server = """
        import http.server, os
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b"served by " + os.environ["POD_IP"].encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)
        http.server.HTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
    """
    ip_env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest(
        "web", server, restart="Always", metadata={"labels": {"app": "web"}},
        container={"env": ip_env}))
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"clusterIP": "None", "selector": {"app": "web"},
                    "ports": [{"port": 8080}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(svc))
    web_ip = cluster.wait_pod(namespace, "web", ("Running",))["status"]["podIP"]
    client = f"""
        import socket, time, urllib.request
        for name in ("web", "web.{namespace}", "web.{namespace}.svc",
                     "web.{namespace}.svc.cluster.local"):
            print(name, socket.gethostbyname(name), flush=True)
        for _ in range(120):
            try:
                print(urllib.request.urlopen("http://web.{namespace}.svc:8080/").read().decode())
                break
            except OSError:
                time.sleep(0.5)
    """
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest("client", client))
    pod = cluster.wait_pod(namespace, "client", ("Succeeded", "Failed"))
    log = cluster.pod_log(namespace, "client")
    assert pod["status"]["phase"] == "Succeeded", log
    resolved = dict(line.split() for line in log.splitlines()[:4])
    assert set(resolved.values()) == {web_ip}, log
    assert f"served by {web_ip}" in log


def test_pod_api_access_follows_rbac(cluster: Cluster, namespace: str) -> None:
    code = """
        import subprocess, sys
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
        config.load_kube_config()
        try:
            client.CoreV1Api().list_namespaced_pod("{ns}")
            print("allowed")
        except ApiException as err:
            print("status", err.status)
    """.replace("{ns}", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest("probe1", code))
    cluster.wait_pod(namespace, "probe1", ("Succeeded",))
    assert "status 403" in cluster.pod_log(namespace, "probe1")
    cluster.kubectl("create", "rolebinding", "-n", namespace, "default-view",
                    "--clusterrole=view", f"--serviceaccount={namespace}:default")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod_manifest("probe2", code))
    cluster.wait_pod(namespace, "probe2", ("Succeeded",))
    assert "allowed" in cluster.pod_log(namespace, "probe2")


def test_s3_roundtrip_with_obstore(cluster: Cluster) -> None:
    store = cluster.s3.store()
    data = secrets.token_bytes(3 * 2**20 + 17)
    key = f"smoke/{secrets.token_hex(4)}.bin"
    store.put(key, data)
    assert bytes(store.get(key).bytes()) == data
    assert any(m["path"] == key for batch in store.list("smoke/") for m in batch)


def test_deleting_owner_deletes_dependents(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "-n", namespace, "owner", "--from-literal=a=1")
    owner = cluster.get("configmap", "owner", namespace)
    assert owner is not None
    dependent = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dependent", "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
            "uid": owner["metadata"]["uid"]}]},
        "data": {"b": "2"},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dependent))
    cluster.kubectl("delete", "configmap", "-n", namespace, "owner")
    eventually("the garbage collector to delete the dependent",
               lambda: cluster.get("configmap", "dependent", namespace) is None)
