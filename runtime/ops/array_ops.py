"""Constants, placeholders, identity and the ops that move or reshape data."""

from __future__ import annotations

import numpy as np

from .. import dtypes, shapes
from ..gradients import defvjp
from ..graph import Operation, Tensor, apply_op, convert_to_tensor, get_default_graph
from ..op_def import define_op, same_as_input
from ..shapes import ShapeError


@define_op("Const", attrs={"value": None, "dtype": None}, num_inputs=0, differentiable=False)
def _const_shape(inputs, attrs):
    return [(attrs["dtype"], tuple(attrs["value"].shape))]


def constant(value, dtype=None, shape=None, name: str | None = None) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else None
    array = np.asarray(value, dtype=dtype)
    if dtype is None:
        # Python floats become float32 and ints int32, as in TensorFlow.
        if array.dtype == np.float64 and not isinstance(value, np.ndarray):
            array = array.astype(np.float32)
        elif array.dtype == np.int64 and not isinstance(value, np.ndarray):
            array = array.astype(np.int32)
    if shape is not None:
        array = np.broadcast_to(array, tuple(shape)).copy()
    array.setflags(write=False)
    op = get_default_graph().create_op(
        "Const", [], {"value": array, "dtype": array.dtype}, name or "Const"
    )
    return op.outputs[0]


@define_op("Placeholder", attrs={"dtype": None, "shape": None}, num_inputs=0, differentiable=False)
def _placeholder_shape(inputs, attrs):
    return [(attrs["dtype"], attrs["shape"])]


def placeholder(dtype, shape=None, name: str | None = None) -> Tensor:
    attrs = {"dtype": dtypes.as_dtype(dtype), "shape": shapes.as_shape(shape)}
    return get_default_graph().create_op("Placeholder", [], attrs, name or "Placeholder").outputs[0]


define_op("Identity", num_inputs=1)(same_as_input())
define_op("StopGradient", num_inputs=1, differentiable=False)(same_as_input())


def identity(x, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    return apply_op("Identity", [x], name=name).outputs[0]


def stop_gradient(x, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    return apply_op("StopGradient", [x], name=name).outputs[0]


@defvjp("Identity")
def _identity_grad(op, grad):
    return [grad]


@define_op("NoOp", num_inputs=0, differentiable=False)
def _noop_shape(inputs, attrs):
    return []


def no_op(name: str | None = None) -> Operation:
    return get_default_graph().create_op("NoOp", [], None, name or "NoOp")


def group(*inputs, name: str | None = None) -> Operation:
    """One op that runs after all of ``inputs`` (ops or tensors)."""
    flat = []
    for x in inputs:
        flat.extend(x if isinstance(x, (list, tuple)) else [x])
    graph = get_default_graph()
    with graph.control_dependencies(flat):
        return no_op(name=name or "group_deps")


def tuple_(tensors: list[Tensor], name: str | None = None) -> list[Tensor]:
    """Identities of ``tensors`` that are each available only once all of them are."""
    gate = group(*tensors, name=name or "tuple")
    graph = get_default_graph()
    with graph.control_dependencies([gate]):
        return [identity(t) for t in tensors]


def static_shape(x: Tensor) -> tuple:
    if x.shape is None:
        raise ShapeError(f"tensor {x.name} has unknown rank")
    return x.shape


define_op("ZerosLike", num_inputs=1, differentiable=False)(same_as_input())
define_op("OnesLike", num_inputs=1, differentiable=False)(same_as_input())


def zeros_like(x, name: str | None = None) -> Tensor:
    return apply_op("ZerosLike", [convert_to_tensor(x)], name=name).outputs[0]


def ones_like(x, name: str | None = None) -> Tensor:
    return apply_op("OnesLike", [convert_to_tensor(x)], name=name).outputs[0]
