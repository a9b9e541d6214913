"""``where``: TensorFlow 1.x's Select, an elementwise choice between two tensors.

``x`` and ``y`` have one shape; the condition is a scalar (pick one tensor whole), has
that shape (pick entry by entry), or is a vector over the first dim (pick whole rows).
That is TensorFlow 1.x's contract; NumPy-style broadcasting of ``x`` against ``y`` (TF2's
``where_v2``) is not part of it and is refused with the shapes named.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, require_same_dtype
from .array_ops import zeros_like


@define_op("Select", num_inputs=3)
def _select_shape(inputs, attrs):
    c, x, y = inputs
    if c.dtype != dtypes.bool_:
        raise ShapeError(f"condition must be bool, {c.name} is {c.dtype}")
    dtype = require_same_dtype([x, y])
    if not shapes.compatible(x.shape, y.shape):
        raise ShapeError(
            f"x {shapes.fmt(x.shape)} and y {shapes.fmt(y.shape)} must have the same shape"
        )
    shape = shapes.merge(x.shape, y.shape)
    if c.shape is None or c.shape == () or shape is None:
        return [(dtype, shape)]
    if len(c.shape) == len(shape):
        if not shapes.compatible(c.shape, shape):
            raise ShapeError(
                f"condition {shapes.fmt(c.shape)} must have x's shape {shapes.fmt(shape)}"
            )
        return [(dtype, shapes.merge(c.shape, shape))]
    if len(c.shape) == 1 and len(shape) > 1:
        if not shapes.compatible(c.shape, shape[:1]):
            raise ShapeError(
                f"a vector condition {shapes.fmt(c.shape)} must match the first dim of x "
                f"{shapes.fmt(shape)}"
            )
        return [(dtype, shapes.merge(c.shape, shape[:1]) + shape[1:])]
    raise ShapeError(
        f"condition {shapes.fmt(c.shape)} must be a scalar, have x's shape {shapes.fmt(shape)}, "
        "or be a vector of its first dim"
    )


def where(condition, x=None, y=None, name: str | None = None) -> Tensor:
    """``x`` where ``condition`` is true, else ``y`` (see the module doc for the shapes).

    The one-argument form (coordinates of the true entries) has a result whose size is
    known only at run time and no use in the models here; it is refused.
    """
    if x is None or y is None:
        raise ValueError(
            "where: pass both x and y; the one-argument form (indices of true entries) "
            "is not supported"
        )
    condition = convert_to_tensor(condition)
    x, y = _symbolic(x), _symbolic(y)
    # A Python number takes the dtype of the tensor beside it, as in arithmetic.
    if isinstance(y, Tensor) and not isinstance(x, Tensor):
        x = convert_to_tensor(x, dtype=y.dtype)
    x = convert_to_tensor(x)
    y = convert_to_tensor(y, dtype=None if isinstance(y, Tensor) else x.dtype)
    return apply_op("Select", [condition, x, y], name=name).outputs[0]


def _symbolic(v):
    """A Variable (anything standing for a tensor) as its tensor; other values as they are."""
    return convert_to_tensor(v) if hasattr(v, "_as_graph_element") else v


@defvjp("Select")
def _select_grad(op, g):
    c = op.inputs[0]
    zeros = zeros_like(g)
    return [None, where(c, g, zeros), where(c, zeros, g)]
