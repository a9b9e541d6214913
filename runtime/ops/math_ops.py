"""Elementwise math with broadcasting, reductions, MatMul, comparisons and casts.

Like TensorFlow's ``math_ops.py``, one op family per file, each op's definition, shape
function, constructor and gradient side by side: the file is long because the family is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, elementwise, require_same_dtype, same_as_input

# ---- definitions


BINARY = ("Add", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Pow", "SquaredDifference")
UNARY = ("Neg", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Abs", "Sign", "Reciprocal")
COMPARE = ("Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual")
LOGICAL = ("LogicalAnd", "LogicalOr")

for _name in BINARY:
    define_op(_name, num_inputs=2)(elementwise)
for _name in ("FloorDiv", "FloorMod"):
    define_op(_name, num_inputs=2, differentiable=False)(elementwise)
for _name in UNARY:
    define_op(_name, num_inputs=1, differentiable=_name != "Sign")(same_as_input())


def _compare_shape(inputs, attrs):
    ((_, shape),) = elementwise(inputs, attrs)
    return [(dtypes.bool_, shape)]


for _name in COMPARE + LOGICAL:
    define_op(_name, num_inputs=2, differentiable=False)(_compare_shape)


@define_op("LogicalNot", num_inputs=1, differentiable=False)
def _logical_not_shape(inputs, attrs):
    return [(dtypes.bool_, inputs[0].shape)]


@define_op("Cast", attrs={"dtype": None}, num_inputs=1)
def _cast_shape(inputs, attrs):
    return [(dtypes.as_dtype(attrs["dtype"]), inputs[0].shape)]


@define_op("AddN")
def _add_n_shape(inputs, attrs):
    if not inputs:
        raise ShapeError("AddN needs at least one input")
    dtype = require_same_dtype(inputs)
    shape = inputs[0].shape
    for t in inputs[1:]:
        if not shapes.compatible(shape, t.shape):
            raise ShapeError(
                f"AddN inputs differ in shape: {shapes.fmt(shape)} vs {shapes.fmt(t.shape)}"
            )
        shape = shapes.merge(shape, t.shape)
    return [(dtype, shape)]


@define_op("MatMul", attrs={"transpose_a": False, "transpose_b": False}, num_inputs=2)
def _matmul_shape(inputs, attrs):
    a, b = inputs
    dtype = require_same_dtype(inputs)
    for t in (a, b):
        if t.shape is not None and len(t.shape) != 2:
            raise ShapeError(f"MatMul takes matrices; {t.name} has shape {shapes.fmt(t.shape)}")
    if a.shape is None or b.shape is None:
        return [(dtype, (None, None))]
    m, k = a.shape[::-1] if attrs["transpose_a"] else a.shape
    k2, n = b.shape[::-1] if attrs["transpose_b"] else b.shape
    if k is not None and k2 is not None and k != k2:
        raise ShapeError(
            f"inner dimensions differ: {shapes.fmt(a.shape)} x {shapes.fmt(b.shape)} "
            f"(transpose_a={attrs['transpose_a']}, transpose_b={attrs['transpose_b']})"
        )
    return [(dtype, (m, n))]


def _reduce_shape(inputs, attrs):
    x = inputs[0]
    if x.shape is None:
        return [(x.dtype, None)]
    axes = shapes.normalize_axes(attrs["axis"], len(x.shape))
    if attrs["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return [(x.dtype, shape)]


for _name in ("Sum", "Mean", "Max", "Min", "Prod"):
    define_op(_name, attrs={"axis": None, "keepdims": False}, num_inputs=1)(_reduce_shape)


@define_op(
    "ArgMax", attrs={"axis": 0, "output_type": dtypes.int64}, num_inputs=1, differentiable=False
)
def _argmax_shape(inputs, attrs):
    x = inputs[0]
    out = attrs["output_type"]
    if x.shape is None:
        return [(out, None)]
    (axis,) = shapes.normalize_axes(attrs["axis"], len(x.shape))
    return [(out, tuple(d for i, d in enumerate(x.shape) if i != axis))]


@define_op("SumToShapeOf", num_inputs=2)
def _sum_to_shape(inputs, attrs):
    return [(inputs[0].dtype, inputs[1].shape)]


@define_op("BroadcastToShapeOf", attrs={"axes": ()}, num_inputs=2)
def _broadcast_to_shape(inputs, attrs):
    return [(inputs[0].dtype, inputs[1].shape)]


@define_op("Size", attrs={"out_type": dtypes.int32}, num_inputs=1, differentiable=False)
def _size_shape(inputs, attrs):
    return [(attrs["out_type"], ())]


# ---- constructors


def _binary(op_type: str, x, y, name: str | None) -> Tensor:
    x, y = _convert_pair(x, y)
    return apply_op(op_type, [x, y], name=name).outputs[0]


def _convert_pair(x, y) -> tuple[Tensor, Tensor]:
    if isinstance(x, Tensor) and not isinstance(y, Tensor):
        y = convert_to_tensor(y, dtype=x.dtype if not isinstance(y, np.ndarray) else None)
    elif isinstance(y, Tensor) and not isinstance(x, Tensor):
        x = convert_to_tensor(x, dtype=y.dtype if not isinstance(x, np.ndarray) else None)
    return convert_to_tensor(x), convert_to_tensor(y)


def _unary(op_type: str, x, name: str | None) -> Tensor:
    return apply_op(op_type, [convert_to_tensor(x)], name=name).outputs[0]


def add(x, y, name=None):
    return _binary("Add", x, y, name)


def subtract(x, y, name=None):
    return _binary("Sub", x, y, name)


def multiply(x, y, name=None):
    return _binary("Mul", x, y, name)


def divide(x, y, name=None):
    return _binary("RealDiv", x, y, name)


def maximum(x, y, name=None):
    return _binary("Maximum", x, y, name)


def minimum(x, y, name=None):
    return _binary("Minimum", x, y, name)


def floordiv(x, y, name=None):
    return _binary("FloorDiv", x, y, name)


def floormod(x, y, name=None):
    return _binary("FloorMod", x, y, name)


def pow(x, y, name=None):  # noqa: A001 - mirrors the op name
    return _binary("Pow", x, y, name)


def squared_difference(x, y, name=None):
    return _binary("SquaredDifference", x, y, name)


def negative(x, name=None):
    return _unary("Neg", x, name)


def square(x, name=None):
    return _unary("Square", x, name)


def sqrt(x, name=None):
    return _unary("Sqrt", x, name)


def rsqrt(x, name=None):
    return _unary("Rsqrt", x, name)


def exp(x, name=None):
    return _unary("Exp", x, name)


def log(x, name=None):
    return _unary("Log", x, name)


def abs(x, name=None):  # noqa: A001
    return _unary("Abs", x, name)


def sign(x, name=None):
    return _unary("Sign", x, name)


def reciprocal(x, name=None):
    return _unary("Reciprocal", x, name)


def equal(x, y, name=None):
    return _binary("Equal", x, y, name)


def not_equal(x, y, name=None):
    return _binary("NotEqual", x, y, name)


def less(x, y, name=None):
    return _binary("Less", x, y, name)


def less_equal(x, y, name=None):
    return _binary("LessEqual", x, y, name)


def greater(x, y, name=None):
    return _binary("Greater", x, y, name)


def greater_equal(x, y, name=None):
    return _binary("GreaterEqual", x, y, name)


def logical_and(x, y, name=None):
    return _binary("LogicalAnd", x, y, name)


def logical_or(x, y, name=None):
    return _binary("LogicalOr", x, y, name)


def logical_not(x, name=None):
    return _unary("LogicalNot", x, name)


def cast(x, dtype, name=None) -> Tensor:
    x = convert_to_tensor(x)
    dtype = dtypes.as_dtype(dtype)
    if x.dtype == dtype:
        return x
    return apply_op("Cast", [x], {"dtype": dtype}, name).outputs[0]


def add_n(inputs: Sequence, name=None) -> Tensor:
    inputs = [convert_to_tensor(x) for x in inputs]
    if len(inputs) == 1:
        return inputs[0]
    return apply_op("AddN", inputs, name=name).outputs[0]


def matmul(a, b, transpose_a: bool = False, transpose_b: bool = False, name=None) -> Tensor:
    a, b = _convert_pair(a, b)
    attrs = {"transpose_a": bool(transpose_a), "transpose_b": bool(transpose_b)}
    return apply_op("MatMul", [a, b], attrs, name).outputs[0]


def _reduce(op_type, x, axis, keepdims, name):
    x = convert_to_tensor(x)
    if isinstance(axis, list):
        axis = tuple(axis)
    return apply_op(op_type, [x], {"axis": axis, "keepdims": bool(keepdims)}, name).outputs[0]


def reduce_sum(x, axis=None, keepdims=False, name=None):
    return _reduce("Sum", x, axis, keepdims, name)


def reduce_mean(x, axis=None, keepdims=False, name=None):
    return _reduce("Mean", x, axis, keepdims, name)


def reduce_max(x, axis=None, keepdims=False, name=None):
    return _reduce("Max", x, axis, keepdims, name)


def reduce_min(x, axis=None, keepdims=False, name=None):
    return _reduce("Min", x, axis, keepdims, name)


def reduce_prod(x, axis=None, keepdims=False, name=None):
    return _reduce("Prod", x, axis, keepdims, name)


def argmax(x, axis: int = 0, output_type=dtypes.int64, name=None) -> Tensor:
    x = convert_to_tensor(x)
    attrs = {"axis": int(axis), "output_type": dtypes.as_dtype(output_type)}
    return apply_op("ArgMax", [x], attrs, name).outputs[0]


def size(x, out_type=dtypes.int32, name=None) -> Tensor:
    return apply_op("Size", [convert_to_tensor(x)], {"out_type": out_type}, name).outputs[0]


def sum_to_shape_of(g: Tensor, x: Tensor) -> Tensor:
    """``g`` summed over the dims along which ``x`` was broadcast to ``g``'s shape."""
    if g.shape is not None and g.shape == x.shape and None not in g.shape:
        return g
    return apply_op("SumToShapeOf", [g, x]).outputs[0]


