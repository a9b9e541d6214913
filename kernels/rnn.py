"""The LSTM cell's elementwise part as one kernel each way (TensorFlow's ``LSTMBlockCell``).

Given the gate pre-activations ``[i, j, f, o]`` (the cell's matmuls stay BLAS calls of
their own), the forward computes ``c = c_prev * sigmoid(f + forget_bias) + sigmoid(i) *
tanh(j)`` and ``h = tanh(c) * sigmoid(o)`` and keeps the five activations for the
gradient; built of ops that was a dozen kernel calls per cell step forward and about
twenty back, each a pass over the batch, inside the time loop.
"""

from __future__ import annotations

import numpy

from .registry import KernelContext, kernel


def _sigmoid_of_negated_(xp, v):
    """``v = 1 / (1 + exp(v))``: the sigmoid of ``-v``, in place (an overflow of exp to inf
    is the right limit). Taking the negated input lets the first pass that writes ``v``
    (from the gates, with the forget bias) do the negation."""
    with numpy.errstate(over="ignore"):
        xp.exp(v, out=v)
    v += 1
    xp.reciprocal(v, out=v)


@kernel("FusedLSTMCell")
def _fused_lstm_cell(ctx: KernelContext):
    xp, forget_bias, name = ctx.xp, float(ctx.attrs["forget_bias"]), ctx.name

    def fn(gates, c_prev):
        b, four = gates.shape
        n = four // 4
        if four != 4 * n or c_prev.shape != (b, n):
            raise ValueError(
                f"FusedLSTMCell {name!r}: gates {gates.shape} must be [batch, 4 * units] "
                f"for a cell state {c_prev.shape}"
            )
        acts = xp.empty((b, 5 * n), gates.dtype)  # i, j, f, o, tanh(c)
        i, j, f, o, tc = (acts[:, k * n : (k + 1) * n] for k in range(5))
        # Each activation is written straight from its gate block: the negations (and the
        # forget bias) are the first pass over it, with no copy of the gates before.
        xp.negative(gates[:, :n], out=i)
        xp.tanh(gates[:, n : 2 * n], out=j)
        xp.subtract(-forget_bias, gates[:, 2 * n : 3 * n], out=f)
        xp.negative(gates[:, 3 * n :], out=o)
        _sigmoid_of_negated_(xp, i)
        _sigmoid_of_negated_(xp, acts[:, 2 * n : 4 * n])  # f and o side by side
        c = xp.multiply(c_prev, f)
        c += i * j
        xp.tanh(c, out=tc)
        h = tc * o
        return c, h, acts

    return fn


@kernel("FusedLSTMCellGrad")
def _fused_lstm_cell_grad(ctx: KernelContext):
    xp = ctx.xp

    def fn(dc, dh, acts, c_prev):
        n = acts.shape[1] // 5
        i, j, f, o, tc = (acts[:, k * n : (k + 1) * n] for k in range(5))
        d_gates = xp.empty((acts.shape[0], 4 * n), acts.dtype)
        di, dj, df, do = (d_gates[:, k * n : (k + 1) * n] for k in range(4))
        # d c = dc + dh * o * (1 - tanh(c)^2)
        total = tc * tc
        xp.subtract(1, total, out=total)
        total *= o
        total *= dh
        total += dc
        xp.multiply(dh, tc, out=do)
        do *= o
        do *= 1 - o
        xp.multiply(total, j, out=di)
        di *= i
        di *= 1 - i
        xp.multiply(total, i, out=dj)
        dj *= 1 - j * j
        xp.multiply(total, c_prev, out=df)
        df *= f
        df *= 1 - f
        total *= f
        return d_gates, total

    return fn
