"""How much of each GPU a process may use: TensorFlow 1.x's session options, and the error a
step gets when it needs more.

``Session(config=fm.ConfigProto(gpu_options=fm.GPUOptions(per_process_gpu_memory_fraction=
0.4)))`` limits CuPy's memory pool on every GPU the task uses to that fraction of the
device's memory, so two processes can share a GPU without one taking it all. In a pod,
where the script is not the place to say it, ``FLOWMILL_GPU_MEMORY_FRACTION`` does the
same; the session's option overrides it. The limit is the process's: a later session that
asks for another fraction changes it.

``allow_growth`` is accepted as TensorFlow takes it and changes nothing: CuPy's pool takes
memory from the device as arrays need it and never reserves the fraction up front, which is
what ``allow_growth=True`` asks of TensorFlow.

An allocation past the limit (or past what the device has) raises CuPy's
``OutOfMemoryError`` in a kernel; the step fails with ``ResourceExhaustedError`` naming the
op, its device, the limit, and how to raise it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from numbers import Real

from flowmill.kernels import memory_limit, set_memory_limit

from .device_names import parse_device
from .local_devices import gpu_count
from .session_config import ConfigProto

ENV = "FLOWMILL_GPU_MEMORY_FRACTION"
OPTION = "per_process_gpu_memory_fraction"


class ResourceExhaustedError(MemoryError):
    """A step needed more memory than its device (or its limit) gives: TensorFlow's name
    for it. A ``MemoryError``, as CuPy's and NumPy's are."""


def _fraction(value, what: str) -> float:
    """``value`` as a fraction of a GPU's memory, or a ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value <= 1 \
            or math.isnan(value):
        raise ValueError(f"{what} must be a fraction of each GPU's memory in (0, 1], "
                         f"got {value!r}")
    return float(value)


def requested_fraction(config: ConfigProto | None = None,
                       environ: Mapping[str, str] = os.environ) -> tuple[float, str] | None:
    """The fraction asked for and who asked (the session's option, else the environment),
    or None where neither did; a value that is no fraction in (0, 1] is refused."""
    asked = None if config is None else config.gpu_options.per_process_gpu_memory_fraction
    if asked is not None:
        return _fraction(asked, f"GPUOptions.{OPTION}"), f"GPUOptions.{OPTION}"
    text = environ.get(ENV, "").strip()
    if text:
        try:
            value: object = float(text)
        except ValueError:
            value = text
        return _fraction(value, f"{ENV} ({OPTION})"), ENV
    return None


_applied: tuple[float, str] | None = None  # the fraction in force, and who asked for it


def limit_gpu_memory(config: ConfigProto | None = None,
                     environ: Mapping[str, str] = os.environ) -> list[int]:
    """Apply the fraction asked for (``requested_fraction``) to every GPU this task uses;
    the limits in bytes, per GPU (none where nothing was asked or there is no GPU)."""
    global _applied
    asked = requested_fraction(config, environ)
    if asked is None or gpu_count() == 0:
        return []
    limits = [set_memory_limit("GPU", i, asked[0]) for i in range(gpu_count())]
    _applied = asked
    return limits


def out_of_memory(node, error: MemoryError) -> ResourceExhaustedError:
    """The error of a step whose kernel at ``node`` (None: unknown) could not allocate."""
    if node is None:
        return ResourceExhaustedError(f"a step ran out of memory: {error}")
    device = parse_device(node.device).get("device", "CPU:0") if node.device else "CPU:0"
    at = f"op {node.name!r} ({node.type}) on {device} ran out of memory: {error}"
    kind, _, ordinal = device.partition(":")
    if kind != "GPU":
        return ResourceExhaustedError(at)
    limit = memory_limit(kind, int(ordinal or 0))
    if limit and _applied is not None:
        fraction, source = _applied
        how = (f" This process may use {limit:,} bytes of {device} ({OPTION}={fraction:g}, "
               f"from {source}): raise it with Session(config=fm.ConfigProto(gpu_options="
               f"fm.GPUOptions({OPTION}=...))) or {ENV}, or make the step smaller.")
    elif limit:
        how = f" Its memory pool is limited to {limit:,} bytes: raise the limit, or make " \
              "the step smaller."
    else:
        how = (f" {device} has no more to give: make the step smaller, or share the device "
               f"with fewer processes ({OPTION} or {ENV} limits each).")
    return ResourceExhaustedError(at + how)
