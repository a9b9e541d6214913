"""Op kernels by device type, in one registry (see ``registry``). Importing this package
registers the NumPy (CPU) kernels, and the CuPy (GPU) ones when CuPy is importable, and
sets how host memory is reused (``host_memory``)."""

import os

from . import (  # noqa: F401  (registration)
    accumulator,
    activations,
    array,
    batch_norm,
    candidate_sampling,
    checkpoint,
    control,
    copies,
    data,
    debug,
    fusion,
    graph_segment,
    host_memory,
    math,
    nn,
    random,
    rnn,
    sendrecv,
    stack,
    state,
    summary,
    tensor_array,
    top_k,
    training,
)
from .copies import pinned_allocator
from .registry import (
    ARRAY_MODULES,
    DEAD,
    FRAME_KERNELS,
    HOST_INPUTS,
    HOST_ONLY,
    HOST_OUTPUTS,
    KERNELS,
    SCALAR_INPUTS,
    KernelContext,
    add_array_module,
    device_count,
    device_memory,
    get_builder,
    gpu_support,
    kernel,
    memory_limit,
    on_device,
    remove_array_module,
    set_memory_limit,
)

host_memory.keep_freed_memory()

try:  # GPU kernels: the same generic builders over CuPy, when it is installed
    import cupy
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None
if cupy is not None:  # pragma: no cover
    add_array_module("GPU", cupy)
elif os.environ.get("FLOWMILL_STANDIN_GPUS"):  # the strict stand-in, for tests without one
    from . import standin

    add_array_module("GPU", standin.module(int(os.environ["FLOWMILL_STANDIN_GPUS"])))
    if os.environ.get("FLOWMILL_STANDIN_COUNTS"):
        standin.report_at_exit(os.environ["FLOWMILL_STANDIN_COUNTS"])

__all__ = [
    "ARRAY_MODULES",
    "DEAD",
    "HOST_INPUTS",
    "HOST_ONLY",
    "HOST_OUTPUTS",
    "KERNELS",
    "SCALAR_INPUTS",
    "KernelContext",
    "add_array_module",
    "device_count",
    "device_memory",
    "get_builder",
    "gpu_support",
    "kernel",
    "memory_limit",
    "on_device",
    "pinned_allocator",
    "remove_array_module",
    "set_memory_limit",
]
