"""Elementwise math, reductions and MatMul, written once against the array module."""

from __future__ import annotations

import numpy

from .registry import KernelContext, kernel, may_overwrite

_XP_FUNCTIONS = {
    "RealDiv": "true_divide",
    "Maximum": "maximum",
    "Minimum": "minimum",
    "Pow": "power",
    "FloorDiv": "floor_divide",
    "FloorMod": "mod",
    "Neg": "negative",
    "Square": "square",
    "Sqrt": "sqrt",
    "Exp": "exp",
    "Log": "log",
    "Cos": "cos",
    "Sin": "sin",
    "Log1p": "log1p",
    "Abs": "absolute",
    "Sign": "sign",
    "Equal": "equal",
    "NotEqual": "not_equal",
    "Less": "less",
    "LessEqual": "less_equal",
    "Greater": "greater",
    "GreaterEqual": "greater_equal",
    "LogicalAnd": "logical_and",
    "LogicalOr": "logical_or",
    "LogicalNot": "logical_not",
}


_UNARY = {"Neg", "Square", "Sqrt", "Exp", "Log", "Cos", "Sin", "Log1p", "Abs", "Sign",
          "LogicalNot"}


def _direct(fn_name: str):
    def build(ctx: KernelContext):
        return getattr(ctx.xp, fn_name)

    return build


for _op, _fn in _XP_FUNCTIONS.items():
    kernel(_op, scalar_inputs=_op not in _UNARY)(_direct(_fn))


def _forwarding(fn_name: str):
    """An elementwise binary op that computes into an input the step no longer needs."""

    def build(ctx: KernelContext):
        ufunc = getattr(ctx.xp, fn_name)
        first, second = ctx.forward(0), ctx.forward(1)
        if not (first or second):
            return ufunc

        def fn(x, y):
            if first and may_overwrite(x, y):
                return ufunc(x, y, out=x)
            if second and may_overwrite(y, x):
                return ufunc(x, y, out=y)
            return ufunc(x, y)

        return fn

    return build


for _op, _fn in {"Add": "add", "Sub": "subtract", "Mul": "multiply"}.items():
    kernel(_op, scalar_inputs=True)(_forwarding(_fn))


@kernel("Rsqrt")
def _rsqrt(ctx):
    xp = ctx.xp
    return lambda x: xp.reciprocal(xp.sqrt(x))


@kernel("Reciprocal")
def _reciprocal(ctx):
    xp = ctx.xp
    return lambda x: xp.reciprocal(x)


@kernel("SquaredDifference")
def _squared_difference(ctx):
    xp = ctx.xp

    def fn(x, y):
        d = xp.subtract(x, y)
        return xp.multiply(d, d)

    return fn


@kernel("Cast")
def _cast(ctx):
    dtype = ctx.attrs["dtype"]
    return lambda x: x.astype(dtype)


@kernel("AddN")
def _add_n(ctx):
    xp = ctx.xp

    def fn(first, *rest):
        out = xp.asarray(xp.add(first, rest[0]))  # 0-d results come back as scalars
        for x in rest[1:]:
            xp.add(out, x, out=out)
        return out

    return fn


# ``a @ b.T`` with few rows in ``a`` and many in ``b`` (an RNN's recurrent gradient, a
# [64, 2048] x [2048, 512] product every time step): OpenBLAS's transposed-B path runs
# these at 30-60 GFLOP/s on one core where the swapped product ``(b @ a.T).T`` runs at
# 60-85, even with its result copied back into row-major order (measured over M 16-64,
# N 256-2048, K 256-2048: 1.05-2.2x). Fewer rows than 64, or b narrower than 256 rows,
# and the plain call is as fast or faster.
_SWAP_MAX_ROWS = 64
_SWAP_MIN_COLS = 256


@kernel("MatMul")
def _matmul(ctx):
    ta, tb = ctx.attrs["transpose_a"], ctx.attrs["transpose_b"]
    xp = ctx.xp
    matmul = xp.matmul
    if ta and tb:
        return lambda a, b: matmul(a.T, b.T)
    if ta:
        return lambda a, b: matmul(a.T, b)
    if tb:
        if ctx.device_type != "CPU":
            return lambda a, b: matmul(a, b.T)

        def a_bt(a, b):
            if a.shape[0] <= _SWAP_MAX_ROWS and b.shape[0] >= _SWAP_MIN_COLS:
                return xp.ascontiguousarray(matmul(b, a.T).T)
            return matmul(a, b.T)

        return a_bt
    return matmul


def _reduction(fn_name: str):
    def build(ctx: KernelContext):
        fn = getattr(ctx.xp, fn_name)
        axis, keepdims = ctx.attrs["axis"], ctx.attrs["keepdims"]
        if isinstance(axis, list):
            axis = tuple(axis)
        xp = ctx.xp
        return lambda x: xp.asarray(fn(x, axis=axis, keepdims=keepdims))

    return build


for _op, _fn in {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min", "Prod": "prod"}.items():
    kernel(_op)(_reduction(_fn))


@kernel("ArgMax")
def _argmax(ctx):
    axis, dtype = ctx.attrs["axis"], ctx.attrs["output_type"]
    xp = ctx.xp
    return lambda x: xp.argmax(x, axis=axis).astype(dtype, copy=False)


@kernel("Size", host_outputs=(0,))
def _size(ctx):
    dtype = ctx.attrs["out_type"]
    return lambda x: numpy.asarray(x.size, dtype=dtype)  # in host memory on every device


@kernel("SumToShapeOf")
def _sum_to_shape_of(ctx):
    def fn(g, x):
        shape = x.shape
        if g.shape == shape:
            return g
        lead = g.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(
            i + lead for i, d in enumerate(shape) if d == 1 and g.shape[i + lead] != 1
        )
        return g.sum(axis=axes, keepdims=True).reshape(shape)

    return fn


@kernel("BroadcastToShapeOf")
def _broadcast_to_shape_of(ctx):
    xp, axes = ctx.xp, ctx.attrs["axes"]
    if axes:
        return lambda g, x: xp.broadcast_to(xp.expand_dims(g, axes), x.shape)
    return lambda g, x: xp.broadcast_to(g, x.shape)
