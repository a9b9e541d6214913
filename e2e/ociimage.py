"""A one-binary container image made by hand: Debian's static busybox in an OCI archive.

No registry is reachable from the test machines, so the real node's images are written
here and imported into its containerd (``ctr images import``). The archive is an OCI image
layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) with one uncompressed layer
holding ``/bin/busybox`` and a symlink per applet, and one manifest per image name, all
sharing that layer. Byte-for-byte reproducible (fixed owners and times), so the digests are
stable between runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: no shared libraries needed
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
PASSWD = "root:x:0:0:root:/root:/bin/sh\nflowmill:x:1000:1000:flowmill:/tmp:/bin/sh\n"
GROUP = "root:x:0:\nflowmill:x:1000:\n"


@dataclass(frozen=True)
class Image:
    """One image of the archive: its name and the runtime config of its manifest."""

    name: str  # e.g. flowmill.local/busybox:e2e (a registry-qualified name: no docker.io)
    cmd: list[str] = field(default_factory=lambda: ["/bin/sh"])
    entrypoint: list[str] = field(default_factory=list)
    user: str = "1000:1000"


def _applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True)
    return sorted({a for a in out.stdout.split() if a and "/" not in a and a != "busybox"})


def _layer() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, 0, link
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for d in ("bin", "dev", "etc", "proc", "sys", "root", "var"):
            add(d, tarfile.DIRTYPE, 0o755)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        add("etc/passwd", tarfile.REGTYPE, 0o644, PASSWD.encode())
        add("etc/group", tarfile.REGTYPE, 0o644, GROUP.encode())
        add("bin/busybox", tarfile.REGTYPE, 0o755, BUSYBOX.read_bytes())
        for applet in _applets():
            add(f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox")
    return buf.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_archive(path: Path, images: list[Image]) -> None:
    """Write an OCI archive holding ``images`` (linux/amd64) to ``path``."""
    blobs: dict[str, bytes] = {}
    layer = _layer()
    layer_desc = _blob(blobs, layer, OCI_LAYER)
    manifests = []
    for img in images:
        config = {
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": img.cmd, "Entrypoint": img.entrypoint or None,
                       "User": img.user, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
            "history": [{"created_by": "flowmill e2e: /bin/busybox from busybox-static"}],
        }
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": _blob(blobs, _json(config), OCI_CONFIG), "layers": [layer_desc]}
        desc = _blob(blobs, _json(manifest), OCI_MANIFEST)
        desc["platform"] = {"architecture": "amd64", "os": "linux"}
        desc["annotations"] = {"io.containerd.image.name": img.name,
                               "org.opencontainers.image.ref.name": img.name.rsplit(":", 1)[1]}
        manifests.append(desc)
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": manifests}
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": _json(index)}
    files.update({f"blobs/sha256/{d.split(':', 1)[1]}": b for d, b in blobs.items()})
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
