"""The TrainingJob CRD on a real kube-apiserver: defaults, validation, update rules,
``kubectl explain`` and the printer columns.

The CRD is cluster-wide and stays installed for the rest of the session (applying it is
idempotent); every job lives in the test's own namespace.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flowmill.operator.api import SpecError, TrainingJob, TrainingJobSpec
from flowmill.operator.manifests import owner_reference
from flowmill.operator.status import observe

from .cluster import Cluster
from .polling import eventually

pytestmark = pytest.mark.e2e

CRD = Path(__file__).resolve().parents[1] / "crds" / "trainingjobs.flowmill.dev.yaml"
CRD_NAME = "trainingjobs.flowmill.dev"

TEMPLATE = {"spec": {"containers": [{"name": "flowmill", "image": "flowmill:dev",
                                     "command": ["python", "train.py"],
                                     "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
SPEC = {
    "replicaSpecs": {"ps": {"replicas": 1}, "worker": {"replicas": 2, "template": TEMPLATE}},
    "checkpoint": {"uri": "s3://flowmill-e2e/mnist", "secretRef": {"name": "s3-creds"}},
}


def job_manifest(name: str = "mnist", spec: dict | None = None) -> str:
    return json.dumps({"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": name}, "spec": spec or SPEC})



@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> str:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    return CRD_NAME


def test_crd_is_served(cluster: Cluster, crd: str) -> None:
    out = cluster.kubectl("api-resources", "--api-group=flowmill.dev", "-o", "wide").stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("trainingjobs"))
    assert " tj " in line and "TrainingJob" in line and "flowmill" in line
    cluster.kubectl("get", "flowmill")  # the category answers


def test_valid_job_gets_the_defaults(cluster: Cluster, namespace: str, crd: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job_manifest())
    stored = cluster.get("tj", "mnist", namespace)
    spec = stored["spec"]
    assert spec["replicaSpecs"]["ps"]["restartPolicy"] == "ExitCode"
    assert spec["replicaSpecs"]["worker"]["restartPolicy"] == "OnFailure"
    assert spec["training"] == {"mode": "sync", "backupWorkers": 0}
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3,
                                 "suspend": False, "terminationGracePeriodSeconds": 60,
                                 "gangScheduling": False}
    assert spec["successPolicy"] == "ChiefWorker"
    assert spec["checkpoint"]["intervalSteps"] == 100 and spec["checkpoint"]["keep"] == 5
    assert spec["checkpoint"]["secretRef"] == {
        "name": "s3-creds", "accessKeyIdKey": "AWS_ACCESS_KEY_ID",
        "secretAccessKeyKey": "AWS_SECRET_ACCESS_KEY"}
    # The template is kept whole (GPU limits and all).
    assert spec["replicaSpecs"]["worker"]["template"] == TEMPLATE
    # The Python API fills in exactly what the API server does.
    assert TrainingJobSpec.from_dict(SPEC).to_dict() == spec
    assert TrainingJob.from_dict(stored).spec == TrainingJobSpec.from_dict(spec)


def with_(path: str, value: object, spec: dict | None = None) -> dict:
    spec = copy.deepcopy(spec or SPEC)
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return spec


INVALID = [
    ("backup workers >= workers", "mnist", with_("training", {"backupWorkers": 2}),
     "spec.training.backupWorkers: Invalid value",
     "must be less than spec.replicaSpecs.worker.replicas"),
    ("unknown mode", "mnist", with_("training", {"mode": "fast"}),
     "spec.training.mode: Unsupported value: \"fast\"", "bounded-staleness"),
    ("negative replicas", "mnist", with_("replicaSpecs.ps.replicas", -1),
     "spec.replicaSpecs.ps.replicas", "greater than or equal to 0"),
    ("no workers", "mnist", with_("replicaSpecs.worker.replicas", 0),
     "spec.replicaSpecs.worker.replicas", "greater than or equal to 1"),
    ("a million workers", "mnist", with_("replicaSpecs.worker.replicas", 1_000_000),
     "spec.replicaSpecs.worker.replicas", "less than or equal to 1000"),
    ("bad summary uri", "mnist", with_("training", {"summaryUri": "gs://bucket/logs"}),
     "spec.training.summaryUri", "should match '^(s3|file)://'"),
    ("staleness outside bounded-staleness", "mnist", with_("training", {"staleness": 2}),
     "spec.training.staleness", "applies to mode bounded-staleness only"),
    ("bounded-staleness without staleness", "mnist",
     with_("training", {"mode": "bounded-staleness"}),
     "spec.training.staleness", "mode bounded-staleness needs staleness"),
    ("backup workers in async mode", "mnist",
     with_("training", {"mode": "async", "backupWorkers": 1}),
     "spec.training.backupWorkers", "applies to mode sync only"),
    ("distributed without ps", "mnist", with_("replicaSpecs.ps.replicas", 0),
     "spec.replicaSpecs", "needs ps.replicas >= 1"),
    ("bad checkpoint uri", "mnist", with_("checkpoint.uri", "gs://bucket"),
     "spec.checkpoint.uri", "should match '^(s3|file|memory)://'"),
    ("container without image", "mnist",
     with_("replicaSpecs.worker.template", {"spec": {"containers": [{"name": "x"}]}}),
     "spec.replicaSpecs.worker.template.spec.containers[0].image", "Required value"),
    ("name too long for its task names", "a" * 60, SPEC, "metadata.name must be a DNS-1035",
     "fits in 63 characters"),
    ("unknown field", "mnist", with_("training.speed", "fast"),
     'unknown field "spec.training.speed"', "strict decoding error"),
    ("unknown restart policy", "mnist", with_("replicaSpecs.worker.restartPolicy", "Always"),
     "spec.replicaSpecs.worker.restartPolicy: Unsupported value: \"Always\"", "ExitCode"),
    ("replicas not a number", "mnist", with_("replicaSpecs.ps.replicas", "two"),
     "spec.replicaSpecs.ps.replicas", "must be of type integer"),
    ("checkpoint interval of 0", "mnist", with_("checkpoint.intervalSteps", 0),
     "spec.checkpoint.intervalSteps", "greater than or equal to 1"),
    ("negative backoffLimit", "mnist", with_("runPolicy", {"backoffLimit": -1}),
     "spec.runPolicy.backoffLimit", "greater than or equal to 0"),
    ("stall timeout of 0", "mnist", with_("runPolicy", {"stallTimeoutSeconds": 0}),
     "spec.runPolicy.stallTimeoutSeconds", "greater than or equal to 1"),
]


@pytest.mark.parametrize("name,spec,where,message", [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_jobs_are_refused(cluster: Cluster, namespace: str, crd: str, name: str,
                                  spec: dict, where: str, message: str) -> None:
    out = cluster.kubectl("create", "-n", namespace, "-f", "-",
                          input=job_manifest(name, spec), check=False)
    assert out.returncode != 0, out.stdout
    assert where in out.stderr and message in out.stderr, out.stderr
    assert cluster.get("tj", name, namespace) is None
    # The Python API refuses the same manifests (the local launcher runs no API server).
    with pytest.raises(SpecError):
        TrainingJob.from_dict(json.loads(job_manifest(name, spec)))


def patch(cluster: Cluster, namespace: str, body: dict, check: bool = True,
          subresource: str | None = None):
    extra = [f"--subresource={subresource}"] if subresource else []
    return cluster.kubectl("patch", "-n", namespace, "tj", "mnist", "--type=merge",
                           "-p", json.dumps(body), *extra, check=check)


def test_running_job_keeps_its_shape(cluster: Cluster, namespace: str, crd: str) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=job_manifest())
    refused = patch(cluster, namespace, {"spec": {"training": {"mode": "async"}}}, check=False)
    assert refused.returncode != 0
    assert "spec.training: Invalid value" in refused.stderr
    assert "cannot change while the job may be running" in refused.stderr
    refused = patch(cluster, namespace,
                    {"spec": {"replicaSpecs": {"worker": {"replicas": 3}}}}, check=False)
    assert refused.returncode != 0 and "spec.replicaSpecs: Invalid value" in refused.stderr
    # runPolicy stays mutable.
    patch(cluster, namespace, {"spec": {"runPolicy": {"backoffLimit": 5}}})
    patch(cluster, namespace, {"spec": {"runPolicy": {"suspend": True}}})
    # Once suspended, the shape may change, and resuming may come with the change.
    patch(cluster, namespace, {"spec": {"training": {"mode": "async"}}})
    patch(cluster, namespace, {"spec": {"replicaSpecs": {"worker": {"replicas": 3}},
                                        "runPolicy": {"suspend": False}}})
    spec = cluster.get("tj", "mnist", namespace)["spec"]
    assert spec["training"]["mode"] == "async"
    assert spec["replicaSpecs"]["worker"]["replicas"] == 3
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 5,
                                 "suspend": False, "terminationGracePeriodSeconds": 60,
                                 "gangScheduling": False}
    refused = patch(cluster, namespace, {"spec": {"training": {"mode": "sync"}}}, check=False)
    assert refused.returncode != 0


def test_explain_teaches_the_api(cluster: Cluster, crd: str) -> None:
    def explain() -> str | None:
        out = cluster.kubectl("explain", "trainingjob.spec.training", check=False)
        return out.stdout if out.returncode == 0 else None

    text = eventually("kubectl explain to know TrainingJob", explain)
    for words in ("How the workers' updates are combined", "backupWorkers", "staleness",
                  "maxSteps", "enum: sync, async, bounded-staleness"):
        assert words in text, text
    policy = cluster.kubectl("explain",
                             "trainingjob.spec.replicaSpecs.worker.restartPolicy").stdout
    assert "ExitCode" in policy and "143 SIGTERM" in policy
    run_policy = cluster.kubectl("explain", "tj.spec.runPolicy", "--recursive").stdout
    for field in ("cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                  "backoffLimit", "suspend", "terminationGracePeriodSeconds"):
        assert field in run_policy
    spec = cluster.kubectl("explain", "tj.spec").stdout
    assert "enum: ChiefWorker, AllWorkers" in spec, spec
    success = cluster.kubectl("explain", "tj.spec.successPolicy").stdout
    assert "TFJob" in success and "AllWorkers:" in success, success


def test_printer_columns_and_status(cluster: Cluster, namespace: str, crd: str) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=job_manifest())
    stored = cluster.get("tj", "mnist", namespace)
    # A status as the operator computes it, for two running workers and a running ps.
    pods = []
    for role, index in (("ps", 0), ("worker", 0), ("worker", 1)):
        pods.append({
            "metadata": {"name": f"mnist-{role}-{index}", "labels": {
                "flowmill.dev/job-name": "mnist", "flowmill.dev/replica-type": role,
                "flowmill.dev/replica-index": str(index),
                "flowmill.dev/restart-generation": "1"},
                "ownerReferences": [owner_reference(TrainingJob.of(stored))]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "flowmill", "state": {"running": {}}}]}})
    status = observe(stored, pods, datetime.now(UTC)).to_dict()
    status.update(restartCount=2, progress={"step": 1234, "loss": 0.5},
                  lastCheckpoint={"step": 1200, "uri": "s3://flowmill-e2e/mnist/1200",
                                  "time": "2025-01-01T00:00:00Z"},
                  kopf={"progress": {"create_fn": {"started": "x"}}})
    patch(cluster, namespace, {"status": status}, subresource="status")

    # Nothing the operator writes is pruned (kopf's own keys included).
    assert cluster.get("tj", "mnist", namespace)["status"] == status

    header, row = cluster.kubectl("get", "tj", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "WORKERS", "STEP", "CHECKPOINT", "RESTARTS",
                              "AGE"]
    assert row.split()[:6] == ["mnist", "Running", "2/2", "1234", "1200", "2"]

    refused = patch(cluster, namespace, {"status": {"phase": "Done"}}, check=False,
                    subresource="status")
    assert refused.returncode != 0 and "status.phase" in refused.stderr
    # The main resource ignores status; the status subresource ignores spec.
    patch(cluster, namespace, {"spec": {"runPolicy": {"suspend": True}},
                               "status": {"phase": "Failed"}})
    after = cluster.get("tj", "mnist", namespace)
    assert after["status"]["phase"] == "Running"
    assert after["spec"]["runPolicy"]["suspend"] is True
