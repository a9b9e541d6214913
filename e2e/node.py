"""A node stand-in for end-to-end tests: it plays the kubelet with host processes.

TEST-ONLY. Most e2e pods run here, as host processes, with no images to build; the
tests that need real containers use the real node of ``e2e.realnode``. The stand-in
registers several Nodes (``--nodes``, each in a zone of its own, with CPU, memory, pods and
``nvidia.com/gpu`` capacity), runs the pods the cluster's kube-scheduler binds to them,
each container's ``command`` + ``args`` as a local process group with the pod's environment,
and reports pod status through ``pods/status`` the way a kubelet does. Images, volumes,
probes, resource limits and network isolation are NOT emulated: every pod shares the host
file system, and each gets its own loopback address (127.N.x.y) as ``status.podIP``. The
one exception is ``secret`` volumes: their files are written under the pod's directory,
and env values that name a mount path are pointed there.

In-pod API access: the pod's ServiceAccount token, minted with the TokenRequest API and
bound to the pod, is written into a kubeconfig exposed as ``$KUBECONFIG``, so in-pod
clients are subject to RBAC like real pods. Service names resolve through
``pod_python/sitecustomize.py`` (Python processes only; see that file).

Run: ``python -m e2e.node --kubeconfig ... --name ... --state-dir ... --log-dir ...``
(``e2e.cluster`` does this).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from .containers import Container, PodRuntime, now_iso
from .kubeconfig import write_kubeconfig
from .logserver import serve_logs
from .podnet import IpPool, name_table, search_list, write_table
from .podspec import (
    MissingRef,
    Obj,
    argv,
    container_env,
    pod_requests,
    remount,
    secret_files,
)

log = logging.getLogger("flowmill.node")
POD_PYTHON = Path(__file__).resolve().parent / "pod_python"
MERGE = "application/merge-patch+json"
LEASE_SECONDS = 40
TOKEN_SECONDS = 24 * 3600
API_THREADS = 4  # status writes and token requests in flight at once
REQUEST_TIMEOUT = 30  # seconds, for the requests made off the main loop


def _json(resp: Any) -> Obj:
    return json.loads(resp.data)


def detect_gpus() -> int:
    """Number of NVIDIA GPUs, per ``nvidia-smi -L`` (0 when absent)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


