"""Copies between a task's host memory and one of its devices, the kernels of the nodes
``insert_copies`` puts on such edges. Each runs on the device side (with its device
current): ``_HostToDevice`` copies a NumPy array into a new device array, ``_DeviceToHost``
a device array into a new NumPy array. A dead value passes through as the executor passes
it through any op. ``_HostScalar`` turns a 0-d host value into the NumPy scalar an
elementwise device kernel takes by value, in place of a copy."""

from __future__ import annotations

from .registry import KernelContext, kernel


@kernel("_HostToDevice", host_inputs=(0,))
def _host_to_device(ctx: KernelContext):
    return ctx.xp.asarray


@kernel("_DeviceToHost", host_outputs=(0,))
def _device_to_host(ctx: KernelContext):
    return ctx.xp.asnumpy


@kernel("_HostScalar", host_only="makes a host scalar for a device kernel's launch")
def _host_scalar(ctx: KernelContext):
    return lambda x: x[()]  # a 0-d array's NumPy scalar
