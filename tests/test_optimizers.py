"""Optimizers against independent NumPy implementations of the documented update rules.

Each rule below is written from ``tf.compat.v1.train.*Optimizer``'s documentation, not from
the graph code, and applied to the same float64 problems step by step.
"""

from __future__ import annotations

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime import optimizers as O
from flowmill.runtime.autodiff import IndexedSlices

STEPS = 100
TOL = 1e-6

# ---- reference rules: (param, grad, state, t) -> new param; ``state`` is updated in place.


def gd_rule(lr):
    def step(w, g, s, t):
        return w - lr * g

    return step, {}


def momentum_rule(lr, mu, nesterov=False):
    def step(w, g, s, t):
        s["a"] = mu * s["a"] + g
        if nesterov:
            return w - (lr * g + lr * mu * s["a"])
        return w - lr * s["a"]

    return step, {"a": 0.0}


def adagrad_rule(lr, init=0.1):
    def step(w, g, s, t):
        s["a"] = s["a"] + g * g
        return w - lr * g / np.sqrt(s["a"])

    return step, {"a": init}


def adadelta_rule(lr, rho, eps):
    def step(w, g, s, t):
        s["a"] = rho * s["a"] + (1 - rho) * g * g
        update = np.sqrt(s["u"] + eps) / np.sqrt(s["a"] + eps) * g
        s["u"] = rho * s["u"] + (1 - rho) * update * update
        return w - lr * update

    return step, {"a": 0.0, "u": 0.0}


def rmsprop_rule(lr, decay, momentum, eps, centered=False):
    def step(w, g, s, t):
        s["ms"] = decay * s["ms"] + (1 - decay) * g * g
        denom = s["ms"] + eps
        if centered:
            s["mg"] = decay * s["mg"] + (1 - decay) * g
            denom = s["ms"] - s["mg"] ** 2 + eps
        s["mom"] = momentum * s["mom"] + lr * g / np.sqrt(denom)
        return w - s["mom"]

    return step, {"ms": 1.0, "mom": 0.0, "mg": 0.0}


def adam_rule(lr, b1, b2, eps):
    def step(w, g, s, t):
        lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        return w - lr_t * s["m"] / (np.sqrt(s["v"]) + eps)

    return step, {"m": 0.0, "v": 0.0}


CONFIGS = [
    ("sgd", lambda: O.GradientDescent(0.05), gd_rule(0.05)),
    ("momentum", lambda: O.Momentum(0.02, 0.9), momentum_rule(0.02, 0.9)),
    (
        "nesterov",
        lambda: O.Momentum(0.02, 0.9, use_nesterov=True),
        momentum_rule(0.02, 0.9, nesterov=True),
    ),
    ("adagrad", lambda: O.Adagrad(0.1), adagrad_rule(0.1)),
    ("adagrad_init", lambda: O.Adagrad(0.1, 0.5), adagrad_rule(0.1, 0.5)),
    ("adadelta", lambda: O.Adadelta(1.0, rho=0.9, epsilon=1e-6), adadelta_rule(1.0, 0.9, 1e-6)),
    ("rmsprop", lambda: O.RMSProp(0.002), rmsprop_rule(0.002, 0.9, 0.0, 1e-10)),
    (
        "rmsprop_momentum",
        lambda: O.RMSProp(0.01, decay=0.8, momentum=0.5, epsilon=1e-6),
        rmsprop_rule(0.01, 0.8, 0.5, 1e-6),
    ),
    (
        "rmsprop_centered",
        # A larger epsilon: near the optimum ms - mg^2 cancels, and with epsilon 1e-10
        # two roundings of the same rule drift apart (the problem, not the code, is unstable).
        lambda: O.RMSProp(0.005, momentum=0.3, epsilon=1e-3, centered=True),
        rmsprop_rule(0.005, 0.9, 0.3, 1e-3, centered=True),
    ),
    ("adam", lambda: O.Adam(0.05), adam_rule(0.05, 0.9, 0.999, 1e-8)),
    ("adam_betas", lambda: O.Adam(0.02, 0.8, 0.99, 1e-6), adam_rule(0.02, 0.8, 0.99, 1e-6)),
]
IDS = [c[0] for c in CONFIGS]

