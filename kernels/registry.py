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
    op_type: str, device: str | None = None, frame: bool = False
) -> Callable[[Builder], Builder]:
    """Register a builder; without ``device`` it serves every array module. With ``frame``
    the kernel is called as ``fn(frame, *inputs)``."""

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


def get_builder(op_type: str, device_type: str) -> Builder:
    try:
        return KERNELS[(op_type, device_type)]
    except KeyError:
        have = sorted(d for (o, d) in KERNELS if o == op_type)
        raise NotImplementedError(
            f"no {device_type} kernel for op {op_type!r} (registered for: {have or 'none'})"
        ) from None
