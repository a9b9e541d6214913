"""LeakyReLU and ELU, each a forward op and a backward op as ReLU is (``nn_ops``), so a
layer's backward pass is one kernel (``flowmill.kernels.activations``). The backward ops
have gradients too, so second derivatives work.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, require_float, require_same_dtype
from .array_ops import zeros_like
from .math_ops import less
from .select_ops import where


def _float_unary(inputs, attrs):
    require_float(inputs[0])
    return [(inputs[0].dtype, inputs[0].shape)]


def _float_pair(inputs, attrs):
    """A gradient and the forward value it goes with: one float dtype, one shape."""
    a, b = inputs
    dtype = require_same_dtype(inputs)
    if dtype.kind != "f":
        raise ShapeError(f"expected floating-point inputs, got {dtype}")
    if not shapes.compatible(a.shape, b.shape):
        raise ShapeError(f"shapes differ: {shapes.fmt(a.shape)} vs {shapes.fmt(b.shape)}")
    return [(dtype, shapes.merge(a.shape, b.shape))]


define_op("LeakyRelu", attrs={"alpha": 0.2}, num_inputs=1)(_float_unary)
define_op("LeakyReluGrad", attrs={"alpha": 0.2}, num_inputs=2)(_float_pair)
define_op("Elu", num_inputs=1)(_float_unary)
define_op("EluGrad", num_inputs=2)(_float_pair)


def leaky_relu(features, alpha: float = 0.2, name=None) -> Tensor:
    """``features`` where positive, else ``alpha * features``."""
    if isinstance(alpha, Tensor) or not isinstance(alpha, (int, float)):
        raise TypeError(f"leaky_relu: alpha must be a Python number, got {alpha!r}")
    x = convert_to_tensor(features)
    return apply_op("LeakyRelu", [x], {"alpha": float(alpha)}, name).outputs[0]


def leaky_relu_grad(gradients, features, alpha: float = 0.2, name=None) -> Tensor:
    """``gradients`` where ``features`` is positive, else ``alpha * gradients``."""
    return apply_op("LeakyReluGrad", [gradients, features], {"alpha": alpha}, name).outputs[0]


def elu(features, name=None) -> Tensor:
    """``features`` where positive, else ``exp(features) - 1`` (Clevert et al., 2015)."""
    return apply_op("Elu", [convert_to_tensor(features)], name=name).outputs[0]


def elu_grad(gradients, outputs, name=None) -> Tensor:
    """From the Elu's output ``y``: ``gradients * (y + 1)`` where ``y < 0``, else ``gradients``."""
    return apply_op("EluGrad", [gradients, outputs], name=name).outputs[0]


@defvjp("LeakyRelu")
def _leaky_relu_vjp(op, g):
    return [leaky_relu_grad(g, op.inputs[0], op.attrs["alpha"])]


@defvjp("LeakyReluGrad")
def _leaky_relu_grad_vjp(op, h):
    # Linear in the gradient; the mask from the features is constant almost everywhere.
    return [leaky_relu_grad(h, op.inputs[1], op.attrs["alpha"]), None]


@defvjp("Elu")
def _elu_vjp(op, g):
    return [elu_grad(g, op.outputs[0])]


@defvjp("EluGrad")
def _elu_grad_vjp(op, h):
    g, y = op.inputs
    negative = less(y, 0.0)
    return [elu_grad(h, y), where(negative, h * g, zeros_like(h))]
