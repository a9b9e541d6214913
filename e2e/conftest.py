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
from .kueue import Kueue
from .kueue import missing_requirements as kueue_missing
from .realnode import RealNode, missing_requirements
from .versions import BUILD_SCRIPT, binaries


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: needs the local Kubernetes control plane and S3 server (e2e/)")
    config.addinivalue_line(
        "markers", "image: builds (e2e/image.sh) and runs the project's images with podman")


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: build only for tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build what is missing once, before any test's timeout starts ticking."""
    build = os.environ.get("FLOWMILL_E2E_BUILD", "1") != "0"
    if any(item.get_closest_marker("e2e") and "cluster" in getattr(item, "fixturenames", ())
           for item in items):
        if binaries().missing() and build:
            subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    # The real node's kubelet, add-ons and Debian packages, only when a selected test uses
    # it and the node can run here at all (it needs root; without, its tests skip).
    if build and os.geteuid() == 0 and any(
            "real_node" in getattr(item, "fixturenames", ()) for item in items) and (
            missing_requirements()):
        subprocess.run(["bash", str(BUILD_SCRIPT), "kubelet", "kube-proxy", "coredns",
                        "node-packages"], check=True)
    if build and any("kueue" in getattr(item, "fixturenames", ()) for item in items) and (
            kueue_missing()):
        subprocess.run(["bash", str(BUILD_SCRIPT), "kueue"], check=True)
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


@pytest.fixture(scope="module")
def real_node(cluster: Cluster) -> Iterator[RealNode]:
    """A real node (kubelet + containerd + runc + CNI) registered with the cluster as
    ``real-0``, labelled and tainted ``flowmill.dev/node-kind=real``. Opt-in, one per test
    module that asks for it (it starts in seconds), gone with its pods and Node object
    once the module is done, so other modules see only the stand-in. Pods reach it with
    ``spec.nodeName: real-0``, or through the cluster's scheduler by selecting and
    tolerating the node's kind (``flowmill.dev/node-kind=real``), with images
    imported with ``real_node.import_archive`` and ``imagePullPolicy: Never``."""
    missing = missing_requirements()
    if missing:
        pytest.skip(f"the real node needs: {missing}")
    node = RealNode(cluster)
    node.start()
    try:
        yield node
    finally:
        problems = node.stop()
        assert not problems, f"real node clean-up: {problems}"


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[Kueue]:
    """Kueue (``e2e.kueue``) with its CRDs and the webhooks of its API group. Opt-in, one
    per test module that asks for it (it starts in seconds); its CRDs, with every queue and
    workload, its webhook configurations and RBAC are gone once the module is done, so
    other modules see the cluster without it."""
    missing = kueue_missing()
    if missing:
        pytest.skip(f"Kueue needs: {missing}")
    k = Kueue(cluster)
    k.start()
    try:
        yield k
    finally:
        k.stop()


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