def broadcast_to_shape_of(g: Tensor, x: Tensor, axes: tuple = ()) -> Tensor:
    """``g`` with ``axes`` re-inserted, broadcast to ``x``'s shape (a view, no copy)."""
    return apply_op("BroadcastToShapeOf", [g, x], {"axes": tuple(axes)}).outputs[0]


# ---- operator overloading on tensors


def _install_operators() -> None:
    def rev(fn):
        return lambda self, other: fn(other, self)

    Tensor.__add__ = add
    Tensor.__radd__ = rev(add)
    Tensor.__sub__ = subtract
    Tensor.__rsub__ = rev(subtract)
    Tensor.__mul__ = multiply
    Tensor.__rmul__ = rev(multiply)
    Tensor.__truediv__ = divide
    Tensor.__rtruediv__ = rev(divide)
    Tensor.__floordiv__ = floordiv
    Tensor.__rfloordiv__ = rev(floordiv)
    Tensor.__mod__ = floormod
    Tensor.__rmod__ = rev(floormod)
    Tensor.__pow__ = pow
    Tensor.__rpow__ = rev(pow)
    Tensor.__matmul__ = matmul
    Tensor.__rmatmul__ = rev(matmul)
    Tensor.__neg__ = negative
    Tensor.__abs__ = abs
    Tensor.__lt__ = less
    Tensor.__le__ = less_equal
    Tensor.__gt__ = greater
    Tensor.__ge__ = greater_equal
    Tensor.__and__ = logical_and
    Tensor.__or__ = logical_or
    Tensor.__invert__ = logical_not


