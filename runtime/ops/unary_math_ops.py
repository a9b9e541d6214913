"""Elementwise functions beyond ``math_ops``' core: Cos and Sin (the cosine learning-rate
schedule) and Log1p (losses that stay exact where ``log(1 + tiny)`` would round to 0).
One kernel each (``flowmill.kernels.math``), a gradient each, so second derivatives work.
"""

from __future__ import annotations

from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, require_float


def _float_unary(inputs, attrs):
    require_float(inputs[0])
    return [(inputs[0].dtype, inputs[0].shape)]


for _name in ("Cos", "Sin", "Log1p"):
    define_op(_name, num_inputs=1)(_float_unary)


def cos(x, name=None) -> Tensor:
    return apply_op("Cos", [convert_to_tensor(x)], name=name).outputs[0]


def sin(x, name=None) -> Tensor:
    return apply_op("Sin", [convert_to_tensor(x)], name=name).outputs[0]


def log1p(x, name=None) -> Tensor:
    """``log(1 + x)``, accurate for ``x`` near 0."""
    return apply_op("Log1p", [convert_to_tensor(x)], name=name).outputs[0]


@defvjp("Cos")
def _cos_grad(op, g):
    return [-(g * sin(op.inputs[0]))]


@defvjp("Sin")
def _sin_grad(op, g):
    return [g * cos(op.inputs[0])]


@defvjp("Log1p")
def _log1p_grad(op, g):
    return [g / (1.0 + op.inputs[0])]
