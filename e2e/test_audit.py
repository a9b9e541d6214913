"""Counting a client's requests in the apiserver's audit log, and the stand-in's name
table with many Services (pure parts)."""

from __future__ import annotations

import json
from pathlib import Path

from . import audit
from .podnet import name_table


def event(user: str, verb: str, resource: str | None = None, sub: str | None = None,
          stage: str = "ResponseComplete", code: int = 200, uri: str = "/x") -> dict:
    out = {"kind": "Event", "stage": stage, "verb": verb, "requestURI": uri,
           "user": {"username": user}, "responseStatus": {"code": code}}
    if resource:
        out["objectRef"] = {"resource": resource, **({"subresource": sub} if sub else {})}
    return out


def write(path: Path, events: list[dict]) -> list[int]:
    """The events as JSON lines; the offset after each."""
    offsets = []
    with open(path, "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
            offsets.append(f.tell())
    return offsets


def test_counts_a_users_completed_requests_by_verb_and_resource(tmp_path: Path):
    log = tmp_path / "audit.log"
    write(log, [
        event("op", "create", "pods"),
        event("op", "create", "pods", code=409),
        event("op", "update", "trainingjobs", "status"),
        event("op", "get", uri="/apis/flowmill.dev/v1alpha1?timeout=32s"),
        event("op", "watch", "pods", stage="ResponseStarted"),
        event("op", "watch", "pods"),
        event("admin", "create", "pods"),
        event("op", "list", "pods", stage="RequestReceived"),
    ])
    counts = audit.count(log, 0, audit.offset(log), "op")
    assert counts.requests == {"create pods": 2, "update trainingjobs/status": 1,
                               "get /apis/flowmill.dev/v1alpha1": 1}
    assert counts.total == 4
    assert counts.watches == {"watch pods": 1}
    assert counts.codes == {200: 3, 409: 1}


def test_a_window_takes_the_lines_that_end_inside_it(tmp_path: Path):
    log = tmp_path / "audit.log"
    ends = write(log, [event("op", "get", "a"), event("op", "get", "b"),
                       event("op", "get", "c")])
    assert audit.count(log, ends[0], ends[2], "op").requests == {"get b": 1, "get c": 1}
    # Offsets cut through a line: it belongs to neither edge's inside.
    assert audit.count(log, ends[0] - 3, ends[2] - 3, "op").requests == {"get b": 1}
    assert audit.count(log, ends[1], ends[1], "op").total == 0
    assert audit.offset(tmp_path / "none.log") == 0


def test_the_policy_logs_only_the_given_users():
    policy = audit.policy(("flowmill:operator",))
    assert policy["rules"][0] == {"level": "Metadata", "users": ["flowmill:operator"],
                                  "omitStages": ["RequestReceived"]}
    assert policy["rules"][-1] == {"level": "None"}


def pod(ns: str, name: str, ip: str, labels: dict, phase: str = "Running", **spec) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "labels": labels},
            "spec": spec, "status": {"podIP": ip, "phase": phase}}


def svc(ns: str, name: str, selector: dict | None, headless: bool = False,
        not_ready: bool = False) -> dict:
    spec: dict = {"selector": selector} if selector is not None else {}
    if headless:
        spec["clusterIP"] = "None"
    if not_ready:
        spec["publishNotReadyAddresses"] = True
    return {"metadata": {"namespace": ns, "name": name}, "spec": spec}


def test_name_table_matches_every_label_of_a_selector_in_its_namespace():
    pods = [
        pod("a", "j-worker-0", "127.9.0.1", {"job": "j", "role": "worker", "i": "0"}),
        pod("a", "j-worker-1", "127.9.0.2", {"job": "j", "role": "worker", "i": "1"},
            phase="Pending"),
        pod("a", "j-ps-0", "127.9.0.3", {"job": "j", "role": "ps", "i": "0"},
            hostname="j-ps-0", subdomain="j"),
        pod("b", "j-worker-0", "127.9.0.4", {"job": "j", "role": "worker", "i": "0"}),
    ]
    services = [
        svc("a", "j-worker-0", {"job": "j", "role": "worker", "i": "0"}),
        svc("a", "j-workers", {"job": "j", "role": "worker"}),
        svc("a", "j-all", {"job": "j"}, not_ready=True),
        svc("a", "j", {"job": "j", "role": "ps"}, headless=True),
        svc("a", "nothing", None),
        svc("a", "empty", {}),
    ]
    table = name_table(services, pods)
    assert table == {
        "j-worker-0.a.svc.cluster.local": ["127.9.0.1"],
        "j-workers.a.svc.cluster.local": ["127.9.0.1"],
        "j-all.a.svc.cluster.local": ["127.9.0.1", "127.9.0.2", "127.9.0.3"],
        "j.a.svc.cluster.local": ["127.9.0.3"],
        "nothing.a.svc.cluster.local": [],
        "empty.a.svc.cluster.local": [],
        "j-ps-0.j.a.svc.cluster.local": ["127.9.0.3"],
    }
