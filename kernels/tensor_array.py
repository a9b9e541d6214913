"""TensorArrays: a step's list of tensors indexed by position, written once each.

A ``dynamic_rnn`` reads its input at step ``t`` and writes its output at step ``t`` with no
copy (the array holds references, an unstacked input is a list of views), and stacks the
outputs once at the end. A TensorArray lives for one step, like a stack. Its gradient
array (``grad_array``) is made on first use and is attached to it, so the gradients of
reads and writes in different loops find the same one; gradient writes to one position
add up (a value read twice has two gradients), and an unwritten gradient reads as zeros.

The gradient array keeps the forward array's list of values, not the array itself: an
array that held its gradient array holding it would be a reference cycle, freed only by
the garbage collector, and a step of ``dynamic_rnn`` would leave its per-step gate
gradients (tens of megabytes for an LSTM-512) in memory for many steps after its own.
"""

from __future__ import annotations

import numpy

from .registry import KernelContext, kernel


class TensorArrayError(IndexError):
    pass


class TensorArray:
    __slots__ = ("name", "values", "dynamic", "forward_values", "_grad", "xp", "element_shape")

    def __init__(
        self, name: str, size: int, dynamic: bool, xp, element_shape, forward_values=None
    ):
        self.name = name
        self.values: list = [None] * size
        self.dynamic = dynamic
        # The values of the array this one holds the gradients of (None: not a gradient).
        self.forward_values: list | None = forward_values
        self._grad: TensorArray | None = None
        self.xp = xp
        self.element_shape = element_shape

    def grad_array(self) -> TensorArray:
        if self._grad is None:
            self._grad = TensorArray(
                f"{self.name} (gradient)", len(self.values), self.dynamic, self.xp,
                self.element_shape, forward_values=self.values,
            )
        return self._grad

    def _index(self, i, growing: bool = False) -> int:
        i = int(i)
        if i < 0 or (i >= len(self.values) and not (growing and self.dynamic)):
            raise TensorArrayError(
                f"TensorArray {self.name!r}: index {i} out of range for size {len(self.values)}"
            )
        if i >= len(self.values):
            self.values.extend([None] * (i + 1 - len(self.values)))
        return i

    def write(self, i, value) -> None:
        i = self._index(i, growing=True)
        old = self.values[i]
        if old is None:
            self.values[i] = value
        elif self.forward_values is not None:
            self.values[i] = old + value
        else:
            raise TensorArrayError(
                f"TensorArray {self.name!r}: position {i} written twice (each is written once)"
            )

    def read(self, i):
        i = self._index(i)
        value = self.values[i]
        if value is None:
            if self.forward_values is not None:
                forward = self.forward_values[i] if i < len(self.forward_values) else None
                if forward is None:
                    raise TensorArrayError(
                        f"TensorArray {self.name!r}: position {i} read before the forward "
                        "array's was written"
                    )
                return self.xp.zeros_like(forward)
            raise TensorArrayError(f"TensorArray {self.name!r}: position {i} read before written")
        return value

    def stack(self):
        if not self.values:
            shape = self.element_shape
            if shape is None or any(d is None for d in shape):
                raise TensorArrayError(
                    f"TensorArray {self.name!r} is empty and its element shape is not known"
                )
            return self.xp.zeros((0, *shape))
        return self.xp.stack([self.read(i) for i in range(len(self.values))])

    def unstack(self, value) -> None:
        n = value.shape[0] if value.ndim else 0
        if value.ndim == 0:
            raise TensorArrayError(f"TensorArray {self.name!r}: cannot unstack a scalar")
        if n != len(self.values):
            if not self.dynamic:
                raise TensorArrayError(
                    f"TensorArray {self.name!r}: unstacking {n} values into size "
                    f"{len(self.values)}"
                )
            self.values[:] = [None] * n  # in place: a gradient array shares the list
        for i in range(n):
            self.write(i, value[i])


@kernel("TensorArrayV3", host_inputs=(0,))
def _tensor_array(ctx: KernelContext):
    a, xp = ctx.attrs, ctx.xp
    name = a["tensor_array_name"] or ctx.name
    flow = xp.zeros((), xp.float32)

    def fn(size):
        return TensorArray(name, int(size), a["dynamic_size"], xp, a["element_shape"]), flow

    return fn


@kernel("TensorArrayGradV3")
def _grad(ctx: KernelContext):
    return lambda ta, flow: ta.grad_array()


@kernel("TensorArrayWriteV3", host_inputs=(1,))
def _write(ctx: KernelContext):
    def fn(ta, index, value, flow):
        ta.write(index, value)
        return flow

    return fn


@kernel("TensorArrayReadV3", host_inputs=(1,))
def _read(ctx: KernelContext):
    return lambda ta, index, flow: ta.read(index)


@kernel("TensorArrayStackV3")
def _stack(ctx: KernelContext):
    return lambda ta, flow: ta.stack()


@kernel("TensorArrayUnstackV3")
def _unstack(ctx: KernelContext):
    def fn(ta, value, flow):
        ta.unstack(value)
        return flow

    return fn


@kernel("TensorArraySizeV3", host_outputs=(0,))
def _size(ctx: KernelContext):
    return lambda ta, flow: numpy.asarray(len(ta.values), numpy.int32)  # in host memory
