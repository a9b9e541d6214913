"""Checkpoint kernels: shard uploads through the task's ``ShardWriter``, manifests, reads.

``SaveShard`` keeps the arrays it is handed without copying them (a variable update after
the read writes a new buffer while anyone holds the old one), so on a CPU the save costs
the training step nothing but the reads; device arrays are copied to host memory first.

A sharded table's shards are saved with the slice of the full table each holds
(``TensorSlice``: full name and shape, first row, row stride). ``RestoreShard`` finds each
variable by name, or, where the checkpoint split the table another way (more or fewer
shards, or one whole variable), assembles the variable's rows from the saved slices:
``plan_restore`` works out from the manifest alone which rows of which saved tensor go
where, so a mismatch is reported before anything is read or assigned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from . import shapes
from .checkpoint_store import (
    CheckpointError,
    CheckpointExistsError,
    ShardInfo,
    TensorInfo,
    TensorSlice,
    commit,
    load_manifest,
    logger,
    mark_verified,
    prune,
    read_shard,
    shard_writer,
    verify_shard,
)
from .registry import KernelContext, kernel, to_host

_HOST = "reads and writes files"


def check_writable(ctx: KernelContext, uri: str) -> None:
    """A task of a job with a checkpoint URI writes checkpoints under it only: a graph
    that names another place (a request from outside the job) is refused when compiled."""
    root = ctx.resources.checkpoint_root
    if root and uri.rstrip("/") != root.rstrip("/") and \
            not uri.startswith(root.rstrip("/") + "/"):
        raise ValueError(
            f"{ctx.op_type} {ctx.name!r} writes to {uri!r}; checkpoints are written only "
            f"under this job's {root!r}"
        )


@kernel("SaveShard", host_only=_HOST)
def _save_shard(ctx: KernelContext):
    uri, shard, names = ctx.attrs["uri"], ctx.attrs["shard"], tuple(ctx.attrs["names"])
    check_writable(ctx, uri)
    slices = decode_slices(ctx.attrs.get("slices"))
    writer = shard_writer(ctx.resources)

    def fn(step, *values):
        tensors = dict(zip(names, map(to_host, values), strict=True))
        writer.start(uri, shard, int(step), tensors, slices)

    return fn


@kernel("ShardSaved", host_only=_HOST)
def _shard_saved(ctx: KernelContext):
    uri, shard = ctx.attrs["uri"], ctx.attrs["shard"]
    writer = shard_writer(ctx.resources)

    def fn(step):
        try:
            info = writer.result(uri, shard, int(step))
        except CheckpointExistsError as e:
            raise CheckpointExistsError(f"saving step {int(step)} to {uri}: {e}") from None
        # Read back here, on the task that wrote it: the checkpoint is verified before its
        # manifest exists, and no variable bytes travel to the task that commits.
        verify_shard(writer.store(uri)[0], info)
        description = {**info.to_json(), "path": info.path, "verified": True}
        return np.frombuffer(json.dumps(description).encode(), np.uint8)

    return fn


@kernel("CommitCheckpoint", host_only=_HOST)
def _commit(ctx: KernelContext):
    uri, keep = ctx.attrs["uri"], ctx.attrs["keep"]
    check_writable(ctx, uri)
    metadata = json.loads(ctx.attrs["metadata"] or "{}")
    writer = shard_writer(ctx.resources)

    def fn(step, restored, *descriptions):
        store, prefix = writer.store(uri)
        step = int(step)
        try:
            manifest = commit(store, prefix, step, map(_shard_info, descriptions), metadata)
        except CheckpointExistsError as e:
            raise CheckpointExistsError(f"saving step {step} to {uri}: {e}") from None
        if all(json.loads(bytes(np.asarray(d, np.uint8))).get("verified") for d in descriptions):
            mark_verified(store, manifest)  # every shard was read back by its own task
        if keep:
            _retain(store, prefix, uri, keep, (step, int(restored)))
        return np.int64(manifest.step)

    return fn


def _shard_info(description) -> ShardInfo:
    data = json.loads(bytes(np.asarray(description, np.uint8)))
    info = ShardInfo.from_json(data, data["path"].rsplit("/", 1)[0])
    if info.path != data["path"]:
        raise CheckpointError(f"shard {info.name!r} description names {data['path']}")
    return info


def _retain(store, prefix: str, uri: str, keep: int, protect: tuple[int, int]) -> None:
    """Prune to ``keep`` verified checkpoints, sparing ``protect`` (the step just committed
    and the one restored from). A new checkpoint its shards' tasks could not all verify is
    verified here: one that does not read back intact is quarantined and reported, as the
    save did not leave a usable checkpoint."""
    step = protect[0]
    try:
        pruned = prune(store, prefix, keep, protect)
    except Exception as e:  # noqa: BLE001 - committed; old checkpoints just stay a while longer
        logger.warning("pruning checkpoints under %s failed: %s", uri, e)
        return
    if step in pruned.quarantined:
        raise CheckpointError(
            f"checkpoint step {step} under {uri} was committed but does not read back intact "
            f"({pruned.quarantined[step]}); it is quarantined"
        )


@kernel("RestoreShard", host_only=_HOST)
def _restore_shard(ctx: KernelContext):
    """This task's variables from a checkpoint, found by name in whichever of its shards
    holds them, or assembled row by row from the slices of the table they belong to: a
    checkpoint written with another layout (more or fewer PS tasks, one process, a table
    split into another number of shards) restores as well as one written by this job.
    Each shard file is read whole (its CRC32C covers the whole file), one at a time, and
    let go once its rows are copied out."""
    a = ctx.attrs
    uri = a["uri"]
    slices = decode_slices(a.get("slices"))
    wanted = [
        Wanted(name, np.dtype(dtype), shape, slices.get(name))
        for name, dtype, shape in zip(a["names"], a["dtypes"], a["shapes"], strict=True)
    ]
    writer, asarray = shard_writer(ctx.resources), ctx.xp.asarray

    def fn(step):
        store, prefix = writer.store(uri)
        manifest = load_manifest(store, prefix, int(step))
        plans = plan_restore(manifest, wanted)
        values = assemble(plans, lambda shard: read_shard(store, manifest, shard))
        out = [asarray(v) for v in values]
        return out[0] if len(out) == 1 else tuple(out)

    return fn


# ---- which saved tensors a restore reads


@dataclass(frozen=True)
class Wanted:
    """A variable to restore: its name, dtype and shape (None: whatever the checkpoint
    holds) and, for a shard of a sharded table, the slice of the full table it holds."""

    name: str
    dtype: np.dtype | None
    shape: tuple | None
    slice: TensorSlice | None = None


@dataclass(frozen=True)
class Piece:
    """Rows ``src`` of the saved tensor ``tensor`` of shard ``shard`` go to rows ``dst``
    of the variable (``None``: the whole tensor is the variable)."""

    shard: str
    tensor: str
    dst: slice | None = None
    src: slice | None = None


@dataclass(frozen=True)
class Plan:
    """How one variable is read: its shape and dtype, and the pieces that fill it."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def plan_restore(manifest, wanted: Iterable[Wanted]) -> list[Plan]:
    """Where each wanted variable's value comes from in ``manifest``'s checkpoint, checked
    (names, dtypes, shapes, that the saved slices cover their table) without reading any
    data; ``CheckpointError`` naming the variables that cannot be restored from it."""
    catalog = _Catalog(manifest)
    plans, missing = [], []
    for w in wanted:
        plan = catalog.plan(w)
        if plan is None:
            name = w.slice.full_name if w.slice is not None else w.name
            if name not in missing:
                missing.append(name)
        else:
            plans.append(plan)
    if missing:
        raise CheckpointError(missing_message(manifest, missing))
    return plans


