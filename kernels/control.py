"""Control-flow kernels. The compiler writes these ops inline; the kernels define their
meaning (and serve any executor that does not compile)."""

from __future__ import annotations

from .registry import DEAD, KernelContext, kernel


@kernel("Switch", host_inputs=(1,))  # the predicate is decided on the host
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


for _op in ("Enter", "Exit", "NextIteration"):
    kernel(_op)(_forward)
kernel("LoopCond", host_inputs=(0,), host_outputs=(0,))(_forward)  # the predicate, on the host
