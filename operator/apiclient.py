"""The operator's connection to the API server: who it is, how it asks, and how fast.

Why not the official client library: the operator makes a handful of kinds of request
(read, list, create, replace, delete of a few resources, all JSON), and the library's
generated models cost about 30 MB of memory at import and a model conversion per
request, several times what the requests themselves cost. Here a request is JSON over a
kept-alive HTTPS connection per reconcile thread (``http.client``), and objects stay the
dicts the API serves.

Both kopf's watches and these requests use one identity (``load_credentials``): in a pod
its ServiceAccount (the token re-read as the kubelet rotates it), elsewhere the current
context of ``$KUBECONFIG`` (or ``~/.kube/config``) with a client certificate or a token;
an ``exec`` or ``auth-provider`` user is refused with a message saying so.

Requests go through a client-side rate limit (``FLOWMILL_API_QPS`` per second on
average, bursts of ``FLOWMILL_API_BURST``), as client-go's clients have, so a burst of
reconciles (a thousand jobs applied at once, an operator restarting among them) spreads
its writes instead of crowding out everyone else's requests; the API server's priority
and fairness protects it in turn. kopf's watch requests are long-lived and not counted.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import yaml

ENV_QPS = "FLOWMILL_API_QPS"  # 0: no limit
ENV_BURST = "FLOWMILL_API_BURST"
DEFAULT_QPS = 100.0
DEFAULT_BURST = 200
LIST_PAGE = 500  # objects a LIST page carries
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS = 60.0
ERROR_BODY_LIMIT = 64 * 1024  # an error's body is read for its message, never kept whole
USER_AGENT = "flowmill-operator"


class ApiError(Exception):
    """A request the API server answered with an error status (or did not answer)."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        super().__init__(f"{status} {reason}")
        self.status, self.reason, self.body = status, reason, body

    @property
    def message(self) -> str:
        """The ``message`` of the API's Status body, if it sent one."""
        try:
            return str(json.loads(self.body or "{}").get("message", ""))
        except (ValueError, AttributeError):
            return ""


# ---- who the operator is


@dataclass(frozen=True)
class Credentials:
    server: str  # https://host:port
    ca_file: str | None = None
    insecure: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    token_file: str | None = None  # re-read: a projected token is rotated


def load_credentials(environ: Mapping[str, str] = os.environ,
                     service_account: Path = SERVICE_ACCOUNT) -> Credentials:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG (or ~/.kube/config)."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if host and port and (service_account / "token").exists():
        host = f"[{host}]" if ":" in host else host
        return Credentials(server=f"https://{host}:{port}",
                           ca_file=str(service_account / "ca.crt"),
                           token_file=str(service_account / "token"))
    paths = [p for p in (environ.get("KUBECONFIG") or "").split(os.pathsep) if p]
    path = Path(paths[0] if paths else Path.home() / ".kube" / "config").expanduser()
    return from_kubeconfig(path)


def from_kubeconfig(path: Path) -> Credentials:
    """The current context's cluster and user. Embedded certificates and keys
    (``*-data``) are written to files only this process may read (the SSL library loads
    a client certificate from a file)."""
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the kubeconfig {path}: {e}") from None
    context_name = doc.get("current-context")

    def named(kind: str, name: str | None) -> dict[str, Any]:
        for item in doc.get(f"{kind}s") or ():
            if item.get("name") == name:
                return item.get(kind) or {}
        raise ValueError(f"kubeconfig {path}: no {kind} named {name!r}")

    context = named("context", context_name)
    cluster, user = named("cluster", context.get("cluster")), named("user", context.get("user"))
    if user.get("exec") or user.get("auth-provider"):
        raise ValueError(
            f"kubeconfig {path}: user {context.get('user')!r} logs in with "
            f"{'exec' if user.get('exec') else 'auth-provider'}, which the operator does not "
            "support; give it a token or a client certificate")
    if not cluster.get("server"):
        raise ValueError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no server")

    def file(field: str, section: dict[str, Any]) -> str | None:
        if section.get(f"{field}-data"):
            return _private_file(base64.b64decode(section[f"{field}-data"]))
        value = section.get(field)
        return str((path.parent / value).resolve()) if value else None

    token_file = user.get("tokenFile")
    return Credentials(
        server=cluster["server"].rstrip("/"), ca_file=file("certificate-authority", cluster),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        cert_file=file("client-certificate", user), key_file=file("client-key", user),
        token=user.get("token"),
        token_file=str((path.parent / token_file).resolve()) if token_file else None)