def assemble(plans: list[Plan], read: Callable[[str], Mapping]) -> list[np.ndarray]:
    """The values ``plans`` describe; ``read(shard)`` gives a shard's tensors. Shards are
    read one at a time, in order, and dropped once their rows are copied out, so at most
    one shard file is held beside the values (a whole variable keeps its shard's buffer:
    it is a view of it)."""
    out: list[np.ndarray | None] = [None] * len(plans)
    shards = sorted({p.shard for plan in plans for p in plan.pieces})
    for shard in shards:
        tensors = read(shard)
        for i, plan in enumerate(plans):
            for piece in plan.pieces:
                if piece.shard != shard:
                    continue
                array = tensors[piece.tensor]
                if piece.dst is None:
                    out[i] = array
                    continue
                if out[i] is None:
                    out[i] = np.empty(plan.shape, plan.dtype)
                out[i][piece.dst] = array[piece.src]
        del tensors
    for i, plan in enumerate(plans):
        if out[i] is None:  # no rows: nothing to read
            out[i] = np.empty(plan.shape, plan.dtype)
    return out


class _Catalog:
    """A manifest's tensors by name, and its sliced tables by full name."""

    def __init__(self, manifest):
        self.manifest = manifest
        self.held: dict[str, tuple[str, TensorInfo]] = {}
        self.tables: dict[str, list[tuple[str, TensorInfo]]] = {}
        for s in manifest.shards:
            for t in s.tensors:
                self.held[t.name] = (s.name, t)
                if t.slice is not None:
                    self.tables.setdefault(t.slice.full_name, []).append((s.name, t))

    def plan(self, w: Wanted) -> Plan | None:
        found = self.held.get(w.name)
        if w.slice is None:
            if found is not None:
                return self._whole(w, *found)
            return self._rows(w, w.name, None)
        if found is not None and found[1].slice == w.slice:
            return self._whole(w, *found)  # the table is split as it was saved
        if w.slice.full_name in self.tables or w.slice.full_name in self.held:
            return self._rows(w, w.slice.full_name, w.slice)
        if found is not None and found[1].slice is None:
            return self._whole(w, *found)  # saved before slices were recorded: by name
        return None

    def _whole(self, w: Wanted, shard: str, info: TensorInfo) -> Plan:
        dtype = np.dtype(info.dtype)
        if not _same_dtype(w, dtype) or not shapes.compatible(w.shape, info.shape):
            raise CheckpointError(
                f"variable {w.name!r} is {shapes.fmt(w.shape)} {w.dtype}; shard {shard!r} "
                f"of {self.manifest.directory} holds {shapes.fmt(info.shape)} {info.dtype}"
            )
        return Plan(w.name, dtype, tuple(info.shape), (Piece(shard, info.name),))

    def _rows(self, w: Wanted, full_name: str, target: TensorSlice | None) -> Plan | None:
        """The plan of a variable that is ``target``'s rows of table ``full_name`` (the
        whole table when ``target`` is None), from the slices the checkpoint holds of it."""
        sources = self._sources(full_name)
        if sources is None:
            return None
        dtype, full_shape, where = self._table(full_name, sources)
        wanted_full = target.full_shape if target is not None else w.shape
        if not _same_dtype(w, dtype) or not shapes.compatible(wanted_full, full_shape):
            what = f"{shapes.fmt(wanted_full)} {w.dtype}"
            if target is not None:
                what = f"rows {target.offset}::{target.stride} of {full_name!r}, {what}"
            raise CheckpointError(
                f"variable {w.name!r} is {what}; {self.manifest.directory} holds "
                f"{full_name!r} as {shapes.fmt(full_shape)} {dtype} ({where})"
            )
        if target is None:
            target = TensorSlice(full_name, full_shape, 0, 1)
            shape = tuple(full_shape)
        else:
            shape = tuple(w.shape)
        pieces = []
        for shard, info, held in sources:
            overlap = _overlap(
                (target.offset, target.stride, shape[0]),
                (held.offset, held.stride, info.shape[0]),
            )
            if overlap is not None:
                pieces.append(Piece(shard, info.name, *overlap))
        return Plan(w.name, dtype, shape, tuple(pieces))

    def _sources(self, full_name: str) -> list[tuple[str, TensorInfo, TensorSlice]] | None:
        """The saved tensors holding rows of ``full_name``, each with the slice it holds:
        its slices, or the one whole tensor of that name (a table saved unsharded)."""
        if full_name in self.tables:
            return [(shard, t, t.slice) for shard, t in self.tables[full_name]]
        found = self.held.get(full_name)
        if found is None:
            return None
        shard, info = found
        if not info.shape:
            raise CheckpointError(
                f"{self.manifest.directory} holds {full_name!r} as a scalar, not a table "
                "whose rows a sharded variable can take"
            )
        return [(shard, info, TensorSlice(full_name, tuple(info.shape), 0, 1))]

    def _table(self, full_name: str, sources) -> tuple[np.dtype, tuple[int, ...], str]:
        """The table's dtype and full shape, after checking its slices agree on them and
        hold every row once; and where it is, for messages."""
        dtypes = {np.dtype(info.dtype) for _, info, _ in sources}
        full_shapes = {tuple(held.full_shape) for _, _, held in sources}
        shards = sorted({s for s, _, _ in sources})
        where = (
            f"{len(sources)} slice{'s' * (len(sources) != 1)}, in shard"
            f"{'s' * (len(shards) != 1)} {', '.join(shards)}"
        )
        if len(dtypes) != 1 or len(full_shapes) != 1:
            raise CheckpointError(
                f"{self.manifest.directory}: the slices of {full_name!r} disagree on its "
                f"dtype or shape ({', '.join(sorted(map(str, dtypes | full_shapes)))})"
            )
        (full_shape,) = full_shapes
        rows = [(held.offset, held.stride, info.shape[0]) for _, info, held in sources]
        held_rows = sum(n for _, _, n in rows)
        overlapping = any(
            _overlap(a, b) is not None for i, a in enumerate(rows) for b in rows[i + 1 :]
        )
        if held_rows != full_shape[0] or overlapping:
            raise CheckpointError(
                f"{self.manifest.directory} holds {held_rows} rows of the "
                f"{full_shape[0]}-row table {full_name!r} ({where})"
                + (", some of them twice" if overlapping else "")
                + ": the checkpoint does not hold the whole table once (a shard was left "
                "out of the save?)"
            )
        return dtypes.pop(), full_shape, where


