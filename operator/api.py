"""The TrainingJob API as Python dataclasses: parsing, defaults and validation.

``crds/trainingjobs.flowmill.dev.yaml`` is the definition; this module mirrors it so that
the operator and the local launcher read a manifest the same way the API server does, and
report a mistake with its field path (``spec.replicaSpecs.worker.replicas: must be >= 1,
got 0``) before anything runs. Each dataclass field carries its JSON name, CRD default and
bounds in its metadata; ``tests/test_operator_api.py`` walks the CRD schema and checks the
two agree, so a change to one without the other fails a test.

The CEL rules of the CRD are re-checked here too (backupWorkers, staleness, the ps tasks a
distributed job needs, the job name's length), except the update rules, which only the
API server can see.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flowmill.runtime.cluster import CHECKPOINT_ON_CORRUPT, ENV_TRAINING, TRAINING_ROLES

GROUP = "flowmill.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"

ROLES = ("ps", *TRAINING_ROLES)  # the order tasks are created in: ps tasks first
MODES = ("sync", "async", "bounded-staleness")
RESTART_POLICIES = ("Never", "OnFailure", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
SUCCESS_POLICIES = ("ChiefWorker", "AllWorkers")

PORT = 2222
PORT_NAME = "flowmill"
MAIN_CONTAINER = "flowmill"
# What a ps task runs when its template gives no command. Binding to the pod's own IP
# (rather than 0.0.0.0) lets several pods share a host's loopback on one port.
DEFAULT_PS_COMMAND = ("python", "-m", "flowmill.runtime.server", "--bind-host", "$(POD_IP)")

# The job name leaves room for "-worker-<index>" in a 63-character Service name.
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_SERVICE_NAME = 63
_URI = re.compile(r"^(s3|file|memory)://")
_SUMMARY_URI = re.compile(r"^(s3|file)://")
SUMMARIES_DIR = "summaries"  # beside the checkpoints, when summaryUri is not given


class SpecError(ValueError):
    """Every problem found in a manifest, each naming its field path."""

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + e for e in self.errors))


def _field(json_name: str, default: Any = dataclasses.MISSING, *, enum: tuple | None = None,
           minimum: int | None = None, maximum: int | None = None,
           pattern: re.Pattern | None = None, min_length: int | None = None) -> Any:
    """A dataclass field with its CRD name and constraints.

    No default means the field is required; a default of None means optional with no CRD
    default; a dataclass type as default means the CRD defaults the object itself.
    """
    metadata = {"json": json_name, "enum": enum, "minimum": minimum, "maximum": maximum,
                "pattern": pattern, "min_length": min_length}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---- the spec

# The most tasks of one role a job may ask for: a bound on what one manifest makes the
# operator create (and the local launcher start), far above any job here.
MAX_REPLICAS = 1000


@dataclass(frozen=True, kw_only=True)
class ReplicaSpec:
    """One role's tasks. Subclasses carry each role's defaults and bounds (as the CRD does)."""

    replicas: int = _field("replicas", 1, minimum=0, maximum=MAX_REPLICAS)
    restart_policy: str = _field("restartPolicy", "OnFailure", enum=RESTART_POLICIES)
    template: dict | None = _field("template", None)


@dataclass(frozen=True, kw_only=True)
class PSSpec(ReplicaSpec):
    replicas: int = _field("replicas", 1, minimum=0, maximum=MAX_REPLICAS)
    restart_policy: str = _field("restartPolicy", "ExitCode", enum=RESTART_POLICIES)
    template: dict | None = _field("template", None)


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(ReplicaSpec):
    replicas: int = _field("replicas", 1, minimum=1, maximum=MAX_REPLICAS)
    restart_policy: str = _field("restartPolicy", "OnFailure", enum=RESTART_POLICIES)
    template: dict = _field("template")


@dataclass(frozen=True, kw_only=True)
class ChiefSpec(ReplicaSpec):
    replicas: int = _field("replicas", 1, minimum=0, maximum=1)
    restart_policy: str = _field("restartPolicy", "OnFailure", enum=RESTART_POLICIES)
    template: dict | None = _field("template", None)


@dataclass(frozen=True, kw_only=True)
class ReplicaSpecs:
    worker: WorkerSpec = _field("worker")
    ps: PSSpec | None = _field("ps", None)
    chief: ChiefSpec | None = _field("chief", None)

    def get(self, role: str) -> ReplicaSpec | None:
        if role not in ROLES:
            raise KeyError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        return getattr(self, role)

    def replicas(self, role: str) -> int:
        spec = self.get(role)
        return spec.replicas if spec is not None else 0


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    mode: str = _field("mode", "sync", enum=MODES)
    backup_workers: int = _field("backupWorkers", 0, minimum=0)
    staleness: int | None = _field("staleness", None, minimum=0)
    max_steps: int | None = _field("maxSteps", None, minimum=1)
    check_numerics: bool | None = _field("checkNumerics", None)  # omitted: off
    # Where training tasks write TensorBoard summaries (default: ``summary_uri`` below).
    summary_uri: str | None = _field("summaryUri", None, pattern=_SUMMARY_URI)

    @property
    def runtime_mode(self) -> str:
        """The mode's name in ``flowmill.runtime.replicas`` (``bounded_staleness``)."""
        return self.mode.replace("-", "_")

    def to_json(self) -> str:
        return json.dumps(to_dict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TrainingSpec:
        """What a task was told in ``FLOWMILL_TRAINING`` (the defaults when unset)."""
        text = environ.get(ENV_TRAINING)
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError([f"{ENV_TRAINING}: not valid JSON: {e}"]) from None
        errors: list[str] = []
        spec = _parse(cls, data, ENV_TRAINING, errors)
        if not errors:
            _check_training(spec, ENV_TRAINING, errors)
        if errors:
            raise SpecError(errors)
        return spec


@dataclass(frozen=True, kw_only=True)
class SecretRef:
    name: str = _field("name", min_length=1)
    access_key_id_key: str = _field("accessKeyIdKey", "AWS_ACCESS_KEY_ID")
    secret_access_key_key: str = _field("secretAccessKeyKey", "AWS_SECRET_ACCESS_KEY")
    endpoint_key: str | None = _field("endpointKey", None)
    region_key: str | None = _field("regionKey", None)


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    uri: str = _field("uri", pattern=_URI)
    interval_steps: int = _field("intervalSteps", 100, minimum=1)
    keep: int = _field("keep", 5, minimum=1)
    secret_ref: SecretRef | None = _field("secretRef", None)
    # When every checkpoint is damaged: fail naming them, or train again from step 0.
    on_corrupt: str = _field("onCorrupt", CHECKPOINT_ON_CORRUPT[0], enum=CHECKPOINT_ON_CORRUPT)


@dataclass(frozen=True, kw_only=True)
class RunPolicy:
    clean_pod_policy: str = _field("cleanPodPolicy", "Running", enum=CLEAN_POD_POLICIES)
    ttl_seconds_after_finished: int | None = _field("ttlSecondsAfterFinished", None, minimum=0)
    active_deadline_seconds: int | None = _field("activeDeadlineSeconds", None, minimum=1)
    backoff_limit: int = _field("backoffLimit", 3, minimum=0)
    suspend: bool = _field("suspend", False)
    # Time for the chief to commit a checkpoint when its pod is asked to stop.
    termination_grace_period_seconds: int = _field(
        "terminationGracePeriodSeconds", 60, minimum=0
    )
    # No step for this long: the task holding the job up is restarted (None: derived from
    # the step time; flowmill.operator.stall).
    stall_timeout_seconds: int | None = _field("stallTimeoutSeconds", None, minimum=1)
    # All of the job's pods placed together or none: a PodGroup with a gang policy
    # (scheduling.k8s.io/v1alpha2, Kubernetes' GenericWorkload and GangScheduling gates).
    gang_scheduling: bool = _field("gangScheduling", False)


@dataclass(frozen=True, kw_only=True)
class SecuritySpec:
    # Mutual TLS between the tasks, with a CA per run of the job (flowmill.runtime.tls).
    tls: bool = _field("tls", True)


@dataclass(frozen=True, kw_only=True)
class TrainingJobSpec:
    replica_specs: ReplicaSpecs = _field("replicaSpecs")
    training: TrainingSpec = _field("training", TrainingSpec)
    checkpoint: CheckpointSpec | None = _field("checkpoint", None)
    run_policy: RunPolicy = _field("runPolicy", RunPolicy)
    # TFJob's name and default: the chief (else worker 0) decides, so a worker of a sync
    # job left waiting for a step nobody runs any more cannot keep the job from finishing.
    success_policy: str = _field("successPolicy", "ChiefWorker", enum=SUCCESS_POLICIES)
    security: SecuritySpec = _field("security", SecuritySpec)
    # Set on every pod whose template names none: the scheduler that places the job's
    # pods, and their PriorityClass (also the job's priority in a Kueue queue).
    scheduler_name: str | None = _field("schedulerName", None, min_length=1)
    priority_class_name: str | None = _field("priorityClassName", None, min_length=1)

    @classmethod
    def from_dict(cls, data: Any, path: str = "spec") -> TrainingJobSpec:
        """Parse and validate a manifest's ``spec``; raises SpecError listing every problem."""
        errors: list[str] = []
        spec = _parse(cls, data, path, errors)
        if not errors:
            _check_spec(spec, path, errors)
        if errors:
            raise SpecError(errors)
        return spec

    def to_dict(self) -> dict:
        return to_dict(self)

    def summary_uri(self) -> str | None:
        """Where the training tasks write TensorBoard summaries: ``training.summaryUri``,
        else ``summaries`` beside the checkpoints (``<checkpoint.uri>/summaries``, as
        TensorFlow's estimators keep events with their checkpoints); None without either
        (or beside ``memory://`` checkpoints, which no TensorBoard can read)."""
        if self.training.summary_uri:
            return self.training.summary_uri
        if self.checkpoint is None or self.checkpoint.uri.startswith("memory://"):
            return None
        return f"{self.checkpoint.uri.rstrip('/')}/{SUMMARIES_DIR}"

    def tasks(self) -> list[tuple[str, int]]:
        """Every task as (role, index), ps tasks first."""
        return [(role, i) for role in ROLES for i in range(self.replica_specs.replicas(role))]

    def training_tasks(self) -> list[tuple[str, int]]:
        """The tasks that run the model script, in worker-replica order: the chief, then
        the workers (the order sync accumulators and staleness clocks count them in)."""
        return [(role, i) for role in TRAINING_ROLES
                for i in range(self.replica_specs.replicas(role))]

    def num_training_tasks(self) -> int:
        return sum(self.replica_specs.replicas(role) for role in TRAINING_ROLES)

    def source_template(self, role: str) -> dict:
        """The template a role's pods are made from, as written (not a copy: read only):
        the role's own, else the worker's."""
        own = self.replica_specs.get(role)
        if own is not None and own.template is not None:
            return own.template
        return self.replica_specs.worker.template

    def template_for(self, role: str) -> dict:
        """The pod template a role's tasks run (a deep copy; safe to modify).

        ps and chief fall back to the worker template, so a job names its image once: the
        ps tasks then run the worker image without the worker's command, args and GPUs
        (they serve variables; DEFAULT_PS_COMMAND is their command).
        """
        own = self.replica_specs.get(role)
        template = copy.deepcopy(self.source_template(role))
        if role == "ps" and (own is None or own.template is None):
            container = template["spec"]["containers"][main_container_index(template)]
            container.pop("command", None)
            container.pop("args", None)
            resources = container.get("resources") or {}
            for kind in ("limits", "requests"):
                amounts = resources.get(kind)
                if isinstance(amounts, dict):
                    amounts.pop("nvidia.com/gpu", None)
                    if not amounts:
                        del resources[kind]
            if "resources" in container and not resources:
                del container["resources"]
        return template


def main_container_index(template: Mapping) -> int:
    """The container that runs the task: the one named ``flowmill``, else the first."""
    containers = template["spec"]["containers"]
    for i, container in enumerate(containers):
        if container.get("name") == MAIN_CONTAINER:
            return i
    return 0


# ---- the whole object


@dataclass(frozen=True)
class TrainingJob:
    """A TrainingJob object: identity, parsed spec, and its raw status as stored."""

    name: str
    namespace: str
    spec: TrainingJobSpec
    uid: str | None = None
    generation: int | None = None
    status: Mapping[str, Any] = field(default_factory=dict)
    deleting: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, obj: Any, source: str | None = None) -> TrainingJob:
        if not isinstance(obj, Mapping):
            raise SpecError([f"a TrainingJob must be an object, got {type(obj).__name__}"],
                            source)
        errors: list[str] = []
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if api_version is not None and api_version != API_VERSION:
            errors.append(f"apiVersion: must be {API_VERSION}, got {api_version!r}")
        if kind is not None and kind != KIND:
            errors.append(f"kind: must be {KIND}, got {kind!r}")
        metadata = obj.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            errors.append(f"metadata: must be an object, got {type(metadata).__name__}")
            metadata = {}
        name = metadata.get("name")
        namespace = metadata.get("namespace") or "default"
        if not isinstance(name, str) or not name:
            errors.append("metadata.name: required")
        spec = None
        if "spec" not in obj:
            errors.append("spec: required")
        else:
            spec = _parse(TrainingJobSpec, obj["spec"], "spec", errors)
            if not errors:
                _check_spec(spec, "spec", errors)
        if spec is not None and isinstance(name, str) and name:
            _check_name(name, spec, errors)
        if errors:
            raise SpecError(errors, source)
        status = obj.get("status") or {}
        labels = metadata.get("labels") or {}
        return cls(name=name, namespace=namespace, spec=spec, uid=metadata.get("uid"),
                   generation=metadata.get("generation"),
                   status=status if isinstance(status, Mapping) else {},
                   deleting=bool(metadata.get("deletionTimestamp")),
                   labels=dict(labels) if isinstance(labels, Mapping) else {})

    @classmethod
    def of(cls, job: TrainingJob | Mapping) -> TrainingJob:
        """Accept either a parsed job or the raw object (as a watch or kopf delivers it)."""
        return job if isinstance(job, TrainingJob) else cls.from_dict(job)