_install_operators()


# ---- gradients


def _unbroadcast(op, gx, gy):
    x, y = op.inputs
    return [sum_to_shape_of(gx, x), sum_to_shape_of(gy, y)]


@defvjp("Add")
def _add_grad(op, g):
    return _unbroadcast(op, g, g)


@defvjp("Sub")
def _sub_grad(op, g):
    return _unbroadcast(op, g, negative(g))


@defvjp("Mul")
def _mul_grad(op, g):
    x, y = op.inputs
    return _unbroadcast(op, g * y, g * x)


@defvjp("RealDiv")
def _div_grad(op, g):
    x, y = op.inputs
    gx = g / y
    return _unbroadcast(op, gx, negative(gx) * op.outputs[0])


def _select_grad(op, g, x_wins):
    x, y = op.inputs
    mask = cast(x_wins, g.dtype)
    return _unbroadcast(op, g * mask, g * (1.0 - mask))


@defvjp("Maximum")
def _maximum_grad(op, g):
    x, y = op.inputs
    return _select_grad(op, g, greater_equal(x, y))


@defvjp("Minimum")
def _minimum_grad(op, g):
    x, y = op.inputs
    return _select_grad(op, g, less_equal(x, y))


@defvjp("Pow")
def _pow_grad(op, g):
    x, y = op.inputs
    z = op.outputs[0]
    gx = g * y * pow(x, y - 1.0)
    safe_log = log(maximum(x, convert_to_tensor(np.finfo(x.dtype).tiny, x.dtype)))
    gy = g * z * safe_log
    return _unbroadcast(op, gx, gy)


