"""Pods -> status, and failure -> action: every branch of observe and decide."""

import copy
import json
import pathlib
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from flowmill.operator import status as st
from flowmill.operator.api import TrainingJob
from flowmill.operator.manifests import LABEL_GENERATION, desired_pod
from flowmill.operator.status import (
    Status,
    decide,
    format_indexes,
    is_retryable_exit_code,
    observe,
    parse_indexes,
)
from flowmill.runtime.cluster import PREEMPTED_EXIT_CODE, RESTART_JOB_EXIT_CODE

UID = "job-uid-1"
T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
TEMPLATE = {"spec": {"containers": [
    {"name": "sidecar", "image": "logs"},
    {"name": "flowmill", "image": "flowmill:dev", "command": ["python", "train.py"]}]}}


def at(seconds):
    return T0 + timedelta(seconds=seconds)


def stamp(seconds=0):
    return st.format_time(at(seconds))


def make_job(ps=1, workers=2, chief=0, status=None, policy=None, ps_policy=None, suspend=False,
             success=None, **run_policy):
    replica_specs = {"worker": {"replicas": workers, "template": TEMPLATE}}
    if ps:
        replica_specs["ps"] = {"replicas": ps}
    if chief:
        replica_specs["chief"] = {"replicas": chief}
    if policy:
        replica_specs["worker"]["restartPolicy"] = policy
        if chief:
            replica_specs["chief"]["restartPolicy"] = policy
    if ps_policy:
        replica_specs["ps"]["restartPolicy"] = ps_policy
    spec = {"replicaSpecs": replica_specs, "runPolicy": {"suspend": suspend, **run_policy}}
    if success:
        spec["successPolicy"] = success
    return {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "mnist", "namespace": "ml", "uid": UID, "generation": 2},
        "spec": spec,
        "status": copy.deepcopy(status or {}),
    }


def running_status(**changes):
    """A job whose pods (generation 1) were created at T0 and all run."""
    base = {"phase": "Running", "startTime": stamp(), "restartGeneration": 1,
            "conditions": [
                {"type": "Created", "status": "True", "reason": "Created",
                 "lastTransitionTime": stamp()},
                {"type": "Running", "status": "True", "reason": "AllTasksRunning",
                 "lastTransitionTime": stamp(5)}]}
    base.update(changes)
    return base


def pod(role, index, state="running", code=None, gen=1, terminating=False, ready=True,
        annotations=None, uid=UID, job="mnist"):
    """A pod as the API returns it, in one of a few kubelet-reported states."""
    labels = {"flowmill.dev/job-name": job, "flowmill.dev/replica-type": role,
              "flowmill.dev/replica-index": str(index), LABEL_GENERATION: str(gen)}
    meta = {"name": f"{job}-{role}-{index}", "namespace": "ml", "labels": labels,
            "ownerReferences": [{"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
                                 "name": job, "uid": uid, "controller": True}]}
    if terminating:
        meta["deletionTimestamp"] = stamp()
    if annotations:
        meta["annotations"] = {k: json.dumps(v) for k, v in annotations.items()}
    sidecar = {"name": "sidecar", "state": {"running": {}}}
    main = {"name": "flowmill", "state": {}}
    status = {"containerStatuses": [sidecar, main]}
    if state == "pending":
        status["phase"] = "Pending"
        main["state"] = {"waiting": {"reason": "ContainerCreating"}}
    elif state == "unschedulable":
        status = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/1 nodes have enough nvidia.com/gpu"}]}
    elif state == "running":
        status["phase"] = "Running"
        main["state"] = {"running": {}}
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    elif state == "succeeded":
        status["phase"] = "Succeeded"
        main["state"] = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    elif state == "failed":
        status["phase"] = "Failed"
        main["state"] = {"terminated": {"exitCode": code, "reason": "Error"}}
    elif state == "exited":  # the task exited, a sidecar still runs: the pod says Running
        status["phase"] = "Running"
        main["state"] = {"terminated": {"exitCode": code,
                                        "reason": "Completed" if code == 0 else "Error"}}
    elif state == "stopping":  # every container exited; the kubelet has yet to say so
        status["phase"] = "Running"
        sidecar["state"] = {"terminated": {"exitCode": 0, "reason": "Completed"}}
        main["state"] = {"terminated": {"exitCode": code or 0,
                                        "reason": "Completed" if not code else "Error"}}
    elif state == "evicted":
        status = {"phase": "Failed", "reason": "Evicted"}
    else:
        raise ValueError(state)
    return {"metadata": meta, "status": status}


def all_running(ps=1, workers=2, chief=0, gen=1):
    return ([pod("ps", i, gen=gen) for i in range(ps)]
            + [pod("chief", i, gen=gen) for i in range(chief)]
            + [pod("worker", i, gen=gen) for i in range(workers)])


def step(job, pods, now=T0):
    status = observe(job, pods, now)
    return decide(job, pods, status, now)


def names(pods):
    return [p["metadata"]["name"] for p in pods]


def cond(status, type):
    c = status.condition(type)
    return None if c is None else (c.status, c.reason)


# ---- exit codes


@pytest.mark.parametrize("code,retryable", [
    (None, True), (0, True), (75, True), (1, False), (2, False), (126, False), (127, False),
    (128, False), (129, True), (130, True), (134, False), (135, False), (136, False),
    (137, True), (139, False), (143, True), (192, True), (193, False), (255, False)])
def test_retryable_exit_codes(code, retryable):
    assert is_retryable_exit_code(code) is retryable


@pytest.mark.parametrize("policy,chief,done,why", [
    ("ChiefWorker", 1, {"chief": {0}}, "the chief exited 0"),
    ("ChiefWorker", 1, {"worker": {0, 1, 2}}, None),
    ("ChiefWorker", 0, {"worker": {0}}, "worker 0 exited 0"),
    ("ChiefWorker", 0, {"worker": {1, 2}}, None),
    ("ChiefWorker", 0, {}, None),
    ("AllWorkers", 0, {"worker": {0, 1}}, None),
    ("AllWorkers", 0, {"worker": {0, 1, 2}}, "all 3 workers exited 0"),
    ("AllWorkers", 1, {"chief": {0}, "worker": {0, 1}}, None),
    ("AllWorkers", 1, {"worker": {0, 1, 2}}, None),
    ("AllWorkers", 1, {"chief": {0}, "worker": {0, 1, 2}},
     "the chief and all 3 workers exited 0"),
])
def test_success_policies(policy, chief, done, why):
    """The one rule the operator and the local launcher both apply."""
    job = TrainingJob.from_dict(make_job(workers=3, chief=chief, success=policy))
    assert st.success_reason(job.spec, done) == why


