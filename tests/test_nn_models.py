"""A tiny CNN end to end: conv -> bias -> relu -> max-pool -> dense -> softmax cross-entropy.

The dense layer is a VALID convolution whose window covers the whole feature map, which is
exactly a fully connected layer and keeps the logits as [batch, 1, 1, classes].
"""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.ops import nn_ops as nn

rng = np.random.default_rng(11)
SHAPES = {"w1": (3, 3, 1, 4), "b1": (4,), "w2": (4, 4, 4, 3), "b2": (3,)}


def _model(x, labels, p, sparse: bool):
    h = nn.relu(nn.bias_add(nn.conv2d(x, p["w1"], 1, "SAME"), p["b1"]))
    h = nn.max_pool(h, 2, 2, "SAME")
    logits = nn.bias_add(nn.conv2d(h, p["w2"], 1, "VALID"), p["b2"])
    if sparse:
        xent = nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    else:
        xent = nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return fm.reduce_mean(xent) + 1e-3 * nn.l2_loss(p["w1"]), logits


def _values():
    params = {k: rng.normal(scale=0.5, size=s) for k, s in SHAPES.items()}
    x = rng.normal(size=(5, 8, 8, 1))
    ids = rng.integers(0, 3, size=(5, 1, 1))
    return x, ids, params


def _build(sparse: bool, dtype=fm.float64):
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(dtype, (None, 8, 8, 1))
        if sparse:
            labels = fm.placeholder(fm.int32, (None, 1, 1))
        else:
            labels = fm.placeholder(dtype, (None, 1, 1, 3))
        p = {k: fm.placeholder(dtype, s, name=k) for k, s in SHAPES.items()}
        loss, logits = _model(x, labels, p, sparse)
    return g, x, labels, p, loss, logits


def _feed(x, labels, p, xv, ids, params, sparse):
    feed = {x: xv, labels: ids.astype(np.int32) if sparse else np.eye(3)[ids]}
    feed.update({p[k]: v for k, v in params.items()})
    return feed


def _numeric(sess, fetch, feed, tensor, index, eps=1e-6):
    value = feed[tensor]
    old = value[index]
    value[index] = old + eps
    up = sess.run(fetch, feed)
    value[index] = old - eps
    down = sess.run(fetch, feed)
    value[index] = old
    return (up - down) / (2 * eps)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse_labels", "dense_labels"])
def test_cnn_gradients_match_finite_differences(sparse):
    g, x, labels, p, loss, logits = _build(sparse)
    with g.as_default():
        names = list(SHAPES)
        grads = dict(zip(names, fm.gradients(loss, [p[k] for k in names]), strict=True))
    xv, ids, params = _values()
    with fm.Session(g) as sess:
        feed = _feed(x, labels, p, xv, ids, params, sparse)
        analytic = sess.run(grads, feed)
        assert sess.run(logits, feed).shape == (5, 1, 1, 3)
        for k in names:
            assert analytic[k].shape == SHAPES[k]
            for _ in range(4):
                index = tuple(int(rng.integers(0, d)) for d in SHAPES[k])
                want = _numeric(sess, loss, feed, p[k], index)
                np.testing.assert_allclose(analytic[k][index], want, rtol=1e-5, atol=1e-7,
                                           err_msg=f"d loss / d {k}{index}")


def test_cnn_second_derivatives_match_finite_differences():
    """d/dw of |d loss/dw|^2 runs every backward op's own gradient."""
    g, x, labels, p, loss, _ = _build(sparse=False)
    with g.as_default():
        gw1, gw2 = fm.gradients(loss, [p["w1"], p["w2"]])
        norm = fm.reduce_sum(gw1 * gw1) + fm.reduce_sum(gw2 * gw2)
        hw1, hw2 = fm.gradients(norm, [p["w1"], p["w2"]])
    xv, ids, params = _values()
    with fm.Session(g) as sess:
        feed = _feed(x, labels, p, xv, ids, params, sparse=False)
        a1, a2 = sess.run([hw1, hw2], feed)
        for name, analytic in (("w1", a1), ("w2", a2)):
            for _ in range(3):
                index = tuple(int(rng.integers(0, d)) for d in SHAPES[name])
                want = _numeric(sess, norm, feed, p[name], index)
                np.testing.assert_allclose(analytic[index], want, rtol=1e-4, atol=1e-7,
                                           err_msg=f"d|grad|^2 / d {name}{index}")


def test_cnn_learns_with_plain_gradient_descent():
    g, x, labels, p, loss, logits = _build(sparse=True, dtype=fm.float32)
    with g.as_default():
        names = list(SHAPES)
        grads = fm.gradients(loss, [p[k] for k in names])
    xv, ids, params = _values()
    params = {k: v.astype(np.float32) for k, v in params.items()}
    with fm.Session(g) as sess:
        step = sess.make_callable([loss, *grads], [x, labels, *(p[k] for k in names)])
        args = [xv.astype(np.float32), ids.astype(np.int32)]
        first = None
        for _ in range(60):
            out = step(*args, *(params[k] for k in names))
            first = out[0] if first is None else first
            for k, gk in zip(names, out[1:], strict=True):
                params[k] = params[k] - 0.3 * gk
        final = step(*args, *(params[k] for k in names))[0]
    assert final < 0.25 * first
