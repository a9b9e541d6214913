"""A TrainingJob's pods and headless Services, as plain manifests (pure and deterministic).

One pod and one Service per task, both named ``<job>-<role>-<index>``: the Service gives
the task a stable DNS name (``<job>-<role>-<index>.<namespace>.svc``) that survives the
pod being recreated, and the cluster spec every task gets in ``FLOWMILL_CONFIG`` lists
those names. Pods run with ``restartPolicy: Never``: the operator counts and decides every
restart itself (``status.py``), so the budget is never reset by the kubelet restarting a
container in place, and a recreated pod carries a higher
``flowmill.dev/restart-generation`` label than the pod it replaces.

The same inputs always give the same dicts, in the same key order, so a manifest can be
compared with what exists and tests can pin it.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

from flowmill.runtime.cluster import (
    ENV_CHECKPOINT_INTERVAL,
    ENV_CHECKPOINT_KEEP,
    ENV_CHECKPOINT_ON_CORRUPT,
    ENV_CHECKPOINT_URI,
    ENV_GPUS,
    ENV_METRICS_PORT,
    ENV_SUMMARY_URI,
    ENV_TLS_DIR,
    ENV_TRAINING,
    ENV_VAR,
    GPU_RESOURCE,
    TRAINING_ROLES,
    ClusterSpec,
    TaskConfig,
    identity,
)

from .api import (
    API_VERSION,
    DEFAULT_PS_COMMAND,
    KIND,
    PORT,
    PORT_NAME,
    ROLES,
    TrainingJob,
    main_container_index,
)
from .certificates import Issued
from .queueing import Placement, merge_placement

LABEL_JOB = "flowmill.dev/job-name"
LABEL_ROLE = "flowmill.dev/replica-type"
LABEL_INDEX = "flowmill.dev/replica-index"
LABEL_GENERATION = "flowmill.dev/restart-generation"

# Where a training task serves its progress (``PROGRESS_PATH`` of the task contract): the
# port its main container names ``metrics`` in the template, else this one.
METRICS_PORT = 9090
METRICS_PORT_NAME = "metrics"
# With spec.security.tls: the job's CA certificate and every task's certificate and key
# live in the Secret <job>-tls (further ones, <job>-tls-1, ..., past TASKS_PER_SECRET
# tasks: a Secret holds at most 1 MiB), issued anew for every run of the job; each pod
# mounts its own three files at TLS_MOUNT.
TLS_VOLUME = "flowmill-tls"
TLS_MOUNT = "/var/run/flowmill/tls"
TASKS_PER_SECRET = 1000
ANNOTATION_RUN = "flowmill.dev/run-generation"
ANNOTATION_CA = "flowmill.dev/ca-sha256"


def task_name(job_name: str, role: str, index: int) -> str:
    return f"{job_name}-{role}-{index}"


def task_address(job: TrainingJob, role: str, index: int) -> str:
    return f"{task_name(job.name, role, index)}.{job.namespace}.svc:{PORT}"


def cluster_spec(job: TrainingJob | Mapping) -> ClusterSpec:
    """Every task's Service address by role (roles without tasks left out)."""
    job = TrainingJob.of(job)
    replicas = job.spec.replica_specs.replicas
    return ClusterSpec.from_dict({
        role: [task_address(job, role, i) for i in range(replicas(role))]
        for role in ROLES if replicas(role) > 0
    })


def task_labels(job_name: str, role: str, index: int) -> dict[str, str]:
    """The labels that pick out one task (its Service selects its pod by these)."""
    return {LABEL_JOB: job_name, LABEL_ROLE: role, LABEL_INDEX: str(index)}


def metrics_port(job: TrainingJob | Mapping, role: str) -> int:
    """The port a task serves its progress and metrics on (a ps task: what it holds and
    the sync state that names a stalled job's holder): the one its template's main
    container names ``metrics``, or ``METRICS_PORT``."""
    job = TrainingJob.of(job)
    template = job.spec.template_for(role)
    container = template["spec"]["containers"][main_container_index(template)]
    for p in container.get("ports") or ():
        if p.get("name") == METRICS_PORT_NAME and isinstance(p.get("containerPort"), int):
            return p["containerPort"]
    return METRICS_PORT


