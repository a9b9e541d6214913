"""Optimizer updates as single ops (``ResourceApply*``), as TensorFlow's ``training_ops``:
one kernel per variable and step, where the same rule composed of ops is a dozen (see
``flowmill.kernels.training``).

An update's inputs are the variable's handle, its slots' handles, the gradient, and the
hyperparameters as 0-d tensors of the variable's dtype; it has no outputs (order on it
with control dependencies, as on any update).
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Operation, Tensor, apply_op
from ..op_def import define_op

# op type -> its hyperparameters, in input order after the gradient
HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "ResourceApplyGradientDescent": ("lr",),
    "ResourceApplyMomentum": ("lr", "momentum"),
    "ResourceApplyAdagrad": ("lr",),
    "ResourceApplyAdadelta": ("lr", "rho", "one_minus_rho", "epsilon"),
    "ResourceApplyRMSProp": ("lr", "one_minus_decay", "momentum", "epsilon"),
    "ResourceApplyAdam": ("lr_t", "one_minus_beta1", "one_minus_beta2", "epsilon"),
}
_FLAGS = {
    "ResourceApplyMomentum": {"use_nesterov": False},
    "ResourceApplyRMSProp": {"centered": False, "use_momentum": True},
}


def _shape_fn(op_type: str):
    hypers = HYPERPARAMETERS[op_type]

    def fn(inputs, attrs):
        dtype, shape = attrs["dtype"], attrs["shape"]
        states = 0
        while states < len(inputs) and inputs[states].dtype == dtypes.resource:
            states += 1
        if states == 0 or len(inputs) != states + 1 + len(hypers):
            raise ShapeError(f"takes a variable, its slots, a gradient and {len(hypers)} "
                             f"hyperparameters ({', '.join(hypers)}); got {len(inputs)} inputs")
        grad = inputs[states]
        if grad.dtype != dtype:
            raise ShapeError(f"variable has dtype {dtype}, gradient has {grad.dtype}")
        if not shapes.compatible(shape, grad.shape):
            raise ShapeError(f"variable has shape {shapes.fmt(shape)}, gradient has "
                             f"{shapes.fmt(grad.shape)}")
        for name, t in zip(hypers, inputs[states + 1 :], strict=True):
            if t.dtype != dtype or not shapes.compatible((), t.shape):
                raise ShapeError(f"hyperparameter {name} must be a {dtype} scalar, "
                                 f"got {t.dtype}{shapes.fmt(t.shape)}")
        return []

    return fn


for _op, _hypers in HYPERPARAMETERS.items():
    define_op(
        _op,
        attrs={"dtype": None, "shape": None, **_FLAGS.get(_op, {})},
        stateful=True,
        differentiable=False,
    )(_shape_fn(_op))


def apply_update(op_type: str, var, slots: list, grad: Tensor, hypers: list[Tensor],
                 **flags) -> Operation:
    """``op_type`` applied to ``var`` (a Variable) and its ``slots``, with the variable."""
    handles = [var.handle, *(s.handle for s in slots)]
    attrs = {"dtype": var.dtype, "shape": var.shape, **flags}
    with var.graph.colocate_with(var.handle):
        return apply_op(op_type, [*handles, grad, *hypers], attrs)
