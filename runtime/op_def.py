"""The op registry: what each op takes, which attrs it accepts, and how its outputs are typed.

An op definition says nothing about how to compute it (that is a kernel's job, in
``flowmill.kernels``) nor how to differentiate it (``flowmill.runtime.autodiff``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.shapes import Shape, ShapeError

if TYPE_CHECKING:
    from .graph import Tensor

OutputSpec = tuple[np.dtype, Shape]
ShapeFn = Callable[[list["Tensor"], dict[str, Any]], list[OutputSpec]]


@dataclass(frozen=True)
class OpDef:
    name: str
    shape_fn: ShapeFn
    attrs: dict[str, Any] = field(default_factory=dict)  # accepted attr -> default
    stateful: bool = (
        False  # touches state or the outside world: never pruned away, merged or folded
    )
    differentiable: bool = True  # needs a gradient in the registry
    num_inputs: int | None = None  # None: variadic


OPS: dict[str, OpDef] = {}


def define_op(
    name: str,
    *,
    attrs: dict[str, Any] | None = None,
    stateful: bool = False,
    differentiable: bool = True,
    num_inputs: int | None = None,
) -> Callable[[ShapeFn], ShapeFn]:
    """Register ``name`` with the decorated function as its shape function."""

    def register(shape_fn: ShapeFn) -> ShapeFn:
        if name in OPS:
            raise ValueError(f"op {name!r} is defined twice")
        OPS[name] = OpDef(name, shape_fn, dict(attrs or {}), stateful, differentiable, num_inputs)
        return shape_fn

    return register


def get_op_def(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op type {name!r}") from None


# Shape-function building blocks shared by many ops.


def same_as_input(i: int = 0) -> ShapeFn:
    def fn(inputs, attrs):
        return [(inputs[i].dtype, inputs[i].shape)]

    return fn


def require_same_dtype(inputs: list[Tensor]) -> np.dtype:
    dtype = inputs[0].dtype
    for t in inputs[1:]:
        if t.dtype != dtype:
            raise ShapeError(f"dtypes differ: {dtype} and {t.dtype}")
    return dtype


def require_float(t: Tensor) -> None:
    if t.dtype.kind != "f":
        raise ShapeError(f"expected a floating-point input, got {t.dtype}")


def elementwise(inputs: list[Tensor], attrs: dict) -> list[OutputSpec]:
    dtype = require_same_dtype(inputs)
    shape = inputs[0].shape
    for t in inputs[1:]:
        shape = shapes.broadcast(shape, t.shape)
    return [(dtype, shape)]
