"""A real Kubernetes control plane and S3 store on loopback, for end-to-end tests.

Runs etcd, kube-apiserver, kube-controller-manager (the default controllers: Deployments,
ReplicaSets, the garbage collector, namespaces, service accounts and their tokens),
SeaweedFS's S3 gateway, and the node stand-in of ``e2e.node``, which runs pods as host
processes (a real kubelet node, ``e2e.realnode``, is started only by the tests that ask
for it). Everything binds to 127.0.0.1 on free ports; state lives in a temporary directory
removed on ``stop()``; logs are kept under ``log_dir``.

    with Cluster() as c:
        c.kubectl("get", "nodes")
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import config

from . import audit
from .kubeconfig import write_kubeconfig
from .pki import Pki, make_pki
from .procs import Proc, free_port, orphaned, stop_all, wait_for
from .realnode import sweep_stale_nodes
from .s3 import S3Info, bucket_exists, create_bucket, write_identities
from .versions import Binaries, binaries, cache_dir, read_versions

REPO = Path(__file__).resolve().parent.parent
SERVICE_CIDR = "10.0.0.0/24"
NODE_PREFIX = "flowmill-node"  # the stand-in's nodes: flowmill-node-0, -1, ...
NODES = 3
# Gang scheduling as this release has it (alpha): PodGroup objects, pods naming theirs.
GANG_GATES = "GenericWorkload=true,GangScheduling=true"
KEEP_LOG_RUNS = 10
STATE_PREFIX = "flowmill-e2e-"


def sweep_stale_state() -> None:
    """Remove state left by sessions killed outright (SIGKILL runs no clean-up).

    Their processes are gone already (parent-death signal); only files remain: the
    state folder, and the files it lists in ``outside-files.txt``.
    """
    for d in orphaned(STATE_PREFIX):
        try:
            for line in (d / "outside-files.txt").read_text().split():
                Path(line).unlink(missing_ok=True)
        except OSError:
            pass
        shutil.rmtree(d, ignore_errors=True)
    # A real node (e2e.realnode) also leaves processes, cgroups and network devices.
    sweep_stale_nodes()


def _new_log_dir() -> Path:
    """``$FLOWMILL_E2E_LOG_DIR`` or a fresh run folder under the cache, pruning old runs."""
    if os.environ.get("FLOWMILL_E2E_LOG_DIR"):
        d = Path(os.environ["FLOWMILL_E2E_LOG_DIR"])
        d.mkdir(parents=True, exist_ok=True)
        return d
    root = cache_dir() / "e2e-logs"
    root.mkdir(parents=True, exist_ok=True)
    runs = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    for old in runs[: max(0, len(runs) - KEEP_LOG_RUNS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    d = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    d.mkdir()
    latest = root / "latest"
    latest.unlink(missing_ok=True)
    latest.symlink_to(d.name)
    return d


class CommandError(subprocess.CalledProcessError):
    """A failed kubectl/helm run; its message carries the tool's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr}"


