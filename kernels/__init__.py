"""Op kernels by device type, in one registry (see ``registry``). Importing this package
registers the NumPy (CPU) kernels, and the CuPy (GPU) ones when CuPy is importable."""

from . import array, control, data, math, nn, random, state  # noqa: F401  (registration)
from .registry import (
    ARRAY_MODULES,
    DEAD,
    KERNELS,
    KernelContext,
    add_array_module,
    get_builder,
    kernel,
)

__all__ = [
    "ARRAY_MODULES",
    "DEAD",
    "KERNELS",
    "KernelContext",
    "add_array_module",
    "get_builder",
    "kernel",
]
