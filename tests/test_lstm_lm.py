"""An LSTM language model from the op set: embedding Gather, an unrolled LSTM cell
(MatMul, Split, Sigmoid, Tanh), softmax cross-entropy. Its gradients agree with central
differences and plain SGD built from graph ops lowers its loss."""

import numpy as np

import flowmill.runtime as fm
from flowmill.runtime.backprop import to_dense
from flowmill.runtime.ops import nn_ops

VOCAB, EMBED, HIDDEN, STEPS, BATCH = 7, 5, 6, 4, 3


def build(dtype):
    rng = np.random.default_rng(0)
    ids = fm.placeholder(fm.int32, (BATCH, STEPS + 1), name="ids")
    params = {
        "embed": fm.Variable(rng.normal(0, 0.5, (VOCAB, EMBED)).astype(dtype), name="embed"),
        "w": fm.Variable(rng.normal(0, 0.3, (EMBED + HIDDEN, 4 * HIDDEN)).astype(dtype), name="w"),
        "b": fm.Variable(np.zeros(4 * HIDDEN, dtype), name="b"),
        "out": fm.Variable(rng.normal(0, 0.3, (HIDDEN, VOCAB)).astype(dtype), name="out"),
    }
    h = fm.zeros((BATCH, HIDDEN), dtype)
    c = fm.zeros((BATCH, HIDDEN), dtype)
    losses = []
    for t in range(STEPS):
        x = fm.gather(params["embed"], ids[:, t])
        gates = fm.matmul(fm.concat([x, h], 1), params["w"]) + params["b"]
        i, f, g, o = fm.split(gates, 4, axis=1)
        c = nn_ops.sigmoid(f) * c + nn_ops.sigmoid(i) * nn_ops.tanh(g)
        h = nn_ops.sigmoid(o) * nn_ops.tanh(c)
        logits = fm.matmul(h, params["out"])
        losses.append(
            nn_ops.sparse_softmax_cross_entropy_with_logits(labels=ids[:, t + 1], logits=logits)
        )
    loss = fm.reduce_mean(fm.add_n(losses)) / float(STEPS)
    return ids, params, loss


def _batch():
    return np.random.default_rng(1).integers(0, VOCAB, size=(BATCH, STEPS + 1)).astype(np.int32)


def test_lstm_gradients_match_central_differences():
    graph = fm.Graph()
    with graph.as_default():
        ids, params, loss = build(np.float64)
        names = list(params)
        grads = fm.gradients(loss, [params[n] for n in names])
        dense = [to_dense(g) for g in grads]
        assert isinstance(grads[0], fm.IndexedSlices)  # the embedding gets row gradients
        probe = fm.placeholder(fm.float64, None, name="probe")
        setters = {n: params[n].assign(probe) for n in names}
    batch = _batch()
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        analytic = dict(zip(names, sess.run(dense, {ids: batch}), strict=True))
        rng = np.random.default_rng(2)
        for name in names:
            value = sess.run(params[name])
            for flat_index in rng.choice(value.size, size=4, replace=False):
                idx = np.unravel_index(flat_index, value.shape)
                values = []
                for delta in (1e-6, -1e-6):
                    moved = value.copy()
                    moved[idx] += delta
                    sess.run(setters[name], {probe: moved})
                    values.append(sess.run(loss, {ids: batch}))
                sess.run(setters[name], {probe: value})
                numeric = (values[0] - values[1]) / 2e-6
                np.testing.assert_allclose(analytic[name][idx], numeric, rtol=1e-4, atol=1e-8)


def test_lstm_trains_with_sgd_built_from_graph_ops():
    graph = fm.Graph()
    with graph.as_default():
        ids, params, loss = build(np.float32)
        grads = fm.gradients(loss, list(params.values()))
        updates = []
        for var, g in zip(params.values(), grads, strict=True):
            if isinstance(g, fm.IndexedSlices):
                updates.append(var.scatter_sub(g.indices, g.values * 2.0))
            else:
                updates.append(var.assign_sub(g * 2.0))
        train = fm.group(*updates)
    batch = _batch()
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        first = sess.run(loss, {ids: batch})
        for _ in range(200):
            sess.run(train, {ids: batch})
        assert sess.run(loss, {ids: batch}) < 0.5 * first