def _same_dtype(w: Wanted, dtype: np.dtype) -> bool:
    return w.dtype is None or np.dtype(w.dtype) == dtype


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[slice, slice] | None:
    """Where two row progressions meet: ``a`` holds rows ``a0 + da*i`` for ``i < na``, ``b``
    rows ``b0 + db*j`` for ``j < nb``. The rows both hold are ``a``'s ``i`` in one
    progression and ``b``'s ``j`` in another (the Chinese remainder theorem); returns
    those two as slices, or None when they share no row."""
    a0, da, na = a
    b0, db, nb = b
    g = math.gcd(da, db)
    if (b0 - a0) % g:
        return None
    step_i, step_j = db // g, da // g
    # da*i = b0 - a0 (mod db): i0 is the least solution
    i0 = 0 if step_i == 1 else ((b0 - a0) // g * pow(da // g, -1, step_i)) % step_i
    j0 = (a0 + da * i0 - b0) // db  # may be negative: the row precedes b's first
    k_lo = max(-(i0 // step_i), -(j0 // step_j))  # ceil(-i0 / step_i), ceil(-j0 / step_j)
    k_hi = min((na - 1 - i0) // step_i, (nb - 1 - j0) // step_j)
    if k_lo > k_hi:
        return None
    i_lo, j_lo = i0 + step_i * k_lo, j0 + step_j * k_lo
    count = k_hi - k_lo + 1
    return (
        slice(i_lo, i_lo + step_i * (count - 1) + 1, step_i),
        slice(j_lo, j_lo + step_j * (count - 1) + 1, step_j),
    )


# ---- names, for messages and listings


def logical_variables(manifest) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a checkpoint holds as a model sees it: every tensor that is no slice, and every
    sliced table once under its full name, each name -> (dtype, shape)."""
    out = {}
    for s in manifest.shards:
        for t in s.tensors:
            if t.slice is None:
                out.setdefault(t.name, (t.dtype, tuple(t.shape)))
            else:
                out.setdefault(t.slice.full_name, (t.dtype, tuple(t.slice.full_shape)))
    return out


def missing_message(manifest, missing: list[str]) -> str:
    held = sorted(logical_variables(manifest))
    shown = ", ".join(held[:8]) + (f", ... ({len(held)} in all)" if len(held) > 8 else "")
    return (
        f"checkpoint {manifest.directory} holds no variable {', '.join(map(repr, missing))} "
        f"(it holds {shown or 'none'}): it was written by another model, or the "
        "variables were renamed"
    )


# ---- slices as op attrs


def encode_slices(slices: Mapping[str, TensorSlice]) -> str:
    """The ``slices`` attr of ``SaveShard`` and ``RestoreShard``: JSON, name -> slice."""
    return json.dumps({name: s.to_json() for name, s in sorted(slices.items())}) if slices else ""


def decode_slices(text: str | None) -> dict[str, TensorSlice]:
    if not text:
        return {}
    return {name: TensorSlice.from_json(d) for name, d in json.loads(text).items()}
