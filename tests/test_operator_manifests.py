"""Spec -> pods and headless Services: names, labels, owners, the injected environment."""

import copy
import json

import pytest

from flowmill.operator import manifests
from flowmill.operator.api import DEFAULT_PS_COMMAND, TrainingJob, TrainingSpec
from flowmill.operator.manifests import (
    LABEL_GENERATION,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    desired_pod,
    desired_pods,
    desired_services,
)
from flowmill.runtime.cluster import ENV_VAR, TaskConfig

UID = "6f1c2d3e-0000-4000-8000-000000000001"
WORKER = {
    "metadata": {"labels": {"team": "ml", LABEL_JOB: "spoofed"},
                 "annotations": {"note": "hi"}},
    "spec": {
        "serviceAccountName": "trainer",
        "restartPolicy": "Always",
        "containers": [
            {"name": "flowmill", "image": "flowmill:dev", "command": ["python", "train.py"],
             "env": [{"name": "LR", "value": "0.1"},
                     {"name": ENV_VAR, "value": "user's own"},
                     {"name": "DATA", "value": "$(FLOWMILL_CHECKPOINT_URI)/data"}],
             "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "4"}}},
        ],
    },
}


def job(**spec_changes):
    spec = {
        "replicaSpecs": {"ps": {"replicas": 2}, "worker": {"replicas": 2, "template": WORKER}},
        "training": {"mode": "sync", "backupWorkers": 1, "maxSteps": 1000},
        "checkpoint": {"uri": "s3://ckpt/mnist", "intervalSteps": 50, "keep": 3,
                       "secretRef": {"name": "s3-creds", "endpointKey": "endpoint"}},
    }
    spec.update(copy.deepcopy(spec_changes))
    return TrainingJob.from_dict({
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "mnist", "namespace": "ml", "uid": UID, "generation": 1},
        "spec": spec, "status": {"restartGeneration": 4}})


def env_of(container):
    return {e["name"]: e for e in container["env"]}


def main(pod):
    return pod["spec"]["containers"][0]


def test_one_pod_per_task_ps_first():
    pods = desired_pods(job())
    assert [p["metadata"]["name"] for p in pods] == [
        "mnist-ps-0", "mnist-ps-1", "mnist-worker-0", "mnist-worker-1"]
    for p in pods:
        assert p["apiVersion"] == "v1" and p["kind"] == "Pod"
        assert p["metadata"]["namespace"] == "ml"
        assert p["spec"]["restartPolicy"] == "Never"  # the operator decides restarts


def test_labels_and_owner():
    pod = desired_pod(job(), "worker", 1, generation=7)
    labels = pod["metadata"]["labels"]
    assert labels == {"team": "ml", LABEL_JOB: "mnist", LABEL_ROLE: "worker", LABEL_INDEX: "1",
                      LABEL_GENERATION: "7"}
    assert pod["metadata"]["annotations"] == {"note": "hi"}
    assert pod["metadata"]["ownerReferences"] == [{
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob", "name": "mnist",
        "uid": UID, "controller": True, "blockOwnerDeletion": True}]
    # The generation defaults to the job's status.
    assert desired_pods(job())[0]["metadata"]["labels"][LABEL_GENERATION] == "4"


def test_cluster_spec_env():
    pods = desired_pods(job())
    for pod in pods:
        config = TaskConfig.from_json(env_of(main(pod))[ENV_VAR]["value"])
        labels = pod["metadata"]["labels"]
        assert (config.role, config.index) == (labels[LABEL_ROLE], int(labels[LABEL_INDEX]))
        assert config.cluster.as_dict() == {
            "ps": ["mnist-ps-0.ml.svc:2222", "mnist-ps-1.ml.svc:2222"],
            "worker": ["mnist-worker-0.ml.svc:2222", "mnist-worker-1.ml.svc:2222"]}
        assert config.address == f"{pod['metadata']['name']}.ml.svc:2222"


def test_chief_in_cluster_spec():
    j = job(replicaSpecs={"ps": {}, "worker": {"template": WORKER}, "chief": {}}, training={})
    pods = desired_pods(j)
    assert [p["metadata"]["name"] for p in pods] == [
        "mnist-ps-0", "mnist-chief-0", "mnist-worker-0"]
    config = TaskConfig.from_json(env_of(main(pods[1]))[ENV_VAR]["value"])
    assert config.is_chief and config.cluster.as_dict()["chief"] == ["mnist-chief-0.ml.svc:2222"]


