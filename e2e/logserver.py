"""The kubelet's ``/containerLogs`` endpoint, so ``kubectl logs`` works with the stand-in.

The apiserver proxies ``pods/log`` to ``https://<node InternalIP>:<kubeletEndpoint.Port>``
with its kubelet client certificate; this server checks that certificate against the
cluster CA and streams the container's log file.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

# (namespace, pod, container, previous) -> (log file, still running?) or None
Resolver = Callable[[str, str, str, bool], tuple[Path, Callable[[], bool]] | None]


def _tail(data: bytes, lines: int) -> bytes:
    if lines < 0:
        return data
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:]) if lines else b""


class _Handler(BaseHTTPRequestHandler):
    resolver: Resolver

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404, "only /containerLogs/<ns>/<pod>/<container> is served")
            return
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        found = self.resolver(parts[1], parts[2], parts[3], q.get("previous") == "true")
        if found is None:
            self.send_error(404, f"no log for {parts[1]}/{parts[2]}/{parts[3]}")
            return
        path, running = found
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        try:
            with open(path, "rb") as f:
                data = _tail(f.read(), int(q.get("tailLines", "-1")))
                if "limitBytes" in q:
                    data = data[: int(q["limitBytes"])]
                self.wfile.write(data)
                self.wfile.flush()
                while q.get("follow") == "true":
                    chunk = f.read()
                    if chunk:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    elif not running():
                        break
                    else:
                        time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass


def serve_logs(resolver: Resolver, cert: Path, key: Path, ca: Path) -> int:
    """Start the endpoint on 127.0.0.1 in a daemon thread; return its port."""
    handler = type("Handler", (_Handler,), {"resolver": staticmethod(resolver)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="log-server", daemon=True).start()
    return server.server_address[1]
