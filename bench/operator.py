"""The operator's latency and cost on a real control plane.

Starts the e2e control plane (etcd, kube-apiserver, kube-controller-manager and the node
stand-in, which runs each pod's container as a local process and ignores its image),
installs the CRD, and runs the operator as its own process,
``kopf run -m flowmill.operator.controller --namespace NS --standalone``, under the admin
kubeconfig, so that its CPU time and memory can be read from ``/proc/<pid>``. Then:

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
  ``operator_rss_idle_mb`` its resident memory just before the phase.

Every clock starts just before the ``kubectl`` process is spawned, so kubectl's own start
and requests are inside the figures, as a user sees them. Pod and job times are the arrival
of the watch event that first showed the state, stamped in a watcher thread; nothing is
polled. A warm-up job runs first, so the figures are of an operator that has started.
Every wait is bounded; the jobs, the operator and the control plane are stopped on any
failure. No peer is timed: Kubeflow's training operator (TFJob, the one PS-aware peer) is a
Go controller that this harness does not build.

    python bench/operator.py [--jobs 3] [--many 50] [--timeout 180]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kubernetes import client, watch

REPO = Path(__file__).resolve().parent.parent
# At the end of sys.path: in front, the repository's operator/ folder would shadow the
# standard library's ``operator`` (see e2e/README.md).
sys.path.append(str(REPO))

from e2e.cluster import Cluster, free_port  # noqa: E402
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
            "spec": {"replicaSpecs": specs, "runPolicy": {"backoffLimit": 100}}}


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
        self.running: dict[str, float] = {}  # pod uid -> first event showing it Running
        self.jobs: dict[str, dict] = {}
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
                phase = (job.get("status") or {}).get("phase")
                if phase:
                    self.phases.setdefault((name, phase), now)
            self.cond.notify_all()

    def live(self, names: set[str]) -> dict[str, dict]:
        """Those of ``names`` that exist and are not being deleted (call under ``cond``)."""
        return {n: p for n, p in self.pods.items()
                if n in names and not p["metadata"].get("deletionTimestamp")}

    def of_job(self, job: str) -> list[dict]:
        return [p for p in self.pods.values()
                if (p["metadata"].get("labels") or {}).get(LABEL_JOB) == job]

    def wait(self, what: str, check: Callable[[], Any], timeout: float) -> Any:
        """Block until ``check()`` (called under the lock after every event) is truthy."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                result = check()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
                self.cond.wait(min(left, 1.0))

    def stop(self) -> None:
        self.stopping.set()


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
        env = {**os.environ, "KUBECONFIG": str(c.kubeconfig),
               "FLOWMILL_METRICS_PORT": str(free_port()), "FLOWMILL_METRICS_HOST": "127.0.0.1"}
        # `python -m` puts the working folder on sys.path: the state folder, not the repo.
        self.operator = Proc("operator", [
            sys.executable, "-m", "kopf", "run", "-m", "flowmill.operator.controller",
            "--namespace", self.ns, "--standalone"], c.log_dir / "operator.log",
            env=env, cwd=c.state)
        say(f"operator pid {self.operator.pid}, log {self.operator.log}")

    def teardown(self) -> None:
        """Delete the jobs (their pods go by garbage collection), then stop the operator."""
        try:
            self.cluster.kubectl("delete", "tj", "--all", "-n", self.ns, "--wait=false",
                                 check=False, timeout=60)
            if self.watcher is not None:
                self.watcher.wait("every pod to go", lambda: not self.watcher.pods, 60)
        except Exception as e:  # the cluster stops next, with the pods
            say(f"clean-up: {e}")
        finally:
            if self.operator is not None:
                self.operator.stop()
            if self.watcher is not None:
                self.watcher.stop()

    # -- helpers

    def apply(self, manifest: dict) -> float:
        """Start the clock, ``kubectl apply`` the manifest; return the start time."""
        text = json.dumps(manifest)
        t0 = time.monotonic()
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=text)
        return t0

    def wait(self, what: str, check: Callable[[], Any]) -> Any:
        assert self.watcher is not None and self.operator is not None
        op = self.operator

        def guarded() -> Any:
            if not op.alive():
                raise RuntimeError(f"the operator exited ({op.popen.returncode}) while "
                                   f"waiting for {what}; log {op.log}:\n{op.log_tail()}")
            return check()

        return self.watcher.wait(what, guarded, self.args.timeout)

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

        def replaced() -> str | None:
            pod = w.live({victim}).get(victim)
            uid = pod["metadata"]["uid"] if pod else None
            return uid if uid and uid != old_uid else None

        new_uid = self.wait(f"a replacement for {victim}", replaced)
        replacement = w.seen[new_uid] - t_kill
        replacement_running = self.wait(f"{victim}'s replacement to run",
                                        lambda: w.running.get(new_uid)) - t_kill
        self.delete_job(name)
        return {"created": created, "running": running, "job_running": job_running,
                "replacement": replacement, "replacement_running": replacement_running}

    def many_jobs(self, n: int) -> dict[str, float]:
        """``n`` one-worker jobs in one apply; the operator's CPU and memory meanwhile."""
        w, op = self.watcher, self.operator
        assert w is not None and op is not None
        names = [f"many-{i:03d}" for i in range(n)]
        items = [job_manifest(j, ["sleep", "600"], workers=1, ps=0) for j in names]
        cpu0, rss_idle, _ = proc_stat(op.pid)
        t0 = self.apply({"apiVersion": "v1", "kind": "List", "items": items})
        applied = time.monotonic() - t0
        pods = {f"{j}-worker-0" for j in names}
        created = self.wait(f"the pods of {n} jobs", lambda: (
            (live := w.live(pods)).keys() == pods
            and max(w.seen[p["metadata"]["uid"]] for p in live.values()))) - t0
        reconciled = self.wait(f"{n} jobs to be Running", lambda: all(
            (j, "Running") in w.phases for j in names) and max(
            w.phases[(j, "Running")] for j in names)) - t0
        cpu1, rss_end, _ = proc_stat(op.pid)
        with w.cond:
            started = {p["metadata"]["name"]: w.running[p["metadata"]["uid"]]
                       for p in w.live(pods).values()}
        # The operator's own share: from a job's pod running to the job's status saying so.
        lags = [w.phases[(j, "Running")] - started[f"{j}-worker-0"] for j in names]
        return {"apply": applied, "created": created, "running": max(started.values()) - t0,
                "reconciled": reconciled, "lag": statistics.median(lags), "lag_max": max(lags),
                "cpu": cpu1 - cpu0, "rss_idle": rss_idle, "rss_end": rss_end}

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
        many = self.many_jobs(args.many)
        say("  ".join(f"{k} {v:.2f}" for k, v in many.items()))
        assert self.operator is not None
        _, _, rss_peak = proc_stat(self.operator.pid)

        def med(key: str) -> float:
            return round(statistics.median(r[key] for r in rounds), 3)

        def top(key: str) -> float:
            return round(max(r[key] for r in rounds), 3)

        n = args.many
        return {
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
            "operator_cpu_s": round(many["cpu"], 2),
            "operator_rss_mb": round(rss_peak, 1),
            "operator_rss_idle_mb": round(many["rss_idle"], 1),
            "operator_rss_end_mb": round(many["rss_end"], 1),
            "cpus": os.cpu_count(),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3, help="2 ps + 2 worker jobs, one at a time")
    ap.add_argument("--many", type=int, default=50, help="one-worker jobs applied at once")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds, for every wait")
    args = ap.parse_args()
    missing = binaries().missing()
    if missing:
        sys.exit(f"e2e binaries missing (run e2e/build.sh): {[p.name for p in missing]}")
    cluster = Cluster()
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
