"""The task contract: what every task of a job reads, answers and serves, shared by the
runtime, the operator and the launcher (which import nothing else of each other's).

Every task reads its place in the job from one environment variable (the local launcher
and the operator both set it), shaped like TensorFlow's ``TF_CONFIG``::

    {"cluster": {"ps": ["h0:2222", "h1:2222"], "worker": ["h2:2222", "h3:2222"]},
     "task": {"type": "worker", "index": 1}}

and the rest from the ``ENV_*`` variables below; it answers with its exit code
(``RESTART_JOB_EXIT_CODE`` asks for the whole job to restart) and, as a training task,
serves its progress on ``ENV_METRICS_PORT`` (``PROGRESS_PATH``, read by ``fetch_progress``).
This module imports only the standard library, so the operator's pod loads no kernels.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .addresses import default_bind_host, format_address, parse_address
from .device_names import task_device

ENV_VAR = "FLOWMILL_CONFIG"
ROLES = ("chief", "ps", "worker")  # in task-number order
TRAINING_ROLES = ("chief", "worker")  # the tasks that run the model script

# The rest of what the launcher and the operator give every task: the job's training
# section (JSON), its checkpoint settings, where variables go, where to serve progress
# (training tasks), whether to draw a progress bar, and the pod's own address.
ENV_TRAINING = "FLOWMILL_TRAINING"
ENV_CHECKPOINT_URI = "FLOWMILL_CHECKPOINT_URI"
ENV_CHECKPOINT_INTERVAL = "FLOWMILL_CHECKPOINT_INTERVAL"
ENV_CHECKPOINT_KEEP = "FLOWMILL_CHECKPOINT_KEEP"
ENV_CHECKPOINT_ON_CORRUPT = "FLOWMILL_CHECKPOINT_ON_CORRUPT"
CHECKPOINT_ON_CORRUPT = ("Fail", "StartFresh")  # its values; the first is the default
# Where training tasks write TensorBoard summaries (``spec.training.summaryUri``).
ENV_SUMMARY_URI = "FLOWMILL_SUMMARY_URI"
ENV_PS_STRATEGY = "FLOWMILL_PS_STRATEGY"
PS_STRATEGIES = ("bytes", "round_robin")  # its values; the first is the default
ENV_METRICS_PORT = "FLOWMILL_METRICS_PORT"
ENV_PROGRESS = "FLOWMILL_PROGRESS"  # "off": report progress, draw nothing
# Where a training task leaves its last snapshot when it exits (the local launcher's job
# bar reads it, as a task that has exited can no longer be polled).
ENV_PROGRESS_FINAL = "FLOWMILL_PROGRESS_FINAL"
ENV_POD_IP = "POD_IP"
# The directory of the task's TLS credentials: ca.crt (its job run's CA), tls.crt and
# tls.key (its own, naming it: ``identity``). Unset: the task serves and dials in plain TCP.
ENV_TLS_DIR = "FLOWMILL_TLS_DIR"
# The GPUs a task may use: a worker's ``nvidia.com/gpu`` limit, 0 for a PS task.
ENV_GPUS = "FLOWMILL_GPUS"
GPU_RESOURCE = "nvidia.com/gpu"
TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE = "ca.crt", "tls.crt", "tls.key"  # PEM, in it
# Whom a certificate of a job run names besides its tasks: the local launcher, which asks
# its PS tasks whether they serve and tells them to stop.
LAUNCHER_IDENTITY = "launcher"
# And what a task tells them by exiting with it: restart the whole job from its last
# checkpoint (EX_TEMPFAIL from sysexits.h: "try again later"), as a task that lost a PS
# task does.
RESTART_JOB_EXIT_CODE = 75
# A training task asked to stop (SIGTERM: eviction, preemption, drain, ``kubectl delete
# pod``, Ctrl-C of the launcher) stops, its chief after committing a checkpoint of the
# step it reached, and exits with 128 + SIGTERM, as a container killed by it reports: the
# operator and the launcher restart it (the chief: the whole job, from that checkpoint)
# without counting a failure against ``runPolicy.backoffLimit``.
PREEMPTED_EXIT_CODE = 143
# A training task whose own address (as the cluster spec names it) another process holds
# exits with this code: the local launcher, which picked the port moments before, starts
# the job again on new ports, without counting it against ``runPolicy.backoffLimit``. (A
# pod's own IP has no such neighbour; on a cluster the code is judged as any other.)
PORT_TAKEN_EXIT_CODE = 76
# What a training task serves on ENV_METRICS_PORT.
PROGRESS_PATH = "/progress"
METRICS_PATH = "/metrics"
MAX_SNAPSHOT_BYTES = 1 << 16  # a snapshot is a few hundred bytes; anything bigger is not one


def identity(role: str, index: int) -> str:
    """The name a task's certificate carries (CN and DNS name): ``worker-1``."""
    return f"{role}-{index}"


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


def bind_host(environ: Mapping[str, str] = os.environ) -> str:
    """Where this task's endpoints listen: the pod's own address when it is a loopback one,
    else every interface (``default_bind_host``'s choice). Without ``POD_IP``, the host of
    this task's address in the cluster spec; without either, loopback."""
    host = environ.get(ENV_POD_IP, "").strip()
    if not host and environ.get(ENV_VAR):
        try:
            host = parse_address(TaskConfig.from_json(environ[ENV_VAR]).address)[0]
        except (ClusterSpecError, ValueError, AttributeError, TypeError):
            host = ""
    if not host:
        return "127.0.0.1"
    chosen = default_bind_host(format_address(host, 0))
    if chosen == "0.0.0.0" or host == "localhost":
        return chosen
    return host


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a pointer to follow: a task's endpoint could
    otherwise send its reader (the operator, with the cluster access it has) anywhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def fetch_progress(url: str, timeout: float) -> dict[str, Any] | None:
    """A task's snapshot from its ``/progress`` URL; None when it cannot be had (not
    serving yet, gone, too slow, not a snapshot, a redirect). Proxies from the environment
    are not used: the endpoint is a pod's or a local task's own address."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())
    try:
        with opener.open(url, timeout=timeout) as r:
            body = r.read(MAX_SNAPSHOT_BYTES + 1)
    except (OSError, ValueError, urllib.error.URLError):
        return None
    if len(body) > MAX_SNAPSHOT_BYTES:
        return None
    try:
        snap = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return snap if isinstance(snap, dict) else None


def _check_address(address, where: str) -> None:
    try:
        _, port = parse_address(address if isinstance(address, str) else "")
    except ValueError:
        port = 0
    if port == 0:
        raise ClusterSpecError(f"{where} must be 'host:port', got {address!r}")
