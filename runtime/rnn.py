"""Recurrent networks as TensorFlow 1.x builds them: cells, ``dynamic_rnn``, ``static_rnn``.

A cell maps ``(input_t, state) -> (output_t, new_state)`` and owns its weights (made on
its first use through ``get_variable``, so ``variable_scope`` reuse shares them).
``dynamic_rnn`` runs a cell over a sequence in a ``while_loop``: the graph is the same
size for any sequence length, inputs are read per step off a ``TensorArray`` and outputs
written into another (no per-step copy of the sequence), and its gradient is the loop
run backwards (``backprop``). ``static_rnn`` unrolls the cell in the graph, one copy per
step: worth it only for short sequences, where the loop's bookkeeping costs more than the
extra ops. With ``sequence_length``, steps past a sequence's end give zero outputs and
keep its state, so padded batches train as the unpadded sequences would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from . import dtypes
from .graph import GraphError, Tensor, convert_to_tensor, get_default_graph
from .initializers import zeros as zeros_init
from .ops.array_ops import concat, reshape, shape, split, transpose, zeros, zeros_like
from .ops.control_flow_ops import while_loop
from .ops.math_ops import add, less, matmul, multiply
from .ops.nn_ops import bias_add, sigmoid, tanh
from .ops.rnn_ops import fused_lstm_cell
from .ops.select_ops import where
from .ops.tensor_array_ops import TensorArray
from .variable_scopes import get_variable, variable_scope


class LSTMStateTuple(NamedTuple):
    """An LSTM's state: the cell ``c`` and the output ``h``."""

    c: Any
    h: Any


class RNNCell:
    """The cell interface: ``state_size``, ``output_size``, ``zero_state``, and a call."""

    default_name = "rnn_cell"  # its variable scope when not named

    def __init__(self, name: str | None = None):
        self._name = name
        self._scope = None  # the variable scope its weights were made in
        self.built = False

    @property
    def state_size(self):
        raise NotImplementedError

    @property
    def output_size(self) -> int:
        raise NotImplementedError

    def zero_state(self, batch_size, dtype):
        """Zeros for every part of the state; ``batch_size`` may be a scalar tensor."""

        def part(n: int) -> Tensor:
            z = zeros(_stack_dims(batch_size, n), dtype)
            z.set_shape((batch_size if isinstance(batch_size, int) else None, n))
            return z

        return _map(part, self.state_size)

    def build(self, input_depth: int, dtype) -> None:
        """Make the weights (outside any loop: a loop body must only read them)."""
        graph = get_default_graph()
        with graph._control_flow_context(None):
            scope = self._scope or self._name or _default_name(self)
            with variable_scope(scope, reuse=None if self._scope is None else True) as vs:
                self._scope = vs
                self._make_weights(input_depth, dtype)
        self.built = True

    def _make_weights(self, input_depth: int, dtype) -> None:
        raise NotImplementedError

    def __call__(self, inputs, state):
        inputs = convert_to_tensor(inputs)
        if not self.built:
            depth = _static_depth(inputs, type(self).__name__)
            self.build(depth, inputs.dtype)
        return self.call(inputs, state)

    def call(self, inputs: Tensor, state):
        raise NotImplementedError


