"""Control-flow kernels. The compiler writes these ops inline; the kernels define their
meaning (and serve any executor that does not compile)."""

from __future__ import annotations

from .registry import DEAD, KernelContext, kernel


@kernel("Switch")
def _switch(ctx: KernelContext):
    return lambda data, pred: (DEAD, data) if pred else (data, DEAD)


@kernel("Merge")
def _merge(ctx: KernelContext):
    def fn(*inputs):
        for i, value in enumerate(inputs):
            if value is not DEAD:
                return value, i
        return DEAD, DEAD

    return fn


def _forward(ctx: KernelContext):
    return lambda x: x


for _op in ("Enter", "Exit", "NextIteration", "LoopCond"):
    kernel(_op)(_forward)
