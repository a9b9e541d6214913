"""Activation kernels beyond ReLU: LeakyReLU and ELU, each beside its backward kernel.

Each is one fused kernel, as in TensorFlow, instead of a chain of elementwise ops, so a
layer's forward and backward pass each cost one pass over the activations.
"""

from __future__ import annotations

from .registry import KernelContext, kernel


@kernel("LeakyRelu")
def _leaky_relu(ctx: KernelContext):
    where, alpha = ctx.xp.where, ctx.attrs["alpha"]
    return lambda x: where(x > 0, x, x * x.dtype.type(alpha))


@kernel("LeakyReluGrad")
def _leaky_relu_grad(ctx: KernelContext):
    """``g`` where the features are positive, else ``alpha * g``."""
    where, alpha = ctx.xp.where, ctx.attrs["alpha"]
    return lambda g, x: where(x > 0, g, g * g.dtype.type(alpha))


@kernel("Elu")
def _elu(ctx: KernelContext):
    xp = ctx.xp

    def fn(x):
        # expm1 of the negative part only: the positive entries would overflow for nothing.
        return xp.where(x > 0, x, xp.expm1(xp.minimum(x, 0)))

    return fn


@kernel("EluGrad")
def _elu_grad(ctx: KernelContext):
    """From the Elu's output ``y``: ``g * (y + 1)`` where ``y < 0`` (there ``y + 1 = e^x``)."""
    where = ctx.xp.where
    return lambda g, y: where(y < 0, g * (y + 1), g)
