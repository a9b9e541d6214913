"""Op constructors by family; importing this package registers every op definition."""

from . import (
    accumulator_ops,
    array_ops,
    checkpoint_ops,
    clip_ops,
    control_flow_ops,
    data_flow_ops,
    debug_ops,
    math_ops,
    nn_ops,
    pack_ops,
    random_ops,
    select_ops,
    sendrecv_ops,
    stack_ops,
    state_ops,
    unary_math_ops,
)

__all__ = [
    "accumulator_ops",
    "array_ops",
    "checkpoint_ops",
    "clip_ops",
    "control_flow_ops",
    "data_flow_ops",
    "debug_ops",
    "math_ops",
    "nn_ops",
    "pack_ops",
    "random_ops",
    "select_ops",
    "sendrecv_ops",
    "stack_ops",
    "state_ops",
    "unary_math_ops",
]
