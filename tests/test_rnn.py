"""Recurrent networks: TensorArray ops, the LSTM cell against its formula, dynamic_rnn (a
while loop) against static_rnn (unrolled) and NumPy, padded sequences, weight sharing, and
weight gradients through the loop against central differences."""

import gc

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.tensor_array import TensorArrayError
from flowmill.runtime import rnn
from flowmill.runtime.ops.tensor_array_ops import TensorArray
from flowmill.runtime.variable_scopes import variable_scope

from opcheck import OpCase, case_tests

rng = np.random.default_rng(5)
B, T, D, H = 3, 5, 4, 6


def sig(v):
    return 1.0 / (1.0 + np.exp(-v))


# ---- TensorArray ops, forward and gradient


def ta_roundtrip(x):
    """Unstack, read, write out of order, stack: every op and its gradient."""
    src = TensorArray(x.dtype, 3).unstack(x)
    out = TensorArray(x.dtype, 3)
    out = out.write(2, src.read(0) * 2.0).write(0, src.read(1) * src.read(1))
    out = out.write(1, src.read(2) - src.read(0))
    return out.stack()


def ta_gradient(x):
    """The gradient of reads and writes as an op output: forward-checks the gradient array."""
    y = ta_roundtrip(x)
    (g,) = fm.gradients(fm.reduce_sum(y * y), [x])
    return [g, TensorArray(x.dtype, 3).unstack(x).size()]


def ref_ta_gradient(x):
    a, b, c = x[0], x[1], x[2]
    # y = [b^2, c - a, 2a]; d/dx of sum(y^2)
    ga = -2 * (c - a) + 8 * a
    return [np.stack([ga, 4 * b**3, 2 * (c - a)]), np.int32(3)]


def fused_cell(gates, c):
    return list(fm.nn.rnn_cell.fused_lstm_cell(gates, c, forget_bias=0.5))


def ref_fused_cell(gates, c):
    i, j, f, o = np.split(gates.astype(np.float64), 4, axis=1)
    new_c = c * sig(f + 0.5) + sig(i) * np.tanh(j)
    return [new_c, np.tanh(new_c) * sig(o)]


PROJ = rng.normal(size=(2, 3))


def fused_cell_gradient(gates, c):
    """The gradient as an op's output: forward-checks FusedLSTMCellGrad, through h only."""
    _, h = fm.nn.rnn_cell.fused_lstm_cell(gates, c, forget_bias=0.5)
    return fm.gradients(fm.reduce_sum(h * fm.constant(PROJ)), [gates, c])


def ref_fused_cell_gradient(gates, c):
    i, j, f, o = np.split(gates.astype(np.float64), 4, axis=1)
    si, tj, sf, so = sig(i), np.tanh(j), sig(f + 0.5), sig(o)
    new_c = c * sf + si * tj
    tc = np.tanh(new_c)
    dc = PROJ * so * (1 - tc**2)
    d_gates = np.concatenate(
        [dc * tj * si * (1 - si), dc * si * (1 - tj**2), dc * c * sf * (1 - sf),
         PROJ * tc * so * (1 - so)], axis=1)
    return [d_gates, dc * sf]


CASES = [
    OpCase("tensor_array_roundtrip", ta_roundtrip, [rng.normal(size=(3, 2))],
           lambda x: np.stack([x[1] * x[1], x[2] - x[0], 2 * x[0]])),
    OpCase("tensor_array_gradient", ta_gradient, [rng.normal(size=(3, 2))], ref_ta_gradient,
           grad=False),
    OpCase("fused_lstm_cell", fused_cell, [rng.normal(size=(2, 12)), rng.normal(size=(2, 3))],
           ref_fused_cell),
    OpCase("fused_lstm_cell_gradient", fused_cell_gradient,
           [rng.normal(size=(2, 12)), rng.normal(size=(2, 3))], ref_fused_cell_gradient,
           grad=False),
    OpCase("dynamic_fill", lambda x: fm.fill(fm.shape(x), 2.5, fm.float64) * x,
           [rng.normal(size=(3, 2))], lambda x: 2.5 * x, grad=False),
]

test_forward, test_gradient = case_tests(CASES)


def _run_one(build):
    g = fm.Graph()
    with g.as_default():
        out = build()
    with fm.Session(g) as sess:
        return sess.run(out)


def test_tensor_array_misuse_is_named():
    def read_unwritten():
        return TensorArray(fm.float32, 2, tensor_array_name="outs").read(1)

    with pytest.raises(TensorArrayError, match=r"'outs': position 1 read before written"):
        _run_one(read_unwritten)

    def write_twice():
        ta = TensorArray(fm.float32, 2, tensor_array_name="outs").write(0, 1.0).write(0, 2.0)
        return ta.stack()

    with pytest.raises(TensorArrayError, match="position 0 written twice"):
        _run_one(write_twice)

    def out_of_range():
        return TensorArray(fm.float32, 2, tensor_array_name="outs").write(5, 1.0).stack()

    with pytest.raises(TensorArrayError, match="index 5 out of range for size 2"):
        _run_one(out_of_range)

    def growing():
        return TensorArray(fm.float32, 0, dynamic_size=True).write(2, 1.0).write(0, 3.0)

    with pytest.raises(TensorArrayError, match="position 1 read before written"):
        _run_one(lambda: growing().stack())


# ---- cells and loops


