"""What a TrainingJob's pods say (``observe``) and what to do about it (``decide``).

Both are pure: the job, its pods (as the API returns them) and the time go in; a status
and an action come out. The operator's handlers only list pods, call these, write the
action's status, then create and delete what the action names.

Why things are decided the way they are (TFJob users' complaints, kubeflow/trainer#...):

- The restart budget (``runPolicy.backoffLimit``) is counted in ``status.restartCount``,
  never reset, and never by the kubelet (pods run ``restartPolicy: Never``) (#2045).
- A permanent failure under ``restartPolicy: ExitCode`` fails the job at once instead of
  restarting forever (#2044).
- A worker that exited 0 is remembered in ``replicaStatuses.worker.completedIndexes``, so
  it is not run again after its pod is garbage-collected (#1186, #1997).
- A ps task that fails, exits, or whose pod goes away after training began restarts the
  whole job (its variables are gone), and a job is Running only while every task is
  (#881). When the job finishes, running ps pods are stopped (#774, #1059).
- ``successPolicy`` ChiefWorker (the default, as TFJob's) ends the job when the chief (or,
  without one, worker 0) exits 0: a worker left waiting for a sync step cannot hold it.
- ``ttlSecondsAfterFinished`` deletes the job when due (#1533).
- A job in a Kueue queue (``queueing.py``) starts no pod until admitted; evicted
  (preempted), it is suspended, its pods asked to stop (the chief checkpoints), and no
  restart is counted against its budget (volcano#2560, jobset#1117).

Pods carry ``flowmill.dev/restart-generation``: every creation of pods uses a new, higher
generation (``status.restartGeneration``). A whole-job restart or a suspension sets
``status.runGeneration`` above every existing pod; pods below it belong to an earlier run
and are deleted, and nothing new starts until they are gone (so new workers never meet
the old ps tasks, and a name is never taken by a pod that is still terminating).

The module is long because observe and decide share one reading of the pods (``TaskPod``)
and one status: split, every part would need both, and the rules above would be spread
over files that must change together. Kueue's own rules are apart (``queueing.py``).
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from flowmill.runtime.cluster import PREEMPTED_EXIT_CODE, RESTART_JOB_EXIT_CODE, TRAINING_ROLES

from .api import (
    KIND,
    ROLES,
    TrainingJob,
    TrainingJobSpec,
    main_container_index,
)
from .manifests import (
    LABEL_GENERATION,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    desired_pod,
    task_name,
)
from .queueing import ADMITTED, QUEUED, Admission
from .stall import Stalled

PHASES = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
FINISHED = ("Succeeded", "Failed")
CONDITION_TYPES = ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")

# How a stalled task ends: killed (SIGKILL), as a kubelet kills a container whose liveness
# probe fails once the grace period is over.
STALLED_EXIT_CODE = 128 + int(signal.SIGKILL)
# A training task that lost a PS exits RESTART_JOB_EXIT_CODE, often before the PS's own
# end is reported (kubelets report independently): the restart waits this long for it,
# so that it names the PS, not the task that noticed.
LOST_PS_GRACE_S = 2.0

# Signals that mean the program itself crashed: restarting it would crash it again.
_CRASH_SIGNALS = frozenset(int(s) for s in (
    signal.SIGILL, signal.SIGTRAP, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE,
    signal.SIGSEGV, signal.SIGSYS))


def is_retryable_exit_code(code: int | None) -> bool:
    """Under ``restartPolicy: ExitCode``: may a task that ended with ``code`` run again?

    As Kubeflow documents: codes below 128 are the program's own verdict and permanent
    (1, 2, 126, 127 ...), except ``RESTART_JOB_EXIT_CODE``; 128 + a signal sent from
    outside (130 SIGINT, 137 SIGKILL, e.g. the OOM killer or preemption, 143 SIGTERM) is
    retryable; 128 itself (a bad exit argument), 128 + a crash signal (139 SIGSEGV, 134
    SIGABRT, ...) and codes above 128 + 64 are permanent. ``None`` (a pod lost without an
    exit code, e.g. evicted or its node gone) and 0 (a ps task that stopped before the
    job was done) are retryable.
    """
    if code is None or code == 0 or code == RESTART_JOB_EXIT_CODE:
        return True
    if 128 < code <= 128 + 64:
        return code - 128 not in _CRASH_SIGNALS
    return False


# ---- time


def format_time(t: datetime) -> str:
    return _utc(t).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return _utc(datetime.fromisoformat(text.replace("Z", "+00:00")))


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


# ---- status


def format_indexes(indexes: Iterable[int]) -> str:
    """``{0, 2, 3, 4}`` -> ``"0,2-4"`` (as a Kubernetes Job's completedIndexes)."""
    runs: list[list[int]] = []
    for i in sorted(set(indexes)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_indexes(text: str | None) -> frozenset[int]:
    indexes: set[int] = set()
    for part in (text or "").split(","):
        if not part.strip():
            continue
        first, _, last = part.partition("-")
        indexes.update(range(int(first), int(last or first) + 1))
    return frozenset(indexes)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        if self.message:
            out["message"] = self.message
        if self.last_transition_time:
            out["lastTransitionTime"] = self.last_transition_time
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> Condition:
        return cls(type=d["type"], status=d["status"], reason=d.get("reason", ""),
                   message=d.get("message", ""),
                   last_transition_time=d.get("lastTransitionTime"),
                   observed_generation=d.get("observedGeneration"))


@dataclass(frozen=True)
class ReplicaStatus:
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    restarts: int = 0
    completed: frozenset[int] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"active": self.active, "succeeded": self.succeeded,
                               "failed": self.failed, "restarts": self.restarts}
        if self.completed:
            out["completedIndexes"] = format_indexes(self.completed)
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> ReplicaStatus:
        return cls(active=d.get("active", 0), succeeded=d.get("succeeded", 0),
                   failed=d.get("failed", 0), restarts=d.get("restarts", 0),
                   completed=parse_indexes(d.get("completedIndexes")))


@dataclass(frozen=True)
class Status:
    phase: str | None = None
    conditions: tuple[Condition, ...] = ()
    replica_statuses: Mapping[str, ReplicaStatus] = field(default_factory=dict)
    workers: str | None = None
    start_time: str | None = None
    completion_time: str | None = None
    restart_count: int = 0
    restart_generation: int = 0
    run_generation: int = 0
    last_checkpoint: Mapping[str, Any] | None = None
    progress: Mapping[str, Any] | None = None
    observed_generation: int | None = None

    def replica(self, role: str) -> ReplicaStatus:
        return self.replica_statuses.get(role) or ReplicaStatus()

    def condition(self, type: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type), None)

    def to_dict(self) -> dict[str, Any]:
        """The status as written to the API (fields that were never set are left out)."""
        out: dict[str, Any] = {}
        if self.phase:
            out["phase"] = self.phase
        out["conditions"] = [c.to_dict() for c in self.conditions]
        out["replicaStatuses"] = {role: self.replica_statuses[role].to_dict()
                                  for role in ROLES if role in self.replica_statuses}
        for key, value in (("workers", self.workers), ("startTime", self.start_time),
                           ("completionTime", self.completion_time)):
            if value is not None:
                out[key] = value
        out["restartCount"] = self.restart_count
        out["restartGeneration"] = self.restart_generation
        out["runGeneration"] = self.run_generation
        if self.last_checkpoint is not None:
            out["lastCheckpoint"] = dict(self.last_checkpoint)
        if self.progress is not None:
            out["progress"] = dict(self.progress)
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        return out

    @classmethod
    def from_dict(cls, d: Mapping | None) -> Status:
        d = d or {}
        return cls(
            phase=d.get("phase"),
            conditions=tuple(Condition.from_dict(c) for c in d.get("conditions") or ()),
            replica_statuses={role: ReplicaStatus.from_dict(r)
                              for role, r in (d.get("replicaStatuses") or {}).items()},
            workers=d.get("workers"),
            start_time=d.get("startTime"),
            completion_time=d.get("completionTime"),
            restart_count=d.get("restartCount", 0),
            restart_generation=d.get("restartGeneration", 0),
            run_generation=d.get("runGeneration", 0),
            last_checkpoint=d.get("lastCheckpoint"),
            progress=d.get("progress"),
            observed_generation=d.get("observedGeneration"),
        )


