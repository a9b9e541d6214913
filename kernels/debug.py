"""Kernels that check or show values as a step runs: CheckNumerics, Assert and Print.

A NaN or Inf otherwise spreads through every op downstream and into the weights without
an error. CheckNumerics costs one reduction when its input is fine: the sum of a tensor
is finite only if every element is, so only a sum that is not (which overflow can also
give) pays for the element-wise tests that say what was found.
"""

from __future__ import annotations

import math
import sys

import numpy

from . import shapes
from .registry import KernelContext, kernel

_HOST = "decides and formats on the host"


class InvalidArgumentError(ValueError):
    """A value a step computed or was fed is not what the graph requires (TensorFlow's
    ``InvalidArgumentError``): a NaN or Inf CheckNumerics found, an Assert that failed. A
    ``ValueError``, so a task answers it with INVALID_ARGUMENT."""


def format_value(x: numpy.ndarray, summarize: int) -> str:
    """``x`` as TensorFlow's Print shows it: the first and last ``summarize`` entries of
    each dimension (all of them when ``summarize`` is negative)."""
    threshold = sys.maxsize if summarize < 0 else 0
    return numpy.array2string(
        numpy.asarray(x), separator=" ", threshold=threshold, edgeitems=max(summarize, 1)
    )


def _shape_of(x) -> str:
    shape = getattr(x, "shape", None)
    return type(x).__name__ if shape is None else shapes.fmt(tuple(shape))


@kernel("CheckNumerics", gpu_note="reads one flag back to the host per check")
def _check_numerics(ctx: KernelContext):
    xp = ctx.xp
    message, producer = ctx.attrs["message"], ctx.attrs["producer"]

    def found(x) -> str:
        nan, inf = bool(xp.isnan(x).any()), bool(xp.isinf(x).any())
        return " and ".join(what for what, hit in (("NaN", nan), ("Inf", inf)) if hit)

    def fn(x, *inputs_of_producer):
        if math.isfinite(x.sum()):
            return x
        what = found(x)
        if not what:  # the sum overflowed; every element is finite
            return x
        value = f"shape {_shape_of(x)}, {x.dtype}"
        if producer is None:
            raise InvalidArgumentError(
                f"op {ctx.name!r} (CheckNumerics): {message}: tensor had {what} values ({value})"
            )
        text = f"{what} found in {producer} ({value})"
        if inputs_of_producer:
            text += "; its inputs had shapes " + ", ".join(map(_shape_of, inputs_of_producer))
        raise InvalidArgumentError(text)

    return fn


@kernel("Assert", host_only=_HOST)
def _assert(ctx: KernelContext):
    xp = ctx.xp
    to_host = getattr(xp, "asnumpy", numpy.asarray)
    template, summarize = ctx.attrs["template"], ctx.attrs["summarize"]

    def fn(condition, *data) -> None:
        if bool(xp.all(condition)):
            return None
        values = iter(data)
        parts = [
            piece if piece is not None else format_value(to_host(next(values)), summarize)
            for piece in template
        ]
        raise InvalidArgumentError(f"op {ctx.name!r} (Assert): assertion failed: {' '.join(parts)}")

    return fn


@kernel("Print", host_only=_HOST)
def _print(ctx: KernelContext):
    to_host = getattr(ctx.xp, "asnumpy", numpy.asarray)
    message, summarize = ctx.attrs["message"], ctx.attrs["summarize"]

    def fn(first, *rest):
        text = " ".join(format_value(to_host(x), summarize) for x in (first, *rest))
        stream = sys.stderr  # looked up on every call: whoever holds stderr now gets it
        stream.write(f"{message}{text}\n")
        stream.flush()
        return first

    return fn
