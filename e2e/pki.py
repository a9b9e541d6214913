"""Certificates and keys for the test control plane, made with the ``openssl`` CLI.

The CLI (present on every Linux host) keeps the harness free of extra Python dependencies.
EC P-256 keys are used throughout: they are generated in milliseconds, and kube-apiserver
accepts them for serving, client and service-account signing keys alike.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_IP = "10.0.0.1"  # first address of the service range: the `kubernetes` Service


@dataclass(frozen=True)
class Pki:
    """Paths of the generated material."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True)


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(path), cwd=path.parent)
    path.chmod(0o600)


def _sign(pki: Pki, name: str, subject: str, ext: str) -> None:
    """Issue ``name.crt`` for ``name.key`` from the CA with the given v3 extensions."""
    _new_key(pki.key(name))
    csr = pki.dir / f"{name}.csr"
    extfile = pki.dir / f"{name}.ext"
    extfile.write_text(ext)
    _openssl("req", "-new", "-key", str(pki.key(name)), "-subj", subject, "-out", str(csr),
             cwd=pki.dir)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
             "-CAcreateserial", "-days", "30", "-sha256", "-extfile", str(extfile),
             "-out", str(pki.crt(name)), cwd=pki.dir)
    csr.unlink()
    extfile.unlink()


CLIENT_EXT = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n"


def make_pki(directory: Path, node_names: list[str]) -> Pki:
    """Create a CA, serving certs (apiserver, node), client certs and service-account keys."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    _new_key(pki.ca_key)
    _openssl("req", "-x509", "-new", "-key", str(pki.ca_key), "-subj", "/CN=flowmill-e2e-ca",
             "-days", "30", "-sha256", "-out", str(pki.ca_crt), cwd=directory)
    sans = ",".join([
        "IP:127.0.0.1", f"IP:{SERVICE_IP}", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ])
    _sign(pki, "apiserver", "/CN=kube-apiserver",
          "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
          f"extendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    # Group system:masters is bound to cluster-admin by the default RBAC policy.
    _sign(pki, "admin", "/O=system:masters/CN=flowmill-admin", CLIENT_EXT)
    # The identities the default RBAC policy grants the controller-manager's and the
    # scheduler's permissions to.
    _sign(pki, "scheduler", "/CN=system:kube-scheduler", CLIENT_EXT)
    _sign(pki, "controller-manager", "/CN=system:kube-controller-manager", CLIENT_EXT)
    # What the apiserver's aggregation layer presents to extension apiservers; delegating
    # components (the controller-manager) trust requests carrying it.
    _sign(pki, "front-proxy-client", "/CN=front-proxy-client", CLIENT_EXT)
    # The apiserver's identity towards the node stand-in's log endpoint (`kubectl logs`).
    _sign(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
          CLIENT_EXT)
    # Serving cert of the node stand-in's log endpoint, which the apiserver verifies.
    names = ",".join(f"DNS:{n}" for n in node_names)
    _sign(pki, "node", f"/CN=system:node:{node_names[0]}",
          "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
          f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,{names}\n")
    _new_key(pki.sa_key)
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub), cwd=directory)
    return pki


def issue_kubelet_certs(pki: Pki, node_name: str, node_ip: str) -> tuple[str, str]:
    """A real kubelet's serving and client certificates, from the cluster CA.

    Serving: what the apiserver verifies (``--kubelet-certificate-authority``) when it
    proxies ``kubectl logs``/``exec`` to ``https://<node_ip>:10250``. Client: the node
    identity ``system:node:<name>`` in group ``system:nodes``, which the Node authorizer
    and the NodeRestriction admission plugin recognise. Returns the two names (for
    ``pki.crt()``/``pki.key()``).
    """
    serving, client = f"kubelet-{node_name}-serving", f"kubelet-{node_name}-client"
    _sign(pki, serving, f"/CN=system:node:{node_name}",
          "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
          f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{node_ip},DNS:{node_name}\n")
    _sign(pki, client, f"/O=system:nodes/CN=system:node:{node_name}", CLIENT_EXT)
    return serving, client


def issue_client(pki: Pki, name: str, user: str, group: str | None = None) -> str:
    """A client certificate for ``user`` (in ``group``): the identity a component shows
    the apiserver (``system:kube-proxy``, ``system:kube-scheduler`` are bound to their
    roles by the default RBAC policy). Returns ``name`` (for ``pki.crt()``/``pki.key()``)."""
    subject = (f"/O={group}" if group else "") + f"/CN={user}"
    _sign(pki, name, subject, CLIENT_EXT)
    return name


def issue_serving(pki: Pki, name: str, cn: str, ip: str = "127.0.0.1") -> str:
    """A serving certificate for ``ip`` from the cluster CA: what a webhook server on
    loopback (Kueue's) shows the apiserver, which trusts it through the webhook
    configuration's ``caBundle``, the CA. Returns ``name`` (for ``pki.crt()``/``pki.key()``)."""
    _sign(pki, name, f"/CN={cn}",
          "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
          f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{ip}\n")
    return name
