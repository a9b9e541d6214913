"""Op kernels by device type, in one registry (see ``registry``). Importing this package
registers the NumPy (CPU) kernels, and the CuPy (GPU) ones when CuPy is importable, and
sets how host memory is reused (``host_memory``)."""

from . import (  # noqa: F401  (registration)
    accumulator,
    activations,
    array,
    batch_norm,
    candidate_sampling,
    checkpoint,
    control,
    data,
    debug,
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
)
from .registry import (
    ARRAY_MODULES,
    DEAD,
    FRAME_KERNELS,
    KERNELS,
    KernelContext,
    add_array_module,
    get_builder,
    kernel,
)

host_memory.keep_freed_memory()

try:  # GPU kernels: the same generic builders over CuPy, when it is installed
    import cupy
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None
else:  # pragma: no cover
    add_array_module("GPU", cupy)

__all__ = [
    "ARRAY_MODULES",
    "DEAD",
    "KERNELS",
    "KernelContext",
    "add_array_module",
    "get_builder",
    "kernel",
]
