"""Initializers: ``fn(shape, dtype) -> Tensor`` callables for ``Variable(init, shape=...)``.

The variance-scaling ones (Glorot, He) follow Keras: fans come from the last two dims, a
convolution kernel ``(..., in, out)`` multiplying both by its receptive field, and the
normal variants draw a truncated normal widened so that the kept values have the intended
variance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from . import dtypes
from .graph import Tensor
from .ops import array_ops, random_ops

Initializer = Callable[[tuple, object], Tensor]
# Standard deviation of a unit normal truncated to [-2, 2]: dividing by it restores unit variance.
TRUNCATED_STDDEV = 0.87962566103423978


def _static(shape) -> tuple[int, ...]:
    if shape is None or any(d is None for d in shape):
        raise ValueError(f"an initializer needs a fully known shape, got {shape}")
    return tuple(int(d) for d in shape)


def zeros() -> Initializer:
    return lambda shape, dtype=dtypes.float32: array_ops.zeros(_static(shape), dtype)


def ones() -> Initializer:
    return lambda shape, dtype=dtypes.float32: array_ops.ones(_static(shape), dtype)


def constant(value) -> Initializer:
    """Fills with a scalar, or broadcasts an array-like to the variable's shape."""

    def init(shape, dtype=dtypes.float32):
        shape = _static(shape)
        if isinstance(value, (int, float)):
            return array_ops.fill(shape, value, dtype)
        return array_ops.constant(value, dtype=dtype, shape=shape)

    return init


def random_uniform(minval=-0.05, maxval=0.05, seed: int | None = None) -> Initializer:
    def init(shape, dtype=dtypes.float32):
        return random_ops.random_uniform(_static(shape), minval, maxval, dtype, seed)

    return init


def random_normal(mean=0.0, stddev=0.05, seed: int | None = None) -> Initializer:
    def init(shape, dtype=dtypes.float32):
        return random_ops.random_normal(_static(shape), mean, stddev, dtype, seed)

    return init


def truncated_normal(mean=0.0, stddev=0.05, seed: int | None = None) -> Initializer:
    def init(shape, dtype=dtypes.float32):
        return random_ops.truncated_normal(_static(shape), mean, stddev, dtype, seed)

    return init


def fans(shape) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of this shape."""
    shape = _static(shape)
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def variance_scaling(
    scale: float = 1.0,
    mode: str = "fan_in",
    distribution: str = "truncated_normal",
    seed: int | None = None,
) -> Initializer:
    """Values of variance ``scale / n``, n the fan in, fan out, or their mean (``fan_avg``)."""
    if mode not in ("fan_in", "fan_out", "fan_avg"):
        raise ValueError(f"mode must be fan_in, fan_out or fan_avg, got {mode!r}")
    if distribution not in ("truncated_normal", "uniform"):
        raise ValueError(f"distribution must be truncated_normal or uniform, got {distribution!r}")

    def init(shape, dtype=dtypes.float32):
        shape = _static(shape)
        fan_in, fan_out = fans(shape)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
        variance = scale / max(1.0, n)
        if distribution == "uniform":
            limit = math.sqrt(3.0 * variance)
            return random_ops.random_uniform(shape, -limit, limit, dtype, seed)
        stddev = math.sqrt(variance) / TRUNCATED_STDDEV
        return random_ops.truncated_normal(shape, 0.0, stddev, dtype, seed)

    return init


def glorot_uniform(seed: int | None = None) -> Initializer:
    """Uniform on +-sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010)."""
    return variance_scaling(1.0, "fan_avg", "uniform", seed)


def glorot_normal(seed: int | None = None) -> Initializer:
    return variance_scaling(1.0, "fan_avg", "truncated_normal", seed)


def he_normal(seed: int | None = None) -> Initializer:
    """Variance 2 / fan_in, for ReLU layers (He et al., 2015)."""
    return variance_scaling(2.0, "fan_in", "truncated_normal", seed)


def he_uniform(seed: int | None = None) -> Initializer:
    return variance_scaling(2.0, "fan_in", "uniform", seed)