@defvjp("SquaredDifference")
def _squared_difference_grad(op, g):
    x, y = op.inputs
    d = g * (2.0 * (x - y))
    return _unbroadcast(op, d, negative(d))


@defvjp("Neg")
def _neg_grad(op, g):
    return [negative(g)]


@defvjp("Square")
def _square_grad(op, g):
    return [g * (2.0 * op.inputs[0])]


@defvjp("Sqrt")
def _sqrt_grad(op, g):
    return [g * 0.5 / op.outputs[0]]


@defvjp("Rsqrt")
def _rsqrt_grad(op, g):
    y = op.outputs[0]
    return [g * (-0.5) * y * y * y]


@defvjp("Exp")
def _exp_grad(op, g):
    return [g * op.outputs[0]]


@defvjp("Log")
def _log_grad(op, g):
    return [g / op.inputs[0]]


@defvjp("Abs")
def _abs_grad(op, g):
    return [g * sign(op.inputs[0])]


@defvjp("Reciprocal")
def _reciprocal_grad(op, g):
    y = op.outputs[0]
    return [negative(g) * y * y]


@defvjp("Cast")
def _cast_grad(op, g):
    x = op.inputs[0]
    if x.dtype.kind != "f" or g.dtype.kind != "f":
        return [None]
    return [cast(g, x.dtype)]


@defvjp("AddN")
def _add_n_grad(op, g):
    return [g] * len(op.inputs)


@defvjp("MatMul")
def _matmul_grad(op, g):
    a, b = op.inputs
    ta, tb = op.attrs["transpose_a"], op.attrs["transpose_b"]
    if not ta and not tb:
        return [matmul(g, b, transpose_b=True), matmul(a, g, transpose_a=True)]
    if not ta and tb:
        return [matmul(g, b), matmul(g, a, transpose_a=True)]
    if ta and not tb:
        return [matmul(b, g, transpose_b=True), matmul(a, g)]
    return [
        matmul(b, g, transpose_a=True, transpose_b=True),
        matmul(g, a, transpose_a=True, transpose_b=True),
    ]


def _reduced_axes(op) -> tuple:
    x = op.inputs[0]
    if x.shape is None:
        raise ShapeError(f"gradient of {op.name}: input rank must be known")
    return shapes.normalize_axes(op.attrs["axis"], len(x.shape))


def _expand_like_input(op, g):
    axes = () if op.attrs["keepdims"] else _reduced_axes(op)
    return broadcast_to_shape_of(g, op.inputs[0], axes)


@defvjp("Sum")
def _sum_grad(op, g):
    return [_expand_like_input(op, g)]


@defvjp("Mean")
def _mean_grad(op, g):
    x, y = op.inputs[0], op.outputs[0]
    n_in, n_out = shapes.num_elements(x.shape), shapes.num_elements(y.shape)
    if n_in is not None and n_out is not None:
        count = convert_to_tensor(max(n_in // max(n_out, 1), 1), x.dtype)
    else:
        count = cast(size(x), x.dtype) / cast(size(y), x.dtype)
    return [_expand_like_input(op, g) / count]


def _extremum_grad(op, g):
    x, y = op.inputs[0], op.outputs[0]
    y_full = _expand_like_input(op, y)
    mask = cast(equal(x, y_full), g.dtype)
    axes = _reduced_axes(op)
    ties = reduce_sum(mask, axis=axes, keepdims=op.attrs["keepdims"])
    return [_expand_like_input(op, g / ties) * mask]


defvjp("Max")(_extremum_grad)
defvjp("Min")(_extremum_grad)


@defvjp("Prod")
def _prod_grad(op, g):
    x, y = op.inputs[0], op.outputs[0]
    return [_expand_like_input(op, g * y) / x]


@defvjp("SumToShapeOf")
def _sum_to_shape_grad(op, g):
    return [broadcast_to_shape_of(g, op.inputs[0]), None]


@defvjp("BroadcastToShapeOf")
def _broadcast_to_shape_grad(op, g):
    axes = op.attrs["axes"]
    if axes:
        return [reduce_sum(g, axis=axes), None]
    return [sum_to_shape_of(g, op.inputs[0]), None]
