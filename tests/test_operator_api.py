"""The TrainingJob spec in Python: parsing, defaults, validation, and agreement with the CRD."""

import copy
import dataclasses
import json
import pathlib
import typing

import pytest
import yaml

from flowmill.operator import api
from flowmill.operator.api import (
    SpecError,
    TrainingJob,
    TrainingJobSpec,
    TrainingSpec,
    load_manifest,
    to_dict,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "trainingjobs.flowmill.dev.yaml"

WORKER_TEMPLATE = {"spec": {"containers": [
    {"name": "flowmill", "image": "flowmill:dev", "command": ["python", "train.py"],
     "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "2"}}}]}}
SPEC = {"replicaSpecs": {"ps": {"replicas": 2},
                         "worker": {"replicas": 3, "template": WORKER_TEMPLATE}}}


def manifest(spec=None, name="mnist", **metadata):
    return {"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, **metadata}, "spec": copy.deepcopy(spec or SPEC)}


def with_(path, value, spec=None):
    """SPEC with the value at a dotted path set (None deletes it)."""
    spec = copy.deepcopy(spec or SPEC)
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return spec


def test_defaults_fill_in_like_the_crd():
    spec = TrainingJobSpec.from_dict(SPEC)
    assert spec.replica_specs.ps.replicas == 2
    assert spec.replica_specs.ps.restart_policy == "ExitCode"
    assert spec.replica_specs.worker.restart_policy == "OnFailure"
    assert spec.replica_specs.chief is None
    assert spec.training == TrainingSpec(mode="sync", backup_workers=0)
    assert spec.checkpoint is None
    rp = spec.run_policy
    assert (rp.clean_pod_policy, rp.backoff_limit, rp.suspend) == ("Running", 3, False)
    assert rp.ttl_seconds_after_finished is None and rp.active_deadline_seconds is None
    assert spec.success_policy == "ChiefWorker"
    assert spec.tasks() == [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)]


def test_checkpoint_and_secret_defaults():
    spec = TrainingJobSpec.from_dict(with_("checkpoint", {
        "uri": "s3://bucket/run", "secretRef": {"name": "s3"}}))
    ck = spec.checkpoint
    assert (ck.uri, ck.interval_steps, ck.keep) == ("s3://bucket/run", 100, 5)
    ref = ck.secret_ref
    assert (ref.name, ref.access_key_id_key, ref.secret_access_key_key) == (
        "s3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    assert ref.endpoint_key is None and ref.region_key is None


def test_to_dict_round_trips():
    spec = TrainingJobSpec.from_dict(with_("training", {"mode": "bounded-staleness",
                                                        "staleness": 2, "maxSteps": 10}))
    again = TrainingJobSpec.from_dict(spec.to_dict())
    assert again == spec
    assert spec.to_dict()["training"] == {"mode": "bounded-staleness", "backupWorkers": 0,
                                          "staleness": 2, "maxSteps": 10}


INVALID = [
    ("worker replicas 0", with_("replicaSpecs.worker.replicas", 0),
     "spec.replicaSpecs.worker.replicas: must be >= 1, got 0"),
    ("negative ps replicas", with_("replicaSpecs.ps.replicas", -1),
     "spec.replicaSpecs.ps.replicas: must be >= 0, got -1"),
    ("two chiefs", with_("replicaSpecs.chief", {"replicas": 2}),
     "spec.replicaSpecs.chief.replicas: must be <= 1, got 2"),
    ("a million workers", with_("replicaSpecs.worker.replicas", 1_000_000),
     "spec.replicaSpecs.worker.replicas: must be <= 1000, got 1000000"),
    ("a million ps tasks", with_("replicaSpecs.ps.replicas", 1_000_000),
     "spec.replicaSpecs.ps.replicas: must be <= 1000, got 1000000"),
    ("replicas a string", with_("replicaSpecs.worker.replicas", "3"),
     "spec.replicaSpecs.worker.replicas: must be an integer, got '3'"),
    ("replicas a bool", with_("replicaSpecs.worker.replicas", True),
     "spec.replicaSpecs.worker.replicas: must be an integer, got True"),
    ("unknown restart policy", with_("replicaSpecs.worker.restartPolicy", "Always"),
     "spec.replicaSpecs.worker.restartPolicy: must be one of Never, OnFailure, ExitCode, "
     "got 'Always'"),
    ("unknown success policy", with_("successPolicy", "AllPS"),
     "spec.successPolicy: must be one of ChiefWorker, AllWorkers, got 'AllPS'"),
    ("unknown mode", with_("training", {"mode": "fast"}),
     "spec.training.mode: must be one of sync, async, bounded-staleness, got 'fast'"),
    ("no worker", with_("replicaSpecs.worker", None), "spec.replicaSpecs.worker: required"),
    ("no worker template", with_("replicaSpecs.worker.template", None),
     "spec.replicaSpecs.worker.template: required"),
    ("no containers", with_("replicaSpecs.worker.template", {"spec": {"containers": []}}),
     "spec.replicaSpecs.worker.template.spec.containers: must have at least 1 item"),
    ("container without image",
     with_("replicaSpecs.ps.template", {"spec": {"containers": [{"name": "x"}]}}),
     "spec.replicaSpecs.ps.template.spec.containers[0].image: required"),
    ("template without spec", with_("replicaSpecs.worker.template", {"metadata": {}}),
     "spec.replicaSpecs.worker.template.spec: required"),
    ("unknown field", with_("replicaSpecs.worker.replica", 2),
     "spec.replicaSpecs.worker.replica: unknown field"),
    ("unknown role", with_("replicaSpecs.evaluator", {"replicas": 1}),
     "spec.replicaSpecs.evaluator: unknown field"),
    ("bad uri", with_("checkpoint", {"uri": "gs://bucket"}),
     "spec.checkpoint.uri: must match ^(s3|file|memory)://, got 'gs://bucket'"),
    ("checkpoint without uri", with_("checkpoint", {"keep": 2}), "spec.checkpoint.uri: required"),
    ("keep 0", with_("checkpoint", {"uri": "memory://", "keep": 0}),
     "spec.checkpoint.keep: must be >= 1, got 0"),
    ("empty secret name", with_("checkpoint", {"uri": "s3://b", "secretRef": {"name": ""}}),
     "spec.checkpoint.secretRef.name: must not be empty"),
    ("bad clean policy", with_("runPolicy", {"cleanPodPolicy": "Some"}),
     "spec.runPolicy.cleanPodPolicy: must be one of All, Running, None, got 'Some'"),
    ("negative backoff", with_("runPolicy", {"backoffLimit": -1}),
     "spec.runPolicy.backoffLimit: must be >= 0, got -1"),
    ("suspend a string", with_("runPolicy", {"suspend": "yes"}),
     "spec.runPolicy.suspend: must be a boolean, got 'yes'"),
    ("deadline 0", with_("runPolicy", {"activeDeadlineSeconds": 0}),
     "spec.runPolicy.activeDeadlineSeconds: must be >= 1, got 0"),
    ("stall timeout 0", with_("runPolicy", {"stallTimeoutSeconds": 0}),
     "spec.runPolicy.stallTimeoutSeconds: must be >= 1, got 0"),
    ("training not an object", with_("training", "sync"),
     "spec.training: must be an object, got 'sync'"),
    # The CRD's CEL rules.
    ("backup workers >= workers", with_("training", {"backupWorkers": 3}),
     "spec.training.backupWorkers: must be less than spec.replicaSpecs.worker.replicas (3), "
     "got 3"),
    ("backup workers in async", with_("training", {"mode": "async", "backupWorkers": 1}),
     "spec.training.backupWorkers: applies to mode sync only"),
    ("staleness in sync", with_("training", {"staleness": 1}),
     "spec.training.staleness: applies to mode bounded-staleness only"),
    ("bounded staleness without staleness", with_("training", {"mode": "bounded-staleness"}),
     "spec.training.staleness: required by mode bounded-staleness"),
    ("distributed without ps", with_("replicaSpecs.ps.replicas", 0),
     "spec.replicaSpecs.ps.replicas: a job with more than one training task"),
    ("worker plus chief without ps",
     with_("replicaSpecs", {"worker": {"template": WORKER_TEMPLATE}, "chief": {}}),
     "spec.replicaSpecs.ps.replicas: a job with more than one training task"),
]


@pytest.mark.parametrize("spec,message", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_specs_name_the_field(spec, message):
    with pytest.raises(SpecError) as e:
        TrainingJobSpec.from_dict(spec)
    assert any(err.startswith(message) for err in e.value.errors), e.value.errors


def test_every_error_is_reported_at_once():
    spec = with_("runPolicy", {"backoffLimit": -1},
                 with_("replicaSpecs.worker.replicas", 0))
    with pytest.raises(SpecError) as e:
        TrainingJobSpec.from_dict(spec)
    assert len(e.value.errors) == 2
    assert "backoffLimit" in str(e.value) and "worker.replicas" in str(e.value)


def test_a_single_worker_needs_no_ps():
    spec = TrainingJobSpec.from_dict({"replicaSpecs": {"worker": {"template": WORKER_TEMPLATE}}})
    assert spec.tasks() == [("worker", 0)]
    assert spec.replica_specs.replicas("ps") == 0


@pytest.mark.parametrize("name,ok", [
    ("mnist", True), ("a" * 54, True), ("a" * 55, False), ("a.b", False),
    ("1abc", False), ("ab-", False), ("Mnist", False)])
def test_job_name_leaves_room_for_task_names(name, ok):
    # 3 workers: the longest task is <name>-worker-2, 9 characters more than the name.
    if ok:
        assert TrainingJob.from_dict(manifest(name=name)).name == name
    else:
        with pytest.raises(SpecError, match="metadata.name"):
            TrainingJob.from_dict(manifest(name=name))


def test_training_job_from_dict():
    obj = manifest(namespace="ml", uid="u-1", generation=4)
    obj["status"] = {"phase": "Running"}
    job = TrainingJob.from_dict(obj)
    assert (job.name, job.namespace, job.uid, job.generation) == ("mnist", "ml", "u-1", 4)
    assert job.status == {"phase": "Running"} and not job.deleting
    assert TrainingJob.of(job) is job
    assert TrainingJob.from_dict(manifest()).namespace == "default"
    obj["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert TrainingJob.from_dict(obj).deleting


def test_training_job_rejects_other_kinds():
    obj = manifest()
    obj["kind"] = "TFJob"
    obj["apiVersion"] = "kubeflow.org/v1"
    with pytest.raises(SpecError) as e:
        TrainingJob.from_dict(obj)
    assert "apiVersion: must be flowmill.dev/v1alpha1" in str(e.value)
    assert "kind: must be TrainingJob" in str(e.value)
    with pytest.raises(SpecError, match="spec: required"):
        TrainingJob.from_dict({"kind": "TrainingJob", "metadata": {"name": "x"}})


def test_template_fallbacks():
    spec = TrainingJobSpec.from_dict(with_("replicaSpecs.chief", {}))
    ps = spec.template_for("ps")["spec"]["containers"][0]
    assert ps["image"] == "flowmill:dev"
    assert "command" not in ps
    assert ps["resources"] == {"limits": {"cpu": "2"}}  # no GPUs for a ps task
    assert spec.template_for("chief") == WORKER_TEMPLATE
    assert spec.template_for("worker") == WORKER_TEMPLATE
    # Copies: changing one changes nothing else.
    spec.template_for("worker")["spec"]["containers"].clear()
    assert spec.replica_specs.worker.template == WORKER_TEMPLATE
    own = {"spec": {"containers": [{"name": "ps", "image": "ps:1"}]}}
    spec = TrainingJobSpec.from_dict(with_("replicaSpecs.ps.template", own))
    assert spec.template_for("ps") == own


def test_ps_without_gpus_drops_empty_resources():
    only_gpu = {"spec": {"containers": [
        {"name": "flowmill", "image": "i", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}
    spec = TrainingJobSpec.from_dict(with_("replicaSpecs.worker.template", only_gpu))
    assert "resources" not in spec.template_for("ps")["spec"]["containers"][0]


def test_main_container_is_named_flowmill_else_first():
    assert api.main_container_index({"spec": {"containers": [{"name": "a"}]}}) == 0
    assert api.main_container_index(
        {"spec": {"containers": [{"name": "sidecar"}, {"name": "flowmill"}]}}) == 1


def test_training_env_round_trip():
    training = TrainingSpec(mode="bounded-staleness", staleness=3, max_steps=100)
    env = {api.ENV_TRAINING: training.to_json()}
    assert TrainingSpec.from_env(env) == training
    assert training.runtime_mode == "bounded_staleness"
    assert TrainingSpec.from_env({}) == TrainingSpec()
    with pytest.raises(SpecError, match="FLOWMILL_TRAINING: not valid JSON"):
        TrainingSpec.from_env({api.ENV_TRAINING: "{"})
    with pytest.raises(SpecError, match="FLOWMILL_TRAINING.staleness"):
        TrainingSpec.from_env({api.ENV_TRAINING: json.dumps({"mode": "bounded-staleness"})})


def test_runtime_modes_match():
    from flowmill.runtime.replicas import MODES
    assert sorted(TrainingSpec(mode=m).runtime_mode for m in api.MODES) == sorted(MODES)


# ---- load_manifest


def test_load_manifest(tmp_path):
    path = tmp_path / "job.yaml"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3"}}
    path.write_text(yaml.safe_dump_all([secret, manifest()]))
    job = load_manifest(path)
    assert job.name == "mnist" and job.spec.replica_specs.worker.replicas == 3


@pytest.mark.parametrize("text,message", [
    ("", "expected exactly one TrainingJob, found 0"),
    ("kind: Secret\n", "expected exactly one TrainingJob, found 0 (documents: ['Secret'])"),
    (yaml.safe_dump_all([manifest(), manifest(name="other")]),
     "expected exactly one TrainingJob, found 2"),
    ("a: [1,\n", "not valid YAML"),
    (yaml.safe_dump(manifest(with_("replicaSpecs.worker.replicas", 0))),
     "spec.replicaSpecs.worker.replicas: must be >= 1, got 0"),
])
def test_load_manifest_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_manifest(path)
    assert str(e.value).startswith(f"{path}: ")
    assert message in str(e.value)


def test_load_manifest_missing_file(tmp_path):
    with pytest.raises(SpecError, match="nope.yaml: cannot read"):
        load_manifest(tmp_path / "nope.yaml")


# ---- the CRD is the definition: the dataclasses must agree with it


def crd():
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema():
    (version,) = crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


JSON_TYPES = {int: "integer", str: "string", bool: "boolean", dict: "object"}


def _walk(cls, node, path, seen):
    """Check a dataclass against a CRD schema node, recursively."""
    props = node["properties"]
    fields = {f.metadata["json"]: f for f in dataclasses.fields(cls)}
    assert set(props) == set(fields), f"{path}: CRD {sorted(props)} vs Python {sorted(fields)}"
    required = set(node.get("required", ()))
    hints = typing.get_type_hints(cls)
    for name, f in fields.items():
        prop, where = props[name], f"{path}.{name}"
        seen.append(where)
        assert prop.get("description"), f"{where}: no description in the CRD"
        is_required = (f.default is dataclasses.MISSING
                       and f.default_factory is dataclasses.MISSING)
        assert (name in required) == is_required, f"{where}: required differs"
        kind = api._unoptional(hints[f.name])
        if dataclasses.is_dataclass(kind):
            assert prop["type"] == "object", where
            if f.default_factory is not dataclasses.MISSING:
                assert prop.get("default") == to_dict(f.default_factory()), where
            else:
                assert "default" not in prop, where
            _walk(kind, prop, where, seen)
            continue
        md = f.metadata
        assert prop["type"] == JSON_TYPES[kind], where
        if f.default in (None, dataclasses.MISSING):
            assert "default" not in prop, f"{where}: CRD has a default, Python none"
        else:
            assert prop.get("default") == f.default, f"{where}: default differs"
        assert prop.get("enum") == (list(md["enum"]) if md["enum"] else None), where
        assert prop.get("minimum") == md["minimum"], f"{where}: minimum differs"
        assert prop.get("maximum") == md["maximum"], f"{where}: maximum differs"
        assert prop.get("minLength") == md["min_length"], where
        pattern = md["pattern"].pattern if md["pattern"] else None
        assert prop.get("pattern") == pattern, f"{where}: pattern differs"
        if kind is dict:  # a pod template: free-form below what the CRD checks
            assert prop["x-kubernetes-preserve-unknown-fields"] is True, where


def test_dataclasses_agree_with_the_crd():
    schema = crd_schema()
    seen = []
    _walk(TrainingJobSpec, schema["properties"]["spec"], "spec", seen)
    assert "spec.replicaSpecs.chief.replicas" in seen and "spec.runPolicy.suspend" in seen
    assert list(schema["properties"]["spec"]["properties"]["replicaSpecs"]["properties"]) == \
        ["ps", "worker", "chief"] and set(api.ROLES) == {"ps", "worker", "chief"}


def test_crd_identity():
    doc = crd()
    spec = doc["spec"]
    assert doc["metadata"]["name"] == f"{api.PLURAL}.{api.GROUP}"
    assert spec["group"] == api.GROUP
    assert spec["names"]["kind"] == api.KIND and spec["names"]["plural"] == api.PLURAL
    assert spec["names"]["shortNames"] == ["tj"]
    (version,) = spec["versions"]
    assert version["name"] == api.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_crd_describes_every_field():
    """kubectl explain teaches the API: every declared property has a description."""
    missing = []

    def visit(node, path):
        for name, prop in (node.get("properties") or {}).items():
            where = f"{path}.{name}"
            is_object_meta = where == ".metadata"  # described by Kubernetes itself
            if not is_object_meta and not prop.get("description"):
                missing.append(where)
            visit(prop, where)
        if isinstance(node.get("items"), dict):
            visit(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            visit(node["additionalProperties"], f"{path}.*")

    visit(crd_schema(), "")
    assert not missing, missing
