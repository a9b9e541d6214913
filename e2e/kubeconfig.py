"""Kubeconfig files for the admin, the controller-manager and pods."""

from __future__ import annotations

import json
from pathlib import Path


def write_kubeconfig(path: Path, server: str, ca: Path, *, user: str,
                     cert: Path | None = None, key: Path | None = None,
                     token: str | None = None, namespace: str | None = None,
                     tls_server_name: str | None = None) -> None:
    """Write a one-context kubeconfig (client certificate or bearer token).

    ``tls_server_name``: the name to verify the server's certificate against, when the
    address in ``server`` is not one of its names (a forwarded port, say).
    """
    creds: dict[str, str] = {}
    if cert and key:
        creds = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        creds["token"] = token
    ctx: dict[str, str] = {"cluster": "flowmill-e2e", "user": user}
    if namespace:
        ctx["namespace"] = namespace
    cluster: dict[str, str] = {"server": server, "certificate-authority": str(ca)}
    if tls_server_name:
        cluster["tls-server-name"] = tls_server_name
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "flowmill-e2e",
        "clusters": [{"name": "flowmill-e2e", "cluster": cluster}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "flowmill-e2e", "context": ctx}],
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML
    path.chmod(0o600)
