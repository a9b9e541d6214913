"""``spec.checkpoint.onCorrupt``: parsed and validated like the CRD, carried to every task
in FLOWMILL_CHECKPOINT_ON_CORRUPT, and read back by the checkpoint policy."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from flowmill.operator.api import SpecError, TrainingJob, TrainingJobSpec
from flowmill.operator.manifests import task_env
from flowmill.runtime.checkpoint_policy import CheckpointConfig
from flowmill.runtime.cluster import ENV_CHECKPOINT_ON_CORRUPT

CRD = pathlib.Path(__file__).resolve().parents[1] / "crds" / "trainingjobs.flowmill.dev.yaml"
WORKER = {"spec": {"containers": [{"name": "flowmill", "image": "flowmill:dev"}]}}


def spec(checkpoint: dict) -> dict:
    return {
        "replicaSpecs": {"ps": {"replicas": 1}, "worker": {"replicas": 1, "template": WORKER}},
        "checkpoint": checkpoint,
    }


def job(checkpoint: dict) -> TrainingJob:
    return TrainingJob.from_dict({
        "apiVersion": "flowmill.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "mnist", "namespace": "ml", "uid": "u-1"},
        "spec": spec(checkpoint),
    })


def test_on_corrupt_defaults_to_fail():
    parsed = TrainingJobSpec.from_dict(spec({"uri": "s3://bucket/run"}))
    assert parsed.checkpoint.on_corrupt == "Fail"


def test_a_wrong_on_corrupt_is_named():
    with pytest.raises(SpecError) as caught:
        TrainingJobSpec.from_dict(spec({"uri": "s3://bucket/run", "onCorrupt": "Ignore"}))
    assert caught.value.errors == [
        "spec.checkpoint.onCorrupt: must be one of Fail, StartFresh, got 'Ignore'"
    ]


@pytest.mark.parametrize("value", ["Fail", "StartFresh"])
def test_on_corrupt_reaches_every_task_and_its_policy(value):
    manifest = job({"uri": "file:///ckpt", "onCorrupt": value})
    for role in ("ps", "worker"):
        env = {e["name"]: e.get("value") for e in task_env(manifest, role, 0)}
        assert env[ENV_CHECKPOINT_ON_CORRUPT] == value, role
        assert CheckpointConfig.from_env(env).on_corrupt == value, role


def test_the_crd_declares_on_corrupt():
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    checkpoint = schema["properties"]["spec"]["properties"]["checkpoint"]
    field = checkpoint["properties"]["onCorrupt"]
    assert field["enum"] == ["Fail", "StartFresh"] and field["default"] == "Fail"
    assert "StartFresh" in field["description"]
    assert ENV_CHECKPOINT_ON_CORRUPT in checkpoint["description"]