class _Projected:
    """A cell whose gates are ``[x, h] @ kernel + bias``: ``project`` computes the input
    part for every step at once (``x`` is ``[time, batch, depth]``), ``call_projected``
    one step from it."""

    kernel: Any
    bias: Any
    num_units: int

    def _split_kernel(self) -> tuple[Tensor, Tensor]:
        """``(W_x, W_h)``: a ``Split``, whose gradient is one ``Concat`` of the two parts'
        (two slices' gradients would each be a zero-filled kernel, then summed)."""
        rows = self.kernel.shape[0] - self.num_units
        w_x, w_h = split(convert_to_tensor(self.kernel), [rows, self.num_units], axis=0)
        return w_x, w_h

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The input part of every step's gates, and the recurrent weight ``W_h`` (sliced
        here, outside the loop: the loop reads it as a constant)."""
        w_x, w_h = self._split_kernel()
        depth = x.shape[-1]
        steps, batch = x.shape[0], x.shape[1]
        flat = bias_add(matmul(reshape(x, [-1, depth]), w_x), self.bias)
        dims = [steps, -1] if steps is not None else [-1, batch]
        return reshape(flat, [*dims, w_x.shape[1]]), w_h


class BasicRNNCell(_Projected, RNNCell):
    """``h' = activation(W [x, h] + b)``."""

    default_name = "basic_rnn_cell"

    def __init__(self, num_units: int, activation: Callable = tanh, name: str | None = None):
        super().__init__(name)
        self.num_units = _positive(num_units, "num_units")
        self.activation = activation

    @property
    def state_size(self) -> int:
        return self.num_units

    @property
    def output_size(self) -> int:
        return self.num_units

    def _make_weights(self, input_depth, dtype):
        self.kernel = get_variable("kernel", [input_depth + self.num_units, self.num_units], dtype)
        self.bias = get_variable("bias", [self.num_units], dtype, initializer=zeros_init())

    def call(self, inputs, state):
        h = self.activation(bias_add(matmul(concat([inputs, state], 1), self.kernel), self.bias))
        return h, h

    def call_projected(self, projected, state, w_h):
        h = self.activation(projected + matmul(state, w_h))
        return h, h


class LSTMCell(_Projected, RNNCell):
    """The LSTM of TensorFlow's ``BasicLSTMCell`` (Zaremba et al., the paper's language
    model): gates ``i, j, f, o`` from one matmul of ``[x, h]``,
    ``c' = c * sigmoid(f + forget_bias) + sigmoid(i) * activation(j)``,
    ``h' = activation(c') * sigmoid(o)``; the state is ``LSTMStateTuple(c, h)``."""

    default_name = "lstm_cell"

    def __init__(
        self,
        num_units: int,
        forget_bias: float = 1.0,
        activation: Callable = tanh,
        initializer=None,
        name: str | None = None,
    ):
        super().__init__(name)
        self.num_units = _positive(num_units, "num_units")
        self.forget_bias = float(forget_bias)
        self.activation = activation
        self.initializer = initializer

    @property
    def state_size(self) -> LSTMStateTuple:
        return LSTMStateTuple(self.num_units, self.num_units)

    @property
    def output_size(self) -> int:
        return self.num_units

    def _make_weights(self, input_depth, dtype):
        n = self.num_units
        self.kernel = get_variable("kernel", [input_depth + n, 4 * n], dtype, self.initializer)
        self.bias = get_variable("bias", [4 * n], dtype, initializer=zeros_init())

    def call(self, inputs, state):
        c, h = state
        return self._gated(bias_add(matmul(concat([inputs, h], 1), self.kernel), self.bias), c)

    def call_projected(self, projected, state, w_h):
        c, h = state
        return self._gated(projected + matmul(h, w_h), c)

    def _gated(self, gates, c):
        if self.activation is tanh:  # the cell's elementwise part as one op each way
            new_c, new_h = fused_lstm_cell(gates, c, self.forget_bias)
            return new_h, LSTMStateTuple(new_c, new_h)
        i, j, f, o = split(gates, 4, axis=1)
        new_c = add(
            multiply(c, sigmoid(f + self.forget_bias)), multiply(sigmoid(i), self.activation(j))
        )
        new_h = multiply(self.activation(new_c), sigmoid(o))
        return new_h, LSTMStateTuple(new_c, new_h)


BasicLSTMCell = LSTMCell


class MultiRNNCell(RNNCell):
    """Cells stacked: each one's output is the next one's input; the state is a tuple."""

    default_name = "multi_rnn_cell"

    def __init__(self, cells: Sequence[RNNCell], name: str | None = None):
        super().__init__(name)
        if not cells:
            raise ValueError("MultiRNNCell needs at least one cell")
        if len({id(c) for c in cells}) != len(cells):
            raise ValueError("MultiRNNCell: the same cell object twice would share its weights")
        self.cells = list(cells)

    @property
    def state_size(self) -> tuple:
        return tuple(c.state_size for c in self.cells)

    @property
    def output_size(self) -> int:
        return self.cells[-1].output_size

    def _make_weights(self, input_depth, dtype):
        for k, cell in enumerate(self.cells):
            cell._name = cell._name or f"cell_{k}"
            cell.build(input_depth, dtype)
            input_depth = cell.output_size

    def call(self, inputs, state):
        if len(state) != len(self.cells):
            raise ValueError(
                f"MultiRNNCell has {len(self.cells)} cells, the state has {len(state)} parts"
            )
        new_states = []
        for cell, s in zip(self.cells, state, strict=True):
            inputs, s = cell.call(inputs, s)
            new_states.append(s)
        return inputs, tuple(new_states)


