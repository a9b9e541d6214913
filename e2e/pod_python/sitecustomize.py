"""Cluster DNS for Python processes run by the e2e node stand-in.

Why this file: pods there are plain host processes, so there is no cluster DNS server and
no per-pod /etc/hosts; glibc offers no per-process hosts file (HOSTALIASES only maps
dot-free aliases to other names), and LD_PRELOAD shims are brittle. Python imports
``sitecustomize`` at start-up from PYTHONPATH, which the stand-in points here. It

* makes ``socket.getaddrinfo``/``gethostbyname``/``gethostbyname_ex`` (and so urllib,
  requests, asyncio, aiohttp, the kubernetes client) look names up in the table the
  stand-in maintains (``$FLOWMILL_NAME_TABLE``, JSON: FQDN -> IPs), applying the pod's
  DNS search list, and
* rewrites ``grpc`` channel targets and server ports that use such names, because gRPC
  resolves names in C, past the Python socket module.

Unknown names fall through to the normal resolver. Non-Python programs see only the
normal resolver. This file must not import the harness: it runs inside pods.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import socket
import sys

_TABLE_PATH = os.environ.get("FLOWMILL_NAME_TABLE", "")
_SEARCH = [s for s in os.environ.get("FLOWMILL_DNS_SEARCH", "").split() if s]
_cache: dict[str, object] = {"mtime": None, "table": {}}


def _table() -> dict:
    try:
        mtime = os.stat(_TABLE_PATH).st_mtime_ns
    except OSError:
        return {}
    if mtime != _cache["mtime"]:
        try:
            with open(_TABLE_PATH) as f:
                _cache["table"] = json.load(f)
            _cache["mtime"] = mtime
        except (OSError, ValueError):
            pass
    return _cache["table"]  # type: ignore[return-value]


def lookup(host: object) -> list[str] | None:
    """IPs for a cluster name, or None when the name is not a cluster name."""
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str) or not host or not _TABLE_PATH:
        return None
    name = host.rstrip(".").lower()
    table = _table()
    candidates = [name] if host.endswith(".") else [name] + [f"{name}.{s}" for s in _SEARCH]
    for c in candidates:
        if c in table:
            return list(table[c])
    return None


def _no_such_host() -> socket.gaierror:
    return socket.gaierror(socket.EAI_NONAME, "Name or service not known")


_getaddrinfo = socket.getaddrinfo
_gethostbyname = socket.gethostbyname
_gethostbyname_ex = socket.gethostbyname_ex


def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
    ips = lookup(host)
    if ips is None or family not in (0, socket.AF_INET):
        return _getaddrinfo(host, port, family, type, proto, flags)
    if not ips:
        raise _no_such_host()
    out = []
    for ip in ips:
        out.extend(_getaddrinfo(ip, port, socket.AF_INET, type, proto,
                                flags | socket.AI_NUMERICHOST))
    return out


def gethostbyname(host):
    ips = lookup(host)
    if ips is None:
        return _gethostbyname(host)
    if not ips:
        raise _no_such_host()
    return ips[0]


def gethostbyname_ex(host):
    ips = lookup(host)
    if ips is None:
        return _gethostbyname_ex(host)
    if not ips:
        raise _no_such_host()
    return host, [], ips


socket.getaddrinfo = getaddrinfo
socket.gethostbyname = gethostbyname
socket.gethostbyname_ex = gethostbyname_ex


# -- grpc ------------------------------------------------------------------------------

def grpc_target(target: str) -> str:
    """``name:port`` (or ``dns:///name:port``) -> ``ipv4:ip1:port,ip2:port``."""
    rest = target
    for prefix in ("dns:///", "dns:"):
        if rest.startswith(prefix):
            rest = rest[len(prefix):]
            break
    host, sep, port = rest.rpartition(":")
    ips = lookup(host) if sep else None
    if not ips:
        return target
    return "ipv4:" + ",".join(f"{ip}:{port}" for ip in ips)


def _server_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    ips = lookup(host) if sep else None
    return f"{ips[0]}:{port}" if ips else address


def _patch_grpc(grpc) -> None:
    def wrap_channel(fn):
        def channel(target, *args, **kwargs):
            return fn(grpc_target(target), *args, **kwargs)
        return channel

    def wrap_port(fn):
        def add_port(self, address, *args, **kwargs):
            return fn(self, _server_address(address), *args, **kwargs)
        return add_port

    for mod in (grpc, getattr(grpc, "aio", None)):
        if mod is None:
            continue
        for name in ("insecure_channel", "secure_channel"):
            if hasattr(mod, name):
                setattr(mod, name, wrap_channel(getattr(mod, name)))
    try:
        from grpc import _server
        from grpc.aio import _server as _aio_server
    except ImportError:
        return
    for cls in (getattr(_server, "_Server", None), getattr(_aio_server, "Server", None)):
        for name in ("add_insecure_port", "add_secure_port"):
            if cls is not None and hasattr(cls, name):
                setattr(cls, name, wrap_port(getattr(cls, name)))


class _GrpcHook(importlib.abc.MetaPathFinder):
    """Patches ``grpc`` right after it is first imported (importing it here would be slow)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "grpc":
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec("grpc")
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module):
            exec_module(module)
            _patch_grpc(module)
        loader.exec_module = patched_exec  # type: ignore[method-assign]
        sys.meta_path.remove(self)
        return spec


if _TABLE_PATH:
    if "grpc" in sys.modules:
        _patch_grpc(sys.modules["grpc"])
    else:
        sys.meta_path.insert(0, _GrpcHook())
