"""Variable ops checked like every other op: forward against NumPy, gradients numerically."""

import numpy as np
import pytest

import flowmill.runtime as fm

from opcheck import OpCase, case_tests

W = np.array([[1.0, -2.0], [0.5, 3.0], [2.0, 1.0]], np.float32)


def _updated(update):
    """Apply ``update(var)`` then read the variable again, in one step."""

    def build(*inputs):
        v = fm.Variable(W, name="v")
        with fm.control_dependencies([update(v, *inputs)]):
            return v.read_value()

    return build


CASES = [
    OpCase(
        "read_variable",
        lambda x: fm.Variable(W.astype(x.dtype), name="w") * x,
        [W * 0.5],
        lambda x: W * x,
    ),
    OpCase("assign", _updated(lambda v, x: v.assign(x)), [W * 3], lambda x: x, grad=False),
    OpCase("assign_add", _updated(lambda v, x: v.assign_add(x)), [W], lambda x: W + x, grad=False),
    OpCase("assign_sub", _updated(lambda v, x: v.assign_sub(x)), [W], lambda x: W - x, grad=False),
    OpCase(
        "assign_add_result",
        lambda x: fm.Variable(W, name="v").assign_add(x) * 2.0,
        [W],
        lambda x: (W + x) * 2,
        grad=False,
    ),
    OpCase(
        "scatter_add_repeated_rows",
        _updated(lambda v, i, u: v.scatter_add(i, u)),
        [np.array([2, 0, 2]), np.ones((3, 2), np.float32)],
        lambda i, u: W + np.array([[1, 1], [0, 0], [2, 2]], np.float32),
        grad=False,
    ),
    OpCase(
        "scatter_sub",
        _updated(lambda v, i, u: v.scatter_sub(i, u)),
        [np.array([1]), np.full((1, 2), 0.5, np.float32)],
        lambda i, u: W - np.array([[0, 0], [0.5, 0.5], [0, 0]], np.float32),
        grad=False,
    ),
    OpCase(
        "scatter_sub_repeated_rows",
        _updated(lambda v, i, u: v.scatter_sub(i, u)),
        [np.array([1, 2, 1, 0, 1]), np.arange(10, dtype=np.float32).reshape(5, 2)],
        lambda i, u: W - np.array([[6, 7], [0 + 4 + 8, 1 + 5 + 9], [2, 3]], np.float32),
        grad=False,
    ),
    OpCase(
        "var_is_initialized",
        lambda x: fm.cast(fm.Variable(W, name="v").is_initialized(), fm.float32) * x,
        [W],
        lambda x: x,
        grad=False,
    ),
    OpCase(
        "scatter_update",
        _updated(lambda v, i, u: v.scatter_update(i, u)),
        [np.array([0, 2]), np.zeros((2, 2), np.float32)],
        lambda i, u: np.array([[0, 0], [0.5, 3], [0, 0]], np.float32),
        grad=False,
    ),
]



# ---- optimizer updates, one op each: the variable and every slot read back after it.

S1 = np.abs(W) + 0.5  # slot values (positive: accumulators and mean squares)
S2 = W * 0.25
S3 = np.abs(S2)  # Adadelta's mean squared update
HYPER = {"lr": 0.1, "momentum": 0.9, "rho": 0.8, "eps": 1e-3}


def _applied(op_type: str, slots: list, hypers: list, **flags):
    def build(grad):
        from flowmill.runtime.ops.training_ops import apply_update

        var = fm.Variable(W, name="v")
        slot_vars = [fm.Variable(s, name=f"s{i}") for i, s in enumerate(slots)]
        consts = [fm.constant(np.float32(h)) for h in hypers]
        with fm.control_dependencies([apply_update(op_type, var, slot_vars, grad, consts,
                                                   **flags)]):
            return [var.read_value(), *(s.read_value() for s in slot_vars)]

    return build


def _rms_ref(centered: bool, use_momentum: bool):
    lr, omd, mu, eps = 0.1, 0.2, 0.9, 1e-3

    def ref(g):
        ms = S1 + (g * g - S1) * omd
        mg = S2 + (g - S2) * omd
        step = g * lr / np.sqrt((ms - mg * mg if centered else ms) + eps)
        mom = S2 * mu + step
        out = [W - (mom if use_momentum else step), ms]
        return out + ([mom] if use_momentum else []) + ([mg] if centered else [])

    return ref


def _adadelta_ref(g):
    lr, rho, eps = 0.1, 0.8, 1e-3
    a = S1 * rho + g * g * (1 - rho)
    update = np.sqrt(S3 + eps) / np.sqrt(a + eps) * g
    return [W - update * lr, a, S3 * rho + update * update * (1 - rho)]