def dynamic_rnn(
    cell: RNNCell,
    inputs,
    sequence_length=None,
    initial_state=None,
    dtype=None,
    time_major: bool = False,
    swap_memory: bool = False,
    scope: str | None = None,
):
    """Run ``cell`` over ``inputs`` (``[batch, time, depth]``, or ``[time, batch, depth]``
    with ``time_major``) in a while loop: ``(outputs, final_state)``, outputs shaped as the
    inputs are.

    Cells that split their matmul (``LSTMCell``, ``BasicRNNCell``, and ``MultiRNNCell``s of
    them) run layer by layer, as cuDNN and PyTorch do: a layer's input projection
    ``x_t W_x + b`` is one matmul over all steps before its loop, so the loop multiplies only
    ``h W_h``; its gradient is again one matmul over all steps."""
    inputs = convert_to_tensor(inputs)
    _check_sequence(inputs, "dynamic_rnn")
    dtype = _dtype_for(inputs, initial_state, dtype, "dynamic_rnn")
    if not cell.built:
        depth = _static_depth(inputs, "dynamic_rnn")
    with variable_scope(scope or "rnn"):
        if not cell.built:
            cell.build(depth, dtype)
        x = inputs if time_major else transpose(inputs, [1, 0, 2])
        steps_static, batch_static = x.shape[0], x.shape[1]
        steps = steps_static if steps_static is not None else shape(x)[0]
        batch = batch_static if batch_static is not None else shape(x)[1]
        state = initial_state if initial_state is not None else cell.zero_state(batch, dtype)
        loop = _Loop(steps, steps_static, batch_static, dtype, sequence_length, swap_memory)
        layers = cell.cells if isinstance(cell, MultiRNNCell) else [cell]
        # Projecting needs the time or the batch dimension known (one reshape dim is free).
        known = steps_static is not None or batch_static is not None
        if known and all(isinstance(c, _Projected) for c in layers):
            finals = []
            parts = state if isinstance(cell, MultiRNNCell) else [state]
            for layer, layer_state in zip(layers, parts, strict=True):
                projected, w_h = layer.project(x)
                x, final = loop.run(partial(_step_projected, layer, w_h), projected,
                                    layer.output_size, layer_state)
                finals.append(final)
            final_state = tuple(finals) if isinstance(cell, MultiRNNCell) else finals[0]
        else:
            x, final_state = loop.run(cell.call, x, cell.output_size, state)
        outputs = x if time_major else transpose(x, [1, 0, 2])
        return outputs, final_state


def _step_projected(layer, w_h, projected, state):
    return layer.call_projected(projected, state, w_h)


class _Loop:
    """One while loop over time: step ``t`` reads ``inputs[t]`` off a TensorArray, calls
    ``step(x_t, state)`` and writes its output into another."""

    def __init__(self, steps, steps_static, batch_static, dtype, sequence_length, swap_memory):
        self.steps, self.steps_static, self.batch_static = steps, steps_static, batch_static
        self.dtype, self.swap_memory = dtype, swap_memory
        self.lengths = None if sequence_length is None else convert_to_tensor(sequence_length)

    def run(self, step: Callable, inputs: Tensor, output_size: int, state):
        """``(outputs [time, batch, output_size], final state)``."""
        in_ta = TensorArray(self.dtype, self.steps, element_shape=inputs.shape[1:],
                            name="input").unstack(inputs)
        out_ta = TensorArray(self.dtype, self.steps, name="output",
                             element_shape=(self.batch_static, output_size))
        lengths = self.lengths

        def body(t, out_flow, *flat):
            old = _pack(state, flat)
            out, new = step(in_ta.read(t), old)
            if lengths is not None:  # past its end a sequence keeps its state, outputs zeros
                live = less(t, lengths)
                out = where(live, out, zeros_like(out))
                new = _map2(lambda a, b: where(live, a, b), new, old)
            written = out_ta._with_flow(out_flow).write(t, out)
            return [t + 1, written.flow, *_flatten(new)]

        result = while_loop(
            lambda t, *_: less(t, self.steps),
            body,
            [convert_to_tensor(0, dtypes.int32), out_ta.flow, *_flatten(state)],
            maximum_iterations=self.steps_static,
            swap_memory=self.swap_memory,
        )
        return out_ta._with_flow(result[1]).stack(), _pack(state, result[2:])


