"""``fm.layers``: TensorFlow 1.x's functional layers, built of ops and ``get_variable``.

Each layer opens a variable scope named ``name`` (or a unique default: ``dense``,
``dense_1``, ...) and makes its variables there, so ``reuse=True`` with the same name
shares them (a tower, or an evaluation graph over the training weights). Kernels start
Glorot uniform and biases at zero, as in TensorFlow. Images are NHWC (``channels_last``).

``training`` (batch normalization, dropout) is a Python bool, fixed when the graph is
built, or a bool scalar tensor fed per step; with a tensor, ``cond`` runs only the
chosen branch. Batch normalization's moving averages are updated by ops in the
``UPDATE_OPS`` collection, which the training step must run, as in TensorFlow::

    with fm.control_dependencies(fm.get_collection(fm.GraphKeys.UPDATE_OPS)):
        train = optimizer.minimize(loss)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from flowmill.kernels import shapes

from . import initializers
from .graph import GraphError, GraphKeys, Tensor, convert_to_tensor
from .ops import nn_ops
from .ops.array_ops import constant, identity, reshape
from .ops.batch_norm_ops import fused_batch_norm
from .ops.control_flow_ops import cond
from .ops.math_ops import matmul, rsqrt
from .ops.nn_impl import moments
from .variable_scopes import Reuse, get_variable, variable_scope

Activation = Callable[[Tensor], Tensor] | None


def _float_input(inputs, layer: str, min_rank: int) -> Tensor:
    x = convert_to_tensor(inputs)
    if x.dtype.kind != "f":
        raise TypeError(f"{layer}: inputs {x.name} must be floating point, are {x.dtype}")
    if x.shape is None or len(x.shape) < min_rank:
        raise GraphError(
            f"{layer}: inputs {x.name} need a known rank >= {min_rank}, have shape "
            f"{shapes.fmt(x.shape)}"
        )
    return x


def _known_dim(x: Tensor, axis: int, layer: str, what: str) -> int:
    d = x.shape[axis]
    if d is None:
        raise GraphError(
            f"{layer}: the {what} dim of inputs {x.name} {shapes.fmt(x.shape)} must be known "
            "to size the variables"
        )
    return d


def _channels_last(data_format: str, layer: str) -> None:
    if data_format not in ("channels_last", "NHWC"):
        raise ValueError(f"{layer}: only channels_last data is supported, got {data_format!r}")


def _padding(padding: str, layer: str) -> str:
    if not isinstance(padding, str) or padding.upper() not in ("SAME", "VALID"):
        raise ValueError(f"{layer}: padding must be 'valid' or 'same', got {padding!r}")
    return padding.upper()


def _finish(y: Tensor, bias, activation: Activation) -> Tensor:
    if bias is not None:
        y = nn_ops.bias_add(y, bias)
    return activation(y) if activation is not None else y


# ---- dense and convolution


def dense(
    inputs,
    units: int,
    activation: Activation = None,
    use_bias: bool = True,
    kernel_initializer=None,
    bias_initializer=None,
    trainable: bool = True,
    name: str | None = None,
    reuse: Reuse = None,
) -> Tensor:
    """``activation(inputs @ kernel + bias)`` over the last axis; ``kernel`` is
    ``[in, units]``. Inputs of rank > 2 are flattened to rows and back (at most one of
    their leading dims unknown)."""
    x = _float_input(inputs, "dense", 2)
    n_in = _known_dim(x, -1, "dense", "last")
    lead = x.shape[:-1]
    if len(lead) > 1 and sum(d is None for d in lead) > 1:
        raise GraphError(
            f"dense: inputs {x.name} {shapes.fmt(x.shape)} may have at most one unknown dim"
        )
    with variable_scope(name, default_name="dense", values=[x], reuse=reuse):
        kernel = get_variable(
            "kernel", (n_in, int(units)), x.dtype,
            kernel_initializer or initializers.glorot_uniform(), trainable,
        )
        bias = (
            get_variable("bias", (int(units),), x.dtype,
                         bias_initializer or initializers.zeros(), trainable)
            if use_bias else None
        )
        if len(lead) == 1:
            y = matmul(x, kernel)
        else:
            y = reshape(matmul(reshape(x, (-1, n_in)), kernel), (*lead, int(units)))
        return _finish(y, bias, activation)


def conv2d(
    inputs,
    filters: int,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] = (1, 1),
    padding: str = "valid",
    data_format: str = "channels_last",
    dilation_rate: int | Sequence[int] = (1, 1),
    activation: Activation = None,
    use_bias: bool = True,
    kernel_initializer=None,
    bias_initializer=None,
    trainable: bool = True,
    name: str | None = None,
    reuse: Reuse = None,
) -> Tensor:
    """2-D convolution of NHWC ``inputs`` with a ``[kh, kw, in, filters]`` kernel."""
    _channels_last(data_format, "conv2d")
    x = _float_input(inputs, "conv2d", 4)
    if len(x.shape) != 4:
        raise GraphError(f"conv2d: inputs {x.name} must be NHWC, have {shapes.fmt(x.shape)}")
    n_in = _known_dim(x, 3, "conv2d", "channel")
    kh, kw = _pair(kernel_size, "conv2d kernel_size")
    with variable_scope(name, default_name="conv2d", values=[x], reuse=reuse):
        kernel = get_variable(
            "kernel", (kh, kw, n_in, int(filters)), x.dtype,
            kernel_initializer or initializers.glorot_uniform(), trainable,
        )
        bias = (
            get_variable("bias", (int(filters),), x.dtype,
                         bias_initializer or initializers.zeros(), trainable)
            if use_bias else None
        )
        y = nn_ops.conv2d(
            x, kernel, _pair(strides, "conv2d strides"), _padding(padding, "conv2d"),
            dilations=_pair(dilation_rate, "conv2d dilation_rate"),
        )
        return _finish(y, bias, activation)


def _pair(value, what: str) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)):
        return int(value), int(value)
    value = tuple(int(v) for v in value)
    if len(value) != 2:
        raise ValueError(f"{what} must be an int or 2 ints, got {value!r}")
    return value


def max_pooling2d(
    inputs,
    pool_size: int | Sequence[int],
    strides: int | Sequence[int],
    padding: str = "valid",
    data_format: str = "channels_last",
    name: str | None = None,
) -> Tensor:
    """The max of each ``pool_size`` window of NHWC ``inputs``; no variables."""
    _channels_last(data_format, "max_pooling2d")
    x = convert_to_tensor(inputs)
    with x.graph.as_default(), x.graph.name_scope(name or "max_pooling2d"):
        return nn_ops.max_pool(
            x, _pair(pool_size, "max_pooling2d pool_size"),
            _pair(strides, "max_pooling2d strides"), _padding(padding, "max_pooling2d"),
        )


def flatten(inputs, name: str | None = None) -> Tensor:
    """``[batch, ...]`` to ``[batch, everything else]``; only the batch dim may be unknown."""
    x = convert_to_tensor(inputs)
    if x.shape is None or not x.shape:
        raise GraphError(f"flatten: inputs {x.name} need a known rank >= 1")
    rest = x.shape[1:]
    if None in rest:
        raise GraphError(
            f"flatten: all dims of inputs {x.name} {shapes.fmt(x.shape)} but the first "
            "must be known"
        )
    with x.graph.as_default(), x.graph.name_scope(name or "flatten"):
        return reshape(x, (x.shape[0] if x.shape[0] is not None else -1, math.prod(rest)))


# ---- training-dependent layers


def _static_training(training) -> bool | None:
    """The flag as a Python bool, or None for a tensor (decided per step)."""
    if isinstance(training, (bool, np.bool_)):
        return bool(training)
    flag = convert_to_tensor(training)
    if flag.dtype != np.bool_ or (flag.shape is not None and flag.shape != ()):
        raise TypeError(
            f"training must be a Python bool or a bool scalar tensor, got {flag.name} of "
            f"{shapes.fmt(flag.shape)} {flag.dtype}"
        )
    return None


def dropout(
    inputs,
    rate: float = 0.5,
    noise_shape=None,
    seed: int | None = None,
    training=False,
    name: str | None = None,
) -> Tensor:
    """In training, zero each entry with probability ``rate`` and scale the rest by
    ``1 / (1 - rate)``; otherwise the inputs unchanged. Off by default, as in TensorFlow."""
    x = convert_to_tensor(inputs)
    static = _static_training(training)
    with x.graph.as_default(), x.graph.name_scope(name or "dropout"):
        if static is False:
            return identity(x)
        if static is True:
            return nn_ops.dropout(x, rate, noise_shape, seed)
        return cond(
            convert_to_tensor(training),
            lambda: nn_ops.dropout(x, rate, noise_shape, seed),
            lambda: identity(x),
        )


def batch_normalization(
    inputs,
    axis: int = -1,
    momentum: float = 0.99,
    epsilon: float = 1e-3,
    center: bool = True,
    scale: bool = True,
    beta_initializer=None,
    gamma_initializer=None,
    moving_mean_initializer=None,
    moving_variance_initializer=None,
    training=False,
    trainable: bool = True,
    name: str | None = None,
    reuse: Reuse = None,
) -> Tensor:
    """Normalize each channel (``axis``) to zero mean and unit variance, then scale by
    ``gamma`` and shift by ``beta`` (Ioffe and Szegedy, 2015).

    In training the batch's moments are used and the moving averages
    (``moving = momentum * moving + (1 - momentum) * batch``) are updated by ops put in
    ``UPDATE_OPS``; at inference the moving averages are used. The batch variance is the
    biased one, for the output and the average alike (TensorFlow's non-fused kernel).
    """
    x = _float_input(inputs, "batch_normalization", 2)
    rank = len(x.shape)
    if not -rank <= axis < rank:
        raise GraphError(
            f"batch_normalization: axis {axis} is out of range for inputs {x.name} "
            f"{shapes.fmt(x.shape)}"
        )
    axis %= rank
    channels = _known_dim(x, axis, "batch_normalization", f"axis {axis}")
    static = _static_training(training)
    reduce_axes = [i for i in range(rank) if i != axis]
    param_shape = (channels,)

    def broadcast(t: Tensor) -> Tensor:
        """A per-channel vector shaped to broadcast along ``axis``."""
        if axis == rank - 1:
            return t
        return reshape(t, tuple(channels if i == axis else 1 for i in range(rank)))

    with variable_scope(name, default_name="batch_normalization", values=[x], reuse=reuse):
        dtype = x.dtype
        gamma = get_variable(
            "gamma", param_shape, dtype, gamma_initializer or initializers.ones(), trainable
        ) if scale else None
        beta = get_variable(
            "beta", param_shape, dtype, beta_initializer or initializers.zeros(), trainable
        ) if center else None
        moving_mean = get_variable(
            "moving_mean", param_shape, dtype,
            moving_mean_initializer or initializers.zeros(), trainable=False,
        )
        moving_variance = get_variable(
            "moving_variance", param_shape, dtype,
            moving_variance_initializer or initializers.ones(), trainable=False,
        )
        if axis == rank - 1 and static is not False:
            return _fused(x, gamma, beta, moving_mean, moving_variance, momentum, epsilon,
                          training, static)
        if static is False:
            mean, variance = moving_mean.value(), moving_variance.value()
        else:
            if static is True:
                mean, variance = moments(x, reduce_axes)
            else:
                # Inference takes the averages, and then the updates below change nothing
                # (moving - mean is exactly 0), so they need no branch of their own.
                mean, variance = cond(
                    convert_to_tensor(training),
                    lambda: moments(x, reduce_axes),
                    lambda: (identity(moving_mean.value()), identity(moving_variance.value())),
                )
            decay = 1.0 - momentum
            for var, batch in ((moving_mean, mean), (moving_variance, variance)):
                update = var.assign_sub((var.value() - batch) * decay, name="update")
                x.graph.add_to_collection(GraphKeys.UPDATE_OPS, update.op)
        # y = x * inv + (beta - mean * inv), inv = gamma / sqrt(variance + epsilon).
        inv = rsqrt(variance + epsilon)
        if gamma is not None:
            inv = inv * gamma
        shift = -(mean * inv) if beta is None else beta - mean * inv
        return x * broadcast(inv) + broadcast(shift)


def _fused(x, gamma, beta, moving_mean, moving_variance, momentum, epsilon, training, static):
    """Channels last, training (or deciding per step): one fused op each way."""
    channels = x.shape[-1]
    scale = gamma.value() if gamma is not None else constant(np.ones(channels, x.dtype))
    offset = beta.value() if beta is not None else constant(np.zeros(channels, x.dtype))

    def train():
        return fused_batch_norm(x, scale, offset, epsilon=epsilon)

    def infer():
        return fused_batch_norm(x, scale, offset, moving_mean.value(), moving_variance.value(),
                                epsilon, is_training=False)

    # In inference the updates below change nothing (moving - moving is exactly 0).
    y, mean, variance = train() if static else cond(convert_to_tensor(training), train, infer)
    decay = 1.0 - momentum
    for var, batch in ((moving_mean, mean), (moving_variance, variance)):
        update = var.assign_sub((var.value() - batch) * decay, name="update")
        x.graph.add_to_collection(GraphKeys.UPDATE_OPS, update.op)
    return y


__all__ = [
    "batch_normalization",
    "conv2d",
    "dense",
    "dropout",
    "flatten",
    "max_pooling2d",
]
