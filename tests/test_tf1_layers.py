"""TensorFlow 1.x's variable scopes and functional layers: names and reuse rules as
TensorFlow has them, layer shapes and initial values, batch normalization's moving
averages through UPDATE_OPS, dropout only in training, and a small conv net that learns."""

import numpy as np
import pytest

import flowmill.runtime as fm

rng = np.random.default_rng(3)


def run(fetches, feeds=None, graph=None):
    with fm.Session(graph or fm.get_default_graph()) as sess:
        sess.run(fm.global_variables_initializer())
        return sess.run(fetches, feeds)


# ---- variable scopes


def test_get_variable_is_named_by_its_scopes_not_the_name_scope():
    with fm.Graph().as_default():
        with fm.name_scope("outer"), fm.variable_scope("a"), fm.variable_scope("b"):
            w = fm.get_variable("w", (2, 3))
            y = fm.identity(w, name="y")
        assert w.name == "a/b/w" and w.shape == (2, 3) and w.dtype == np.float32
        assert y.op.name == "outer/a/b/y"
        ys = []
        for _ in range(2):
            with fm.variable_scope("a", reuse=True):
                with fm.variable_scope("b"):  # reuse is inherited
                    assert fm.get_variable("w") is w
                    ys.append(fm.identity(w, name="y"))
        # Ops get a fresh name scope each time, variables keep theirs.
        assert [t.op.name for t in ys] == ["a/b/y", "a_1/b/y"]
        assert fm.trainable_variables() == [w]


def test_making_a_variable_twice_fails_naming_it():
    with fm.Graph().as_default():
        with fm.variable_scope("layer"):
            fm.get_variable("w", (2,))
        with pytest.raises(ValueError, match="Variable layer/w already exists"):
            with fm.variable_scope("layer"):
                fm.get_variable("w", (2,))
        with pytest.raises(ValueError, match="Variable layer/w already exists"):
            with fm.variable_scope("layer", reuse=False):
                fm.get_variable("w", (2,))


def test_reusing_a_missing_variable_fails_naming_it():
    with fm.Graph().as_default():
        with pytest.raises(ValueError, match="Variable layer/v does not exist"):
            with fm.variable_scope("layer", reuse=True):
                fm.get_variable("v", (2,))
        assert fm.global_variables() == []


def test_sharing_checks_shape_and_dtype():
    with fm.Graph().as_default():
        with fm.variable_scope("s"):
            fm.get_variable("w", (2, 3))
        with fm.variable_scope("s", reuse=True):
            with pytest.raises(ValueError, match=r"share variable s/w.*shape \(3, 2\)"):
                fm.get_variable("w", (3, 2))
            with pytest.raises(ValueError, match="share variable s/w.*dtype float64"):
                fm.get_variable("w", (2, 3), fm.float64)


def test_auto_reuse_makes_then_shares_and_reuse_cannot_be_turned_off():
    with fm.Graph().as_default():
        with fm.variable_scope("m", reuse=fm.AUTO_REUSE):
            first = fm.get_variable("w", (4,))
        with fm.variable_scope("m", reuse=fm.AUTO_REUSE):
            assert fm.get_variable("w", (4,)) is first
        with fm.variable_scope("m", reuse=True), fm.variable_scope("inner", reuse=False):
            assert fm.get_variable_scope().reuse is True
        with fm.variable_scope("n") as scope:
            v = fm.get_variable("v", (1,))
            scope.reuse_variables()
            assert fm.get_variable("v") is v
        with fm.variable_scope(scope):  # a captured scope re-enters under its own name
            assert fm.get_variable_scope().name == "n" and fm.get_variable_scope().reuse


def test_default_names_are_made_unique_and_captured_scopes_re_enter():
    with fm.Graph().as_default():
        names = []
        for _ in range(3):
            with fm.variable_scope(None, default_name="block"):
                names.append(fm.get_variable("w", (1,)).name)
        assert names == ["block/w", "block_1/w", "block_2/w"]
        with fm.variable_scope("top") as top:
            pass
        with fm.variable_scope("elsewhere"), fm.variable_scope(top):
            assert fm.get_variable("x", (1,)).name == "top/x"
        with pytest.raises(ValueError, match="reuse=True needs a name_or_scope"):
            with fm.variable_scope(None, default_name="d", reuse=True):
                pass


