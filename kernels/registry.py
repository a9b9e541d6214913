"""Kernels in one plain dict keyed by (op type, device type).

A kernel is registered as a *builder*: ``builder(ctx) -> fn``. The builder runs once,
when a step is compiled, and binds attrs and state; ``fn(*inputs)`` runs every step and
returns one array, a tuple of arrays for multi-output ops, or None for ops without
outputs. Builders registered without a device are written against ``ctx.xp`` (NumPy or
CuPy), so one definition serves every device type whose array module is present.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy

Kernel = Callable[..., Any]
Builder = Callable[["KernelContext"], Kernel]

KERNELS: dict[tuple[str, str], Builder] = {}
# Op types whose kernels take the step's frame (step id, rendezvous) as first argument.
FRAME_KERNELS: set[str] = set()
ARRAY_MODULES: dict[str, ModuleType] = {"CPU": numpy}
_GENERIC: dict[str, Builder] = {}
# Ops whose work is on the host by nature (queues, files, strings, the network): op type ->
# why no device serves them. ``flowmill ops`` shows the reason in its GPU column.
HOST_ONLY: dict[str, str] = {}
# Inputs and outputs a device kernel keeps in host memory, as TensorFlow's ``HostMemory``:
# the shapes, axes and counts it reads as Python numbers would otherwise cost a device
# synchronization each. Op type -> input (output) indices.
HOST_INPUTS: dict[str, frozenset[int]] = {}
HOST_OUTPUTS: dict[str, frozenset[int]] = {}
# Elementwise ops whose device kernels take a host scalar for an input, passed by value
# with the launch as CuPy's ufuncs take NumPy scalars: no copy to the device.
SCALAR_INPUTS: set[str] = set()
# How an op's device kernel behaves where it differs from the CPU's (a check it leaves out
# because it would stop the stream, a value it reads back to the host): op type -> note.
GPU_NOTES: dict[str, str] = {}


class _Dead:
    """The value on an untaken branch of a Switch; it flows through every op but Merge."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DEAD"

    def __reduce__(self):
        return (_Dead, ())


DEAD = _Dead()


@dataclass
class KernelContext:
    """What a builder may use: the op's attrs and name, the array module, the step's state."""

    op_type: str
    name: str
    attrs: dict[str, Any]
    device_type: str
    resources: Any  # flowmill.kernels.resources.Resources
    input_dtypes: list = field(default_factory=list)
    output_dtypes: list = field(default_factory=list)
    output_shapes: list = field(default_factory=list)
    outputs_used: bool = True  # False: nothing reads the outputs, the kernel may skip them
    # Per input: the step never reads it again, so the kernel may write its result into it
    # (if ``may_overwrite`` agrees at run time), as TensorFlow's kernels forward inputs.
    forwardable: tuple[bool, ...] = ()
    # The step is captured as a CUDA graph: state kernels update variables in their own
    # buffers (and fix them there), never by swapping a new buffer in.
    in_place_updates: bool = False

    def forward(self, i: int) -> bool:
        return i < len(self.forwardable) and self.forwardable[i]

    @property
    def xp(self) -> ModuleType:
        return ARRAY_MODULES[self.device_type]


def to_host(value) -> numpy.ndarray:
    """``value`` as a NumPy array in host memory (a CuPy array is copied with ``.get()``),
    for kernels whose work happens on the host: serializing, writing files."""
    if isinstance(value, numpy.ndarray):
        return value
    get = getattr(value, "get", None)
    return get() if callable(get) else numpy.asarray(value)


# Inside ``may_overwrite``: the step's local, the kernel's parameter, this function's
# parameter and getrefcount's argument. Any other reference means someone else holds it.
_OWN_REFS = 4


def may_overwrite(x, like=None) -> bool:
    """True when ``x`` (an input the compiler marked forwardable) is a buffer no one else
    holds or views, so a kernel may compute into it; with ``like``, also when ``like``
    broadcasts into it (an elementwise result then has ``x``'s shape)."""
    if type(x).__name__ != "ndarray" or sys.getrefcount(x) > _OWN_REFS or x.base is not None:
        return False
    if like is None:
        return True
    shape = getattr(like, "shape", ())
    return shape == x.shape or len(shape) == 0 or x.shape[len(x.shape) - len(shape):] == shape