class NodeStandIn:
    """Watches pods and services; runs the pods bound to this node as processes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.names: list[str] = [f"{args.name}-{i}" for i in range(args.nodes)]
        self.name = self.names[0]  # the one that hands out real GPUs, if there are any
        config.load_kube_config(config_file=args.kubeconfig)
        self.core = client.CoreV1Api()
        self.coord = client.CoordinationV1Api()
        self.state = Path(args.state_dir)
        self.log_root = Path(args.log_dir)
        self.state.mkdir(parents=True, exist_ok=True)
        self.log_root.mkdir(parents=True, exist_ok=True)
        self.names_file = self.state / "names.json"
        write_table(self.names_file, {})
        self.events: queue.Queue[tuple[str, str, Any]] = queue.Queue()
        self.pods: dict[str, Obj] = {}  # uid -> latest pod object (all namespaces)
        self.services: dict[str, Obj] = {}  # uid -> service
        self.runtimes: dict[str, PodRuntime] = {}  # uid -> pods running here
        self.reported: dict[str, str] = {}  # uid -> last status written or queued (JSON)
        # What the main loop must look at: pods whose object changed since it last did,
        # and runtimes whose status may differ from the one last written.
        self.dirty: set[str] = set()
        self.unreported: set[str] = set()
        # Status writes go out from a few threads: every status of a pod, in order, one
        # write per pod in flight at a time, the pods side by side; tokens are minted
        # there too, from the pod's admission on.
        self.api_pool = ThreadPoolExecutor(API_THREADS, thread_name_prefix="api")
        self.status_cond = threading.Condition()
        self.outbox: dict[str, list[tuple[str, str, Obj, str]]] = {}  # uid -> writes due
        self.sending: set[str] = set()  # uids with a writer at work
        self.tokens: dict[str, Future[str]] = {}  # uid -> its token, being minted
        self.last_sweep = 0.0
        self.last_table: dict[str, list[str]] | None = None
        self.deleted: set[str] = set()  # uids whose final delete was sent (finalizers may stay)
        self.ips = IpPool()
        self.gpus = detect_gpus()
        mem_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
        base = {
            "cpu": args.cpu or str(os.cpu_count() or 1),
            "memory": args.memory or f"{mem_mib}Mi",
            "pods": str(args.pods), "ephemeral-storage": "100Gi",
        }
        # nvidia.com/gpu: this host's GPUs on the first node (handed to pods as
        # CUDA_VISIBLE_DEVICES); without any, each node advertises --gpus that no device
        # stands behind, as a device plugin's count would, for scheduling tests.
        self.capacity = {
            name: {**base, "nvidia.com/gpu": str(
                (self.gpus if i == 0 else 0) if self.gpus else args.gpus)}
            for i, name in enumerate(self.names)}
        self.stopping = threading.Event()
        self.names_dirty = True

    # -- node registration and heartbeats -------------------------------------------------

    def labels(self, i: int) -> dict[str, str]:
        name = self.names[i]
        return {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "flowmill.dev/node-stand-in": "true",
                "topology.kubernetes.io/region": "e2e",
                "topology.kubernetes.io/zone": f"e2e-{'abcdefghij'[i % 10]}"}

    def register(self, log_port: int) -> None:
        self.log_port = log_port
        for i, name in enumerate(self.names):
            labels = self.labels(i)
            node = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "status": self._node_status(name),
            }
            try:
                self.core.create_node(node)
            except ApiException as err:
                if err.status != 409:
                    raise
                self.core.patch_node(name, {"metadata": {"labels": labels}},
                                     _content_type=MERGE)
            self.post_status(name)

    def post_status(self, name: str) -> None:
        self.core.patch_node_status(name, {"status": self._node_status(name)},
                                    _content_type=MERGE)

    def _node_status(self, name: str) -> Obj:
        now = now_iso()
        return {
            "capacity": self.capacity[name], "allocatable": self.capacity[name],
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "flowmill e2e node stand-in is posting ready status",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.log_port}},
            "nodeInfo": {
                "kubeletVersion": self.args.kubelet_version, "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64",
                "containerRuntimeVersion": "flowmill-processes://1", "osImage": "host",
                "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "",
                "bootID": "",
            },
        }

    def renew_leases(self) -> None:
        """Node heartbeats: the node-lifecycle controller marks nodes without them NotReady."""
        for name in self.names:
            body = {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS,
                         "renewTime": dt_micro()},
            }
            try:
                self.coord.patch_namespaced_lease(name, "kube-node-lease", body,
                                                  _content_type=MERGE)
            except ApiException as err:
                if err.status != 404:
                    raise
                self.coord.create_namespaced_lease("kube-node-lease", body)

    # -- watches --------------------------------------------------------------------------

    def _watch(self, kind: str, list_fn: Any) -> None:
        """List then watch ``kind`` forever, feeding the main loop; relist on any error."""
        while not self.stopping.is_set():
            try:
                listing = _json(list_fn(_preload_content=False))
                self.events.put(("SYNC", kind, listing["items"]))
                rv = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    w = watch.Watch()
                    for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=60,
                                       deserialize=False, allow_watch_bookmarks=True):
                        obj = ev["object"]
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self.events.put((ev["type"], kind, obj))
            except Exception as err:  # expired resourceVersion, apiserver restart, ...
                if not self.stopping.is_set():
                    log.info("%s watch restarting: %s", kind, err)
                    time.sleep(1)

    def _on_event(self, etype: str, kind: str, obj: Any) -> None:
        store = self.pods if kind == "pod" else self.services
        if etype == "SYNC":
            store.clear()
            store.update({o["metadata"]["uid"]: o for o in obj})
            if kind == "pod":
                for uid in list(self.runtimes):
                    if uid not in self.pods:
                        self._forget(uid)
                self.deleted &= set(self.pods)
                self.dirty = set(self.pods)
        elif etype == "DELETED":
            store.pop(obj["metadata"]["uid"], None)
            if kind == "pod":
                self._forget(obj["metadata"]["uid"])
                self.deleted.discard(obj["metadata"]["uid"])
                self.dirty.discard(obj["metadata"]["uid"])
        else:
            store[obj["metadata"]["uid"]] = obj
            if kind == "pod":
                self.dirty.add(obj["metadata"]["uid"])
        self.names_dirty = True

    # -- pods on this node ----------------------------------------------------------------

    def sync_pods(self, sweep_every: float = 0.1) -> None:
        """Admit or begin terminating the pods whose object changed, then advance the pods
        running here: those pods at once, all of them every ``sweep_every`` seconds (exits,
        restart back-offs and kill deadlines are noticed by polling). A status is written
        only when the runtime changed or its last write did not go through, so a loop
        over a thousand quiet pods makes no request and renders no status; and it is
        written by the status writers, so the loop waits on no request but a token's."""
        looked = []  # admitted first, all of them, so their tokens are minted side by side
        for uid in list(self.dirty):
            pod = self.pods.get(uid)
            if pod is not None and pod["spec"].get("nodeName") in self.capacity \
                    and self._look(uid, pod):
                looked.append(uid)
            self.dirty.discard(uid)
        for uid in looked:
            if (rt := self.runtimes.get(uid)) is not None:
                self._step(uid, rt)
        now = time.monotonic()
        if now - self.last_sweep >= sweep_every:
            self.last_sweep = now
            for uid, rt in list(self.runtimes.items()):
                if uid in self.runtimes:  # not forgotten meanwhile
                    self._step(uid, rt)

    def _look(self, uid: str, pod: Obj) -> bool:
        """Admit the pod or note its deletion; True if it runs here (to be stepped)."""
        rt = self.runtimes.get(uid)
        if rt is None:
            if pod["metadata"].get("deletionTimestamp"):
                if uid not in self.deleted:
                    self._delete_now(pod)
                return False
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return False  # finished before this stand-in started
            rt = self._admit(pod)
        rt.pod = pod
        if pod["metadata"].get("deletionTimestamp") and rt.kill_at is None:
            grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
            rt.begin_termination(float(grace))
            self.unreported.add(uid)
        return True

    def _step(self, uid: str, rt: PodRuntime) -> None:
        if rt.advance(lambda c, rt=rt: self._launch(rt, c)):
            self.unreported.add(uid)
        if rt.kill_at is not None and (rt.overdue() or rt.terminal()):
            rt.kill()
            self._report(rt, wait=True)  # the final status, before the object goes
            self._delete_now(rt.pod)
            self._forget(uid)
            return
        if uid in self.unreported:
            self._report(rt)

    def _admit(self, pod: Obj) -> PodRuntime:
        uid = pod["metadata"]["uid"]
        rt = PodRuntime(pod, self.ips.allocate(), self.state / "pods" / uid, self.log_root,
                        (self.args.backoff_base, self.args.backoff_max))
        rt.work_dir.mkdir(parents=True, exist_ok=True)
        want = int(pod_requests(pod).get("nvidia.com/gpu", 0))
        if want and self.gpus and pod["spec"]["nodeName"] == self.name:
            taken = {g for r in self.runtimes.values() for g in r.gpus}
            rt.gpus = [g for g in range(self.gpus) if g not in taken][:want]
        self.runtimes[uid] = rt
        if pod["spec"].get("automountServiceAccountToken") is not False:
            self.tokens[uid] = self.api_pool.submit(self._mint_token, pod)
        self._report(rt)  # podIP first: env may refer to status.podIP
        pod.setdefault("status", {}).update(podIP=rt.ip, podIPs=[{"ip": rt.ip}],
                                            hostIP="127.0.0.1")
        return rt

    def _lookup(self, kind: str, ns: str, name: str) -> dict[str, str] | None:
        try:
            if kind == "secret":
                obj = _json(self.core.read_namespaced_secret(name, ns, _preload_content=False))
                return {k: base64.b64decode(v).decode(errors="replace")
                        for k, v in (obj.get("data") or {}).items()}
            obj = _json(self.core.read_namespaced_config_map(name, ns, _preload_content=False))
            return dict(obj.get("data") or {})
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def _secret_volumes(self, rt: PodRuntime, c: Container) -> dict[str, str]:
        """Write the container's secret volumes under the pod's directory (files 0600);
        mount path -> the directory that stands in for it."""
        def lookup(ns: str, name: str) -> dict[str, bytes] | None:
            try:
                obj = _json(self.core.read_namespaced_secret(name, ns, _preload_content=False))
            except ApiException as err:
                if err.status == 404:
                    return None
                raise
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

        mounts = {}
        for i, (target, files) in enumerate(secret_files(rt.pod, c.spec, lookup).items()):
            where = rt.work_dir / "volumes" / c.name / str(i)
            where.mkdir(parents=True, exist_ok=True)
            for path, data in files.items():
                dest = where / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            mounts[target] = str(where)
        return mounts

    def _pod_kubeconfig(self, rt: PodRuntime) -> Path | None:
        """A kubeconfig with the pod's bound ServiceAccount token (TokenRequest API)."""
        spec, meta = rt.pod["spec"], rt.pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        path = rt.work_dir / "kubeconfig"
        if path.exists():
            return path
        sa = spec.get("serviceAccountName") or "default"
        pending = self.tokens.pop(meta["uid"], None)
        token = pending.result() if pending is not None else self._mint_token(rt.pod)
        write_kubeconfig(path, self.args.server, Path(self.args.ca), user=sa, token=token,
                         namespace=meta["namespace"])
        sa_dir = rt.work_dir / "serviceaccount"
        sa_dir.mkdir(exist_ok=True)
        (sa_dir / "token").write_text(token)
        (sa_dir / "namespace").write_text(meta["namespace"])
        shutil.copy(self.args.ca, sa_dir / "ca.crt")
        return path

    def _mint_token(self, pod: Obj) -> str:
        """A token for the pod's ServiceAccount, bound to the pod (TokenRequest API)."""
        spec, meta = pod["spec"], pod["metadata"]
        sa = spec.get("serviceAccountName") or "default"
        body = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=TOKEN_SECONDS,
            bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=meta["name"], uid=meta["uid"])))
        return _json(self.core.create_namespaced_service_account_token(
            sa, meta["namespace"], body, _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT))["status"]["token"]

    def _base_env(self, rt: PodRuntime) -> dict[str, str]:
        meta = rt.pod["metadata"]
        home = rt.work_dir / "home"
        tmp = rt.work_dir / "tmp"
        home.mkdir(exist_ok=True)
        tmp.mkdir(exist_ok=True)
        # The harness's Python (the project venv) comes first, so `python` means it.
        path = os.pathsep.join([str(Path(sys.executable).parent),
                                os.environ.get("PATH", "/usr/bin:/bin")])
        env = {
            "PATH": path, "HOME": str(home), "TMPDIR": str(tmp), "LANG": "C.UTF-8",
            "HOSTNAME": rt.pod["spec"].get("hostname") or meta["name"],
            "FLOWMILL_NAME_TABLE": str(self.names_file),
            "FLOWMILL_DNS_SEARCH": " ".join(search_list(meta["namespace"])),
        }
        if rt.gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"] = ",".join(
                map(str, rt.gpus))
        kubeconfig = self._pod_kubeconfig(rt)
        if kubeconfig:
            env["KUBECONFIG"] = str(kubeconfig)
        return env

    def _launch(self, rt: PodRuntime, c: Container) -> None:
        try:
            env = self._base_env(rt)
            env.update(container_env(rt.pod, c.spec, self._lookup))
            env = remount(env, self._secret_volumes(rt, c))
        except (MissingRef, ApiException) as err:
            c.waiting = ("CreateContainerConfigError", str(err))
            c.not_before = time.monotonic() + 2
            return
        # Pod PYTHONPATH entries keep working; the name-resolution hook goes first.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(POD_PYTHON),
                                                          env.get("PYTHONPATH")]))
        cwd = Path(c.spec["workingDir"]) if c.spec.get("workingDir") else rt.work_dir
        if not cwd.is_dir():
            c.waiting = ("CreateContainerError", f"workingDir {cwd} does not exist on the host")
            c.not_before = time.monotonic() + 2
            return
        c.start(argv(c.spec, env), env, cwd)
        log.info("started %s/%s[%s] restart=%d ip=%s", rt.namespace, rt.name, c.name,
                 c.restarts, rt.ip)
        self.names_dirty = True

    def _report(self, rt: PodRuntime, wait: bool = False) -> None:
        """Write pod status if it changed since the last write: queue it for the status
        writers (``wait``: and wait until it, and any write before it, went out)."""
        uid = rt.uid
        status = rt.status()
        key = json.dumps(status, sort_keys=True)
        with self.status_cond:
            self.unreported.discard(uid)
            if self.reported.get(uid) != key:
                self.reported[uid] = key
                self.outbox.setdefault(uid, []).append((rt.name, rt.namespace, status, key))
                if uid not in self.sending:
                    self.sending.add(uid)
                    self.api_pool.submit(self._send_status, uid)
            if wait:
                self.status_cond.wait_for(lambda: uid not in self.sending,
                                          timeout=REQUEST_TIMEOUT)

    def _send_status(self, uid: str) -> None:
        """A status writer: the pod's queued statuses in order, until none is left. The last
        one, if it did not go through (the pod not found yet, the API unreachable), is
        queued again by the main loop's next look at the pod; one the API rejects is
        logged, not retried."""
        while True:
            with self.status_cond:
                due = self.outbox.get(uid)
                if not due:
                    self.outbox.pop(uid, None)
                    self.sending.discard(uid)
                    self.status_cond.notify_all()
                    return
                name, namespace, status, key = due.pop(0)
            try:
                self.core.patch_namespaced_pod_status(
                    name, namespace, {"status": status}, _content_type=MERGE,
                    _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            except ApiException as err:
                if err.status == 404:
                    self._unsent(uid, key)
                else:
                    # Rejected (e.g. invalid): log once per distinct status, not every tick.
                    log.warning("status of %s/%s: %s %s", namespace, name, err.status,
                                err.body)
            except Exception as err:  # the API unreachable, a timeout, ...
                log.info("status of %s/%s: %s", namespace, name, err)
                self._unsent(uid, key)

    def _unsent(self, uid: str, key: str) -> None:
        with self.status_cond:
            if self.reported.get(uid) == key and not self.outbox.get(uid):
                del self.reported[uid]
                if uid in self.runtimes:
                    self.unreported.add(uid)

    def _delete_now(self, pod: Obj) -> None:
        """Finish a graceful deletion: remove the object (gracePeriodSeconds=0)."""
        meta = pod["metadata"]
        self.deleted.add(meta["uid"])
        body = client.V1DeleteOptions(grace_period_seconds=0,
                                      preconditions=client.V1Preconditions(uid=meta["uid"]))
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=body,
                                            _preload_content=False)
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("deleting %s/%s: %s", meta["namespace"], meta["name"], err.reason)

    def _forget(self, uid: str) -> None:
        rt = self.runtimes.pop(uid, None)
        with self.status_cond:
            self.reported.pop(uid, None)
            self.unreported.discard(uid)
            self.outbox.pop(uid, None)
        pending = self.tokens.pop(uid, None)
        if pending is not None:
            pending.cancel()
        if rt is not None:
            rt.kill()
            shutil.rmtree(rt.work_dir, ignore_errors=True)
            self.names_dirty = True

    # -- logs for `kubectl logs` ----------------------------------------------------------

    def resolve_log(self, ns: str, pod: str, container: str, previous: bool) -> Any:
        for rt in list(self.runtimes.values()):
            if rt.namespace == ns and rt.name == pod:
                for c in rt.containers:
                    if c.name == container:
                        if previous:
                            if not c.restarts:
                                return None
                            n = c.restarts - 1
                            return c.log_dir / f"{n}.log", lambda: False
                        return c.log_path, c.running
        # A finished pod no longer tracked: newest log folder of that name.
        dirs = sorted(self.log_root.glob(f"{ns}_{pod}_*/{container}"),
                      key=lambda p: p.stat().st_mtime)
        if not dirs:
            return None
        runs = sorted(dirs[-1].glob("*.log"), key=lambda p: int(p.stem))
        return (runs[-1], lambda: False) if runs else None

    # -- main loop ------------------------------------------------------------------------

    def run(self) -> None:
        port = serve_logs(self.resolve_log, Path(self.args.serving_cert),
                          Path(self.args.serving_key), Path(self.args.ca))
        self.register(port)
        self.renew_leases()
        for kind, fn in (("pod", self.core.list_pod_for_all_namespaces),
                         ("service", self.core.list_service_for_all_namespaces)):
            threading.Thread(target=self._watch, args=(kind, fn), name=f"watch-{kind}",
                             daemon=True).start()
        last_lease = last_status = time.monotonic()
        log.info("nodes registered: %s", self.capacity)
        while not self.stopping.is_set():
            try:
                self._on_event(*self.events.get(timeout=0.2))
                while True:
                    self._on_event(*self.events.get_nowait())
            except queue.Empty:
                pass
            try:
                self.sync_pods()
                if self.names_dirty:
                    self.names_dirty = False
                    table = name_table(self.services.values(), self.pods.values())
                    if table != self.last_table:  # most pod events change no name
                        write_table(self.names_file, table)
                        self.last_table = table
                now = time.monotonic()
                if now - last_lease > 10:
                    self.renew_leases()
                    last_lease = now
                if now - last_status > 60:
                    for name in self.names:
                        self.post_status(name)
                    last_status = now
            except Exception:
                log.exception("node loop")
                time.sleep(1)
        self.shutdown()

    def shutdown(self) -> None:
        """Stop every pod process (SIGTERM, then SIGKILL after a short grace)."""
        for rt in self.runtimes.values():
            rt.begin_termination(2.0)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(
                c.running() for rt in self.runtimes.values() for c in rt.containers):
            time.sleep(0.1)
        for rt in self.runtimes.values():
            rt.kill()
        self.api_pool.shutdown(wait=False, cancel_futures=True)


