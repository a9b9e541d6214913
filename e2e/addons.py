"""The cluster add-ons of the real node: kube-proxy, CoreDNS, and the ``kubernetes``
Service's endpoint.

A pod on a real node finds the cluster the way pods do everywhere: in-cluster clients (the
operator) dial ``KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT``, the ``kubernetes``
Service's ClusterIP, which kube-proxy turns into the API server's endpoint, and task names
(``digits-ps-0.<ns>.svc``) are answered by CoreDNS from the Services and EndpointSlices.
Each is the real component, built from the same sources a cluster runs (``e2e/build.sh
kube-proxy coredns``); what differs from a cluster is only where they run:

* kube-proxy (iptables mode) and CoreDNS are processes in the node's network and mount
  namespaces (as a DaemonSet with ``hostNetwork`` would be), CoreDNS on the node's address,
  port 53, which the kubelet gives pods as their ``nameserver`` (``clusterDNS``);
* the API server listens on 127.0.0.1, which its endpoint reconciler cannot advertise, so
  the ``kubernetes`` Service's Endpoints and EndpointSlice are written here: the port
  forward on the host end of the node's veth (``RealNode.host_ip:6443``).

kube-proxy is told not to touch the host's sysctls (``conntrack`` limits at 0: the
conntrack table size and TCP timeouts are host-wide), and the pods' CNI routes send the
service range to the node, where its rules are. The cluster's kube-scheduler places pods
here that select the node's kind and tolerate its taint (``flowmill.dev/node-kind=real``).
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .kubeconfig import write_kubeconfig
from .pki import issue_client
from .procs import Proc, wait_for
from .versions import cache_dir, read_versions

if TYPE_CHECKING:
    from .realnode import RealNode

CLUSTER_DOMAIN = "cluster.local"
DNS_PORT = 53
READY_PORT = 8181  # CoreDNS's /ready, on the node's address
PROXY_HEALTHZ_PORT = 10256
COREDNS_USER = "flowmill:coredns"
# What CoreDNS's kubernetes plugin reads (the ClusterRole its own manifests ship).
COREDNS_RBAC = [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
     "metadata": {"name": COREDNS_USER},
     "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                "verbs": ["list", "watch"]},
               {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                "verbs": ["list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": COREDNS_USER},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                 "name": COREDNS_USER},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                   "name": COREDNS_USER}]},
]
# The API server's endpoint reconciler would own these; with it off they are ours.
SKIP_MIRROR = "endpointslice.kubernetes.io/skip-mirror"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"


def binaries() -> dict[str, Path]:
    v = read_versions()
    b = cache_dir() / "bin"
    return {"kube-proxy": b / f"kube-proxy-{v['KUBERNETES_VERSION']}",
            "coredns": b / f"coredns-{v['COREDNS_VERSION']}"}


def kubernetes_endpoints(address: str, port: int) -> list[dict]:
    """The ``kubernetes`` Service's Endpoints and EndpointSlice, pointing at ``address``."""
    return [
        {"apiVersion": "v1", "kind": "Endpoints",
         "metadata": {"name": "kubernetes", "namespace": "default",
                      "labels": {SKIP_MIRROR: "true"}},
         "subsets": [{"addresses": [{"ip": address}],
                      "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}]},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kubernetes", "namespace": "default",
                      "labels": {"kubernetes.io/service-name": "kubernetes",
                                 MANAGED_BY: "flowmill-e2e"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
         "ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
    ]


def corefile(bind: str, kubeconfig: Path) -> str:
    """CoreDNS answering the cluster's names only: nothing beyond the node is reachable, so
    there is nothing to forward other names to (they are refused). No cache: a recreated
    task's new address is answered at once (records carry the plugin's 5 s TTL)."""
    return f"""\
.:{DNS_PORT} {{
    bind {bind}
    errors
    ready {bind}:{READY_PORT}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
}}
"""


def kube_proxy_config(node: str, node_ip: str, cluster_cidr: str, kubeconfig: Path) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node, "mode": "iptables", "clusterCIDR": cluster_cidr,
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": f"{node_ip}:{PROXY_HEALTHZ_PORT}",
        "metricsBindAddress": "127.0.0.1:10249",
        # 0: leave the host-wide conntrack table size and TCP timeouts alone.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "iptables": {"localhostNodePorts": False},
        "nodePortAddresses": ["primary"],
    }


class Addons:
    """Start the add-ons of one real node; ``stop`` removes what they left in the cluster
    (their processes are the node's, stopped with it)."""

    def __init__(self, node: RealNode) -> None:
        self.node = node

    def start(self, holder: Proc, timeout: float) -> None:
        node, cluster = self.node, self.node.cluster
        pki = cluster.pki
        assert pki is not None and node.state is not None
        st = node.state
        bins = binaries()
        forward = f"https://{node.host_ip}:{node.api_port}"

        def kubeconfig(name: str, user: str, group: str | None = None,
                       server: str = forward) -> Path:
            cert = issue_client(pki, f"{node.name}-{name}", user, group)
            path = st / f"{name}.kubeconfig"
            write_kubeconfig(path, server, pki.ca_crt, cert=pki.crt(cert), key=pki.key(cert),
                             user=user, tls_server_name="kubernetes")
            return path

        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "List",
            "items": [*COREDNS_RBAC, *kubernetes_endpoints(node.host_ip, node.api_port)]}))

        proxy_cfg = st / "kube-proxy.json"
        proxy_cfg.write_text(json.dumps(kube_proxy_config(
            node.name, node.node_ip, str(node.pod_cidr),
            kubeconfig("kube-proxy", "system:kube-proxy"))))
        proxy = node.spawn_inside("kube-proxy", holder, [
            bins["kube-proxy"], f"--config={proxy_cfg}", "--v=2"])

        core = st / "Corefile"
        core.write_text(corefile(node.node_ip, kubeconfig("coredns", COREDNS_USER)))
        dns = node.spawn_inside("coredns", holder, [bins["coredns"], "-conf", core])

        # Each answers its health endpoint once it has synced (kube-proxy: its rules
        # written; CoreDNS: its kubernetes plugin's caches filled).
        wait_for("kube-proxy healthy", lambda: _ok(
            f"http://{node.node_ip}:{PROXY_HEALTHZ_PORT}/healthz"), timeout, [proxy, holder])
        wait_for("CoreDNS ready", lambda: _ok(f"http://{node.node_ip}:{READY_PORT}/ready"),
                 timeout, [dns, holder])

    def stop(self) -> None:
        cluster = self.node.cluster
        cluster.kubectl("delete", "-n", "default", "endpoints,endpointslices", "kubernetes",
                        "--ignore-not-found", check=False, timeout=60)


def _ok(url: str) -> bool:
    """A 200 from a component's health endpoint (its own self-signed certificate)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=2, context=ctx) as r:  # noqa: S310
        return r.status == 200
