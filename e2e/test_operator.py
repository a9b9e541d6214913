"""The TrainingJob operator on the real control plane: kopf in-process, pods as processes.

Each test runs the operator (``kopf run -m flowmill.operator.controller``) in a thread
with ``kopf.testing.KopfRunner`` against the cluster's kubeconfig, watching the test's
namespace, and applies TrainingJobs whose tasks are small Python programs: the node
stand-in runs a container's ``command`` as a local process and ignores its image. A task
that must behave differently on its second run counts its runs in a file.

The operator runs as the Helm chart's ServiceAccount under the chart's namespace-scope
RBAC (rendered with ``helm template``), so anything it does beyond those rules fails here.
Timing is never asserted; every wait polls with a generous timeout.
"""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from flowmill.operator.api import GROUP, VERSION
from flowmill.operator.manifests import LABEL_JOB

from .cluster import Cluster, free_port
from .jobs import JobReader
from .kubeconfig import write_kubeconfig
from .polling import REFUSED
from .polling import eventually as poll

pytestmark = pytest.mark.e2e


REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "flowmill"
FULLNAME = "fm-flowmill"  # the chart's ServiceAccount and Role for release "fm"
CRD = REPO / "crds" / "trainingjobs.flowmill.dev.yaml"
CRD_NAME = "trainingjobs.flowmill.dev"
TIMEOUT = 90.0

SLEEP = "import time; time.sleep(600)"  # a ps task: serves until it is deleted


def runs(path: Path, codes: list[int], pause: float = 0.5) -> str:
    """A task that appends a line to ``path`` on every start and exits with the code of
    its run (the last code once they run out)."""
    return textwrap.dedent(f"""
        import sys, time
        with open({str(path)!r}, "a") as f:
            f.write("run\\n")
        n = open({str(path)!r}).read().count("run")
        codes = {codes!r}
        time.sleep({pause})
        sys.exit(codes[min(n, len(codes)) - 1])
    """)


def starts(path: Path) -> str:
    """A ps task that counts its starts, then serves until it is deleted."""
    return textwrap.dedent(f"""
        import time
        with open({str(path)!r}, "a") as f:
            f.write("run\\n")
        time.sleep(600)
    """)


def wait_for(path: Path) -> str:
    """A worker that exits 0 once ``path`` exists."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}): time.sleep(0.2)\n"


def count_runs(path: Path) -> int:
    return path.read_text().count("run") if path.exists() else 0


def template(code: str) -> dict:
    return {"spec": {"containers": [{"name": "flowmill", "image": "flowmill:e2e",
                                     "command": [sys.executable, "-c", code]}]}}


def manifest(name: str, worker: str, *, workers: int = 1, ps: str | None = None,
             restart_policy: str = "OnFailure", success_policy: str | None = None,
             **run_policy: Any) -> str:
    specs: dict[str, Any] = {"worker": {"replicas": workers, "restartPolicy": restart_policy,
                                        "template": template(worker)}}
    if ps is not None:
        specs["ps"] = {"replicas": 1, "template": template(ps)}
    spec: dict[str, Any] = {"replicaSpecs": specs, "runPolicy": run_policy}
    if success_policy is not None:
        spec["successPolicy"] = success_policy
    return json.dumps({"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
                       "metadata": {"name": name}, "spec": spec})


def eventually(what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    return poll(what, check, timeout, interval=0.3)

class Kube(JobReader):
    def apply(self, text: str) -> None:
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=text)

    def patch(self, name: str, patch: dict) -> None:
        self.cluster.kubectl("patch", "tj", name, "-n", self.ns, "--type=merge", "-p",
                             json.dumps(patch))

    def phase(self, name: str, phase: str, timeout: float = TIMEOUT,
              each: Callable[[dict], None] | None = None) -> dict:
        return super().phase(name, phase, timeout, each)

    def reasons(self, name: str) -> set[str]:
        events = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items
        return {e.reason for e in events}


def condition(tj: dict, type: str) -> dict:
    return next(c for c in tj["status"]["conditions"] if c["type"] == type)


class LogRecords(logging.Handler):
    """Every log record of the operator's run (kopf logs to the process's handlers, not to
    the runner's captured output)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Operator:
    """The operator in this process, watching one namespace; restartable."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.runner: KopfRunner | None = None
        self.logs = LogRecords()
        self.metrics_port = 0

    def start(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.metrics_port = free_port()
        monkeypatch.setenv("FLOWMILL_METRICS_PORT", str(self.metrics_port))
        self.logs.records.clear()
        logging.getLogger().addHandler(self.logs)
        self.runner = KopfRunner(["run", "-m", "flowmill.operator.controller",
                                  "--namespace", self.namespace, "--standalone"], timeout=60)
        self.runner.__enter__()
        # Started means its start-up activity is done: a stop before that cancels it (a
        # test may find its job already as it wants it, and stop the operator at once).
        eventually("the operator's start-up", lambda: any(
            "Activity 'start' succeeded" in r.getMessage() for r in list(self.logs.records)), 60)

    def stop(self) -> None:
        runner, self.runner = self.runner, None
        assert runner is not None
        try:
            runner.__exit__(None, None, None)
        finally:
            logging.getLogger().removeHandler(self.logs)
        assert runner.exit_code == 0, runner.output[-3000:]
        lines = [f"{r.name}: {r.getMessage()}" for r in self.logs.records]
        assert any("Activity 'start' succeeded" in ln for ln in lines), lines[-20:]
        # Nothing the operator asked for was refused by the chart's RBAC, and no handler
        # raised.
        refused = [ln for ln in lines if REFUSED.search(ln)]
        assert refused == [], "\n".join(refused)
        crashed = [ln for r, ln in zip(self.logs.records, lines, strict=True) if r.exc_info]
        assert crashed == [], "\n".join(crashed)

    def metrics(self) -> str:
        """The Prometheus endpoint's text ("" until the operator has started serving it)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                return r.read().decode()
        except OSError:
            return ""


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> str:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    return CRD_NAME


