"""Op constructors by family; importing this package registers every op definition."""

from . import array_ops, control_flow_ops, data_flow_ops, math_ops, nn_ops, random_ops, state_ops  # noqa: I001

__all__ = [
    "array_ops",
    "control_flow_ops",
    "data_flow_ops",
    "math_ops",
    "nn_ops",
    "random_ops",
    "state_ops",
]
