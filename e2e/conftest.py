"""Fixtures for the end-to-end tests: one control plane per session, a namespace per test.

Binaries missing from the cache are built before the first test runs (outside the
per-test timeout), unless ``FLOWMILL_E2E_BUILD=0``, in which case the tests are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from .cluster import Cluster
from .versions import BUILD_SCRIPT, binaries


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: needs the local Kubernetes control plane and S3 server (e2e/)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build what is missing once, before any test's timeout starts ticking."""
    if not any(item.get_closest_marker("e2e") for item in items):
        return
    if binaries().missing() and os.environ.get("FLOWMILL_E2E_BUILD", "1") != "0":
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """etcd + kube-apiserver + kube-controller-manager + SeaweedFS S3 + node stand-in."""
    missing = binaries().missing()
    if missing:
        pytest.skip(f"e2e binaries not built (run e2e/build.sh): {[p.name for p in missing]}")
    c = Cluster()
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted afterwards (without waiting)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    # Pods are refused until the controller-manager has made the default ServiceAccount.
    deadline = time.monotonic() + 60
    while cluster.get("serviceaccount", "default", name) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}")
        time.sleep(0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
