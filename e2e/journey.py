"""What a user does and looks at in a namespace where the chart is installed, on either
kind of node: the digits example applied with ``kubectl apply``, its TrainingJob, pods,
Events, checkpoints in S3 and logs, and its tasks killed the way a node loses them.

``Journey`` is the node stand-in's (``test_user_journey.py``): the example's script runs
from this checkout, and a task's process is found through ``/proc``.
``e2e/test_real_node_journey.py`` adapts it to the real node (the image, containers).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import obstore
import yaml

from flowmill.operator.manifests import LABEL_INDEX, LABEL_JOB, LABEL_ROLE

from .cluster import Cluster
from .jobs import JobReader
from .polling import eventually
from .procs import free_port

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "flowmill"
EXAMPLE = REPO / "examples" / "digits" / "job.yaml"
RELEASE = "fm"
OPERATOR_LABEL = f"app.kubernetes.io/instance={RELEASE}"
TIMEOUT = 240.0  # for a whole digits run on a busy 2-core machine
MANIFEST_KEY = re.compile(r"/ckpt-(\d{12})/MANIFEST\.json$")
RESTORED = re.compile(r"restored checkpoint step (\d+) from (\S+)")


class Journey(JobReader):
    """The namespace the chart was installed in, and what a user looks at there."""

    def __init__(self, cluster: Cluster, namespace: str, tmp: Path) -> None:
        super().__init__(cluster, namespace)
        self.tmp = tmp
        self.store = cluster.s3.store()

    # -- the job, as the example has it

    def manifest(self, name: str, *, max_steps: int, interval: int = 100,
                 args: list[str] | None = None, wrap: list[str] | None = None,
                 uri: str | None = None, **run_policy: Any) -> Path:
        """examples/digits/job.yaml for this cluster, written to a file to apply; ``wrap``
        goes between the interpreter and the script (a fault injector); ``uri``, the
        checkpoints' place, is the job's own folder of the test bucket unless given."""
        doc = yaml.safe_load(EXAMPLE.read_text())
        doc["metadata"]["name"] = name
        spec = doc["spec"]
        template = spec["replicaSpecs"]["worker"]["template"]
        (container,) = template["spec"]["containers"]
        self.adapt(template["spec"], container)
        if wrap:
            container["command"][1:1] = wrap
        if args is not None:
            container["args"] = args
        container.setdefault("env", []).append({"name": "AWS_ALLOW_HTTP", "value": "true"})
        spec["training"]["maxSteps"] = max_steps
        spec["checkpoint"].update(uri=uri or self.checkpoint_uri(name),
                                  intervalSteps=interval)
        spec["runPolicy"].update(run_policy)
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def adapt(self, pod_spec: dict, container: dict) -> None:
        """The worker template (the ps tasks' too) for the nodes it runs on: on the stand-in,
        the script from this checkout (the image's working directory holds examples/)."""
        container["command"] = [str(REPO / a) if a.startswith("examples/") else a
                                for a in container["command"]]

    def apply(self, name: str, **kwargs: Any) -> Path:
        path = self.manifest(name, **kwargs)
        self.cluster.kubectl("apply", "-n", self.ns, "-f", str(path))
        return path

    def checkpoint_uri(self, name: str) -> str:
        return f"s3://{self.cluster.s3.bucket}/{self.ns}/{name}"

    # -- reading

    def services(self, job: str) -> list[str]:
        resp = self.core.list_namespaced_service(self.ns, label_selector=f"{LABEL_JOB}={job}",
                                                 _preload_content=False)
        return [s["metadata"]["name"] for s in json.loads(resp.data)["items"]]

    def phase(self, name: str, phase: str, seen: set[str] | None = None,
              each: Callable[[dict], None] | None = None) -> dict:
        """Wait for ``phase``; ``seen`` collects the phases passed on the way."""

        def watch(status: dict) -> None:
            if seen is not None and status.get("phase"):
                seen.add(status["phase"])
            if each is not None:
                each(status)

        return super().phase(name, phase, TIMEOUT, watch)

    def checkpoints(self, name: str) -> dict[int, str]:
        """The committed checkpoints of a job in S3: {step: key of its MANIFEST.json}."""
        found = {}
        for batch in obstore.list(self.store, prefix=f"{self.ns}/{name}/"):
            for meta in batch:
                m = MANIFEST_KEY.search(meta["path"])
                if m:
                    found[int(m.group(1))] = meta["path"]
        return found

    def read_json(self, key: str) -> dict:
        return json.loads(bytes(obstore.get(self.store, key).bytes()))

    def wait_checkpoint(self, name: str) -> int:
        """The first checkpoint step of a running job: proof that training is under way."""
        found = eventually(f"a checkpoint of {name} in S3", lambda: self.checkpoints(name),
                           TIMEOUT, interval=0.3)
        return min(found)

    def log(self, pod: str) -> str:
        """The newest log of the pod of that name."""
        return self.cluster.pod_log(self.ns, pod)

    def all_logs(self, pod: str) -> str:
        """Every log of every pod of that name, oldest first."""
        files = (self.cluster.log_dir / "pods").glob(f"{self.ns}_{pod}_*/*/*.log")
        return "".join(f.read_text(errors="replace")
                       for f in sorted(files, key=lambda f: f.stat().st_mtime))

    def events(self, name: str) -> dict[str, list[str]]:
        """The job's Events: {reason: [message, ...]}."""
        events = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items
        out: dict[str, list[str]] = {}
        for e in events:
            out.setdefault(e.reason, []).append(e.message)
        return out

    def table(self, name: str) -> dict[str, str]:
        """``kubectl get tj NAME`` as {column: value}."""
        header, row = self.cluster.kubectl("get", "tj", name, "-n", self.ns).stdout.splitlines()
        return dict(zip(header.split(), row.split(), strict=True))

    # -- killing

    def pid(self, pod: dict) -> int:
        """The process of the pod's container (the leader of its process group)."""
        home = f"/{pod['metadata']['uid']}/home".encode()

        def find() -> int | None:
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    env = (entry / "environ").read_bytes().split(b"\0")
                    pid = int(entry.name)
                    if any(e.startswith(b"HOME=") and e.endswith(home) for e in env) and \
                            os.getpgid(pid) == pid:
                        return pid
                except (OSError, ProcessLookupError):
                    continue
            return None

        return eventually(f"the process of pod {pod['metadata']['name']}", find, 60)

    def kill(self, job: str, pod_name: str, sig: int = signal.SIGKILL) -> str:
        """Signal the task's process (SIGKILL: as a lost node; SIGTERM: as an eviction or
        preemption asks it to stop); returns the uid of the pod it ran in."""
        pod = eventually(f"pod {pod_name} running", lambda: (
            p if (p := self.live_pods(job).get(pod_name)) and
            p.get("status", {}).get("phase") == "Running" else None), TIMEOUT)
        self.signal(pod, sig)
        return pod["metadata"]["uid"]

    def signal(self, pod: dict, sig: int) -> None:
        os.kill(self.pid(pod), sig)

    def replace_operator(self, seen: TaskPods) -> dict:
        """Delete the operator's pod mid-run; the Deployment's next pod, once Running.
        ``seen`` keeps counting the job's pods meanwhile."""
        (operator,) = self.pods(OPERATOR_LABEL)
        self.cluster.kubectl("delete", "pod", operator["metadata"]["name"], "-n", self.ns,
                             "--wait=false")

        def replaced() -> dict | None:
            seen()
            pods = [p for p in self.pods(OPERATOR_LABEL)
                    if p["metadata"]["uid"] != operator["metadata"]["uid"]]
            return pods[0] if pods and pods[0]["status"].get("phase") == "Running" else None

        new = eventually("the Deployment to replace the operator pod", replaced, TIMEOUT, 0.3)
        assert new["metadata"]["name"] != operator["metadata"]["name"]
        return new

    def step(self, name: str) -> int:
        """The job's global step, as the operator read it from the chief."""
        status = (self.job(name) or {}).get("status") or {}
        return int((status.get("progress") or {}).get("step") or 0)


class TaskPods:
    """A job's pods, counted at every call (pass it as ``Journey.phase``'s ``each``): the
    most pods seen at once for each task, and every pod uid seen, by pod name."""

    def __init__(self, journey: Journey, job: str) -> None:
        self.journey, self.job = journey, job
        self.most: Counter[tuple[str, str]] = Counter()
        self.ever: dict[str, set[str]] = {}

    def __call__(self, _status: dict | None = None) -> None:
        pods = self.journey.pods(f"{LABEL_JOB}={self.job}")
        now = Counter((p["metadata"]["labels"][LABEL_ROLE], p["metadata"]["labels"][LABEL_INDEX])
                      for p in pods)
        for task, n in now.items():
            self.most[task] = max(self.most[task], n)
        for p in pods:
            self.ever.setdefault(p["metadata"]["name"], set()).add(p["metadata"]["uid"])


def uids(pods: dict[str, dict]) -> dict[str, str]:
    return {n: p["metadata"]["uid"] for n, p in pods.items()}


def condition(tj: dict, type: str) -> dict | None:
    return next((c for c in tj["status"].get("conditions") or () if c["type"] == type), None)


def accuracy(log: str) -> float:
    line = next(ln for ln in reversed(log.splitlines()) if ln.startswith("test_accuracy: "))
    return float(line.split()[1])


def tls_secret(journey: Journey, name: str) -> dict[str, bytes]:
    """The job's certificates, as the operator wrote them (``<job>-tls``)."""
    secret = journey.core.read_namespaced_secret(f"{name}-tls", journey.ns)
    assert secret.metadata.owner_references[0].kind == "TrainingJob"
    return {k: base64.b64decode(v) for k, v in secret.data.items()}


def stand_in_values() -> dict:
    """The chart's values for a release whose operator runs on the node stand-in, in
    namespace scope."""
    return {
        "rbac": {"scope": "namespace"},
        # Every pod shares this host's ports: the operator's listeners take free ones.
        "liveness": {"port": free_port()},
        "extraEnv": [{"name": "FLOWMILL_METRICS_HOST", "value": "127.0.0.1"},
                     {"name": "FLOWMILL_METRICS_PORT", "value": "0"},
                     # Read the chief's progress often: these runs are short.
                     {"name": "FLOWMILL_PROGRESS_SECONDS", "value": "1"}],
    }


@contextmanager
def installed(cluster: Cluster, ns: str, tmp: Path, values: dict) -> Iterator[None]:
    """A namespace with the job's S3 Secret and the chart installed with ``values``
    (namespace scope); both gone afterwards. ``values`` may name the S3 endpoint the
    tasks dial (``s3_endpoint``, taken out before helm sees them)."""
    endpoint = values.pop("s3_endpoint", cluster.s3.endpoint)
    labels = values.pop("namespace_labels", {})
    cluster.kubectl("create", "namespace", ns)
    try:
        if labels:
            cluster.kubectl("label", "namespace", ns,
                            *(f"{k}={v}" for k, v in labels.items()))
        eventually("the default ServiceAccount", lambda: cluster.get(
            "serviceaccount", "default", ns), 60, interval=0.2)
        secret = yaml.safe_load(EXAMPLE.read_text())["spec"]["checkpoint"]["secretRef"]
        s3 = cluster.s3
        cluster.kubectl("create", "secret", "generic", secret["name"], "-n", ns,
                        f"--from-literal=AWS_ACCESS_KEY_ID={s3.access_key}",
                        f"--from-literal=AWS_SECRET_ACCESS_KEY={s3.secret_key}",
                        f"--from-literal={secret['endpointKey']}={endpoint}",
                        f"--from-literal={secret['regionKey']}={s3.region}")
        (tmp / "values.json").write_text(json.dumps(values))
        cluster.helm("install", RELEASE, str(CHART), "-n", ns, "-f",
                     str(tmp / "values.json"), "--wait", "--timeout", "180s")
        yield
    finally:
        cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "120s",
                     check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
