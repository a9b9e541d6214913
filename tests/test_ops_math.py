import numpy as np

import flowmill.runtime as fm
from flowmill.runtime.ops import math_ops as M

from opcheck import OpCase, case_tests

rng = np.random.default_rng(1)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def pos(*shape):
    return r(*shape, low=0.5, high=2.0)


CASES = [
    OpCase("add_broadcast", lambda a, b: a + b, [r(3, 4), r(4)], np.add),
    OpCase("add_broadcast_keepdim", lambda a, b: a + b, [r(3, 1), r(1, 4)], np.add),
    OpCase("sub", lambda a, b: a - b, [r(2, 3), r(2, 3)], np.subtract),
    OpCase("mul_broadcast", lambda a, b: a * b, [r(2, 3, 4), r(3, 1)], np.multiply),
    OpCase("div", lambda a, b: a / b, [r(2, 3), pos(2, 3)], np.divide),
    OpCase("maximum", M.maximum, [r(5), r(5)], np.maximum),
    OpCase("minimum", M.minimum, [r(5), r(5)], np.minimum),
    OpCase("pow", M.pow, [pos(4), r(4)], np.power, rtol=1e-4),
    OpCase("squared_difference", M.squared_difference, [r(3, 2), r(2)], lambda a, b: (a - b) ** 2),
    OpCase("neg", lambda a: -a, [r(3)], np.negative),
    OpCase("square", M.square, [r(3, 2)], np.square),
    OpCase("sqrt", M.sqrt, [pos(4)], np.sqrt),
    OpCase("rsqrt", M.rsqrt, [pos(4)], lambda a: 1 / np.sqrt(a)),
    OpCase("exp", M.exp, [r(4)], np.exp),
    OpCase("log", M.log, [pos(4)], np.log),
    OpCase("abs", M.abs, [r(6)], np.abs),
    OpCase("reciprocal", M.reciprocal, [pos(3)], np.reciprocal),
    OpCase("sign", M.sign, [r(6)], np.sign, grad=False),
    OpCase(
        "add_n",
        lambda a, b, c: M.add_n([a, b, c]),
        [r(2, 2), r(2, 2), r(2, 2)],
        lambda a, b, c: a + b + c,
    ),
    OpCase(
        "cast", lambda a: M.cast(a, fm.float64) * 2.0, [r(3)], lambda a: a.astype(np.float64) * 2
    ),
    OpCase(
        "cast_to_int",
        lambda a: M.cast(a, fm.int32),
        [r(5) * 3],
        lambda a: a.astype(np.int32),
        grad=False,
    ),
    OpCase("matmul", M.matmul, [r(3, 4), r(4, 2)], np.matmul),
    OpCase(
        "matmul_ta",
        lambda a, b: M.matmul(a, b, transpose_a=True),
        [r(4, 3), r(4, 2)],
        lambda a, b: a.T @ b,
    ),
    OpCase(
        "matmul_tb",
        lambda a, b: M.matmul(a, b, transpose_b=True),
        [r(3, 4), r(2, 4)],
        lambda a, b: a @ b.T,
    ),
    OpCase(  # few rows against many: the kernel swaps the product (b @ a.T).T
        "matmul_tb_swapped",
        lambda a, b: M.matmul(a, b, transpose_b=True),
        [r(4, 8), r(300, 8)],
        lambda a, b: a @ b.T,
        grad=False,
    ),
    OpCase(
        "matmul_tab",
        lambda a, b: M.matmul(a, b, transpose_a=True, transpose_b=True),
        [r(4, 3), r(2, 4)],
        lambda a, b: a.T @ b.T,
    ),
    OpCase("sum_all", M.reduce_sum, [r(3, 4)], lambda a: np.sum(a)),
    OpCase(
        "sum_axis_keep",
        lambda a: M.reduce_sum(a, axis=1, keepdims=True),
        [r(3, 4)],
        lambda a: a.sum(1, keepdims=True),
    ),
    OpCase(
        "mean_axis", lambda a: M.reduce_mean(a, axis=[0, 2]), [r(2, 3, 4)], lambda a: a.mean((0, 2))
    ),
    OpCase(
        "mean_keep",
        lambda a: M.reduce_mean(a, axis=0, keepdims=True),
        [r(2, 3)],
        lambda a: a.mean(0, keepdims=True),
    ),
    OpCase("max_axis", lambda a: M.reduce_max(a, axis=1), [r(3, 5)], lambda a: a.max(1)),
    OpCase(
        "min_all_keep",
        lambda a: M.reduce_min(a, keepdims=True),
        [r(2, 3)],
        lambda a: a.min(keepdims=True),
    ),
    OpCase(
        "prod_axis", lambda a: M.reduce_prod(a, axis=0), [pos(3, 2)], lambda a: a.prod(0), rtol=1e-4
    ),
    OpCase(
        "floordiv_mod",
        lambda a, b: [a // b, a % b],
        [np.array([7, -7, 9], np.int32), np.array([2, 2, -4], np.int32)],
        lambda a, b: [a // b, a % b],
        grad=False,
    ),
    OpCase("argmax", lambda a: M.argmax(a, axis=1), [r(4, 5)], lambda a: a.argmax(1), grad=False),
    OpCase("size", lambda a: M.size(a), [r(4, 5)], lambda a: np.int32(20), grad=False),
    OpCase(
        "compare",
        lambda a, b: [M.equal(a, b), M.not_equal(a, b), a < b, a <= b, a > b, a >= b],
        [np.array([1, 2, 3], np.float32), np.array([3, 2, 1], np.float32)],
        lambda a, b: [a == b, a != b, a < b, a <= b, a > b, a >= b],
        grad=False,
    ),
    OpCase(
        "logical",
        lambda a, b: [a & b, a | b, ~a],
        [np.array([True, False, True]), np.array([True, True, False])],
        lambda a, b: [a & b, a | b, ~a],
        grad=False,
    ),
    OpCase(
        "sum_to_shape_of",
        lambda g, x: [M.sum_to_shape_of(g, x), M.broadcast_to_shape_of(x, g)],
        [r(2, 3), r(1, 3)],
        lambda g, x: [g.sum(0, keepdims=True), np.broadcast_to(x, (2, 3))],
    ),
    OpCase(
        "broadcast_to_shape_of_axes",
        lambda g, x: M.broadcast_to_shape_of(g, x, axes=(1,)),
        [r(2), r(2, 3)],
        lambda g, x: np.broadcast_to(g[:, None], (2, 3)),
        wrt=[0],
    ),
    OpCase(
        "zeros_ones_like",
        lambda a: [fm.ops.array_ops.zeros_like(a), fm.ops.array_ops.ones_like(a)],
        [r(2, 2)],
        lambda a: [np.zeros_like(a), np.ones_like(a)],
        grad=False,
    ),
]


test_forward, test_gradient = case_tests(CASES)
