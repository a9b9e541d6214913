"""The kube-apiserver's audit log, for counting the requests a client makes.

``Cluster(audit_users=(...))`` has the apiserver log every request of those users at the
Metadata level (one JSON object a line, no bodies) to ``cluster.audit_log``. A reader
takes the file's size before and after what it measures (``offset``) and counts the
requests in between (``count``): by verb and resource, the way ``kubectl`` names them
(``create pods``, ``update trainingjobs/status``, ``get /apis/flowmill.dev/v1`` for a
path that names no resource).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

COMPLETE = "ResponseComplete"


def policy(users: tuple[str, ...] | list[str]) -> dict:
    """An audit policy: Metadata for ``users`` (each request once, when its response is
    complete, and once when a watch's response starts), nothing for anyone else."""
    return {
        "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
        "rules": [
            {"level": "Metadata", "users": list(users), "omitStages": ["RequestReceived"]},
            {"level": "None"},
        ],
    }


def offset(path: Path) -> int:
    """The log's size now: where the next request's line will start."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def kind(event: dict) -> str:
    """``verb resource[/subresource]``, or ``verb /path`` for a non-resource URL."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource")
    if resource:
        if ref.get("subresource"):
            resource += "/" + ref["subresource"]
    else:
        resource = event.get("requestURI", "").split("?", 1)[0]
    return f"{event.get('verb')} {resource}"


@dataclass
class Counts:
    """The requests of one user between two offsets of the log."""

    requests: Counter[str] = field(default_factory=Counter)  # completed, watches aside
    watches: Counter[str] = field(default_factory=Counter)  # watches that ended
    codes: Counter[int] = field(default_factory=Counter)  # response codes of ``requests``

    @property
    def total(self) -> int:
        return sum(self.requests.values())


def count(path: Path, start: int, end: int, user: str) -> Counts:
    """Count ``user``'s completed requests logged between byte offsets ``start`` and
    ``end``. A line cut at ``start`` belongs to the window before; one cut at ``end``, to
    the window after (the apiserver may be writing it as the offset is taken)."""
    out = Counts()
    if end <= start:
        return out
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the rest of a line that began before the window
        while f.tell() < end:
            line = f.readline()
            if not line.endswith(b"\n") or f.tell() > end:
                break
            event = json.loads(line)
            if event.get("stage") != COMPLETE or event.get("user", {}).get("username") != user:
                continue
            if event.get("verb") == "watch":
                out.watches[kind(event)] += 1
            else:
                out.requests[kind(event)] += 1
                out.codes[int(event.get("responseStatus", {}).get("code", 0))] += 1
    return out
