"""Optimizer updates as one kernel each (``ResourceApply*``), as TensorFlow's
``training_ops``.

An update reads a variable, its slots and its gradient, and writes the variable and the
slots: composed of ops it is a dozen elementwise kernels (on a GPU, each a launch reading
and writing whole buffers; fused, still one per slot and one for the variable), here
it is one. ``RULES`` writes each
rule once, in place, with the array module's ufuncs and arithmetic alone, term by term
as the composed ops compute it, so the two agree to the bit on the CPU. On a GPU the
same function goes through ``cupy.fuse``, which compiles its in-place statements into
one kernel writing every buffer it updates.

Inputs are the variable, its slots (in the optimizer's order), the gradient, then the
hyperparameters as 0-d values of the variable's dtype, already derived as the rule
uses them (Adam's bias-corrected rate, ``1 - beta``): they are computed once per step
for every variable, and reach a device kernel as scalars with the launch. The variable's
lock is taken, then each slot's (always in that order); buffers a reader still holds
are copied first (copy-on-write, ``state.writable``), so a value once read never changes
under its reader.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack

from .registry import KernelContext, kernel
from .state import writable

Rule = Callable[..., None]


def _gradient_descent(xp, attrs) -> Rule:
    def rule(var, grad, lr):
        var -= grad * lr

    return rule


def _momentum(xp, attrs) -> Rule:
    def rule(var, accum, grad, lr, momentum):
        accum *= momentum
        accum += grad
        var -= grad * lr + accum * momentum * lr

    def plain(var, accum, grad, lr, momentum):
        accum *= momentum
        accum += grad
        var -= accum * lr

    return rule if attrs["use_nesterov"] else plain


def _rsqrt(xp, x):
    return xp.reciprocal(xp.sqrt(x))  # as the Rsqrt kernel computes it


def _adagrad(xp, attrs) -> Rule:
    def rule(var, accum, grad, lr):
        accum += xp.square(grad)
        var -= grad * lr * _rsqrt(xp, accum)

    return rule


def _adadelta(xp, attrs) -> Rule:
    def rule(var, accum, accum_update, grad, lr, rho, one_minus_rho, eps):
        accum *= rho
        accum += xp.square(grad) * one_minus_rho
        update = xp.sqrt(accum_update + eps) * _rsqrt(xp, accum + eps) * grad
        var -= update * lr
        accum_update *= rho
        accum_update += xp.square(update) * one_minus_rho

    return rule


def _rmsprop(xp, attrs) -> Rule:
    centered, use_momentum = attrs["centered"], attrs["use_momentum"]

    def rule(var, ms, *rest):
        *slots, grad, lr, one_minus_decay, momentum, eps = rest
        mom = slots[0] if use_momentum else None
        mg = slots[-1] if centered else None
        ms += (xp.square(grad) - ms) * one_minus_decay
        if centered:
            mg += (grad - mg) * one_minus_decay
            step = grad * lr * _rsqrt(xp, (ms - xp.square(mg)) + eps)
        else:
            step = grad * lr * _rsqrt(xp, ms + eps)
        if use_momentum:
            mom *= momentum
            mom += step
            var -= mom
        else:
            var -= step

    return rule


def _adam(xp, attrs) -> Rule:
    def rule(var, m, v, grad, lr_t, one_minus_beta1, one_minus_beta2, eps):
        m += (grad - m) * one_minus_beta1
        v += (xp.square(grad) - v) * one_minus_beta2
        var -= (m * lr_t) / (xp.sqrt(v) + eps)

    return rule


# op type -> (rule builder, how many slots it updates given the op's attrs)
RULES: dict[str, tuple[Callable[..., Rule], Callable[[dict], int]]] = {
    "ResourceApplyGradientDescent": (_gradient_descent, lambda attrs: 0),
    "ResourceApplyMomentum": (_momentum, lambda attrs: 1),
    "ResourceApplyAdagrad": (_adagrad, lambda attrs: 1),
    "ResourceApplyAdadelta": (_adadelta, lambda attrs: 2),
    "ResourceApplyRMSProp": (
        _rmsprop, lambda attrs: 1 + bool(attrs["use_momentum"]) + bool(attrs["centered"])),
    "ResourceApplyAdam": (_adam, lambda attrs: 2),
}


@functools.cache
def _fused(op_type: str, flags: tuple, xp) -> Rule:
    """The rule as one kernel, made once per op type, flags and array module and shared
    by every variable (``cupy.fuse`` traces and compiles once per function object and
    argument types). It returns nothing: CuPy then adds no output array to the kernel,
    whose in-place statements write its arguments' buffers."""
    build, _ = RULES[op_type]
    return xp.fuse(kernel_name=op_type)(build(xp, dict(flags)))  # fuse(f, name=) decorates


def _apply(ctx: KernelContext):
    build, slots_of = RULES[ctx.op_type]
    xp, name, fix = ctx.xp, ctx.name, ctx.in_place_updates
    slots = slots_of(ctx.attrs)
    if getattr(xp, "fuse", None) is not None:  # one kernel for the whole update
        flags = tuple(sorted((k, v) for k, v in ctx.attrs.items() if k not in ("dtype", "shape")))
        rule = _fused(ctx.op_type, flags, xp)
    else:
        rule = build(xp, ctx.attrs)

    def fn(*inputs):
        states, grad, hypers = inputs[: slots + 1], inputs[slots + 1], inputs[slots + 2 :]
        with ExitStack() as locks:
            for state in states:  # the variable's lock first, always
                locks.enter_context(state.lock)
            buffers = [writable(state, fix) for state in states]
            if grad.shape != buffers[0].shape:
                raise ValueError(f"{name}: gradient of shape {list(grad.shape)} for variable "
                                 f"{states[0].name!r} of shape {list(buffers[0].shape)}")
            rule(*buffers, grad, *hypers)

    return fn


for _op in RULES:
    kernel(_op, scalar_inputs=True)(_apply)
