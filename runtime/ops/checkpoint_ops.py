"""Checkpoint ops: every task that holds variables writes and reads its own shard.

Saving is graph, as TensorFlow's sharded ``SaveV2`` + ``MergeV2Checkpoints`` are, so it
runs wherever the variables live and no variable's bytes cross the network:

- ``SaveShard`` is placed with a parameter server's variables and takes their values
  (reads hand out the variables' buffers; updates are copy-on-write, so the values stay
  as read). It starts the shard's upload on that task, in the background, and returns:
  a save stalls training no longer than the reads (plus a device-to-host copy on a GPU).
- ``ShardSaved`` waits for that upload and yields the shard's description (JSON bytes).
- ``CommitCheckpoint`` writes the manifest listing every shard, which alone makes the
  checkpoint exist, then keeps the newest ``keep`` verified checkpoints (never deleting
  the step it was given as restored from).
- ``RestoreShard`` reads one shard of a committed checkpoint back, on the task that
  assigns it to its variables.

The URI (``file://``, ``s3://``, ``memory://``) is an attr; each task opens its own store
from it (S3 credentials from that task's environment). The ``slices`` attr of
``SaveShard`` and ``RestoreShard`` names the tensors that are shards of a larger table and
the rows of it each holds, so a checkpoint restores into another split of the table.
"""

from __future__ import annotations

import json

from flowmill.kernels import shapes
from flowmill.kernels.checkpoint import decode_slices, encode_slices
from flowmill.kernels.checkpoint_store import SHARD_NAME_RE, TensorSlice, open_store
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Operation, Tensor, apply_op, convert_to_tensor
from ..op_def import define_op

_WHERE = {"uri": "", "shard": ""}


def _check_step(step: Tensor) -> None:
    if step.dtype.kind not in "iu" or not shapes.compatible(step.shape, ()):
        raise ShapeError(
            f"input 0 (the step) must be an integer scalar, got {shapes.fmt(step.shape)} "
            f"{step.dtype}"
        )


def _check_where(attrs) -> None:
    uri, shard = attrs["uri"], attrs["shard"]
    if not isinstance(uri, str) or "://" not in uri:
        raise ShapeError(
            f"attr uri must be a checkpoint URI (file://, s3://, memory://), got {uri!r}"
        )
    if not isinstance(shard, str) or not SHARD_NAME_RE.fullmatch(shard):
        raise ShapeError(f"attr shard must be a shard name like 'ps-0', got {shard!r}")


def _check_names(names, count: int) -> list[str]:
    names = list(names or ())
    if len(names) != count:
        raise ShapeError(f"attr names lists {len(names)} tensors for {count} values")
    if len(set(names)) != len(names):
        raise ShapeError(f"attr names lists a tensor twice: {names}")
    if not all(isinstance(n, str) and n for n in names):
        raise ShapeError(f"attr names must be non-empty strings, got {names}")
    return names


def _check_slices(attrs, shapes_of: dict) -> None:
    """The ``slices`` attr: JSON naming tensors of this op, each a slice its shape fits."""
    try:
        slices = decode_slices(attrs["slices"])
    except (ValueError, KeyError, TypeError) as e:
        raise ShapeError(f"attr slices is not a name -> slice map: {e}") from None
    for name, s in slices.items():
        if name not in shapes_of:
            raise ShapeError(f"attr slices names {name!r}, which is not one of attr names")
        shape = shapes_of[name]
        if shape is not None and None not in shape:
            try:
                s.check_rows(shape, name)
            except ValueError as e:
                raise ShapeError(str(e)) from None


@define_op(
    "SaveShard",
    attrs={**_WHERE, "names": (), "slices": ""},
    stateful=True,
    differentiable=False,
)
def _save_shard_shape(inputs, attrs):
    if not inputs:
        raise ShapeError("SaveShard needs the step as input 0")
    _check_step(inputs[0])
    _check_where(attrs)
    names = _check_names(attrs["names"], len(inputs) - 1)
    _check_slices(attrs, {n: t.shape for n, t in zip(names, inputs[1:], strict=True)})
    return []


@define_op("ShardSaved", attrs=dict(_WHERE), num_inputs=1, stateful=True, differentiable=False)
def _shard_saved_shape(inputs, attrs):
    _check_step(inputs[0])
    _check_where(attrs)
    return [(dtypes.uint8, (None,))]