def test_success_policy_defaults_to_chief_worker():
    assert TrainingJob.from_dict(make_job()).spec.success_policy == "ChiefWorker"


@pytest.mark.parametrize("role,policy,code,action", [
    ("worker", "OnFailure", 1, "recreate"),
    ("worker", "OnFailure", 137, "recreate"),
    ("chief", "OnFailure", 2, "recreate"),
    ("worker", "ExitCode", 137, "recreate"),
    ("worker", "ExitCode", None, "recreate"),
    ("worker", "ExitCode", 1, "fail"),
    ("worker", "ExitCode", 139, "fail"),
    ("worker", "Never", 137, "fail"),
    ("worker", "Never", 75, "fail"),
    ("worker", "OnFailure", 75, "restart_job"),
    ("worker", "ExitCode", 75, "restart_job"),
    ("ps", "ExitCode", 137, "restart_job"),
    ("ps", "ExitCode", 0, "restart_job"),
    ("ps", "ExitCode", 1, "fail"),
    ("ps", "OnFailure", 1, "restart_job"),
    ("ps", "Never", 137, "fail"),
])
def test_failure_actions(role, policy, code, action):
    """Failure -> action, as the operator and the local launcher both decide it."""
    assert st.failure_action(role, policy, code) == action


@pytest.mark.parametrize("role, chief, action", [
    ("worker", False, "recreate"), ("worker", True, "restart_job"),
    ("chief", True, "restart_job"), ("ps", False, "restart_job"),
])
@pytest.mark.parametrize("policy", ["Never", "OnFailure", "ExitCode"])
def test_a_preempted_task_runs_again_under_every_policy_uncounted(role, chief, action, policy):
    """143 (SIGTERM: eviction, preemption, drain) is not a failure: the chief restarts the
    job from the checkpoint it committed on its way out, a worker comes back alone."""
    assert st.failure_action(role, policy, PREEMPTED_EXIT_CODE, chief) == action
    assert not st.counts_against_backoff(PREEMPTED_EXIT_CODE)
    assert st.counts_against_backoff(137) and st.counts_against_backoff(None)


def test_preemptions_spend_no_backoff_budget():
    """With backoffLimit 0, a preempted worker is recreated and a preempted chief (worker
    0) restarts the job; restartCount stays 0, the replica's restarts count them."""
    job = make_job(backoffLimit=0, status=running_status())

    def decide(pods):
        return st.decide(job, pods, st.observe(job, pods, at(60)), at(60))

    worker = decide([pod("ps", 0), pod("worker", 0),
                     pod("worker", 1, "failed", PREEMPTED_EXIT_CODE)])
    assert worker.kind == "recreate" and worker.delete == ("mnist-worker-1",)
    assert worker.status.restart_count == 0
    assert worker.status.replica("worker").restarts == 1
    assert "1 preempted, not counted" in worker.message

    chief = decide([pod("ps", 0), pod("worker", 0, "failed", PREEMPTED_EXIT_CODE),
                    pod("worker", 1)])
    assert chief.kind == "restart_job" and chief.status.restart_count == 0
    assert "not counted against backoffLimit" in chief.message

    # The same failure with another code spends the (empty) budget and fails the job.
    failed = decide([pod("ps", 0), pod("worker", 0), pod("worker", 1, "failed", 137)])
    assert failed.kind == "fail" and failed.reason == "BackoffLimitExceeded"


def test_a_stalled_task_is_recreated_and_counted_and_named_in_the_event():
    job = make_job(backoffLimit=3, status=running_status())
    pods = all_running()
    stalled = [st.Stalled("worker", 1, "sent no gradients for step 40 for 9s")]
    action = st.decide(job, pods, st.observe(job, pods, at(60)), at(60), stalled)
    assert action.kind == "recreate" and action.delete == ("mnist-worker-1",)
    assert action.reason == "TaskStalled" and action.warning
    assert "worker-1 (pod mnist-worker-1) is stalled: sent no gradients for step 40" \
        in action.message
    assert action.status.restart_count == 1
    assert action.status.replica("worker").restarts == 1
    assert cond(action.status, "Restarting") == ("True", "TaskStalled")
    # A stalled task that is not running (gone, or terminating already) is not acted on.
    gone = [pod("ps", 0), pod("worker", 0), pod("worker", 1, terminating=True)]
    assert st.decide(job, gone, st.observe(job, gone, at(60)), at(60), stalled).kind == "wait"


def test_a_stalled_task_under_never_fails_the_job_and_the_budget_still_binds():
    job = make_job(policy="Never", status=running_status())
    pods = all_running()
    stalled = [st.Stalled("worker", 1, "made no step for 30s")]
    action = st.decide(job, pods, st.observe(job, pods, at(60)), at(60), stalled)
    assert action.kind == "fail" and action.reason == "TaskStalled"
    assert "worker-1 (pod mnist-worker-1) is stalled: made no step for 30s; restartPolicy " \
           "Never" in action.message
    spent = make_job(backoffLimit=0, status=running_status())
    action = st.decide(spent, pods, st.observe(spent, pods, at(60)), at(60), stalled)
    assert action.kind == "fail" and action.reason == "BackoffLimitExceeded"


def test_a_stalled_chief_restarts_alone():
    """A chief ends like a worker under a probe: recreated, and it rejoins the job."""
    job = make_job(chief=1, status=running_status())
    pods = all_running(chief=1)
    stalled = [st.Stalled("chief", 0, "the gradients of step 7 are in")]
    action = st.decide(job, pods, st.observe(job, pods, at(60)), at(60), stalled)
    assert action.kind == "recreate" and action.delete == ("mnist-chief-0",)


def test_indexes():
    assert format_indexes([4, 0, 2, 3]) == "0,2-4"
    assert format_indexes([]) == ""
    assert parse_indexes("0,2-4") == {0, 2, 3, 4}
    assert parse_indexes("") == frozenset() and parse_indexes(None) == frozenset()


