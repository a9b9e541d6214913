"""``stack`` and ``unstack`` (TensorFlow's Pack and Unpack), composed of existing ops.

Stacking is ExpandDims (a view) on each value then one Concat, the copy a Pack kernel
would make anyway; unstacking is one Split then Squeeze (views). Their gradients are
those ops' gradients, so no op of their own is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowmill.kernels import shapes

from ..graph import GraphError, Tensor, convert_to_tensor, get_default_graph
from .array_ops import concat, expand_dims, split, squeeze


def _tensors(values: Sequence, what: str) -> list[Tensor]:
    """Convert ``values``, plain numbers taking the dtype of the first tensor among them."""
    if isinstance(values, Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{what}: values must be a list or tuple of tensors, got {values!r}")
    if not values:
        raise ValueError(f"{what}: needs at least one value")
    symbolic = [convert_to_tensor(v) if hasattr(v, "_as_graph_element") else v for v in values]
    dtype = next((v.dtype for v in symbolic if isinstance(v, Tensor)), None)
    return [
        v if isinstance(v, Tensor) else convert_to_tensor(v, dtype=dtype) for v in symbolic
    ]


def stack(values: Sequence, axis: int = 0, name: str = "stack") -> Tensor:
    """Values of one shape joined along a new ``axis``: N tensors of shape S become one of
    shape ``S[:axis] + (N,) + S[axis:]``."""
    tensors = _tensors(values, "stack")
    first = tensors[0]
    for i, t in enumerate(tensors[1:], 1):
        if t.dtype != first.dtype:
            raise GraphError(
                f"stack: value {i} ({t.name}) has dtype {t.dtype}, value 0 ({first.name}) "
                f"has {first.dtype}"
            )
        if not shapes.compatible(t.shape, first.shape):
            raise GraphError(
                f"stack: value {i} ({t.name}) has shape {shapes.fmt(t.shape)}, value 0 "
                f"({first.name}) has {shapes.fmt(first.shape)}"
            )
    rank = next((len(t.shape) for t in tensors if t.shape is not None), None)
    if rank is not None and not -(rank + 1) <= axis <= rank:
        raise GraphError(f"stack: axis {axis} is out of range for values of rank {rank}")
    graph = first.graph if isinstance(first, Tensor) else get_default_graph()
    with graph.as_default(), graph.name_scope(name):
        if rank is not None and axis < 0:
            axis += rank + 1
        return concat([expand_dims(t, axis) for t in tensors], axis)


def unstack(value, num: int | None = None, axis: int = 0, name: str = "unstack") -> list[Tensor]:
    """The slices of ``value`` along ``axis``, that axis removed: the inverse of ``stack``."""
    value = convert_to_tensor(value)
    if value.shape is None:
        raise GraphError(f"unstack: the rank of {value.name} must be known")
    rank = len(value.shape)
    if not -rank <= axis < rank:
        raise GraphError(
            f"unstack: axis {axis} is out of range for {value.name} of shape "
            f"{shapes.fmt(value.shape)}"
        )
    axis %= rank
    dim = value.shape[axis]
    if num is None:
        if dim is None:
            raise GraphError(
                f"unstack: dim {axis} of {value.name} {shapes.fmt(value.shape)} is unknown; "
                "pass num"
            )
        num = dim
    elif dim is not None and dim != num:
        raise GraphError(f"unstack: num={num}, but dim {axis} of {value.name} has size {dim}")
    with value.graph.as_default(), value.graph.name_scope(name):
        return [squeeze(part, [axis]) for part in split(value, num, axis)]
