"""The project's images as ``e2e/image.sh`` builds them: references, podman's settings.

The script is the one source of the image keys and of podman's configuration; this module
asks it (``image.sh ref``, ``image.sh env``) rather than repeating either.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .versions import cache_dir

HERE = Path(__file__).resolve().parent
IMAGE_SCRIPT = HERE / "image.sh"
# Why the images could not be built at collection (conftest), for the tests to fail with.
IMAGE_BUILD_ERROR = pytest.StashKey[str]()


def _script(*args: str) -> str:
    out = subprocess.run(["bash", str(IMAGE_SCRIPT), *args], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"image.sh {' '.join(args)} exited {out.returncode}: {out.stderr}")
    return out.stdout.strip()


def podman_env() -> dict[str, str]:
    """This process's environment with podman pointed at the script's configuration."""
    env = dict(os.environ)
    for line in _script("env").splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def image_ref(target: str) -> str:
    """``localhost/flowmill:<key>`` (cpu), ``...-cuda`` (cuda) for the current sources."""
    return _script("ref", target)


@dataclass(frozen=True)
class Image:
    target: str
    ref: str
    size_bytes: int
    build_seconds: int | None  # as the script measured it, when it built the image


def inspect(target: str, env: dict[str, str]) -> Image | None:
    """The built image of ``target`` for the current sources, or None if there is none."""
    ref = image_ref(target)
    try:
        out = subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", ref],
                             capture_output=True, text=True, env=env, timeout=60)
    except FileNotFoundError:  # no podman: e2e/image.sh installs it
        return None
    if out.returncode != 0:
        return None
    key = ref.rsplit(":", 1)[1].removesuffix("-cuda")
    seconds = cache_dir() / "images" / f"{target}-{key}.seconds"
    built = int(seconds.read_text()) if seconds.exists() else None
    return Image(target, ref, int(out.stdout.strip()), built)


def save_archive(ref: str, env: dict[str, str]) -> Path:
    """``podman save`` of a built image, as the archive a node's runtime imports
    (``ctr images import``; no registry here), kept beside the images and named by the
    image's key so that an unchanged image is saved once; older archives are removed."""
    folder = cache_dir() / "images" / "archives"
    folder.mkdir(parents=True, exist_ok=True)
    name = ref.rsplit("/", 1)[-1].replace(":", "-")
    archive = folder / f"{name}.tar"
    if not archive.exists():
        for old in folder.glob("*.tar"):
            old.unlink()
        tmp = archive.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(tmp), ref],
                       env=env, check=True, capture_output=True, timeout=600)
        tmp.rename(archive)
    return archive
