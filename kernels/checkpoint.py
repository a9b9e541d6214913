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
    ShardInfo,
    commit,
    load_manifest,
    logger,
    prune,
    read_shard,
    shard_writer,
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
        info = writer.result(uri, shard, int(step))
        description = {**info.to_json(), "path": info.path}
        return np.frombuffer(json.dumps(description).encode(), np.uint8)

    return fn


@kernel("CommitCheckpoint")
def _commit(ctx: KernelContext):
    uri, keep = ctx.attrs["uri"], ctx.attrs["keep"]
    metadata = json.loads(ctx.attrs["metadata"] or "{}")
    writer = shard_writer(ctx.resources)

    def fn(step, *descriptions):
        store, prefix = writer.store(uri)
        shards = []
        for d in descriptions:
            data = json.loads(bytes(np.asarray(d, np.uint8)))
            info = ShardInfo.from_json(data, data["path"].rsplit("/", 1)[0])
            if info.path != data["path"]:
                raise CheckpointError(f"shard {info.name!r} description names {data['path']}")
            shards.append(info)
        manifest = commit(store, prefix, int(step), shards, metadata)
        if keep:
            try:
                prune(store, prefix, keep)
            except Exception as e:  # committed; old checkpoints just stay a while longer
                logger.warning("pruning checkpoints under %s failed: %s", uri, e)
        return np.int64(manifest.step)

    return fn


@kernel("RestoreShard")
def _restore_shard(ctx: KernelContext):
    a = ctx.attrs
    uri, shard = a["uri"], a["shard"]
    specs = list(zip(a["names"], a["dtypes"], a["shapes"], strict=True))
    writer, asarray = shard_writer(ctx.resources), ctx.xp.asarray

    def fn(step):
        store, prefix = writer.store(uri)
        manifest = load_manifest(store, prefix, int(step))
        if shard not in manifest:
            held = ", ".join(s.name for s in manifest.shards)
            raise CheckpointError(
                f"checkpoint {manifest.directory} has no shard {shard!r} (it has {held}); "
                "was it written by a job with other parameter servers?"
            )
        tensors = read_shard(store, manifest, shard)
        out = []
        for name, dtype, shape in specs:
            array = tensors.get(name)
            if array is None:
                raise CheckpointError(
                    f"shard {shard!r} of {manifest.directory} holds no variable {name!r}"
                )
            if array.dtype != dtype or not shapes.compatible(shape, array.shape):
                raise CheckpointError(
                    f"variable {name!r} is {shapes.fmt(shape)} {dtype}; shard {shard!r} of "
                    f"{manifest.directory} holds {shapes.fmt(array.shape)} {array.dtype}"
                )
            out.append(asarray(array))
        return out[0] if len(out) == 1 else tuple(out)

    return fn