# ---- decide, table-driven: (id, job, pods, now, kind, check(action))


def _ok(**expect):
    """A check that the action's fields/status have the expected values."""
    def check(a):
        s = a.status
        got = {
            "create": names(a.create), "delete": list(a.delete), "phase": s.phase,
            "restarts": s.restart_count, "reason": a.reason, "delete_job": a.delete_job,
            "requeue": a.requeue_after, "start": s.start_time, "completion": s.completion_time,
            "run_gen": s.run_generation, "gen": s.restart_generation,
        }
        for key, value in expect.items():
            if key in got:
                assert got[key] == value, (key, got[key], value)
            elif key == "message":
                assert value in a.message, (a.message, value)
            elif key == "running_message":
                assert value in s.condition("Running").message, s.condition("Running")
            elif key == "worker_restarts":
                assert s.replica("worker").restarts == value
            elif key == "ps_restarts":
                assert s.replica("ps").restarts == value
            elif key == "completed":
                assert s.replica("worker").completed == frozenset(value)
            elif key == "condition":
                assert cond(s, value[0]) == value[1:], (s.conditions, value)
            else:
                raise KeyError(key)
    return check


CASES = [
    ("new job creates every pod, ps first", make_job(), [], T0, "create",
     _ok(create=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"], phase="Pending",
         start=stamp(), gen=1, condition=("Running", "False", "TasksPending"))),
    ("all running: nothing to do", make_job(status=running_status()), all_running(), at(60),
     "wait", _ok(phase="Running", condition=("Running", "True", "AllTasksRunning"))),
    ("pending pods say why", make_job(status=running_status(phase="Pending")),
     [pod("ps", 0), pod("worker", 0, "unschedulable"), pod("worker", 1, "pending")], at(1),
     "wait", _ok(phase="Pending", condition=("Running", "False", "WaitingForCapacity"),
                 running_message="worker-0 (Unschedulable: 0/1 nodes")),
    ("pending pods the scheduler has not turned down: not a wait for capacity",
     make_job(status=running_status(phase="Pending")),
     [pod("ps", 0), pod("worker", 0, "pending"), pod("worker", 1, "pending")], at(1),
     "wait", _ok(phase="Pending", condition=("Running", "False", "TasksPending"))),
    ("failed worker, OnFailure: recreate", make_job(status=running_status()),
     [pod("ps", 0), pod("worker", 0), pod("worker", 1, "failed", 1)], at(60), "recreate",
     _ok(delete=["mnist-worker-1"], phase="Restarting", restarts=1, worker_restarts=1,
         condition=("Restarting", "True", "RestartingTasks"), message="exited with code 1")),
    ("failed worker, ExitCode 137: recreate", make_job(policy="ExitCode",
                                                      status=running_status()),
     [pod("ps", 0), pod("worker", 0, "failed", 137), pod("worker", 1)], at(60), "recreate",
     _ok(delete=["mnist-worker-0"], restarts=1)),
    ("evicted worker (no exit code), ExitCode: recreate",
     make_job(policy="ExitCode", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "evicted"), pod("worker", 1)], at(60), "recreate",
     _ok(delete=["mnist-worker-0"], message="(Evicted)")),
    ("worker exited 1 with a sidecar running, ExitCode: fail",
     make_job(policy="ExitCode", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "exited", 1), pod("worker", 1)], at(60), "fail",
     _ok(phase="Failed", reason="NonRetryableExitCode", completion=stamp(60),
         delete=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"],
         condition=("Failed", "True", "NonRetryableExitCode"))),
    ("worker segfault, ExitCode: fail", make_job(policy="ExitCode", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "failed", 139), pod("worker", 1)], at(60), "fail",
     _ok(reason="NonRetryableExitCode", delete=["mnist-ps-0", "mnist-worker-1"],
         message="exited with code 139")),
    ("worker killed, Never: fail", make_job(policy="Never", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "failed", 137), pod("worker", 1)], at(60), "fail",
     _ok(reason="TaskFailed", message="restartPolicy Never")),
    ("worker exits 75: restart the job", make_job(status=running_status(
        replicaStatuses={"worker": {"completedIndexes": "1", "restarts": 0}})),
     [pod("ps", 0), pod("worker", 0, "failed", 75), pod("worker", 1, "succeeded")], at(60),
     "restart_job",
     _ok(phase="Restarting", restarts=1, worker_restarts=1, run_gen=2, completed=[],
         delete=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"],
         condition=("Restarting", "True", "RestartingJob"), message="from its last checkpoint")),
    ("exit 75 under Never fails", make_job(policy="Never", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "failed", 75), pod("worker", 1)], at(60), "fail",
     _ok(reason="TaskFailed")),
    ("ps killed, ExitCode: restart the job", make_job(status=running_status()),
     [pod("ps", 0, "failed", 137), pod("worker", 0), pod("worker", 1)], at(60), "restart_job",
     _ok(restarts=1, ps_restarts=1, delete=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"])),
    ("ps failed, OnFailure: restart the job even for code 1",
     make_job(ps_policy="OnFailure", status=running_status()),
     [pod("ps", 0, "failed", 1), pod("worker", 0), pod("worker", 1)], at(60), "restart_job",
     _ok(restarts=1)),
    ("ps exit 1, ExitCode: fail", make_job(status=running_status()),
     [pod("ps", 0, "failed", 1), pod("worker", 0), pod("worker", 1)], at(60), "fail",
     _ok(reason="NonRetryableExitCode", delete=["mnist-worker-0", "mnist-worker-1"])),
    ("ps failed, Never: fail", make_job(ps_policy="Never", status=running_status()),
     [pod("ps", 0, "failed", 137), pod("worker", 0), pod("worker", 1)], at(60), "fail",
     _ok(reason="TaskFailed")),
    ("ps exited 0 while workers run: restart the job", make_job(status=running_status()),
     [pod("ps", 0, "succeeded"), pod("worker", 0), pod("worker", 1)], at(60), "restart_job",
     _ok(message="exited 0 before the job finished")),
    ("ps pod deleted by someone: restart the job", make_job(status=running_status()),
     [pod("ps", 0, terminating=True), pod("worker", 0), pod("worker", 1)], at(60),
     "restart_job", _ok(message="is being deleted", delete=["mnist-worker-0", "mnist-worker-1"])),
    ("ps pod gone after training began: restart the job", make_job(status=running_status()),
     [pod("worker", 0), pod("worker", 1)], at(60), "restart_job",
     _ok(message="ps-0 lost its pod after training began")),
    ("ps pod gone before training began: just create it",
     make_job(status=running_status(phase="Pending")),
     [pod("worker", 0, "pending"), pod("worker", 1, "unschedulable")], at(60), "create",
     _ok(create=["mnist-ps-0"], gen=2, restarts=0, start=stamp())),
    ("ps pod deleted before training began: wait for it to go",
     make_job(status=running_status(phase="Pending")),
     [pod("ps", 0, terminating=True), pod("worker", 0, "pending"), pod("worker", 1, "pending")],
     at(60), "wait", _ok(restarts=0, create=[])),
    ("a permanent failure wins over a job restart",
     make_job(policy="ExitCode", status=running_status()),
     [pod("ps", 0, "failed", 137), pod("worker", 0, "failed", 2), pod("worker", 1)], at(60),
     "fail", _ok(reason="NonRetryableExitCode")),
    ("a job restart wins over recreating workers", make_job(status=running_status()),
     [pod("ps", 0, "failed", 137), pod("worker", 0, "failed", 137), pod("worker", 1)], at(60),
     "restart_job", _ok(restarts=1, ps_restarts=1, worker_restarts=0)),
    ("backoff limit reached: fail", make_job(backoffLimit=2, status=running_status(
        restartCount=2)),
     [pod("ps", 0), pod("worker", 0, "failed", 1), pod("worker", 1)], at(60), "fail",
     _ok(reason="BackoffLimitExceeded", restarts=2,
         message="backoffLimit 2 reached after 2 restart(s); last failure: worker-0")),
    ("two failures, one restart left: fail", make_job(backoffLimit=3, status=running_status(
        restartCount=2)),
     [pod("ps", 0), pod("worker", 0, "failed", 1), pod("worker", 1, "failed", 1)], at(60),
     "fail", _ok(reason="BackoffLimitExceeded")),
    ("backoff limit 0 allows no job restart", make_job(backoffLimit=0, status=running_status()),
     [pod("ps", 0, "failed", 137), pod("worker", 0), pod("worker", 1)], at(60), "fail",
     _ok(reason="BackoffLimitExceeded")),
    ("AllWorkers, all workers exited 0: succeed, stop the ps",
     make_job(success="AllWorkers", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "succeeded"), pod("worker", 1, "succeeded")], at(90),
     "succeed", _ok(phase="Succeeded", delete=["mnist-ps-0"], completion=stamp(90),
                    condition=("Succeeded", "True", "Succeeded"), message="all 2 workers")),
    ("AllWorkers, worker 0 exited 0 and worker 1 runs: wait for it",
     make_job(success="AllWorkers", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "succeeded"), pod("worker", 1)], at(90), "wait",
     _ok(phase="Running", completed=[0], delete=[])),
    ("AllWorkers with a chief: the chief exited 0, a worker runs: wait",
     make_job(chief=1, success="AllWorkers", status=running_status()),
     [pod("ps", 0), pod("chief", 0, "succeeded"), pod("worker", 0, "succeeded"),
      pod("worker", 1)], at(90), "wait", _ok(phase="Running", completed=[0])),
    ("AllWorkers with a chief: every worker exited 0, the chief runs: wait",
     make_job(chief=1, success="AllWorkers", status=running_status()),
     [pod("ps", 0), pod("chief", 0), pod("worker", 0, "succeeded"),
      pod("worker", 1, "succeeded")], at(90), "wait", _ok(phase="Running", completed=[0, 1])),
    ("AllWorkers with a chief: all exited 0: succeed",
     make_job(chief=1, success="AllWorkers", status=running_status()),
     [pod("ps", 0), pod("chief", 0, "succeeded"), pod("worker", 0, "succeeded"),
      pod("worker", 1, "succeeded")], at(90), "succeed",
     _ok(delete=["mnist-ps-0"], message="the chief and all 2 workers exited 0")),
    ("ChiefWorker without a chief: worker 0 exited 0: succeed, stop what runs",
     make_job(status=running_status()),
     [pod("ps", 0), pod("worker", 0, "succeeded"), pod("worker", 1)], at(90), "succeed",
     _ok(phase="Succeeded", delete=["mnist-ps-0", "mnist-worker-1"],
         message="succeeded: worker 0 exited 0")),
    ("cleanPodPolicy Running keeps worker 0, exited 0, while its pod still says Running",
     make_job(status=running_status()),
     [pod("ps", 0), pod("worker", 0, "stopping"), pod("worker", 1)], at(90), "succeed",
     _ok(phase="Succeeded", delete=["mnist-ps-0", "mnist-worker-1"],
         message="succeeded: worker 0 exited 0")),
    ("ChiefWorker without a chief: worker 1 exited 0: wait for worker 0",
     make_job(success="ChiefWorker", status=running_status()),
     [pod("ps", 0), pod("worker", 0), pod("worker", 1, "succeeded")], at(90), "wait",
     _ok(phase="Running", completed=[1])),
    ("ChiefWorker, cleanPodPolicy None: worker 0 exited 0, only the ps is stopped",
     make_job(cleanPodPolicy="None", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "succeeded"), pod("worker", 1)], at(90), "succeed",
     _ok(delete=["mnist-ps-0"])),
    ("chief exited 0: succeed, stop what runs", make_job(chief=1, status=running_status()),
     [pod("ps", 0), pod("chief", 0, "succeeded"), pod("worker", 0), pod("worker", 1)], at(90),
     "succeed", _ok(delete=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"],
                    message="the chief exited 0")),
    ("cleanPodPolicy None still stops the ps", make_job(
        chief=1, cleanPodPolicy="None", status=running_status()),
     [pod("ps", 0), pod("chief", 0, "succeeded"), pod("worker", 0), pod("worker", 1)], at(90),
     "succeed", _ok(delete=["mnist-ps-0"])),
    ("cleanPodPolicy All deletes finished pods too", make_job(
        cleanPodPolicy="All", status=running_status()),
     [pod("ps", 0), pod("worker", 0, "succeeded"), pod("worker", 1, "succeeded")], at(90),
     "succeed", _ok(delete=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"])),
    ("a finished worker whose pod was collected is not run again",
     make_job(status=running_status(
         replicaStatuses={"worker": {"completedIndexes": "1"}})),
     [pod("ps", 0), pod("worker", 0)], at(60), "wait", _ok(phase="Running", completed=[1])),
    ("a finished worker is remembered", make_job(status=running_status()),
     [pod("ps", 0), pod("worker", 0), pod("worker", 1, "succeeded")], at(60), "wait",
     _ok(phase="Running", completed=[1])),
    ("suspend stops the training tasks first", make_job(suspend=True, status=running_status()),
     all_running(), at(60), "suspend",
     _ok(phase="Suspended", delete=["mnist-worker-0", "mnist-worker-1"],
         start=None, run_gen=2, condition=("Suspended", "True", "Suspended"))),
    ("suspend keeps the ps while a worker stops (its checkpoint needs it)",
     make_job(suspend=True, status=running_status(phase="Suspended", runGeneration=2,
                                                  startTime=None)),
     [pod("ps", 0), pod("worker", 0, terminating=True), pod("worker", 1, "failed", 143)],
     at(60), "suspend", _ok(phase="Suspended", delete=["mnist-worker-1"])),
    ("suspend deletes the ps once the training tasks stopped",
     make_job(suspend=True, status=running_status(phase="Suspended", runGeneration=2,
                                                  startTime=None)),
     [pod("ps", 0), pod("worker", 0, "failed", 143, terminating=True)],
     at(60), "suspend", _ok(phase="Suspended", delete=["mnist-ps-0"])),
    ("suspended with nothing left: wait", make_job(suspend=True, status=running_status(
        phase="Suspended", runGeneration=2, startTime=None)),
     [pod("ps", 0, terminating=True)], at(60), "wait", _ok(phase="Suspended", run_gen=2)),
    ("resume waits for the old pods to go", make_job(status=running_status(
        phase="Suspended", runGeneration=2, startTime=None)),
     [pod("ps", 0, terminating=True), pod("worker", 0)], at(60), "cleanup",
     _ok(phase="Pending", delete=["mnist-worker-0"], create=[],
         condition=("Running", "False", "Resumed"))),
    ("resume starts a new run", make_job(status=running_status(
        phase="Suspended", runGeneration=2, startTime=None)), [], at(60), "create",
     _ok(phase="Pending", gen=2, start=stamp(60),
         create=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"])),
    ("deadline passed: fail", make_job(activeDeadlineSeconds=100, status=running_status()),
     all_running(), at(100), "fail",
     _ok(reason="DeadlineExceeded", delete=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"])),
    ("deadline ahead: look again then", make_job(activeDeadlineSeconds=100,
                                                  status=running_status()),
     all_running(), at(70), "wait", _ok(requeue=30.0)),
    ("deadline counts from the first creation", make_job(activeDeadlineSeconds=100), [], T0,
     "create", _ok(requeue=100.0)),
    ("finished: TTL ahead", make_job(ttlSecondsAfterFinished=60, status=running_status(
        phase="Succeeded", completionTime=stamp(100))), [], at(130), "wait", _ok(requeue=30.0)),
    ("finished: TTL due deletes the job", make_job(ttlSecondsAfterFinished=60,
                                                   status=running_status(
        phase="Failed", completionTime=stamp(100))), [], at(160), "delete_job",
     _ok(delete_job=True, phase="Failed")),
    ("first seen finished: TTL counts from now", make_job(ttlSecondsAfterFinished=60,
                                                         status=running_status()),
     [pod("ps", 0), pod("worker", 0, "succeeded"), pod("worker", 1, "succeeded")], at(90),
     "succeed", _ok(requeue=60.0)),
    ("finished: leftovers cleaned up", make_job(status=running_status(
        phase="Succeeded", completionTime=stamp(100))),
     [pod("ps", 0), pod("worker", 0, "succeeded")], at(110), "cleanup",
     _ok(delete=["mnist-ps-0"], phase="Succeeded")),
    ("finished and clean: nothing to do", make_job(status=running_status(
        phase="Failed", completionTime=stamp(100))),
     [pod("worker", 0, "failed", 1)], at(110), "wait", _ok(phase="Failed", requeue=None)),
    ("job restart: old pods are deleted, nothing created",
     make_job(status=running_status(phase="Restarting", runGeneration=2, restartCount=1)),
     [pod("ps", 0, terminating=True), pod("worker", 0, "failed", 75, terminating=True),
      pod("worker", 1)], at(61), "cleanup",
     _ok(delete=["mnist-worker-1"], create=[], phase="Restarting")),
    ("job restart: old pods all going, wait",
     make_job(status=running_status(phase="Restarting", runGeneration=2, restartCount=1)),
     [pod("ps", 0, terminating=True)], at(62), "wait", _ok(phase="Restarting")),
    ("job restart: old pods gone, start again",
     make_job(status=running_status(phase="Restarting", runGeneration=2, restartCount=1)),
     [], at(63), "create",
     _ok(create=["mnist-ps-0", "mnist-worker-0", "mnist-worker-1"], gen=2, restarts=1,
         phase="Restarting")),
    ("a pod of an earlier job of the same name is removed first", make_job(),
     [pod("worker", 0, uid="old-uid")], T0, "cleanup", _ok(delete=["mnist-worker-0"])),
    ("a task the spec no longer has is removed", make_job(workers=1, ps=0,
                                                          status=running_status()),
     [pod("worker", 0), pod("worker", 1)], at(5), "cleanup", _ok(delete=["mnist-worker-1"])),
    ("a recreated worker's old pod is still going: not counted again",
     make_job(status=running_status(phase="Restarting", restartCount=1)),
     [pod("ps", 0), pod("worker", 0, "failed", 1, terminating=True), pod("worker", 1)], at(61),
     "wait", _ok(restarts=1, phase="Restarting")),
    ("the recreated worker gets a newer generation",
     make_job(status=running_status(phase="Restarting", restartCount=1)),
     [pod("ps", 0), pod("worker", 1)], at(62), "create",
     _ok(create=["mnist-worker-0"], gen=2, restarts=1, phase="Restarting")),
    ("a lost status write does not reuse a generation",
     make_job(status=running_status(restartGeneration=1)),
     [pod("ps", 0, gen=3), pod("worker", 1, gen=3)], at(62), "create",
     _ok(create=["mnist-worker-0"], gen=4)),
    ("a job being deleted is left alone", None, all_running(), at(1), "wait", _ok()),
]


@pytest.mark.parametrize("job,pods,now,kind,check", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(job, pods, now, kind, check):
    if job is None:
        job = make_job(status=running_status())
        job["metadata"]["deletionTimestamp"] = stamp()
    action = step(job, pods, now)
    assert action.kind == kind, (action.kind, action.reason, action.message)
    assert action.kind in st.ACTIONS
    check(action)
    if kind != "wait":
        assert action.reason and action.message
    assert action.warning == (kind in ("fail", "recreate", "restart_job"))


def test_created_pods_match_the_manifests():
    job = make_job()
    action = step(job, [])
    parsed = TrainingJob.from_dict(job)
    assert list(action.create) == [desired_pod(parsed, r, i, 1) for r, i in parsed.spec.tasks()]


# ---- observe


def test_observe_counts_and_workers_column():
    job = make_job(workers=3, status=running_status(
        replicaStatuses={"worker": {"restarts": 2}, "ps": {"restarts": 1}}, restartCount=3))
    pods = [pod("ps", 0), pod("worker", 0), pod("worker", 1, ready=False),
            pod("worker", 2, "succeeded")]
    status = observe(job, pods, at(10))
    w = status.replica("worker")
    assert (w.active, w.succeeded, w.failed, w.restarts) == (2, 1, 0, 2)
    assert w.completed == {2}
    assert status.replica("ps").active == 1 and status.replica("ps").restarts == 1
    assert status.workers == "1/3"
    assert status.restart_count == 3 and status.observed_generation == 2
    assert "chief" not in status.replica_statuses


def test_a_dead_ps_means_not_running():
    """The job is Running only while every task is (kubeflow/trainer#881)."""
    status = observe(make_job(status=running_status()),
                     [pod("ps", 0, "failed", 137), pod("worker", 0), pod("worker", 1)], at(10))
    assert status.phase != "Running"
    assert status.replica("ps").failed == 1


def test_condition_times_change_only_with_status():
    job = make_job()
    first = observe(job, [], at(0))
    job["status"] = first.to_dict()
    creating = observe(job, [pod("ps", 0, "pending")], at(5))
    # a pod on its way (no pod, Pending, ContainerCreating) is not news: no write
    assert creating.condition("Running") == first.condition("Running")
    stuck = pod("ps", 0, "pending")
    stuck["status"]["containerStatuses"][1]["state"] = {"waiting": {"reason": "ErrImagePull"}}
    again = observe(job, [stuck], at(5))
    assert again.condition("Running").last_transition_time == stamp(0)
    assert again.condition("Running").reason == "TasksPending"
    assert again.condition("Running").message == (
        "waiting for 3 task(s): ps-0 (ErrImagePull); worker-0; worker-1")
    job["status"] = again.to_dict()
    running = observe(job, all_running(), at(10))
    assert running.phase == "Running"
    assert running.condition("Running").last_transition_time == stamp(10)
    assert running.condition("Created").last_transition_time == stamp(0)
    job["status"] = running.to_dict()
    still = observe(job, all_running(), at(20))
    assert still.condition("Running").last_transition_time == stamp(10)
    # Only conditions that were ever true are listed (besides Created and Running).
    assert [c.type for c in still.conditions] == ["Created", "Running"]
    for c in still.conditions:
        assert c.observed_generation == 2


def test_conditions_turning_false_say_why():
    job = make_job(status=running_status())
    failed = step(job, [pod("ps", 0), pod("worker", 0, "failed", 1), pod("worker", 1)], at(60))
    running = failed.status.condition("Running")
    assert (running.status, running.reason) == ("False", "RestartingTasks")
    assert running.last_transition_time == stamp(60)
    job["status"] = failed.status.to_dict()
    back = observe(job, all_running(), at(70))
    assert cond(back, "Restarting") == ("False", "AllTasksRunning")
    assert back.condition("Restarting").last_transition_time == stamp(70)
    assert back.restart_count == 1  # never reset by the pods coming back


def test_restarting_keeps_its_reason_until_all_run():
    job = make_job(status=running_status())
    action = step(job, [pod("ps", 0, "failed", 137), pod("worker", 0), pod("worker", 1)], at(60))
    job["status"] = action.status.to_dict()
    later = observe(job, [pod("ps", 0, "pending", gen=2)], at(70))
    assert later.phase == "Restarting"
    assert later.condition("Restarting").reason == "RestartingJob"
    assert "ps-0 (pod mnist-ps-0) exited with code 137" in later.condition("Restarting").message


def test_progress_and_checkpoint_from_the_chiefs_snapshot():
    ckpt = {"step": 400, "uri": "s3://b/p/400", "time": stamp(50)}
    job = make_job(status=running_status(lastCheckpoint=ckpt))
    status = observe(job, all_running(), at(60))
    snap = {"task": {"role": "worker", "index": 0}, "step": 512, "total": 1000,
            "loss": 0.25, "examples": 16384, "examplesPerSecond": 1000.04,
            "updated": "2025-03-01T12:00:59.5+00:00",
            "lastCheckpoint": {"step": 300, "uri": "s3://b/p/300", "time": stamp(40)}}
    status = st.with_progress(status, snap)
    assert status.progress == {"step": 512, "loss": 0.25, "examplesPerSecond": 1000.0,
                               "time": stamp(59)}
    assert status.last_checkpoint == ckpt  # never goes back to an older step
    newer = {"step": 500, "uri": "s3://b/p/500", "time": stamp(59)}
    status = st.with_progress(status, {**snap, "lastCheckpoint": newer})
    assert status.last_checkpoint == newer
    # A task that reports the job's global step (async: more than its own steps) shows it.
    later = {**snap, "step": 513, "globalStep": 1026, "updated": "2025-03-01T12:01:00Z"}
    assert st.with_progress(status, later).progress["step"] == 1026
    schema = _status_schema()["properties"]["lastCheckpoint"]
    _fits(json.loads(json.dumps(status.to_dict()["lastCheckpoint"])), schema, "lastCheckpoint")


def test_progress_changes_only_with_a_new_step_and_failures_keep_what_was_seen():
    job = make_job(status=running_status())
    first = {"step": 10, "loss": 1.5, "examplesPerSecond": 320.0, "updated": stamp(10),
             "lastCheckpoint": {"step": 10, "uri": "file:///ckpt/10", "time": stamp(10)}}
    status = st.with_progress(observe(job, all_running(), at(11)), first)
    # The same step again (a stalled chief): nothing changes, not even the rate.
    assert st.with_progress(status, {**first, "examplesPerSecond": 0.0}) is status
    # No snapshot (the fetch failed), or not one: everything stays.
    for bad in (None, [], {"step": -1}, {"step": "12"}, {"step": True},
                {"step": 12, "lastCheckpoint": {"step": 12}},
                {"lastCheckpoint": {"step": "12", "uri": "x"}}):
        kept = st.with_progress(status, bad)
        assert kept.last_checkpoint == status.last_checkpoint, bad
        if not isinstance(bad, dict) or "step" not in bad or not st._count(bad["step"]):
            assert kept.progress == status.progress, bad
    # Not finite, not a number, not a time: left out.
    odd = st.with_progress(status, {"step": 11, "loss": float("nan"),
                                    "examplesPerSecond": "fast", "updated": "yesterday"})
    assert odd.progress == {"step": 11}
    # Carried through the next observe, and kept once the job (and its pods) ended.
    job["status"] = status.to_dict()
    later = observe(job, [pod("ps", 0), pod("worker", 0, "succeeded"),
                          pod("worker", 1, "succeeded")], at(30))
    assert later.phase == "Succeeded"
    assert later.progress == status.progress and later.last_checkpoint == {
        "step": 10, "uri": "file:///ckpt/10", "time": stamp(10)}
    job["status"] = later.to_dict()
    assert observe(job, [], at(40)).last_checkpoint == later.last_checkpoint


def _status_schema():
    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1]
                          / "crds" / "trainingjobs.flowmill.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def test_finished_is_final():
    job = make_job(status=running_status(phase="Failed", completionTime=stamp(5)))
    status = observe(job, all_running(), at(10))
    assert status.phase == "Failed" and status.completion_time == stamp(5)


def test_status_round_trip_and_schema():
    job = make_job(chief=1, status=running_status())
    action = step(job, [pod("ps", 0), pod("chief", 0, "failed", 1), pod("worker", 0),
                        pod("worker", 1, "succeeded")], at(30))
    data = action.status.to_dict()
    assert Status.from_dict(data) == action.status
    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1]
                          / "crds" / "trainingjobs.flowmill.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    _fits(json.loads(json.dumps(data)), schema, "status")
    assert schema["properties"]["phase"]["enum"] == list(st.PHASES)
    assert "kopf" in schema["properties"]  # kopf's own keys are kept, not pruned


def _fits(value, schema, path):
    """Every key of ``value`` is declared in ``schema`` (the API server would prune it)."""
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), path
        for key, item in value.items():
            if "properties" in schema and key in schema["properties"]:
                _fits(item, schema["properties"][key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                _fits(item, schema["additionalProperties"], f"{path}.{key}")
            else:
                raise AssertionError(f"{path}.{key} is not in the CRD status schema")
    elif kind == "array":
        for i, item in enumerate(value):
            _fits(item, schema["items"], f"{path}[{i}]")
    else:
        py = {"string": str, "integer": int, "number": (int, float), "boolean": bool}[kind]
        assert isinstance(value, py), (path, value)
        if "enum" in schema:
            assert value in schema["enum"], (path, value)


def test_printer_columns_point_at_the_status():
    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1]
                          / "crds" / "trainingjobs.flowmill.dev.yaml").read_text())
    version = crd["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Workers": ".status.workers",
                       "Step": ".status.progress.step",
                       "Checkpoint": ".status.lastCheckpoint.step",
                       "Restarts": ".status.restartCount",
                       "Admitted": '.status.conditions[?(@.type=="Admitted")].status',
                       "Age": ".metadata.creationTimestamp"}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for name, path in columns.items():
        if "[" in path:  # a condition's status, by type: a string of the conditions list
            assert path.startswith(".status.conditions[")
            continue
        parts = path.split(".")[1:]
        if parts[0] != "status":
            continue
        node = status
        for part in parts[1:]:
            node = node["properties"][part]
        assert node["type"] in ("string", "integer"), name


# ---- a whole life, through a tiny stand-in for the API server and kubelet


class World:
    """Applies actions the way the operator would; pods change state when told to."""

    def __init__(self, job):
        self.job = job
        self.pods = {}
        self.now = T0
        self.deleted_job = False
        self.events = []

    def reconcile(self, seconds=1):
        self.now += timedelta(seconds=seconds)
        pods = list(self.pods.values())
        action = decide(self.job, pods, observe(self.job, pods, self.now), self.now)
        self.job["status"] = action.status.to_dict()
        for name in action.delete:
            self.pods[name]["metadata"]["deletionTimestamp"] = st.format_time(self.now)
        for manifest in action.create:
            name = manifest["metadata"]["name"]
            assert name not in self.pods, f"{name} created while its old pod exists"
            created = copy.deepcopy(manifest)
            created["status"] = {"phase": "Pending"}
            self.pods[name] = created
        self.deleted_job |= action.delete_job
        if action.kind != "wait":
            self.events.append((action.kind, action.reason))
        return action

    def gone(self):
        """Terminating pods finish going."""
        self.pods = {n: p for n, p in self.pods.items()
                     if not p["metadata"].get("deletionTimestamp")}

    def set(self, name, state, code=None):
        p = self.pods[name]
        labels = p["metadata"]["labels"]
        fresh = pod(labels["flowmill.dev/replica-type"],
                    int(labels["flowmill.dev/replica-index"]), state, code,
                    gen=int(labels[LABEL_GENERATION]))
        p["status"] = fresh["status"]

    def run_all(self):
        for name, p in self.pods.items():
            if p["status"].get("phase") == "Pending":
                self.set(name, "running")

    def generation(self, name):
        return int(self.pods[name]["metadata"]["labels"][LABEL_GENERATION])


def test_life_of_a_job():
    world = World(make_job(backoffLimit=2, ttlSecondsAfterFinished=30))
    assert world.reconcile().kind == "create"
    assert world.job["status"]["phase"] == "Pending"
    world.run_all()
    assert world.reconcile().kind == "wait"
    assert world.job["status"]["phase"] == "Running"
    assert world.job["status"]["workers"] == "2/2"

    # A worker fails: recreated (restart 1 of 2), with a newer generation.
    world.set("mnist-worker-1", "failed", 137)
    assert world.reconcile().kind == "recreate"
    assert world.reconcile().kind == "wait"  # its old pod is still going
    world.gone()
    assert world.reconcile().kind == "create"
    assert world.generation("mnist-worker-1") > world.generation("mnist-worker-0")
    world.run_all()
    world.reconcile()
    assert world.job["status"]["phase"] == "Running"
    assert world.job["status"]["restartCount"] == 1

    # The ps dies: the whole job restarts (restart 2 of 2); nothing starts before all go.
    world.set("mnist-ps-0", "failed", 137)
    assert world.reconcile().kind == "restart_job"
    assert world.job["status"]["phase"] == "Restarting"
    assert world.reconcile().kind == "wait"
    world.gone()
    assert world.reconcile().kind == "create"
    assert len(world.pods) == 3
    world.run_all()
    world.reconcile()
    assert world.job["status"]["phase"] == "Running"
    assert world.job["status"]["restartCount"] == 2
    assert world.job["status"]["replicaStatuses"]["ps"]["restarts"] == 1

    # Worker 1 finishes (the job waits for worker 0) and its pod is garbage-collected: it
    # is not run again.
    world.set("mnist-worker-1", "succeeded")
    world.reconcile()
    del world.pods["mnist-worker-1"]
    assert world.reconcile().kind == "wait"
    assert "mnist-worker-1" not in world.pods

    # The budget is spent: the next failure fails the job, and running pods are cleaned up.
    world.set("mnist-worker-0", "failed", 1)
    action = world.reconcile()
    assert (action.kind, action.reason) == ("fail", "BackoffLimitExceeded")
    assert world.job["status"]["phase"] == "Failed"
    assert set(action.delete) == {"mnist-ps-0"}
    world.gone()
    assert world.reconcile(10).kind == "wait"
    assert world.reconcile(25).kind == "delete_job"
    assert world.deleted_job
    assert world.job["status"]["restartCount"] == 2


def test_life_of_a_suspended_job():
    world = World(make_job(activeDeadlineSeconds=1000))
    world.reconcile()
    world.run_all()
    world.reconcile()
    world.job["spec"]["runPolicy"]["suspend"] = True
    assert world.reconcile(500).kind == "suspend"
    assert world.job["status"]["phase"] == "Suspended"
    assert "startTime" not in world.job["status"]
    world.job["spec"]["runPolicy"]["suspend"] = False
    # Resumed while the old run stops: its ps (kept for the chief's last checkpoint) goes.
    action = world.reconcile(600)
    assert (action.kind, action.delete) == ("cleanup", ("mnist-ps-0",))
    world.gone()
    assert world.reconcile().kind == "create"
    world.run_all()
    assert world.reconcile().kind == "wait"
    assert world.job["status"]["phase"] == "Running"
    # The deadline counts from the resume, not from the first start.
    assert world.reconcile(900).kind == "wait"
    assert world.reconcile(200).kind == "fail"
    assert world.job["status"]["conditions"][-1]["reason"] == "DeadlineExceeded"
    assert world.job["status"]["restartCount"] == 0
    assert [c["type"] for c in world.job["status"]["conditions"]] == [
        "Created", "Running", "Suspended", "Failed"]


def _unowned(p, owner=None):
    p["metadata"]["ownerReferences"] = [owner] if owner else []
    return p


@pytest.mark.parametrize("owner", [None, {"apiVersion": "batch/v1", "kind": "Job",
                                          "name": "mnist", "uid": UID, "controller": True}],
                         ids=["no-owner", "another-kind"])
def test_a_look_alike_pod_is_neither_counted_nor_touched(owner):
    """A pod with the job's labels that no TrainingJob controls, claiming worker 0 exited
    0, does not finish the job (nor is it deleted: it is not the operator's)."""
    job = make_job(status=running_status())
    fake = _unowned(pod("worker", 0, "succeeded", 0), owner)
    real = [pod("ps", 0), pod("worker", 1)]
    status = st.observe(job, [*real, fake], at(60))
    assert status.phase != "Succeeded" and not status.replica("worker").completed
    decision = st.decide(job, [*real, fake], status, at(60))
    assert "mnist-worker-0" not in decision.delete
    assert decision.kind == "create" and decision.create[0]["metadata"]["name"] == \
        "mnist-worker-0"


def _ended(p, seconds):
    """The pod's task container ended at ``at(seconds)``."""
    main = p["status"]["containerStatuses"][1]["state"]["terminated"]
    main["finishedAt"] = stamp(seconds)
    return p


def test_a_restart_asked_by_a_task_that_lost_its_ps_waits_a_moment_to_name_the_ps():
    """Kubelets report independently: a worker that lost its PS exits 75, often reported
    before the PS itself. The restart waits up to LOST_PS_GRACE_S for the PS's end, so
    it names and counts the PS, not the worker that noticed."""
    job = make_job(status=running_status())
    lost = _ended(pod("worker", 0, "failed", RESTART_JOB_EXIT_CODE), 59)
    pods = [pod("ps", 0), lost, pod("worker", 1)]
    first = decide(job, pods, observe(job, pods, at(60)), at(60))
    assert first.kind == "wait" and first.requeue_after == pytest.approx(1.0)
    ps_ended = [_ended(pod("ps", 0, "failed", 137), 59), lost, pod("worker", 1)]
    action = decide(job, ps_ended, observe(job, ps_ended, at(60)), at(60))
    assert action.kind == "restart_job" and "ps-0" in action.message
    assert action.status.replica("ps").restarts == 1
    assert action.status.replica("worker").restarts == 0
    # Nothing came: past the grace the worker's own exit restarts the job
    late = decide(job, pods, observe(job, pods, at(62)), at(62))
    assert late.kind == "restart_job" and late.status.replica("worker").restarts == 1
