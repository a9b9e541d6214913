"""The chart's optional ValidatingAdmissionPolicy (``admissionPolicy.enabled``) on the real
control plane: TrainingJobs whose pod templates ask for host namespaces, hostPath volumes,
privileged containers or capabilities beyond Pod Security's baseline set are refused by
the apiserver, with a message naming each field; everything else is accepted.

The jobs are ``examples/digits/job.yaml`` with one change each, applied with ``kubectl
apply``. The operator container runs an idle stand-in (nothing here needs it to act); the
policy is the apiserver's own. Its policy informer takes a moment after an install, so each
install first polls (bounded) until a forbidden job is refused.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from .cluster import Cluster
from .polling import eventually

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "flowmill"
CRD_FILE = REPO / "crds" / "trainingjobs.flowmill.dev.yaml"
CRD_NAME = "trainingjobs.flowmill.dev"
EXAMPLE = REPO / "examples" / "digits" / "job.yaml"
RELEASE = "fm"
FULLNAME = "fm-flowmill"

IDLE = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)
"""


def policy_name(namespace: str) -> str:
    """Policy and binding are cluster-scoped: named <release namespace>-<full name>."""
    return f"{namespace}-{FULLNAME}"


# -- jobs ---------------------------------------------------------------------------------

Edit = Callable[[dict], None]


def job(name: str, edit: Edit | None = None, *, suspend: bool = False) -> dict:
    """The digits example named ``name``, changed by ``edit`` (which gets its spec)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["runPolicy"]["suspend"] = suspend
    if edit is not None:
        edit(doc["spec"])
    return doc


def pod(spec: dict, role: str) -> dict:
    """The pod spec of ``role``'s template; ps and chief get a template of their own."""
    specs = spec["replicaSpecs"]
    if role != "worker" and "template" not in specs.get(role, {}):
        specs.setdefault(role, {"replicas": 1})["template"] = {"spec": {"containers": [
            {"name": "flowmill", "image": "flowmill:0.1.0"}]}}
    return specs[role]["template"]["spec"]


def setting(role: str, **fields: object) -> Edit:
    return lambda spec: pod(spec, role).update(fields)


def host_path(role: str) -> Edit:
    return setting(role, volumes=[{"name": "scratch", "emptyDir": {}},
                                  {"name": "host-data", "hostPath": {"path": "/data"}}])


def container(role: str, kind: str = "containers", **security: object) -> Edit:
    """``role``'s container (``flowmill``, or a new ``side`` one in another list) with a
    securityContext."""
    def edit(spec: dict) -> None:
        p = pod(spec, role)
        if kind == "containers":
            p["containers"][0]["securityContext"] = security
        else:
            p[kind] = [{"name": "side", "image": "busybox", "securityContext": security}]
    return edit


def at(role: str, field: str) -> str:
    return f"spec.replicaSpecs.{role}.template.spec.{field}"


def apply(cluster: Cluster, namespace: str, doc: dict,
          dry_run: bool = False) -> subprocess.CompletedProcess[str]:
    extra = ["--dry-run=server"] if dry_run else []
    return cluster.kubectl("apply", "-n", namespace, *extra, "-f", "-",
                           input=json.dumps(doc), check=False)


def refused_by_policy(out: subprocess.CompletedProcess[str], namespace: str) -> bool:
    return out.returncode != 0 and f"ValidatingAdmissionPolicy '{policy_name(namespace)}'" in (
        out.stderr)


def wait_until_enforced(cluster: Cluster, release_ns: str, where: str) -> None:
    """Poll (server-side dry runs) until the policy refuses a hostNetwork job in ``where``."""
    probe = job("probe", setting("worker", hostNetwork=True))
    eventually(f"the policy to refuse a hostNetwork job in {where}",
               lambda: refused_by_policy(apply(cluster, where, probe, dry_run=True),
                                         release_ns), timeout=60)


# -- the chart ----------------------------------------------------------------------------

def new_namespace(cluster: Cluster, stem: str) -> str:
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    eventually("the default ServiceAccount", lambda: cluster.get(
        "serviceaccount", "default", name), 60, interval=0.2)
    return name


def install(cluster: Cluster, namespace: str, tmp: Path, **values: object) -> str:
    """``helm install`` with the policy (and an idle operator); returns helm's output."""
    doc = {"image": {"repository": "flowmill", "tag": "e2e"},
           "command": ["python", "-c", textwrap.dedent(IDLE)],
           "admissionPolicy": {"enabled": True, "validationActions": ["Deny"]}, **values}
    path = tmp / "values.json"
    path.write_text(json.dumps(doc))  # JSON is valid YAML
    return cluster.helm("install", RELEASE, str(CHART), "-n", namespace, "-f", str(path),
                        "--wait", "--timeout", "180s").stdout


def uninstall(cluster: Cluster, namespace: str, check: bool = True) -> None:
    cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "120s",
                 check=check)


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