def _private_file(data: bytes) -> str:
    fd, name = tempfile.mkstemp(prefix="flowmill-operator-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:  # mkstemp makes it 0600
        f.write(data)
    return name


def connection_info(creds: Credentials,
                    settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The same identity for kopf's own watches as for the controller's requests."""
    return kopf.ConnectionInfo(
        server=creds.server, ca_path=creds.ca_file, insecure=creds.insecure or None,
        scheme="Bearer" if creds.token or creds.token_file else None,
        token=_token(creds), certificate_path=creds.cert_file,
        private_key_path=creds.key_file, trust_env=settings.networking.trust_env)


def _token(creds: Credentials) -> str | None:
    if creds.token_file:
        return Path(creds.token_file).read_text().strip()
    return creds.token


# ---- how fast it may ask


class RateLimit:
    """A token bucket: ``qps`` tokens a second, at most ``burst`` saved up. A caller
    without a token reserves the next one and sleeps until it is due, so waiting callers
    go in the order they came. Thread-safe."""

    def __init__(self, qps: float, burst: int,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if qps < 0 or burst < 1:
            raise ValueError(f"the API rate limit needs qps >= 0 and burst >= 1, "
                             f"got qps {qps}, burst {burst}")
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._last = clock()

    def acquire(self) -> float:
        """Take a token, waiting for it if need be; the seconds waited."""
        if self.qps == 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait


def rate_limit_from_env(environ: Mapping[str, str] = os.environ) -> RateLimit:
    qps_text = environ.get(ENV_QPS, "").strip()
    burst_text = environ.get(ENV_BURST, "").strip()
    try:
        qps = float(qps_text) if qps_text else DEFAULT_QPS
    except ValueError:
        raise ValueError(f"{ENV_QPS} must be a number of requests per second (0: no "
                         f"limit), got {qps_text!r}") from None
    if burst_text and not burst_text.isdigit():
        raise ValueError(f"{ENV_BURST} must be a whole number of requests, got {burst_text!r}")
    return RateLimit(qps, int(burst_text) if burst_text else DEFAULT_BURST)


# ---- how it asks


def path(api_version: str, plural: str, namespace: str | None = None,
         name: str | None = None, subresource: str | None = None) -> str:
    """The URL path of a collection or an object: ``v1`` is the core group."""
    parts = ["api", "v1"] if api_version == "v1" else ["apis", *api_version.split("/")]
    if namespace is not None:
        parts += ["namespaces", namespace]
    parts.append(plural)
    if name is not None:
        parts.append(name)
    if subresource is not None:
        parts.append(subresource)
    return "/" + "/".join(urllib.parse.quote(p, safe="") for p in parts)


class Kube:
    """JSON requests to the API server, one kept-alive connection per thread."""

    def __init__(self, creds: Credentials, limit: RateLimit | None = None,
                 timeout: float = 30.0) -> None:
        url = urllib.parse.urlsplit(creds.server)
        if url.scheme != "https" or not url.hostname:
            raise ValueError(f"the API server must be an https:// URL, got {creds.server!r}")
        self.creds, self.limit, self.timeout = creds, limit, timeout
        self.host, self.port = url.hostname, url.port or 443
        self.prefix = url.path.rstrip("/")
        self.ssl = ssl.create_default_context(cafile=creds.ca_file)
        if creds.insecure:
            self.ssl.check_hostname = False
            self.ssl.verify_mode = ssl.CERT_NONE
        if creds.cert_file:
            self.ssl.load_cert_chain(creds.cert_file, creds.key_file)
        self._local = threading.local()
        self._token: tuple[float, str | None] = (-TOKEN_REREAD_SECONDS, None)
        self._token_lock = threading.Lock()

    def get(self, path: str, **query: str) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def list(self, path: str, each: Callable[[dict[str, Any]], dict[str, Any]],
             limit: int = LIST_PAGE, **query: str) -> dict[str, Any]:
        """A LIST read ``limit`` objects a page, as client-go's pager reads, each object
        passed through ``each`` before the next page is read, so a large collection is
        never held whole as parsed JSON: the items, and the list's resourceVersion (the
        pages are one snapshot)."""
        items: list[dict[str, Any]] = []
        page_query = {**query, "limit": str(limit)}
        version = None
        while True:
            page = self.get(path, **page_query)
            meta = page.get("metadata") or {}
            version = version or meta.get("resourceVersion")
            items.extend(each(obj) for obj in page.get("items") or ())
            if not meta.get("continue"):
                return {"metadata": {"resourceVersion": version}, "items": items}
            page_query["continue"] = meta["continue"]
            del page

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def replace(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PUT", path, body)

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self.request("DELETE", path, body)

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None,
                query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One request; the response's JSON, or ``ApiError``. A kept-alive connection the
        server closed meanwhile is dialled again once."""
        if self.limit is not None:
            self.limit.acquire()
        target = self.prefix + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        for attempt in (0, 1):
            conn, fresh = self._connection()
            try:
                conn.request(method, target, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop()
                if fresh or attempt:
                    raise ApiError(0, "connection lost") from None
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                raise ApiError(0, f"{type(e).__name__}: {e}") from None
        if resp.status >= 400:
            raise ApiError(resp.status, resp.reason,
                           data[:ERROR_BODY_LIMIT].decode(errors="replace"))
        return json.loads(data) if data else {}

    def close(self) -> None:
        self._drop()

    def _connection(self) -> tuple[http.client.HTTPSConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, False
        conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                           context=self.ssl)
        self._local.conn = conn
        return conn, True

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _bearer(self) -> str | None:
        if not self.creds.token_file:
            return self.creds.token
        with self._token_lock:
            read, token = self._token
            if time.monotonic() - read >= TOKEN_REREAD_SECONDS:
                token = _token(self.creds)
                self._token = (time.monotonic(), token)
            return token
