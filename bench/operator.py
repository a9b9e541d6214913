"""The operator's latency and cost on a real control plane.

Starts the e2e control plane (etcd, kube-apiserver, kube-controller-manager and the node
stand-in, which runs each pod's container as a local process and ignores its image),
installs the CRD, and runs the operator as its own process, ``python -m flowmill.operator
--namespace NS --standalone`` (as the image runs it), under an identity of its own (user
``flowmill:operator``, bound to ``cluster-admin``), so that its CPU time and memory can
be read from ``/proc/<pid>`` and its API requests from the kube-apiserver's audit log,
which records that user's requests alone (``e2e.audit``). Then:

- ``--jobs`` times over, a TrainingJob of 2 ps and 2 workers (long-running Python tasks) is
  applied with ``kubectl apply``: the time until all four pods exist
  (``apply_to_created_s``), until all four are Running (``apply_to_running_s``) and until
  the job's ``status.phase`` says Running (``apply_to_job_running_s``); then worker 0's
  process is killed with SIGKILL and the time until its replacement pod (same name, new
  uid) exists is ``death_to_replacement_s`` (and Running, ``death_to_replacement_running_s``).
  Each figure is the median over the jobs, with the max beside it.
- ``--many`` jobs of one worker each (the task is ``sleep``) are applied at once, as one
  ``kubectl apply`` of a List. A job counts as reconciled when its ``status.phase`` is
  Running: the operator created its pod, the pod started, and the operator observed that
  and wrote it to the job's status, which is the whole loop a user waits for.
  ``jobs_50_reconciled_s`` is the time until every job is; ``jobs_50_created_s`` until
  every job's pod exists, ``jobs_50_running_s`` until every pod runs (the node stand-in
  starts pods one at a time, so this is mostly its pace), and ``jobs_50_status_lag_s`` is
  the operator's own share: per job, from its pod's Running to its status saying Running
  (median; ``_max_s`` the worst). ``jobs_50_apply_s`` is the ``kubectl apply`` itself
  (one request after another). ``operator_cpu_s`` is the operator's user + system CPU time
  over that phase (from just before the apply until the last job is reconciled);
  ``operator_rss_mb`` its peak resident memory over the whole run (``VmHWM``),
  ``operator_rss_idle_mb`` its resident memory just before the phase. Beside them:
  ``jobs_50_create_lag_s``, the operator's share on the creation side (per job, from the
  job's first watch event to its pod's; median, ``_max_s``), ``jobs_50_cpu_per_job_s``
  and ``jobs_50_requests_per_job`` (completed requests, watches aside, over the phase,
  divided by the jobs; ``jobs_50_requests_by_kind`` by verb and resource).
- ``--scale`` jobs of one worker (1,000 by default; 0 skips it), after the ``--many`` jobs
  and their pods are gone, measured the same way (``jobs_1000_...``, with p99s beside the
  medians) while a 2 ps + 2 worker job runs: about a second into the apply its worker 0 is
  killed, and ``burst_death_to_replacement_s`` is the time to its replacement pod. Then
  ~10 s of quiet, and ``jobs_1000_rss_rest_mb`` is the operator's resident memory with
  every job known (``jobs_1000_rss_peak_mb`` its peak, ``jobs_1000_rest_cpu_s`` and
  ``jobs_1000_rest_requests`` its CPU time and requests over the quiet), and
  ``jobs_1000_objects_mb`` what the jobs and pods themselves take as its store holds them
  (each parsed on its own and compacted, ``store.compact``; ``tracemalloc`` in a process
  of their own). Last the operator
  is stopped (SIGTERM) and a fresh one started: ``restart_first_metrics_s`` is the time
  from its start to its first answer on ``/metrics``, ``restart_recovery_s`` until the
  sum of its ``flowmill_operator_trainingjobs`` gauge reaches the jobs there are (each
  job counts after its first reconcile in the new process); ``restart_rss_mb`` is its
  resident memory then (``restart_rss_peak_mb`` its peak).
- ``harness``: per phase, what the harness itself spent: the ``kubectl apply`` seconds, the
  scheduler's share of each pod's start (``pod_bind_lag_s``: its first event to its
  binding) and the stand-in's (``pod_start_lag_s``: the binding to its Running), the
  requests the apiserver served from every client beside the operator's, and the CPU
  seconds of the node stand-in, the kube-apiserver, etcd, the scheduler, the
  controller-manager, the operator, this process (its watches) and the kubectl processes,
  so that a reader sees which of them bound a figure.

Every clock starts just before the ``kubectl`` process is spawned, so kubectl's own start
and requests are inside the figures, as a user sees them. Pod and job times are the arrival
of the watch event that first showed the state, stamped in a watcher thread; nothing is
polled but the restarted operator's ``/metrics``. A warm-up job runs first, so the
figures are of an operator that has started. Every wait is bounded; the jobs, the operator
and the control plane are stopped on any failure. No peer is timed: Kubeflow's training
operator (TFJob, the one PS-aware peer) is a Go controller that this harness does not build.

    python bench/operator.py [--jobs 3] [--many 50] [--scale 1000] [--timeout 180]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kubernetes import client, watch

REPO = Path(__file__).resolve().parent.parent
# At the end of sys.path: in front, the repository's operator/ folder would shadow the
# standard library's ``operator`` (see e2e/README.md).
sys.path.append(str(REPO))

from e2e import audit  # noqa: E402
from e2e.cluster import Cluster, free_port  # noqa: E402
from e2e.kubeconfig import write_kubeconfig  # noqa: E402
from e2e.pki import issue_client  # noqa: E402
from e2e.procs import Proc  # noqa: E402
from e2e.versions import binaries  # noqa: E402
from flowmill.operator.api import GROUP, PLURAL, VERSION  # noqa: E402
from flowmill.operator.manifests import LABEL_JOB  # noqa: E402

CRD = REPO / "crds" / "trainingjobs.flowmill.dev.yaml"
CRD_NAME = "trainingjobs.flowmill.dev"
NAMESPACE = "bench-operator"
CONTAINER = "flowmill"
# A task that says its pid (so it can be killed from here) and serves until deleted.
SERVE = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
WATCH_SECONDS = 30  # each watch request ends after this; the watcher resumes from its version
SCALE_TASK = ["sleep", "86400"]  # outlives any run of the scale phase
OPERATOR_USER = "flowmill:operator"  # the operator's identity; the audit log records its own
GAUGE = "flowmill_operator_trainingjobs"  # jobs by phase, set after each job's reconcile
RECONCILE = "flowmill_operator_reconcile_duration_seconds"  # a histogram of reconciles
QUIET_S = 10.0  # after the scale phase, before its memory is read
BURST_KILL_S = 1.0  # into the scale phase's apply, the running job's worker 0 is killed
CHECK_EVERY_S = 0.2  # how often a wait over many objects looks (the stamps are the events')
CHECK_ALL_BELOW = 20  # with fewer objects left, it looks after every event


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def template(command: list[str]) -> dict:
    return {"spec": {"containers": [{"name": CONTAINER, "image": "flowmill:bench",
                                     "command": command}]}}


def job_manifest(name: str, command: list[str], workers: int, ps: int) -> dict:
    specs: dict[str, Any] = {"worker": {"replicas": workers, "restartPolicy": "OnFailure",
                                        "template": template(command)}}
    if ps:
        specs["ps"] = {"replicas": ps, "template": template(command)}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
            "metadata": {"name": name},
            # The tasks serve no /progress: no stall judgement in the bench's few minutes.
            "spec": {"replicaSpecs": specs,
                     "runPolicy": {"backoffLimit": 100, "stallTimeoutSeconds": 3600}}}


def task_names(job: str, ps: int, workers: int) -> set[str]:
    return ({f"{job}-ps-{i}" for i in range(ps)}
            | {f"{job}-worker-{i}" for i in range(workers)})


class Watcher:
    """The namespace's TrainingJobs and their pods, from watches, each state stamped with
    the arrival time of the first event that showed it."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.ns = namespace
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.cond = threading.Condition()
        self.pods: dict[str, dict] = {}  # name -> the latest object, while it exists
        self.seen: dict[str, float] = {}  # pod uid -> first event
        self.bound: dict[str, float] = {}  # pod uid -> first event showing it on a node
        self.running: dict[str, float] = {}  # pod uid -> first event showing it Running
        self.jobs: dict[str, dict] = {}
        self.job_seen: dict[str, float] = {}  # job uid -> first event
        self.phases: dict[tuple[str, str], float] = {}  # (job, phase) -> first event
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(self._list_pods, self._on_pod),
                             daemon=True, name="watch-pods"),
            threading.Thread(target=self._loop, args=(self._list_jobs, self._on_job),
                             daemon=True, name="watch-jobs"),
        ]
        for t in self.threads:
            t.start()

    def _list_pods(self, **kw: Any) -> Any:
        return self.core.list_namespaced_pod(self.ns, label_selector=LABEL_JOB, **kw)

    def _list_jobs(self, **kw: Any) -> Any:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, **kw)

    def _loop(self, call: Callable[..., Any], on: Callable[[str, dict, float], None]) -> None:
        """List, then watch from the list's version; list again after an error or a 410."""
        rv = None
        while not self.stopping.is_set():
            try:
                if rv is None:
                    listing = json.loads(call(_preload_content=False,
                                              _request_timeout=60).data)
                    now = time.monotonic()
                    for item in listing["items"]:
                        on("ADDED", item, now)
                    rv = listing["metadata"]["resourceVersion"]
                w = watch.Watch()
                for ev in w.stream(call, resource_version=rv, timeout_seconds=WATCH_SECONDS,
                                   allow_watch_bookmarks=True, deserialize=False,
                                   _request_timeout=WATCH_SECONDS + 30):
                    now = time.monotonic()
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if ev["type"] != "BOOKMARK":
                        on(ev["type"], obj, now)
                    if self.stopping.is_set():
                        return
            except Exception as e:  # resume whatever broke the stream
                if self.stopping.is_set():
                    return
                say(f"watch {threading.current_thread().name}: {type(e).__name__}: {e}")
                rv = None
                time.sleep(0.5)

    def _on_pod(self, kind: str, pod: dict, now: float) -> None:
        meta = pod["metadata"]
        with self.cond:
            if kind == "DELETED":
                if self.pods.get(meta["name"], {}).get("metadata", {}).get("uid") == meta["uid"]:
                    del self.pods[meta["name"]]
            else:
                self.pods[meta["name"]] = pod
                self.seen.setdefault(meta["uid"], now)
                if pod["spec"].get("nodeName"):
                    self.bound.setdefault(meta["uid"], now)
                if (pod.get("status") or {}).get("phase") == "Running":
                    self.running.setdefault(meta["uid"], now)
            self.cond.notify_all()

    def _on_job(self, kind: str, job: dict, now: float) -> None:
        name = job["metadata"]["name"]
        with self.cond:
            if kind == "DELETED":
                self.jobs.pop(name, None)
            else:
                self.jobs[name] = job
                self.job_seen.setdefault(job["metadata"]["uid"], now)
                phase = (job.get("status") or {}).get("phase")
                if phase:
                    self.phases.setdefault((name, phase), now)
            self.cond.notify_all()

    def live(self, names: set[str]) -> dict[str, dict]:
        """Those of ``names`` that exist and are not being deleted (call under ``cond``)."""
        return {n: p for n in names if (p := self.pods.get(n)) is not None
                and not p["metadata"].get("deletionTimestamp")}

    def live_uid(self, name: str) -> str | None:
        """The uid of the pod ``name`` if it exists and is not being deleted."""
        pod = self.pods.get(name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return None
        return pod["metadata"]["uid"]

    def of_job(self, job: str) -> list[dict]:
        return [p for p in self.pods.values()
                if (p["metadata"].get("labels") or {}).get(LABEL_JOB) == job]

    def wait(self, what: str | Callable[[], str], check: Callable[[], Any],
             timeout: float) -> Any:
        """Block until ``check()`` (called under the lock after every event) is truthy."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                result = check()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    said = what() if callable(what) else what
                    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {said}")
                self.cond.wait(min(left, 1.0))

    def stop(self) -> None:
        self.stopping.set()


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process (its own, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``th percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def metric_sum(text: str, name: str, skip: str | None = None) -> float:
    """The sum of a metric's samples in a Prometheus text exposition (but those whose
    labels contain ``skip``)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and not (
                skip and skip in line.rsplit(" ", 1)[0]):
            total += float(line.rsplit(" ", 1)[1])
    return total


