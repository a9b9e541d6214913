"""Stacks that carry a while loop's per-iteration values to its gradient loop.

``StackV2`` makes the step's stack (a resource), ``StackPushV2`` appends a value in the
forward loop and ``StackPopV2`` takes the newest back in the backward loop (kernels in
``flowmill.kernels.stack``). ``control_flow_ops.GradWhileContext`` builds them; a model
script never needs to.
"""

from __future__ import annotations

from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Tensor, apply_op
from ..op_def import define_op


@define_op(
    "StackV2",
    attrs={"elem_type": None, "max_size": -1, "stack_name": ""},
    num_inputs=0,
    stateful=True,
    differentiable=False,
)
def _stack_shape(inputs, attrs):
    if not isinstance(attrs["max_size"], int) or attrs["max_size"] < -1:
        raise ShapeError(f"attr max_size must be an int >= -1, got {attrs['max_size']!r}")
    return [(dtypes.resource, ())]


@define_op(
    "StackPushV2", attrs={"swap_memory": False}, num_inputs=2, stateful=True,
    differentiable=False,
)
def _push_shape(inputs, attrs):
    if inputs[0].dtype != dtypes.resource:
        raise ShapeError(f"StackPushV2 needs a stack handle first, got {inputs[0].dtype}")
    return []


@define_op(
    "StackPopV2",
    attrs={"elem_type": None, "elem_shape": None, "swap_memory": False, "may_be_dead": False},
    num_inputs=1,
    stateful=True,
    differentiable=False,
)
def _pop_shape(inputs, attrs):
    if inputs[0].dtype != dtypes.resource:
        raise ShapeError(f"StackPopV2 needs a stack handle, got {inputs[0].dtype}")
    return [(attrs["elem_type"], attrs["elem_shape"])]


def stack(elem_type, max_size: int = -1, stack_name: str = "", name=None) -> Tensor:
    attrs = {"elem_type": elem_type, "max_size": max_size, "stack_name": stack_name}
    return apply_op("StackV2", [], attrs, name or "Stack").outputs[0]


def stack_push(handle: Tensor, value: Tensor, swap_memory: bool = False, name=None):
    return apply_op("StackPushV2", [handle, value], {"swap_memory": swap_memory}, name or "push")


def stack_pop(
    handle: Tensor, like: Tensor, swap_memory: bool = False, may_be_dead: bool = False, name=None
) -> Tensor:
    """Pop a value with ``like``'s dtype and shape (the pushed tensor's)."""
    attrs = {
        "elem_type": like.dtype,
        "elem_shape": like.shape,
        "swap_memory": swap_memory,
        "may_be_dead": may_be_dead,
    }
    return apply_op("StackPopV2", [handle], attrs, name or "pop").outputs[0]
