"""Every pass terminates on every graph: the optimizer (CSE, constant folding) and the
numerics checks run over loops of every shape the models here use, their gradient loops
included, each in bounded time, and the optimized step computes what the plain one does.
A pass never runs a loop frame without its condition (constant folding once did, forever,
on a loop whose body holds a constant)."""

import threading

import numpy as np
import pytest
import test_loop_gradients as loops

import flowmill.runtime as fm
from flowmill.kernels.resources import Resources
from flowmill.runtime.backprop import to_dense
from flowmill.runtime.passes import add_numerics_checks, optimize
from flowmill.runtime.prune import prune

from opcheck import build_case

PASS_LIMIT_S = 60.0


def _passes_finish(fetches, feeds) -> None:
    """Prune, optimize and add numerics checks in a thread; fail (naming the step) if the
    passes are still running after the limit."""
    errors: list[BaseException] = []

    def run():
        try:
            step = optimize(prune(list(fetches), [], list(feeds)), Resources())
            add_numerics_checks(step)
        except BaseException as e:  # reported below
            errors.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(PASS_LIMIT_S)
    assert not worker.is_alive(), f"graph passes did not finish in {PASS_LIMIT_S:.0f} s"
    if errors:
        raise errors[0]


def _loop_graphs():
    """Each loop case's forward graph, and the same graph with its gradient."""
    for case in loops.CASES:
        yield pytest.param(case, False, id=f"{case.id}-forward")
        if case.grad:
            yield pytest.param(case, True, id=f"{case.id}-gradient")


@pytest.mark.parametrize(("case", "with_gradient"), list(_loop_graphs()))
def test_passes_terminate_and_keep_the_result(case, with_gradient):
    graph, feeds, outputs = build_case(case, dtype_override=np.float64)
    with graph.as_default():
        if with_gradient:
            loss = fm.add_n([fm.reduce_sum(y) for y in outputs])
            outputs = outputs + _dense(fm.gradients(loss, _floats(feeds)))
    _passes_finish(outputs, feeds)
    values = [np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v)
              for v in case.inputs]
    feed = dict(zip(feeds, values, strict=True))
    with fm.Session(graph, optimize=False) as plain:
        want = plain.run(outputs, feed)
    with fm.Session(graph, optimize=True, check_numerics=True) as checked:
        got = checked.run(outputs, feed)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


def _floats(feeds):
    return [f for f in feeds if f.dtype.kind == "f"]


def _dense(grads):
    return [to_dense(g) for g in grads if g is not None]


def test_the_loop_that_hung_constant_folding():
    """A loop whose body multiplies by a constant and reads a fed sequence."""
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, [None, 8])
        seq = fm.placeholder(fm.float32, [3, None, 8])
        h0 = fm.zeros_like(fm.matmul(x, fm.zeros([8, 4])))
        _, h = fm.while_loop(
            lambda t, h: fm.less(t, 3),
            lambda t, h: (t + 1, h + fm.matmul(fm.gather(seq, t), fm.ones([8, 4]))),
            [fm.constant(0), h0],
        )
    _passes_finish([h], [x, seq])
    for optimize_ in (False, True):
        with fm.Session(g, optimize=optimize_) as sess:
            out = sess.run(h, {x: np.ones((2, 8), np.float32), seq: np.ones((3, 2, 8), np.float32)})
        np.testing.assert_array_equal(out, np.full((2, 4), 24.0, np.float32))


def test_loops_made_of_constants_only():
    """Bodies and conditions that read nothing but constants, alone and nested, and a
    constant fetched from inside a cond in a loop: nothing folds across a frame."""
    g = fm.Graph()
    with g.as_default():
        n = fm.while_loop(lambda i: fm.less(i, 10), lambda i: i + fm.constant(2), fm.constant(0))

        def outer(i, total):
            inner = fm.while_loop(
                lambda j, s: fm.less(j, 3), lambda j, s: (j + 1, s + fm.constant(1.0)),
                [fm.constant(0), fm.constant(0.0)],
            )[1]
            picked = fm.cond(fm.less(i, 1), lambda: fm.constant(100.0), lambda: inner)
            return i + 1, total + picked

        _, total = fm.while_loop(
            lambda i, t: fm.less(i, 4), outer, [fm.constant(0), fm.constant(0.0)]
        )
    _passes_finish([n, total], [])
    with fm.Session(g) as sess:
        assert sess.run([n, total]) == [10, 109.0]