def _main_of(job: TrainingJob, role: str) -> dict:
    template = job.spec.template_for(role)
    return template["spec"]["containers"][main_container_index(template)]


def _template_env(job: TrainingJob, role: str) -> set[str]:
    return {e.get("name") for e in _main_of(job, role).get("env") or ()}


def gpu_limit(job: TrainingJob | Mapping, role: str) -> int:
    """The GPUs a task of ``role`` uses: its main container's ``nvidia.com/gpu`` limit (a
    worker sees the GPUs the device plugin gave it; this keeps the runtime to that count
    where a node shows more), none for PS tasks, which keep variables in host memory."""
    if role == "ps":
        return 0
    limits = (_main_of(TrainingJob.of(job), role).get("resources") or {}).get("limits") or {}
    try:
        return max(int(str(limits.get(GPU_RESOURCE, 0))), 0)
    except ValueError:
        return 0


def task_env(job: TrainingJob | Mapping, role: str, index: int) -> list[dict[str, Any]]:
    """The environment the operator gives a task's main container.

    Object-store credentials come from the Secret by reference (``secretKeyRef``), so
    their values never appear in a pod manifest.
    """
    job = TrainingJob.of(job)
    spec = job.spec
    config = TaskConfig(cluster_spec(job), role, index)
    env: list[dict[str, Any]] = [
        {"name": ENV_VAR, "value": config.to_json()},
        {"name": ENV_TRAINING, "value": spec.training.to_json()},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    env.append({"name": ENV_METRICS_PORT, "value": str(metrics_port(job, role))})
    gpus = gpu_limit(job, role)
    env.append({"name": ENV_GPUS, "value": str(gpus)})
    if gpus and "CUPY_CACHE_DIR" not in _template_env(job, role):
        env.append({"name": "CUPY_CACHE_DIR", "value": KERNEL_CACHE_MOUNT})
    if spec.security.tls:
        env.append({"name": ENV_TLS_DIR, "value": TLS_MOUNT})
    summaries = spec.summary_uri()
    if summaries is not None and role in TRAINING_ROLES:
        env.append({"name": ENV_SUMMARY_URI, "value": summaries})
    checkpoint = spec.checkpoint
    if checkpoint is not None:
        env += [
            {"name": ENV_CHECKPOINT_URI, "value": checkpoint.uri},
            {"name": ENV_CHECKPOINT_INTERVAL, "value": str(checkpoint.interval_steps)},
            {"name": ENV_CHECKPOINT_KEEP, "value": str(checkpoint.keep)},
            {"name": ENV_CHECKPOINT_ON_CORRUPT, "value": checkpoint.on_corrupt},
        ]
        ref = checkpoint.secret_ref
        if ref is not None:
            keys = [("AWS_ACCESS_KEY_ID", ref.access_key_id_key),
                    ("AWS_SECRET_ACCESS_KEY", ref.secret_access_key_key),
                    ("AWS_ENDPOINT_URL", ref.endpoint_key),
                    ("AWS_REGION", ref.region_key)]
            env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": key}}}
                    for name, key in keys if key is not None]
    return env


