"""Checkpoint kernels: shard uploads through the task's ``ShardWriter``, manifests, reads.

``SaveShard`` keeps the arrays it is handed without copying them (a variable update after
the read writes a new buffer while anyone holds the old one), so on a CPU the save costs
the training step nothing but the reads; device arrays are copied to host memory first.
"""

from __future__ import annotations

import json

import numpy as np

from . import shapes
from .checkpoint_store import (
    CheckpointError,
    CheckpointExistsError,
    ShardInfo,
    commit,
    load_manifest,
    logger,
    mark_verified,
    prune,
    read_shard,
    shard_writer,
    verify_shard,
)
from .registry import KernelContext, kernel


def _to_host(value) -> np.ndarray:
    get = getattr(value, "get", None)  # CuPy arrays copy to host with .get()
    return value if isinstance(value, np.ndarray) else get() if callable(get) else np.asarray(value)


@kernel("SaveShard")
def _save_shard(ctx: KernelContext):
    uri, shard, names = ctx.attrs["uri"], ctx.attrs["shard"], tuple(ctx.attrs["names"])
    writer = shard_writer(ctx.resources)

    def fn(step, *values):
        writer.start(uri, shard, int(step), dict(zip(names, map(_to_host, values), strict=True)))

    return fn


@kernel("ShardSaved")
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


@kernel("CommitCheckpoint")
def _commit(ctx: KernelContext):
    uri, keep = ctx.attrs["uri"], ctx.attrs["keep"]
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


@kernel("RestoreShard")
def _restore_shard(ctx: KernelContext):
    """This task's variables from a checkpoint, found by name in whichever of its shards
    holds them: a checkpoint written with another layout (more or fewer PS tasks, one
    process) restores as well as one written by this job."""
    a = ctx.attrs
    uri = a["uri"]
    specs = list(zip(a["names"], a["dtypes"], a["shapes"], strict=True))
    writer, asarray = shard_writer(ctx.resources), ctx.xp.asarray

    def fn(step):
        store, prefix = writer.store(uri)
        manifest = load_manifest(store, prefix, int(step))
        holder = manifest_holders(manifest)
        missing = [name for name, _, _ in specs if name not in holder]
        if missing:
            raise CheckpointError(missing_message(manifest, missing, holder))
        read = {}
        for shard in dict.fromkeys(holder[name] for name, _, _ in specs):
            read[shard] = read_shard(store, manifest, shard)  # whole, its CRC32C checked
        out = []
        for name, dtype, shape in specs:
            shard = holder[name]
            array = read[shard][name]
            if array.dtype != dtype or not shapes.compatible(shape, array.shape):
                raise CheckpointError(
                    f"variable {name!r} is {shapes.fmt(shape)} {dtype}; shard {shard!r} of "
                    f"{manifest.directory} holds {shapes.fmt(array.shape)} {array.dtype}"
                )
            out.append(asarray(array))
        return out[0] if len(out) == 1 else tuple(out)

    return fn


def manifest_holders(manifest) -> dict[str, str]:
    """Each variable name in a checkpoint -> the shard that holds it."""
    return {t.name: s.name for s in manifest.shards for t in s.tensors}


def missing_message(manifest, missing: list[str], holder: dict[str, str]) -> str:
    held = sorted(holder)
    shown = ", ".join(held[:8]) + (f", ... ({len(held)} in all)" if len(held) > 8 else "")
    return (
        f"checkpoint {manifest.directory} holds no variable {', '.join(map(repr, missing))} "
        f"(it holds {shown or 'none'}): it was written by another model, or the "
        "variables were renamed"
    )