class Cluster:
    """Start/stop the control plane; helpers for kubectl, helm and pod logs."""

    service_cidr = SERVICE_CIDR

    def __init__(self, bins: Binaries | None = None, bucket: str = "flowmill-e2e",
                 audit_users: tuple[str, ...] = (), node_pods: int | None = None) -> None:
        """``audit_users``: the apiserver logs these users' requests (Metadata level, JSON
        lines) to ``audit_log`` (see ``e2e.audit``); none by default. ``node_pods``: each
        stand-in node's pods capacity (the stand-in's default, a kubelet's 110, if None)."""
        self.bins = bins or binaries()
        self.versions = read_versions()
        sweep_stale_state()
        self.state = Path(tempfile.mkdtemp(prefix=STATE_PREFIX))
        (self.state / "owner.pid").write_text(str(os.getpid()))
        self.log_dir = _new_log_dir()
        self.pki: Pki | None = None
        self.procs: list[Proc] = []
        self.kubeconfig = self.state / "kubeconfig"
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.s3 = S3Info(
            endpoint=f"http://127.0.0.1:{free_port()}",
            access_key="flowmill" + secrets.token_hex(4),
            secret_key=secrets.token_hex(16),
            bucket=bucket,
        )
        self.node_names = [f"{NODE_PREFIX}-{i}" for i in range(NODES)]
        self.audit_users = tuple(audit_users)
        self.audit_log: Path | None = self.state / "audit.log" if self.audit_users else None
        self.node_pods = node_pods
        self.start_seconds: float | None = None
        self._weed_grpc: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> Cluster:
        """Bring every component up and wait until each answers; stop all on failure."""
        missing = self.bins.missing()
        if missing:
            raise FileNotFoundError(f"binaries missing (run e2e/build.sh): {missing}")
        t0 = time.monotonic()
        try:
            self.pki = make_pki(self.state / "pki", self.node_names)
            etcd_url = self._start_etcd()
            weed = self._start_weed()
            etcd = self.procs[0]
            wait_for("etcd /health", lambda: _http_ok(f"{etcd_url}/health"), timeout, [etcd])
            api = self._start_apiserver(etcd_url)
            wait_for("kube-apiserver /readyz", self._apiserver_ready, timeout, [etcd, api])
            self._write_kubeconfigs()
            kcm = self._start_controller_manager()
            scheduler = self._start_scheduler()
            node = self._start_node()
            wait_for("the default ServiceAccount (controller-manager working)",
                     lambda: self._kubectl_ok("get", "serviceaccount", "default"),
                     timeout, [api, kcm])
            wait_for(f"nodes {', '.join(self.node_names)} Ready", self._nodes_ready, timeout,
                     [api, node])
            wait_for("kube-scheduler /healthz", self._scheduler_ready, timeout,
                     [api, scheduler])
            wait_for("SeaweedFS S3 gateway", self._s3_try_create_bucket, timeout, [weed])
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        (self.log_dir / "start-seconds.txt").write_text(f"{self.start_seconds:.1f}\n")
        return self

    def stop(self) -> None:
        """Stop every process and remove state.

        In waves: the node stand-in first (its pods die with it), then the clients of the
        apiserver, then the apiserver, then etcd (an apiserver without etcd hangs on
        SIGTERM until killed).
        """
        waves = [("node",), ("kube-scheduler", "kube-controller-manager", "seaweedfs"),
                 ("kube-apiserver",)]
        for names in waves:
            stop_all([p for p in self.procs if p.name in names])
        stop_all(self.procs)
        self.procs.clear()
        for path in self._weed_sockets():
            path.unlink(missing_ok=True)
        shutil.rmtree(self.state, ignore_errors=True)

    def _weed_sockets(self) -> list[Path]:
        """SeaweedFS also listens on /tmp/seaweedfs-<kind>-grpc-<port>.sock (fixed folder)."""
        return [Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
                for kind, port in self._weed_grpc.items()]

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- components --------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str | os.PathLike[str]],
               env: dict[str, str] | None = None, cwd: Path | None = None,
               grace: float = 10.0) -> Proc:
        p = Proc(name, argv, self.log_dir / f"{name}.log", env=env, cwd=cwd, grace=grace)
        self.procs.append(p)
        return p

    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            self.bins.etcd, "--name=e2e", f"--data-dir={self.state / 'etcd'}",
            f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=e2e=http://127.0.0.1:{peer}",
            # Test data is thrown away: skipping fsync makes the apiserver several times faster.
            "--unsafe-no-fsync", "--log-level=warn",
        ])
        return url

    def _audit_flags(self) -> list[str]:
        if self.audit_log is None:
            return []
        policy = self.state / "audit-policy.json"
        policy.write_text(json.dumps(audit.policy(self.audit_users)))
        # One file for the whole run: the log backend rotates at --audit-log-maxsize MB,
        # and 0 means its default of 100, not "never".
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json", "--audit-log-maxsize=1000000",
                "--audit-log-maxbackup=0", "--audit-log-mode=blocking"]

    def _start_apiserver(self, etcd_url: str) -> Proc:
        pki = self._pki
        return self._spawn("kube-apiserver", [
            self.bins.kube_apiserver,
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}",
            f"--cert-dir={self.state / 'apiserver-certs'}",
            f"--tls-cert-file={pki.crt('apiserver')}",
            f"--tls-private-key-file={pki.key('apiserver')}",
            f"--client-ca-file={pki.ca_crt}",
            f"--requestheader-client-ca-file={pki.ca_crt}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.crt('front-proxy-client')}",
            f"--proxy-client-key-file={pki.key('front-proxy-client')}",
            # Node: what a real kubelet (e2e.realnode, identity system:node:<name>) may
            # read and write, scoped to its own Node and pods; RBAC for everyone else.
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            # The release's gang scheduling (alpha): PodGroups and pods' schedulingGroup.
            f"--feature-gates={GANG_GATES}", "--runtime-config=scheduling.k8s.io/v1alpha2=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            # `kubectl logs` is proxied to the node stand-in's log endpoint.
            f"--kubelet-client-certificate={pki.crt('apiserver-kubelet-client')}",
            f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
            f"--kubelet-certificate-authority={pki.ca_crt}",
            "--kubelet-preferred-address-types=InternalIP",
            # Loopback may not appear in Endpoints, so the apiserver cannot publish itself
            # as the `kubernetes` Service; in-pod clients get a kubeconfig instead.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false", "--v=1",
            *self._audit_flags(),
        ])

    def _start_controller_manager(self) -> Proc:
        pki = self._pki
        kc = self.state / "controller-manager.kubeconfig"
        return self._spawn("kube-controller-manager", [
            self.bins.kube_controller_manager,
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            f"--cert-dir={self.state / 'kcm-certs'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}",
            f"--cluster-signing-cert-file={pki.ca_crt}",
            f"--cluster-signing-key-file={pki.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*", f"--feature-gates={GANG_GATES}", "--v=1",
        ])

    def _start_scheduler(self) -> Proc:
        """The release's kube-scheduler, default profile: it places every pod that names
        no node (the stand-in's nodes and a real node alike); identity
        ``system:kube-scheduler``, which the default RBAC policy binds to its roles."""
        pki = self._pki
        kc = self.state / "scheduler.kubeconfig"
        write_kubeconfig(kc, self.server, pki.ca_crt, cert=pki.crt("scheduler"),
                         key=pki.key("scheduler"), user="system:kube-scheduler")
        config = self.state / "scheduler.json"
        config.write_text(json.dumps({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(kc)},
            "leaderElection": {"leaderElect": False},
        }))
        self._scheduler_port = free_port()
        return self._spawn("kube-scheduler", [
            self.bins.kube_scheduler, f"--config={config}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={self._scheduler_port}",
            f"--feature-gates={GANG_GATES}",
            f"--cert-dir={self.state / 'scheduler-certs'}", "--v=1",
        ])

    def _start_weed(self) -> Proc:
        d = self.state / "seaweedfs"
        glog = self.state / "seaweedfs-glog"  # else its glog files land in /tmp
        d.mkdir()
        glog.mkdir()
        identities = self.state / "s3-identities.json"
        write_identities(identities, self.s3.access_key, self.s3.secret_key)
        s3_port = int(self.s3.endpoint.rsplit(":", 1)[1])
        ports = {k: free_port() for k in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port.grpc")}
        self._weed_grpc = {k.split(".")[0]: v for k, v in ports.items() if k.endswith("grpc")}
        (self.state / "outside-files.txt").write_text("".join(
            f"{p}\n" for p in self._weed_sockets()))
        return self._spawn("seaweedfs", [
            self.bins.weed, f"-logdir={glog}", "server", f"-dir={d}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{k}={v}" for k, v in ports.items()),
            "-filer", f"-filer.localSocket={d / 'filer.sock'}",
            "-s3", f"-s3.port={s3_port}", f"-s3.config={identities}",
            f"-s3.localSocket={d / 's3.sock'}",
            # Extra listeners on fixed default ports would clash between sessions.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64", "-volume.max=16", "-volume.preStopSeconds=0",
        ], grace=2.0)  # it lingers after SIGTERM; its data is thrown away anyway

    def _start_node(self) -> Proc:
        pki = self._pki
        # The repository root goes at the END of sys.path: at the front, its `operator/`
        # folder would shadow the standard library's `operator` module.
        boot = (f"import runpy, sys; sys.path.append({str(REPO)!r}); "
                "runpy.run_module('e2e.node', run_name='__main__')")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return self._spawn("node", [
            sys.executable, "-c", boot,
            f"--kubeconfig={self.state / 'node.kubeconfig'}",
            f"--name={NODE_PREFIX}", f"--nodes={len(self.node_names)}",
            f"--state-dir={self.state / 'node'}",
            f"--log-dir={self.log_dir / 'pods'}",
            f"--server={self.server}", f"--ca={pki.ca_crt}",
            f"--serving-cert={pki.crt('node')}", f"--serving-key={pki.key('node')}",
            f"--kubelet-version={self.versions['KUBERNETES_VERSION']}",
            *([f"--pods={self.node_pods}"] if self.node_pods else []),
        ], env=env, cwd=self.state)

    # -- readiness ---------------------------------------------------------------------

    def _apiserver_ready(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self._pki.ca_crt))
        ctx.load_cert_chain(self._pki.crt("admin"), self._pki.key("admin"))
        with urllib.request.urlopen(f"{self.server}/readyz", context=ctx, timeout=5) as r:
            return r.status == 200

    def _nodes_ready(self) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return False
        ready = {n["metadata"]["name"] for n in json.loads(out.stdout)["items"]
                 if any(c["type"] == "Ready" and c["status"] == "True"
                        for c in n["status"].get("conditions", []))}
        return set(self.node_names) <= ready

    def _scheduler_ready(self) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its own self-signed
        url = f"https://127.0.0.1:{self._scheduler_port}/healthz"
        with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
            return r.status == 200

    def _s3_try_create_bucket(self) -> bool:
        create_bucket(self.s3)
        return bucket_exists(self.s3)

    def _kubectl_ok(self, *args: str) -> bool:
        return self.kubectl(*args, check=False).returncode == 0

    # -- configuration files -----------------------------------------------------------

    @property
    def _pki(self) -> Pki:
        assert self.pki is not None, "cluster not started"
        return self.pki

    def _write_kubeconfigs(self) -> None:
        pki = self._pki
        write_kubeconfig(self.kubeconfig, self.server, pki.ca_crt,
                         cert=pki.crt("admin"), key=pki.key("admin"), user="admin")
        write_kubeconfig(self.state / "controller-manager.kubeconfig", self.server, pki.ca_crt,
                         cert=pki.crt("controller-manager"), key=pki.key("controller-manager"),
                         user="kube-controller-manager")
        # The stand-in acts with admin rights: it also binds pods and mints pod tokens.
        write_kubeconfig(self.state / "node.kubeconfig", self.server, pki.ca_crt,
                         cert=pki.crt("admin"), key=pki.key("admin"), user="node")

    # -- helpers for tests -------------------------------------------------------------

    def tool_env(self) -> dict[str, str]:
        """Environment for kubectl/helm: this cluster, and no writes to the real $HOME."""
        home = self.state / "home"
        home.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update(KUBECONFIG=str(self.kubeconfig), HOME=str(home),
                   HELM_CACHE_HOME=str(home / ".cache/helm"),
                   HELM_CONFIG_HOME=str(home / ".config/helm"),
                   HELM_DATA_HOME=str(home / ".local/share/helm"))
        return env

    def _run(self, exe: Path, args: tuple[str, ...], check: bool, input: str | None,
             timeout: float) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([str(exe), *args], env=self.tool_env(), input=input, text=True,
                             capture_output=True, timeout=timeout)
        if check and out.returncode != 0:
            raise CommandError(out.returncode, [exe.name, *args], out.stdout, out.stderr)
        return out

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises on failure unless ``check=False``."""
        return self._run(self.bins.kubectl, args, check, input, timeout)

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster; raises on failure unless ``check=False``."""
        return self._run(self.bins.helm, args, check, input, timeout)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        """The object as a dict, or None if it does not exist."""
        ns = ["-n", namespace] if namespace else []
        out = self.kubectl("get", kind, name, *ns, "-o", "json", "--ignore-not-found",
                           check=False)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl get {kind} {name}: {out.stderr}")
        return json.loads(out.stdout) if out.stdout.strip() else None

    def wait_pod(self, namespace: str, name: str, phases: tuple[str, ...] = ("Succeeded",),
                 timeout: float = 120) -> dict:
        """Poll until the pod is in one of ``phases``; return it (fail with its state)."""
        deadline = time.monotonic() + timeout
        pod = None
        while time.monotonic() < deadline:
            pod = self.get("pod", name, namespace)
            if pod and pod.get("status", {}).get("phase") in phases:
                return pod
            time.sleep(0.5)
        state = json.dumps((pod or {}).get("status"), indent=1)
        raise TimeoutError(f"pod {namespace}/{name} not in {phases} after {timeout}s: {state}")

    def api(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this cluster (admin)."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def pod_log_path(self, namespace: str, name: str, container: str | None = None,
                     restart: int | None = None) -> Path:
        """Log file of a pod's container (newest pod of that name; latest run by default)."""
        pods = self.log_dir / "pods"
        dirs = sorted(pods.glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime)
        if not dirs:
            raise FileNotFoundError(f"no log folder for pod {namespace}/{name} under {pods}")
        cdirs = [d for d in dirs[-1].iterdir() if d.is_dir()]
        cdir = next((d for d in cdirs if d.name == container), None) if container else (
            cdirs[0] if len(cdirs) == 1 else None)
        if cdir is None:
            raise FileNotFoundError(f"pick a container of {namespace}/{name}: "
                                    f"{sorted(d.name for d in cdirs)}")
        runs = sorted(cdir.glob("*.log"), key=lambda p: int(p.stem))
        if restart is not None:
            return cdir / f"{restart}.log"
        return runs[-1]

    def pod_log(self, namespace: str, name: str, container: str | None = None,
                restart: int | None = None) -> str:
        """Output (stdout and stderr) of a pod's container, like ``kubectl logs``."""
        return self.pod_log_path(namespace, name, container, restart).read_text(errors="replace")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200
