"""Element types: plain NumPy dtypes, so kernels and feeds need no translation."""

from __future__ import annotations

import numpy as np

float16 = np.dtype("float16")
float32 = np.dtype("float32")
float64 = np.dtype("float64")
int8 = np.dtype("int8")
int32 = np.dtype("int32")
int64 = np.dtype("int64")
uint8 = np.dtype("uint8")
bool_ = np.dtype("bool")
# Byte strings of any length (an input pipeline's text lines): NumPy's "S" at whatever
# item size a value has (the pipeline matches a value's dtype to it by kind).
string = np.dtype("S")
# Handles to state (variables, queues) travel along edges as Python objects.
resource = np.dtype("object")

FLOATS = frozenset({float16, float32, float64})
INTEGERS = frozenset({int8, int32, int64, uint8})


def as_dtype(value) -> np.dtype:
    """Accept a NumPy dtype, a type such as ``np.float32`` or a name such as ``"float32"``."""
    if value == "bool":
        return bool_
    if value == "string":
        return string
    return np.dtype(value)

