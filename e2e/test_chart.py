"""The operator's Helm chart on the real control plane: install, permissions, uninstall.

The node stand-in runs a container's command as a local process and pulls no image, so the
operator container's command is replaced with a small Python process. It reports the
arguments the chart gave it and what its ServiceAccount token may do, then idles until
SIGTERM; everything else (Deployment, ServiceAccount, RBAC, the CRD) is the chart's own.
The namespaces are labelled for the `restricted` Pod Security Standard, so the apiserver
refuses the pod if the chart's security context falls short of it.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .cluster import Cluster, free_port
from .polling import REFUSED, eventually

pytestmark = pytest.mark.e2e


REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "flowmill"
CRD_FILE = REPO / "crds" / "trainingjobs.flowmill.dev.yaml"
CRD_NAME = "trainingjobs.flowmill.dev"
RELEASE = "fm"
FULLNAME = "fm-flowmill"

STAND_IN = """
    import json, os, signal, sys, time
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("argv", json.dumps(sys.argv[1:]), flush=True)
    print("pod-id", os.environ["POD_ID"], flush=True)
    ns = os.environ["POD_NAMESPACE"]
    config.load_kube_config()  # the stand-in's kubeconfig holds the pod's SA token
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()

    def attempt(what, call):
        try:
            call()
            print(what, "allowed", flush=True)
        except ApiException as err:
            print(what, err.status, flush=True)

    attempt("list-pods", lambda: core.list_namespaced_pod(ns))
    attempt("list-trainingjobs", lambda: custom.list_namespaced_custom_object(
        "flowmill.dev", "{version}", ns, "trainingjobs"))
    attempt("list-secrets", lambda: core.list_namespaced_secret(ns))
    print("done", flush=True)
    while True:
        time.sleep(3600)
"""



def served_version() -> str:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))


class Release:
    """One helm release of the chart in a namespace; uninstalled at the end if still there."""

    def __init__(self, cluster: Cluster, namespace: str, tmp: Path) -> None:
        self.cluster, self.namespace, self.tmp = cluster, namespace, tmp
        self.installed = False
        self.sa = f"system:serviceaccount:{namespace}:{FULLNAME}"

    def install(self, code: str = STAND_IN, **values: object) -> None:
        code = textwrap.dedent(code).replace("{version}", served_version())
        doc = {"image": {"repository": "flowmill", "tag": "e2e"},
               "command": ["python", "-c", code], **values}
        path = self.tmp / "values.json"
        path.write_text(json.dumps(doc))  # JSON is valid YAML
        self.cluster.helm("install", RELEASE, str(CHART), "-n", self.namespace, "-f",
                          str(path), "--wait", "--timeout", "180s")
        self.installed = True

    def uninstall(self) -> None:
        self.cluster.helm("uninstall", RELEASE, "-n", self.namespace, "--wait",
                          "--timeout", "180s")
        self.installed = False

    def pod(self) -> dict:
        out = self.cluster.kubectl("get", "pods", "-n", self.namespace, "-l",
                                   f"app.kubernetes.io/instance={RELEASE}", "-o", "json")
        (pod,) = json.loads(out.stdout)["items"]
        return pod

    def log(self) -> dict[str, str]:
        """The stand-in's report, once it has finished: {first word: rest of the line}."""
        name = self.pod()["metadata"]["name"]

        def report() -> str | None:
            text = self.cluster.pod_log(self.namespace, name)
            return text if "\ndone" in text else None

        text = str(eventually("the stand-in's report", report))
        return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)

    def can(self, verb: str, resource: str, *where: str) -> bool:
        """``kubectl auth can-i`` as the operator's ServiceAccount (``where``: -n X / -A).

        ``resource`` may name a subresource (``pods/exec``); kubectl would read the part
        after the slash as an object name, so it goes in ``--subresource``.
        """
        resource, _, sub = resource.partition("/")
        extra = [f"--subresource={sub}"] if sub else []
        out = self.cluster.kubectl("auth", "can-i", verb, resource, *extra, f"--as={self.sa}",
                                   *(where or ("-n", self.namespace)), check=False)
        answer = out.stdout.strip()
        assert answer in ("yes", "no"), out.stderr
        return answer == "yes"


@pytest.fixture
def release(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Release]:
    cluster.kubectl("label", "namespace", namespace,
                    "pod-security.kubernetes.io/enforce=restricted")
    rel = Release(cluster, namespace, tmp_path)
    try:
        yield rel
    finally:
        if rel.installed:
            cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout",
                         "120s", check=False)


