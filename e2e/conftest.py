"""Fixtures for the end-to-end tests: one control plane per session, a namespace per test.

Binaries missing from the cache are built before the first test that needs the cluster
runs (outside the per-test timeout), unless ``FLOWMILL_E2E_BUILD=0``, in which case those
tests are skipped. Likewise the images (``e2e/image.sh``) before the first ``image`` test,
unless ``FLOWMILL_IMAGE_BUILD=0``; those tests fail, not skip, if the images are missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from .cluster import Cluster
from .images import IMAGE_BUILD_ERROR, IMAGE_SCRIPT
from .versions import BUILD_SCRIPT, binaries


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: needs the local Kubernetes control plane and S3 server (e2e/)")
    config.addinivalue_line(
        "markers", "image: builds (e2e/image.sh) and runs the project's images with podman")


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: build only for tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build what is missing once, before any test's timeout starts ticking."""
    if any(item.get_closest_marker("e2e") and "cluster" in getattr(item, "fixturenames", ())
           for item in items):
        if binaries().missing() and os.environ.get("FLOWMILL_E2E_BUILD", "1") != "0":
            subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    if (any(item.get_closest_marker("image") for item in items) and sys.platform == "linux"
            and os.environ.get("FLOWMILL_IMAGE_BUILD", "1") != "0"):
        # The script skips what is built (a fraction of a second); a failure fails the image
        # tests with its message rather than the whole session.
        out = subprocess.run(["bash", str(IMAGE_SCRIPT)], capture_output=True, text=True)
        if out.returncode != 0:
            config.stash[IMAGE_BUILD_ERROR] = (
                f"{IMAGE_SCRIPT} exited {out.returncode}:\n{out.stderr[-4000:]}")


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