def test_initializers_default_glorot_for_floats_zeros_for_ints_and_scope_defaults():
    with fm.Graph().as_default():
        w = fm.get_variable("w", (40, 60))
        n = fm.get_variable("n", (3,), fm.int64)
        c = fm.get_variable("c", initializer=np.arange(3, dtype=np.float32))
        with fm.variable_scope("s", initializer=fm.initializers.constant(2.5)):
            s = fm.get_variable("v", (2,))
        with pytest.raises(ValueError, match="get_variable u: a shape is needed"):
            fm.get_variable("u")
        wv, nv, cv, sv = run([w, n, c, s])
    limit = np.sqrt(6.0 / (40 + 60))
    assert np.abs(wv).max() <= limit and np.abs(wv).max() > 0.8 * limit
    np.testing.assert_array_equal(nv, [0, 0, 0])
    np.testing.assert_array_equal(cv, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(sv, [2.5, 2.5])


# ---- dense, conv2d, pooling, flatten


def test_dense_shapes_variables_and_reuse():
    with fm.Graph().as_default():
        x = fm.placeholder(fm.float32, (None, 5))
        y = fm.layers.dense(x, 3, activation=fm.nn.relu)
        y_again = fm.layers.dense(x, 3, name="dense", reuse=True)
        z = fm.layers.dense(fm.placeholder(fm.float32, (None, 4, 3)), 2)
        assert y.shape == (None, 3) and z.shape == (None, 4, 2)
        assert [v.name for v in fm.trainable_variables()] == [
            "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"
        ]
        with pytest.raises(ValueError, match="Variable dense/kernel already exists"):
            fm.layers.dense(x, 3, name="dense")
        with pytest.raises(ValueError, match="Variable fc/kernel does not exist"):
            fm.layers.dense(x, 3, name="fc", reuse=True)
        with pytest.raises(fm.GraphError, match="last dim of inputs .* must be known"):
            fm.layers.dense(fm.placeholder(fm.float32, (2, None)), 3)
        xv = rng.normal(size=(4, 5)).astype(np.float32)
        yv, y2, k, b = run([y, y_again, "dense/kernel/Read:0", "dense/bias/Read:0"], {x: xv})
    np.testing.assert_allclose(yv, np.maximum(xv @ k + b, 0), rtol=1e-5)
    np.testing.assert_allclose(y2, xv @ k + b, rtol=1e-5)  # the same variables
    np.testing.assert_array_equal(b, np.zeros(3))


def test_conv2d_pooling_and_flatten_shapes():
    with fm.Graph().as_default():
        x = fm.placeholder(fm.float32, (None, 9, 9, 2))
        same = fm.layers.conv2d(x, 4, 3, padding="same")
        valid = fm.layers.conv2d(x, 5, (3, 2), strides=2)
        pooled = fm.layers.max_pooling2d(same, 2, 2)
        pooled_same = fm.layers.max_pooling2d(same, 3, 2, padding="same")
        flat = fm.layers.flatten(pooled)
        assert same.shape == (None, 9, 9, 4) and valid.shape == (None, 4, 4, 5)
        assert pooled.shape == (None, 4, 4, 4) and pooled_same.shape == (None, 5, 5, 4)
        assert flat.shape == (None, 64)
        kernel = fm.get_collection(fm.GraphKeys.TRAINABLE_VARIABLES, scope="conv2d_1")[0]
        assert kernel.name == "conv2d_1/kernel" and kernel.shape == (3, 2, 2, 5)
        with pytest.raises(ValueError, match="conv2d: padding must be 'valid' or 'same'"):
            fm.layers.conv2d(x, 1, 3, padding="full")
        xv = rng.normal(size=(2, 9, 9, 2)).astype(np.float32)
        got, k, fv, pv = run([same, "conv2d/kernel/Read:0", flat, pooled], {x: xv})
    want = fm.Graph()
    with want.as_default():
        ref = fm.nn.conv2d(xv, k, 1, "SAME")
    np.testing.assert_allclose(got, run(ref, graph=want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fv, pv.reshape(2, -1))


# ---- batch normalization


def _bn_graph(training):
    x = fm.placeholder(fm.float32, (None, 3, 3, 2), name="x")
    y = fm.layers.batch_normalization(x, momentum=0.9, training=training)
    variables = {v.name.split("/")[-1]: v for v in fm.global_variables()}
    return x, y, variables


def test_batch_norm_in_training_normalizes_and_updates_the_averages_via_update_ops():
    with fm.Graph().as_default():
        x, y, v = _bn_graph(training=True)
        updates = fm.get_collection(fm.GraphKeys.UPDATE_OPS)
        assert len(updates) == 2
        assert {v_.name for v_ in fm.trainable_variables()} == {
            "batch_normalization/gamma", "batch_normalization/beta"
        }
        xv = rng.normal(2.0, 3.0, size=(8, 3, 3, 2)).astype(np.float32)
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            out = sess.run(y, {x: xv})
            assert sess.run(v["moving_mean"].value()).tolist() == [0.0, 0.0]  # not run yet
            sess.run(updates, {x: xv})
            mm, mv = sess.run([v["moving_mean"].value(), v["moving_variance"].value()])
    mean, var = xv.mean((0, 1, 2)), xv.var((0, 1, 2))
    np.testing.assert_allclose(out, (xv - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mm, 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(mv, 0.9 * 1.0 + 0.1 * var, rtol=1e-5)


def test_batch_norm_at_inference_uses_the_moving_averages():
    with fm.Graph().as_default():
        x, y, v = _bn_graph(training=False)
        assert fm.get_collection(fm.GraphKeys.UPDATE_OPS) == []
        xv = rng.normal(size=(4, 3, 3, 2)).astype(np.float32)
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            sess.run([
                v["moving_mean"].assign([1.0, -2.0]), v["moving_variance"].assign([4.0, 0.25]),
                v["gamma"].assign([2.0, 1.0]), v["beta"].assign([0.5, 0.0]),
            ])
            out = sess.run(y, {x: xv})
    want = (xv - [1.0, -2.0]) / np.sqrt(np.array([4.0, 0.25]) + 1e-3) * [2.0, 1.0] + [0.5, 0.0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_batch_norm_with_a_training_tensor_switches_per_step():
    with fm.Graph().as_default():
        training = fm.placeholder(fm.bool_, (), name="training")
        x, y, v = _bn_graph(training=training)
        updates = fm.get_collection(fm.GraphKeys.UPDATE_OPS)
        xv = rng.normal(1.0, 2.0, size=(6, 3, 3, 2)).astype(np.float32)
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            train_out = sess.run([y, *updates], {x: xv, training: True})[0]
            mm = sess.run(v["moving_mean"].value())
            infer_out = sess.run([y, *updates], {x: xv, training: False})[0]
            assert sess.run(v["moving_mean"].value()).tolist() == mm.tolist()  # unchanged
    mean, var = xv.mean((0, 1, 2)), xv.var((0, 1, 2))
    np.testing.assert_allclose(mm, 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(train_out, (xv - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)
    mv = 0.9 + 0.1 * var
    np.testing.assert_allclose(infer_out, (xv - mm) / np.sqrt(mv + 1e-3), rtol=1e-4, atol=1e-5)


def test_batch_norm_on_another_axis_and_bad_arguments():
    with fm.Graph().as_default():
        x = fm.placeholder(fm.float32, (5, 3, 4))
        y = fm.layers.batch_normalization(x, axis=1, training=True, center=False, scale=False)
        assert [v.name for v in fm.global_variables()] == [
            "batch_normalization/moving_mean", "batch_normalization/moving_variance"
        ]
        with pytest.raises(TypeError, match="training must be a Python bool or a bool scalar"):
            fm.layers.batch_normalization(x, training=fm.constant(1.0))
        with pytest.raises(fm.GraphError, match="axis 3 is out of range"):
            fm.layers.batch_normalization(x, axis=3)
        xv = rng.normal(size=(5, 3, 4)).astype(np.float32)
        out = run(y, {x: xv})
    mean, var = xv.mean((0, 2), keepdims=True), xv.var((0, 2), keepdims=True)
    np.testing.assert_allclose(out, (xv - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)


# ---- dropout


def test_dropout_is_off_at_inference_and_scaled_in_training():
    with fm.Graph(seed=1).as_default():
        x = fm.placeholder(fm.float32, (200, 50))
        training = fm.placeholder(fm.bool_, ())
        off = fm.layers.dropout(x, 0.4)  # training=False by default, as in TensorFlow
        on = fm.layers.dropout(x, 0.4, training=True)
        switched = fm.layers.dropout(x, 0.4, training=training)
        xv = np.ones((200, 50), np.float32)
        with fm.Session() as sess:
            off_v, on_v = sess.run([off, on], {x: xv})
            sw_train = sess.run(switched, {x: xv, training: True})
            sw_infer = sess.run(switched, {x: xv, training: False})
    np.testing.assert_array_equal(off_v, xv)
    np.testing.assert_array_equal(sw_infer, xv)
    for out in (on_v, sw_train):
        kept = out != 0
        assert abs(kept.mean() - 0.6) < 0.02
        np.testing.assert_allclose(out[kept], 1 / 0.6, rtol=1e-6)


# ---- a small conv net built from layers learns


def test_a_conv_net_of_layers_trains():
    images = rng.normal(size=(32, 8, 8, 1)).astype(np.float32)
    # Labels a conv net can read: which quadrant holds the most mass.
    quads = np.stack([images[:, :4, :4].sum((1, 2, 3)), images[:, :4, 4:].sum((1, 2, 3)),
                      images[:, 4:, :4].sum((1, 2, 3)), images[:, 4:, 4:].sum((1, 2, 3))], 1)
    labels = quads.argmax(1).astype(np.int32)
    with fm.Graph(seed=5).as_default():
        x = fm.placeholder(fm.float32, (None, 8, 8, 1))
        y = fm.placeholder(fm.int32, (None,))
        training = fm.placeholder(fm.bool_, ())
        h = fm.layers.conv2d(x, 8, 3, padding="same", activation=fm.nn.relu)
        h = fm.layers.batch_normalization(h, training=training)
        h = fm.layers.max_pooling2d(h, 2, 2)
        h = fm.layers.dropout(fm.layers.flatten(h), 0.1, training=training)
        logits = fm.layers.dense(h, 4)
        loss = fm.reduce_mean(
            fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
        step = fm.train.get_or_create_global_step()
        rate = fm.train.exponential_decay(0.05, step, 20, 0.5)
        with fm.control_dependencies(fm.get_collection(fm.GraphKeys.UPDATE_OPS)):
            train = fm.train.Adam(rate).minimize(loss, global_step=step)
        moving = fm.get_collection(fm.GraphKeys.GLOBAL_VARIABLES, scope="batch_norm")[2]
        assert moving.name == "batch_normalization/moving_mean"
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            feed = {x: images, y: labels}
            before = sess.run(loss, {**feed, training: False})
            for _ in range(30):
                sess.run(train, {**feed, training: True})
            after = sess.run(loss, {**feed, training: False})
            assert sess.run(step) == 30
            assert np.abs(sess.run(moving.value())).sum() > 0  # the averages moved
    assert after < 0.5 * before, (before, after)


def test_facade_functions_are_not_shadowed_by_modules_of_the_same_name():
    """Importing ``flowmill.runtime.<name>`` sets the package attribute ``<name>`` to that
    module: a facade function named like a runtime module would turn into the module as
    soon as anything imported it (``fm.variable_scope`` did, hence ``variable_scopes``)."""
    import pathlib

    import flowmill.runtime as runtime_pkg
    from flowmill.runtime import layers  # noqa: F401  (loads variable_scopes)

    root = pathlib.Path(runtime_pkg.__file__).parent
    functions = [n for n, (_, attr) in runtime_pkg._WHERE.items() if attr is not None]
    clashes = [n for n in functions if (root / f"{n}.py").exists() or (root / n).is_dir()]
    assert clashes == []
    assert callable(fm.variable_scope) and fm.variable_scope.__module__.endswith("scopes")