def kernel(
    op_type: str,
    device: str | None = None,
    frame: bool = False,
    host_only: str | None = None,
    host_inputs: tuple[int, ...] = (),
    host_outputs: tuple[int, ...] = (),
    scalar_inputs: bool = False,
    gpu_note: str | None = None,
) -> Callable[[Builder], Builder]:
    """Register a builder; without ``device`` it serves every array module. With ``frame``
    the kernel is called as ``fn(frame, *inputs)``. ``host_only`` (the reason) keeps it off
    every device but the CPU; ``host_inputs``/``host_outputs`` name the inputs and outputs
    its device kernels take and give in host memory (NumPy arrays); ``scalar_inputs``
    says its device kernel takes a NumPy scalar for any input; ``gpu_note`` documents
    where its device kernel behaves differently from the CPU's."""
    if host_only is not None:
        HOST_ONLY[op_type] = host_only
        device = "CPU"
    if host_inputs:
        HOST_INPUTS[op_type] = frozenset(host_inputs)
    if host_outputs:
        HOST_OUTPUTS[op_type] = frozenset(host_outputs)
    if scalar_inputs:
        SCALAR_INPUTS.add(op_type)
    if gpu_note is not None:
        GPU_NOTES[op_type] = gpu_note

    def register(builder: Builder) -> Builder:
        if frame:
            FRAME_KERNELS.add(op_type)
        if device is None:
            _GENERIC[op_type] = builder
            for dev in ARRAY_MODULES:
                KERNELS.setdefault((op_type, dev), builder)
        else:
            KERNELS[(op_type, device)] = builder
        return builder

    return register


def step_cancellation(frame):
    """The cancellation of the step a frame kernel runs in (a ``cancellation.Cancellation``),
    or None where steps are not cancelled (one process: the frame is None)."""
    return None if frame is None else frame.cancellation


def add_array_module(device_type: str, xp: ModuleType) -> None:
    """Make a device type available: every generic kernel now serves it too."""
    ARRAY_MODULES[device_type] = xp
    for op_type, builder in _GENERIC.items():
        KERNELS.setdefault((op_type, device_type), builder)


def remove_array_module(device_type: str) -> None:
    """Take a device type away again, with every kernel registered for it."""
    if device_type == "CPU":
        raise ValueError("the CPU array module cannot be removed")
    ARRAY_MODULES.pop(device_type, None)
    for key in [k for k in KERNELS if k[1] == device_type]:
        del KERNELS[key]


def device_count(device_type: str) -> int:
    """How many devices of a type this process sees: 1 CPU; for a GPU module, CuPy's count
    (which honours ``CUDA_VISIBLE_DEVICES``), 0 where it finds no driver or device."""
    if device_type == "CPU":
        return 1
    xp = ARRAY_MODULES.get(device_type)
    if xp is None:
        return 0
    try:
        return int(xp.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - CuPy without a driver raises its own CUDA errors
        return 0


def device_memory(device_type: str) -> tuple[int, int] | None:
    """Bytes in use by live arrays, and bytes held, by the device module's memory pool
    (CuPy's default pool); None for the CPU."""
    xp = ARRAY_MODULES.get(device_type)
    if device_type == "CPU" or xp is None:
        return None
    pool = xp.get_default_memory_pool()
    return int(pool.used_bytes()), int(pool.total_bytes())


def set_memory_limit(device_type: str, ordinal: int, fraction: float) -> int:
    """Limit the device module's memory pool on device ``ordinal`` to ``fraction`` of the
    device's memory (CuPy's ``MemoryPool.set_limit``: an allocation past it raises
    ``OutOfMemoryError``, after the pool has freed the blocks it caches); the limit in
    bytes."""
    xp = ARRAY_MODULES[device_type]
    with xp.cuda.Device(ordinal):
        pool = xp.get_default_memory_pool()
        pool.set_limit(fraction=fraction)
        return int(pool.get_limit())


def memory_limit(device_type: str, ordinal: int) -> int:
    """The limit of the device module's memory pool on device ``ordinal``, in bytes (0:
    none); 0 for the CPU."""
    xp = ARRAY_MODULES.get(device_type)
    if device_type == "CPU" or xp is None:
        return 0
    with xp.cuda.Device(ordinal):
        return int(xp.get_default_memory_pool().get_limit())


def on_device(fn: Kernel, device_type: str, ordinal: int) -> Kernel:
    """``fn`` run with device ``ordinal`` current (device 0 is current already)."""
    if ordinal == 0 or device_type == "CPU":
        return fn
    device = ARRAY_MODULES[device_type].cuda.Device(ordinal)

    def run(*args):
        with device:
            return fn(*args)

    return run


def gpu_support(op_type: str) -> str:
    """What a GPU does with ``op_type``, whether or not this machine has one: ``yes``
    (with its note, if any), or ``no: <why>``."""
    if op_type in HOST_ONLY:
        return f"no: {HOST_ONLY[op_type]}"
    if op_type not in _GENERIC and (op_type, "GPU") not in KERNELS:
        return "no: no GPU kernel"
    note = GPU_NOTES.get(op_type)
    return f"yes: {note}" if note else "yes"


def get_builder(op_type: str, device_type: str) -> Builder:
    try:
        return KERNELS[(op_type, device_type)]
    except KeyError:
        have = sorted(d for (o, d) in KERNELS if o == op_type)
        raise NotImplementedError(
            f"no {device_type} kernel for op {op_type!r} (registered for: {have or 'none'})"
        ) from None