def proc_stat(pid: int) -> tuple[float, float, float]:
    """(user + system CPU seconds, resident MB now, peak resident MB) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    mem = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            mem[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return cpu, mem["VmRSS"], mem["VmHWM"]


class Bench:
    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.cluster, self.args = cluster, args
        self.ns = NAMESPACE
        self.watcher: Watcher | None = None
        self.operator: Proc | None = None
        self.operator_env: dict[str, str] = {}
        self.metrics_port = 0
        self.harness: dict[str, dict[str, Any]] = {}

    # -- setup and teardown

    def setup(self) -> None:
        c = self.cluster
        c.kubectl("apply", "-f", str(CRD))
        c.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
        c.kubectl("create", "namespace", self.ns)
        deadline = time.monotonic() + 60  # pods are refused until its ServiceAccount exists
        while c.get("serviceaccount", "default", self.ns) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no default ServiceAccount in {self.ns}")
            time.sleep(0.2)
        self.watcher = Watcher(c.api(), self.ns)
        self.operator_env = {**os.environ, "KUBECONFIG": str(self.operator_identity()),
                             "FLOWMILL_METRICS_HOST": "127.0.0.1"}
        self.operator = self.start_operator("operator")
        say(f"operator pid {self.operator.pid}, log {self.operator.log}")

    def operator_identity(self) -> Path:
        """A client certificate and kubeconfig for ``flowmill:operator``, bound to
        cluster-admin, so the audit log can tell the operator's requests from the rest."""
        c = self.cluster
        assert c.pki is not None
        name = issue_client(c.pki, "operator-bench", OPERATOR_USER)
        kubeconfig = c.state / "operator.kubeconfig"
        write_kubeconfig(kubeconfig, c.server, c.pki.ca_crt, user=OPERATOR_USER,
                         cert=c.pki.crt(name), key=c.pki.key(name))
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": "flowmill-operator-bench"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "cluster-admin"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                 "name": OPERATOR_USER}]}
        c.kubectl("apply", "-f", "-", input=json.dumps(binding))
        deadline = time.monotonic() + 60  # until the authorizer's cache has the binding
        while c.kubectl("auth", "can-i", "create", "pods", "-n", self.ns,
                        f"--as={OPERATOR_USER}", check=False).stdout.strip() != "yes":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{OPERATOR_USER} is not allowed to create pods")
            time.sleep(0.2)
        return kubeconfig

    def start_operator(self, log_name: str) -> Proc:
        """A fresh operator process, its metrics on a port of its own."""
        self.metrics_port = free_port()
        env = {**self.operator_env, "FLOWMILL_METRICS_PORT": str(self.metrics_port)}
        # `python -m` puts the working folder on sys.path: the state folder, not the repo.
        return Proc("operator", [
            sys.executable, "-m", "flowmill.operator", "--namespace", self.ns, "--standalone"],
            self.cluster.log_dir / f"{log_name}.log",
            env=env, cwd=self.cluster.state)

    def teardown(self) -> None:
        """Delete the jobs and their pods, wait for the pods to go, stop the operator."""
        w = self.watcher
        try:
            if w is not None:
                left = len(w.pods)
                self.clear_jobs(max(60.0, 0.2 * left))
        except Exception as e:  # the cluster stops next, with the pods
            say(f"clean-up: {e}")
        finally:
            if self.operator is not None:
                self.operator.stop()
            if w is not None:
                w.stop()

    def clear_jobs(self, timeout: float) -> None:
        """Every job of the namespace gone, with its pods, Services and NetworkPolicy: in
        one request each, not by the garbage collector, which deletes one object after
        another at the controller-manager's 20 requests a second."""
        w = self.watcher
        assert w is not None
        w.custom.delete_collection_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)
        w.core.delete_collection_namespaced_pod(self.ns, label_selector=LABEL_JOB)
        w.core.delete_collection_namespaced_service(self.ns, label_selector=LABEL_JOB)
        client.NetworkingV1Api(w.core.api_client).delete_collection_namespaced_network_policy(
            self.ns, label_selector=LABEL_JOB)
        w.wait(lambda: f"every job and pod to go ({len(w.jobs)} jobs, {len(w.pods)} pods "
               "left)", lambda: not w.pods and not w.jobs, timeout)

    # -- helpers

    def apply(self, manifest: dict, timeout: float = 120) -> float:
        """Start the clock, ``kubectl apply`` the manifest; return the start time."""
        text = json.dumps(manifest)
        t0 = time.monotonic()
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=text, timeout=timeout)
        return t0

    def wait(self, what: str | Callable[[], str], check: Callable[[], Any],
             timeout: float | None = None) -> Any:
        assert self.watcher is not None and self.operator is not None
        op = self.operator

        def guarded() -> Any:
            if not op.alive():
                said = what() if callable(what) else what
                raise RuntimeError(f"the operator exited ({op.popen.returncode}) while "
                                   f"waiting for {said}; log {op.log}:\n{op.log_tail()}")
            return check()

        return self.watcher.wait(what, guarded, timeout or self.args.timeout)

    def stamps(self, what: str, keys: list[str], stamp: Callable[[str], float | None],
               timeout: float) -> dict[str, float]:
        """Wait until ``stamp(key)`` (called under the watcher's lock) gives a time for
        every key; those times. While many are left, looks every ``CHECK_EVERY_S`` at most:
        the times are the events', so looking less often changes no figure, only the
        watcher's share; near the end, after every event, so the wait ends with the last."""
        got: dict[str, float] = {}
        pending = set(keys)
        last = [0.0]

        def check() -> bool:
            now = time.monotonic()
            if len(pending) > CHECK_ALL_BELOW and now - last[0] < CHECK_EVERY_S:
                return False
            last[0] = now
            for key in list(pending):
                t = stamp(key)
                if t is not None:
                    got[key] = t
                    pending.discard(key)
            return not pending

        self.wait(lambda: f"{what} ({len(pending)} of {len(keys)} left)", check, timeout)
        return got

    def delete_job(self, name: str) -> None:
        w = self.watcher
        assert w is not None
        self.cluster.kubectl("delete", "tj", name, "-n", self.ns, "--wait=false")
        self.wait(f"the pods of {name} to go", lambda: not w.of_job(name))

    def pid_of(self, pod: str) -> int:
        def read() -> int | None:
            try:
                text = self.cluster.pod_log(self.ns, pod, CONTAINER)
            except FileNotFoundError:
                return None
            first = text.split("\n", 1)[0].strip()
            return int(first) if first.isdigit() else None

        deadline = time.monotonic() + self.args.timeout
        while (pid := read()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no pid in the log of pod {pod}")
            time.sleep(0.1)
        return pid

    def snapshot(self) -> dict[str, Any]:
        """CPU seconds so far of the operator, each control-plane process, this process
        (its watches) and the kubectl runs it reaped; the audit log's size."""
        assert self.operator is not None
        cpu = {p.name: proc_cpu(p.pid) for p in self.cluster.procs if p.alive()}
        cpu["operator"] = proc_cpu(self.operator.pid)
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu["bench"] = me.ru_utime + me.ru_stime
        cpu["kubectl"] = kids.ru_utime + kids.ru_stime
        log = self.cluster.audit_log
        operator = self.scrape(f"http://127.0.0.1:{self.metrics_port}/metrics") or ""
        return {"cpu": cpu, "audit": audit.offset(log) if log else 0,
                "api_requests": self.api_requests(),
                "reconciles": metric_sum(operator, f"{RECONCILE}_count"),
                "reconcile_s": metric_sum(operator, f"{RECONCILE}_sum")}

    @staticmethod
    def scrape(url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read().decode()
        except OSError:
            return None

    def api_requests(self) -> float:
        """Requests the kube-apiserver has served so far, from every client (its
        ``apiserver_request_total``; watches aside)."""
        assert self.watcher is not None
        api = self.watcher.core.api_client
        resp = api.call_api("GET", f"{api.configuration.host}/metrics", _request_timeout=30)
        if resp.status != 200:
            raise RuntimeError(f"kube-apiserver /metrics: {resp.status} {resp.reason}")
        return metric_sum(resp.read().decode(), "apiserver_request_total",
                          skip='verb="WATCH"')

    def requests(self, start: int, end: int) -> audit.Counts:
        log = self.cluster.audit_log
        assert log is not None
        return audit.count(log, start, end, OPERATOR_USER)

    # -- phases

    def one_job(self, name: str) -> dict[str, float]:
        """Apply 2 ps + 2 workers, wait for Running, kill worker 0, wait for its replacement."""
        w = self.watcher
        assert w is not None
        names = task_names(name, ps=2, workers=2)
        t0 = self.apply(job_manifest(name, [sys.executable, "-c", SERVE], workers=2, ps=2))
        pods = self.wait(f"the pods of {name}",
                         lambda: (live := w.live(names)).keys() == names and live)
        created = max(w.seen[p["metadata"]["uid"]] for p in pods.values()) - t0
        self.wait(f"the pods of {name} to run", lambda: all(
            p["metadata"]["uid"] in w.running for p in w.live(names).values())
            and w.live(names).keys() == names)
        with w.cond:
            running = max(w.running[p["metadata"]["uid"]] for p in w.live(names).values()) - t0
        job_running = self.wait(f"{name} to be Running",
                                lambda: w.phases.get((name, "Running"))) - t0

        victim = f"{name}-worker-0"
        with w.cond:
            old_uid = w.pods[victim]["metadata"]["uid"]
        pid = self.pid_of(victim)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        new_uid = self.wait(f"a replacement for {victim}", self.replaced(victim, old_uid))
        replacement = w.seen[new_uid] - t_kill
        replacement_running = self.wait(f"{victim}'s replacement to run",
                                        lambda: w.running.get(new_uid)) - t_kill
        self.delete_job(name)
        return {"created": created, "running": running, "job_running": job_running,
                "replacement": replacement, "replacement_running": replacement_running}

    def replaced(self, victim: str, old_uid: str) -> Callable[[], str | None]:
        """A check: the uid of ``victim``'s replacement (same name, new uid), once it exists."""
        w = self.watcher
        assert w is not None

        def check() -> str | None:
            uid = w.live_uid(victim)
            return uid if uid and uid != old_uid else None

        return check

    def many_jobs(self, n: int, prefix: str, command: list[str], timeout: float,
                  burst: str | None = None) -> dict[str, Any]:
        """``n`` one-worker jobs in one apply, until each job's status says Running; the
        operator's CPU time, memory and API requests meanwhile. With ``burst`` (a running
        job of 2 ps + 2 workers), its worker 0 is killed ``BURST_KILL_S`` into the apply."""
        w, op = self.watcher, self.operator
        assert w is not None and op is not None
        names = [f"{prefix}-{i:0{len(str(n - 1))}d}" for i in range(n)]
        pod_of = {j: f"{j}-worker-0" for j in names}
        items = [job_manifest(j, command, workers=1, ps=0) for j in names]
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        victim, old_uid, pid = None, None, 0
        if burst:
            victim = f"{burst}-worker-0"
            with w.cond:
                old_uid = w.pods[victim]["metadata"]["uid"]
            pid = self.pid_of(victim)
        _, rss_idle, _ = proc_stat(op.pid)
        before = self.snapshot()
        applied: dict[str, Any] = {}

        def apply() -> None:
            try:
                start = time.monotonic()
                self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=text,
                                     timeout=timeout)
                applied["s"] = time.monotonic() - start
            except BaseException as e:  # raised in the main thread after join
                applied["error"] = e

        thread = threading.Thread(target=apply, name="apply", daemon=True)
        t0 = time.monotonic()
        thread.start()
        out: dict[str, Any] = {}
        if victim is not None and old_uid is not None:
            time.sleep(max(0.0, t0 + BURST_KILL_S - time.monotonic()))
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            new_uid = self.wait(f"a replacement for {victim}", self.replaced(victim, old_uid),
                                timeout)
            out["burst_replacement"] = w.seen[new_uid] - t_kill
            out["burst_replacement_running"] = self.wait(
                f"{victim}'s replacement to run", lambda: w.running.get(new_uid),
                timeout) - t_kill
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"kubectl apply of {n} jobs took over {timeout:.0f}s")
        if "error" in applied:
            raise applied["error"]

        def seen(pod: str) -> float | None:
            uid = w.live_uid(pod)
            return w.seen.get(uid) if uid else None

        def running(pod: str) -> float | None:
            uid = w.live_uid(pod)
            return w.running.get(uid) if uid else None

        created = self.stamps(f"the pods of {n} jobs", list(pod_of.values()), seen, timeout)
        started = self.stamps(f"the pods of {n} jobs to run", list(pod_of.values()), running,
                              timeout)
        reconciled = self.stamps(f"{n} jobs to be Running", names,
                                 lambda j: w.phases.get((j, "Running")), timeout)
        after = self.snapshot()
        with w.cond:
            job_seen = {j: w.job_seen[w.jobs[j]["metadata"]["uid"]] for j in names}
        # The operator's own shares: from a job's first event to its pod's (creation), and
        # from a job's pod running to the job's status saying so (status).
        create_lags = [created[pod_of[j]] - job_seen[j] for j in names]
        status_lags = [reconciled[j] - started[pod_of[j]] for j in names]
        # The scheduler's share (from a pod's first event to its binding to a node) and the
        # node stand-in's (from the binding to the pod's Running).
        with w.cond:
            bound = {pod: w.bound[w.pods[pod]["metadata"]["uid"]] for pod in pod_of.values()}
        bind_lags = [bound[pod] - created[pod] for pod in pod_of.values()]
        start_lags = [started[pod] - bound[pod] for pod in pod_of.values()]
        cpu = {k: after["cpu"][k] - before["cpu"].get(k, 0.0) for k in after["cpu"]}
        counts = self.requests(before["audit"], after["audit"])
        out.update({
            "n": n, "apply": applied["s"],
            "created": max(created.values()) - t0, "running": max(started.values()) - t0,
            "reconciled": max(reconciled.values()) - t0,
            "lag": statistics.median(status_lags), "lag_p99": percentile(status_lags, 99),
            "lag_max": max(status_lags),
            "create_lag": statistics.median(create_lags),
            "create_lag_p99": percentile(create_lags, 99), "create_lag_max": max(create_lags),
            "bind_lag": statistics.median(bind_lags),
            "bind_lag_p99": percentile(bind_lags, 99),
            "start_lag": statistics.median(start_lags),
            "start_lag_p99": percentile(start_lags, 99),
            "api_requests": after["api_requests"] - before["api_requests"],
            "reconciles": after["reconciles"] - before["reconciles"],
            "reconcile_s": after["reconcile_s"] - before["reconcile_s"],
            "cpu": cpu["operator"], "cpu_all": cpu, "rss_idle": rss_idle,
            "rss_end": proc_stat(op.pid)[1], "counts": counts, "audit_end": after["audit"],
        })
        return out

    def restart(self) -> dict[str, Any]:
        """SIGTERM the operator, start a fresh one, and time it until its gauge of jobs by
        phase counts every job there is (each job counts after its first reconcile)."""
        w, op = self.watcher, self.operator
        assert w is not None and op is not None
        with w.cond:
            jobs = len(w.jobs)
        timeout = max(self.args.timeout, 0.5 * jobs)
        start = audit.offset(self.cluster.audit_log) if self.cluster.audit_log else 0
        before = self.snapshot()
        t_stop = time.monotonic()
        op.stop()
        stopped = time.monotonic() - t_stop
        t0 = time.monotonic()
        self.operator = new = self.start_operator("operator-restart")
        say(f"restarted operator pid {new.pid}, log {new.log}")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        first, counted = None, 0.0
        while True:
            if not new.alive():
                raise RuntimeError(f"the restarted operator exited ({new.popen.returncode}); "
                                   f"log {new.log}:\n{new.log_tail()}")
            text = self.scrape(url)
            now = time.monotonic()
            if text is not None:
                first = first if first is not None else now - t0
                counted = metric_sum(text, GAUGE)
                if counted >= jobs:
                    recovered = now - t0
                    break
            if now - t0 > timeout:
                raise TimeoutError(f"the restarted operator counted {counted:.0f} of {jobs} "
                                   f"jobs after {timeout:.0f}s")
            time.sleep(0.1)
        after = self.snapshot()
        _, rss, peak = proc_stat(new.pid)
        cpu = {k: after["cpu"][k] - before["cpu"].get(k, 0.0) for k in after["cpu"]}
        cpu["operator"] = after["cpu"]["operator"]  # the new process's, all of it
        cpu.pop("kubectl")  # none ran; the reaped children are the old operator
        counts = self.requests(start, after["audit"])
        return {"jobs": jobs, "stop": stopped, "first_metrics": first, "recovered": recovered,
                "cpu": cpu, "counts": counts, "rss": rss, "rss_peak": peak}

    def objects_mb(self) -> float:
        """What the namespace's jobs and pods take in memory as the operator's store
        holds them (``store.compact``: parsed JSON, ``managedFields`` dropped, keys and
        short strings shared), measured by ``tracemalloc``
        in a process of their own: the part of the operator's memory at rest that grows
        with the jobs whoever keeps them."""
        api = self.cluster.api()
        pods = client.CoreV1Api(api).list_namespaced_pod(
            self.ns, label_selector=LABEL_JOB, _preload_content=False).data
        jobs = client.CustomObjectsApi(api).list_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, _preload_content=False).data
        listing = self.cluster.state / "objects.json"
        listing.write_bytes(b'{"pods": %s, "jobs": %s}' % (pods, jobs))
        # Each object parsed on its own, as a watch event is (one parse of the whole
        # list would share the keys among all objects, which the store does itself).
        code = ("import gc, json, sys, tracemalloc\n"
                "from flowmill.operator.store import compact\n"
                "doc = json.loads(open(sys.argv[1]).read())\n"
                "texts = [json.dumps(o) for k in ('pods', 'jobs') for o in doc[k]['items']]\n"
                "del doc\n"
                "tracemalloc.start()\n"
                "kept = [compact(json.loads(t)) for t in texts]\n"
                "gc.collect()\n"
                "print(tracemalloc.get_traced_memory()[0], len(kept))\n")
        out = subprocess.run([sys.executable, "-c", code, str(listing)], capture_output=True,
                             text=True, check=True, timeout=120, cwd=self.cluster.state)
        held, count = out.stdout.split()
        say(f"the {count} jobs and pods take {int(held) / 2**20:.1f} MiB as the store holds them")
        return int(held) / 2**20

    def scale(self, n: int) -> dict[str, Any]:
        """``n`` jobs while a 2 ps + 2 worker job loses a worker; then quiet; then a restart."""
        w = self.watcher
        assert w is not None
        timeout = max(self.args.timeout, 0.5 * n)
        burst = "burst"
        names = task_names(burst, ps=2, workers=2)
        self.apply(job_manifest(burst, [sys.executable, "-c", SERVE], workers=2, ps=2))
        self.wait(f"the pods of {burst} to run", lambda: (live := w.live(names)).keys() == names
                  and all(p["metadata"]["uid"] in w.running for p in live.values()))
        self.wait(f"{burst} to be Running", lambda: w.phases.get((burst, "Running")))
        say(f"{n} jobs at once, {burst}'s worker 0 killed {BURST_KILL_S:.0f} s in")
        out = self.many_jobs(n, "scale", SCALE_TASK, timeout, burst=burst)
        say(f"quiet for {QUIET_S:.0f} s")
        op = self.operator
        assert op is not None
        cpu0 = proc_cpu(op.pid)
        time.sleep(QUIET_S)
        rest = self.snapshot()
        out["rest_cpu"] = proc_cpu(op.pid) - cpu0
        out["rest_requests"] = self.requests(out["audit_end"], rest["audit"])
        _, out["rss_rest"], out["rss_peak"] = proc_stat(op.pid)
        out["objects_mb"] = self.objects_mb()
        self.delete_job(burst)  # the restart then finds the n jobs alone
        self.wait(f"{burst} to go", lambda: burst not in w.jobs)
        say(f"operator restart with {n} jobs")
        out["restart"] = self.restart()
        return out

    def run(self) -> dict[str, Any]:
        args = self.args
        # The warm-up also waits out the garbage collector's discovery of the new CRD
        # (every 30 s): until then, deleting a job leaves its pods behind.
        say("warm-up job")
        self.one_job("warmup")
        rounds = []
        for i in range(args.jobs):
            r = self.one_job(f"job-{i}")
            rounds.append(r)
            say(f"job {i}: " + "  ".join(f"{k} {v:.2f} s" for k, v in r.items()))
        say(f"{args.many} jobs at once")
        many = self.many_jobs(args.many, "many", ["sleep", "600"], args.timeout)
        say("  ".join(f"{k} {v:.2f}" for k, v in many.items() if isinstance(v, float)))
        assert self.operator is not None
        _, _, rss_peak = proc_stat(self.operator.pid)

        def med(key: str) -> float:
            return round(statistics.median(r[key] for r in rounds), 3)

        def top(key: str) -> float:
            return round(max(r[key] for r in rounds), 3)

        n = args.many
        result = {
            "bench": "operator",
            "kopf_version": version("kopf"),
            "kubernetes_version": self.cluster.versions["KUBERNETES_VERSION"],
            "jobs": args.jobs,
            "apply_to_created_s": med("created"),
            "apply_to_created_max_s": top("created"),
            "apply_to_running_s": med("running"),
            "apply_to_running_max_s": top("running"),
            "apply_to_job_running_s": med("job_running"),
            "death_to_replacement_s": med("replacement"),
            "death_to_replacement_max_s": top("replacement"),
            "death_to_replacement_running_s": med("replacement_running"),
            f"jobs_{n}_apply_s": round(many["apply"], 3),
            f"jobs_{n}_created_s": round(many["created"], 3),
            f"jobs_{n}_running_s": round(many["running"], 3),
            f"jobs_{n}_reconciled_s": round(many["reconciled"], 3),
            f"jobs_{n}_status_lag_s": round(many["lag"], 3),
            f"jobs_{n}_status_lag_max_s": round(many["lag_max"], 3),
            f"jobs_{n}_create_lag_s": round(many["create_lag"], 3),
            f"jobs_{n}_create_lag_max_s": round(many["create_lag_max"], 3),
            f"jobs_{n}_cpu_per_job_s": round(many["cpu"] / n, 4),
            **per_job(f"jobs_{n}", many["counts"], n),
            **reconciles(f"jobs_{n}", many, n),
            "operator_cpu_s": round(many["cpu"], 2),
            "operator_rss_mb": round(rss_peak, 1),
            "operator_rss_idle_mb": round(many["rss_idle"], 1),
            "operator_rss_end_mb": round(many["rss_end"], 1),
            "cpus": os.cpu_count(),
        }
        self.harness[f"jobs_{n}"] = harness(many)
        if args.scale:
            say(f"clearing the {n} jobs")
            self.clear_jobs(max(args.timeout, 0.2 * n))
            s = self.scale(args.scale)
            k, restart = f"jobs_{args.scale}", s["restart"]
            result.update({
                f"{k}_apply_s": round(s["apply"], 3),
                f"{k}_created_s": round(s["created"], 3),
                f"{k}_running_s": round(s["running"], 3),
                f"{k}_reconciled_s": round(s["reconciled"], 3),
                f"{k}_status_lag_s": round(s["lag"], 3),
                f"{k}_status_lag_p99_s": round(s["lag_p99"], 3),
                f"{k}_status_lag_max_s": round(s["lag_max"], 3),
                f"{k}_create_lag_s": round(s["create_lag"], 3),
                f"{k}_create_lag_p99_s": round(s["create_lag_p99"], 3),
                f"{k}_create_lag_max_s": round(s["create_lag_max"], 3),
                f"{k}_cpu_s": round(s["cpu"], 2),
                f"{k}_cpu_per_job_s": round(s["cpu"] / args.scale, 4),
                **per_job(k, s["counts"], args.scale),
                **reconciles(k, s, args.scale),
                f"{k}_rss_idle_mb": round(s["rss_idle"], 1),
                f"{k}_rss_rest_mb": round(s["rss_rest"], 1),
                f"{k}_rss_peak_mb": round(s["rss_peak"], 1),
                f"{k}_objects_mb": round(s["objects_mb"], 1),
                f"{k}_rest_cpu_s": round(s["rest_cpu"], 2),
                f"{k}_rest_requests": s["rest_requests"].total,
                f"{k}_rest_requests_by_kind": dict(s["rest_requests"].requests.most_common()),
                "burst_death_to_replacement_s": round(s["burst_replacement"], 3),
                "burst_death_to_replacement_running_s": round(s["burst_replacement_running"], 3),
                "restart_jobs": restart["jobs"],
                "restart_stop_s": round(restart["stop"], 3),
                "restart_first_metrics_s": round(restart["first_metrics"], 3),
                "restart_recovery_s": round(restart["recovered"], 3),
                "restart_cpu_s": round(restart["cpu"]["operator"], 2),
                "restart_rss_mb": round(restart["rss"], 1),
                "restart_rss_peak_mb": round(restart["rss_peak"], 1),
                **per_job("restart", restart["counts"], restart["jobs"]),
            })
            self.harness[k] = harness(s)
            self.harness["restart"] = {"cpu_s": {name: round(v, 2) for name, v
                                                 in restart["cpu"].items()}}
        result["harness"] = self.harness
        return result


