"""Scheduling latency: jobs placed by the real kube-scheduler, with and without Kueue.

Starts the e2e control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, and the node stand-in's three nodes, which run each bound pod's container
as a local process), Kueue v0.17 (``e2e/kueue.py``), the CRD, and the operator as its own
process, as ``bench/operator.py`` does. A ClusterQueue with quota for every job here and a
LocalQueue in the bench's namespace. Then, for 1 job (2 ps + 2 workers) and for ``--many``
one-worker jobs applied at once:

- ``direct_*``: the jobs without a queue label: apply -> every pod Running (the scheduler
  binds each, the stand-in starts it).
- ``kueue_*``: the same jobs labelled ``kueue.x-k8s.io/queue-name``: apply -> the job's
  Workload admitted (``admitted_s``; the operator makes the Workload, Kueue admits it),
  and apply -> every pod Running (``running_s``). ``kueue_N_admission_median_s`` is
  Kueue's own part, per job: from its Workload's creation to its admission (median).

``kueue_N_overhead_s`` is the difference of the two ``running_s``: what queueing adds
before a job starts. Each clock starts just before ``kubectl`` is spawned; object times
are the arrival of the first watch event that showed the state (nothing is polled). Every
wait is bounded; everything is stopped on any failure.

    python bench/scheduling.py [--many 50] [--timeout 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from kubernetes import client

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # at the end: operator/ must not shadow the standard library

from e2e.cluster import Cluster  # noqa: E402
from e2e.kueue import Kueue  # noqa: E402
from e2e.versions import binaries, kueue_binary  # noqa: E402


def _load_operator_bench() -> Any:
    """bench/operator.py (its name is the standard library's, so it is loaded by path)."""
    spec = importlib.util.spec_from_file_location("bench_operator", REPO / "bench" / "operator.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ob = _load_operator_bench()
say = ob.say
QUEUE, CLUSTER_QUEUE, FLAVOR = "bench", "flowmill-bench", "flowmill-bench"
KUEUE = "kueue.x-k8s.io/v1beta2"
SERVE = [sys.executable, "-c", "import time; time.sleep(600)"]


class Watcher(ob.Watcher):
    """bench/operator.py's watcher, plus the namespace's Workloads: when each was first
    seen, and when first seen admitted."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.wl_seen: dict[str, float] = {}  # job name -> first event of its Workload
        self.wl_admitted: dict[str, float] = {}
        super().__init__(api, namespace)
        t = threading.Thread(target=self._loop, args=(self._list_workloads, self._on_wl),
                             daemon=True, name="watch-workloads")
        self.threads.append(t)
        t.start()

    def _list_workloads(self, **kw: Any) -> Any:
        return self.custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", self.ns,
                                                         "workloads", **kw)

    def _on_wl(self, kind: str, wl: dict, now: float) -> None:
        job = (wl["metadata"].get("labels") or {}).get("flowmill.dev/job-name")
        if not job or kind == "DELETED":
            return
        with self.cond:
            self.wl_seen.setdefault(job, now)
            if any(c["type"] == "Admitted" and c["status"] == "True"
                   for c in (wl.get("status") or {}).get("conditions") or ()):
                self.wl_admitted.setdefault(job, now)
            self.cond.notify_all()


class Bench(ob.Bench):
    def setup(self) -> None:
        super().setup()
        self.watcher.stop()
        self.watcher = Watcher(self.cluster.api(), self.ns)
        quota = [{"name": r, "nominalQuota": q} for r, q in (("cpu", "1000"), ("memory", "1Ti"))]
        objects = [
            {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
            {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
             "spec": {"namespaceSelector": {}, "resourceGroups": [{
                 "coveredResources": ["cpu", "memory"],
                 "flavors": [{"name": FLAVOR, "resources": quota}]}]}},
            {"apiVersion": KUEUE, "kind": "LocalQueue",
             "metadata": {"name": QUEUE, "namespace": self.ns},
             "spec": {"clusterQueue": CLUSTER_QUEUE}},
        ]
        self.cluster.kubectl("apply", "-f", "-",
                             input="\n---\n".join(json.dumps(o) for o in objects))

    def jobs(self, prefix: str, n: int, queued: bool) -> dict[str, float]:
        """``n`` jobs applied at once (one of 2 ps + 2 workers when n is 1, else one
        worker each); the times until admitted and until every pod runs."""
        w = self.watcher
        names = [f"{prefix}-{i:03d}" for i in range(n)]
        ps, workers = (2, 2) if n == 1 else (0, 1)
        items = []
        for j in names:
            m = ob.job_manifest(j, SERVE, workers=workers, ps=ps)
            for spec in m["spec"]["replicaSpecs"].values():
                spec["template"]["spec"]["containers"][0]["resources"] = {
                    "requests": {"cpu": "10m", "memory": "16Mi"}}
            if queued:
                m["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": QUEUE}
            items.append(m)
        pods = set().union(*(ob.task_names(j, ps, workers) for j in names))
        t0 = self.apply({"apiVersion": "v1", "kind": "List", "items": items})
        out: dict[str, float] = {}
        if queued:
            out["admitted"] = self.wait(f"{n} Workloads admitted", lambda: all(
                j in w.wl_admitted for j in names) and max(
                w.wl_admitted[j] for j in names)) - t0
            with w.cond:
                out["admission_median"] = statistics.median(
                    w.wl_admitted[j] - w.wl_seen[j] for j in names)
        self.wait(f"the pods of {n} jobs to run", lambda: (
            (live := w.live(pods)).keys() == pods
            and all(p["metadata"]["uid"] in w.running for p in live.values())))
        with w.cond:
            out["running"] = max(w.running[p["metadata"]["uid"]]
                                 for p in w.live(pods).values()) - t0
        self.cluster.kubectl("delete", "tj", "--all", "-n", self.ns, "--wait=false")
        self.wait("every pod to go", lambda: not w.pods)
        return out

    def run(self) -> dict[str, Any]:
        n = self.args.many
        say("warm-up")
        self.jobs("warmup", 1, queued=True)
        result: dict[str, Any] = {"bench": "scheduling",
                                  "kubernetes_version": self.cluster.versions["KUBERNETES_VERSION"],
                                  "kueue_version": self.cluster.versions["KUEUE_VERSION"]}
        for count in (1, n):
            direct = self.jobs(f"direct{count}", count, queued=False)
            queued = self.jobs(f"queued{count}", count, queued=True)
            say(f"{count} job(s): direct {direct}  kueue {queued}")
            result[f"direct_{count}_running_s"] = round(direct["running"], 3)
            result[f"kueue_{count}_admitted_s"] = round(queued["admitted"], 3)
            result[f"kueue_{count}_admission_median_s"] = round(queued["admission_median"], 3)
            result[f"kueue_{count}_running_s"] = round(queued["running"], 3)
            result[f"kueue_{count}_overhead_s"] = round(queued["running"] - direct["running"], 3)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--many", type=int, default=50, help="one-worker jobs applied at once")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds, for every wait")
    args = ap.parse_args()
    missing = binaries().missing() + [p for p in (kueue_binary(),) if not p.exists()]
    if missing:
        sys.exit(f"e2e binaries missing (run e2e/build.sh): {[p.name for p in missing]}")
    cluster = Cluster()
    say("starting the control plane and Kueue")
    cluster.start()
    kueue = Kueue(cluster)
    bench = Bench(cluster, args)
    try:
        kueue.start()
        bench.setup()
        result = bench.run()
    finally:
        try:
            bench.teardown()
        finally:
            try:
                kueue.stop()
            finally:
                cluster.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
