"""Checks that run inside a step (TensorFlow's ``tf.debugging`` and ``tf.Print``): the
module is ``fm.debugging``, its print ``fm.print``.

CheckNumerics and Print are identities of their first input, so they sit in the dataflow:
whatever reads the checked or printed tensor waits for them. Assert has no outputs; a
control dependency on it is what makes it run, as in TensorFlow. Print and Assert act on
the world each time they run, so they are stateful: the graph passes neither fold them
into a constant nor merge two alike. CheckNumerics is pure, as TensorFlow's is: on a
constant input it is folded, checking the constant once, when the step is compiled.

``Session(check_numerics=True)`` puts a CheckNumerics after every float output of a step
(``passes.add_numerics_checks``); those also take the checked op's inputs, whose shapes
they name when they fail.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowmill.kernels.shapes import ShapeError

from ..autodiff import defvjp
from ..graph import Operation, Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, require_float
from .array_ops import zeros_like
from .math_ops import equal, greater, greater_equal, less

SUMMARIZE = 3  # entries shown of each dimension of a tensor, as in TensorFlow


@define_op("CheckNumerics", attrs={"message": "", "producer": None})
def _check_numerics_shape(inputs, attrs):
    if not inputs:
        raise ShapeError("CheckNumerics needs the tensor to check")
    x = inputs[0]
    require_float(x)
    return [(x.dtype, x.shape)]


@define_op("Assert", attrs={"template": (), "summarize": SUMMARIZE}, stateful=True,
           differentiable=False)
def _assert_shape(inputs, attrs):
    if not inputs or inputs[0].dtype.kind != "b":
        raise ShapeError("Assert needs a bool condition as its first input")
    slots = sum(piece is None for piece in attrs["template"])
    if slots != len(inputs) - 1:
        raise ShapeError(f"Assert's template has {slots} tensor slots for {len(inputs) - 1} data")
    return []


@define_op("Print", attrs={"message": "", "summarize": SUMMARIZE}, stateful=True)
def _print_shape(inputs, attrs):
    if not inputs:
        raise ShapeError("Print needs the tensor to pass through")
    return [(inputs[0].dtype, inputs[0].shape)]


def check_numerics(tensor, message: str, name: str | None = None) -> Tensor:
    """``tensor`` itself, once it holds no NaN or Inf; else the step fails with an
    ``InvalidArgumentError`` naming this op, ``message`` and what was found."""
    x = convert_to_tensor(tensor)
    return apply_op("CheckNumerics", [x], {"message": str(message)}, name).outputs[0]


@defvjp("CheckNumerics")
def _check_numerics_grad(op, grad):
    message = f"NaN or Inf in the gradient: {op.attrs['message']}"
    return [check_numerics(grad, message)] + [None] * (len(op.inputs) - 1)


def Assert(condition, data: Sequence, summarize: int | None = None,  # noqa: N802 - TF's name
           name: str | None = None) -> Operation:
    """An op that fails the step with ``data`` in its message unless every element of
    ``condition`` holds. ``data`` holds tensors and strings (shown as they are); each
    tensor shows ``summarize`` entries of each of its dimensions."""
    condition = convert_to_tensor(condition)
    template, tensors = [], []
    for item in data:
        if isinstance(item, str):
            template.append(item)
        else:
            template.append(None)
            tensors.append(convert_to_tensor(item))
    attrs = {"template": tuple(template),
             "summarize": SUMMARIZE if summarize is None else int(summarize)}
    return apply_op("Assert", [condition, *tensors], attrs, name or "Assert")


def _assert_compare(compare, symbol: str, x, y, data, summarize, message, name) -> Operation:
    x = convert_to_tensor(x)
    y = convert_to_tensor(y, dtype=x.dtype)
    with x.graph.name_scope(name):
        if data is None:
            data = [f"Condition x {symbol} y did not hold element-wise: x ({x.name}) =", x,
                    f"y ({y.name}) =", y]
        return Assert(compare(x, y), [message, *data] if message else data, summarize)


def assert_equal(x, y, data=None, summarize=None, message=None, name=None) -> Operation:
    """An Assert that ``x == y`` element-wise (broadcast)."""
    return _assert_compare(equal, "==", x, y, data, summarize, message, name or "assert_equal")


def assert_less(x, y, data=None, summarize=None, message=None, name=None) -> Operation:
    """An Assert that ``x < y`` element-wise (broadcast)."""
    return _assert_compare(less, "<", x, y, data, summarize, message, name or "assert_less")


def assert_greater(x, y, data=None, summarize=None, message=None, name=None) -> Operation:
    """An Assert that ``x > y`` element-wise (broadcast)."""
    return _assert_compare(
        greater, ">", x, y, data, summarize, message, name or "assert_greater"
    )


def assert_non_negative(x, data=None, summarize=None, message=None, name=None) -> Operation:
    """An Assert that every element of ``x`` is ``>= 0``."""
    x = convert_to_tensor(x)
    with x.graph.name_scope(name or "assert_non_negative"):
        if data is None:
            data = [f"Condition x >= 0 did not hold element-wise: x ({x.name}) =", x]
        condition = greater_equal(x, zeros_like(x))
        return Assert(condition, [message, *data] if message else data, summarize)


def assert_all_finite(t, message: str, name: str | None = None) -> Tensor:
    """``t`` once it holds no NaN or Inf (TensorFlow's, which also returns the checked
    tensor: read it, or use it as a control dependency)."""
    return check_numerics(t, message, name=name or "assert_all_finite")


def print_(*inputs, message: str = "", summarize: int = SUMMARIZE,
           name: str | None = None) -> Tensor:
    """The first of ``inputs``, and each time the step computes it, a line on stderr:
    ``message`` then every input's values (``summarize`` entries of each dimension)."""
    if not inputs:
        raise TypeError("print needs at least one input")
    tensors = [convert_to_tensor(x) for x in inputs]
    attrs = {"message": str(message), "summarize": int(summarize)}
    return apply_op("Print", tensors, attrs, name or "Print").outputs[0]


@defvjp("Print")
def _print_grad(op, grad):
    return [grad] + [None] * (len(op.inputs) - 1)