def static_rnn(
    cell: RNNCell,
    inputs: Sequence,
    initial_state=None,
    dtype=None,
    sequence_length=None,
    scope: str | None = None,
):
    """The cell unrolled over a list of ``[batch, depth]`` inputs: ``(outputs, state)``."""
    inputs = [convert_to_tensor(x) for x in inputs]
    if not inputs:
        raise ValueError("static_rnn needs at least one input step")
    dtype = _dtype_for(inputs[0], initial_state, dtype, "static_rnn")
    with variable_scope(scope or "rnn"):
        if not cell.built:
            cell.build(_static_depth(inputs[0], "static_rnn"), dtype)
        batch = inputs[0].shape[0] if inputs[0].shape[0] is not None else shape(inputs[0])[0]
        state = initial_state if initial_state is not None else cell.zero_state(batch, dtype)
        lengths = None if sequence_length is None else convert_to_tensor(sequence_length)
        outputs = []
        for t, x in enumerate(inputs):
            out, new = cell.call(x, state)
            if lengths is not None:
                live = less(t, lengths)
                out = where(live, out, zeros_like(out))
                new = _map2(lambda a, b, live=live: where(live, a, b), new, state)
            outputs.append(out)
            state = new
        return outputs, state


# ---- nested states: tuples (and LSTMStateTuples) of tensors


def _flatten(struct) -> list:
    if isinstance(struct, (tuple, list)):
        return [leaf for s in struct for leaf in _flatten(s)]
    return [struct]


def _pack(like, flat: Sequence):
    flat = list(flat)

    def take(s):
        if isinstance(s, (tuple, list)):
            parts = [take(p) for p in s]
            return type(s)(*parts) if hasattr(s, "_fields") else type(s)(parts)
        return flat.pop(0)

    out = take(like)
    if flat:
        raise ValueError(f"state structure takes fewer tensors than the {len(flat)} given")
    return out


def _map(fn, struct):
    if isinstance(struct, (tuple, list)):
        parts = [_map(fn, s) for s in struct]
        return type(struct)(*parts) if hasattr(struct, "_fields") else type(struct)(parts)
    return fn(struct)


def _map2(fn, a, b):
    return _pack(a, [fn(x, y) for x, y in zip(_flatten(a), _flatten(b), strict=True)])


# ---- checks


def _stack_dims(batch, n: int):
    if isinstance(batch, Tensor):
        return concat([reshape(batch, [1]), convert_to_tensor([n], batch.dtype)], 0)
    return [batch, n]


def _positive(n, what: str) -> int:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be a positive int, got {n!r}")
    return n


def _static_depth(x: Tensor, where_: str) -> int:
    if x.shape is None or x.shape[-1] is None:
        raise GraphError(
            f"{where_}: the input depth (last dimension) of {x.name} must be known to make "
            f"the weights, got shape {x.shape}"
        )
    return int(x.shape[-1])


def _check_sequence(x: Tensor, where_: str) -> None:
    if x.shape is not None and len(x.shape) != 3:
        raise GraphError(
            f"{where_}: inputs {x.name} must be [batch, time, depth] (or time-major), "
            f"got rank {len(x.shape)}"
        )


def _dtype_for(x: Tensor, initial_state, dtype, where_: str):
    if dtype is not None:
        dtype = dtypes.as_dtype(dtype)
        if dtype != x.dtype:
            raise GraphError(f"{where_}: dtype {dtype} but inputs {x.name} are {x.dtype}")
        return dtype
    if x.dtype.kind != "f":
        raise GraphError(f"{where_}: inputs {x.name} must be floating point, got {x.dtype}")
    return x.dtype


def _default_name(cell: RNNCell) -> str:
    return cell.default_name


__all__ = [
    "BasicLSTMCell", "BasicRNNCell", "LSTMCell", "LSTMStateTuple", "MultiRNNCell", "RNNCell",
    "dynamic_rnn", "fused_lstm_cell", "static_rnn",
]