def dt_micro() -> str:
    """MicroTime, as Lease.spec.renewTime requires."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def main(argv_: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--name", default="flowmill-node", help="nodes are NAME-0, NAME-1, ...")
    ap.add_argument("--nodes", type=int, default=int(os.environ.get("FLOWMILL_NODES", "3")))
    ap.add_argument("--gpus", type=int, default=int(os.environ.get("FLOWMILL_NODE_GPUS", "2")),
                    help="nvidia.com/gpu per node when this host has no GPU (none behind it)")
    ap.add_argument("--state-dir", required=True, help="pod scratch dirs (removed per pod)")
    ap.add_argument("--log-dir", required=True, help="container logs (kept)")
    ap.add_argument("--server", required=True, help="apiserver URL for pod kubeconfigs")
    ap.add_argument("--ca", required=True, help="cluster CA certificate")
    ap.add_argument("--serving-cert", required=True)
    ap.add_argument("--serving-key", required=True)
    ap.add_argument("--kubelet-version", default="v0.0.0")
    ap.add_argument("--cpu", default=os.environ.get("FLOWMILL_NODE_CPU"))
    ap.add_argument("--memory", default=os.environ.get("FLOWMILL_NODE_MEMORY"))
    ap.add_argument("--pods", type=int, default=int(os.environ.get("FLOWMILL_NODE_PODS", "110")),
                    help="pods capacity per node (kubelet: 110)")
    ap.add_argument("--backoff-base", type=float, default=1.0,
                    help="first restart delay, seconds (kubelet: 10)")
    ap.add_argument("--backoff-max", type=float, default=20.0,
                    help="restart delay cap, seconds (kubelet: 300)")
    args = ap.parse_args(argv_)
    # Each pod's processes and log files hold descriptors while they start: as many as the
    # hard limit allows, for a thousand pods.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = NodeStandIn(args)
    signal.signal(signal.SIGTERM, lambda *_: node.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: node.stopping.set())
    node.run()


if __name__ == "__main__":
    main()