# ---- a dense problem: two chained layers and a bias, least squares.

rng = np.random.default_rng(3)
X = rng.normal(size=(16, 3))
Y = rng.normal(size=(16, 2))
INIT = {"w1": rng.normal(size=(3, 4)) * 0.5, "w2": rng.normal(size=(4, 2)) * 0.5, "b": np.zeros(2)}


def numpy_grads(p):
    h = X @ p["w1"]
    r = h @ p["w2"] + p["b"] - Y
    d = 2.0 * r / r.size
    return {"w1": X.T @ (d @ p["w2"].T), "w2": h.T @ d, "b": d.sum(0)}


def build_dense(graph):
    with graph.as_default():
        v = {k: fm.Variable(val.copy(), name=k) for k, val in INIT.items()}
        out = fm.matmul(fm.matmul(fm.constant(X), v["w1"]), v["w2"]) + v["b"]
        loss = fm.reduce_mean(fm.square(out - fm.constant(Y)))
    return v, loss


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_dense_updates_match_reference(config):
    _, make, (rule, state0) = config
    graph = fm.Graph()
    v, loss = build_dense(graph)
    with graph.as_default():
        train = make().minimize(loss)
    params = {k: val.copy() for k, val in INIT.items()}
    states = {k: {s: np.full_like(val, x) for s, x in state0.items()} for k, val in INIT.items()}
    reads = {k: var.value() for k, var in v.items()}
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        for t in range(1, STEPS + 1):
            grads = numpy_grads(params)
            params = {k: rule(params[k], grads[k], states[k], t) for k in params}
            sess.run(train)
            got = sess.run(reads)
            for k in params:
                np.testing.assert_allclose(
                    got[k], params[k], rtol=TOL, atol=TOL, err_msg=f"{k} after step {t}"
                )
    # The problem is one an optimizer makes progress on: the check is not vacuous.
    assert not np.allclose(params["w1"], INIT["w1"])


# ---- a sparse problem: an embedding table looked up with a repeated row.

TABLE = rng.normal(size=(6, 3))
IDS_LOOKED_UP = np.array([1, 4, 4, 2])
TARGET = rng.normal(size=(4, 3))
UNTOUCHED = [0, 3, 5]


def sparse_numpy_grad(table):
    rows = table[IDS_LOOKED_UP]
    d = 2.0 * (rows - TARGET) / rows.size
    unique = np.unique(IDS_LOOKED_UP)
    summed = np.stack([d[IDS_LOOKED_UP == i].sum(0) for i in unique])
    return unique, summed