# What the operator must be able to do in a namespace it watches, and must not.
ALLOWED = [
    ("get", "trainingjobs.flowmill.dev"), ("list", "trainingjobs.flowmill.dev"),
    ("watch", "trainingjobs.flowmill.dev"), ("patch", "trainingjobs.flowmill.dev"),
    ("update", "trainingjobs.flowmill.dev"), ("delete", "trainingjobs.flowmill.dev"),
    ("patch", "trainingjobs.flowmill.dev/status"), ("update", "trainingjobs.flowmill.dev/status"),
    ("update", "trainingjobs.flowmill.dev/finalizers"),
    ("create", "pods"), ("delete", "pods"), ("watch", "pods"),
    ("create", "services"), ("delete", "services"), ("list", "services"),
    ("create", "events"), ("patch", "events"), ("create", "events.events.k8s.io"),
    ("get", "secrets"), ("create", "secrets"), ("update", "secrets"),  # <job>-tls
]
DENIED = [
    ("list", "secrets"), ("watch", "secrets"), ("create", "trainingjobs.flowmill.dev"),
    ("deletecollection", "trainingjobs.flowmill.dev"), ("update", "pods"), ("patch", "pods"),
    ("create", "pods/exec"), ("get", "pods/log"), ("patch", "pods/status"),
    ("update", "services"), ("create", "configmaps"),
    ("create", "deployments.apps"), ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("delete", "events"), ("list", "kopfpeerings.kopf.dev"),
    ("create", "trainingjobs.flowmill.dev/status"), ("delete", "trainingjobs.flowmill.dev/status"),
]


def check_permissions(rel: Release, *where: str) -> None:
    granted = {(v, r): rel.can(v, r, *where) for v, r in ALLOWED + DENIED}
    assert [k for k in ALLOWED if not granted[k]] == []
    assert [k for k in DENIED if granted[k]] == []
    crds = "customresourcedefinitions.apiextensions.k8s.io"
    assert rel.can("list", crds) and rel.can("watch", crds)
    assert not rel.can("create", crds) and not rel.can("delete", crds)
    assert not rel.can("delete", "nodes") and not rel.can("get", "namespaces")
    assert not rel.can("delete", "namespaces") and not rel.can("create", "namespaces")


def check_operator_pod(rel: Release, expected_args: list[str]) -> None:
    pod = rel.pod()
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    report = rel.log()
    assert json.loads(report["argv"]) == expected_args
    assert report["pod-id"] == pod["metadata"]["name"]
    # The token the pod runs with is the chart's ServiceAccount's, under the chart's RBAC.
    assert report["list-pods"] == "allowed"
    assert report["list-trainingjobs"] == "allowed"
    assert report["list-secrets"] == "403"


def check_crd_established(cluster: Cluster) -> None:
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}",
                    "--timeout=60s")
    crd = cluster.get("crd", CRD_NAME)
    assert crd is not None and crd["spec"]["names"]["kind"] == "TrainingJob"


def test_namespace_scope_install(cluster: Cluster, namespace: str, release: Release) -> None:
    release.install(rbac={"create": True, "scope": "namespace"})
    check_crd_established(cluster)
    check_operator_pod(release, [f"--namespace={namespace}", "--standalone",
                                 "--liveness=http://0.0.0.0:8080/healthz"])
    crd_role = f"{namespace}-{FULLNAME}-observe"
    for kind, name, ns in [("serviceaccount", FULLNAME, namespace),
                           ("role", FULLNAME, namespace), ("rolebinding", FULLNAME, namespace),
                           ("clusterrole", crd_role, None),
                           ("clusterrolebinding", crd_role, None)]:
        assert cluster.get(kind, name, ns) is not None, f"{kind} {name} missing"
    assert cluster.get("clusterrole", f"{namespace}-{FULLNAME}") is None

    check_permissions(release)
    # Nothing outside the release's namespace, except reading CRDs and namespaces.
    assert not release.can("create", "pods", "-n", "default")
    assert not release.can("list", "trainingjobs.flowmill.dev", "-A")
    assert release.can("list", "namespaces") and release.can("watch", "namespaces")

    release.uninstall()
    for kind, name, ns in [("deployment", FULLNAME, namespace),
                           ("serviceaccount", FULLNAME, namespace),
                           ("role", FULLNAME, namespace), ("rolebinding", FULLNAME, namespace),
                           ("clusterrole", crd_role, None),
                           ("clusterrolebinding", crd_role, None)]:
        assert cluster.get(kind, name, ns) is None, f"{kind} {name} left behind"
    eventually("the operator pod to go", lambda: not json.loads(cluster.kubectl(
        "get", "pods", "-n", namespace, "-o", "json").stdout)["items"])
    assert cluster.get("crd", CRD_NAME) is not None  # Helm never deletes CRDs