def test_training_and_checkpoint_env():
    env = env_of(main(desired_pod(job(), "worker", 0)))
    training = json.loads(env["FLOWMILL_TRAINING"]["value"])
    assert training == {"mode": "sync", "backupWorkers": 1, "maxSteps": 1000}
    assert TrainingSpec.from_env({"FLOWMILL_TRAINING": env["FLOWMILL_TRAINING"]["value"]}) == \
        job().spec.training
    assert env["FLOWMILL_CHECKPOINT_URI"]["value"] == "s3://ckpt/mnist"
    assert env["FLOWMILL_CHECKPOINT_INTERVAL"]["value"] == "50"
    assert env["FLOWMILL_CHECKPOINT_KEEP"]["value"] == "3"
    assert env["POD_IP"] == {"name": "POD_IP",
                             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_credentials_by_reference_only():
    env = env_of(main(desired_pod(job(), "ps", 0)))
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds", "key": "endpoint"}
    assert "AWS_REGION" not in env  # no regionKey
    for e in env.values():
        if e["name"].startswith("AWS_"):
            assert "value" not in e


def test_no_checkpoint_no_checkpoint_env():
    j = job()
    plain = TrainingJob.from_dict({
        "metadata": {"name": "mnist", "namespace": "ml", "uid": UID},
        "spec": {"replicaSpecs": j.spec.to_dict()["replicaSpecs"]}})
    env = env_of(main(desired_pod(plain, "worker", 0)))
    assert not any(n.startswith(("FLOWMILL_CHECKPOINT", "AWS_")) for n in env)


def test_template_env_comes_after_ours_and_never_overrides():
    names = [e["name"] for e in main(desired_pod(job(), "worker", 0))["env"]]
    # Ours first (so $(VAR) in the template's variables can use them), then the template's,
    # without its own FLOWMILL_CONFIG.
    assert names[:3] == [ENV_VAR, "FLOWMILL_TRAINING", "POD_IP"]
    assert names[-2:] == ["LR", "DATA"]
    assert names.count(ENV_VAR) == 1
    assert env_of(main(desired_pod(job(), "worker", 0)))[ENV_VAR]["value"] != "user's own"


def test_worker_keeps_gpus_and_command_ps_runs_the_server():
    worker = main(desired_pod(job(), "worker", 0))
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": "1", "cpu": "4"}}
    assert worker["command"] == ["python", "train.py"]
    ps = main(desired_pod(job(), "ps", 0))
    assert ps["command"] == list(DEFAULT_PS_COMMAND)
    assert ps["resources"] == {"limits": {"cpu": "4"}}
    assert ps["image"] == "flowmill:dev"


def test_a_workers_gpu_limit_is_its_tasks_gpu_count_and_ps_tasks_get_none():
    worker = main(desired_pod(job(), "worker", 1))
    assert env_of(worker)["FLOWMILL_GPUS"]["value"] == "1"
    assert env_of(main(desired_pod(job(), "ps", 0)))["FLOWMILL_GPUS"]["value"] == "0"
    cpu_only = copy.deepcopy(WORKER)
    del cpu_only["spec"]["containers"][0]["resources"]
    j = job(replicaSpecs={"ps": {"replicas": 1}, "worker": {"replicas": 2, "template": cpu_only}})
    pod = desired_pod(j, "worker", 0)
    assert env_of(main(pod))["FLOWMILL_GPUS"]["value"] == "0"
    assert "CUPY_CACHE_DIR" not in env_of(main(pod))
    assert not any(v["name"] == "cupy-kernel-cache" for v in pod["spec"].get("volumes", []))


def test_gpu_workers_keep_compiled_kernels_on_a_volume_a_template_may_provide():
    pod = desired_pod(job(), "worker", 0)
    assert env_of(main(pod))["CUPY_CACHE_DIR"]["value"] == "/var/cache/cupy"
    assert {"name": "cupy-kernel-cache", "emptyDir": {}} in pod["spec"]["volumes"]
    assert {"name": "cupy-kernel-cache", "mountPath": "/var/cache/cupy"} in \
        main(pod)["volumeMounts"]
    # A claim of that name keeps the kernels across pods; the operator adds no emptyDir.
    shared = copy.deepcopy(WORKER)
    shared["spec"]["volumes"] = [{"name": "cupy-kernel-cache",
                                  "persistentVolumeClaim": {"claimName": "kernels"}}]
    pod = desired_pod(job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": shared}}),
                      "worker", 0)
    assert [v for v in pod["spec"]["volumes"] if v["name"] == "cupy-kernel-cache"] == \
        [{"name": "cupy-kernel-cache", "persistentVolumeClaim": {"claimName": "kernels"}}]
    # A template that sets CUPY_CACHE_DIR keeps its own, and gets no volume.
    own = copy.deepcopy(WORKER)
    own["spec"]["containers"][0]["env"].append({"name": "CUPY_CACHE_DIR", "value": "/cache"})
    pod = desired_pod(job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": own}}),
                      "worker", 0)
    assert env_of(main(pod))["CUPY_CACHE_DIR"]["value"] == "/cache"
    assert not [m for m in main(pod).get("volumeMounts", []) if m["name"] == "cupy-kernel-cache"]


def test_ps_template_command_wins():
    own = {"spec": {"containers": [{"name": "flowmill", "image": "ps:2",
                                    "command": ["flowmill-ps"]}]}}
    j = job(replicaSpecs={"ps": {"template": own}, "worker": {"template": WORKER}}, training={})
    assert main(desired_pod(j, "ps", 0))["command"] == ["flowmill-ps"]


def test_port_added_once():
    ports = main(desired_pod(job(), "worker", 0))["ports"]
    assert ports == [{"name": "flowmill", "containerPort": 2222, "protocol": "TCP"},
                     {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    template = copy.deepcopy(WORKER)
    template["spec"]["containers"][0]["ports"] = [{"name": "grpc", "containerPort": 2222},
                                                  {"name": "metrics", "containerPort": 9090}]
    j = job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": template}})
    assert main(desired_pod(j, "worker", 0))["ports"] == template["spec"]["containers"][0]["ports"]


def test_main_container_is_the_one_named_flowmill():
    template = copy.deepcopy(WORKER)
    sidecar = {"name": "logs", "image": "fluent-bit"}
    template["spec"]["containers"].insert(0, sidecar)
    j = job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": template}})
    containers = desired_pod(j, "worker", 0)["spec"]["containers"]
    assert {k: v for k, v in containers[0].items() if k != "securityContext"} == sidecar
    assert ENV_VAR in env_of(containers[1])


RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_pods_are_hardened_where_the_template_says_nothing():
    """The Pod Security restricted level's settings, for every container, and no token."""
    for role in ("ps", "worker"):
        spec = desired_pod(job(), role, 0)["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"] == {"runAsNonRoot": True,
                                           "seccompProfile": {"type": "RuntimeDefault"}}
        assert all(c["securityContext"] == RESTRICTED_CONTAINER for c in spec["containers"])


def test_a_templates_own_security_settings_win():
    template = copy.deepcopy(WORKER)
    spec = template["spec"]
    spec["automountServiceAccountToken"] = True
    spec["securityContext"] = {"runAsNonRoot": False, "runAsUser": 0}
    spec["initContainers"] = [{"name": "fetch", "image": "busybox",
                               "securityContext": {"privileged": True}}]
    spec["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    j = job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": template}})
    pod = desired_pod(j, "worker", 0)["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"] == {"runAsNonRoot": False, "runAsUser": 0,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    # Escalation is left alone beside privileged or CAP_SYS_ADMIN (the API refuses both).
    assert pod["initContainers"][0]["securityContext"] == {
        "privileged": True, "capabilities": {"drop": ["ALL"]}}
    assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["SYS_ADMIN"]}}


