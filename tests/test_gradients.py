"""The autodiff library: path sums, seeds, unreachable inputs, missing gradients."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.op_def import OPS, OpDef


@pytest.fixture
def graph():
    g = fm.Graph()
    with g.as_default():
        yield g


def test_partial_gradients_are_summed_over_every_path(graph):
    x = fm.placeholder(fm.float64, (), name="x")
    a = x * x  # path 1
    b = fm.exp(x)  # path 2
    y = a * b + x  # and path 3
    (g,) = fm.gradients(y, [x])
    with fm.Session(graph) as sess:
        v = 0.7
        assert sess.run(g, {x: v}) == pytest.approx(2 * v * np.exp(v) + v * v * np.exp(v) + 1)


def test_grad_ys_seeds_the_backward_pass(graph):
    x = fm.placeholder(fm.float32, (3,), name="x")
    y = x * 3.0
    (g,) = fm.gradients(y, [x], grad_ys=[fm.constant([1.0, 2.0, 3.0])])
    with fm.Session(graph) as sess:
        np.testing.assert_array_equal(sess.run(g, {x: np.zeros(3)}), [3.0, 6.0, 9.0])


def test_unreachable_input_gets_none(graph):
    x = fm.placeholder(fm.float32, (), name="x")
    z = fm.placeholder(fm.float32, (), name="z")
    assert fm.gradients(x * 2.0, [x, z])[1] is None


def test_several_ys_add_up(graph):
    x = fm.placeholder(fm.float32, (), name="x")
    g = fm.gradients([x * 2.0, x * 5.0], [x])[0]
    with fm.Session(graph) as sess:
        assert sess.run(g, {x: 1.0}) == 7.0


def test_gradient_with_respect_to_a_variable(graph):
    w = fm.Variable(np.array([1.0, -2.0], np.float32), name="w")
    loss = fm.reduce_sum(w * w)
    (g,) = fm.gradients(loss, [w])
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        np.testing.assert_array_equal(sess.run(g), [2.0, -4.0])


def test_missing_gradient_names_the_op(graph, monkeypatch):
    from flowmill.runtime.op_def import same_as_input

    monkeypatch.setitem(OPS, "Mystery", OpDef("Mystery", same_as_input(), num_inputs=1))
    x = fm.placeholder(fm.float32, (), name="x")
    y = graph.create_op("Mystery", [x], name="mystery").outputs[0]
    with pytest.raises(LookupError, match="'mystery' \\(Mystery\\)"):
        fm.gradients(y, [x])


def test_stop_gradient_blocks(graph):
    x = fm.placeholder(fm.float32, (), name="x")
    y = fm.stop_gradient(x * 3.0) * x
    (g,) = fm.gradients(y, [x])
    with fm.Session(graph) as sess:
        assert sess.run(g, {x: 2.0}) == 6.0