def owner_reference(job: TrainingJob) -> dict[str, Any]:
    if not job.uid:
        raise ValueError(f"TrainingJob {job.namespace}/{job.name} has no metadata.uid: "
                         "owned objects need the job as stored by the API server")
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def desired_pod(job: TrainingJob | Mapping, role: str, index: int,
                generation: int = 0, placement: Placement | None = None) -> dict[str, Any]:
    """The pod of one task, built from its role's template (plus, for a job Kueue
    admitted, its flavors' ``placement``)."""
    job = TrainingJob.of(job)
    replicas = job.spec.replica_specs.replicas(role)
    if not 0 <= index < replicas:
        raise ValueError(f"TrainingJob {job.name} has no task {role}-{index} "
                         f"({role} has {replicas} replicas)")
    template = job.spec.template_for(role)
    meta = template.get("metadata") or {}
    pod_spec = dict(template["spec"])
    containers = [dict(c) for c in pod_spec["containers"]]
    main = main_container_index(template)
    containers[main] = _main_container(containers[main], task_env(job, role, index), role,
                                       metrics_port(job, role))
    if job.spec.security.tls:
        _mount_credentials(pod_spec, containers[main], job, role, index)
    if any(e.get("name") == "CUPY_CACHE_DIR" and e.get("value") == KERNEL_CACHE_MOUNT
           for e in containers[main]["env"]):
        _mount_kernel_cache(pod_spec, containers[main])
    pod_spec["containers"] = [_quantities_as_strings(c) for c in containers]
    if pod_spec.get("initContainers"):
        pod_spec["initContainers"] = [_quantities_as_strings(dict(c))
                                      for c in pod_spec["initContainers"]]
    if job.spec.run_policy.gang_scheduling:
        pod_spec["schedulingGroup"] = {"podGroupName": job.name}
    if job.spec.scheduler_name:
        pod_spec.setdefault("schedulerName", job.spec.scheduler_name)
    if job.spec.priority_class_name:
        pod_spec.setdefault("priorityClassName", job.spec.priority_class_name)
    merge_placement(pod_spec, placement)
    _harden(pod_spec)
    pod_spec["restartPolicy"] = "Never"
    # One env var set per Service in the namespace would crowd a big job's environment.
    pod_spec.setdefault("enableServiceLinks", False)
    pod_spec.setdefault(
        "terminationGracePeriodSeconds", job.spec.run_policy.termination_grace_period_seconds
    )
    labels = {**(meta.get("labels") or {}), **task_labels(job.name, role, index),
              LABEL_GENERATION: str(generation)}
    metadata: dict[str, Any] = {
        "name": task_name(job.name, role, index),
        "namespace": job.namespace,
        "labels": labels,
    }
    if meta.get("annotations"):
        metadata["annotations"] = dict(meta["annotations"])
    metadata["ownerReferences"] = [owner_reference(job)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def desired_pods(job: TrainingJob | Mapping, generation: int | None = None) -> list[dict]:
    """Every task's pod, ps tasks first; ``generation`` defaults to the job's
    ``status.restartGeneration``."""
    job = TrainingJob.of(job)
    if generation is None:
        generation = int(job.status.get("restartGeneration") or 0)
    return [desired_pod(job, role, i, generation) for role, i in job.spec.tasks()]


def desired_service(job: TrainingJob | Mapping, role: str, index: int) -> dict[str, Any]:
    """A headless Service resolving the task's name to its pod, ready or not (peers must
    find each other while they start)."""
    job = TrainingJob.of(job)
    labels = task_labels(job.name, role, index)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": task_name(job.name, role, index),
            "namespace": job.namespace,
            "labels": dict(labels),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": dict(labels),
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT, "protocol": "TCP"}],
            "publishNotReadyAddresses": True,
        },
    }


