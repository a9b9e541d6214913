"""Pinned versions and cached binary paths, read from ``versions.env``.

One file pins every version so ``build.sh`` and the Python harness can never disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSIONS_FILE = HERE / "versions.env"
BUILD_SCRIPT = HERE / "build.sh"


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse the ``KEY=value`` lines of the shell-style versions file."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("\"'")
    return out


def cache_dir() -> Path:
    """Root of the version-keyed cache; outside the repository so clones share it."""
    return Path(os.environ.get("FLOWMILL_CACHE", Path.home() / ".cache" / "flowmill"))


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of the pinned binaries in the cache."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    helm: Path
    weed: Path

    def missing(self) -> list[Path]:
        """Binaries not yet built (``build.sh`` creates them)."""
        return [p for p in vars(self).values() if not os.access(p, os.X_OK)]


def binaries() -> Binaries:
    """Paths of the binaries that match ``versions.env``."""
    v = read_versions()
    b = cache_dir() / "bin"
    k = v["KUBERNETES_VERSION"]
    return Binaries(
        etcd=b / f"etcd-{v['ETCD_VERSION']}",
        kube_apiserver=b / f"kube-apiserver-{k}",
        kube_controller_manager=b / f"kube-controller-manager-{k}",
        kube_scheduler=b / f"kube-scheduler-{k}",
        kubectl=b / f"kubectl-v{v['KUBECTL_VERSION']}",
        helm=b / f"helm-{v['HELM_VERSION']}",
        weed=b / f"weed-{v['SEAWEEDFS_VERSION']}",
    )


def kubelet_binary() -> Path:
    """The kubelet of the real node (``e2e.realnode``); not in ``Binaries``, whose
    ``missing()`` gates every e2e test, while only the real node needs it."""
    return cache_dir() / "bin" / f"kubelet-{read_versions()['KUBERNETES_VERSION']}"


def kueue_binary() -> Path:
    """Kueue (``e2e.kueue``); not in ``Binaries`` either: only the Kueue tests need it."""
    return cache_dir() / "bin" / f"kueue-{read_versions()['KUEUE_VERSION']}"


def kueue_manifests() -> Path:
    """The manifests Kueue ships (CRDs, the conversion patches its kustomization enables,
    webhook configurations, the manager's ClusterRole), copied out of the Go module cache
    by ``build.sh kueue`` so that ``clean-caches`` does not take them."""
    return cache_dir() / f"kueue-{read_versions()['KUEUE_VERSION']}"
