"""``fused_batch_norm``: batch normalization over the last axis in one op each way.

Training mode normalizes with the batch's own moments and returns them (the biased
variance: the one the output uses, and the one ``layers.batch_normalization`` averages);
inference, with given moments, is a per-channel scale and shift of existing ops. The
kernels (``flowmill.kernels.batch_norm``) say why it is one op.
"""

from __future__ import annotations

from flowmill.kernels.shapes import ShapeError

from ..autodiff import defvjp
from ..graph import GraphError, Tensor, apply_op, convert_to_tensor
from ..op_def import define_op
from .math_ops import rsqrt


def _channels(x, scale, offset, op: str):
    if x.dtype.kind != "f":
        raise ShapeError(f"{op} needs floating-point inputs, got {x.dtype}")
    if x.shape is not None and len(x.shape) < 2:
        raise ShapeError(f"{op} needs inputs of rank >= 2 (channels last), got {x.shape}")
    c = None if x.shape is None else x.shape[-1]
    for what, t in (("scale", scale), ("offset", offset)):
        if t.dtype != x.dtype:
            raise ShapeError(f"{op} {what} has dtype {t.dtype}, inputs {x.dtype}")
        if t.shape is not None and (len(t.shape) != 1 or None not in (c, t.shape[0])
                                    and t.shape[0] != c):
            raise ShapeError(f"{op} {what} must be [{c}] (one per channel), got {t.shape}")
    return c


@define_op("FusedBatchNorm", attrs={"epsilon": 1e-3}, num_inputs=3)
def _fused_shape(inputs, attrs):
    x, scale, offset = inputs
    c = _channels(x, scale, offset, "FusedBatchNorm")
    return [(x.dtype, x.shape), (x.dtype, (c,)), (x.dtype, (c,))]


@define_op("FusedBatchNormGrad", attrs={"epsilon": 1e-3}, num_inputs=7, differentiable=False)
def _fused_grad_shape(inputs, attrs):
    g, x, scale = inputs[:3]
    c = _channels(x, scale, scale, "FusedBatchNormGrad")
    return [(x.dtype, x.shape), (x.dtype, (c,)), (x.dtype, (c,))]


def fused_batch_norm(
    x, scale, offset, mean=None, variance=None, epsilon: float = 1e-3, data_format="NHWC",
    is_training: bool = True, name=None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, batch_mean, batch_variance)`` (TensorFlow's ``tf.nn.fused_batch_norm``); with
    ``is_training=False``, ``y`` from the given ``mean`` and ``variance``, returned as
    they are. Channels are the last axis."""
    if data_format not in ("NHWC", "NC", "NWC", "NDHWC"):
        raise GraphError(f"fused_batch_norm: channels must be last, got data_format "
                         f"{data_format!r}")
    x = convert_to_tensor(x)
    scale = convert_to_tensor(scale, x.dtype)
    offset = convert_to_tensor(offset, x.dtype)
    if is_training:
        if mean is not None or variance is not None:
            raise GraphError("fused_batch_norm: in training the batch's moments are used; "
                             "pass mean and variance only with is_training=False")
        op = apply_op("FusedBatchNorm", [x, scale, offset], {"epsilon": float(epsilon)},
                      name or "FusedBatchNorm")
        return op.outputs[0], op.outputs[1], op.outputs[2]
    if mean is None or variance is None:
        raise GraphError("fused_batch_norm: inference (is_training=False) needs mean and variance")
    mean = convert_to_tensor(mean, x.dtype)
    variance = convert_to_tensor(variance, x.dtype)
    a = scale * rsqrt(variance + epsilon)
    return x * a + (offset - mean * a), mean, variance


@defvjp("FusedBatchNorm")
def _fused_grad(op, g, g_mean, g_variance):
    x, scale, _ = op.inputs
    _, mean, variance = op.outputs
    grad = apply_op(
        "FusedBatchNormGrad", [g, x, scale, mean, variance, g_mean, g_variance],
        {"epsilon": op.attrs["epsilon"]}, "FusedBatchNormGrad",
    )
    return list(grad.outputs)