@pytest.fixture(scope="module")
def guarded(cluster: Cluster, crd: None,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A namespace-scope release with the policy, enforced; its namespace holds a suspended
    job with hostNetwork, ``legacy``, created before the install."""
    ns = new_namespace(cluster, "admission-policy")
    try:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(
            job("legacy", setting("worker", hostNetwork=True), suspend=True)))
        install(cluster, ns, tmp_path_factory.mktemp("admission-policy"),
                rbac={"create": True, "scope": "namespace"})
        wait_until_enforced(cluster, ns, ns)
        yield ns
    finally:
        uninstall(cluster, ns, check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# -- refusals -----------------------------------------------------------------------------

# Host namespaces, each in two roles.
HOST_NAMESPACES = [("hostNetwork", "worker"), ("hostNetwork", "ps"), ("hostPID", "worker"),
                   ("hostPID", "chief"), ("hostIPC", "ps"), ("hostIPC", "chief")]
FORBIDDEN = [(f"{role}-{field}", setting(role, **{field: True}),
              at(role, field) + " must not be true") for field, role in HOST_NAMESPACES] + [
    # hostPath volumes.
    ("worker-hostPath", host_path("worker"),
     at("worker", 'volumes["host-data"].hostPath') + " must not be set"),
    ("ps-hostPath", host_path("ps"),
     at("ps", 'volumes["host-data"].hostPath') + " must not be set"),
    # Privileged containers, in every container list.
    ("worker-privileged", container("worker", privileged=True),
     at("worker", 'containers["flowmill"].securityContext.privileged') + " must not be true"),
    ("chief-privileged", container("chief", privileged=True),
     at("chief", 'containers["flowmill"].securityContext.privileged') + " must not be true"),
    ("ps-privileged-init", container("ps", "initContainers", privileged=True),
     at("ps", 'initContainers["side"].securityContext.privileged') + " must not be true"),
    ("worker-privileged-ephemeral", container("worker", "ephemeralContainers", privileged=True),
     at("worker", 'ephemeralContainers["side"].securityContext.privileged') + " must not be true"),
    # Capabilities beyond the baseline set (CHOWN is in it).
    ("worker-capabilities", container("worker", capabilities={"add": ["CHOWN", "SYS_ADMIN"]}),
     at("worker", 'containers["flowmill"].securityContext.capabilities.add')
     + " must not add SYS_ADMIN (beyond the Pod Security baseline set)"),
]


@pytest.mark.parametrize(("edit", "message"), [c[1:] for c in FORBIDDEN],
                         ids=[c[0] for c in FORBIDDEN])
def test_forbidden_template_is_refused(cluster: Cluster, guarded: str, edit: Edit,
                                       message: str) -> None:
    name = f"forbidden-{uuid.uuid4().hex[:6]}"
    out = apply(cluster, guarded, job(name, edit))
    assert refused_by_policy(out, guarded), out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert cluster.get("trainingjob", name, guarded) is None


def test_every_problem_is_named_in_one_refusal(cluster: Cluster, guarded: str) -> None:
    def edit(spec: dict) -> None:
        setting("worker", hostNetwork=True, hostIPC=True)(spec)
        container("chief", privileged=True)(spec)
        host_path("ps")(spec)

    out = apply(cluster, guarded, job("several", edit))
    assert refused_by_policy(out, guarded), out.stderr
    for message in (at("worker", "hostNetwork"), at("worker", "hostIPC"),
                    at("chief", 'containers["flowmill"].securityContext.privileged'),
                    at("ps", 'volumes["host-data"].hostPath')):
        assert message in out.stderr, out.stderr
    assert at("worker", "hostPID") not in out.stderr


# -- what is accepted ---------------------------------------------------------------------

ACCEPTED = [
    ("plain", None),
    # Set, but not to what is refused; privilege escalation is Pod Security's to judge.
    ("false-flags", setting("worker", hostNetwork=False, hostPID=False, hostIPC=False)),
    ("baseline-capability", container("worker", privileged=False,
                                      allowPrivilegeEscalation=True,
                                      capabilities={"add": ["NET_BIND_SERVICE"],
                                                    "drop": ["ALL"]})),
    ("other-volumes", setting("worker", volumes=[{"name": "scratch", "emptyDir": {}}])),
]


@pytest.mark.parametrize("edit", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_allowed_template_is_accepted(cluster: Cluster, guarded: str,
                                      edit: Edit | None) -> None:
    name = f"allowed-{uuid.uuid4().hex[:6]}"
    out = apply(cluster, guarded, job(name, edit))
    assert out.returncode == 0, out.stderr
    assert cluster.get("trainingjob", name, guarded) is not None
    cluster.kubectl("delete", "trainingjob", name, "-n", guarded)


def test_update_adding_host_network_is_refused(cluster: Cluster, guarded: str) -> None:
    # Suspended: the CRD refuses replicaSpecs changes of a job that may be running before
    # any admission policy sees them.
    cluster.kubectl("apply", "-n", guarded, "-f", "-",
                    input=json.dumps(job("updated", suspend=True)))
    out = apply(cluster, guarded, job("updated", setting("worker", hostNetwork=True),
                                      suspend=True))
    assert refused_by_policy(out, guarded), out.stdout + out.stderr
    assert at("worker", "hostNetwork") + " must not be true" in out.stderr
    stored = cluster.get("trainingjob", "updated", guarded)
    assert stored is not None
    assert "hostNetwork" not in stored["spec"]["replicaSpecs"]["worker"]["template"]["spec"]
    # An allowed change of the same job goes through.
    cluster.kubectl("patch", "trainingjob", "updated", "-n", guarded, "--type=merge", "-p",
                    json.dumps({"spec": {"replicaSpecs": {"ps": {"replicas": 1}}}}))


def test_job_from_before_the_policy_is_checked_only_when_its_templates_change(
        cluster: Cluster, guarded: str) -> None:
    """Metadata and other spec changes of ``legacy`` pass (the operator's finalizer and
    annotation patches, a suspension); changing its replicaSpecs is checked."""
    cluster.kubectl("label", "trainingjob", "legacy", "-n", guarded, "team=a")
    cluster.kubectl("patch", "trainingjob", "legacy", "-n", guarded, "--type=merge", "-p",
                    json.dumps({"metadata": {"finalizers": ["flowmill.dev/test"]},
                                "spec": {"runPolicy": {"backoffLimit": 5}}}))
    out = cluster.kubectl("patch", "trainingjob", "legacy", "-n", guarded, "--type=merge",
                          "-p", json.dumps({"spec": {"replicaSpecs": {"ps": {"replicas": 1}}}}),
                          check=False)
    assert refused_by_policy(out, guarded), out.stdout + out.stderr
    assert at("worker", "hostNetwork") + " must not be true" in out.stderr
    cluster.kubectl("delete", "trainingjob", "legacy", "-n", guarded, "--wait=false")
    cluster.kubectl("patch", "trainingjob", "legacy", "-n", guarded, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]))
    eventually("legacy to be deleted",
               lambda: cluster.get("trainingjob", "legacy", guarded) is None, timeout=60)


def test_namespace_scope_binds_only_the_watched_namespaces(cluster: Cluster, guarded: str,
                                                           namespace: str) -> None:
    binding = cluster.get("validatingadmissionpolicybinding", policy_name(guarded))
    assert binding is not None
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [guarded]}]
    out = apply(cluster, namespace, job("elsewhere", setting("worker", hostNetwork=True)),
                dry_run=True)
    assert out.returncode == 0, out.stderr


def test_policy_type_checks_cleanly(cluster: Cluster, guarded: str) -> None:
    """The apiserver checks the expressions against the CRD's schema: no warnings."""
    def checked() -> dict | None:
        policy = cluster.get("validatingadmissionpolicy", policy_name(guarded)) or {}
        status = policy.get("status", {})
        done = status.get("observedGeneration") == policy["metadata"]["generation"]
        return status if done and "typeChecking" in status else None

    status = eventually("the policy's type check", checked, timeout=60)
    assert not status["typeChecking"].get("expressionWarnings"), status


# -- cluster scope and uninstall ----------------------------------------------------------

def test_cluster_scope_binds_every_namespace_until_uninstalled(
        cluster: Cluster, crd: None, namespace: str, tmp_path: Path) -> None:
    elsewhere = new_namespace(cluster, "admission-policy-elsewhere")
    name = policy_name(namespace)
    installed = False
    try:
        notes = install(cluster, namespace, tmp_path)
        installed = True
        notes_line = f"ValidatingAdmissionPolicy {name} (Deny) checks TrainingJobs in every"
        assert f"{notes_line} namespace" in notes, notes
        binding = cluster.get("validatingadmissionpolicybinding", name)
        assert binding is not None and binding["spec"]["policyName"] == name
        assert binding["spec"]["validationActions"] == ["Deny"]
        assert "matchResources" not in binding["spec"]
        wait_until_enforced(cluster, namespace, elsewhere)
        out = apply(cluster, elsewhere, job("elsewhere", host_path("worker")))
        assert refused_by_policy(out, namespace), out.stderr
        assert at("worker", 'volumes["host-data"].hostPath') in out.stderr

        uninstall(cluster, namespace)
        installed = False
        assert cluster.get("validatingadmissionpolicy", name) is None
        assert cluster.get("validatingadmissionpolicybinding", name) is None
        eventually("a hostNetwork job to be accepted again", lambda: apply(
            cluster, elsewhere, job("elsewhere", setting("worker", hostNetwork=True)),
            dry_run=True).returncode == 0, timeout=60)
    finally:
        if installed:
            uninstall(cluster, namespace, check=False)
        cluster.kubectl("delete", "namespace", elsewhere, "--wait=false", check=False)
