"""Kernels for constants, placeholders and identities (the compiler inlines most of them)."""

from __future__ import annotations

from .registry import KernelContext, kernel


@kernel("Const")
def _const(ctx: KernelContext):
    value = ctx.xp.asarray(ctx.attrs["value"])
    return lambda: value


@kernel("Placeholder")
def _placeholder(ctx: KernelContext):
    def fn():
        raise ValueError(f"placeholder {ctx.name!r} must be fed")

    return fn


def _identity(ctx: KernelContext):
    return lambda x: x


for _op in ("Identity", "StopGradient", "Enter", "Exit", "NextIteration", "LoopCond"):
    kernel(_op)(_identity)


@kernel("NoOp")
def _noop(ctx: KernelContext):
    def noop():
        return None

    return noop


@kernel("ZerosLike")
def _zeros_like(ctx: KernelContext):
    return ctx.xp.zeros_like


@kernel("OnesLike")
def _ones_like(ctx: KernelContext):
    return ctx.xp.ones_like