@define_op(
    "CommitCheckpoint",
    attrs={"uri": "", "keep": 0, "metadata": ""},
    stateful=True,
    differentiable=False,
)
def _commit_shape(inputs, attrs):
    if len(inputs) < 3:
        raise ShapeError(
            "CommitCheckpoint needs the step, the step restored from and at least one shard "
            "description"
        )
    _check_step(inputs[0])
    if inputs[1].dtype.kind not in "iu" or not shapes.compatible(inputs[1].shape, ()):
        raise ShapeError(
            f"input 1 (the step restored from, -1 for none) must be an integer scalar, got "
            f"{shapes.fmt(inputs[1].shape)} {inputs[1].dtype}"
        )
    for i, t in enumerate(inputs[2:], 2):
        if t.dtype != dtypes.uint8 or not shapes.compatible(t.shape, (None,)):
            raise ShapeError(
                f"input {i} must be a shard description (uint8 vector), got "
                f"{shapes.fmt(t.shape)} {t.dtype}"
            )
    if not isinstance(attrs["keep"], int) or attrs["keep"] < 0:
        keep = attrs["keep"]
        raise ShapeError(f"attr keep must be >= 0 (0 keeps every checkpoint), got {keep!r}")
    return [(dtypes.int64, ())]


@define_op(
    "RestoreShard",
    attrs={**_WHERE, "names": (), "dtypes": (), "shapes": (), "slices": ""},
    num_inputs=1,
    stateful=True,
    differentiable=False,
)
def _restore_shape(inputs, attrs):
    _check_step(inputs[0])
    _check_where(attrs)
    names = _check_names(attrs["names"], len(attrs["names"] or ()))
    kinds, dims = list(attrs["dtypes"] or ()), list(attrs["shapes"] or ())
    if not len(names) == len(kinds) == len(dims):
        raise ShapeError(
            f"attrs names, dtypes and shapes differ in length: {len(names)}, {len(kinds)}, "
            f"{len(dims)}"
        )
    dims = [shapes.as_shape(s) for s in dims]
    _check_slices(attrs, dict(zip(names, dims, strict=True)))
    return [(dtypes.as_dtype(k), s) for k, s in zip(kinds, dims, strict=True)]


# ---- constructors


def _step_tensor(step) -> Tensor:
    """A Python int is an int64 step; a tensor is checked by the shape functions."""
    return convert_to_tensor(step, dtype=dtypes.int64 if isinstance(step, int) else None)


def save_shard(
    uri: str,
    shard: str,
    step,
    tensors: dict,
    name: str | None = None,
    slices: dict[str, TensorSlice] | None = None,
) -> Operation:
    """Start writing ``tensors`` (name -> tensor) as shard ``shard`` of the checkpoint at
    ``step`` under ``uri``; ``shard_saved`` waits for it. ``slices`` records, for the
    tensors that are shards of a larger table, the rows of the table each holds."""
    open_store(uri)  # a malformed URI fails here, where the graph is built
    values = list(tensors.values())
    return apply_op(
        "SaveShard",
        [_step_tensor(step), *values],
        {
            "uri": uri,
            "shard": shard,
            "names": tuple(tensors),
            "slices": encode_slices(slices or {}),
        },
        name or "SaveShard",
    )


def shard_saved(uri: str, shard: str, step, name: str | None = None) -> Tensor:
    """The description of shard ``shard`` at ``step`` once this task has written it."""
    return apply_op(
        "ShardSaved", [_step_tensor(step)], {"uri": uri, "shard": shard}, name or "ShardSaved"
    ).outputs[0]


def commit_checkpoint(
    uri: str, step, shards: list[Tensor], keep: int = 0, metadata: dict | None = None,
    name: str | None = None, restored=-1,
) -> Tensor:
    """Write the manifest of the checkpoint at ``step`` listing ``shards`` (descriptions from
    ``shard_saved``); then keep only the newest ``keep`` verified ones (0: all), never
    deleting step ``restored`` (the one the job started from; -1: none). Yields the step."""
    return apply_op(
        "CommitCheckpoint",
        [_step_tensor(step), _step_tensor(restored), *shards],
        {"uri": uri, "keep": keep, "metadata": json.dumps(metadata or {}, sort_keys=True)},
        name or "CommitCheckpoint",
    ).outputs[0]


def restore_shard(
    uri: str,
    shard: str,
    step,
    specs: dict,
    name: str | None = None,
    slices: dict[str, TensorSlice] | None = None,
) -> list[Tensor]:
    """The tensors of shard ``shard`` of the checkpoint at ``step``; ``specs`` maps each
    tensor's name to its (dtype, shape), checked against what the checkpoint holds.
    ``slices`` names the tensors that are shards of a larger table and the rows of it
    each holds: those are assembled from however the checkpoint split the table."""
    open_store(uri)
    kinds = tuple(dtypes.as_dtype(d) for d, _ in specs.values())
    dims = tuple(shapes.as_shape(s) for _, s in specs.values())
    op = apply_op(
        "RestoreShard",
        [_step_tensor(step)],
        {
            "uri": uri,
            "shard": shard,
            "names": tuple(specs),
            "dtypes": kinds,
            "shapes": dims,
            "slices": encode_slices(slices or {}),
        },
        name or "RestoreShard",
    )
    return list(op.outputs)
