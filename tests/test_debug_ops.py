"""The debugging ops: CheckNumerics, Assert and Print, against NumPy and by what they raise
or write (``fm.debugging``, ``fm.print``)."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.graph import GraphError
from flowmill.runtime.ops import debug_ops as D

from opcheck import OpCase, case_tests

rng = np.random.default_rng(5)


def r(*shape):
    return rng.uniform(0.5, 2.0, size=shape).astype(np.float32)


def _asserted(x, y):
    """``x`` once an Assert that ``x < y`` passed (the Assert as a control dependency)."""
    check = D.assert_less(x, y)
    with fm.control_dependencies([check]):
        return fm.identity(x)


CASES = [
    OpCase("check_numerics", lambda x: D.check_numerics(x, "x"), [r(3, 4)], lambda x: x),
    OpCase("check_numerics_of_log", lambda x: D.check_numerics(fm.log(x), "log"), [r(5)],
           np.log),
    OpCase("assert_all_finite", lambda x: D.assert_all_finite(x * 2.0, "twice"), [r(2, 3)],
           lambda x: x * 2),
    OpCase("print", lambda x, y: fm.print(x, y, message="x, y: "), [r(2, 2), r(3)],
           lambda x, y: x, wrt=[0]),
    OpCase("assert", _asserted, [r(4), r(4) + 2.0], lambda x, y: x, grad=False),
]

test_forward, test_gradient = case_tests(CASES)


def run(fetch, feeds=None):
    with fm.Session(fetch.graph) as sess:
        return sess.run(fetch, feeds or {})


def graph_with(build):
    g = fm.Graph()
    with g.as_default():
        return build()


# ---- CheckNumerics


@pytest.mark.parametrize(
    "bad, found",
    [([1.0, np.nan, 2.0], "NaN"), ([1.0, -np.inf, 2.0], "Inf"), ([np.nan, np.inf], "NaN and Inf")],
)
def test_check_numerics_names_the_op_the_message_and_what_it_found(bad, found):
    def build():
        x = fm.placeholder(fm.float32, (None,), name="x")
        return x, D.check_numerics(x * 1.0, "after scaling", name="scaled/check")

    x, checked = graph_with(build)
    with fm.Session(checked.graph) as sess:
        np.testing.assert_array_equal(sess.run(checked, {x: [1.0, 2.0]}), [1.0, 2.0])
        with pytest.raises(fm.InvalidArgumentError) as info:
            sess.run(checked, {x: np.array(bad, np.float32)})
    message = str(info.value)
    assert "op 'scaled/check' (CheckNumerics)" in message
    assert "after scaling" in message
    assert f"tensor had {found} values" in message
    assert f"shape ({len(bad)},)" in message and "float32" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_check_numerics_is_not_fooled_by_a_sum_that_overflows():
    big = np.full(8, 60000.0, np.float16)  # each finite, their float16 sum is not
    assert not np.isfinite(big.sum())
    checked = graph_with(lambda: D.check_numerics(fm.constant(big) * 1.0, "big"))
    np.testing.assert_array_equal(run(checked), big)


def test_check_numerics_takes_floats_only():
    with pytest.raises(GraphError, match="floating-point"):
        graph_with(lambda: D.check_numerics(fm.constant([1, 2]), "ints"))


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_the_gradient_of_check_numerics_is_checked_too():
    def build():
        x = fm.placeholder(fm.float32, (3,), name="x")
        y = D.check_numerics(x, "forward")
        loss = fm.reduce_sum(fm.sqrt(y))  # finite at 0; its gradient 1 / (2 sqrt 0) is not
        (grad,) = fm.gradients(loss, [x])
        return x, grad

    x, grad = graph_with(build)
    assert grad.op.type == "CheckNumerics"
    with fm.Session(grad.graph) as sess:
        np.testing.assert_allclose(sess.run(grad, {x: [1.0, 4.0, 0.25]}), [0.5, 0.25, 1.0])
        with pytest.raises(fm.InvalidArgumentError) as info:
            sess.run(grad, {x: [1.0, 0.0, 4.0]})
    message = str(info.value)
    assert "NaN or Inf in the gradient: forward" in message and "Inf values" in message


# ---- Assert and the asserts built on it


def _run_asserted(make_assert, *values):
    """Run ``make_assert(*placeholders)`` as a control dependency of an identity."""
    g = fm.Graph()
    with g.as_default():
        feeds = [fm.placeholder(np.asarray(v).dtype, np.shape(v), name=f"in{i}")
                 for i, v in enumerate(values)]
        check = make_assert(*feeds)
        with fm.control_dependencies([check]):
            out = fm.identity(feeds[0])
    with fm.Session(g) as sess:
        return sess.run(out, dict(zip(feeds, values, strict=True)))


@pytest.mark.parametrize(
    "make, good, bad, condition",
    [
        (D.assert_equal, ([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 5, 3]), "x == y"),
        (D.assert_less, ([1.0, 2.0], [2.0, 3.0]), ([1.0, 4.0], [2.0, 3.0]), "x < y"),
        (D.assert_greater, ([2.0, 3.0], [1.0, 2.0]), ([2.0, 1.0], [1.0, 2.0]), "x > y"),
    ],
)
def test_comparison_asserts_pass_and_fail_with_the_data(make, good, bad, condition):
    good = [np.array(v) for v in good]
    bad = [np.array(v) for v in bad]
    np.testing.assert_array_equal(_run_asserted(make, *good), good[0])
    with pytest.raises(fm.InvalidArgumentError) as info:
        _run_asserted(lambda x, y: make(x, y, message="values differ"), *bad)
    message = str(info.value)
    assert "(Assert): assertion failed: values differ" in message
    assert f"Condition {condition} did not hold element-wise" in message
    assert f"x (in0:0) = {np.array2string(bad[0], separator=' ')}" in message
    assert f"y (in1:0) = {np.array2string(bad[1], separator=' ')}" in message


def test_assert_non_negative():
    np.testing.assert_array_equal(
        _run_asserted(D.assert_non_negative, np.array([0.0, 1.5])), [0.0, 1.5]
    )
    with pytest.raises(fm.InvalidArgumentError, match=r"x >= 0 did not hold.*\[ 0\.  -1\.5\]"):
        _run_asserted(D.assert_non_negative, np.array([0.0, -1.5]))


def test_assert_shows_strings_and_summarized_tensors():
    def check(x):
        return D.Assert(fm.less(x, 100.0), ["x is", x, "and that is too much"], summarize=2)

    with pytest.raises(fm.InvalidArgumentError) as info:
        _run_asserted(check, np.arange(200, 210, dtype=np.float32))
    assert "assertion failed: x is [200. 201. ... 208. 209.] and that is too much" in str(
        info.value
    )


def test_assert_all_finite_returns_the_checked_tensor():
    def build():
        x = fm.placeholder(fm.float32, (2,), name="x")
        return x, D.assert_all_finite(x, "x must be finite")

    x, checked = graph_with(build)
    with fm.Session(checked.graph) as sess:
        np.testing.assert_array_equal(sess.run(checked, {x: [1.0, 2.0]}), [1.0, 2.0])
        with pytest.raises(fm.InvalidArgumentError, match="x must be finite: tensor had Inf"):
            sess.run(checked, {x: [1.0, np.inf]})


def test_assert_wants_a_bool_condition():
    with pytest.raises(GraphError, match="bool condition"):
        graph_with(lambda: D.Assert(fm.constant([1.0]), ["x"]))


# ---- Print


def test_print_writes_its_inputs_to_stderr_and_passes_the_first_through(capfd):
    def build():
        x = fm.placeholder(fm.float32, (3,), name="x")
        shown = fm.print(x, fm.reduce_sum(x), message="x and its sum: ")
        return x, shown * 2.0

    x, doubled = graph_with(build)
    with fm.Session(doubled.graph) as sess:
        np.testing.assert_array_equal(sess.run(doubled, {x: [1.0, 2.0, 3.0]}), [2.0, 4.0, 6.0])
        sess.run(doubled, {x: [0.5, 0.5, 0.5]})
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "x and its sum: [1. 2. 3.] 6.",
        "x and its sum: [0.5 0.5 0.5] 1.5",
    ]


def test_print_summarizes_large_tensors(capsys):
    shown = graph_with(lambda: fm.print(fm.range(100), message="n: ", summarize=2) + 0)
    assert run(shown).shape == (100,)
    assert capsys.readouterr().err == "n: [ 0  1 ... 98 99]\n"


def test_print_of_a_constant_runs_every_step_and_is_never_merged(capsys):
    """Stateful: not folded into a constant (it would print once, at compile time) nor
    merged with an identical Print."""

    def build():
        c = fm.constant([1.0, 2.0])
        return fm.print(c, message="a: ") + fm.print(c, message="a: ")

    total = graph_with(build)
    with fm.Session(total.graph) as sess:
        for _ in range(3):
            np.testing.assert_array_equal(sess.run(total), [2.0, 4.0])
    assert capsys.readouterr().err == "a: [1. 2.]\n" * 6


def test_the_debugging_names_of_the_facade():
    assert fm.debugging is D
    assert fm.print is D.print_
    assert issubclass(fm.InvalidArgumentError, ValueError)
