"""Flowmill as a user runs it: ``helm install`` the chart, ``kubectl apply`` the digits job.

One release of the chart serves the whole module, in namespace scope: the operator runs
as the chart's Deployment pod, with the chart's own command (``python -m
flowmill.operator``; the node stand-in puts the project's Python first on ``PATH``), under
the chart's ServiceAccount and RBAC. The S3 credentials go into the Secret the job names.
Each test applies ``examples/digits/job.yaml`` with ``kubectl apply -f``, changed only
where this cluster is not a real one: the script's path on this host, the bucket and
prefix, plain-http S3, and a shorter run (``training.maxSteps``).

Tasks die the way a node loses them: SIGKILL to the container's process, found through
``/proc`` (the stand-in gives each pod a ``HOME`` under the pod's uid). Progress is
judged from what the job itself leaves: committed checkpoints in S3, the job's status,
its pods. No timing is asserted; every wait polls with a generous bound.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import uuid
from collections.abc import Iterator

import pytest
import yaml

from flowmill.operator.manifests import LABEL_JOB, LABEL_ROLE

from .cluster import Cluster
from .journey import (
    EXAMPLE,
    OPERATOR_LABEL,
    RELEASE,
    REPO,
    RESTORED,
    TIMEOUT,
    Journey,
    TaskPods,
    accuracy,
    condition,
    installed,
    stand_in_values,
    tls_secret,
    uids,
)
from .polling import REFUSED, eventually

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def journey(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Journey]:
    """The chart installed in a namespace of its own, and the job's S3 Secret."""
    ns = f"user-journey-{uuid.uuid4().hex[:6]}"
    tmp = tmp_path_factory.mktemp("user-journey")
    with installed(cluster, ns, tmp, stand_in_values()):
        yield Journey(cluster, ns, tmp)


def test_operator_runs_as_the_charts_deployment(journey: Journey) -> None:
    (pod,) = journey.pods(OPERATOR_LABEL)
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["serviceAccountName"] == "fm-flowmill"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "flowmill.operator"]
    assert f"--namespace={journey.ns}" in container["args"]
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and owner["name"].startswith("fm-flowmill-")


def test_digits_job_succeeds(journey: Journey) -> None:
    # The example as shipped is a valid TrainingJob to the API server.
    journey.cluster.kubectl("apply", "--dry-run=server", "-n", journey.ns, "-f", str(EXAMPLE))
    name = "digits"
    journey.apply(name, max_steps=600)
    tj = journey.phase(name, "Succeeded")
    status = tj["status"]
    assert condition(tj, "Succeeded")["status"] == "True"
    assert "worker 0 exited 0" in condition(tj, "Succeeded")["message"]
    assert status["restartCount"] == 0 and status["startTime"] and status["completionTime"]
    assert status["replicaStatuses"]["worker"]["succeeded"] >= 1, status

    # The chief trained the whole run and scored the model.
    chief = journey.log(f"{name}-worker-0")
    assert "global step 600" in chief, chief[-2000:]
    assert accuracy(chief) > 0.85, chief[-2000:]

    # Checkpoints in S3: one every 100 steps and the last one at the end, each with the
    # shard of both ps tasks; `keep: 3` pruned the oldest.
    found = journey.checkpoints(name)
    assert max(found) == 600 and sorted(found) == [400, 500, 600], found
    manifest = journey.read_json(found[600])
    assert manifest["step"] == 600
    assert sorted(s["name"] for s in manifest["shards"]) == ["ps-0", "ps-1"]

    # Status filled in from the chief while it ran.
    progress, last = status["progress"], status["lastCheckpoint"]
    assert 0 < progress["step"] <= 600 and progress["loss"] > 0
    assert progress["examplesPerSecond"] > 0
    assert last["uri"].startswith(journey.checkpoint_uri(name)) and last["step"] % 100 == 0
    row = journey.table(name)
    assert list(row) == ["NAME", "PHASE", "WORKERS", "STEP", "CHECKPOINT", "RESTARTS", "AGE"]
    assert row["PHASE"] == "Succeeded" and re.fullmatch(r"[0-2]/2", row["WORKERS"]), row
    assert int(row["STEP"]) == progress["step"] and int(row["CHECKPOINT"]) == last["step"]
    assert row["RESTARTS"] == "0" and re.fullmatch(r"\d+[smhd]\w*", row["AGE"]), row

    # cleanPodPolicy Running: the ps tasks are stopped (their pods gone, or ended, not
    # merely being deleted); worker 0's pod stays, Succeeded.
    eventually("the ps tasks to stop", lambda: all(
        p["status"].get("phase") in ("Succeeded", "Failed")
        for p in journey.pods(f"{LABEL_JOB}={name},{LABEL_ROLE}=ps")), 60)
    assert journey.live_pods(name)[f"{name}-worker-0"]["status"]["phase"] == "Succeeded"
    assert {"CreatingTasks", "Succeeded"} <= journey.events(name).keys()


