"""The cluster spec: which tasks a job has, where they listen, and which one this is.

Every task reads the same JSON from one environment variable (the local launcher and the
operator both set it), shaped like TensorFlow's ``TF_CONFIG``::

    {"cluster": {"ps": ["h0:2222", "h1:2222"], "worker": ["h2:2222", "h3:2222"]},
     "task": {"type": "worker", "index": 1}}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VAR = "FLOWMILL_CONFIG"
ROLES = ("chief", "ps", "worker")

# The rest of what the launcher and the operator give every task: the job's training
# section (JSON) and its checkpoint settings.
ENV_TRAINING = "FLOWMILL_TRAINING"
ENV_CHECKPOINT_URI = "FLOWMILL_CHECKPOINT_URI"
ENV_CHECKPOINT_INTERVAL = "FLOWMILL_CHECKPOINT_INTERVAL"
ENV_CHECKPOINT_KEEP = "FLOWMILL_CHECKPOINT_KEEP"
# And what a task tells them by exiting with it: restart the whole job from its last
# checkpoint (EX_TEMPFAIL from sysexits.h: "try again later"), as a task that lost a PS
# task does.
RESTART_JOB_EXIT_CODE = 75


class ClusterSpecError(ValueError):
    pass


@dataclass(frozen=True)
class ClusterSpec:
    jobs: dict[str, tuple[str, ...]]  # role -> task addresses, in task order

    @classmethod
    def from_dict(cls, cluster: Mapping) -> ClusterSpec:
        if not isinstance(cluster, Mapping) or not cluster:
            raise ClusterSpecError(f"cluster must map roles to address lists, got {cluster!r}")
        jobs = {}
        for role, addresses in cluster.items():
            if role not in ROLES:
                raise ClusterSpecError(
                    f"unknown role {role!r} in cluster (roles: {', '.join(ROLES)})"
                )
            if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
                raise ClusterSpecError(
                    f"cluster.{role} must be a list of 'host:port', got {addresses!r}"
                )
            for i, address in enumerate(addresses):
                _check_address(address, f"cluster.{role}[{i}]")
            jobs[role] = tuple(addresses)
        if "chief" in jobs and len(jobs["chief"]) != 1:
            raise ClusterSpecError(
                f"cluster.chief must have exactly one task, has {len(jobs['chief'])}"
            )
        return cls(jobs)

    def num_tasks(self, role: str) -> int:
        return len(self.jobs.get(role, ()))

    def address(self, role: str, index: int) -> str:
        try:
            return self.jobs[role][index]
        except (KeyError, IndexError):
            raise ClusterSpecError(f"cluster has no task {role}:{index}") from None

    def tasks(self) -> list[tuple[str, int]]:
        return [(role, i) for role in ROLES for i in range(self.num_tasks(role))]

    def as_dict(self) -> dict[str, list[str]]:
        return {role: list(addresses) for role, addresses in self.jobs.items()}


@dataclass(frozen=True)
class TaskConfig:
    cluster: ClusterSpec
    role: str
    index: int

    @property
    def device(self) -> str:
        return task_device(self.role, self.index)

    @property
    def address(self) -> str:
        return self.cluster.address(self.role, self.index)

    @property
    def is_chief(self) -> bool:
        """The chief (or worker 0 when there is no chief) initializes, saves and reports."""
        if self.cluster.num_tasks("chief"):
            return self.role == "chief"
        return self.role == "worker" and self.index == 0

    def to_json(self) -> str:
        return json.dumps(
            {"cluster": self.cluster.as_dict(), "task": {"type": self.role, "index": self.index}}
        )

    @classmethod
    def from_json(cls, text: str) -> TaskConfig:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterSpecError(f"{ENV_VAR} is not valid JSON: {e}") from None
        if not isinstance(config, Mapping) or "cluster" not in config or "task" not in config:
            raise ClusterSpecError(f"{ENV_VAR} must have 'cluster' and 'task' keys")
        cluster = ClusterSpec.from_dict(config["cluster"])
        task = config["task"]
        role, index = task.get("type"), task.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool):
            raise ClusterSpecError(f"task.index must be an integer, got {index!r}")
        if not 0 <= index < cluster.num_tasks(role):
            raise ClusterSpecError(
                f"task {role}:{index} is not in the cluster "
                f"({role} has {cluster.num_tasks(role)} tasks)"
            )
        return cls(cluster, role, index)


def from_env(environ: Mapping[str, str] = os.environ) -> TaskConfig | None:
    """This task's config, or None when running as a single process."""
    text = environ.get(ENV_VAR)
    return TaskConfig.from_json(text) if text else None


def task_device(role: str, index: int, kind: str = "CPU", ordinal: int = 0) -> str:
    return f"/job:{role}/task:{index}/device:{kind}:{ordinal}"


def task_of(device: str) -> str:
    """``/job:ps/task:1/device:CPU:0`` -> ``/job:ps/task:1``."""
    return "/".join(device.split("/")[:3])


def _check_address(address, where: str) -> None:
    if not isinstance(address, str):
        raise ClusterSpecError(f"{where} must be 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterSpecError(f"{where} must be 'host:port', got {address!r}")
