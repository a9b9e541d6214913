"""Switch and Merge. The compiler writes both inline; these kernels define their meaning."""

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
