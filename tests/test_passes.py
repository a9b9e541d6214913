"""Common-subexpression elimination and constant folding over a pruned step."""

import numpy as np

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
