"""Pure pieces of the node stand-in: env resolution, resource sums, pod phase.

Kept free of I/O so they read like the kubelet rules they mirror and are easy to check.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

Obj = dict[str, Any]

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubelet's ``$(VAR)`` expansion: known names are substituted, ``$$`` escapes ``$``,
    unknown references stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(sub, value)


class MissingRef(Exception):
    """A referenced Secret/ConfigMap key does not exist (kubelet: CreateContainerConfigError)."""


Lookup = Callable[[str, str, str], Mapping[str, str] | None]  # (kind, namespace, name) -> data


def field_ref(pod: Obj, path: str) -> str:
    """The value of a ``fieldRef.fieldPath`` of the downward API."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", [])),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", [])),
    }
    if path not in simple:
        raise MissingRef(f"unsupported fieldRef {path!r}")
    return simple[path]


def resource_ref(container: Obj, ref: Obj) -> str:
    """A ``resourceFieldRef`` value (limits fall back to requests, as for the kubelet)."""
    kind, _, res = ref["resource"].partition(".")
    res_map = container.get("resources", {})
    raw = (res_map.get(kind) or {}).get(res) or (res_map.get("requests") or {}).get(res)
    if raw is None:
        return "0"
    divisor = parse_quantity(ref.get("divisor", "1"))
    value = parse_quantity(raw) / divisor
    return str(int(value.to_integral_value(rounding="ROUND_CEILING")))


def _keyref(kind: str, ns: str, ref: Obj, lookup: Lookup) -> str | None:
    data = lookup(kind, ns, ref["name"])
    if data is not None and ref["key"] in data:
        return data[ref["key"]]
    if ref.get("optional"):
        return None
    raise MissingRef(f"{kind} {ns}/{ref['name']} has no key {ref['key']!r}"
                     if data is not None else f"{kind} {ns}/{ref['name']} not found")


def container_env(pod: Obj, container: Obj, lookup: Lookup) -> dict[str, str]:
    """The env a container declares (``envFrom`` first, then ``env`` in order)."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for src in container.get("envFrom", []) or []:
        prefix = src.get("prefix", "")
        for kind in ("configMap", "secret"):
            ref = src.get(f"{kind}Ref")
            if ref is None:
                continue
            data = lookup(kind, ns, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise MissingRef(f"{kind} {ns}/{ref['name']} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env", []) or []:
        name, src = var["name"], var.get("valueFrom")
        if src is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in src:
            env[name] = field_ref(pod, src["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in src:
            env[name] = resource_ref(container, src["resourceFieldRef"])
        else:
            kind = "secret" if "secretKeyRef" in src else "configMap"
            value = _keyref(kind, ns, src[f"{kind}KeyRef"], lookup)
            if value is not None:
                env[name] = value
    return env


def secret_files(pod: Obj, container: Obj,
                 lookup: Callable[[str, str], Mapping[str, bytes] | None]
                 ) -> dict[str, dict[str, bytes]]:
    """The files of each ``secret`` volume the container mounts, by ``mountPath``: the
    volume's ``items`` (key -> path), or every key of the Secret. ``lookup(namespace,
    name)`` gives a Secret's data as bytes. A Secret or key that is missing raises
    MissingRef unless the volume is ``optional`` (the kubelet's rule)."""
    ns = pod["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or ()}
    out: dict[str, dict[str, bytes]] = {}
    for mount in container.get("volumeMounts") or ():
        src = (volumes.get(mount["name"]) or {}).get("secret")
        if src is None:
            continue
        name, optional = src.get("secretName", ""), bool(src.get("optional"))
        data = lookup(ns, name)
        if data is None:
            if optional:
                continue
            raise MissingRef(f"secret {ns}/{name} not found (volume {mount['name']})")
        items = src.get("items")
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        files = {}
        for key, path in pairs:
            if key not in data:
                if optional:
                    continue
                raise MissingRef(f"secret {ns}/{name} has no key {key!r} "
                                 f"(volume {mount['name']})")
            files[path] = data[key]
        out[mount["mountPath"]] = files
    return out


def remount(env: Mapping[str, str], mounts: Mapping[str, str]) -> dict[str, str]:
    """``env`` with values that name a mount path (or a file under one) pointed at the
    host directory standing in for it (no mount namespaces here)."""
    out = dict(env)
    for var, value in env.items():
        for target, host in mounts.items():
            if value == target or value.startswith(target.rstrip("/") + "/"):
                out[var] = host + value[len(target.rstrip("/")):]
                break
    return out


def argv(container: Obj, env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded. Without ``command`` there is no
    image entrypoint to fall back on here, so ``args`` alone is taken as the command."""
    parts = list(container.get("command") or []) + list(container.get("args") or [])
    return [expand(p, env) for p in parts]


def pod_requests(pod: Obj) -> dict[str, Decimal]:
    """Effective requests: max(sum of containers, largest init container), per resource."""

    def req(c: Obj) -> dict[str, Decimal]:
        r = (c.get("resources") or {}).get("requests") or {}
        return {k: parse_quantity(v) for k, v in r.items()}

    total: dict[str, Decimal] = {}
    for c in pod["spec"].get("containers", []):
        for k, v in req(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in pod["spec"].get("initContainers", []) or []:
        for k, v in req(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def matches(selector: Mapping[str, str] | None, labels: Mapping[str, str] | None) -> bool:
    """Equality-based label selector (what Services and nodeSelector use)."""
    if not selector:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())
