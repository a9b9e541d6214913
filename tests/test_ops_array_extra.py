"""Op cases for the TF1 additions outside ``fm.nn``: ``where`` (Select), ``stack`` and
``unstack``, the clipping functions and the Cos, Sin and Log1p ops; each against NumPy,
the differentiable ones against central differences too."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.ops import unary_math_ops as um

from opcheck import OpCase, case_tests

rng = np.random.default_rng(5)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def away(*shape, avoid=(-0.5, 0.5), margin=0.1):
    """Values at least ``margin`` from each of ``avoid`` (clip bounds): no kink is crossed."""
    x = r(*shape)
    for a in avoid:
        near = np.abs(x - a) < margin
        x[near] = a + np.where(x[near] >= a, margin, -margin) * 1.5
    return x


MASK = np.array([[True, False, True], [False, False, True]])


def ref_clip_by_global_norm(a, b, clip):
    norm = np.sqrt(np.sum(a.astype(np.float64) ** 2) + np.sum(b.astype(np.float64) ** 2))
    scale = clip / max(norm, clip)
    return [a * scale, b * scale, norm]


CASES = [
    # where (Select)
    OpCase("where_same_shape", lambda c, x, y: fm.where(c, x, y), [MASK, r(2, 3), r(2, 3)],
           lambda c, x, y: np.where(c, x, y)),
    OpCase("where_scalar_condition", lambda c, x, y: fm.where(c, x, y),
           [np.array(False), r(2, 3), r(2, 3)], lambda c, x, y: y),
    OpCase("where_row_condition", lambda c, x, y: fm.where(c, x, y),
           [np.array([True, False, True]), r(3, 2, 2), r(3, 2, 2)],
           lambda c, x, y: np.where(c[:, None, None], x, y)),
    OpCase("where_python_number", lambda c, x: fm.where(c, 1.0, x),
           [np.array(True), np.float32(2.0)], lambda c, x: np.float32(1.0)),
    OpCase("where_int", lambda c, x, y: fm.where(c, x, y),
           [MASK, np.arange(6, dtype=np.int32).reshape(2, 3), -np.ones((2, 3), np.int32)],
           lambda c, x, y: np.where(c, x, y), grad=False),
    # stack / unstack
    OpCase("stack", lambda a, b, c: fm.stack([a, b, c]), [r(2, 3), r(2, 3), r(2, 3)],
           lambda a, b, c: np.stack([a, b, c])),
    OpCase("stack_last_axis", lambda a, b: fm.stack([a, b], axis=-1), [r(2, 3), r(2, 3)],
           lambda a, b: np.stack([a, b], axis=-1)),
    OpCase("stack_scalars", lambda a: fm.stack([a, 2.0, a * 3.0]), [np.float32(1.5)],
           lambda a: np.array([a, 2.0, a * 3.0], np.float32)),
    OpCase("unstack", lambda x: fm.unstack(x, axis=1), [r(2, 3, 2)],
           lambda x: [x[:, i] for i in range(3)]),
    # clipping
    OpCase("clip_by_value", lambda x: fm.clip_by_value(x, -0.5, 0.5), [away(3, 4)],
           lambda x: np.clip(x, -0.5, 0.5)),
    OpCase("clip_by_value_tensor_bounds", lambda x, lo, hi: fm.clip_by_value(x, lo, hi),
           [np.array([-3.0, 0.2, 3.0], np.float32), np.float32(-1.0), np.float32(1.0)],
           lambda x, lo, hi: np.clip(x, lo, hi)),
    OpCase("clip_by_norm", lambda x: fm.clip_by_norm(x, 1.0), [r(2, 3)],
           lambda x: x / max(np.linalg.norm(x.astype(np.float64)), 1.0)),
    OpCase("clip_by_norm_rows", lambda x: fm.clip_by_norm(x, 1.0, axes=[1]),
           [np.array([[3.0, 4.0], [0.3, 0.4]], np.float32)],
           lambda x: np.array([[0.6, 0.8], [0.3, 0.4]])),
    OpCase(
        "clip_by_global_norm",
        lambda a, b: (lambda out: [out[0][0], out[0][2], out[1]])(
            fm.clip_by_global_norm([a, None, b], 1.5)
        ),
        [r(2, 3), r(4)],
        lambda a, b: ref_clip_by_global_norm(a, b, 1.5),
    ),
    OpCase(
        "clip_by_global_norm_within",
        lambda a: fm.clip_by_global_norm([a], 100.0)[0][0],
        [r(3)],
        lambda a: a,
    ),
    # elementwise
    OpCase("cos", um.cos, [r(3, 4, low=-4, high=4)], np.cos),
    OpCase("sin", um.sin, [r(3, 4, low=-4, high=4)], np.sin),
    OpCase("log1p", um.log1p, [r(5, low=-0.5, high=3.0)], np.log1p),
    OpCase("log1p_tiny", um.log1p, [np.array([1e-10, -1e-12], np.float32)],
           lambda x: x.astype(np.float64), grad=False, rtol=1e-6, atol=0),
]


test_forward, test_gradient = case_tests(CASES)


# ---- what a wrong call is told


def test_bad_inputs_name_the_op_argument_and_shape():
    f = fm.placeholder
    with fm.Graph().as_default():
        c, x = f(fm.bool_, (2, 3)), f(fm.float32, (2, 3))
        with pytest.raises(fm.GraphError, match=r"\(Select\).*x \(2, 3\) and y \(3,\) must"):
            fm.where(c, x, f(fm.float32, (3,)))
        with pytest.raises(fm.GraphError, match=r"condition \(3,\) must match the first dim"):
            fm.where(f(fm.bool_, (3,)), x, x)
        with pytest.raises(fm.GraphError, match="condition must be bool"):
            fm.where(x, x, x)
        with pytest.raises(ValueError, match="one-argument form"):
            fm.where(c)
        with pytest.raises(fm.GraphError, match=r"stack: value 1 .* has shape \(3, 2\)"):
            fm.stack([x, f(fm.float32, (3, 2))])
        with pytest.raises(fm.GraphError, match="unstack: dim 0 .* is unknown; pass num"):
            fm.unstack(f(fm.float32, (None, 2)))
        with pytest.raises(ValueError, match="clip_value_min 2 is greater than clip_value_max 1"):
            fm.clip_by_value(x, 2, 1)
        with pytest.raises(TypeError, match="t_list must be a list or tuple"):
            fm.clip_by_global_norm(x, 1.0)
        with pytest.raises(ValueError, match="every entry of t_list is None"):
            fm.clip_by_global_norm([None], 1.0)


def test_select_checks_shapes_at_run_time():
    with fm.Graph().as_default():
        c = fm.placeholder(fm.bool_, None)
        x = fm.placeholder(fm.float32, None)
        out = fm.where(c, x, x)
        with fm.Session() as sess, pytest.raises(Exception, match="condition of shape \\(2,\\)"):
            sess.run(out, {c: np.array([True, False]), x: np.zeros(3, np.float32)})


def test_clip_by_global_norm_keeps_none_and_indexed_slices():
    with fm.Graph().as_default():
        table = fm.Variable(np.ones((5, 2), np.float32), name="table")
        dense = fm.Variable(np.full(3, 2.0, np.float32), name="dense")
        unused = fm.Variable(np.zeros(2, np.float32), name="unused")
        loss = fm.reduce_sum(fm.gather(table, [1, 3]) * 3.0) + fm.reduce_sum(dense * 4.0)
        grads = fm.gradients(loss, [table, dense, unused])
        assert isinstance(grads[0], fm.IndexedSlices) and grads[2] is None
        clipped, norm = fm.clip_by_global_norm(grads, 1.0)
        assert isinstance(clipped[0], fm.IndexedSlices) and clipped[2] is None
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            rows, idx, d, n = sess.run([clipped[0].values, clipped[0].indices, clipped[1], norm])
    want_norm = np.sqrt(4 * 9.0 + 3 * 16.0)
    assert n == pytest.approx(want_norm)
    np.testing.assert_allclose(rows, np.full((2, 2), 3.0 / want_norm), rtol=1e-6)
    np.testing.assert_array_equal(idx, [1, 3])
    np.testing.assert_allclose(d, np.full(3, 4.0 / want_norm), rtol=1e-6)


def test_clip_by_global_norm_of_an_infinite_norm_is_nan():
    with fm.Graph().as_default():
        clipped, norm = fm.clip_by_global_norm([fm.constant([np.inf, 1.0])], 1.0)
        with fm.Session() as sess, np.errstate(invalid="ignore"):
            values, n = sess.run([clipped[0], norm])
    assert np.isinf(n) and np.all(np.isnan(values))
