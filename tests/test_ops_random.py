"""Random ops: exact streams from the documented seeds, seeding rules, and statistics."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime import initializers as init
from flowmill.runtime.graph import GraphError
from flowmill.runtime.ops import array_ops as A
from flowmill.runtime.ops import random_ops as R
from flowmill.runtime.ops.state_ops import Variable

from opcheck import OpCase, case_tests

GRAPH_SEED = 7  # the seed opcheck gives every case's graph


def stream(seed2, seed=GRAPH_SEED):
    """The generator an op with these seeds draws from, as documented in kernels.random."""
    return np.random.default_rng([seed, seed2])


def truncated(rng, shape, dtype=np.float32):
    x = rng.standard_normal(shape, dtype=dtype)
    flat = x.reshape(-1)
    redo = np.flatnonzero(np.abs(flat) > 2)
    while redo.size:
        fresh = rng.standard_normal(redo.size, dtype=dtype)
        flat[redo] = fresh
        redo = redo[np.abs(fresh) > 2]
    return x


CASES = [
    OpCase(
        "random_uniform",
        lambda: R.random_uniform((3, 4), seed=5),
        [],
        lambda: stream(5).random((3, 4), dtype=np.float32),
        grad=False,
    ),
    OpCase(
        "random_uniform_range_float64",
        lambda: R.random_uniform((20,), -3.0, 1.0, fm.float64, seed=1),
        [],
        lambda: stream(1).random(20) * 4.0 - 3.0,
        grad=False,
    ),
    OpCase(
        # No op seed: it is derived from the op count (one placeholder was built first).
        "random_uniform_derived_seed",
        lambda x: x * R.random_uniform((2,)),
        [np.ones(2, np.float32)],
        lambda x: x * stream(1).random(2, dtype=np.float32),
        grad=False,
    ),
    OpCase(
        "random_uniform_shape_input",
        lambda x: R.random_uniform(A.shape(x), seed=5),
        [np.ones((2, 3), np.float32)],
        lambda x: stream(5).random((2, 3), dtype=np.float32),
        grad=False,
    ),
    OpCase(
        "random_normal",
        lambda: R.random_normal((4, 5), mean=1.0, stddev=2.0, seed=3),
        [],
        lambda: stream(3).standard_normal((4, 5), dtype=np.float32) * np.float32(2) + 1,
        grad=False,
    ),
    OpCase(
        "random_normal_float16",
        lambda: R.random_normal((6,), dtype=fm.float16, seed=3),
        [],
        lambda: stream(3).standard_normal(6, dtype=np.float32).astype(np.float16),
        grad=False,
        rtol=1e-3,
    ),
    OpCase(
        "truncated_normal",
        lambda: R.truncated_normal((50, 4), stddev=0.5, seed=9),
        [],
        lambda: truncated(stream(9), (50, 4)) * np.float32(0.5),
        grad=False,
    ),
]


test_forward, test_gradient = case_tests(CASES)


# ---- seeding


def _build(graph_seed=None, op_seed=None, extra_ops=0):
    graph = fm.Graph(seed=graph_seed)
    with graph.as_default():
        for _ in range(extra_ops):
            fm.constant(0.0)
        x = R.random_uniform((8,), seed=op_seed)
    return graph, x


def _draws(graph, x, steps=3):
    with fm.Session(graph) as sess:
        return [sess.run(x) for _ in range(steps)]


def test_sessions_of_one_graph_draw_the_same_sequence():
    graph, x = _build(graph_seed=1)
    first, second = _draws(graph, x), _draws(graph, x)
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first[0], first[1])  # yet each step draws anew


def test_every_step_of_a_session_continues_one_stream():
    graph, x = _build(graph_seed=1, op_seed=4)
    with graph.as_default():
        y = x * 2.0
    with fm.Session(graph) as sess:
        a = sess.run(x)
        b, b2 = sess.run([x, y])  # another compiled step, the same generator
    rng = stream(4, seed=1)
    np.testing.assert_array_equal(a, rng.random(8, dtype=np.float32))
    np.testing.assert_array_equal(b, rng.random(8, dtype=np.float32))
    np.testing.assert_array_equal(b2, b * 2)


def test_graph_seed_alone_derives_op_seeds_from_the_op_count():
    g1, x1 = _build(graph_seed=11)
    g2, x2 = _build(graph_seed=11)
    g3, x3 = _build(graph_seed=11, extra_ops=1)
    assert x1.op.attrs["seed"] == 11 and x1.op.attrs["seed2"] == 0
    np.testing.assert_array_equal(_draws(g1, x1), _draws(g2, x2))
    assert x3.op.attrs["seed2"] == 1
    assert not np.array_equal(_draws(g1, x1)[0], _draws(g3, x3)[0])
    with g1.as_default():
        other = R.random_uniform((8,))
    with fm.Session(g1) as sess:
        a, b = sess.run([x1, other])
    assert not np.array_equal(a, b)


def test_op_seed_alone_is_deterministic():
    g1, x1 = _build(op_seed=3)
    g2, x2 = _build(op_seed=3, extra_ops=2)
    assert (x1.op.attrs["seed"], x1.op.attrs["seed2"]) == (R.DEFAULT_GRAPH_SEED, 3)
    np.testing.assert_array_equal(_draws(g1, x1), _draws(g2, x2))


def test_no_seed_is_nondeterministic():
    graph, x = _build()
    assert x.op.attrs["seed"] is None and x.op.attrs["seed2"] is None
    assert not np.array_equal(_draws(graph, x, 1)[0], _draws(graph, x, 1)[0])


def test_random_ops_are_never_folded_or_merged():
    graph = fm.Graph(seed=1)
    with graph.as_default():
        a = R.random_normal((4,), seed=2)
        b = R.random_normal((4,), seed=2)
    with fm.Session(graph) as sess:
        x1, y1 = sess.run([a, b])
        x2 = sess.run(a)
    np.testing.assert_array_equal(x1, y1)  # same seeds, same stream
    assert not np.array_equal(x1, x2)  # but not a constant


def test_run_time_shapes_keep_what_is_known():
    graph = fm.Graph(seed=1)
    with graph.as_default():
        x = fm.placeholder(fm.float32, (None, 3))
        n = fm.placeholder(fm.int32, (2,))
        u = R.random_uniform(A.shape(x), 2.0, 4.0)
        z = R.truncated_normal(n, stddev=0.1)
        c = R.random_normal(fm.constant([2, 5]))
        assert (u.shape, z.shape, c.shape) == ((None, 3), (None, None), (2, 5))
    with fm.Session(graph) as sess:
        for batch in (4, 1):
            a, b = sess.run([u, z], {x: np.zeros((batch, 3)), n: [batch, 2]})
            assert a.shape == (batch, 3) and a.min() >= 2.0 and a.max() < 4.0
            assert b.shape == (batch, 2) and np.abs(b).max() <= 0.2
        assert sess.run(c).shape == (2, 5)


def test_random_ops_check_shape_and_dtype():
    with fm.Graph().as_default():
        with pytest.raises(GraphError, match=r"fully known shape attr, got \(\?, 3\)"):
            R.random_uniform((None, 3))
        with pytest.raises(GraphError, match="1-D int tensor"):
            R.random_uniform(fm.constant([1.0, 2.0]))
        with pytest.raises(GraphError, match="floating-point values, not int32"):
            R.random_normal((3,), dtype=fm.int32)


# ---- statistics


def _sample(tensor_fn, seed=0):
    graph = fm.Graph(seed=seed)
    with graph.as_default():
        t = tensor_fn()
    with fm.Session(graph) as sess:
        return sess.run(t)


def test_distribution_statistics():
    n = 200_000
    u = _sample(lambda: R.random_uniform((n,), -1.0, 3.0))
    assert u.dtype == np.float32 and u.min() >= -1.0 and u.max() < 3.0
    assert abs(u.mean() - 1.0) < 0.02 and abs(u.var() - 16 / 12) < 0.02
    z = _sample(lambda: R.random_normal((n,), 2.0, 0.5, fm.float64))
    assert z.dtype == np.float64 and abs(z.mean() - 2.0) < 0.01 and abs(z.std() - 0.5) < 0.01
    t = _sample(lambda: R.truncated_normal((n,), 0.0, 3.0))
    assert np.abs(t).max() <= 6.0
    assert abs(t.mean()) < 0.02 and abs(t.std() - 3.0 * init.TRUNCATED_STDDEV) < 0.02


# ---- initializers


def _init_value(initializer, shape, dtype=fm.float32):
    graph = fm.Graph()
    with graph.as_default():
        var = Variable(initializer, shape=shape, dtype=dtype)
    with fm.Session(graph) as sess:
        sess.run(var.initializer)
        return sess.run(var.value())


def test_constant_initializers():
    np.testing.assert_array_equal(_init_value(init.zeros(), (2, 3)), np.zeros((2, 3)))
    np.testing.assert_array_equal(_init_value(init.ones(), (4,), fm.int32), np.ones(4))
    np.testing.assert_array_equal(_init_value(init.constant(2.5), (2,)), [2.5, 2.5])
    np.testing.assert_array_equal(_init_value(init.constant([1, 2]), (3, 2)), [[1, 2]] * 3)


def test_glorot_uniform_limits():
    w = _init_value(init.glorot_uniform(seed=1), (300, 200))
    limit = np.sqrt(6 / (300 + 200))
    assert np.abs(w).max() <= limit and np.abs(w).max() > 0.99 * limit
    assert abs(w.var() - 2 / 500) < 0.05 * 2 / 500


def test_glorot_and_he_normal_variances():
    w = _init_value(init.glorot_normal(seed=2), (400, 100))
    assert abs(w.var() - 2 / 500) < 0.05 * 2 / 500
    assert np.abs(w).max() <= 2 * np.sqrt(2 / 500) / init.TRUNCATED_STDDEV
    # A convolution kernel (h, w, in, out): fan_in counts the receptive field.
    k = _init_value(init.he_normal(seed=3), (3, 3, 64, 32))
    assert init.fans((3, 3, 64, 32)) == (576, 288)
    assert abs(k.var() - 2 / 576) < 0.05 * 2 / 576


def test_seeded_initializers_repeat_and_random_ones_spread():
    a = _init_value(init.random_uniform(-0.1, 0.1, seed=5), (50, 50))
    b = _init_value(init.random_uniform(-0.1, 0.1, seed=5), (50, 50))
    np.testing.assert_array_equal(a, b)
    assert a.min() >= -0.1 and a.max() < 0.1
    n = _init_value(init.random_normal(1.0, 0.1, seed=5), (100, 100))
    assert abs(n.mean() - 1.0) < 0.01 and abs(n.std() - 0.1) < 0.01
    t = _init_value(init.truncated_normal(0.0, 0.1, seed=5), (100, 100))
    assert np.abs(t).max() <= 0.2
    h = _init_value(init.he_uniform(seed=5), (100, 10))
    assert np.abs(h).max() <= np.sqrt(6 / 100)


def test_initializers_need_a_static_shape():
    with fm.Graph().as_default():
        with pytest.raises(ValueError, match="fully known shape"):
            init.glorot_uniform()((None, 3), fm.float32)
    with pytest.raises(ValueError, match="mode must be"):
        init.variance_scaling(mode="fan_sideways")
