"""``unique``: the distinct values of a vector and where each element went (``tf.unique``).

A sparse update sums the gradients of repeated rows before it touches the variable; with
``unique`` and ``unsorted_segment_sum`` that sum is a value of the step, not scratch rows of
a slot that another worker's update could be using at the same moment.
"""

from __future__ import annotations

from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op


@define_op("Unique", attrs={"out_idx": dtypes.int32}, num_inputs=1, differentiable=False)
def _unique_shape(inputs, attrs):
    (x,) = inputs
    if x.shape is not None and len(x.shape) != 1:
        raise ShapeError(f"unique needs a vector, got shape {x.shape}")
    return [(x.dtype, (None,)), (attrs["out_idx"], x.shape)]


def unique(x, out_idx=dtypes.int32, name: str | None = None) -> tuple[Tensor, Tensor]:
    """``(y, idx)``: ``y`` the distinct values of ``x`` (sorted), ``x == y[idx]``."""
    op = apply_op("Unique", [convert_to_tensor(x)], {"out_idx": dtypes.as_dtype(out_idx)},
                  name or "Unique")
    return op.outputs[0], op.outputs[1]