def load_manifest(path: str | os.PathLike[str]) -> TrainingJob:
    """The one TrainingJob in a YAML file (other kinds beside it, e.g. a Secret, are skipped)."""
    return TrainingJob.from_dict(read_manifest(path), str(path))


def read_manifest(path: str | os.PathLike[str]) -> Mapping:
    """The one TrainingJob document in a YAML file, not yet validated."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError([f"cannot read: {e.strerror or e}"], source) from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError([f"not valid YAML: {e}"], source) from None
    jobs = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == KIND]
    if len(jobs) != 1:
        kinds = [d.get("kind") if isinstance(d, Mapping) else type(d).__name__
                 for d in documents]
        raise SpecError([f"expected exactly one {KIND}, found {len(jobs)} "
                         f"(documents: {kinds or 'none'})"], source)
    return jobs[0]


def to_dict(obj: Any) -> Any:
    """A spec dataclass back to its manifest form (JSON names, absent fields left out)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                out[f.metadata["json"]] = to_dict(value)
        return out
    return copy.deepcopy(obj)


# ---- parsing


_SCALARS = {int: "an integer", str: "a string", bool: "a boolean", dict: "an object"}


def _parse(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    """Build ``cls`` from ``data``, appending every problem to ``errors`` (None if any)."""
    if not isinstance(data, Mapping):
        errors.append(f"{path}: must be an object, got {_show(data)}")
        return None
    hints, fields = _schema(cls)
    before = len(errors)
    for key in data:
        if key not in fields:
            errors.append(f"{path}.{key}: unknown field (fields: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}"
        value = data.get(name)
        if value is None:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                errors.append(f"{where}: required")
            continue
        kind = _unoptional(hints[f.name])
        if dataclasses.is_dataclass(kind):
            value = _parse(kind, value, where, errors)
        elif not _is_a(value, kind):
            errors.append(f"{where}: must be {_SCALARS[kind]}, got {_show(value)}")
            continue
        else:
            _check_bounds(f.metadata, value, where, errors)
        kwargs[f.name] = value
    if len(errors) > before:
        return None
    obj = cls(**kwargs)
    if isinstance(obj, ReplicaSpec) and obj.template is not None:
        _check_template(obj.template, f"{path}.template", errors)
    return obj


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A spec class's type hints and its fields by JSON name (worked out once: resolving
    the hints compiles their text, which cost more than the rest of a parse)."""
    return (typing.get_type_hints(cls),
            {f.metadata["json"]: f for f in dataclasses.fields(cls)})


def _unoptional(hint: Any) -> type:
    if isinstance(hint, types.UnionType):
        (kind,) = [a for a in hint.__args__ if a is not type(None)]
        return kind
    return hint


def _is_a(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is dict:
        return isinstance(value, Mapping)
    return isinstance(value, kind)


def _check_bounds(metadata: Mapping, value: Any, where: str, errors: list[str]) -> None:
    enum, pattern = metadata["enum"], metadata["pattern"]
    if enum is not None and value not in enum:
        errors.append(f"{where}: must be one of {', '.join(enum)}, got {value!r}")
    if metadata["minimum"] is not None and value < metadata["minimum"]:
        errors.append(f"{where}: must be >= {metadata['minimum']}, got {value}")
    if metadata["maximum"] is not None and value > metadata["maximum"]:
        errors.append(f"{where}: must be <= {metadata['maximum']}, got {value}")
    if pattern is not None and not pattern.search(value):
        errors.append(f"{where}: must match {pattern.pattern}, got {value!r}")
    if metadata["min_length"] is not None and len(value) < metadata["min_length"]:
        errors.append(f"{where}: must not be empty")


def _check_template(template: Mapping, where: str, errors: list[str]) -> None:
    """The part of a PodTemplateSpec the CRD checks: containers with a name and an image."""
    for key in ("metadata", "spec"):
        if key in template and not isinstance(template[key], Mapping):
            errors.append(f"{where}.{key}: must be an object, got {_show(template[key])}")
            return
    spec = template.get("spec")
    if spec is None:
        errors.append(f"{where}.spec: required")
        return
    containers = spec.get("containers")
    if containers is None:
        errors.append(f"{where}.spec.containers: required")
        return
    if not isinstance(containers, list):
        errors.append(f"{where}.spec.containers: must be a list, got {_show(containers)}")
        return
    if not containers:
        errors.append(f"{where}.spec.containers: must have at least 1 item")
    for i, container in enumerate(containers):
        at = f"{where}.spec.containers[{i}]"
        if not isinstance(container, Mapping):
            errors.append(f"{at}: must be an object, got {_show(container)}")
            continue
        for key in ("name", "image"):
            if key not in container:
                errors.append(f"{at}.{key}: required")
            elif not isinstance(container[key], str):
                errors.append(f"{at}.{key}: must be a string, got {_show(container[key])}")


# ---- the CRD's CEL rules


def _check_training(training: TrainingSpec, path: str, errors: list[str]) -> None:
    if training.mode != "sync" and training.backup_workers != 0:
        errors.append(f"{path}.backupWorkers: applies to mode sync only "
                      f"(mode is {training.mode})")
    if training.staleness is not None and training.mode != "bounded-staleness":
        errors.append(f"{path}.staleness: applies to mode bounded-staleness only "
                      f"(mode is {training.mode})")
    if training.mode == "bounded-staleness" and training.staleness is None:
        errors.append(f"{path}.staleness: required by mode bounded-staleness")


def _check_spec(spec: TrainingJobSpec, path: str, errors: list[str]) -> None:
    _check_training(spec.training, f"{path}.training", errors)
    workers = spec.replica_specs.worker.replicas
    if spec.training.backup_workers >= workers:
        errors.append(f"{path}.training.backupWorkers: must be less than "
                      f"{path}.replicaSpecs.worker.replicas ({workers}), "
                      f"got {spec.training.backup_workers}")
    if spec.num_training_tasks() > 1 and spec.replica_specs.replicas("ps") < 1:
        errors.append(f"{path}.replicaSpecs.ps.replicas: a job with more than one training "
                      f"task (workers + chief: {spec.num_training_tasks()}) needs >= 1: the "
                      "shared variables live on the ps tasks")


def _check_name(name: str, spec: TrainingJobSpec, errors: list[str]) -> None:
    longest = f"{name}-worker-{spec.replica_specs.worker.replicas - 1}"
    if not _DNS_1035.match(name):
        errors.append(f"metadata.name: must be a DNS-1035 label (lower-case letters, digits "
                      f"and '-', starting with a letter), got {name!r}")
    elif len(longest) > _MAX_SERVICE_NAME:
        errors.append(f"metadata.name: too long: task name {longest!r} has {len(longest)} "
                      f"characters, Service names allow {_MAX_SERVICE_NAME}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
