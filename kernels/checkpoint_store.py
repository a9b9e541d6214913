"""Consistent checkpoints in object storage.

A checkpoint is a directory ``<prefix>/ckpt-<step:012d>/`` holding one safetensors file per
shard and a ``MANIFEST.json``. Object stores have no rename, so the manifest is the commit:
it is written last, with a conditional create, and lists every shard with its size and
CRC32C. A directory without a manifest (a save cut short by preemption) does not exist as
far as readers are concerned, and the newest checkpoint is found by listing manifests, never
through a pointer object that could name an uncommitted step.

The manifest lists each shard's tensors (name, dtype, shape, byte range); a tensor that is
one shard of a larger table also records its ``slice`` of it (the table's name and shape,
its first row and row stride: ``TensorSlice``), so the table can be put back together, or
split another way, from whichever shards hold it.

Every shard upload gets an object name of its own (``ps-0.<token>.safetensors``), so two
writers of one step never overwrite each other's bytes: the manifest names the files it
vouches for, and only one manifest of a step can be created.

Retention counts only verified checkpoints: every shard read back and its CRC32C checked,
once, then recorded as an empty ``VERIFIED.<manifest digest>`` object that a listing shows.
A checkpoint found damaged is quarantined, not deleted: its manifest moves into a
``QUARANTINED.<digest>.json`` record with the reason, so it is neither restored nor counted
and its step can be saved again, while its files stay for inspection until retention
passes them by. Old checkpoints are deleted only once ``keep`` newer ones are verified, and
never the one a job restored from or the one just committed.

Every parameter-server task writes its own shard with :func:`write_shard` at the same step;
one task then calls :func:`commit`. ``flowmill.runtime.saver.Saver`` does both as
graph ops, on the tasks that hold the variables.

The file is long because it is the one place that knows the checkpoint's layout in a
store (directory and shard names, manifest, markers, quarantine records): writing,
reading, verifying and pruning all share its private path and listing helpers, and split
apart they would have to export them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import struct
import threading
import warnings
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import google_crc32c
import numpy as np
from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
from obstore.store import LocalStore, MemoryStore, S3Store

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
VERIFIED = "VERIFIED."  # + the manifest's digest: every shard of that manifest read back intact
QUARANTINED = "QUARANTINED."  # + the digest of the manifest it replaced, + ".json"
FORMAT = "flowmill-checkpoint"
VERSION = 1
SUFFIX = ".safetensors"
# Multipart part size. S3 wants parts of at least 5 MiB and allows 10,000 of them, so
# larger shards get larger parts.
CHUNK_SIZE = 16 << 20
MIN_PART_SIZE = 5 << 20
MAX_PARTS = 9_000
MAX_CONCURRENCY = 8
# Reads: ranges of at least this size are fetched concurrently.
RANGE_SIZE = 64 << 20
READ_CONCURRENCY = 4

_DIR_RE = re.compile(r"ckpt-(\d{12,})")
SHARD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

# safetensors dtype codes for the NumPy types it can hold (little-endian data).
_CODES = {
    np.dtype("float64"): "F64",
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("int64"): "I64",
    np.dtype("uint64"): "U64",
    np.dtype("int32"): "I32",
    np.dtype("uint32"): "U32",
    np.dtype("int16"): "I16",
    np.dtype("uint16"): "U16",
    np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
    np.dtype("complex64"): "C64",
}
_DTYPES = {code: dtype.newbyteorder("<") for dtype, code in _CODES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, committed or used as asked."""


class CheckpointExistsError(CheckpointError):
    """The step is already committed: a checkpoint is never overwritten."""


class CorruptCheckpointError(CheckpointError):
    """A shard's bytes do not match what its manifest promises."""

    def __init__(self, path: str, reason: str, expected: Any = None, actual: Any = None):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.expected = expected
        self.actual = actual


