"""``top_k`` and ``in_top_k``: the k largest entries of each row, and precision-at-k.

``k`` is an attr (TensorFlow's ``TopK``), so the output shape is static. TopK's gradient
routes each value's gradient back to where it came from with one UnsortedSegmentSum over
the flattened input, whose size is read at run time, so an unknown batch size is fine.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, require_float
from .array_ops import (
    expand_dims,
    range_,
    reshape,
    reshape_to_shape_of,
    shape,
    strided_slice,
    unsorted_segment_sum,
    zeros_like,
)
from .math_ops import size


def _check_k(k, what: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ShapeError(f"{what}: k must be a non-negative Python int, got {k!r}")
    return k


@define_op("TopK", attrs={"k": None}, num_inputs=1)
def _top_k_shape(inputs, attrs):
    (x,) = inputs
    k = _check_k(attrs["k"], "TopK")
    if x.dtype.kind not in "fiu":
        raise ShapeError(f"TopK needs a real-valued input, got {x.dtype}")
    if x.shape is None:
        return [(x.dtype, None), (dtypes.int32, None)]
    if not x.shape:
        raise ShapeError("TopK input must have rank >= 1, got a scalar")
    n = x.shape[-1]
    if n is not None and n < k:
        raise ShapeError(f"input has {n} entries in its last dim, fewer than k={k}")
    out = x.shape[:-1] + (k,)
    return [(x.dtype, out), (dtypes.int32, out)]


@define_op("InTopK", attrs={"k": None}, num_inputs=2, differentiable=False)
def _in_top_k_shape(inputs, attrs):
    predictions, targets = inputs
    _check_k(attrs["k"], "InTopK")
    require_float(predictions)
    if targets.dtype.kind not in "iu":
        raise ShapeError(f"targets must be integer class ids, {targets.name} is {targets.dtype}")
    if predictions.shape is not None and len(predictions.shape) != 2:
        raise ShapeError(
            f"predictions must be [batch, classes], have shape {shapes.fmt(predictions.shape)}"
        )
    if targets.shape is not None and len(targets.shape) != 1:
        raise ShapeError(f"targets must be [batch], have shape {shapes.fmt(targets.shape)}")
    batch = None if predictions.shape is None else predictions.shape[:1]
    if not shapes.compatible(batch, targets.shape):
        raise ShapeError(
            f"targets {shapes.fmt(targets.shape)} and predictions "
            f"{shapes.fmt(predictions.shape)} disagree on the batch size"
        )
    return [(dtypes.bool_, shapes.merge(batch, targets.shape) or (None,))]


def top_k(input, k: int = 1, sorted: bool = True, name=None) -> tuple[Tensor, Tensor]:  # noqa: A002
    """(values, indices) of the ``k`` largest entries along the last axis, largest first;
    equal values keep their index order. Always sorted (TensorFlow allows that for
    ``sorted=False`` too). Indices are int32."""
    x = convert_to_tensor(input)
    op = apply_op("TopK", [x], {"k": _check_k(k, "top_k")}, name)
    return op.outputs[0], op.outputs[1]


def in_top_k(predictions, targets, k: int, name=None) -> Tensor:
    """Per row: is ``targets[i]`` among the ``k`` highest ``predictions[i]``? A target tied
    with the k-th highest counts as in; a row with a non-finite score never is."""
    predictions = convert_to_tensor(predictions)
    targets = convert_to_tensor(targets)
    attrs = {"k": _check_k(k, "in_top_k")}
    return apply_op("InTopK", [predictions, targets], attrs, name).outputs[0]


@defvjp("TopK")
def _top_k_grad(op, g_values, g_indices):
    x, indices = op.inputs[0], op.outputs[1]
    k = op.attrs["k"]
    if k == 0:
        return [zeros_like(x)]
    n = x.shape[-1] if x.shape is not None and x.shape[-1] is not None else None
    width = n if n is not None else strided_slice(shape(x), -1)
    total = size(x)
    # Row r's index i is entry r * n + i of the flattened input.
    offsets = expand_dims(range_(0, total, width), 1)
    flat = reshape(reshape(indices, (-1, k)) + offsets, (-1,))
    dx = unsorted_segment_sum(reshape(g_values, (-1,)), flat, total)
    return [reshape_to_shape_of(dx, x)]
