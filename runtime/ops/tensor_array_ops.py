"""``TensorArray``: per-position tensors for loops (TensorFlow's ``tf.TensorArray``).

A loop reads its input at step ``t`` off an array made by ``unstack`` and writes its
output at step ``t`` into another, stacked once after the loop (``nn.dynamic_rnn``): no
per-step copy of a whole sequence. The array's state is a resource; a scalar *flow*
tensor threads through every write so that reads and stacks run after the writes they
need, as in TensorFlow. The gradients follow TensorFlow's too: the gradient of a read is a
write into the gradient array (``TensorArrayGradV3``), of a write a read from it, of
``stack`` an ``unstack`` and back; the flow carries the order between them.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op

_ELEMENT = {"dtype": None, "element_shape": None}


def _require_handle(t, op: str) -> None:
    if t.dtype != dtypes.resource:
        raise ShapeError(f"{op} needs a TensorArray handle first, got {t.dtype}")


def define(name: str, attrs: dict, num_inputs: int, differentiable: bool = True):
    return define_op(
        name, attrs=attrs, num_inputs=num_inputs, stateful=True, differentiable=differentiable
    )


@define(
    "TensorArrayV3",
    {**_ELEMENT, "dynamic_size": False, "tensor_array_name": ""},
    1,
    differentiable=False,
)
def _array_shape(inputs, attrs):
    if inputs[0].dtype.kind not in "iu":
        raise ShapeError(f"TensorArray size must be an integer, got {inputs[0].dtype}")
    return [(dtypes.resource, ()), (dtypes.float32, ())]


@define("TensorArrayGradV3", {}, 2, differentiable=False)
def _grad_shape(inputs, attrs):
    _require_handle(inputs[0], "TensorArrayGradV3")
    return [(dtypes.resource, ())]


@define("TensorArrayWriteV3", {}, 4)
def _write_shape(inputs, attrs):
    _require_handle(inputs[0], "TensorArrayWriteV3")
    return [(dtypes.float32, ())]


@define("TensorArrayReadV3", dict(_ELEMENT), 3)
def _read_shape(inputs, attrs):
    _require_handle(inputs[0], "TensorArrayReadV3")
    return [(attrs["dtype"], attrs["element_shape"])]


@define("TensorArrayStackV3", {**_ELEMENT, "size": None}, 2)
def _stack_shape(inputs, attrs):
    _require_handle(inputs[0], "TensorArrayStackV3")
    shape = attrs["element_shape"]
    return [(attrs["dtype"], None if shape is None else (attrs["size"], *shape))]


@define("TensorArrayUnstackV3", {}, 3)
def _unstack_shape(inputs, attrs):
    _require_handle(inputs[0], "TensorArrayUnstackV3")
    return [(dtypes.float32, ())]


@define("TensorArraySizeV3", {}, 2, differentiable=False)
def _size_shape(inputs, attrs):
    return [(dtypes.int32, ())]


class TensorArray:
    """A TensorArray as a script holds it: a handle and the newest flow. ``write`` and
    ``unstack`` return a new TensorArray (the same array, a newer flow), as in TF1."""

    def __init__(
        self,
        dtype,
        size=None,
        dynamic_size: bool = False,
        element_shape=None,
        tensor_array_name: str = "",
        name: str | None = None,
        *,
        _handle: Tensor | None = None,
        _flow: Tensor | None = None,
    ):
        self.dtype = dtypes.as_dtype(dtype)
        self.element_shape = None if element_shape is None else shapes.as_shape(element_shape)
        self._size = size if isinstance(size, int) else None
        if _handle is not None:
            self.handle, self.flow = _handle, _flow
            return
        if size is None:
            raise ValueError("TensorArray needs a size (0 with dynamic_size=True to grow)")
        attrs = {
            "dtype": self.dtype,
            "element_shape": self.element_shape,
            "dynamic_size": dynamic_size,
            "tensor_array_name": tensor_array_name,
        }
        op = apply_op("TensorArrayV3", [convert_to_tensor(size, dtypes.int32)], attrs,
                      name or "TensorArray")
        self.handle, self.flow = op.outputs

    def _with_flow(self, flow: Tensor, element_shape=None) -> TensorArray:
        return TensorArray(self.dtype, self._size, element_shape=element_shape or
                           self.element_shape, _handle=self.handle, _flow=flow)

    def _attrs(self) -> dict:
        return {"dtype": self.dtype, "element_shape": self.element_shape}

    def write(self, index, value, name=None) -> TensorArray:
        value = convert_to_tensor(value, self.dtype)
        if self.element_shape is not None and not shapes.compatible(
            self.element_shape, value.shape
        ):
            raise ShapeError(
                f"TensorArray write: value {value.name} has shape {shapes.fmt(value.shape)}, "
                f"the array holds {shapes.fmt(self.element_shape)}"
            )
        index = convert_to_tensor(index, dtypes.int32)
        op = apply_op("TensorArrayWriteV3", [self.handle, index, value, self.flow], {},
                      name or "TensorArrayWrite")
        return self._with_flow(op.outputs[0], self.element_shape or value.shape)

    def read(self, index, name=None) -> Tensor:
        index = convert_to_tensor(index, dtypes.int32)
        return apply_op("TensorArrayReadV3", [self.handle, index, self.flow], self._attrs(),
                        name or "TensorArrayRead").outputs[0]

    def stack(self, name=None) -> Tensor:
        attrs = {**self._attrs(), "size": self._size}
        return apply_op("TensorArrayStackV3", [self.handle, self.flow], attrs,
                        name or "TensorArrayStack").outputs[0]

    def unstack(self, value, name=None) -> TensorArray:
        value = convert_to_tensor(value, self.dtype)
        op = apply_op("TensorArrayUnstackV3", [self.handle, value, self.flow], {},
                      name or "TensorArrayUnstack")
        element = None if value.shape is None else value.shape[1:]
        return self._with_flow(op.outputs[0], self.element_shape or element)

    def size(self, name=None) -> Tensor:
        return apply_op("TensorArraySizeV3", [self.handle, self.flow], {},
                        name or "TensorArraySize").outputs[0]


def _grad_array(op, flow: Tensor) -> TensorArray:
    """The gradient array of the array ``op`` works on, ordered after ``flow``."""
    handle = op.inputs[0]
    grad = apply_op("TensorArrayGradV3", [handle, flow], {}, "TensorArrayGrad").outputs[0]
    forward = handle.op.attrs if handle.op.type == "TensorArrayV3" else {}
    return TensorArray(
        op.attrs.get("dtype") or forward.get("dtype") or flow.dtype,
        element_shape=op.attrs.get("element_shape", forward.get("element_shape")),
        _handle=grad,
        _flow=flow,
    )


@defvjp("TensorArrayReadV3")
def _read_grad(op, g):
    ta = _grad_array(op, op.inputs[2])
    return [None, None, ta.write(op.inputs[1], g).flow]


@defvjp("TensorArrayWriteV3")
def _write_grad(op, g_flow):
    ta = _grad_array(op, g_flow)
    ta.dtype = op.inputs[2].dtype
    ta.element_shape = op.inputs[2].shape
    return [None, None, ta.read(op.inputs[1]), g_flow]


@defvjp("TensorArrayStackV3")
def _stack_grad(op, g):
    ta = _grad_array(op, op.inputs[1])
    return [None, ta.unstack(g).flow]


@defvjp("TensorArrayUnstackV3")
def _unstack_grad(op, g_flow):
    ta = _grad_array(op, g_flow)
    ta.dtype = op.inputs[1].dtype
    ta.element_shape = None if op.inputs[1].shape is None else op.inputs[1].shape[1:]
    return [None, ta.stack(), g_flow]
