"""Host memory for the CPU kernels: large arrays reuse freed heap memory instead of fresh
pages from the kernel.

A training step allocates and frees the same large temporaries every step (an LSTM
layer's [1280, 2048] gate pre-activations, im2col patches, logits). glibc's malloc serves
such blocks with ``mmap`` and hands them back with ``munmap`` on free (its threshold grows
only to the largest block freed so far, and the heap top is trimmed at twice that), so
every step faults in and zeroes its pages again: in the language-model step of
``bench/lm_step.py`` that was about a fifth of the step. TensorFlow's and PyTorch's CPU
allocators keep what they freed for the same reason.

Here glibc is told, once per process: blocks up to 32 MiB (the most ``M_MMAP_THRESHOLD``
takes) come from the heap, and up to ``TRIM_BYTES`` free at its top is kept. A process's
resident memory therefore stays near its peak after a large step; blocks above 32 MiB
(a PS task's variables) are mapped and unmapped as before. ``FLOWMILL_MALLOC=system``
leaves malloc as it was; other C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20

ENV_VAR = "FLOWMILL_MALLOC"


def keep_freed_memory() -> bool:
    """Apply the settings above; True where glibc took them."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