def build_sparse(graph):
    from flowmill.runtime.ops.array_ops import gather

    with graph.as_default():
        table = fm.Variable(TABLE.copy(), name="table")
        rows = gather(table, fm.constant(IDS_LOOKED_UP))
        loss = fm.reduce_mean(fm.square(rows - fm.constant(TARGET)))
    return table, loss


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_sparse_updates_touch_only_looked_up_rows(config):
    _, make, (rule, state0) = config
    graph = fm.Graph()
    table, loss = build_sparse(graph)
    opt = make()
    with graph.as_default():
        ((grad, _),) = opt.compute_gradients(loss)
        assert isinstance(grad, IndexedSlices), "Gather's gradient should stay sparse"
        train = opt.apply_gradients([(grad, table)])
    ref = TABLE.copy()
    state = {s: np.full_like(TABLE, x) for s, x in state0.items()}
    slots = [opt.get_slot(table, name) for name in opt.get_slot_names()]
    slot_init = None
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        slot_init = sess.run([s.value() for s in slots])
        for t in range(1, STEPS + 1):
            unique, summed = sparse_numpy_grad(ref)
            rows_state = {s: val[unique] for s, val in state.items()}
            ref[unique] = rule(ref[unique], summed, rows_state, t)
            for s, val in rows_state.items():
                state[s][unique] = val
            sess.run(train)
            got = sess.run(table.value())
            np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL, err_msg=f"after step {t}")
        np.testing.assert_array_equal(got[UNTOUCHED], TABLE[UNTOUCHED])
        for slot, before, after in zip(slots, slot_init, sess.run([s.value() for s in slots]),
                                       strict=True):
            np.testing.assert_array_equal(
                after[UNTOUCHED], before[UNTOUCHED], err_msg=f"{slot.name} moved untouched rows"
            )


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_one_op_update_equals_the_rule_composed_of_ops(config):
    """A dense update (one ``ResourceApply*`` op) against the same rule built of elementwise
    ops, gathers and scatters (the sparse path, given every row once), in float32."""
    from flowmill.runtime.ops.array_ops import gather

    _, make, _ = config
    results = []
    for sparse in (False, True):
        graph = fm.Graph()
        with graph.as_default():
            table = fm.Variable(TABLE.astype(np.float32), name="table")
            rows = gather(table, fm.constant(np.arange(len(TABLE)))) if sparse else table
            target = fm.constant(np.resize(TARGET, TABLE.shape).astype(np.float32))
            loss = fm.reduce_mean(fm.square(rows * rows - target))
            opt = make()
            ((grad, _),) = opt.compute_gradients(loss)
            assert isinstance(grad, IndexedSlices) == sparse
            train = opt.apply_gradients([(grad, table)])
            kept = [table, *(opt.get_slot(table, n) for n in opt.get_slot_names())]
        with fm.Session(graph) as sess:
            sess.run(fm.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(train)
            results.append(sess.run([v.value() for v in kept]))
    for name, dense, composed in zip(["table", *opt.get_slot_names()], *results, strict=True):
        np.testing.assert_allclose(dense, composed, rtol=1e-6, atol=1e-7, err_msg=name)
    assert not np.allclose(results[0][0], TABLE)


# ---- bookkeeping


def _least_squares(graph, dtype=np.float64):
    with graph.as_default():
        w = fm.Variable(np.zeros((3, 2), dtype), name="w")
        b = fm.Variable(np.zeros(2, dtype), name="b")
        out = fm.matmul(fm.constant(X.astype(dtype)), w) + b
        loss = fm.reduce_mean(fm.square(out - fm.constant(Y.astype(dtype))))
    return w, b, loss


def test_global_step_counts_applies():
    graph = fm.Graph()
    w, b, loss = _least_squares(graph)
    with graph.as_default():
        assert O.get_global_step() is None
        step = O.create_global_step()
        assert O.get_global_step() is step and O.get_or_create_global_step() is step
        assert step.dtype == np.int64 and not step.trainable
        assert step not in fm.trainable_variables()
        with pytest.raises(ValueError, match="already has a global step"):
            O.create_global_step()
        train = O.Adam(0.01).minimize(loss, global_step=step)
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        for _ in range(7):
            sess.run(train)
        assert sess.run(step.value()) == 7
        assert sess.run(step.value()).dtype == np.int64


def test_minimize_with_var_list_updates_only_those():
    graph = fm.Graph()
    w, b, loss = _least_squares(graph)
    with graph.as_default():
        opt = O.Momentum(0.1, 0.9)
        train = opt.minimize(loss, var_list=[b])
    assert opt.get_slot(w, "momentum") is None and opt.get_slot(b, "momentum") is not None
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        for _ in range(3):
            sess.run(train)
        np.testing.assert_array_equal(sess.run(w.value()), np.zeros((3, 2)))
        assert np.abs(sess.run(b.value())).sum() > 0


def test_slots_are_initialized_by_global_variables_initializer():
    graph = fm.Graph()
    w, b, loss = _least_squares(graph)
    with graph.as_default():
        adam, adagrad = O.Adam(0.1, beta1=0.8), O.Adagrad(0.1, 0.3)
        rms = O.RMSProp(0.1, momentum=0.5)
        for opt in (adam, adagrad, rms):
            opt.minimize(loss)
    assert adam.get_slot_names() == ["m", "v"]
    assert rms.get_slot_names() == ["momentum", "rms"]
    m = adam.get_slot(w, "m")
    assert m.name == "w/Adam" and adam.get_slot(w, "v").name == "w/Adam_1"
    assert not m.trainable and m in fm.global_variables(graph)
    assert m not in fm.trainable_variables(graph)
    # A slot lives with its variable.
    assert m.handle.op.colocation == (w.handle.op.name,)
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        np.testing.assert_array_equal(sess.run(m.value()), np.zeros((3, 2)))
        np.testing.assert_array_equal(sess.run(adagrad.get_slot(b, "accumulator").value()),
                                      np.full(2, 0.3))
        np.testing.assert_array_equal(sess.run(rms.get_slot(w, "rms").value()), np.ones((3, 2)))
        beta_powers = {v.name: sess.run(v.value()) for v in adam.variables() if "power" in v.name}
        assert beta_powers == {"beta1_power": pytest.approx(0.8),
                               "beta2_power": pytest.approx(0.999)}


def test_learning_rate_may_be_a_tensor():
    graph = fm.Graph()
    w, b, loss = _least_squares(graph)
    with graph.as_default():
        lr = fm.placeholder(fm.float32, (), name="lr")
        train = O.GradientDescent(lr).minimize(loss)
    params = {"w": np.zeros((3, 2)), "b": np.zeros(2)}
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        for rate in (0.1, 0.5, 0.05):
            r = X @ params["w"] + params["b"] - Y
            d = 2.0 * r / r.size
            params = {"w": params["w"] - rate * (X.T @ d), "b": params["b"] - rate * d.sum(0)}
            sess.run(train, {lr: rate})
            np.testing.assert_allclose(sess.run(w.value()), params["w"], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(sess.run(b.value()), params["b"], rtol=1e-6, atol=1e-7)


def test_float32_training_reduces_loss():
    graph = fm.Graph()
    w, b, loss = _least_squares(graph, np.float32)
    with graph.as_default():
        train = O.Adam(0.05).minimize(loss)
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        first = sess.run(loss)
        for _ in range(50):
            sess.run(train)
        assert sess.run(w.value()).dtype == np.float32
        assert sess.run(loss) < first


def test_errors_name_the_variables():
    graph = fm.Graph()
    w, b, loss = _least_squares(graph)
    with graph.as_default():
        unused = fm.Variable(np.zeros(3), name="unused")
        with pytest.raises(ValueError, match="unused"):
            O.GradientDescent(0.1).minimize(loss, var_list=[unused])
        with pytest.raises(ValueError, match="no gradients provided"):
            O.GradientDescent(0.1).apply_gradients([(None, w)])
        with pytest.raises(TypeError, match="'w'"):
            O.GradientDescent(0.1).apply_gradients([(fm.constant(np.zeros((3, 2), np.float32)), w)])
        with pytest.raises(TypeError, match="learning_rate"):
            O.GradientDescent("fast")
        with pytest.raises(TypeError, match="not a Variable"):
            O.GradientDescent(0.1).minimize(loss, var_list=[w.value()])


@pytest.mark.parametrize("make,op,copies", [
    (lambda: O.GradientDescent(0.1), "ResourceApplyGradientDescent", 0),
    (lambda: O.Momentum(0.1, 0.9), "ResourceApplyMomentum", 0),
    (lambda: O.RMSProp(0.1, momentum=0.5, centered=True), "ResourceApplyRMSProp", 0),
    (lambda: O.Adam(0.1), "ResourceApplyAdam", 2),
], ids=["sgd", "momentum", "rmsprop", "adam"])
def test_dense_updates_are_one_op_in_place(make, op, copies):
    """One update op per variable writes the variable and its slots in their own buffers;
    only Adam's scalar beta powers are assigned anew."""
    from flowmill.runtime.prune import prune

    graph = fm.Graph()
    w, b, loss = _least_squares(graph)
    with graph.as_default():
        opt = make()
        train = opt.minimize(loss)
    step = prune([], [train], [])
    kinds = [n.type for n in step.nodes]
    assert kinds.count("AssignVariableOp") == copies
    assert kinds.count(op) == 2
    assert not {"AssignAddVariableOp", "AssignSubVariableOp"} & set(kinds)
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        states = [sess.resources.variable(v.handle.op.attrs["shared_name"] or v.handle.op.name,
                                          v.dtype, v.shape)
                  for v in [w, b, *(opt.get_slot(w, s) for s in opt.get_slot_names())]]
        # ids, not the buffers: a buffer held here would be copied on write
        buffers = [id(s.value) for s in states]
        before = [s.value.copy() for s in states]
        sess.run(train)
        for state, buffer in zip(states, buffers, strict=True):
            assert id(state.value) == buffer, state.name  # written in place
        assert all(not np.array_equal(s.value, x) for s, x in zip(states, before, strict=True))
