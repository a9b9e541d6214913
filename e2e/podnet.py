"""Pod addressing for the node stand-in: loopback pod IPs and Service name resolution.

Each pod gets its own address in a 127.N.0.0/16 range claimed by the stand-in (all of
127.0.0.0/8 reaches the loopback interface on Linux, so no setup is needed). Cluster DNS
is replaced by a name table that the stand-in rewrites whenever Services or pods change;
pods consult it through the ``sitecustomize`` module in ``pod_python/`` (see there for
why).
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Iterable
from pathlib import Path

from .podspec import Obj, matches

DOMAIN = "cluster.local"


class IpPool:
    """Hands out 127.N.x.y addresses, never reusing one within a run (no stale peers).

    N is claimed per node stand-in by binding 127.N.255.254:CLAIM_PORT for its lifetime,
    so test sessions running side by side on one host never hand out the same pod IP.
    """

    CLAIM_PORT = 40999

    def __init__(self) -> None:
        self.claim = socket.socket()
        for n in random.sample(range(10, 255), 245):
            try:
                self.claim.bind((f"127.{n}.255.254", self.CLAIM_PORT))
            except OSError:
                continue
            self.claim.listen(1)
            self.prefix = f"127.{n}"
            break
        else:
            raise RuntimeError("no free 127.N.0.0/16 range for pod IPs")
        self.next = 1

    def allocate(self) -> str:
        while True:
            n = self.next
            self.next += 1
            hi, lo = divmod(n, 256)
            if hi > 255 or (hi, lo) == (255, 254):
                raise RuntimeError("pod IP pool exhausted")
            if 0 < lo < 255:
                return f"{self.prefix}.{hi}.{lo}"


def _serving(pod: Obj, not_ready_too: bool) -> bool:
    status = pod.get("status", {})
    if not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
        return False
    return not_ready_too or status.get("phase") == "Running"


def name_table(services: Iterable[Obj], pods: Iterable[Obj]) -> dict[str, list[str]]:
    """Fully qualified names -> pod IPs, as cluster DNS would answer them.

    A Service name resolves to the IPs of the pods its selector picks (for every Service,
    headless or not: there is no kube-proxy, so a ClusterIP could not be reached anyway).
    A pod with ``hostname`` and ``subdomain`` naming a headless Service gets
    ``<hostname>.<subdomain>.<ns>.svc.cluster.local``.
    """
    pods = list(pods)
    # Pods by (namespace, label, value): a Service looks only at the pods carrying its
    # selector's first label, not at every pod (a thousand jobs have a thousand Services).
    by_label: dict[tuple[str, str, str], list[Obj]] = {}
    for p in pods:
        ns = p["metadata"]["namespace"]
        for k, v in (p["metadata"].get("labels") or {}).items():
            by_label.setdefault((ns, k, v), []).append(p)
    table: dict[str, list[str]] = {}
    headless: set[tuple[str, str]] = set()
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec", {})
        ns, name = meta["namespace"], meta["name"]
        if spec.get("clusterIP") == "None":
            headless.add((ns, name))
        not_ready = bool(spec.get("publishNotReadyAddresses"))
        selector = spec.get("selector") or {}
        first = next(iter(selector.items()), None)
        candidates = by_label.get((ns, *first), []) if first else []
        ips = sorted(
            p["status"]["podIP"] for p in candidates
            if matches(selector, p["metadata"].get("labels")) and _serving(p, not_ready)
        )
        table[f"{name}.{ns}.svc.{DOMAIN}"] = ips
    for p in pods:
        spec, ns = p["spec"], p["metadata"]["namespace"]
        host, sub = spec.get("hostname"), spec.get("subdomain")
        if host and sub and (ns, sub) in headless and _serving(p, True):
            table[f"{host}.{sub}.{ns}.svc.{DOMAIN}"] = [p["status"]["podIP"]]
    return table


def write_table(path: Path, table: dict[str, list[str]]) -> None:
    """Replace the table atomically, so a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, sort_keys=True))
    os.replace(tmp, path)


def search_list(namespace: str) -> list[str]:
    """The DNS search domains a pod in ``namespace`` gets."""
    return [f"{namespace}.svc.{DOMAIN}", f"svc.{DOMAIN}", DOMAIN]