def test_cluster_scope_install(cluster: Cluster, namespace: str, release: Release) -> None:
    release.install(metrics={"service": {"enabled": True, "port": 9090}})
    check_crd_established(cluster)
    check_operator_pod(release, ["--all-namespaces", "--standalone",
                                 "--liveness=http://0.0.0.0:8080/healthz"])
    name = f"{namespace}-{FULLNAME}"
    assert cluster.get("clusterrole", name) is not None
    binding = cluster.get("clusterrolebinding", name)
    assert binding is not None and binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": namespace}]
    assert cluster.get("role", FULLNAME, namespace) is None
    svc = cluster.get("service", f"{FULLNAME}-metrics", namespace)
    assert svc is not None and svc["spec"]["ports"][0]["targetPort"] == "metrics"

    check_permissions(release)
    check_permissions(release, "-n", "default")  # every namespace, not only its own
    assert release.can("list", "trainingjobs.flowmill.dev", "-A")
    assert release.can("watch", "pods", "-A")
    assert not release.can("list", "secrets", "-A")
    assert not release.can("list", "clusterkopfpeerings.kopf.dev")  # standalone: no peering
    assert not release.can("list", "namespaces")  # --all-namespaces does not list them

    release.uninstall()
    assert cluster.get("clusterrole", name) is None
    assert cluster.get("clusterrolebinding", name) is None
    assert cluster.get("service", f"{FULLNAME}-metrics", namespace) is None
    assert cluster.get("crd", CRD_NAME) is not None


# kopf itself, with the chart's arguments and a handler that uses what the operator uses:
# progress annotations and a finalizer on the TrainingJob, its status subresource, Events,
# a Service owned by the job.
KOPF_OPERATOR = """
    import sys
    import kopf
    from kopf.cli import main
    from kubernetes import client, config

    @kopf.on.startup()
    def login(**_):
        config.load_kube_config()

    @kopf.on.create("flowmill.dev", "trainingjobs")
    def created(body, name, namespace, patch, **_):
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name + "-probe"},
               "spec": {"clusterIP": "None", "selector": {"job": name},
                        "ports": [{"port": 2222}]}}
        kopf.adopt(svc)
        client.CoreV1Api().create_namespaced_service(namespace, svc)
        kopf.info(body, reason="Probed", message="created " + name + "-probe")
        patch.status["observedGeneration"] = body.metadata["generation"]

    @kopf.on.delete("flowmill.dev", "trainingjobs")
    def deleted(name, namespace, **_):
        client.CoreV1Api().delete_namespaced_service(name + "-probe", namespace)

    sys.argv = ["kopf", "run", *sys.argv[1:]]
    main()
"""


@pytest.mark.parametrize("scope", ["namespace", "cluster"])
def test_kopf_runs_under_the_chart_rbac(cluster: Cluster, namespace: str, release: Release,
                                        scope: str) -> None:
    port = free_port()  # the liveness endpoint binds 0.0.0.0 on this host
    release.install(KOPF_OPERATOR, rbac={"create": True, "scope": scope},
                    liveness={"port": port, "path": "/healthz"}, kopfArgs=["--verbose"])
    check_crd_established(cluster)
    job = {"apiVersion": f"flowmill.dev/{served_version()}", "kind": "TrainingJob",
           "metadata": {"name": "probe"},
           "spec": {"replicaSpecs": {"worker": {"template": {"spec": {"containers": [
               {"name": "flowmill", "image": "flowmill:e2e"}]}}}}}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(job))

    def handled() -> dict | None:
        tj = cluster.get("trainingjob", "probe", namespace) or {}
        return tj if tj.get("status", {}).get("observedGeneration") == 1 else None

    tj = eventually("the create handler's status patch", handled)
    assert isinstance(tj, dict) and tj["metadata"].get("finalizers"), tj["metadata"]
    svc = cluster.get("service", "probe-probe", namespace)
    assert svc is not None
    assert svc["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]

    def probed_event() -> bool:  # kopf posts Events from a queue, after the handler returns
        events = json.loads(cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=probe",
            "-o", "json").stdout)["items"]
        return "Probed" in {e["reason"] for e in events}

    eventually("the handler's Event", probed_event, timeout=60)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200

    cluster.kubectl("delete", "trainingjob", "-n", namespace, "probe", "--timeout=60s")
    assert cluster.get("service", "probe-probe", namespace) is None
    log = cluster.pod_log(namespace, release.pod()["metadata"]["name"])
    # Nothing kopf asked for was refused (a refused namespace listing alone would stall
    # its start for about a minute).
    refused = [ln for ln in log.splitlines() if REFUSED.search(ln)]
    assert refused == [], "\n".join(refused)
    assert "Traceback" not in log, log[-3000:]
    release.uninstall()
