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