def desired_network_policy(job: TrainingJob | Mapping, operator_namespace: str | None = None,
                           operator_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job's NetworkPolicy: its tasks take traffic from the job's own pods only, and
    on their metrics ports from the operator (its pods' labels, in its namespace; any
    namespace when that is not known), which reads their progress there. Where the
    cluster's network enforces policies this keeps a neighbour off the task ports."""
    job = TrainingJob.of(job)
    own = {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if operator_labels:
        namespaces = ({"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}
                      if operator_namespace else {})
        ports = sorted({metrics_port(job, role) for role, _ in job.spec.tasks()})
        ingress.append({
            "from": [{"namespaceSelector": namespaces,
                      "podSelector": {"matchLabels": dict(operator_labels)}}],
            "ports": [{"port": p, "protocol": "TCP"} for p in ports],
        })
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": job.name,
            "namespace": job.namespace,
            "labels": {LABEL_JOB: job.name},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {"podSelector": {"matchLabels": {LABEL_JOB: job.name}},
                 "policyTypes": ["Ingress"], "ingress": ingress},
    }


def tls_secret_name(job_name: str, chunk: int = 0) -> str:
    return f"{job_name}-tls" if chunk == 0 else f"{job_name}-tls-{chunk}"


def tls_secret_names(job: TrainingJob) -> list[str]:
    chunks = -(-len(job.spec.tasks()) // TASKS_PER_SECRET)
    return [tls_secret_name(job.name, c) for c in range(chunks)]


def ca_fingerprint(ca_cert: bytes) -> str:
    return hashlib.sha256(ca_cert).hexdigest()[:32]


def desired_tls_secrets(job: TrainingJob | Mapping, run_generation: int, ca_cert: bytes,
                        issued: Mapping[str, Issued]) -> list[dict[str, Any]]:
    """The Secrets of one run's credentials: the CA certificate (not its key: every
    certificate of the run is issued at once, as spec.replicaSpecs changes only between
    runs) and each task's ``<task>.crt`` and ``<task>.key``, ``issued`` by task name."""
    job = TrainingJob.of(job)
    tasks = job.spec.tasks()
    out = []
    for chunk, name in enumerate(tls_secret_names(job)):
        data = {"ca.crt": ca_cert}
        for role, index in tasks[chunk * TASKS_PER_SECRET:(chunk + 1) * TASKS_PER_SECRET]:
            task = identity(role, index)
            data[f"{task}.crt"], data[f"{task}.key"] = issued[task].cert, issued[task].key
        out.append({
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": name,
                "namespace": job.namespace,
                "labels": {LABEL_JOB: job.name},
                "annotations": {ANNOTATION_RUN: str(run_generation),
                                ANNOTATION_CA: ca_fingerprint(ca_cert)},
                "ownerReferences": [owner_reference(job)],
            },
            "data": {k: base64.b64encode(v).decode("ascii") for k, v in data.items()},
        })
    return out


def _mount_credentials(pod_spec: dict, container: dict, job: TrainingJob, role: str,
                       index: int) -> None:
    """The task's own certificate, key and the CA from its job's Secret, at TLS_MOUNT."""
    task = identity(role, index)
    chunk = job.spec.tasks().index((role, index)) // TASKS_PER_SECRET
    pod_spec["volumes"] = [*(pod_spec.get("volumes") or []), {
        "name": TLS_VOLUME,
        "secret": {"secretName": tls_secret_name(job.name, chunk),
                   "items": [{"key": "ca.crt", "path": "ca.crt"},
                             {"key": f"{task}.crt", "path": "tls.crt"},
                             {"key": f"{task}.key", "path": "tls.key"}]},
    }]
    container["volumeMounts"] = [*(container.get("volumeMounts") or []),
                                 {"name": TLS_VOLUME, "mountPath": TLS_MOUNT, "readOnly": True}]


KERNEL_CACHE_VOLUME = "cupy-kernel-cache"
KERNEL_CACHE_MOUNT = "/var/cache/cupy"


def _mount_kernel_cache(pod_spec: dict, container: dict) -> None:
    """CuPy's compiled kernels (``CUPY_CACHE_DIR``) on the volume ``cupy-kernel-cache``:
    an emptyDir (kept across the container's restarts) unless the template declares a
    volume of that name, such as a PersistentVolumeClaim that keeps them across pods, so a
    replaced worker does not compile its kernels again. A template that sets
    ``CUPY_CACHE_DIR`` itself keeps its own."""
    volumes = list(pod_spec.get("volumes") or [])
    if not any(v.get("name") == KERNEL_CACHE_VOLUME for v in volumes):
        volumes.append({"name": KERNEL_CACHE_VOLUME, "emptyDir": {}})
    pod_spec["volumes"] = volumes
    mounts = list(container.get("volumeMounts") or [])
    if not any(m.get("name") == KERNEL_CACHE_VOLUME for m in mounts):
        mounts.append({"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_MOUNT})
    container["volumeMounts"] = mounts


POD_GROUP_GROUP, POD_GROUP_VERSION, POD_GROUP_PLURAL = "scheduling.k8s.io", "v1alpha2", "podgroups"


def desired_pod_group(job: TrainingJob | Mapping) -> dict[str, Any]:
    """With runPolicy.gangScheduling: the job's PodGroup, named after it, a gang of every
    task (the scheduler places none of its pods until it can place all). Replaced only
    between runs, when the tasks may change: its policy is immutable."""
    job = TrainingJob.of(job)
    return {
        "apiVersion": f"{POD_GROUP_GROUP}/{POD_GROUP_VERSION}",
        "kind": "PodGroup",
        "metadata": {"name": job.name, "namespace": job.namespace,
                     "labels": {LABEL_JOB: job.name},
                     "ownerReferences": [owner_reference(job)]},
        "spec": {"schedulingPolicy": {"gang": {"minCount": len(job.spec.tasks())}}},
    }


def desired_services(job: TrainingJob | Mapping) -> list[dict]:
    job = TrainingJob.of(job)
    return [desired_service(job, role, i) for role, i in job.spec.tasks()]


def _quantities_as_strings(container: dict) -> dict:
    """Resource quantities as the API's type has them, strings: a manifest's
    ``nvidia.com/gpu: 1`` is a YAML integer, which the API server takes but the
    Kubernetes client's pod model refuses."""
    resources = container.get("resources")
    if isinstance(resources, Mapping):
        container["resources"] = {
            key: ({k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                   for k, v in value.items()} if isinstance(value, Mapping) else value)
            for key, value in resources.items()}
    return container


def _harden(pod_spec: dict) -> None:
    """What the Pod Security ``restricted`` level asks, where the template leaves it unset:
    no ServiceAccount token (a task talks to its peers, never to the API server), a
    non-root user, the runtime's default seccomp profile, every capability dropped, no
    privilege escalation. A template that sets any of them keeps its own (admission policy,
    not the operator, decides what a namespace allows), and escalation is left alone where
    the template asks for what needs it (privileged, CAP_SYS_ADMIN), which the API refuses
    beside ``allowPrivilegeEscalation: false``."""
    pod_spec.setdefault("automountServiceAccountToken", False)
    pod = dict(pod_spec.get("securityContext") or {})
    pod.setdefault("runAsNonRoot", True)
    pod.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    pod_spec["securityContext"] = pod
    for key in ("initContainers", "containers"):
        if not pod_spec.get(key):
            continue
        hardened = []
        for container in pod_spec[key]:
            container = dict(container)
            sc = dict(container.get("securityContext") or {})
            added = (sc.get("capabilities") or {}).get("add") or ()
            if not sc.get("privileged") and not {"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added):
                sc.setdefault("allowPrivilegeEscalation", False)
            sc.setdefault("capabilities", {"drop": ["ALL"]})
            container["securityContext"] = sc
            hardened.append(container)
        pod_spec[key] = hardened


def _main_container(container: dict, env: list[dict], role: str,
                    metrics: int | None) -> dict:
    """The task's container: our environment first (the template's own variables may
    refer to it with ``$(VAR)``; a template variable of the same name is dropped), the
    task port, its ``metrics`` port, and for ps tasks the server command
    when the template names none."""
    ours = {e["name"] for e in env}
    container["env"] = env + [dict(e) for e in container.get("env") or []
                              if e.get("name") not in ours]
    ports = [dict(p) for p in container.get("ports") or []]
    if not any(p.get("containerPort") == PORT for p in ports):
        ports.append({"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"})
    if metrics is not None and not any(p.get("name") == METRICS_PORT_NAME
                                       or p.get("containerPort") == metrics for p in ports):
        ports.append({"name": METRICS_PORT_NAME, "containerPort": metrics, "protocol": "TCP"})
    container["ports"] = ports
    if role == "ps" and not container.get("command"):
        container["command"] = list(DEFAULT_PS_COMMAND)
    return container