G = np.array([[0.3, -0.1], [0.2, 0.4], [-0.5, 0.05]], np.float32)
UPDATE_CASES = [
    OpCase("apply_gradient_descent", _applied("ResourceApplyGradientDescent", [], [0.1]),
           [G], lambda g: [W - g * 0.1], grad=False),
    OpCase("apply_momentum", _applied("ResourceApplyMomentum", [S2], [0.1, 0.9]),
           [G], lambda g: [W - (S2 * 0.9 + g) * 0.1, S2 * 0.9 + g], grad=False),
    OpCase("apply_momentum_nesterov",
           _applied("ResourceApplyMomentum", [S2], [0.1, 0.9], use_nesterov=True),
           [G], lambda g: [W - g * 0.1 - (S2 * 0.9 + g) * 0.9 * 0.1, S2 * 0.9 + g], grad=False),
    OpCase("apply_adagrad", _applied("ResourceApplyAdagrad", [S1], [0.1]),
           [G], lambda g: [W - g * 0.1 / np.sqrt(S1 + g * g), S1 + g * g], grad=False),
    OpCase("apply_adadelta", _applied("ResourceApplyAdadelta", [S1, S3], [0.1, 0.8, 0.2, 1e-3]),
           [G], _adadelta_ref, grad=False),
    *(OpCase(f"apply_rmsprop_{'centered_' * c}{'momentum' if m else 'plain'}",
             _applied("ResourceApplyRMSProp", [S1, *([S2] if m else []), *([S2] if c else [])],
                      [0.1, 0.2, 0.9, 1e-3], centered=c, use_momentum=m),
             [G], _rms_ref(c, m), grad=False)
      for c in (False, True) for m in (False, True)),
    OpCase("apply_adam", _applied("ResourceApplyAdam", [S2, S1], [0.05, 0.1, 0.001, 1e-3]),
           [G], lambda g: [W - (S2 + (g - S2) * 0.1) * 0.05
                           / (np.sqrt(S1 + (g * g - S1) * 0.001) + 1e-3),
                           S2 + (g - S2) * 0.1, S1 + (g * g - S1) * 0.001], grad=False),
]
CASES += UPDATE_CASES

test_forward, test_gradient = case_tests(CASES)


def test_assign_of_wrong_shape_is_a_build_error():
    with fm.Graph().as_default():
        v = fm.Variable(W, name="v")
        with pytest.raises(fm.GraphError, match=r"variable has shape \(3, 2\), value has \(2, 3\)"):
            v.assign(np.zeros((2, 3), np.float32))
        with pytest.raises(fm.GraphError, match="variable 'v': variable has dtype float32"):
            v.assign_add(fm.constant(np.zeros((3, 2), np.float64)))


def test_is_initialized_before_and_after_the_initializer():
    """What a task joining a running job asks before it would initialize anything."""
    v = fm.Variable(W, name="v")
    with fm.Session() as sess:
        assert not sess.run(v.is_initialized())
        sess.run(v.initializer)
        assert sess.run(v.is_initialized())


def test_an_update_op_names_what_does_not_fit():
    from flowmill.runtime.graph import GraphError
    from flowmill.runtime.ops.training_ops import apply_update

    with fm.Graph().as_default():
        var, slot = fm.Variable(W, name="v"), fm.Variable(W, name="m")
        lr = fm.constant(np.float32(0.1))
        with pytest.raises(GraphError, match=r"variable has shape \(3, 2\), gradient has \(2,\)"):
            apply_update("ResourceApplyMomentum", var, [slot], fm.constant(W[0]), [lr, lr])
        with pytest.raises(GraphError, match="hyperparameter momentum must be a float32 scalar"):
            apply_update("ResourceApplyMomentum", var, [slot], fm.constant(W),
                         [lr, fm.constant(0.9, dtype=fm.float64)])
        with pytest.raises(GraphError, match="2 hyperparameters"):
            apply_update("ResourceApplyMomentum", var, [slot], fm.constant(W), [lr])


def test_an_update_with_a_gradient_of_another_shape_fails_naming_both():
    from flowmill.runtime.ops.training_ops import apply_update

    graph = fm.Graph()
    with graph.as_default():
        var = fm.Variable(W, name="v")
        g = fm.placeholder(fm.float32, [None, 2])
        update = apply_update("ResourceApplyGradientDescent", var, [], g,
                              [fm.constant(np.float32(0.1))])
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        with pytest.raises(Exception, match=r"gradient of shape \[2, 2\] for variable 'v' of "
                                            r"shape \[3, 2\]"):
            sess.run(update, {g: np.ones((2, 2), np.float32)})
        np.testing.assert_array_equal(sess.run(var.value()), W)  # nothing lost