def test_pod_spec_passthrough_and_overrides():
    spec = desired_pod(job(), "worker", 0)["spec"]
    assert spec["serviceAccountName"] == "trainer"
    assert spec["enableServiceLinks"] is False
    template = copy.deepcopy(WORKER)
    template["spec"]["enableServiceLinks"] = True
    j = job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": template}})
    assert desired_pod(j, "worker", 0)["spec"]["enableServiceLinks"] is True


def test_pure_and_deterministic():
    j = job()
    before = copy.deepcopy(j.spec.to_dict())
    first = json.dumps(desired_pods(j) + desired_services(j))
    assert json.dumps(desired_pods(j) + desired_services(j)) == first
    assert j.spec.to_dict() == before  # the template was not modified
    # A raw object (as a watch delivers it) works the same.
    raw = {"metadata": {"name": "mnist", "namespace": "ml", "uid": UID},
           "spec": j.spec.to_dict(), "status": {"restartGeneration": 4}}
    assert json.dumps(desired_pods(raw) + desired_services(raw)) == first


def test_headless_services():
    services = desired_services(job())
    pods = desired_pods(job())
    assert [s["metadata"]["name"] for s in services] == [p["metadata"]["name"] for p in pods]
    for service, pod in zip(services, pods, strict=True):
        spec = service["spec"]
        assert spec["clusterIP"] == "None"
        assert spec["publishNotReadyAddresses"] is True
        assert spec["ports"] == [{"name": "flowmill", "port": 2222, "targetPort": 2222,
                                  "protocol": "TCP"}]
        # The selector picks exactly this task's pod, whatever its restart generation.
        assert spec["selector"].items() <= pod["metadata"]["labels"].items()
        assert LABEL_GENERATION not in spec["selector"]
        assert service["metadata"]["ownerReferences"] == pod["metadata"]["ownerReferences"]


