"""Iterator ops: an input pipeline's stream behind a handle (TensorFlow's ``IteratorV2``,
``IteratorGetNext``), plus the two a checkpointable position needs.

- ``IteratorV2`` yields the handle of the iterator named ``shared_name``, whose pipeline
  is the dataset registered in this process under the token ``dataset``
  (``flowmill.kernels.iterator``); an ``initializable`` one is read only once sought.
- ``IteratorGetNext`` takes the next element; its outputs are typed from the attrs, so the
  model built on them has static dtypes and shapes. At the end of the stream it raises
  ``OutOfRangeError``.
- ``IteratorSeek`` puts the stream at a position (elements delivered): 0 starts it again,
  a restored job's step count resumes it. ``IteratorPosition`` reads the position.

The kernels are CPU only and the ops are meant to stand on the task that runs the script:
``flowmill.runtime.data`` builds them under a device of ``CPU:0`` with no job or task,
which placement completes with the session's own task.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Operation, Tensor, apply_op
from ..op_def import define_op

_SPEC = {"output_types": None, "output_shapes": None}


def _spec(attrs) -> list[tuple]:
    types = attrs["output_types"]
    if not types:
        raise ShapeError("attr output_types must list at least one dtype")
    out_shapes = attrs["output_shapes"]
    if out_shapes is None:
        out_shapes = [None] * len(types)
    if len(out_shapes) != len(types):
        raise ShapeError(
            f"attr output_shapes lists {len(out_shapes)} shapes for {len(types)} types"
        )
    return [(dtypes.as_dtype(t), shapes.as_shape(s)) for t, s in zip(types, out_shapes,
                                                                       strict=True)]


def _check_handle(handle: Tensor) -> None:
    if handle.dtype != dtypes.resource:
        raise ShapeError(f"input 0 must be an iterator handle (resource), got {handle.dtype}")


@define_op(
    "IteratorV2",
    attrs={**_SPEC, "shared_name": "", "dataset": "", "initializable": False},
    num_inputs=0,
    stateful=True,
    differentiable=False,
)
def _iterator_shape(inputs, attrs):
    _spec(attrs)
    if not isinstance(attrs["dataset"], str) or not attrs["dataset"]:
        raise ShapeError("attr dataset must name a registered dataset")
    return [(dtypes.resource, ())]


@define_op(
    "IteratorGetNext", attrs=dict(_SPEC), num_inputs=1, stateful=True, differentiable=False
)
def _get_next_shape(inputs, attrs):
    _check_handle(inputs[0])
    return _spec(attrs)


@define_op("IteratorSeek", num_inputs=2, stateful=True, differentiable=False)
def _seek_shape(inputs, attrs):
    _check_handle(inputs[0])
    position = inputs[1]
    if position.dtype.kind not in "iu" or not shapes.compatible(position.shape, ()):
        raise ShapeError(
            f"the position must be an integer scalar, got {shapes.fmt(position.shape)} "
            f"{position.dtype}"
        )
    return []


@define_op("IteratorPosition", num_inputs=1, stateful=True, differentiable=False)
def _position_shape(inputs, attrs):
    _check_handle(inputs[0])
    return [(dtypes.int64, ())]


def iterator_handle(types, out_shapes, shared_name: str, dataset: str,
                    initializable: bool = False, name=None) -> Tensor:
    attrs = {
        "output_types": tuple(types),
        "output_shapes": tuple(out_shapes),
        "shared_name": shared_name,
        "dataset": dataset,
        "initializable": bool(initializable),
    }
    return apply_op("IteratorV2", [], attrs, name or "Iterator").outputs[0]


def iterator_get_next(handle: Tensor, types, out_shapes, name=None) -> list[Tensor]:
    attrs = {"output_types": tuple(types), "output_shapes": tuple(out_shapes)}
    return list(apply_op("IteratorGetNext", [handle], attrs, name or "IteratorGetNext").outputs)


def iterator_seek(handle: Tensor, position: Tensor, name=None) -> Operation:
    return apply_op("IteratorSeek", [handle, position], None, name or "IteratorSeek")


def iterator_position(handle: Tensor, name=None) -> Tensor:
    return apply_op("IteratorPosition", [handle], None, name or "IteratorPosition").outputs[0]