# ---- pods, as far as decisions go


@dataclass(frozen=True)
class TaskPod:
    """One pod of the job, reduced to what decisions need."""

    name: str
    role: str
    index: int
    generation: int
    state: str  # of the task's container: pending | running | succeeded | failed
    pod_phase: str = "Pending"  # a pod may still run a sidecar after its task ended
    exit_code: int | None = None
    reason: str = ""  # why it is pending, or how it ended
    ready: bool = False
    started: bool = False
    terminating: bool = False
    foreign: bool = False  # owned by another TrainingJob of the same name (deleted before)
    started_at: str | None = None  # when its task container started running (RFC 3339)
    finished_at: str | None = None  # when its task container ended (RFC 3339)

    @property
    def task(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def live(self) -> bool:
        return not self.terminating

    @property
    def active(self) -> bool:
        return self.live and self.state in ("pending", "running")


def task_pods(job: TrainingJob, pods: Iterable[Mapping]) -> list[TaskPod]:
    """The job's pods, in task order: those with its labels whose controlling owner is a
    TrainingJob. One of another TrainingJob of the same name (deleted and made again) is
    ``foreign``, a stale pod to remove; a pod no TrainingJob controls is not the job's
    whatever its labels say (anyone who may create pods could otherwise pass one off as a
    task that exited 0), and is neither counted nor touched."""
    mains = {role: _main_container_name(job, role) for role in ROLES
             if job.spec.replica_specs.get(role) is not None}
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        role = labels.get(LABEL_ROLE)
        if labels.get(LABEL_JOB) != job.name or role not in ROLES:
            continue
        try:
            index = int(labels.get(LABEL_INDEX, ""))
            generation = int(labels.get(LABEL_GENERATION, "0"))
        except ValueError:
            continue
        controller = next((o for o in meta.get("ownerReferences") or () if o.get("controller")),
                          None)
        if job.uid and (controller is None or controller.get("kind") != KIND):
            continue
        foreign = bool(job.uid and controller.get("uid") != job.uid)
        state, exit_code, reason, ready, started = _pod_state(pod, mains.get(role))
        out.append(TaskPod(
            name=meta.get("name", ""), role=role, index=index, generation=generation,
            state=state, pod_phase=_pod_phase(pod),
            exit_code=exit_code, reason=reason, ready=ready, started=started,
            terminating=bool(meta.get("deletionTimestamp")), foreign=foreign,
            started_at=_started_at(pod, mains.get(role)),
            finished_at=_finished_at(pod, mains.get(role))))
    order = {role: i for i, role in enumerate(ROLES)}
    out.sort(key=lambda t: (order[t.role], t.index, t.generation, t.name))
    return out


def _main_container_name(job: TrainingJob, role: str) -> str:
    template = job.spec.source_template(role)  # a ps made from it keeps its containers
    return template["spec"]["containers"][main_container_index(template)]["name"]


def _pod_phase(pod: Mapping) -> str:
    """The pod's phase, or the one it is about to report: a kubelet keeps a pod Running
    while it tears the pod down, after every container has terminated (it reports the
    terminal phase once the pod's sandbox is gone)."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    statuses = status.get("containerStatuses") or []
    ended = [(c.get("state") or {}).get("terminated") for c in statuses]
    if phase != "Running" or not statuses or None in ended or len(statuses) < len(
            (pod.get("spec") or {}).get("containers") or ()):
        return phase
    return "Succeeded" if all(t.get("exitCode") == 0 for t in ended) else "Failed"


def _pod_state(pod: Mapping, main: str | None) -> tuple[str, int | None, str, bool, bool]:
    """(state, exit code, reason, ready, started) of a pod's task container.

    The task's container decides, not the pod phase alone: a pod whose sidecar still runs
    after the task exited has ended as far as the job goes.
    """
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    statuses = status.get("containerStatuses") or []
    container = next((c for c in statuses if c.get("name") == main), None)
    if container is None and statuses:
        container = statuses[0]
    state = (container or {}).get("state") or {}
    started = phase in ("Running", "Succeeded") or "running" in state or "terminated" in state
    terminated = state.get("terminated")
    if terminated is not None:
        code = terminated.get("exitCode")
        why = terminated.get("reason") or ""
        if code == 0:
            return "succeeded", 0, why or "Completed", False, True
        return "failed", code, why or "Error", False, True
    if phase == "Succeeded":
        return "succeeded", 0, "Completed", False, True
    if phase == "Failed":
        return "failed", None, status.get("reason") or "PodFailed", False, started
    if phase == "Running":
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or ())
        return "running", None, "", ready, True
    return "pending", None, _pending_reason(status, state), False, started


def _finished_at(pod: Mapping, main: str | None) -> str | None:
    for c in (pod.get("status") or {}).get("containerStatuses") or ():
        if c.get("name") == main:
            return ((c.get("state") or {}).get("terminated") or {}).get("finishedAt")
    return None


def _started_at(pod: Mapping, main: str | None) -> str | None:
    """When the task's container started running, else when the pod started."""
    status = pod.get("status") or {}
    for c in status.get("containerStatuses") or ():
        if c.get("name") == main:
            running = (c.get("state") or {}).get("running") or {}
            if running.get("startedAt"):
                return running["startedAt"]
    return status.get("startTime")


def _pending_reason(status: Mapping, state: Mapping) -> str:
    waiting = state.get("waiting")
    if waiting:
        why = waiting.get("reason") or "Waiting"
        return f"{why}: {waiting['message']}" if waiting.get("message") else why
    for c in status.get("conditions") or ():
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            why = c.get("reason") or "Unschedulable"
            return f"{why}: {c['message']}" if c.get("message") else why
    return "Pending"


# ---- observe


def observe(job: TrainingJob | Mapping, pods: Sequence[Mapping], now: datetime,
            admission: Admission | None = None) -> Status:
    """The job's status as its pods show it, carried on from its previous status.

    Counts, the workers column and the phase come from the pods; the restart counters
    come from the previous status (only ``decide`` changes them), and so do progress and
    the last checkpoint (only ``with_progress`` changes them). ``admission``: Kueue's
    answer, for a job in a queue (None for any other).
    """
    job = TrainingJob.of(job)
    prev = Status.from_dict(job.status)
    tasks = task_pods(job, pods)
    stale, current = _split(tasks, prev.run_generation)
    completed = _completed(job, prev, current)

    replica_statuses = {}
    for role in ROLES:
        if job.spec.replica_specs.get(role) is None:
            continue
        mine = [t for t in current if t.role == role]
        succeeded = (len(completed[role]) if role in TRAINING_ROLES
                     else sum(t.state == "succeeded" and t.live for t in mine))
        replica_statuses[role] = ReplicaStatus(
            active=sum(t.active for t in mine),
            succeeded=succeeded,
            failed=sum(t.state == "failed" and t.live for t in mine),
            restarts=prev.replica(role).restarts,
            completed=completed.get(role, frozenset()),
        )
    workers = job.spec.replica_specs.worker.replicas
    ready = sum(t.role == "worker" and t.ready and t.active for t in current)

    phase, reason, message = _natural_phase(job, prev, stale, current, completed, admission)
    status = dataclasses.replace(
        prev,
        replica_statuses=replica_statuses,
        workers=f"{ready}/{workers}",
        observed_generation=job.generation,
    )
    if phase in FINISHED and (prev.phase not in FINISHED or status.completion_time is None):
        status = dataclasses.replace(status, completion_time=format_time(now))
    if phase in ("Pending", "Running", "Restarting", "Suspended"):
        status = dataclasses.replace(status, completion_time=None)
    status = with_phase(status, job, phase, reason, message, now)
    return with_admission(status, job, admission, now) if phase not in FINISHED else status


def _split(tasks: list[TaskPod], run_generation: int) -> tuple[list[TaskPod], list[TaskPod]]:
    """(pods of an earlier run or another job, pods of the current run)."""
    stale = [t for t in tasks if t.generation < run_generation or t.foreign]
    current = [t for t in tasks if t.generation >= run_generation and not t.foreign]
    return stale, current


def _completed(job: TrainingJob, prev: Status,
               current: list[TaskPod]) -> dict[str, frozenset[int]]:
    """Indexes of the training tasks that exited 0: remembered, plus those seen now."""
    out = {}
    for role in TRAINING_ROLES:
        replicas = job.spec.replica_specs.replicas(role)
        seen = {t.index for t in current if t.role == role and t.state == "succeeded"}
        out[role] = frozenset(i for i in prev.replica(role).completed | seen if i < replicas)
    return out


def success_reason(spec: TrainingJobSpec,
                   completed: Mapping[str, Collection[int]]) -> str | None:
    """Why a job has succeeded, given the indexes of its training tasks that exited 0
    (by role), or None while it has not. The operator and the local launcher both ask this.

    ``successPolicy`` ChiefWorker (TFJob's default): the chief exited 0, or, without a chief,
    worker 0 did; what still runs is stopped then. A sync job's worker can wait forever for
    a step the chief will not run, so the job must not wait for it. AllWorkers: the chief
    (if any) and every worker exited 0.
    """
    specs = spec.replica_specs
    has_chief = specs.replicas("chief") > 0
    done = {role: completed.get(role, ()) for role in TRAINING_ROLES}
    if spec.success_policy == "ChiefWorker":
        if has_chief:
            return "the chief exited 0" if 0 in done["chief"] else None
        return "worker 0 exited 0" if 0 in done["worker"] else None
    workers = specs.worker.replicas
    if any(i not in done["worker"] for i in range(workers)):
        return None
    if has_chief:
        return f"the chief and all {workers} workers exited 0" if 0 in done["chief"] else None
    return f"all {workers} workers exited 0"


def _natural_phase(job: TrainingJob, prev: Status, stale: list[TaskPod],
                   current: list[TaskPod], completed: Mapping[str, frozenset[int]],
                   admission: Admission | None) -> tuple[str, str, str]:
    if prev.phase in FINISHED:
        kept = prev.condition(prev.phase)
        return prev.phase, kept.reason if kept else prev.phase, kept.message if kept else ""
    if job.spec.run_policy.suspend:
        return "Suspended", "Suspended", "spec.runPolicy.suspend is true"
    if admission is not None and not admission.admitted:
        return _held_phase(prev, admission)
    why = success_reason(job.spec, completed)
    if why:
        return "Succeeded", "Succeeded", f"TrainingJob {job.name} succeeded: {why}"
    waiting = _not_running(job, current, completed)
    if prev.phase == "Restarting" and (stale or waiting):
        kept = prev.condition("Restarting")
        return "Restarting", kept.reason if kept else "Restarting", kept.message if kept else ""
    resumed = "Resumed" if prev.phase == "Suspended" else "TasksPending"
    if stale:
        return "Pending", resumed, (
            f"waiting for {len(stale)} pod(s) of the previous run to go: "
            + ", ".join(t.name for t in stale[:3]))
    if not waiting:
        return "Running", "AllTasksRunning", f"all {len(job.spec.tasks())} tasks are running"
    shown = "; ".join(f"{task} ({why})" if why not in ON_THEIR_WAY else task
                      for task, why in waiting[:3])
    more = f" and {len(waiting) - 3} more" if len(waiting) > 3 else ""
    if prev.phase == "Suspended":
        return "Pending", "Resumed", f"resuming; waiting for {shown}{more}"
    # A task the scheduler cannot place (a gang's tasks all wait for room for every one):
    # the job waits for capacity, not for its own pods to start.
    reason = ("WaitingForCapacity" if any(why.startswith("Unschedulable") for _, why in waiting)
              else "TasksPending")
    return "Pending", reason, f"waiting for {len(waiting)} task(s): {shown}{more}"


# How a task's pod looks between its creation and its start: named in no message, so
# that a job's status is not written again at each of these steps of every pod.
ON_THEIR_WAY = frozenset({"no pod", "Pending", "ContainerCreating", "PodInitializing"})


def _held_phase(prev: Status, admission: Admission) -> tuple[str, str, str]:
    """A queued job that Kueue has not admitted: Pending until it first runs; evicted, it
    is Suspended (and stays so, queued again, until re-admitted: then it resumes)."""
    if admission.state != QUEUED:
        return "Suspended", admission.reason, f"evicted by Kueue: {admission.message}"
    if prev.phase == "Suspended":
        kept = prev.condition("Suspended")
        return "Suspended", kept.reason if kept else "Suspended", \
            f"queued again: {admission.message}"
    return "Pending", "Queued", admission.message


def _not_running(job: TrainingJob, current: list[TaskPod],
                 completed: Mapping[str, frozenset[int]]) -> list[tuple[str, str]]:
    """(task, why) for every task that is neither running nor (a training task) done."""
    by_task = {(t.role, t.index): t for t in current if t.live}
    out = []
    for role, i in job.spec.tasks():
        if role in TRAINING_ROLES and i in completed[role]:
            continue
        t = by_task.get((role, i))
        if t is None:
            out.append((f"{role}-{i}", "no pod"))
        elif t.state != "running":
            out.append((f"{role}-{i}", t.reason or t.state))
    return out


# ---- progress


def with_progress(status: Status, snapshot: Mapping[str, Any] | None) -> Status:
    """``status.progress`` and ``status.lastCheckpoint`` from the ``/progress`` snapshot of
    the chief (or worker 0) (``flowmill.runtime.telemetry``).

    Progress is the job's global step as the task last saw it (its own step where it
    reports none), its loss and examples per second, and the time it reported that step.
    It changes only with a step reported since the last snapshot, so a stalled job keeps
    its last numbers and their (aging) time and costs no status writes. The last
    checkpoint never goes back to an older step. No snapshot (the fetch failed, the
    pod ended) or a malformed one changes nothing: what was seen last stays.
    """
    if not isinstance(snapshot, Mapping):
        return status
    changes: dict[str, Any] = {}
    step = snapshot.get("globalStep")
    if not _count(step):
        step = snapshot.get("step")
    if _count(step):
        progress: dict[str, Any] = {"step": step}
        for key in ("loss", "examplesPerSecond"):
            value = _finite(snapshot.get(key))
            if value is not None:
                progress[key] = round(value, 6 if key == "loss" else 1)
        updated = _timestamp(snapshot.get("updated"))
        if updated is not None:
            progress["time"] = updated
        prev = status.progress or {}
        if (prev.get("step"), prev.get("time")) != (step, updated):
            changes["progress"] = progress
    ckpt = snapshot.get("lastCheckpoint")
    if isinstance(ckpt, Mapping) and _count(ckpt.get("step")) and \
            isinstance(ckpt.get("uri"), str) and ckpt["uri"]:
        prev_step = (status.last_checkpoint or {}).get("step")
        if not isinstance(prev_step, int) or ckpt["step"] > prev_step:
            seen: dict[str, Any] = {"step": ckpt["step"], "uri": ckpt["uri"]}
            committed = _timestamp(ckpt.get("time"))
            if committed is not None:
                seen["time"] = committed
            changes["last_checkpoint"] = seen
    return dataclasses.replace(status, **changes) if changes else status


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _timestamp(value: Any) -> str | None:
    """An RFC 3339 time as the status writes it, or None when it is not one."""
    if not isinstance(value, str):
        return None
    try:
        return format_time(parse_time(value))
    except (ValueError, TypeError, AttributeError):  # AttributeError: "" parses to None
        return None


def with_phase(status: Status, job: TrainingJob, phase: str, reason: str, message: str,
               now: datetime) -> Status:
    """Set the phase and bring the conditions in line with it.

    Created and Running are always listed (Running false says why the job is not running);
    the others once they have first been true. A lastTransitionTime changes only when its
    condition's status does. Conditions that turn false take the new phase's reason.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r} (phases: {', '.join(PHASES)})")
    stamp = format_time(now)
    existing = {c.type: c for c in status.conditions}
    conditions = []
    for type in CONDITION_TYPES:
        if type == "Created":
            true = True
            why, text = "Created", f"TrainingJob {job.namespace}/{job.name} was created"
        else:
            true = type == phase
            why, text = reason, message
        old = existing.get(type)
        if old is None and not true and type != "Running":
            continue
        value = "True" if true else "False"
        if old is not None and old.status == value:
            keep = type == "Created" or (not true and type != "Running")
            conditions.append(dataclasses.replace(
                old, reason=old.reason if keep else why, message=old.message if keep else text,
                observed_generation=job.generation))
        else:
            conditions.append(Condition(type, value, why, text, stamp, job.generation))
    conditions += [c for c in status.conditions if c.type not in CONDITION_TYPES]
    return dataclasses.replace(status, phase=phase, conditions=tuple(conditions))


def with_admission(status: Status, job: TrainingJob, admission: Admission | None,
                   now: datetime) -> Status:
    """For a job in a Kueue queue: Queued (True while it waits for quota, with Kueue's
    message) and Admitted (True while Kueue lets it run); lastTransitionTime moves only
    with status."""
    if admission is None:
        return status
    queued = admission.state == QUEUED
    admitted = admission.state == ADMITTED
    if admitted:
        reason, message = "Admitted", admission.describe()
    else:
        reason, message = admission.reason, admission.message
    wanted = {"Queued": ("True" if queued else "False", reason, message),
              "Admitted": ("True" if admitted else "False", reason, message)}
    stamp = format_time(now)
    conditions = []
    for c in status.conditions:
        if c.type in wanted:
            value, why, text = wanted.pop(c.type)
            conditions.append(Condition(
                c.type, value, why, text,
                c.last_transition_time if c.status == value else stamp, job.generation))
        else:
            conditions.append(c)
    conditions += [Condition(type, value, why, text, stamp, job.generation)
                   for type, (value, why, text) in wanted.items()]
    return dataclasses.replace(status, conditions=tuple(conditions))


# ---- decide


ACTIONS = ("wait", "create", "recreate", "restart_job", "fail", "succeed", "suspend",
           "cleanup", "delete_job")


@dataclass(frozen=True)
class Action:
    """What to do now. Write ``status`` first, then delete ``delete`` (pod names), then
    create ``create`` (pods, in order: stop at the first error, so workers never start
    without their ps tasks), then delete the job itself if ``delete_job``. Writing the
    status first means a crash in between repeats a restart's count rather than losing it.
    Look again after ``requeue_after`` seconds (a deadline or TTL is due) at the latest.
    """

    kind: str
    status: Status
    create: tuple[dict, ...] = ()
    delete: tuple[str, ...] = ()
    delete_job: bool = False
    reason: str = ""  # for an Event, when kind is not "wait"
    message: str = ""
    warning: bool = False
    requeue_after: float | None = None


def decide(job: TrainingJob | Mapping, pods: Sequence[Mapping], status: Status,
           now: datetime, stalled: Sequence[Stalled] = (),
           admission: Admission | None = None) -> Action:
    """The next step for a job, given its pods and ``observe``'s status of them, the
    tasks holding it up if it has stalled (``stall.holders``, from what the tasks serve),
    and Kueue's answer for a job in a queue."""
    job = TrainingJob.of(job)
    tasks = task_pods(job, pods)
    if job.deleting:
        return Action("wait", status)
    if status.phase in FINISHED:
        return _finish(job, tasks, status, now)
    if job.spec.run_policy.suspend:
        return _suspend(job, tasks, status)
    if admission is not None and not admission.admitted:
        return _hold(job, tasks, status, admission)
    deadline = job.spec.run_policy.active_deadline_seconds
    start = parse_time(status.start_time)
    left = None
    if deadline is not None and start is not None:
        left = (start + timedelta(seconds=deadline) - _utc(now)).total_seconds()
        if left <= 0:
            return _fail(job, tasks, status, now, "DeadlineExceeded",
                         f"TrainingJob {job.name} ran longer than activeDeadlineSeconds "
                         f"({deadline}s) since {status.start_time}")
    stale, current = _split(tasks, status.run_generation)
    if stale:
        delete = tuple(t.name for t in stale if t.live)
        return Action("cleanup" if delete else "wait", status, delete=delete,
                      reason="RemovingPreviousRun",
                      message=f"deleting {len(delete)} pod(s) of the previous run",
                      requeue_after=left)
    action = _on_failures(job, tasks, current, status, now)
    if action is not None:
        return action
    action = _on_stall(job, tasks, current, status, now, stalled)
    if action is not None:
        return action
    return _create_missing(job, current, status, now, left, admission)


def _finish(job: TrainingJob, tasks: list[TaskPod], status: Status, now: datetime) -> Action:
    """A finished job: stop what still runs (per cleanPodPolicy), delete it when its TTL
    is due."""
    first = Status.from_dict(job.status).phase not in FINISHED
    delete = _cleanup(job, tasks)
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done = parse_time(status.completion_time)
    requeue = None
    if ttl is not None and done is not None and not first:
        requeue = (done + timedelta(seconds=ttl) - _utc(now)).total_seconds()
        if requeue <= 0:
            return Action("delete_job", status, delete=delete, delete_job=True,
                          reason="TTLExpired",
                          message=f"deleting TrainingJob {job.name}: finished "
                                  f"{status.completion_time}, ttlSecondsAfterFinished {ttl}")
    elif ttl is not None:
        requeue = float(ttl)
    if first:
        cond = status.condition(status.phase)
        return Action("succeed" if status.phase == "Succeeded" else "fail", status,
                      delete=delete, reason=cond.reason if cond else status.phase,
                      message=cond.message if cond else "",
                      warning=status.phase == "Failed", requeue_after=requeue)
    if delete:
        return Action("cleanup", status, delete=delete, reason="CleaningUp",
                      message=f"deleting {len(delete)} pod(s) of the finished job "
                              f"(cleanPodPolicy {job.spec.run_policy.clean_pod_policy})",
                      requeue_after=requeue)
    return Action("wait", status, requeue_after=requeue)


def _cleanup(job: TrainingJob, tasks: list[TaskPod]) -> tuple[str, ...]:
    """Pods to delete once the job has finished: per cleanPodPolicy, and running ps tasks
    whatever the policy (they only serve workers that are done). A pod counts as running
    by its phase: one whose task ended while a sidecar runs on would never stop."""
    policy = job.spec.run_policy.clean_pod_policy
    out = []
    for t in tasks:
        if not t.live:
            continue
        running = t.pod_phase in ("Pending", "Running")
        if policy == "All" or (running and (policy == "Running" or t.role == "ps")):
            out.append(t.name)
    return tuple(out)


def _suspend(job: TrainingJob, tasks: list[TaskPod], status: Status) -> Action:
    """Delete every pod, the ps tasks last: asked to stop, the chief commits a checkpoint
    of the step it reached, which the ps tasks holding the variables must serve, so they
    are deleted once no training task runs. A resume starts a new run (and a new
    activeDeadlineSeconds)."""
    training = any(t.role in TRAINING_ROLES and t.state in ("pending", "running")
                   for t in tasks)
    delete = tuple(t.name for t in tasks if t.live and not (training and t.role == "ps"))
    newest = max([status.restart_generation, *(t.generation for t in tasks)])
    status = dataclasses.replace(status, start_time=None,
                                 run_generation=max(status.run_generation, newest + 1))
    first = Status.from_dict(job.status).phase != "Suspended"
    if not delete and not first:
        return Action("wait", status)
    return Action("suspend", status, delete=delete, reason="Suspended",
                  message=f"TrainingJob {job.name} suspended: deleting {len(delete)} pod(s)")


def _hold(job: TrainingJob, tasks: list[TaskPod], status: Status,
          admission: Admission) -> Action:
    """A job Kueue has not admitted runs no pod. Evicted, it is suspended as by
    runPolicy.suspend: every pod asked to stop (the chief commits a checkpoint in its
    grace period), a new run when re-admitted, from that checkpoint; nothing counted."""
    if not any(t.live for t in tasks) and (admission.state == QUEUED or not tasks):
        return Action("wait", status)
    action = _suspend(job, tasks, status)
    if action.kind == "wait":
        return action
    return dataclasses.replace(
        action, reason=admission.reason,
        message=f"TrainingJob {job.name} evicted by Kueue ({admission.message}): "
                f"deleting {len(action.delete)} pod(s)")


def _fail(job: TrainingJob, tasks: list[TaskPod], status: Status, now: datetime, reason: str,
          message: str) -> Action:
    status = dataclasses.replace(status, completion_time=format_time(now))
    status = with_phase(status, job, "Failed", reason, message, now)
    return Action("fail", status, delete=_cleanup(job, tasks), reason=reason, message=message,
                  warning=True)


def failure_action(role: str, policy: str, code: int | None, is_chief: bool = False) -> str:
    """What one task's failure calls for: ``fail``, ``restart_job`` or ``recreate`` (the task
    alone). ``code`` is its exit code as a container reports it (128 + N for signal N),
    None when it is lost without one; 0 only for a ps task that stopped too early. The
    operator and the local launcher both decide with this.

    A preempted task (``PREEMPTED_EXIT_CODE``) did not fail: it runs again under every
    restart policy, the chief by restarting the job from the checkpoint it committed on
    its way out (``counts_against_backoff`` says such a restart is free).
    """
    if code == PREEMPTED_EXIT_CODE:
        return "restart_job" if is_chief or role == "ps" else "recreate"
    if policy == "Never":
        return "fail"
    if code == RESTART_JOB_EXIT_CODE:
        return "restart_job"
    if policy == "ExitCode" and not is_retryable_exit_code(code):
        return "fail"
    return "restart_job" if role == "ps" else "recreate"


def counts_against_backoff(code: int | None) -> bool:
    """Whether a restart for a task that ended with ``code`` spends ``backoffLimit``: every
    one does but a preemption's (volcano#2560, jobset#1117: preemption must not use up
    the budget meant for failures)."""
    return code != PREEMPTED_EXIT_CODE


def is_chief_task(job: TrainingJob, role: str, index: int) -> bool:
    """The chief, or worker 0 of a job without one: the task that checkpoints."""
    if job.spec.replica_specs.replicas("chief"):
        return role == "chief"
    return role == "worker" and index == 0


def _describe(t: TaskPod) -> str:
    if t.terminating:
        return f"{t.task} (pod {t.name}) is being deleted"
    if t.state == "succeeded":
        return f"{t.task} (pod {t.name}) exited 0 before the job finished"
    code = f"exited with code {t.exit_code}" if t.exit_code is not None else "failed"
    return f"{t.task} (pod {t.name}) {code} ({t.reason})" if t.reason else \
        f"{t.task} (pod {t.name}) {code}"


def _on_failures(job: TrainingJob, tasks: list[TaskPod], current: list[TaskPod],
                 status: Status, now: datetime) -> Action | None:
    specs = job.spec.replica_specs
    failed = [t for t in current if t.live and t.state == "failed"]
    # A ps task holds state only it has: one that ends, or whose pod goes away once
    # training began, is lost with its variables.
    started = any(t.role in TRAINING_ROLES and t.started for t in current) or any(
        status.replica(r).completed for r in TRAINING_ROLES)
    lost = [t for t in current if started and t.role == "ps" and (
        t.terminating or (t.live and t.state == "succeeded"))]
    present = {(t.role, t.index) for t in current}
    missing_ps = [f"ps-{i}" for i in range(specs.replicas("ps")) if ("ps", i) not in present]
    verdicts = [(t, failure_action(t.role, specs.get(t.role).restart_policy, t.exit_code,
                                   is_chief_task(job, t.role, t.index)))
                for t in failed]
    verdicts += [(t, failure_action("ps", specs.ps.restart_policy, None)) for t in lost]

    fatal = [(t, v) for t, v in verdicts if v == "fail"]
    if fatal:
        t = fatal[0][0]
        policy = specs.get(t.role).restart_policy
        reason = "TaskFailed" if policy == "Never" else "NonRetryableExitCode"
        why = ("restartPolicy Never" if policy == "Never"
               else "restartPolicy ExitCode treats the code as permanent")
        return _fail(job, tasks, status, now, reason,
                     f"TrainingJob {job.name} failed: {_describe(t)}; {why}")

    job_restart = [t for t, v in verdicts if v == "restart_job"]
    if job_restart and not lost and not missing_ps and all(
            t.role in TRAINING_ROLES and t.exit_code == RESTART_JOB_EXIT_CODE
            for t in job_restart):
        wait = _lost_ps_wait(job_restart, now)
        if wait is not None:
            return Action("wait", status, requeue_after=wait)
    if job_restart or (missing_ps and started):
        if job_restart:
            culprit = job_restart[0]
            role, what = culprit.role, _describe(culprit)
        else:
            role, what = "ps", f"{missing_ps[0]} lost its pod after training began"
        counted = not job_restart or counts_against_backoff(job_restart[0].exit_code)
        return _restart_job(job, tasks, status, now, role, what, counted)

    recreate = [t for t, v in verdicts if v == "recreate"]
    if recreate:
        return _recreate(job, tasks, status, now, recreate)
    return None


def _lost_ps_wait(tasks: list[TaskPod], now: datetime) -> float | None:
    """Seconds to wait for a PS's end to be reported, when every task asking for a job
    restart ended within ``LOST_PS_GRACE_S``; None when the wait is over."""
    ends = [parse_time(t.finished_at) for t in tasks]
    if any(e is None for e in ends):
        return None
    left = LOST_PS_GRACE_S - (_utc(now) - max(ends)).total_seconds()
    return min(left, LOST_PS_GRACE_S) if left > 0 else None


def _on_stall(job: TrainingJob, tasks: list[TaskPod], current: list[TaskPod], status: Status,
              now: datetime, stalled: Sequence[Stalled]) -> Action | None:
    """Stalled tasks are ended as a kubelet ends a container whose liveness probe fails,
    and judged by their restart policy as a container killed that way (137): recreated,
    counted against backoffLimit, or under Never the job fails."""
    running = {(t.role, t.index): t for t in current if t.live and t.state == "running"}
    found = [(running[(s.role, s.index)], s) for s in stalled if (s.role, s.index) in running]
    if not found:
        return None
    specs = job.spec.replica_specs
    what = "; ".join(f"{t.task} (pod {t.name}) is stalled: {s.reason}" for t, s in found)
    for t, _ in found:
        verdict = failure_action(t.role, specs.get(t.role).restart_policy, STALLED_EXIT_CODE,
                                 is_chief_task(job, t.role, t.index))
        if verdict == "fail":
            return _fail(job, tasks, status, now, "TaskStalled",
                         f"TrainingJob {job.name} failed: {what}; restartPolicy Never")
    return _recreate(job, tasks, status, now, [t for t, _ in found], what=what,
                     reason="TaskStalled")


def _over_budget(job: TrainingJob, tasks: list[TaskPod], status: Status, now: datetime,
                 wanted: int, what: str) -> Action | None:
    limit = job.spec.run_policy.backoff_limit
    if wanted == 0 or status.restart_count + wanted <= limit:
        return None
    return _fail(job, tasks, status, now, "BackoffLimitExceeded",
                 f"TrainingJob {job.name} failed: backoffLimit {limit} reached after "
                 f"{status.restart_count} restart(s); last failure: {what}")


def _bump(status: Status, role: str, n: int, counted: bool = True, **changes: Any) -> Status:
    """``n`` more restarts of ``role``'s tasks; ``counted`` ones spend the job's budget."""
    replicas = dict(status.replica_statuses)
    replicas[role] = dataclasses.replace(status.replica(role),
                                         restarts=status.replica(role).restarts + n)
    spent = status.restart_count + (n if counted else 0)
    return dataclasses.replace(status, restart_count=spent, replica_statuses=replicas,
                               **changes)


def _restart_job(job: TrainingJob, tasks: list[TaskPod], status: Status, now: datetime,
                 role: str, what: str, counted: bool = True) -> Action:
    """Every pod goes; once all are gone the job starts again (from its last checkpoint),
    every training task included. A preemption's restart is not ``counted``."""
    over = _over_budget(job, tasks, status, now, 1 if counted else 0, what)
    if over is not None:
        return over
    newest = max([status.restart_generation, *(t.generation for t in tasks)])
    status = _bump(status, role, 1, counted, run_generation=newest + 1)
    status = dataclasses.replace(status, replica_statuses={
        r: dataclasses.replace(s, completed=frozenset())
        for r, s in status.replica_statuses.items()})
    budget = (f"restart {status.restart_count} of {job.spec.run_policy.backoff_limit}"
              if counted else "preempted: not counted against backoffLimit")
    message = f"restarting TrainingJob {job.name} from its last checkpoint ({budget}): {what}"
    status = with_phase(status, job, "Restarting", "RestartingJob", message, now)
    delete = tuple(t.name for t in tasks if t.live)
    return Action("restart_job", status, delete=delete, reason="RestartingJob",
                  message=message, warning=True)


def _recreate(job: TrainingJob, tasks: list[TaskPod], status: Status, now: datetime,
              failed: list[TaskPod], what: str = "", reason: str = "RestartingTasks") -> Action:
    what = what or "; ".join(_describe(t) for t in failed)
    counted = [t for t in failed if counts_against_backoff(t.exit_code)]
    over = _over_budget(job, tasks, status, now, len(counted), what)
    if over is not None:
        return over
    for t in failed:
        status = _bump(status, t.role, 1, counts_against_backoff(t.exit_code))
    preempted = len(failed) - len(counted)
    uncounted = f", {preempted} preempted, not counted" if preempted else ""
    message = (f"recreating {len(failed)} task(s) (restarts {status.restart_count} of "
               f"{job.spec.run_policy.backoff_limit}{uncounted}): {what}")
    status = with_phase(status, job, "Restarting", reason, message, now)
    return Action("recreate", status, delete=tuple(t.name for t in failed),
                  reason=reason, message=message, warning=True)


def _create_missing(job: TrainingJob, current: list[TaskPod], status: Status, now: datetime,
                    left: float | None, admission: Admission | None) -> Action:
    """Create the pods of tasks that have none (and did not finish), all at once; delete
    pods of tasks the spec no longer has."""
    desired = set(job.spec.tasks())
    taken = {t.name for t in current}
    extra = tuple(t.name for t in current if t.live and (t.role, t.index) not in desired)
    missing = [
        (role, i) for role, i in job.spec.tasks()
        if task_name(job.name, role, i) not in taken
        and not (role in TRAINING_ROLES and i in status.replica(role).completed)
    ]
    if not missing:
        if extra:
            return Action("cleanup", status, delete=extra, reason="RemovingExtraTasks",
                          message=f"deleting pods of tasks not in the spec: {', '.join(extra)}",
                          requeue_after=left)
        return Action("wait", status, requeue_after=left)
    # Newer than every pod so far, and of the current run (even if a status write was lost).
    # One an earlier decision handed out and no pod carries (its pods could not be made:
    # a quota, a webhook) is used again: a new one would change the status at every try,
    # and its write would bring the job straight back, past the back-off.
    newest = max((t.generation for t in current), default=0)
    if status.restart_generation > newest and status.restart_generation >= status.run_generation:
        generation = status.restart_generation
    else:
        generation = max(status.restart_generation, status.run_generation - 1, newest) + 1
    placements = admission.placements if admission is not None else {}
    pods = tuple(desired_pod(job, role, i, generation, placements.get(role))
                 for role, i in missing)
    # The pods about to be made count as active already (they will show as pending), so
    # the status is not written again when they appear.
    replicas = dict(status.replica_statuses)
    for role, _ in missing:
        replicas[role] = dataclasses.replace(status.replica(role),
                                             active=replicas.get(role, status.replica(role))
                                             .active + 1)
    changes: dict[str, Any] = {"restart_generation": generation,
                               "replica_statuses": replicas}
    if status.start_time is None:
        changes["start_time"] = format_time(now)
        deadline = job.spec.run_policy.active_deadline_seconds
        left = float(deadline) if deadline is not None else left
    status = dataclasses.replace(status, **changes)
    names = ", ".join(p["metadata"]["name"] for p in pods)
    return Action("create", status, create=pods, delete=extra, reason="CreatingTasks",
                  message=f"creating {len(pods)} pod(s): {names}", requeue_after=left)
