"""The devices of this task: its CPU and the GPUs it may use.

A task sees the GPUs its array module sees (CuPy honours ``CUDA_VISIBLE_DEVICES``, and a
pod sees the GPUs the device plugin gave it), capped by ``FLOWMILL_GPUS``: the operator
sets it to a worker's ``nvidia.com/gpu`` limit and to 0 for PS tasks, which keep
variables in host memory whatever the node has. Asked once per process.
"""

from __future__ import annotations

import functools
import os

from flowmill.kernels import device_count

from .cluster import ENV_GPUS as GPUS_ENV


@functools.cache
def gpu_count() -> int:
    """GPUs this task uses."""
    seen = device_count("GPU")
    cap = os.environ.get(GPUS_ENV, "").strip()
    if not cap:
        return seen
    try:
        limit = int(cap)
    except ValueError:
        raise ValueError(f"{GPUS_ENV} must be a whole number of GPUs, got {cap!r}") from None
    if limit < 0:
        raise ValueError(f"{GPUS_ENV} must not be negative, got {limit}")
    return min(seen, limit)


def local_devices() -> list[str]:
    """``["CPU:0", "GPU:0", ...]``."""
    return ["CPU:0"] + [f"GPU:{i}" for i in range(gpu_count())]
