"""Copies between a task's host memory and one of its devices, the kernels of the nodes
``insert_copies`` puts on such edges. Each runs on the device side (with its device
current). A dead value passes through as the executor passes it through any op.

- ``_HostToDevice``: ``asarray``, which CuPy queues on the current stream without waiting
  (asynchronous where the source is pinned: the values a task pulls from a PS are, see
  ``pinned_allocator``; CuPy keeps pinned memory from its pool alive until the copy ends).
- ``_DeviceToHost``: into pinned memory from CuPy's pinned pool (a value sent to a PS is
  copied once, at full speed), waiting for the copy: the host reads it next.
- ``_HostScalar`` turns a 0-d host value into the NumPy scalar an elementwise device
  kernel takes by value, in place of a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy

from .registry import ARRAY_MODULES, KernelContext, kernel


@kernel("_HostToDevice", host_inputs=(0,))
def _host_to_device(ctx: KernelContext):
    return ctx.xp.asarray


@kernel("_DeviceToHost", host_outputs=(0,))
def _device_to_host(ctx: KernelContext):
    empty = _empty_pinned(ctx.xp)
    if empty is None:
        return ctx.xp.asnumpy

    def copy(x):
        out = empty(x.shape, x.dtype)
        x.get(out=out)
        return out

    return copy


@kernel("_DeviceCopy")
def _device_copy(ctx: KernelContext):
    return lambda x: x.copy()


@kernel("_HostScalar", host_only="makes a host scalar for a device kernel's launch")
def _host_scalar(ctx: KernelContext):
    return lambda x: x[()]  # a 0-d array's NumPy scalar


def _empty_pinned(xp) -> Callable | None:
    """``empty(shape, dtype)`` in pinned host memory for device module ``xp``."""
    if xp is numpy:
        return None
    if hasattr(xp, "empty_pinned"):  # the stand-in
        return xp.empty_pinned
    import cupyx  # pragma: no cover - needs CuPy

    return cupyx.empty_pinned


def pinned_allocator(device_type: str = "GPU") -> Callable[[int], numpy.ndarray] | None:
    """``allocate(nbytes)``: a 1-d uint8 array in pinned host memory (CuPy's pinned pool),
    for receive buffers a task copies to its GPU; None without a GPU module."""
    xp = ARRAY_MODULES.get(device_type)
    empty = None if xp is None else _empty_pinned(xp)
    if empty is None:
        return None
    return lambda nbytes: empty((nbytes,), numpy.uint8)
