"""``fused_lstm_cell``: the LSTM cell's elementwise part as one op each way (kernels in
``flowmill.kernels.rnn``, which say why). ``rnn.LSTMCell`` uses it with its default
activation; the gate order is TensorFlow's ``BasicLSTMCell``'s, ``i, j, f, o``."""

from __future__ import annotations

from flowmill.kernels.shapes import ShapeError

from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op
from .array_ops import zeros_like


@define_op("FusedLSTMCell", attrs={"forget_bias": 1.0}, num_inputs=2)
def _fused_shape(inputs, attrs):
    gates, c = inputs
    if gates.dtype.kind != "f" or c.dtype != gates.dtype:
        raise ShapeError(f"FusedLSTMCell needs float gates and state of one dtype, got "
                         f"{gates.dtype} and {c.dtype}")
    if gates.shape is not None and c.shape is not None:
        if len(gates.shape) != 2 or len(c.shape) != 2 or (
            None not in (gates.shape[1], c.shape[1]) and gates.shape[1] != 4 * c.shape[1]
        ):
            raise ShapeError(f"FusedLSTMCell gates must be [batch, 4 * units] for a state "
                             f"[batch, units], got {gates.shape} and {c.shape}")
    units = None if c.shape is None else c.shape[1]
    batch = None if c.shape is None else c.shape[0]
    acts = (batch, None if units is None else 5 * units)
    return [(c.dtype, c.shape), (c.dtype, c.shape), (c.dtype, acts)]


@define_op("FusedLSTMCellGrad", num_inputs=4, differentiable=False)
def _fused_grad_shape(inputs, attrs):
    dc, dh, acts, c_prev = inputs
    four = None if acts.shape is None or acts.shape[1] is None else acts.shape[1] // 5 * 4
    batch = None if acts.shape is None else acts.shape[0]
    return [(acts.dtype, (batch, four)), (acts.dtype, c_prev.shape)]


def fused_lstm_cell(gates, c_prev, forget_bias: float = 1.0, name=None) -> tuple[Tensor, Tensor]:
    """``(c, h)`` of one LSTM step from its gate pre-activations ``[i, j, f, o]``."""
    op = apply_op("FusedLSTMCell", [convert_to_tensor(gates), convert_to_tensor(c_prev)],
                  {"forget_bias": float(forget_bias)}, name or "FusedLSTMCell")
    return op.outputs[0], op.outputs[1]


@defvjp("FusedLSTMCell", none_ok=True)
def _fused_grad(op, g_c, g_h, g_acts):
    c, h, acts = op.outputs
    if g_acts is not None:
        raise LookupError(f"{op.name}: its third output (the activations kept for the "
                          "gradient) has no gradient")
    if g_c is None and g_h is None:
        return [None, None]
    grad = apply_op(
        "FusedLSTMCellGrad",
        [g_c if g_c is not None else zeros_like(c), g_h if g_h is not None else zeros_like(h),
         acts, op.inputs[1]],
        name="FusedLSTMCellGrad",
    )
    return [grad.outputs[0], grad.outputs[1]]