@pytest.fixture
def kube(cluster: Cluster, namespace: str, crd: str) -> Kube:
    return Kube(cluster, namespace)


@pytest.fixture
def chart_identity(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig holding a token of the chart's ServiceAccount, bound by the chart's
    RBAC for watching this namespace."""
    rendered = cluster.helm(
        "template", "fm", str(CHART), "-n", namespace, "--set", "rbac.scope=namespace",
        "--show-only", "templates/serviceaccount.yaml",
        "--show-only", "templates/rbac.yaml").stdout
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=rendered)
    token = cluster.kubectl("create", "token", FULLNAME, "-n", namespace,
                            "--duration=1h").stdout.strip()
    assert cluster.pki is not None
    path = tmp_path / "operator.kubeconfig"
    write_kubeconfig(path, cluster.server, cluster.pki.ca_crt, user=FULLNAME, token=token)
    try:
        yield path
    finally:  # the ClusterRole and its binding outlive the namespace
        cluster.kubectl("delete", "-n", namespace, "--ignore-not-found", "--wait=false",
                        "-f", "-", input=rendered, check=False)


@pytest.fixture
def operator(chart_identity: Path, namespace: str, crd: str,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Operator]:
    monkeypatch.setenv("KUBECONFIG", str(chart_identity))
    monkeypatch.setenv("FLOWMILL_METRICS_HOST", "127.0.0.1")
    op = Operator(namespace)
    op.start(monkeypatch)
    try:
        yield op
    finally:
        if op.runner is not None:
            op.stop()


def test_job_succeeds_stops_its_ps_and_expires(kube: Kube, operator: Operator) -> None:
    kube.apply(manifest("mnist", "import time; time.sleep(1)", workers=2, ps=SLEEP,
                        success_policy="AllWorkers"))
    kube.apply(manifest("brief", "pass", ttlSecondsAfterFinished=2))

    tj = kube.phase("mnist", "Succeeded")
    status = tj["status"]
    assert status["replicaStatuses"]["worker"]["completedIndexes"] == "0-1"
    assert status["restartCount"] == 0 and status["completionTime"]
    assert condition(tj, "Succeeded")["status"] == "True"
    # The ps task only served the workers: it is stopped once they are done.
    eventually("the ps pod to go", lambda: "mnist-ps-0" not in kube.live_pods("mnist"))
    uid = tj["metadata"]["uid"]
    for task in ("ps-0", "worker-0", "worker-1"):
        svc = kube.core.read_namespaced_service(f"mnist-{task}", kube.ns)
        assert svc.spec.cluster_ip == "None"
        assert [o.uid for o in svc.metadata.owner_references] == [uid]
    # Event handlers only: no finalizer, no kopf marks on the job.
    assert not tj["metadata"].get("finalizers")
    assert not [k for k in tj["metadata"].get("annotations") or {} if "kopf" in k]

    table = kube.cluster.kubectl("get", "tj", "mnist", "-n", kube.ns).stdout
    assert "Succeeded" in table.splitlines()[1], table
    eventually("the job's Events", lambda: {"CreatingTasks", "Succeeded"} <= kube.reasons(
        "mnist"), timeout=60)

    # ttlSecondsAfterFinished: the finished job is deleted.
    eventually("the TTL to delete the job", lambda: kube.job("brief") is None)
    assert "TTLExpired" in kube.reasons("brief") or kube.job("brief") is None

    def scraped() -> str | None:
        text = operator.metrics()
        return text if 'flowmill_operator_trainingjobs{phase="Succeeded"} 1' in text else None

    text = eventually("the metrics", scraped, timeout=30)
    created = next(ln for ln in text.splitlines()
                   if ln.startswith("flowmill_operator_pods_created_total "))
    assert int(created.split()[1]) >= 4
    assert "flowmill_operator_reconcile_duration_seconds_count" in text


def test_restart_policies(kube: Kube, operator: Operator, tmp_path: Path) -> None:
    flaky, whole, code, ps = (tmp_path / n for n in ("flaky", "whole", "code", "ps"))
    # OnFailure: a failed worker is recreated; the second failure is over backoffLimit 1.
    kube.apply(manifest("flaky", runs(flaky, [1]), backoffLimit=1))
    # Exit 75 restarts the whole job: the ps task too; the second run succeeds.
    kube.apply(manifest("whole", runs(whole, [75, 0]), ps=starts(ps)))
    # ExitCode: 137 (killed from outside) is retried, 1 is permanent.
    kube.apply(manifest("code", runs(code, [137, 1]), restart_policy="ExitCode"))

    seen: list[int] = []  # every restartCount observed on the way
    tj = kube.phase("flaky", "Failed",
                    each=lambda st: seen.append(st["restartCount"]) if "restartCount" in st
                    else None)
    assert condition(tj, "Failed")["reason"] == "BackoffLimitExceeded"
    assert tj["status"]["restartCount"] == 1
    assert tj["status"]["replicaStatuses"]["worker"]["restarts"] == 1
    assert seen == sorted(seen), seen  # the count never goes down
    assert count_runs(flaky) == 2

    tj = kube.phase("whole", "Succeeded")
    assert tj["status"]["restartCount"] == 1
    assert count_runs(whole) == 2 and count_runs(ps) == 2  # every task ran again

    tj = kube.phase("code", "Failed")
    assert condition(tj, "Failed")["reason"] == "NonRetryableExitCode"
    assert tj["status"]["restartCount"] == 1
    assert count_runs(code) == 2

    # The status is written before the Event that tells of it: wait for the Event.
    eventually("the whole job's Events", lambda: {"RestartingJob", "Succeeded"} <= kube.reasons(
        "whole"), 60)


def test_suspend_resume_and_deadline(kube: Kube, operator: Operator) -> None:
    kube.apply(manifest("pausable", SLEEP))
    kube.apply(manifest("late", SLEEP, activeDeadlineSeconds=3))

    kube.phase("pausable", "Running")
    (before,) = [p["metadata"]["uid"] for p in kube.live_pods("pausable").values()]
    kube.patch("pausable", {"spec": {"runPolicy": {"suspend": True}}})
    kube.phase("pausable", "Suspended")
    eventually("the suspended job's pods to go", lambda: not kube.pods(f"{LABEL_JOB}=pausable"))
    kube.patch("pausable", {"spec": {"runPolicy": {"suspend": False}}})
    tj = kube.phase("pausable", "Running")
    (after,) = [p["metadata"]["uid"] for p in kube.live_pods("pausable").values()]
    assert after != before
    assert condition(tj, "Suspended")["status"] == "False"

    tj = kube.phase("late", "Failed")
    assert condition(tj, "Failed")["reason"] == "DeadlineExceeded"
    eventually("the late job's pods to go", lambda: not kube.live_pods("late"))


def test_operator_restart_mid_job(kube: Kube, operator: Operator, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    go = tmp_path / "go"
    # Every worker's pod must stay to be compared at the end: AllWorkers, not the default
    # ChiefWorker, which stops worker-1 once worker-0 is done.
    kube.apply(manifest("steady", wait_for(go), workers=2, ps=SLEEP,
                        success_policy="AllWorkers"))
    # Stop the operator as soon as it has begun creating pods.
    eventually("the first pod", lambda: kube.pods(f"{LABEL_JOB}=steady"))
    operator.stop()
    early = {n: p["metadata"]["uid"] for n, p in kube.live_pods("steady").items()}

    operator.start(monkeypatch)
    tj = kube.phase("steady", "Running")
    pods = kube.live_pods("steady")
    assert sorted(pods) == ["steady-ps-0", "steady-worker-0", "steady-worker-1"]
    assert all(pods[n]["metadata"]["uid"] == uid for n, uid in early.items())
    running = {n: p["metadata"]["uid"] for n, p in pods.items()}
    started = tj["status"]["startTime"]

    # Once more, mid-run: the next operator finds everything in place.
    operator.stop()
    operator.start(monkeypatch)
    eventually("the new operator to reconcile the job", lambda: (
        'flowmill_operator_trainingjobs{phase="Running"} 1' in operator.metrics()), timeout=60)
    assert {n: p["metadata"]["uid"] for n, p in kube.live_pods("steady").items()} == running
    go.touch()
    tj = kube.phase("steady", "Succeeded")
    assert tj["status"]["restartCount"] == 0
    assert tj["status"]["startTime"] == started
    workers = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.pods(f"{LABEL_JOB}=steady")
               if "worker" in p["metadata"]["name"]}
    assert workers == {n: u for n, u in running.items() if "worker" in n}


def reports(go: Path) -> str:
    """A worker that reports 7 of 20 steps and a checkpoint at step 5 through the
    runtime's telemetry, then waits for ``go`` to exit 0."""
    return textwrap.dedent(f"""
        import os, time
        from flowmill.runtime.progress import ProgressBar
        from flowmill.runtime.telemetry import report_checkpoint
        bar = ProgressBar(20, desc="train")
        for step in range(7):
            bar.update(loss=0.5 + step, examples=32)
            time.sleep(0.05)
        report_checkpoint(5, "s3://flowmill-e2e/progress/ckpt-5")
        while not os.path.exists({str(go)!r}):
            time.sleep(0.2)
    """)


def test_progress_and_last_checkpoint_from_the_chief(kube: Kube, operator: Operator,
                                                     tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = json.loads(manifest("progress", reports(go)))
    # A port free on this host: every pod here shares it, each on its own loopback IP.
    container = job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]
    container["ports"] = [{"name": "metrics", "containerPort": free_port()}]
    kube.apply(json.dumps(job))

    def reported() -> dict | None:
        status = (kube.job("progress") or {}).get("status") or {}
        progress, ckpt = status.get("progress") or {}, status.get("lastCheckpoint") or {}
        return status if progress.get("step") == 7 and ckpt.get("step") == 5 else None

    status = eventually("the worker's progress in the status", reported)
    assert status["phase"] == "Running"
    assert status["progress"]["loss"] == 6.5
    assert status["progress"]["examplesPerSecond"] >= 0
    assert status["lastCheckpoint"]["uri"] == "s3://flowmill-e2e/progress/ckpt-5"
    assert status["lastCheckpoint"]["time"].endswith("Z")

    def columns() -> dict[str, str]:
        header, row = kube.cluster.kubectl("get", "tj", "progress", "-n", kube.ns
                                           ).stdout.splitlines()[:2]
        return dict(zip(header.split(), row.split(), strict=True))

    shown = columns()
    assert (shown["STEP"], shown["CHECKPOINT"]) == ("7", "5"), shown

    # Once the job is done (its pods no longer serve), the last values stay.
    go.touch()
    tj = kube.phase("progress", "Succeeded")
    assert tj["status"]["progress"]["step"] == 7
    assert tj["status"]["lastCheckpoint"] == status["lastCheckpoint"]
    shown = columns()
    assert (shown["PHASE"], shown["STEP"], shown["CHECKPOINT"]) == ("Succeeded", "7", "5")


def test_jobs_run_where_the_restricted_pod_security_level_is_enforced(kube: Kube,
                                                                      operator: Operator) -> None:
    """The API server's Pod Security admission, enforcing ``restricted`` on the namespace,
    admits the operator's pods of a template that says nothing about security (the
    operator's defaults are enough), and refuses a template that asks for root."""
    kube.cluster.kubectl("label", "ns", kube.ns, "--overwrite",
                         "pod-security.kubernetes.io/enforce=restricted")
    kube.apply(manifest("locked", "pass", ps=SLEEP))
    tj = kube.phase("locked", "Succeeded")
    assert tj["status"]["replicaStatuses"]["worker"]["completedIndexes"] == "0"
    # The job's NetworkPolicy, made under the chart's RBAC: its own pods, owned by it.
    policy = json.loads(kube.cluster.kubectl("get", "networkpolicy", "locked", "-n", kube.ns,
                                             "-o", "json").stdout)
    assert [o["uid"] for o in policy["metadata"]["ownerReferences"]] == [tj["metadata"]["uid"]]
    assert policy["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: "locked"}}
    assert policy["spec"]["ingress"][0] == {
        "from": [{"podSelector": {"matchLabels": {LABEL_JOB: "locked"}}}]}

    root = json.loads(manifest("root", "pass"))
    root["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["securityContext"] = {
        "runAsNonRoot": False}
    kube.apply(json.dumps(root))
    eventually("the root pod to be refused", lambda: "FailedCreatePod" in kube.reasons("root"))
    assert not kube.live_pods("root")


def gpu_job(name: str, worker: str, workers: int, ps: str | None = None) -> str:
    """A gang-scheduled job whose workers take one ``nvidia.com/gpu`` each."""
    job = json.loads(manifest(name, worker, workers=workers, ps=ps, gangScheduling=True))
    (container,) = job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"]
    container["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    return json.dumps(job)


def test_gang_waits_for_room_for_every_task(kube: Kube, operator: Operator,
                                            tmp_path: Path) -> None:
    """runPolicy.gangScheduling: the scheduler binds a job's pods together or not at all.
    A job that needs two GPUs while one is free starts none of its pods (its ps neither),
    and says it waits for capacity; once the job holding the others ends, it starts whole."""
    nodes = kube.core.list_node(label_selector="flowmill.dev/node-stand-in=true").items
    gpus = sum(int(n.status.allocatable.get("nvidia.com/gpu", 0)) for n in nodes)
    assert gpus >= 2, gpus
    release, finish = tmp_path / "release", tmp_path / "finish"
    kube.apply(gpu_job("holder", wait_for(release), workers=gpus - 1, ps=SLEEP))
    kube.phase("holder", "Running")
    group = kube.custom.get_namespaced_custom_object(
        "scheduling.k8s.io", "v1alpha2", kube.ns, "podgroups", "holder")
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": gpus}}

    kube.apply(gpu_job("big", wait_for(finish), workers=2, ps=SLEEP))

    def waiting() -> dict | None:
        tj = kube.job("big") or {}
        cond = next((c for c in (tj.get("status") or {}).get("conditions") or ()
                     if c["type"] == "Running"), None)
        return tj if cond and cond["reason"] == "WaitingForCapacity" else None

    tj = eventually("big to wait for capacity", waiting)
    assert tj["status"]["phase"] == "Pending"
    pods = kube.live_pods("big")
    assert len(pods) == 3, sorted(pods)
    assert not [n for n, p in pods.items() if p["spec"].get("nodeName")], pods
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "big"} for p in pods.values())

    release.touch()
    kube.phase("holder", "Succeeded")
    kube.phase("big", "Running")
    assert all(p["spec"].get("nodeName") for p in kube.live_pods("big").values())
    finish.touch()
    kube.phase("big", "Succeeded")
    assert "WaitingForCapacity" not in {c["reason"] for c in kube.job("big")["status"][
        "conditions"] if c["type"] == "Running"}