def test_errors():
    with pytest.raises(ValueError, match="no task worker-2"):
        desired_pod(job(), "worker", 2)
    with pytest.raises(ValueError, match="no task chief-0"):
        desired_pod(job(), "chief", 0)
    no_uid = TrainingJob.from_dict({"metadata": {"name": "mnist"}, "spec": job().spec.to_dict()})
    with pytest.raises(ValueError, match="no metadata.uid"):
        desired_pods(no_uid)
    # The environment needs no uid: the local launcher uses it as is.
    assert manifests.task_env(no_uid, "worker", 0)[0]["name"] == ENV_VAR


def test_every_task_serves_progress_and_metrics_on_the_metrics_port():
    """Training tasks their steps; ps tasks what they hold and the sync state that names a
    stalled job's holder."""
    j = job(replicaSpecs={"ps": {"replicas": 1}, "chief": {"replicas": 1},
                          "worker": {"replicas": 2, "template": WORKER}})
    for role in ("chief", "worker", "ps"):
        container = main(desired_pod(j, role, 0))
        assert env_of(container)["FLOWMILL_METRICS_PORT"] == {
            "name": "FLOWMILL_METRICS_PORT", "value": str(manifests.METRICS_PORT)}
        assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in \
            container["ports"]
    # The local launcher takes the same environment.
    assert {"name": "FLOWMILL_METRICS_PORT", "value": "9090"} in \
        manifests.task_env(j, "worker", 0)


def test_metrics_port_named_in_the_template_wins():
    template = copy.deepcopy(WORKER)
    template["spec"]["containers"][0]["ports"] = [{"name": "metrics", "containerPort": 8000}]
    j = job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": template}})
    container = main(desired_pod(j, "worker", 1))
    assert manifests.metrics_port(j, "worker") == 8000
    assert env_of(container)["FLOWMILL_METRICS_PORT"]["value"] == "8000"
    assert [p for p in container["ports"] if p["name"] == "metrics"] == [
        {"name": "metrics", "containerPort": 8000}]
    # A port the template gives another name is not declared twice.
    template["spec"]["containers"][0]["ports"] = [{"name": "prom", "containerPort": 9090}]
    j = job(replicaSpecs={"ps": {}, "worker": {"replicas": 2, "template": template}})
    ports = main(desired_pod(j, "worker", 0))["ports"]
    assert [p["containerPort"] for p in ports].count(9090) == 1


def test_gang_scheduling_puts_every_task_in_the_jobs_pod_group():
    plain = job()
    assert all("schedulingGroup" not in p["spec"] for p in manifests.desired_pods(plain))
    gang = job(runPolicy={"gangScheduling": True})
    group = manifests.desired_pod_group(gang)
    assert group["apiVersion"] == "scheduling.k8s.io/v1alpha2" and group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == "mnist" and group["metadata"]["namespace"] == "ml"
    assert group["metadata"]["ownerReferences"][0]["uid"] == UID
    # Every task, so the scheduler binds none until it can bind all four.
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 4}}}
    pods = manifests.desired_pods(gang)
    assert [p["spec"]["schedulingGroup"] for p in pods] == [{"podGroupName": "mnist"}] * 4


def test_resource_quantities_written_as_numbers_become_strings():
    template = copy.deepcopy(WORKER)
    template["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": 1, "memory": "1Gi"}, "requests": {"cpu": 0.5}}
    pods = manifests.desired_pods(job(replicaSpecs={
        "ps": {"replicas": 1}, "worker": {"replicas": 2, "template": template}}))
    worker = pods[-1]["spec"]["containers"][0]
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": "1", "memory": "1Gi"},
                                   "requests": {"cpu": "0.5"}}