def per_job(prefix: str, counts: audit.Counts, n: int) -> dict[str, Any]:
    """The operator's requests per job, in total and by verb and resource, and the failed
    ones (by response code, in total)."""
    return {
        f"{prefix}_requests_per_job": round(counts.total / n, 3),
        f"{prefix}_requests_by_kind": {k: round(v / n, 3)
                                       for k, v in counts.requests.most_common()},
        f"{prefix}_requests_failed": {str(code): v for code, v in sorted(counts.codes.items())
                                      if code >= 400},
        f"{prefix}_watches_ended": sum(counts.watches.values()),
    }


def reconciles(prefix: str, phase: dict[str, Any], n: int) -> dict[str, Any]:
    """The operator's reconciles per job over a phase, and their mean duration (its
    ``flowmill_operator_reconcile_duration_seconds`` histogram)."""
    count = phase["reconciles"]
    return {f"{prefix}_reconciles_per_job": round(count / n, 2),
            f"{prefix}_reconcile_mean_s": round(phase["reconcile_s"] / count, 4) if count
            else None}


def harness(phase: dict[str, Any]) -> dict[str, Any]:
    """What a jobs phase cost outside the operator: the apply, the scheduler's and the node
    stand-in's shares of each pod's start, the apiserver's requests from every client (the
    operator's among them), and every process's CPU."""
    return {"apply_s": round(phase["apply"], 3),
            "pod_bind_lag_s": round(phase["bind_lag"], 3),
            "pod_bind_lag_p99_s": round(phase["bind_lag_p99"], 3),
            "pod_start_lag_s": round(phase["start_lag"], 3),
            "pod_start_lag_p99_s": round(phase["start_lag_p99"], 3),
            "api_requests": int(phase["api_requests"]),
            "operator_requests": phase["counts"].total,
            "cpu_s": {name: round(v, 2) for name, v in phase["cpu_all"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3, help="2 ps + 2 worker jobs, one at a time")
    ap.add_argument("--many", type=int, default=50, help="one-worker jobs applied at once")
    ap.add_argument("--scale", type=int, default=1000,
                    help="one-worker jobs applied at once after --many's are gone (0: none)")
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="seconds, for every wait (the scale phase's: at least 0.5 per job)")
    args = ap.parse_args()
    missing = binaries().missing()
    if missing:
        sys.exit(f"e2e binaries missing (run e2e/build.sh): {[p.name for p in missing]}")
    # Room on the stand-in's nodes for every job of a phase on any one node.
    cluster = Cluster(audit_users=(OPERATOR_USER,),
                      node_pods=max(110, args.scale + args.many + 100))
    say("starting the control plane")
    cluster.start()
    bench = Bench(cluster, args)
    try:
        bench.setup()
        result = bench.run()
    finally:
        try:
            bench.teardown()
        finally:
            cluster.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
