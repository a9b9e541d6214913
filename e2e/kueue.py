"""Kueue (sigs.k8s.io/kueue) against the e2e control plane, for the tests that queue work.

Kueue is built like the control plane (``e2e/build.sh kueue``) and runs as a process on the
host, with the manifests it ships: its CRDs, its webhooks and its manager's ClusterRole.
Where a cluster runs it as a Deployment behind a Service, here:

* the apiserver calls its webhooks (admission, and the CRDs' conversion between v1beta1 and
  v1beta2) by URL, ``https://127.0.0.1:<port><path>``: a Service's endpoints cannot be
  loopback addresses. The serving certificate names 127.0.0.1 and comes from the cluster
  CA, which the configurations give as ``caBundle``;
* only the webhooks of Kueue's own API group are registered. The others are for its job
  integrations, not used here (Kueue answers them with no-ops), and would put Kueue in the
  way of every pod, Job or Deployment any test makes: refused whenever Kueue is not up
  (``failurePolicy: Fail``);
* it acts as ``flowmill:kueue`` (a client certificate), bound to the ClusterRole Kueue ships
  for its manager, not as an admin;
* with its internal certificate management off, Kueue reads a metrics certificate from the
  fixed path ``/etc/kueue/metrics/certs`` and exits if there is none, so it runs in user and
  mount namespaces of its own where ``/etc`` is an overlay (upper layer on a tmpfs) that
  adds that folder: the host's ``/etc`` is untouched, and no root is needed.

``stop()`` leaves the cluster as it was: the webhook configurations go first (so the
apiserver never calls a stopped webhook), then every object of Kueue's kinds (while Kueue
runs: it drops its finalizers from them), the process (its CRDs never vanish under it), the
CRDs, now empty, so that no conversion is asked of it, and the RBAC objects.

    with Kueue(cluster):
        cluster.kubectl("apply", "-f", "queues.yaml")
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from .kubeconfig import write_kubeconfig
from .pki import issue_client, issue_serving
from .procs import Proc, free_port, wait_for
from .versions import kueue_binary, kueue_manifests

if TYPE_CHECKING:
    from .cluster import Cluster

GROUP = "kueue.x-k8s.io"
USER = "flowmill:kueue"
PREFIX = "flowmill-e2e-kueue-"  # our names for the cluster-wide objects Kueue ships
ROLE = f"{PREFIX}manager"
CRD = "CustomResourceDefinition"
WEBHOOK_CONFIGURATIONS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
FIELD_MANAGER = "flowmill-e2e"
# Kueue needs at least one job integration (an empty list means the default, batch/job).
# batch/job watches Jobs, which no e2e test makes; its webhook is not registered.
FRAMEWORKS = ["batch/job"]
# Beta features, on by default, that need more of a cluster than this one.
FEATURE_GATES = {
    # An aggregated API server on a fixed port (8082, every address), which Kueue's
    # manifests register as an APIService.
    "VisibilityOnDemand": False,
    # Worker clusters, whose kubeconfigs it watches as Secrets in its own namespace.
    "MultiKueue": False,
    # Topology-aware scheduling: caches every pod and node of the cluster.
    "TopologyAwareScheduling": False,
}
# Run in the new namespaces by `unshare`: $1 an empty folder for the tmpfs, $2 the folder
# with tls.crt and tls.key, then Kueue's command line.
ETC_OVERLAY = """\
set -e
mount -t tmpfs flowmill-kueue "$1"
mkdir -p "$1/upper/kueue/metrics/certs" "$1/work"
cp "$2/tls.crt" "$2/tls.key" "$1/upper/kueue/metrics/certs/"
mount -t overlay flowmill-kueue -o "lowerdir=/etc,upperdir=$1/upper,workdir=$1/work" /etc
shift 2
exec "$@"
"""
# A ResourceFlavor and a v1beta1 ClusterQueue, created with --dry-run=server: they pass
# Kueue's conversion, defaulting and validating webhooks.
PROBE = {"apiVersion": "v1", "kind": "List", "items": [
    {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}},
    {"apiVersion": f"{GROUP}/v1beta1", "kind": "ClusterQueue", "metadata": {"name": "probe"},
     "spec": {"namespaceSelector": {}}},
]}
OBJECTS_GONE_TIMEOUT = 20.0

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the workloads CRD is 1.4 MB


def missing_requirements() -> list[str]:
    """What this host lacks to run Kueue (empty: it can)."""
    out = []
    if not os.access(kueue_binary(), os.X_OK):
        out.append(f"{kueue_binary()} (e2e/build.sh kueue)")
    if not kueue_manifests().is_dir():
        out.append(f"{kueue_manifests()} (e2e/build.sh kueue)")
    if shutil.which("unshare") is None:
        out.append("unshare (util-linux)")
    return out


def _load(path: Path) -> list[dict]:
    """The YAML documents of a file, or of every file in a folder."""
    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    return [d for f in files for d in yaml.load_all(f.read_text(), Loader=_Loader) if d]


def _own_group(webhook: dict) -> bool:
    return all(g == GROUP for rule in webhook["rules"] for g in rule["apiGroups"])


def _stub(obj: dict) -> dict:
    """What identifies ``obj`` to ``kubectl delete -f``."""
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "metadata": {"name": obj["metadata"]["name"]}}


class Kueue:
    """Start/stop Kueue against ``cluster``."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.state = cluster.state / "kueue"
        self.proc: Proc | None = None
        self.objects: list[dict] = []  # what start() applied, for stop()
        self.webhook_port = self.health_port = 0
        self.start_seconds: float | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> Kueue:
        """Apply Kueue's objects, start it, and wait until its webhooks answer."""
        missing = missing_requirements()
        if missing:
            raise RuntimeError(f"Kueue needs: {missing}")
        t0 = time.monotonic()
        self.state.mkdir()
        self.webhook_port, self.health_port = free_port(), free_port()
        try:
            certs, kubeconfig = self._credentials()
            self.objects = [*self._rbac(), *self._crds()]
            self._apply(self.objects)
            self.cluster.kubectl("wait", "--for=condition=Established", f"--timeout={timeout}s",
                                 *(f"crd/{o['metadata']['name']}" for o in self._of(CRD)))
            hooks = self._webhook_configurations()
            self.objects += hooks
            self._apply(hooks)
            self.proc = self._spawn(certs, kubeconfig)
            wait_for("Kueue /readyz", self._ready, timeout, [self.proc])
            wait_for("Kueue's webhooks answering", self._webhooks_answer, timeout, [self.proc])
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        (self.cluster.log_dir / "kueue-start-seconds.txt").write_text(
            f"{self.start_seconds:.1f}\n")
        return self

    def stop(self) -> None:
        """Remove everything start() made and stop Kueue (see the module docstring)."""
        try:
            self._delete(self._of(*WEBHOOK_CONFIGURATIONS))
            self._empty(self._of(CRD))
        finally:
            if self.proc is not None:
                self.proc.stop()
                self.cluster.procs.remove(self.proc)
                self.proc = None
            self._delete(self._of(CRD))
            self._delete(self._of("ClusterRole", "ClusterRoleBinding"))
            self.objects = []
            shutil.rmtree(self.state, ignore_errors=True)

    def __enter__(self) -> Kueue:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- objects -----------------------------------------------------------------------

    def _by_url(self, webhook: dict) -> dict:
        """``webhook`` (admission or conversion) called at its Service's path on Kueue's
        loopback port, trusting the cluster CA."""
        pki = self.cluster.pki
        assert pki is not None
        path = webhook["clientConfig"]["service"]["path"]
        return {**webhook, "clientConfig": {
            "url": f"https://127.0.0.1:{self.webhook_port}{path}",
            "caBundle": base64.b64encode(pki.ca_crt.read_bytes()).decode()}}

    def _rbac(self) -> list[dict]:
        """Kueue's manager ClusterRole as it ships, under our name, bound to its user."""
        (role,) = [d for d in _load(kueue_manifests() / "rbac") if d["kind"] == "ClusterRole"]
        role["metadata"] = {"name": ROLE}
        ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": ROLE}, "roleRef": ref,
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                 "name": USER}]}
        return [role, binding]

    def _crds(self) -> list[dict]:
        """Kueue's CRDs; those its kustomization patches for conversion convert through
        its webhook at the patch's path."""
        patches = {p["metadata"]["name"]: p["spec"]["conversion"]
                   for p in _load(kueue_manifests() / "conversion")}
        crds = _load(kueue_manifests() / "crds")
        for crd in crds:
            conversion = patches.get(crd["metadata"]["name"])
            if conversion:
                crd["spec"]["conversion"] = {**conversion,
                                             "webhook": self._by_url(conversion["webhook"])}
        return crds

    def _webhook_configurations(self) -> list[dict]:
        """Kueue's webhook configurations, with only the webhooks of its own API group."""
        out = []
        for cfg in _load(kueue_manifests() / "webhook"):
            hooks = [self._by_url(h) for h in cfg["webhooks"] if _own_group(h)]
            out.append({**cfg, "metadata": {"name": PREFIX + cfg["metadata"]["name"]},
                        "webhooks": hooks})
        return out

    def _of(self, *kinds: str) -> list[dict]:
        """The applied objects of these kinds."""
        return [o for o in self.objects if o["kind"] in kinds]

    def _apply(self, objects: list[dict]) -> None:
        # Server-side: the workloads CRD is too large for the last-applied annotation.
        self.cluster.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}",
                             "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                         "items": objects}))

    def _delete(self, objects: list[dict]) -> None:
        if objects:
            self.cluster.kubectl("delete", "--ignore-not-found", "-f", "-", timeout=60,
                                 input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                   "items": [_stub(o) for o in objects]}))

    def _empty(self, crds: list[dict]) -> None:
        """Delete every object of Kueue's kinds while it runs: it drops its finalizers
        (ClusterQueues, ResourceFlavors, ...) once nothing uses them, which it misses if
        their CRD goes first. If it cannot (it died), they are dropped here, so that
        nothing holds up the CRDs' deletion."""
        if not crds:
            return
        # Workloads first (kubectl deletes in this order): a ClusterQueue is released once
        # it holds none.
        plurals = sorted((c["spec"]["names"]["plural"] for c in crds),
                         key=lambda p: p != "workloads")
        kinds = ",".join(f"{p}.{GROUP}" for p in plurals)
        self.cluster.kubectl("delete", kinds, "--all", "-A", "--wait=false", timeout=60)
        alive = self.proc is not None and self.proc.alive()
        try:
            wait_for("Kueue's objects deleted", lambda: not self._objects(kinds),
                     OBJECTS_GONE_TIMEOUT if alive else 0)
        except TimeoutError:
            for o in self._objects(kinds):
                meta = o["metadata"]
                ns = ["-n", meta["namespace"]] if "namespace" in meta else []
                self.cluster.kubectl("patch", f"{o['kind'].lower()}.{GROUP}", meta["name"], *ns,
                                     "--type=merge", "-p", '{"metadata":{"finalizers":null}}')

    def _objects(self, kinds: str) -> list[dict]:
        return json.loads(self.cluster.kubectl("get", kinds, "-A", "-o", "json").stdout)["items"]

    # -- the process -------------------------------------------------------------------

    def _credentials(self) -> tuple[Path, Path]:
        """The webhook server's certificate folder, and Kueue's kubeconfig."""
        pki = self.cluster.pki
        assert pki is not None
        certs = self.state / "certs"
        certs.mkdir()
        serving = issue_serving(pki, "kueue-serving", "flowmill-e2e-kueue")
        shutil.copy(pki.crt(serving), certs / "tls.crt")
        shutil.copy(pki.key(serving), certs / "tls.key")
        client = issue_client(pki, "kueue", USER)
        kubeconfig = self.state / "kubeconfig"
        write_kubeconfig(kubeconfig, self.cluster.server, pki.ca_crt, cert=pki.crt(client),
                         key=pki.key(client), user=USER)
        return certs, kubeconfig

    def _config(self, certs: Path) -> dict:
        """Kueue's Configuration: one replica, everything on loopback."""
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            # Else read from a pod's service-account files, if this host has them.
            "namespace": "kueue-system",
            "leaderElection": {"leaderElect": False},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port,
                        "certDir": str(certs)},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            # Off: the tests read Kueue's objects, and its metrics endpoint authenticates
            # scrapers by service-account token (TokenReview), which they do not have.
            "metrics": {"bindAddress": "0"},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": FRAMEWORKS},
        }

    def _spawn(self, certs: Path, kubeconfig: Path) -> Proc:
        config = self.state / "config.json"
        config.write_text(json.dumps(self._config(certs)))
        etc = self.state / "etc-overlay"  # the tmpfs' mount point (empty on the host)
        etc.mkdir()
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
        return self.cluster._spawn("kueue", [
            "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
            "sh", "-c", ETC_OVERLAY, "kueue-etc", etc, certs,
            kueue_binary(), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--feature-gates={gates}", "--zap-log-level=2",
        ])

    def _ready(self) -> bool:
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310
            return r.status == 200

    def _webhooks_answer(self) -> bool:
        return self.cluster.kubectl("create", "--dry-run=server", "-f", "-",
                                    input=json.dumps(PROBE), check=False).returncode == 0
