"""``DynamicFill``: a tensor of one value whose shape is known only when the step runs
(``zeros(shape(x))``, an RNN's zero state for a fed batch). ``Fill`` keeps its shape in
an attr and is made once; this one is made every step from its ``dims`` input."""

from __future__ import annotations

from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op


@define_op(
    "DynamicFill", attrs={"value": 0, "dtype": None}, num_inputs=1, differentiable=False
)
def _dynamic_fill_shape(inputs, attrs):
    (dims,) = inputs
    if dims.dtype.kind not in "iu" or (dims.shape is not None and len(dims.shape) != 1):
        raise ShapeError(f"DynamicFill dims must be an int vector, got {dims.shape} {dims.dtype}")
    rank = None if dims.shape is None else dims.shape[0]
    return [(attrs["dtype"], None if rank is None else (None,) * rank)]


def dynamic_fill(dims: Tensor, value, dtype, name: str | None = None) -> Tensor:
    attrs = {"value": value, "dtype": dtypes.as_dtype(dtype)}
    dims = convert_to_tensor(dims)
    return apply_op("DynamicFill", [dims], attrs, name or "DynamicFill").outputs[0]
