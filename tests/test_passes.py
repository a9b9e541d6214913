"""Common-subexpression elimination and constant folding over a pruned step."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.resources import Resources
from flowmill.runtime.passes import optimize
from flowmill.runtime.prune import prune


def _optimized(fetches, feeds=(), targets=()):
    return optimize(prune(list(fetches), list(targets), list(feeds)), Resources())


def test_cse_merges_identical_pure_ops():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (3,), name="x")
        a = fm.exp(x)
        b = fm.exp(x)
        y = a + b
    step = _optimized([y], [x])
    assert sum(n.type == "Exp" for n in step.nodes) == 1
    with fm.Session(g) as sess:
        np.testing.assert_allclose(sess.run(y, {x: np.zeros(3)}), 2 * np.ones(3))


def test_constant_folding_replaces_constant_subgraph():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (2,), name="x")
        c = fm.exp(fm.constant([0.0, 1.0])) * 2.0
        y = x + c
    step = _optimized([y], [x])
    assert {n.type for n in step.nodes} == {"_Arg", "Const", "Add"}
    with fm.Session(g) as sess:
        np.testing.assert_allclose(sess.run(y, {x: [1.0, 1.0]}), [3.0, 1.0 + 2 * np.e], rtol=1e-6)


def test_stateful_ops_are_never_merged_or_folded():
    g = fm.Graph()
    with g.as_default():
        v = fm.Variable(0.0, name="v")
        a = v.assign_add(1.0)
        b = v.assign_add(1.0)
        r1 = v.read_value()
        r2 = v.read_value()
        total = a + b + r1 + r2
    step = _optimized([total])
    assert sum(n.type == "AssignAddVariableOp" for n in step.nodes) == 2
    assert sum(n.type == "ReadVariableOp" for n in step.nodes) == 2
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        sess.run(total)
        assert sess.run(v) == 2.0


def test_stateful_result_is_recomputed_every_step():
    g = fm.Graph()
    with g.as_default():
        v = fm.Variable(1.0, name="v")
        y = fm.add(v.assign_add(1.0), fm.constant(0.0))
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        assert [sess.run(y) for _ in range(3)] == [2.0, 3.0, 4.0]


def _relu_pool_problem(padding="VALID", ksize=2, strides=2):
    """A conv-like input with many exact ties (a coarse grid of values, a third of them
    negative, many zeros): where pooling's first-maximum rule decides who gets a gradient."""
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 4, size=(3, 7, 6, 4)).astype(np.float32) / 2
    g = fm.Graph()
    with g.as_default():
        xs = fm.placeholder(fm.float32, x.shape, name="x")
        r = fm.nn.relu(xs)
        p = fm.nn.max_pool(r, ksize, strides, padding)
        w = fm.constant(rng.standard_normal(p.shape).astype(np.float32))
        loss = fm.reduce_sum(p * w)
        dx = fm.gradients(loss, xs)[0]
    return g, xs, r, p, loss, dx, x


@pytest.mark.parametrize("padding,ksize,strides", [("VALID", 2, 2), ("SAME", 2, 2),
                                                   ("SAME", 3, 2), ("VALID", 3, 1)])
def test_pool_before_relu_is_exact_with_ties(padding, ksize, strides):
    g, xs, _, p, loss, dx, x = _relu_pool_problem(padding, ksize, strides)
    step = _optimized([p, dx], [xs])
    relu = next(n for n in step.nodes if n.type == "Relu")
    assert relu.inputs[0][0].type == "MaxPool"  # the ReLU now reads the pool
    pool_grad = next(n for n in step.nodes if n.type == "MaxPoolGrad")
    assert pool_grad.inputs[2][0].type == "ReluGrad"  # the pooled gradient is masked first
    with fm.Session(g) as fast, fm.Session(g, optimize=False) as plain:
        want = plain.run([p, loss, dx], {xs: x})
        got = fast.run([p, loss, dx], {xs: x})
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.count_nonzero(want[2]) > 0


def test_pool_before_relu_leaves_a_relu_read_elsewhere():
    g, xs, r, p, _, dx, x = _relu_pool_problem()
    step = _optimized([p, dx, r], [xs])  # the ReLU's full output is fetched
    relu = next(n for n in step.nodes if n.type == "Relu")
    assert relu.inputs[0][0].type == "_Arg"
    with g.as_default():
        also = fm.reduce_sum(r)  # another reader of the ReLU
    step = _optimized([p, dx, also], [xs])
    assert next(n for n in step.nodes if n.type == "Relu").inputs[0][0].type == "_Arg"
    with fm.Session(g) as sess:
        np.testing.assert_array_equal(sess.run(r, {xs: x}), np.maximum(x, 0))


def test_pool_before_relu_forward_only():
    g, xs, _, p, loss, _, x = _relu_pool_problem()
    step = _optimized([loss], [xs])
    assert next(n for n in step.nodes if n.type == "Relu").inputs[0][0].type == "MaxPool"
    with fm.Session(g) as fast, fm.Session(g, optimize=False) as plain:
        np.testing.assert_array_equal(fast.run(p, {xs: x}), plain.run(p, {xs: x}))
