"""Network addresses, parsed and written in one place: ``host:port``, ``[v6]:port``, and
where a task listens for a given address."""

from __future__ import annotations

import ipaddress

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or a ``(host, port)`` tuple."""
    if isinstance(address, tuple):
        return address[0], int(address[1])
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not port.isdigit() or not host or not 0 <= int(port) < 65536:
        raise ValueError(f"address {address!r} is not 'host:port'")
    return host.strip("[]"), int(port)


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def default_bind_host(address: str) -> str:
    """Loopback for a task addressed on this machine only, every interface otherwise."""
    host, _ = parse_address(address)
    if host == "localhost":
        return "127.0.0.1"
    try:
        return "127.0.0.1" if ipaddress.ip_address(host).is_loopback else "0.0.0.0"
    except ValueError:  # a host name: a pod's service name resolves to a non-loopback address
        return "0.0.0.0"
