"""The operator's connection to the API server: who it is, and how fast it may ask.

Both kopf's watches and the controller's own requests use one identity: in a pod its
ServiceAccount, elsewhere ``$KUBECONFIG``. The controller's requests go through a
client-side rate limit (``FLOWMILL_API_QPS`` requests per second on average, bursts of
``FLOWMILL_API_BURST``), as client-go's clients have, so a burst of reconciles (a
thousand jobs applied at once, an operator restarting among them) spreads its writes
instead of crowding out everyone else's requests; the API server's priority and fairness
protects it in turn. kopf's watch requests are long-lived and are not counted.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

ENV_QPS = "FLOWMILL_API_QPS"  # 0: no limit
ENV_BURST = "FLOWMILL_API_BURST"
DEFAULT_QPS = 100.0
DEFAULT_BURST = 200


def client_configuration() -> client.Configuration:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG (or ~/.kube/config)."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        # $KUBECONFIG as it is now: the client library reads it once, at import.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                client_configuration=cfg)
    return cfg


def connection_info(cfg: client.Configuration,
                    settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The same identity for kopf's own watches as for the controller's API calls."""
    header = (cfg.get_api_key_with_prefix("BearerToken")
              or cfg.get_api_key_with_prefix("authorization") or "")
    scheme, _, token = header.partition(" ") if " " in header else ("", "", header)
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        username=cfg.username or None, password=cfg.password or None,
        scheme=scheme or None, token=token or None,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        trust_env=settings.networking.trust_env)


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


class LimitedApiClient(client.ApiClient):
    """The client library's ApiClient, every request taking a token first."""

    def __init__(self, configuration: client.Configuration, limit: RateLimit) -> None:
        super().__init__(configuration)
        self.limit = limit

    def request(self, *args: Any, **kwargs: Any) -> Any:
        self.limit.acquire()
        return super().request(*args, **kwargs)


def rate_limit_from_env() -> RateLimit:
    qps_text = os.environ.get(ENV_QPS, "").strip()
    burst_text = os.environ.get(ENV_BURST, "").strip()
    try:
        qps = float(qps_text) if qps_text else DEFAULT_QPS
    except ValueError:
        raise ValueError(f"{ENV_QPS} must be a number of requests per second (0: no "
                         f"limit), got {qps_text!r}") from None
    if burst_text and not burst_text.isdigit():
        raise ValueError(f"{ENV_BURST} must be a whole number of requests, got {burst_text!r}")
    return RateLimit(qps, int(burst_text) if burst_text else DEFAULT_BURST)