def ref_lstm_layer(x, kernel, bias, forget_bias=1.0, lengths=None):
    """TensorFlow's BasicLSTMCell over [batch, time, depth], with sequence lengths."""
    b, t, _ = x.shape
    n = bias.shape[0] // 4
    c, h = np.zeros((b, n)), np.zeros((b, n))
    outs = np.zeros((b, t, n))
    for s in range(t):
        i, j, f, o = np.split(np.concatenate([x[:, s], h], 1) @ kernel + bias, 4, axis=1)
        nc = c * sig(f + forget_bias) + sig(i) * np.tanh(j)
        nh = np.tanh(nc) * sig(o)
        live = np.ones(b, bool) if lengths is None else s < lengths
        c = np.where(live[:, None], nc, c)
        h = np.where(live[:, None], nh, h)
        outs[:, s] = np.where(live[:, None], nh, 0.0)
    return outs, c, h


def _lstm_graph(lengths=None, static=False):
    g = fm.Graph(seed=1)
    with g.as_default():
        x = fm.placeholder(fm.float64, [B, T, D])
        cell = rnn.LSTMCell(H)
        if static:
            outs, state = rnn.static_rnn(cell, fm.unstack(x, axis=1), sequence_length=lengths)
            out = fm.stack(outs, axis=1)
        else:
            out, state = rnn.dynamic_rnn(cell, x, sequence_length=lengths)
    return g, x, cell, out, state


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("lengths", [None, np.array([5, 2, 0], np.int32)],
                         ids=["full", "padded"])
def test_lstm_layer_matches_the_formula(static, lengths):
    g, x, cell, out, state = _lstm_graph(lengths, static)
    v = rng.normal(size=(B, T, D))
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        got, (c, h), kernel, bias = sess.run([out, state, cell.kernel, cell.bias], {x: v})
    want, wc, wh = ref_lstm_layer(v, kernel, bias, lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c, wc, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, wh, rtol=1e-10, atol=1e-12)
    assert [v.name for v in fm.global_variables(g)] == ["rnn/lstm_cell/kernel",
                                                        "rnn/lstm_cell/bias"]


def test_dynamic_rnn_weight_gradients_agree_with_central_differences():
    g = fm.Graph(seed=2)
    with g.as_default():
        x = fm.placeholder(fm.float64, [B, None, D])  # the length is known only when fed
        lengths = fm.placeholder(fm.int32, [B])
        cell = rnn.MultiRNNCell([rnn.LSTMCell(H), rnn.BasicRNNCell(H)])
        out, _ = rnn.dynamic_rnn(cell, x, sequence_length=lengths, dtype=fm.float64)
        proj = fm.constant(rng.normal(size=(H,)))
        loss = fm.reduce_sum(out * proj)
        weights = fm.trainable_variables(g)
        grads = fm.gradients(loss, weights + [x])
    v = rng.normal(size=(B, T, D))
    feed = {x: v, lengths: np.array([5, 3, 1], np.int32)}
    eps = 1e-6
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        analytic = sess.run(grads, feed)
        for w, ga in zip(weights, analytic[:-1], strict=True):
            value = sess.run(w).copy()
            for idx in [tuple(rng.integers(0, d) for d in value.shape) for _ in range(4)]:
                for sign, store in ((1, "up"), (-1, "down")):
                    moved = value.copy()
                    moved[idx] += sign * eps
                    sess.run(w.assign(moved))
                    feed_loss = sess.run(loss, feed)
                    if store == "up":
                        up = feed_loss
                    else:
                        down = feed_loss
                sess.run(w.assign(value))
                np.testing.assert_allclose(ga[idx], (up - down) / (2 * eps), rtol=1e-5,
                                           atol=1e-8, err_msg=f"{w.name}{list(idx)}")
        gx = analytic[-1]
        assert np.all(gx[2, 1:] == 0.0) and np.any(gx[2, 0] != 0.0)  # past its end: no grad


def test_a_training_step_through_dynamic_rnn_leaves_no_reference_cycles():
    """A step's values are freed when the step ends, not at the next garbage collection:
    a TensorArray and its gradient array referring to each other kept every step's gate
    gradients alive for many steps (gigabytes for an LSTM-512 language model)."""
    g = fm.Graph(seed=3)
    with g.as_default():
        x = fm.placeholder(fm.float32, [B, T, D])
        cell = rnn.MultiRNNCell([rnn.LSTMCell(H), rnn.LSTMCell(H)])
        out, _ = rnn.dynamic_rnn(cell, x, dtype=fm.float32)
        train = fm.train.GradientDescent(0.1).minimize(fm.reduce_sum(out * out))
    feed = {x: rng.normal(size=(B, T, D)).astype(np.float32)}
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        sess.run(train, feed)
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                sess.run(train, feed)
            found = gc.collect()
        finally:
            gc.enable()
    assert found == 0


def test_variable_scope_reuse_shares_a_cell_s_weights():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, [2, 3, 4])
        with variable_scope("encoder"):
            a, _ = rnn.dynamic_rnn(rnn.LSTMCell(5), x)
        with variable_scope("encoder", reuse=True):
            b, _ = rnn.dynamic_rnn(rnn.LSTMCell(5), x)
        assert len(fm.global_variables(g)) == 2
        with variable_scope("encoder"), pytest.raises(ValueError, match="already exists"):
            rnn.dynamic_rnn(rnn.LSTMCell(5), x)
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        va, vb = sess.run([a, b], {x: np.ones((2, 3, 4), np.float32)})
    np.testing.assert_array_equal(va, vb)


def test_bad_rnn_input_is_named():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, [2, 4], name="words")
        with pytest.raises(fm.GraphError, match=r"dynamic_rnn: inputs words:0 must be \[batch"):
            rnn.dynamic_rnn(rnn.LSTMCell(3), x)
        y = fm.placeholder(fm.float32, [2, 3, None], name="feats")
        with pytest.raises(fm.GraphError, match="input depth .* of feats:0 must be known"):
            rnn.dynamic_rnn(rnn.LSTMCell(3), y)
        with pytest.raises(ValueError, match="num_units must be a positive int"):
            rnn.LSTMCell(0)