def test_killed_worker_is_recreated(journey: Journey) -> None:
    name = "digits-worker-lost"
    journey.apply(name, max_steps=1000)
    journey.wait_checkpoint(name)
    victim = f"{name}-worker-1"
    old = journey.kill(name, victim)

    def replaced() -> bool:
        pod = journey.live_pods(name).get(victim)
        return bool(pod) and pod["metadata"]["uid"] != old

    eventually(f"a new pod for {victim}", replaced, TIMEOUT)
    tj = journey.phase(name, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 1, status
    assert status["replicaStatuses"]["worker"]["restarts"] == 1, status
    assert status["replicaStatuses"].get("ps", {}).get("restarts", 0) == 0, status
    assert any(victim in m for m in journey.events(name).get("RestartingTasks", [])), \
        journey.events(name)
    assert "global step 1000" in journey.log(f"{name}-worker-0")
    assert journey.table(name)["RESTARTS"] == "1"


def test_killed_ps_restarts_the_job_from_its_checkpoint(journey: Journey) -> None:
    name = "digits-ps-lost"
    journey.apply(name, max_steps=1000)
    first = journey.wait_checkpoint(name)
    before = uids(journey.live_pods(name))
    # The tasks talk over mutual TLS with this run's certificates, one per task.
    ca = tls_secret(journey, name)["ca.crt"]
    assert {f"{t}.{k}" for t in ("ps-0", "ps-1", "worker-0", "worker-1")
            for k in ("crt", "key")} <= tls_secret(journey, name).keys()
    journey.kill(name, f"{name}-ps-0")

    seen: set[str] = set()
    tj = journey.phase(name, "Succeeded", seen=seen)
    status = tj["status"]
    assert status["restartCount"] == 1, status
    assert status["replicaStatuses"]["ps"]["restarts"] == 1, status
    # The job went Restarting, and said why.
    assert "Restarting" in seen, seen
    assert condition(tj, "Restarting") is not None
    events = journey.events(name)
    assert any(f"{name}-ps-0" in m for m in events.get("RestartingJob", [])), events
    # Every task ran again, in new pods, under a new CA: the first run's certificates open
    # nothing in the second.
    after = uids(journey.live_pods(name))
    assert not set(before.values()) & set(after.values())
    assert tls_secret(journey, name)["ca.crt"] != ca

    # The new chief restored the newest checkpoint committed before the restart, and the
    # job went on from that step to the end.
    chief = journey.log(f"{name}-worker-0")
    restored = RESTORED.search(chief)
    assert restored, chief[-3000:]
    step = int(restored.group(1))
    assert step >= first and step % 100 == 0, chief[-3000:]
    assert restored.group(2) == journey.checkpoint_uri(name)
    assert "global step 1000" in chief, chief[-3000:]
    assert 1000 in journey.checkpoints(name)


def test_killed_chief_is_recreated_and_rejoins_the_running_job(journey: Journey) -> None:
    """SIGKILL of the chief (worker 0) of the sync digits job: the operator recreates its
    pod alone; the new chief finds the variables on the ps tasks and rejoins at the job's
    step, restoring and initializing nothing, and the job succeeds."""
    name = "digits-chief-lost"
    journey.apply(name, max_steps=1000, interval=100_000)
    eventually(f"{name} past step 100", lambda: journey.step(name) >= 100, TIMEOUT)
    chief = f"{name}-worker-0"
    old = journey.kill(name, chief)
    eventually(f"a new pod for {chief}", lambda: (
        (pod := journey.live_pods(name).get(chief)) and pod["metadata"]["uid"] != old), TIMEOUT)
    tj = journey.phase(name, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 1, status
    assert status["replicaStatuses"]["worker"]["restarts"] == 1, status
    assert status["replicaStatuses"].get("ps", {}).get("restarts", 0) == 0, status
    log = journey.log(chief)
    rejoined = re.search(r"rejoins the job at global step (\d+)", log)
    assert rejoined and int(rejoined.group(1)) >= 100, log[-3000:]
    assert "restored checkpoint" not in log, log[-3000:]
    assert "global step 1000" in log, log[-3000:]


def test_hung_worker_is_named_and_recreated(journey: Journey) -> None:
    """worker-1 of the sync digits job hangs after its step 40, alive and serving but
    stepping no more (tests/inject.py): every task waits for its gradients. After
    ``stallTimeoutSeconds`` without a step the operator reads the PS tasks' accumulators,
    names worker-1 in a TaskStalled Event and recreates its pod, counted; the new worker
    rejoins and the job succeeds."""
    name = "digits-stalled"
    marker = journey.tmp / f"{name}.hung"
    hang = [str(REPO / "tests" / "inject.py"), "hang", str(marker), "1", "40"]
    journey.apply(name, max_steps=300, interval=100_000, wrap=hang, stallTimeoutSeconds=10)
    victim = f"{name}-worker-1"
    tj = journey.phase(name, "Succeeded")
    status = tj["status"]
    assert marker.exists()
    assert status["restartCount"] == 1, status
    assert status["replicaStatuses"]["worker"]["restarts"] == 1, status
    assert status["replicaStatuses"].get("ps", {}).get("restarts", 0) == 0, status
    events = journey.events(name)
    stalled = events.get("TaskStalled", [])
    assert any(f"worker-1 (pod {victim}) is stalled: sent no gradients for step" in m and
               "stallTimeoutSeconds 10" in m for m in stalled), events
    assert not any("worker-0" in m for m in stalled), events
    assert "hanging after step" in journey.all_logs(victim)
    assert "global step 300" in journey.log(f"{name}-worker-0")


def test_sigtermed_chief_commits_its_step_and_the_job_resumes_uncounted(
    journey: Journey,
) -> None:
    """SIGTERM to the chief between two checkpoint intervals (none is due: the interval is
    longer than the run): it commits a checkpoint of the step it reached and exits 143;
    the operator restarts the job from there without spending backoffLimit (0 here)."""
    name = "digits-preempted"
    journey.apply(name, max_steps=1000, interval=100_000, backoffLimit=0)
    eventually(f"{name} past step 100", lambda: journey.step(name) >= 100, TIMEOUT)
    chief = f"{name}-worker-0"
    journey.kill(name, chief, signal.SIGTERM)

    tj = journey.phase(name, "Succeeded")
    status = tj["status"]
    assert status["restartCount"] == 0, status
    assert status["replicaStatuses"]["worker"]["restarts"] == 1, status
    events = journey.events(name)
    assert any("not counted against backoffLimit" in m and "143" in m
               for m in events.get("RestartingJob", [])), events
    saved = sorted(journey.checkpoints(name))
    assert len(saved) == 2 and 100 <= saved[0] < 1000 and saved[1] == 1000, saved
    assert "exiting with code 143" in journey.all_logs(chief)
    restored = RESTORED.search(journey.log(chief))
    assert restored and int(restored.group(1)) == saved[0], journey.log(chief)[-3000:]


def test_operator_pod_deleted_mid_run(journey: Journey) -> None:
    name = "digits-operator-lost"
    journey.apply(name, max_steps=1000)
    journey.wait_checkpoint(name)
    journey.phase(name, "Running")
    tasks = uids(journey.live_pods(name))
    assert len(tasks) == 4
    seen = TaskPods(journey, name)
    journey.replace_operator(seen)
    tj = journey.phase(name, "Succeeded", each=seen)
    # Never two pods for one task; the new operator took the job over as it stood, and
    # ran no task again.
    assert len(seen.most) == 4 and max(seen.most.values()) == 1, seen.most
    assert seen.ever == {n: {u} for n, u in tasks.items()}, seen.ever
    assert tj["status"]["restartCount"] == 0
    assert "global step 1000" in journey.log(f"{name}-worker-0")


def test_backoff_limit_exceeded_fails_the_job(journey: Journey) -> None:
    name = "digits-typo"
    # A typo in the arguments: argparse exits 2, every time.
    journey.apply(name, max_steps=100, args=["--epochs", "thirty"], backoffLimit=1)
    tj = journey.phase(name, "Failed")
    failed = condition(tj, "Failed")
    assert failed is not None and failed["reason"] == "BackoffLimitExceeded", tj["status"]
    assert "backoffLimit 1" in failed["message"] and "exited with code 2" in failed["message"]
    assert tj["status"]["restartCount"] <= 1
    assert "invalid int value: 'thirty'" in journey.all_logs(f"{name}-worker-0")
    # Nothing is left running.
    eventually("the failed job's tasks to stop", lambda: not [
        p for p in journey.live_pods(name).values() if p["status"].get("phase") in (
            "Pending", "Running")], 60)


def test_deleting_the_job_removes_its_pods_and_services(journey: Journey) -> None:
    name = "digits-deleted"
    journey.apply(name, max_steps=5000)
    journey.phase(name, "Running")
    pids = [journey.pid(p) for p in journey.live_pods(name).values()]
    assert len(journey.services(name)) == 4 and len(pids) == 4
    journey.cluster.kubectl("delete", "tj", name, "-n", journey.ns, "--timeout=60s")
    eventually("the job's pods and Services to go", lambda: not journey.pods(
        f"{LABEL_JOB}={name}") and not journey.services(name), TIMEOUT)

    def stopped(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    eventually("the tasks' processes to exit", lambda: all(map(stopped, pids)), 60)


def found(text: str, needles: dict[str, str]) -> list[str]:
    """Each place in ``text`` where a needle occurs: its name and the text around it."""
    out = []
    for what, value in needles.items():
        for m in re.finditer(re.escape(value), text):
            around = text[max(0, m.start() - 200):m.end() + 200].replace("\n", " | ")
            out.append(f"{what}: ...{around}...")
    return out


def test_credentials_never_leak(journey: Journey) -> None:
    """The S3 credentials in the job's Secret reach the tasks alone, by ``secretKeyRef``.
    After every job of this module ran, neither value is in the operator's logs, the
    namespace's Events, its TrainingJobs, its pods (whose env holds values of their own and
    references to the Secret) or the tasks' logs. Nor where a job fails on S3 and says
    why: one more job, its checkpoints in a bucket that does not exist, fails at its first
    request to the store and logs the store's answer."""
    ns, s3, kubectl = journey.ns, journey.cluster.s3, journey.cluster.kubectl
    example = yaml.safe_load(EXAMPLE.read_text())["spec"]
    secret = example["checkpoint"]["secretRef"]["name"]
    (container,) = example["replicaSpecs"]["worker"]["template"]["spec"]["containers"]
    data = journey.core.read_namespaced_secret(secret, ns).data
    assert base64.b64decode(data["AWS_ACCESS_KEY_ID"]).decode() == s3.access_key
    assert base64.b64decode(data["AWS_SECRET_ACCESS_KEY"]).decode() == s3.secret_key
    # Each value as it is, and as a Secret's data holds it, should a Secret be dumped.
    needles = {"the access key id": s3.access_key, "the secret access key": s3.secret_key}
    # And the tasks' TLS private keys, by a line of each key's PEM body.
    for job in ("digits", "digits-ps-lost"):
        for entry, pem in tls_secret(journey, job).items():
            if entry.endswith(".key"):
                needles[f"{job}'s {entry}"] = pem.decode().splitlines()[1]
    needles |= {f"{what} (base64)": base64.b64encode(v.encode()).decode()
                for what, v in list(needles.items())}

    name = "digits-no-bucket"
    bucket = f"{ns}-missing"
    journey.apply(name, max_steps=50, uri=f"s3://{bucket}/{name}", backoffLimit=0)
    failed = condition(journey.phase(name, "Failed"), "Failed")
    assert failed is not None and failed["reason"] == "BackoffLimitExceeded", failed
    eventually(f"{name}'s tasks to stop", lambda: not [
        p for p in journey.live_pods(name).values() if p["status"].get("phase") in (
            "Pending", "Running")], 60)
    chief = journey.all_logs(f"{name}-worker-0")
    assert "NoSuchBucket" in chief and bucket in chief, chief[-3000:]

    jobs = json.loads(kubectl("get", "tj", "-n", ns, "-o", "json").stdout)["items"]
    names = {j["metadata"]["name"] for j in jobs}
    assert name in names and all(j.get("status", {}).get("phase") for j in jobs), names
    kept = journey.cluster.log_dir / "pods"
    operator_prefix = f"{RELEASE}-flowmill-"

    # 1. The operator's logs: the running pod's through `kubectl logs`, and every earlier
    # operator pod's (one was deleted mid-run) as the node kept them.
    operator = kubectl("logs", f"deploy/{RELEASE}-flowmill", "-n", ns).stdout
    assert operator.strip()
    operator += "".join(f.read_text(errors="replace") for f in sorted(
        kept.glob(f"{ns}_{operator_prefix}*/*/*.log")))
    unmentioned = sorted(n for n in names if f"TrainingJob {ns}/{n}: " not in operator)
    assert not unmentioned, unmentioned

    # 2. Every Event of the namespace, whole (reason, message, note, annotations).
    events_json = kubectl("get", "events", "-n", ns, "-o", "json").stdout
    events = json.loads(events_json)["items"]
    about = {e["involvedObject"]["name"] for e in events}
    assert names <= about, names - about
    assert any(e["involvedObject"]["name"] == name and e["reason"] == "BackoffLimitExceeded"
               for e in events), [e["reason"] for e in events]

    # 3. The TrainingJobs, whole: their status, and whatever the operator annotated.
    jobs_json = json.dumps(jobs)
    status_bytes = sum(len(json.dumps(j["status"])) for j in jobs)

    # 4. The pods, whole: their env's values are plain settings; the credentials go in by
    # reference only.
    pods_json = kubectl("get", "pods", "-n", ns, "-o", "json").stdout
    pods = json.loads(pods_json)["items"]
    values = [e["value"] for p in pods
              for c in p["spec"].get("initContainers", []) + p["spec"]["containers"]
              for e in c.get("env", []) if "value" in e]
    tasks = [p for p in pods if LABEL_JOB in p["metadata"].get("labels", {})]
    assert tasks and values
    for p in tasks:
        (main,) = [c for c in p["spec"]["containers"] if c["name"] == container["name"]]
        env = {e["name"]: e for e in main["env"]}
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[var]["valueFrom"]["secretKeyRef"]["name"] == secret, env[var]

    # 5. The tasks' logs: the live pods' through the API (`kubectl logs`), and every run of
    # every task pod of the namespace as the node kept them (pods deleted or replaced).
    task_logs = "".join(
        journey.core.read_namespaced_pod_log(p["metadata"]["name"], ns, container=c["name"])
        for p in tasks if p["status"].get("phase") != "Pending" and
        not p["metadata"].get("deletionTimestamp") for c in p["spec"]["containers"])
    folders = [d for d in kept.glob(f"{ns}_*") if not d.name.startswith(
        f"{ns}_{operator_prefix}")]
    task_logs += "".join(f.read_text(errors="replace")
                         for d in sorted(folders) for f in sorted(d.glob("*/*.log")))
    unlogged = sorted(n for n in names if not any(
        d.name.startswith(f"{ns}_{n}-") for d in folders))
    assert not unlogged and "NoSuchBucket" in task_logs, unlogged

    sources = {
        "operator logs": operator,
        "events": events_json,
        "trainingjobs": jobs_json,
        "pods": pods_json,
        "task logs": task_logs,
    }
    (journey.cluster.log_dir / "credential-scan.txt").write_text("".join(
        f"{what}: {len(text.encode())} bytes, {len(text.splitlines())} lines\n"
        for what, text in sources.items()) + (
        f"({len(jobs)} TrainingJobs, status {status_bytes} bytes; {len(events)} "
        f"Events; {len(pods)} pods, {len(values)} env values; {len(folders)} task pod "
        "log folders)\n"))
    leaks = [f"{where}: {hit}" for where, text in sources.items()
             for hit in found(text, needles)]
    assert not leaks, "\n".join(leaks)


def test_operator_was_never_refused(journey: Journey) -> None:
    """Whatever the operator asked for in this module, the chart's RBAC allowed."""
    logs = sorted((journey.cluster.log_dir / "pods").glob(f"{journey.ns}_fm-flowmill-*"))
    assert len(logs) >= 2, logs  # the first operator pod and its replacement
    for folder in logs:
        for log in folder.glob("*/*.log"):
            text = log.read_text(errors="replace")
            refused = [ln for ln in text.splitlines() if REFUSED.search(ln)]
            assert refused == [], "\n".join(refused)
            assert "Traceback" not in text, text[-3000:]