class NoUsableCheckpointError(CheckpointError):
    """Checkpoints exist and every one is damaged: starting over would silently discard the
    job's progress, so a restore fails naming each of them and why."""

    def __init__(self, where: str, damaged: Iterable[tuple[str, str]], hint: str = ""):
        self.where = where
        self.damaged = list(damaged)
        listed = "; ".join(f"{directory}: {reason}" for directory, reason in self.damaged)
        text = f"no usable checkpoint under {where}: all {len(self.damaged)} are damaged ({listed})"
        super().__init__(f"{text}. {hint}" if hint else text)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete, unreadable or corrupt)."""


# ---- descriptions


@dataclass(frozen=True)
class TensorSlice:
    """Which rows of a larger logical tensor a saved tensor holds: rows ``offset``,
    ``offset + stride``, ... of ``full_name`` (shaped ``full_shape``), as many as the saved
    tensor has. A table sharded by ``id % n`` saves shard ``p`` with offset ``p`` and stride
    ``n``; one split into consecutive ranges saves each range with stride 1. Recorded so a
    checkpoint restores into any other split of the table (TensorFlow's
    ``save_slice_info`` of a partitioned variable)."""

    full_name: str
    full_shape: tuple[int, ...]
    offset: int
    stride: int

    def __post_init__(self):
        if not isinstance(self.full_name, str) or not self.full_name:
            raise ValueError(f"a slice needs the full tensor's name, got {self.full_name!r}")
        if not self.full_shape or any(int(d) < 0 for d in self.full_shape):
            raise ValueError(
                f"slice of {self.full_name!r}: full shape {self.full_shape} must have a row "
                "axis and known dims"
            )
        if self.stride < 1 or not 0 <= self.offset < max(self.full_shape[0], 1):
            raise ValueError(
                f"slice of {self.full_name!r}: offset {self.offset} and stride {self.stride} "
                f"do not fit its {self.full_shape[0]} rows"
            )

    def check_rows(self, shape: tuple[int, ...], name: str) -> None:
        """``ValueError`` unless a tensor of ``shape`` fits this slice: the full rows' width
        and no row past the end."""
        shape = tuple(shape)
        if (
            len(shape) != len(self.full_shape)
            or shape[1:] != tuple(self.full_shape[1:])
            or (shape[0] and self.offset + self.stride * (shape[0] - 1) >= self.full_shape[0])
        ):
            raise ValueError(
                f"tensor {name!r} of shape {shape} is no slice of {self.full_name!r} "
                f"{tuple(self.full_shape)} at offset {self.offset}, stride {self.stride}"
            )

    def to_json(self) -> dict:
        return {
            "full_name": self.full_name,
            "full_shape": list(self.full_shape),
            "offset": self.offset,
            "stride": self.stride,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> TensorSlice:
        return cls(
            str(d["full_name"]),
            tuple(int(n) for n in d["full_shape"]),
            int(d["offset"]),
            int(d["stride"]),
        )


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # NumPy name, e.g. "float32"
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range in the shard file, for ranged reads
    slice: TensorSlice | None = None  # the rows of a larger tensor it holds, if it is a slice


@dataclass(frozen=True)
class ShardInfo:
    name: str
    path: str  # object path in the store
    size: int
    crc32c: int
    tensors: tuple[TensorInfo, ...]

    def to_json(self) -> dict:
        # The manifest names files relative to its directory, so a checkpoint can be copied.
        return {
            "name": self.name,
            "file": self.path.rsplit("/", 1)[-1],
            "size": self.size,
            "crc32c": self.crc32c,
            "tensors": [_tensor_json(t) for t in self.tensors],
        }

    @classmethod
    def from_json(cls, d: Mapping, directory: str) -> ShardInfo:
        file = d["file"]
        if not isinstance(file, str) or "/" in file or not file:
            raise ValueError(f"shard {d.get('name')!r} has a bad file name {file!r}")
        tensors = tuple(
            TensorInfo(
                str(t["name"]),
                str(np.dtype(t["dtype"])),
                tuple(int(n) for n in t["shape"]),
                (int(t["offsets"][0]), int(t["offsets"][1])),
                None if t.get("slice") is None else TensorSlice.from_json(t["slice"]),
            )
            for t in d["tensors"]
        )
        return cls(
            str(d["name"]), _join(directory, file), int(d["size"]), int(d["crc32c"]), tensors
        )


def _tensor_json(t: TensorInfo) -> dict:
    """A tensor's manifest entry; ``slice`` only for a slice, so manifests of unsliced
    tensors read the same as before slices existed."""
    entry = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offsets": list(t.offsets)}
    if t.slice is not None:
        entry["slice"] = t.slice.to_json()
    return entry


@dataclass(frozen=True)
class Manifest:
    step: int
    path: str  # of MANIFEST.json
    created: str  # ISO 8601, UTC
    shards: tuple[ShardInfo, ...]
    metadata: dict = field(default_factory=dict)
    digest: str = ""  # CRC32C of the manifest's bytes: names its VERIFIED marker

    @property
    def marker(self) -> str:
        """The object whose presence says this manifest's shards were all read back intact."""
        return _join(self.directory, VERIFIED + self.digest)

    @property
    def directory(self) -> str:
        return self.path.rsplit("/", 1)[0] if "/" in self.path else ""

    def shard(self, name: str) -> ShardInfo:
        for s in self.shards:
            if s.name == name:
                return s
        raise CheckpointError(
            f"checkpoint {self.directory} has no shard {name!r} "
            f"(it has {', '.join(s.name for s in self.shards) or 'none'})"
        )

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.shards)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "created": self.created,
            "metadata": self.metadata,
            "shards": [s.to_json() for s in self.shards],
        }

    @classmethod
    def from_json(cls, d: Mapping, path: str, digest: str = "") -> Manifest:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest (format {d.get('format')!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"manifest version {d.get('version')!r}, this reader knows {VERSION}")
        directory = path.rsplit("/", 1)[0] if "/" in path else ""
        metadata = d.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata is a {type(metadata).__name__}, not an object")
        return cls(
            int(d["step"]),
            path,
            str(d["created"]),
            tuple(ShardInfo.from_json(s, directory) for s in d["shards"]),
            metadata,
            digest,
        )


# ---- stores and paths


def open_store(uri: str, options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(store, prefix)`` for ``file:///abs/dir``, ``memory://[prefix]`` or
    ``s3://bucket/prefix``.

    S3 settings come from ``options`` (``endpoint``, ``region``, ``access_key_id``,
    ``secret_access_key``, ``allow_http``, or any other obstore ``S3Config`` key), falling
    back to ``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY`` and ``AWS_ALLOW_HTTP``. Each ``memory://`` call opens a new,
    empty store: share the returned store to share its contents.
    """
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    path = unquote(parts.path)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"checkpoint URI {uri!r}: file URIs name a local path (file:///dir)")
        if not os.path.isabs(path):
            raise ValueError(f"checkpoint URI {uri!r}: the path must be absolute")
        return LocalStore(prefix=path, mkdir=True, automatic_cleanup=True), ""
    if scheme == "memory":
        return MemoryStore(), _norm(unquote(parts.netloc) + path)
    if scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise ValueError(f"checkpoint URI {uri!r} names no bucket (s3://bucket/prefix)")
        config, client_options = _s3_settings(options or {})
        store = S3Store(parts.netloc, config=config, client_options=client_options)
        return store, _norm(path)
    raise ValueError(
        f"checkpoint URI {uri!r}: unsupported scheme {parts.scheme!r} (use file, memory or s3)"
    )


_S3_ALIASES = {
    "access_key": "access_key_id",
    "secret": "secret_access_key",
    "secret_key": "secret_access_key",
    "endpoint_url": "endpoint",
}
_S3_ENV = {
    "endpoint": "AWS_ENDPOINT_URL",
    "region": "AWS_REGION",
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
}


def _s3_settings(options: Mapping[str, Any]) -> tuple[dict, dict]:
    config: dict[str, Any] = {}
    for key, env in _S3_ENV.items():
        if os.environ.get(env):
            config[key] = os.environ[env]
    allow_http = os.environ.get("AWS_ALLOW_HTTP")
    for key, value in options.items():
        key = _S3_ALIASES.get(key, key)
        if key == "allow_http":
            allow_http = value
        elif value is not None:
            config[key] = value
    client_options = {}
    if allow_http is not None:
        client_options["allow_http"] = _truthy(allow_http)
    return config, client_options


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _norm(prefix: str) -> str:
    return prefix.strip("/")


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def checkpoint_dir(prefix: str, step: int) -> str:
    return _join(prefix, f"ckpt-{step:012d}")


def _check_step(step: int) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
    return int(step)


def _check_shard_name(name: str) -> None:
    if not isinstance(name, str) or not SHARD_NAME_RE.fullmatch(name) or name == MANIFEST:
        raise ValueError(
            f"shard name {name!r} must be letters, digits, '.', '_' or '-' (a file name)"
        )


def _exists(store, path: str) -> bool:
    try:
        store.head(path)
    except (NotFoundError, FileNotFoundError):
        return False
    return True


def _delete(store, paths: Iterable[str]) -> None:
    """Delete each path; one already gone is no error (local stores raise for it)."""
    for path in paths:
        try:
            store.delete(path)
        except (NotFoundError, FileNotFoundError):
            pass


def _digest(body: bytes) -> str:
    return f"{google_crc32c.value(body):08x}"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---- writing


def _layout(
    tensors: Mapping[str, Any], slices: Mapping[str, TensorSlice] | None = None
) -> tuple[bytes, list[np.ndarray], list[TensorInfo]]:
    """The safetensors header and the byte views of each array, in file order.

    Tensors are ordered by element size (then name), as safetensors does, so every tensor's
    data starts aligned for its type once the header is padded to 8 bytes. ``slices`` says
    which tensors are slices of a larger one (checked against their shapes).
    """
    slices = dict(slices or {})
    unknown = sorted(set(slices) - set(tensors))
    if unknown:
        raise ValueError(f"slices given for tensors not saved: {unknown}")
    entries = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} cannot be stored in a checkpoint")
        array = np.asarray(value)
        code = _CODES.get(array.dtype.newbyteorder("="))
        if code is None:
            raise TypeError(
                f"tensor {name!r} has dtype {array.dtype}, which a checkpoint cannot hold "
                f"(supported: {', '.join(str(d) for d in _CODES)})"
            )
        little = array.dtype.newbyteorder("<")
        if array.dtype != little:
            array = array.astype(little)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")  # not ascontiguousarray: it makes scalars 1-d
        if name in slices:
            slices[name].check_rows(array.shape, name)
        entries.append((-array.dtype.itemsize, name, code, array))
    entries.sort(key=lambda e: (e[0], e[1]))
    header: dict[str, dict] = {}
    views, offset = [], 0
    for _, name, code, array in entries:
        nbytes = array.nbytes
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        views.append(array.reshape(-1).view(np.uint8))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    infos = []
    for _, name, _, array in entries:
        begin, end = header[name]["data_offsets"]
        dtype = str(array.dtype.newbyteorder("="))
        infos.append(
            TensorInfo(
                name, dtype, array.shape, (len(head) + begin, len(head) + end), slices.get(name)
            )
        )
    return head, views, infos


def write_shard(
    store,
    prefix: str,
    step: int,
    shard_name: str,
    tensors: Mapping[str, np.ndarray],
    *,
    chunk_size: int = CHUNK_SIZE,
    max_concurrency: int = MAX_CONCURRENCY,
    slices: Mapping[str, TensorSlice] | None = None,
) -> ShardInfo:
    """Upload one shard as safetensors; the CRC32C is computed while the bytes stream out.
    ``slices`` names the tensors that are slices of a larger one (a sharded table's
    shards), recorded in the shard's manifest entry.

    The object name is unique to this upload, so a second writer of the same step (a
    restarted chief racing its predecessor, two jobs on one URI) cannot change the bytes a
    manifest already vouches for. The arrays are streamed straight from their buffers (no
    serialized copy is built) as a multipart upload. They must not change until this returns.
    """
    step = _check_step(step)
    _check_shard_name(shard_name)
    directory = checkpoint_dir(prefix, step)
    if _exists(store, _join(directory, MANIFEST)):
        raise CheckpointExistsError(
            f"checkpoint step {step} ({directory} in {_name(store)}) is already committed; "
            f"refusing to overwrite shard {shard_name!r} of it"
        )
    head, views, infos = _layout(tensors, slices)
    size = len(head) + sum(v.nbytes for v in views)
    path = _join(directory, f"{shard_name}.{secrets.token_hex(6)}{SUFFIX}")
    part = max(chunk_size, MIN_PART_SIZE, -(-size // MAX_PARTS))
    if size <= part:
        blob = b"".join([head, *views])
        crc = google_crc32c.value(blob)
        store.put(path, blob, use_multipart=False)
    else:
        state = [google_crc32c.value(head)]

        def chunks() -> Iterator[Any]:
            yield head
            for view in views:
                for start in range(0, view.nbytes, part):
                    piece = view[start : start + part]
                    state[0] = google_crc32c.extend(state[0], piece)
                    yield piece

        store.put(path, chunks(), chunk_size=part, max_concurrency=max_concurrency)
        crc = state[0]
    return ShardInfo(shard_name, path, size, crc, tuple(infos))


def commit(
    store,
    prefix: str,
    step: int,
    shards: Iterable[ShardInfo],
    metadata: Mapping[str, Any] | None = None,
) -> Manifest:
    """Make the checkpoint exist by writing its manifest, after checking every shard is there.

    The manifest is created conditionally: when two committers race on one step, one wins
    and the other gets :class:`CheckpointExistsError`, after deleting the shards it wrote
    that the winning manifest does not list.
    """
    step = _check_step(step)
    shards = tuple(shards)
    directory = checkpoint_dir(prefix, step)
    names = [s.name for s in shards]
    if not shards:
        raise CheckpointError(f"commit of {directory} lists no shards")
    if len(set(names)) != len(names):
        raise CheckpointError(f"commit of {directory} lists a shard twice: {names}")
    for s in shards:
        if s.path.rsplit("/", 1)[0] != directory:
            raise CheckpointError(
                f"commit of {directory}: shard {s.name!r} was written to {s.path}, "
                "another step or prefix"
            )
        try:
            actual = store.head(s.path)["size"]
        except (NotFoundError, FileNotFoundError):
            raise CheckpointError(
                f"commit of {directory}: shard {s.name!r} ({s.path}) does not exist"
            ) from None
        if actual != s.size:
            raise CheckpointError(
                f"commit of {directory}: shard {s.name!r} ({s.path}) has {actual} bytes, "
                f"expected {s.size}"
            )
    manifest = Manifest(step, _join(directory, MANIFEST), _now(), shards, dict(metadata or {}))
    try:
        body = json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"commit of {directory}: metadata is not JSON-serializable: {e}") from None
    try:
        store.put(manifest.path, body, mode="create", use_multipart=False)
    except (AlreadyExistsError, PreconditionError, FileExistsError):
        _discard_losers(store, prefix, step, shards)
        raise CheckpointExistsError(
            f"checkpoint step {step} is already committed in {_name(store)}: {manifest.path} "
            "exists (another writer won the race for this step; this writer's shards were "
            "discarded)"
        ) from None
    return Manifest(
        manifest.step, manifest.path, manifest.created, shards, manifest.metadata, _digest(body)
    )


def _discard_losers(store, prefix: str, step: int, shards: tuple[ShardInfo, ...]) -> None:
    """Delete the shards a losing commit wrote, except any the winning manifest lists (a
    committer that lost with the winner's own shard descriptions deletes nothing)."""
    try:
        kept = {s.path for s in load_manifest(store, prefix, step).shards}
    except Exception as e:  # noqa: BLE001 - unreadable winner: leave every file to retention
        logger.warning("not discarding the losing shards of step %d: %s", step, e)
        return
    _delete(store, [s.path for s in shards if s.path not in kept])


# ---- reading


def _scan(store, prefix: str) -> dict[int, dict[str, int]]:
    """step -> {file name: size} for every checkpoint directory under the prefix."""
    root = prefix + "/" if prefix else ""
    found: dict[int, dict[str, int]] = {}
    for batch in store.list(prefix or None, chunk_size=1000):
        for meta in batch:
            rel = meta["path"][len(root) :]
            directory, _, file = rel.partition("/")
            m = _DIR_RE.fullmatch(directory)
            if m and file and "/" not in file:
                found.setdefault(int(m[1]), {})[file] = meta["size"]
    return found


def load_manifest(store, prefix: str, step: int) -> Manifest:
    """The manifest of the checkpoint at ``step`` (``NotFoundError`` if it is not committed)."""
    path = _join(checkpoint_dir(prefix, step), MANIFEST)
    body = bytes(store.get(path).bytes())
    manifest = Manifest.from_json(json.loads(body), path, _digest(body))
    if manifest.step != step:
        raise ValueError(f"it records step {manifest.step}")
    return manifest


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def _name(store) -> str:
    """The store as it reads in a message: ``LocalStore("/dir")``, ``S3Store(bucket="b")``."""
    text = repr(store)
    return type(store).__name__ if text.startswith("<") else text


def _survey(store, prefix: str, listing) -> Iterator[tuple[int, Manifest | None, str | None]]:
    """Every committed directory, newest first, as ``(step, manifest, problem)``: the
    manifest is None when it cannot be read, the problem None when every shard it lists is
    there at its size (only reading the bytes tells more)."""
    for step in sorted(listing, reverse=True):
        files = listing[step]
        if MANIFEST not in files:
            continue  # not committed (maybe a save in progress): not a checkpoint at all
        try:
            manifest = load_manifest(store, prefix, step)
        except (NotFoundError, FileNotFoundError):
            continue  # deleted or quarantined since the listing
        except (ValueError, KeyError, TypeError, IndexError) as e:
            yield step, None, f"unreadable manifest: {e}"
            continue
        problems = []
        for s in manifest.shards:
            file = s.path.rsplit("/", 1)[-1]
            if file not in files:
                problems.append(f"shard {s.name!r} ({file}) is missing")
            elif files[file] != s.size:
                problems.append(
                    f"shard {s.name!r} ({file}) has {files[file]} bytes, manifest says {s.size}"
                )
        yield step, manifest, "; ".join(problems) or None


def _complete(store, prefix: str, listing) -> Iterator[Manifest]:
    """Complete checkpoints, newest first; the damaged ones are warned about and skipped."""
    for step, manifest, problem in _survey(store, prefix, listing):
        if problem is None:
            yield manifest
            continue
        kind = "checkpoint" if manifest is None else "incomplete checkpoint"
        _warn(f"skipping {kind} {checkpoint_dir(prefix, step)} in {_name(store)}: {problem}")


def checkpoints(store, prefix: str) -> list[Manifest]:
    """Every complete checkpoint, newest first (skipped ones are warned about)."""
    return list(_complete(store, prefix, _scan(store, prefix)))


def latest(store, prefix: str) -> Manifest | None:
    """The newest complete checkpoint, found by listing (never through a pointer object)."""
    return next(_complete(store, prefix, _scan(store, prefix)), None)


def quarantined(store, prefix: str) -> list[tuple[str, str]]:
    """``(directory, reason)`` of every checkpoint taken out of use and not saved again,
    newest first."""
    return _quarantine_reasons(store, prefix, _scan(store, prefix))


def _quarantine_reasons(store, prefix: str, listing) -> list[tuple[str, str]]:
    found = []
    for step in sorted(listing, reverse=True):
        files = listing[step]
        records = sorted(f for f in files if f.startswith(QUARANTINED))
        if records and MANIFEST not in files:
            directory = checkpoint_dir(prefix, step)
            found.append((directory, _recorded_reason(store, _join(directory, records[-1]))))
    return found


def _recorded_reason(store, path: str) -> str:
    try:
        reason = json.loads(bytes(store.get(path).bytes()))["reason"]
    except (NotFoundError, FileNotFoundError, ValueError, KeyError, TypeError) as e:
        return f"quarantined (its record {path} is unreadable: {e})"
    return f"quarantined earlier: {reason}"


def quarantine(store, prefix: str, step: int, reason: str) -> str | None:
    """Take the damaged checkpoint at ``step`` out of use, keeping its files.

    Its manifest moves into a ``QUARANTINED.<digest>.json`` record holding the reason, so
    readers no longer see the checkpoint, retention no longer counts it, and the step can
    be committed again. Returns the record's path, or None when there was no manifest left
    to move (another reader quarantined it first).
    """
    directory = checkpoint_dir(prefix, step)
    path = _join(directory, MANIFEST)
    try:
        body = bytes(store.get(path).bytes())
    except (NotFoundError, FileNotFoundError):
        return None
    digest = _digest(body)
    record = _join(directory, f"{QUARANTINED}{digest}.json")
    doc = {"reason": reason, "quarantined": _now(), "manifest": body.decode("utf-8", "replace")}
    try:
        store.put(record, json.dumps(doc, indent=1).encode(), mode="create", use_multipart=False)
    except (AlreadyExistsError, PreconditionError, FileExistsError):
        pass  # the same manifest was quarantined by another reader: same record
    _delete(store, [path, _join(directory, VERIFIED + digest)])
    logger.warning("quarantined checkpoint %s in %s: %s", directory, _name(store), reason)
    return record


def verify(store, manifest: Manifest) -> None:
    """Read every shard back and check its size and CRC32C; ``CorruptCheckpointError`` for
    the first that is off. Shards stream concurrently, a chunk of each in memory at a time."""
    futures = [_reader_pool().submit(verify_shard, store, s) for s in manifest.shards]
    try:
        for future in futures:
            future.result()
    finally:
        for future in futures:
            future.cancel()


def verify_shard(store, info: ShardInfo) -> None:
    """Read one shard back and check its size and CRC32C (``CorruptCheckpointError``)."""
    try:
        result = store.get(info.path)
    except (NotFoundError, FileNotFoundError):
        raise CorruptCheckpointError(info.path, "shard file is missing", info.size, None) from None
    crc, size = 0, 0
    for chunk in result.stream(min_chunk_size=CHUNK_SIZE):
        crc = google_crc32c.extend(crc, chunk)
        size += len(chunk)
    if size != info.size:
        raise CorruptCheckpointError(
            info.path, f"size is {size} bytes, manifest expects {info.size}", info.size, size
        )
    _check_crc(info, crc)


def _check_crc(info: ShardInfo, crc: int) -> None:
    if crc != info.crc32c:
        raise CorruptCheckpointError(
            info.path,
            f"CRC32C is {crc:#010x}, manifest expects {info.crc32c:#010x}",
            info.crc32c,
            crc,
        )


def mark_verified(store, manifest: Manifest) -> None:
    """Record that every shard of ``manifest`` was read back intact, so retention can count
    it without reading it again."""
    store.put(manifest.marker, b"", use_multipart=False)


def is_verified(store, manifest: Manifest) -> bool:
    return _exists(store, manifest.marker)


def read_shard(store, manifest: Manifest, shard_name: str) -> dict[str, np.ndarray]:
    """A shard's tensors after checking its size and CRC32C against the manifest.

    Large shards are fetched as concurrent ranged reads cut at tensor boundaries, and each
    range is checksummed while later ones are still arriving. The arrays are read-only views
    of the fetched bytes (no copy); copy one to change it.
    """
    info = manifest.shard(shard_name)
    bounds = _ranges(info)
    crc, segments = 0, []
    if len(bounds) == 1:
        segments.append(_fetch(store, info, None))
        crc = google_crc32c.value(segments[0])
    else:
        futures = [_reader_pool().submit(_fetch, store, info, b) for b in bounds]
        try:
            for future in futures:  # checksum each range while later ones arrive
                segments.append(future.result())
                crc = google_crc32c.extend(crc, segments[-1])
        finally:
            for future in futures:
                future.cancel()
    _check_crc(info, crc)
    return _parse(segments, [b[0] for b in bounds], info)


def _ranges(info: ShardInfo) -> list[tuple[int, int]]:
    """Byte ranges of at least RANGE_SIZE that never split a tensor (so no tensor needs its
    pieces joined); the first holds the header."""
    cuts = [0]
    for begin, _ in sorted(t.offsets for t in info.tensors):
        if begin - cuts[-1] >= RANGE_SIZE:
            cuts.append(begin)
    cuts.append(info.size)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _fetch(store, info: ShardInfo, bounds: tuple[int, int] | None) -> np.ndarray:
    """One range of the shard (the whole object for None), its size checked."""
    options = None if bounds is None else {"range": bounds}
    try:
        result = store.get(info.path, options=options)
        data, total = result.bytes(), result.meta["size"]
    except (NotFoundError, FileNotFoundError):
        raise CorruptCheckpointError(info.path, "shard file is missing", info.size, None) from None
    except Exception:
        # A range past the end of a truncated object fails: report the size, not the range.
        data, total = b"", _size(store, info.path)
        if total == info.size:
            raise
    if total is None:
        raise CorruptCheckpointError(info.path, "shard file is missing", info.size, None)
    want = info.size if bounds is None else bounds[1] - bounds[0]
    if total != info.size or len(data) != want:
        raise CorruptCheckpointError(
            info.path, f"size is {total} bytes, manifest expects {info.size}", info.size, total
        )
    return np.frombuffer(data, dtype=np.uint8)


def _size(store, path: str) -> int | None:
    try:
        return store.head(path)["size"]
    except (NotFoundError, FileNotFoundError):
        return None


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_CONCURRENCY, thread_name_prefix="checkpoint-read")
        return _pool


def _parse(segments: list[np.ndarray], starts: list[int], info: ShardInfo) -> dict:
    """Tensors of verified safetensors bytes, checked against the manifest's listing."""
    first = segments[0]
    try:
        (n,) = struct.unpack_from("<Q", first, 0)
        header = json.loads(bytes(first[8 : 8 + n]))
        data_start = 8 + n
        tensors = {}
        for t in info.tensors:
            entry = header[t.name]
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            begin, end = (data_start + o for o in entry["data_offsets"])
            i = bisect_right(starts, begin) - 1
            seg_begin, seg_end = begin - starts[i], end - starts[i]
            if (
                str(dtype.newbyteorder("=")) != t.dtype
                or shape != t.shape
                or (begin, end) != t.offsets
                or not 0 <= seg_begin <= seg_end <= segments[i].size
                or end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            ):
                raise ValueError(f"tensor {t.name!r} disagrees with the manifest")
            array = segments[i][seg_begin:seg_end].view(dtype).reshape(shape)
            tensors[t.name] = array if dtype.isnative else array.astype(dtype.newbyteorder("="))
        extra = set(header) - {"__metadata__"} - set(tensors)
        if extra:
            raise ValueError(f"tensors not in the manifest: {sorted(extra)}")
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise CorruptCheckpointError(info.path, f"bad safetensors content: {e}") from None
    return tensors


T = TypeVar("T")


def restore_newest(
    store,
    prefix: str,
    load: Callable[[Manifest], T],
    *,
    start_fresh: bool = False,
    where: str | None = None,
) -> tuple[Manifest, T] | None:
    """``(manifest, load(manifest))`` for the newest complete checkpoint ``load`` reads
    intact, or None when the prefix holds no checkpoint at all.

    A checkpoint that is damaged (``load`` raising ``CorruptCheckpointError``, a shard
    missing, an unreadable manifest) is quarantined with a warning and the walk goes on to
    the one before. When checkpoints exist and every one is damaged (including those
    quarantined earlier), this raises ``NoUsableCheckpointError`` naming each and why,
    unless ``start_fresh``, which warns and returns None. ``where`` names the location in
    messages (default: the store).
    """
    where = where or _name(store)
    listing = _scan(store, prefix)
    damaged = _quarantine_reasons(store, prefix, listing)
    for step, manifest, problem in _survey(store, prefix, listing):
        if problem is None:
            try:
                return manifest, load(manifest)
            except CorruptCheckpointError as e:
                problem = str(e)
        directory = checkpoint_dir(prefix, step)
        _warn(f"skipping corrupt checkpoint {directory} under {where} (quarantined): {problem}")
        quarantine(store, prefix, step, problem)
        damaged.append((directory, problem))
    if not damaged:
        return None
    damaged.sort(reverse=True)
    if not start_fresh:
        raise NoUsableCheckpointError(where, damaged)
    listed = "; ".join(f"{directory}: {reason}" for directory, reason in damaged)
    _warn(f"every checkpoint under {where} is damaged ({listed}); starting fresh as configured")
    return None


def restore_latest(
    store, prefix: str, shard_names: Iterable[str] | None = None, *, start_fresh: bool = False
) -> tuple[Manifest, dict[str, dict[str, np.ndarray]]] | None:
    """Tensors of the newest checkpoint whose shards all verify, or None if there is none.

    A corrupt or truncated shard quarantines its checkpoint with a warning and falls back
    to the one before; see :func:`restore_newest` for when every one is damaged. Reading
    every shard marks the checkpoint verified.
    """
    wanted = None if shard_names is None else list(shard_names)

    def load(manifest: Manifest) -> dict[str, dict[str, np.ndarray]]:
        names = [s.name for s in manifest.shards] if wanted is None else wanted
        for name in names:
            manifest.shard(name)  # a shard the checkpoint lacks is a setup error, not damage
        return {name: read_shard(store, manifest, name) for name in names}

    found = restore_newest(store, prefix, load, start_fresh=start_fresh)
    if found is not None and wanted is None:
        mark_verified(store, found[0])
    return found


@dataclass(frozen=True)
class Pruned:
    """What a prune did: the steps it deleted, and those it quarantined with the reason."""

    deleted: list[int]
    quarantined: dict[int, str]


def prune(store, prefix: str, keep: int, protect: Iterable[int] = ()) -> Pruned:
    """Keep the newest ``keep`` verified checkpoints and delete the directories older than
    the oldest of them, except the ``protect`` steps (the one the job restored from, the one
    just committed).

    Walking newest first, a checkpoint not verified yet has every shard read back once and
    is marked verified, or quarantined when it is damaged: a corrupt checkpoint never counts
    towards ``keep``, so it cannot push the good ones out. Until ``keep`` checkpoints verify
    nothing is deleted. Everything from the oldest kept one on stays (a save in progress, a
    quarantined checkpoint inside the window). A manifest goes before its shards, so an
    interrupted prune leaves nothing half-visible.
    """
    if keep < 1:
        raise ValueError(f"prune keep must be at least 1, got {keep}")
    listing = _scan(store, prefix)
    verified: list[int] = []
    damaged: dict[int, str] = {}
    for step, manifest, problem in _survey(store, prefix, listing):
        if len(verified) == keep:
            break
        if problem is None:
            problem = _verification_problem(store, manifest, listing[step])
        if problem is None:
            verified.append(step)
        else:
            quarantine(store, prefix, step, problem)
            damaged[step] = problem
    if len(verified) < keep:
        return Pruned([], damaged)
    spared = set(protect)
    doomed = sorted(s for s in listing if s < verified[-1] and s not in spared)
    for step in doomed:
        _delete_directory(store, prefix, step, listing[step])
    return Pruned(doomed, damaged)


def _verification_problem(store, manifest: Manifest, files: Mapping[str, int]) -> str | None:
    """Why ``manifest``'s checkpoint is damaged, or None once it is verified (read back now
    unless its marker is in the listing)."""
    if VERIFIED + manifest.digest in files:
        return None
    try:
        verify(store, manifest)
    except CorruptCheckpointError as e:
        return str(e)
    mark_verified(store, manifest)
    return None


def _delete_directory(store, prefix: str, step: int, files: Iterable[str]) -> None:
    directory = checkpoint_dir(prefix, step)
    files = list(files)
    if MANIFEST in files:
        _delete(store, [_join(directory, MANIFEST)])
    rest = [_join(directory, f) for f in files if f != MANIFEST]
    try:
        if rest:
            store.delete(rest)
    except (NotFoundError, FileNotFoundError):  # a local store stops at a file gone already
        _delete(store, rest)


# ---- one task's shard uploads


class ShardWriter:
    """A task's checkpoint stores and the shard uploads it has in flight.

    Kept in the task's resources, so the op that starts an upload (``SaveShard``) and the
    op that waits for it (``ShardSaved``) find each other across steps. Uploads run one
    at a time, in order, on one thread: a save never competes with the one before it.
    """

    RESOURCE = "_checkpoint_shard_writer"

    def __init__(self):
        self._stores: dict[str, tuple[Any, str]] = {}
        self._uploads: dict[tuple[str, str, int], Future] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-upload")

    def store(self, uri: str) -> tuple[Any, str]:
        """``(store, prefix)`` for ``uri``, opened once per task (one ``memory://`` store
        is then shared by every op of the task that names it)."""
        with self._lock:
            found = self._stores.get(uri)
            if found is None:
                found = self._stores[uri] = open_store(uri)
            return found

    def start(
        self,
        uri: str,
        shard: str,
        step: int,
        tensors: dict[str, np.ndarray],
        slices: Mapping[str, TensorSlice] | None = None,
    ) -> None:
        """Upload ``tensors`` (which must not change until it is done) in the background;
        ``slices`` as ``write_shard``'s."""
        store, prefix = self.store(uri)
        key = (uri, shard, _check_step(step))
        with self._lock:
            running = self._uploads.get(key)
            if running is not None and not running.done():
                raise CheckpointError(
                    f"shard {shard!r} of {checkpoint_dir(prefix, step)} is already being saved"
                )
            self._uploads[key] = self._executor.submit(
                write_shard, store, prefix, step, shard, tensors, slices=slices
            )

    def result(self, uri: str, shard: str, step: int) -> ShardInfo:
        """Wait for the upload of ``shard`` at ``step`` and forget it; its error if it failed."""
        with self._lock:
            upload = self._uploads.pop((uri, shard, int(step)), None)
        if upload is None:
            raise CheckpointError(
                f"no save of shard {shard!r} at step {step} under {uri} was started on this task"
            )
        return upload.result()

    def close(self, cancel_pending_enqueues: bool = True) -> None:
        self._executor.shutdown(wait=False, cancel_futures=cancel_pending_enqueues)


def shard_writer(resources) -> ShardWriter:
    return resources.get_or_create(ShardWriter.RESOURCE, ShardWriter)
