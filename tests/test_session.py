"""Session.run: pruning, plan caching, feeds and fetches, and errors that name what is wrong."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.ops.array_ops import placeholder


@pytest.fixture
def graph():
    g = fm.Graph()
    with g.as_default():
        yield g


def test_feed_cuts_upstream_stateful_op(graph):
    counter = fm.Variable(0.0, name="counter")
    bumped = counter.assign_add(1.0)  # stateful, upstream of what we feed
    y = bumped * 3.0
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        assert sess.run(y, {bumped: 5.0}) == 15.0
        assert sess.run(counter) == 0.0  # never ran
        assert sess.run(y) == 3.0  # not fed: runs
        assert sess.run(counter) == 1.0


def test_pruning_runs_only_what_fetches_need(graph):
    counter = fm.Variable(0, name="counter")
    other = counter.assign_add(1)
    x = fm.constant(2.0) * 4.0
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        assert sess.run(x) == 8.0
        assert sess.run(counter) == 0
        sess.run(None, targets=[other])
        sess.run(other.op)
        assert sess.run(counter) == 2


def test_plans_are_cached_per_signature(graph):
    x = placeholder(fm.float32, (2,), name="x")
    y = x * 2.0
    with fm.Session(graph) as sess:
        for i in range(5):
            np.testing.assert_array_equal(sess.run(y, {x: [i, i]}), [2 * i, 2 * i])
        assert len(sess._plans) == 1
        sess.run([y], {x: [1, 1]})
        sess.run({"y": y}, {x: [1, 1]})
        assert len(sess._plans) == 3


def test_fetch_structures(graph):
    a = fm.constant(1.0)
    b = fm.constant(2.0)
    noop = fm.no_op()
    with fm.Session(graph) as sess:
        out = sess.run({"a": a, "pair": (a, b), "list": [b], "op": noop, "name": "Const_1:0"})
        assert out == {"a": 1.0, "pair": (1.0, 2.0), "list": [2.0], "op": None, "name": 2.0}


def test_fetched_variable_value_is_a_snapshot(graph):
    v = fm.Variable(np.zeros(3, np.float32), name="v")
    inc = v.assign_add(np.ones(3, np.float32))
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        before = sess.run(v)
        sess.run(inc.op)
        np.testing.assert_array_equal(before, [0, 0, 0])
        np.testing.assert_array_equal(sess.run(v), [1, 1, 1])


def test_feed_of_wrong_shape_names_placeholder(graph):
    x = placeholder(fm.float32, (None, 3), name="images")
    y = fm.reduce_sum(x)
    with fm.Session(graph) as sess:
        with pytest.raises(fm.FeedError, match=r"shape \(2, 4\).*'images'.*\(\?, 3\)"):
            sess.run(y, {x: np.zeros((2, 4))})
        with pytest.raises(fm.FeedError, match="'images'.*must be fed"):
            sess.run(y)
        with pytest.raises(fm.FeedError, match="cannot feed str"):
            sess.run(y, {x: "nope"})


def test_fetch_from_another_graph_is_an_error(graph):
    other = fm.Graph()
    with other.as_default():
        foreign = fm.constant(1.0, name="foreign")
    with fm.Session(graph) as sess:
        with pytest.raises(fm.GraphError, match="'foreign:0' belongs to another graph"):
            sess.run(foreign)


def test_closed_session_refuses_to_run(graph):
    x = fm.constant(1.0)
    sess = fm.Session(graph)
    sess.close()
    with pytest.raises(fm.SessionClosedError, match="closed Session"):
        sess.run(x)


def test_uninitialized_variable_read_names_it(graph):
    v = fm.Variable(1.0, name="weights")
    with fm.Session(graph) as sess:
        with pytest.raises(RuntimeError, match="'weights'.*initialized"):
            sess.run(v)


def test_sessions_have_separate_state(graph):
    v = fm.Variable(0, name="v")
    inc = v.assign_add(1)
    s1, s2 = fm.Session(graph), fm.Session(graph)
    for s in (s1, s2):
        s.run(fm.global_variables_initializer())
    s1.run(inc.op)
    assert (s1.run(v), s2.run(v)) == (1, 0)


def test_make_callable_matches_run(graph):
    x = placeholder(fm.float32, (None,), name="x")
    y = fm.reduce_sum(x * x)
    with fm.Session(graph) as sess:
        f = sess.make_callable(y, [x])
        assert f(np.array([1.0, 2.0])) == sess.run(y, {x: [1.0, 2.0]}) == 5.0


def test_control_dependency_on_a_fed_placeholder_waits_on_the_feed(graph):
    ids = placeholder(fm.int32, (2,), name="ids")
    with fm.control_dependencies([ids]):
        y = fm.constant(3.0) * 2.0
    with fm.Session(graph) as sess:
        assert sess.run(y, {ids: [0, 1]}) == 6.0


def test_make_callable_on_a_closed_session(graph):
    sess = fm.Session(graph)
    sess.close()
    with pytest.raises(fm.SessionClosedError):
        sess.make_callable(fm.constant(1.0))


def test_forwarded_buffers_never_clobber_live_values(graph):
    """Kernels may compute into an input the step no longer needs; values still needed
    (fetched, read twice, held by a view or by the caller) must come out intact."""
    x = placeholder(fm.float32, (2, 3), name="x")
    h = fm.matmul(x, fm.constant(np.eye(3, dtype=np.float32)))
    a = fm.nn.relu(h)  # h is read again below: relu must not overwrite it
    b = h * 2.0
    t = fm.transpose(b)  # a view of b, alive while b + 1.0 runs
    c = b + 1.0
    d = fm.nn.bias_add(
        fm.matmul(x, fm.constant(np.ones((3, 3), np.float32))), fm.constant([1.0, 2.0, 3.0])
    )
    feed = np.array([[-1.0, 2.0, 3.0], [4.0, -5.0, 6.0]], np.float32)
    with fm.Session(graph) as sess:
        got = sess.run([h, a, b, t, c, d], {x: feed})
    np.testing.assert_array_equal(got[0], feed)
    np.testing.assert_array_equal(got[1], np.maximum(feed, 0))
    np.testing.assert_array_equal(got[2], feed * 2)
    np.testing.assert_array_equal(got[3], (feed * 2).T)
    np.testing.assert_array_equal(got[4], feed * 2 + 1)
    np.testing.assert_array_equal(got[5], feed.sum(1, keepdims=True) + [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(feed, [[-1.0, 2.0, 3.0], [4.0, -5.0, 6.0]])
