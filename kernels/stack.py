"""Stacks of per-iteration values, for gradients through while loops (paper section 4.1).

The forward loop pushes each value a gradient needs, once per iteration; the backward
loop pops them in reverse. A stack is a plain list made fresh every step, so a step that
fails half-way leaves nothing behind for the next. ``max_size`` bounds it (the loop's
``maximum_iterations``): a loop that runs past it fails, named, instead of filling memory.
With ``swap_memory`` a device value is kept in host memory while it waits, as TensorFlow
swaps GPU tensors out of a long loop's stacks, and goes back to the device when popped.
A dead value (a cond branch inside the loop that was not taken) is pushed as it is, so
pushes and pops stay paired whichever branch ran.
"""

from __future__ import annotations

from .registry import DEAD, KernelContext, kernel


class StackFullError(RuntimeError):
    pass


class StackEmptyError(RuntimeError):
    pass


class Stack(list):
    """One stack's values; ``name`` is what its errors call it."""

    __slots__ = ("name", "max_size")

    def __init__(self, name: str, max_size: int):
        super().__init__()
        self.name = name
        self.max_size = max_size


@kernel("StackV2")
def _stack(ctx: KernelContext):
    name = ctx.attrs["stack_name"] or ctx.name
    max_size = ctx.attrs["max_size"]
    return lambda: Stack(name, max_size)


@kernel("StackPushV2")
def _push(ctx: KernelContext):
    xp = ctx.xp
    swap = ctx.attrs["swap_memory"] and xp.__name__ != "numpy"

    def fn(stack: Stack, value) -> None:
        if 0 <= stack.max_size <= len(stack):
            raise StackFullError(
                f"stack {stack.name!r} is full: {stack.max_size} values (the loop ran more "
                "iterations than its maximum_iterations allow)"
            )
        if swap and value is not DEAD:
            value = xp.asnumpy(value)
        stack.append(value)

    return fn


@kernel("StackPopV2")
def _pop(ctx: KernelContext):
    xp = ctx.xp
    swap = ctx.attrs["swap_memory"] and xp.__name__ != "numpy"

    def fn(stack: Stack):
        if not stack:
            raise StackEmptyError(f"stack {stack.name!r} is empty: popped more than pushed")
        value = stack.pop()
        return xp.asarray(value) if swap and value is not DEAD else value

    return fn
