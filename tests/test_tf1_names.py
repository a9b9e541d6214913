"""A TensorFlow 1.x user's names and habits: the optimizers' TF1 and Keras names, hints
for TF1 names spelled differently here, the math ops on ``fm``, and strict input (feeds
the placeholder's dtype would change, hyperparameters out of range, ``keep_prob``, slot
names)."""

from __future__ import annotations

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime import optimizers as O

# ---- names


def test_tf1_optimizer_names_are_the_same_classes():
    assert fm.train.GradientDescentOptimizer is O.GradientDescent
    assert fm.train.AdamOptimizer is O.Adam
    assert fm.train.MomentumOptimizer is O.Momentum
    assert fm.train.RMSPropOptimizer is O.RMSProp
    assert fm.train.AdagradOptimizer is O.Adagrad
    assert fm.train.AdadeltaOptimizer is O.Adadelta


def test_keras_argument_names_map_to_the_same_hyperparameters():
    adam = fm.train.AdamOptimizer(0.01, beta_1=0.8, beta_2=0.99)
    assert (adam._beta1, adam._beta2) == (0.8, 0.99)
    assert fm.train.RMSPropOptimizer(0.01, rho=0.8)._decay == 0.8
    assert fm.train.MomentumOptimizer(0.01, 0.9, nesterov=True)._nesterov is True


@pytest.mark.parametrize("make, field", [
    (lambda: O.Adam(0.1, beta1=1.5), "beta1"),
    (lambda: O.Adam(0.1, beta2=1.0), "beta2"),
    (lambda: O.Adam(0.1, epsilon=0.0), "epsilon"),
    (lambda: O.RMSProp(0.1, decay=1.5), "decay"),
    (lambda: O.RMSProp(0.1, epsilon=-1e-8), "epsilon"),
    (lambda: O.Adadelta(0.1, rho=2.0), "rho"),
    (lambda: O.Momentum(0.1, float("nan")), "momentum"),
])
def test_hyperparameters_out_of_range_are_refused_by_name(make, field):
    with pytest.raises(ValueError, match=field):
        make()
    O.Adadelta(0.1, rho=1.0)  # decay rates may be 1 (a frozen average), betas may not


@pytest.mark.parametrize("namespace, name, hint", [
    (fm, "to_float", "fm.cast(x, fm.float32)"),
    (fm, "pack", "fm.stack"),
    (fm.nn, "xw_plus_b", "fm.nn.bias_add"),
    (fm.train, "SyncReplicasOptimizer", "spec.training.mode: sync"),
    (fm.train, "replica_device_setter", "PS tasks, least bytes first"),
])
def test_a_tf1_name_spelled_differently_here_says_what_to_write(namespace, name, hint):
    with pytest.raises(AttributeError, match="TensorFlow 1.x's") as e:
        getattr(namespace, name)
    assert hint in str(e.value)


def test_an_unknown_name_suggests_the_closest():
    with pytest.raises(AttributeError, match="did you mean reduce_sum"):
        fm.reduce_summ  # noqa: B018
    with pytest.raises(AttributeError, match="did you mean sparse_softmax_cross_entropy"):
        fm.nn.sparse_softmax_cross_entropy_with_logit  # noqa: B018
    assert not hasattr(fm, "no_such_thing_at_all")


def test_dir_lists_the_api_only():
    for namespace in (fm.train, fm.nn):
        names = [n for n in dir(namespace) if not n.startswith("_")]
        assert set(names) == set(namespace.__all__), namespace.__name__
    assert "AdamOptimizer" in dir(fm.train)
    assert {"pow", "sign", "rsqrt", "greater_equal", "logical_and", "reduce_prod", "sigmoid",
            "tanh", "ProgressBar"} <= set(dir(fm))


def test_the_math_ops_on_fm_compute():
    x = np.array([-2.0, 0.5, 4.0], np.float32)
    t = fm.constant(x)
    with fm.Session() as sess:
        got = sess.run([fm.pow(t, 2.0), fm.sign(t), fm.rsqrt(fm.abs(t)),
                        fm.greater_equal(t, 0.5), fm.logical_and(t > 0, t < 1),
                        fm.reduce_prod(t), fm.sigmoid(t), fm.tanh(t)])
    want = [x**2, np.sign(x), 1 / np.sqrt(np.abs(x)), x >= 0.5, (x > 0) & (x < 1),
            np.prod(x), 1 / (1 + np.exp(-x)), np.tanh(x)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


# ---- strict input


@pytest.mark.parametrize("dtype, value, shown", [
    (fm.int64, [1.7, 2.2, 3.9], "1.7 does not fit int64 (it would become 1)"),
    (fm.int64, [1.0, float("nan")], "nan does not fit int64"),
    (fm.int32, np.array([2**40]), "1099511627776 does not fit int32"),
    (fm.float32, np.array([1.0, 1e300]), "1e+300 does not fit float32 (it would become inf)"),
])
def test_a_feed_the_placeholder_s_dtype_would_change_is_refused(dtype, value, shown):
    graph = fm.Graph()
    with graph.as_default():
        p = fm.placeholder(dtype, [None], name="labels")
        doubled = p * 1
    with fm.Session(graph) as sess:
        with pytest.raises(fm.FeedError, match="'labels'") as e:
            sess.run(doubled, {p: value})
        assert shown in str(e.value)
        step = sess.make_callable(doubled, [p])
        with pytest.raises(fm.FeedError, match="'labels'"):
            step(value)


def test_feeds_that_keep_their_values_pass():
    labels = fm.placeholder(fm.int64, [None])
    x = fm.placeholder(fm.float32, [None])
    with fm.Session() as sess:
        np.testing.assert_array_equal(sess.run(labels * 1, {labels: [1.0, 2.0]}), [1, 2])
        got = sess.run(x * 1, {x: np.array([0.1, np.nan, np.inf, -1e30])})
        np.testing.assert_array_equal(got, np.array([0.1, np.nan, np.inf, -1e30], np.float32))


def test_dropout_takes_keep_prob_and_checks_a_fed_rate():
    x = fm.constant(np.ones((4, 8), np.float32))
    rate = fm.placeholder(fm.float32, ())
    keep = fm.placeholder(fm.float32, ())
    by_rate, by_keep = fm.nn.dropout(x, rate), fm.nn.dropout(x, keep_prob=keep)
    with fm.Session() as sess:
        np.testing.assert_array_equal(sess.run(by_keep, {keep: 1.0}), np.ones((4, 8)))
        assert set(np.unique(sess.run(by_rate, {rate: 0.5}))) <= {0.0, 2.0}
        with pytest.raises(fm.InvalidArgumentError, match="keep_prob is 1 - rate"):
            sess.run(by_rate, {rate: 1.0})  # a TF1 keep_prob fed as the rate
    with pytest.raises(ValueError, match="exactly one"):
        fm.nn.dropout(x, 0.5, keep_prob=0.5)
    with pytest.raises(ValueError, match="keep_prob must be in"):
        fm.nn.dropout(x, keep_prob=0.0)


def test_get_slot_names_the_optimizer_s_slots():
    w = fm.Variable(np.ones(3, np.float32), name="w")
    opt = fm.train.MomentumOptimizer(0.1, 0.9)
    opt.minimize(fm.reduce_sum(w * w))
    assert opt.get_slot(w, "momentum") is not None
    with pytest.raises(ValueError, match=r"no slot named 'velocity'; its slots are \['momentum'\]"):
        opt.get_slot(w, "velocity")
