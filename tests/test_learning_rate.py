"""Learning-rate schedules on the global step match TensorFlow 1.x's formulas, and the
optimizers take a schedule (a tensor) as their learning rate, reading it every step."""

import math

import numpy as np
import pytest

import flowmill.runtime as fm

STEPS = [0, 1, 7, 10, 15, 20, 33, 100]


def values_at(make, steps=STEPS):
    """The schedule ``make(step)`` evaluated with the global step set to each of ``steps``."""
    with fm.Graph().as_default():
        step = fm.train.get_or_create_global_step()
        rate = make(step)
        assert rate.shape == ()
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            out = []
            for s in steps:
                sess.run(step.assign(s))
                out.append(float(sess.run(rate)))
    return np.array(out)


def test_exponential_decay():
    got = values_at(lambda s: fm.train.exponential_decay(0.1, s, 10, 0.5))
    np.testing.assert_allclose(got, [0.1 * 0.5 ** (s / 10) for s in STEPS], rtol=1e-6)
    stairs = values_at(lambda s: fm.train.exponential_decay(0.1, s, 10, 0.5, staircase=True))
    np.testing.assert_allclose(stairs, [0.1 * 0.5 ** (s // 10) for s in STEPS], rtol=1e-6)


def test_piecewise_constant():
    got = values_at(lambda s: fm.train.piecewise_constant(s, [7, 20], [1.0, 0.5, 0.1]))
    want = [1.0 if s <= 7 else 0.5 if s <= 20 else 0.1 for s in STEPS]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with fm.Graph().as_default():
        step = fm.train.get_or_create_global_step()
        with pytest.raises(ValueError, match="3 values for 3 boundaries"):
            fm.train.piecewise_constant(step, [1, 2, 3], [1.0, 0.5, 0.1])
        with pytest.raises(ValueError, match="boundaries \\[5, 2\\] must increase"):
            fm.train.piecewise_constant(step, [5, 2], [1.0, 0.5, 0.1])


def test_cosine_decay():
    got = values_at(lambda s: fm.train.cosine_decay(0.2, s, 20, alpha=0.1))
    want = [
        0.2 * (0.9 * 0.5 * (1 + math.cos(math.pi * min(s, 20) / 20)) + 0.1) for s in STEPS
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert got[-1] == pytest.approx(0.02)  # past decay_steps it stays at alpha * rate


def test_schedules_name_bad_arguments():
    with fm.Graph().as_default():
        step = fm.train.get_or_create_global_step()
        with pytest.raises(ValueError, match="decay_steps must be positive"):
            fm.train.exponential_decay(0.1, step, 0, 0.5)
        with pytest.raises(ValueError, match="cosine_decay: global_step is required"):
            fm.train.cosine_decay(0.1, None, 10)
        with pytest.raises(TypeError, match="learning_rate must be floating point"):
            fm.train.cosine_decay(1, step, 10)


@pytest.mark.parametrize("optimizer", ["GradientDescent", "Momentum", "Adam"])
def test_optimizers_read_the_schedule_every_step(optimizer):
    """A step applies the rate of the global step it starts at (TensorFlow's order)."""
    with fm.Graph().as_default():
        w = fm.Variable(np.zeros(2, np.float32), name="w")
        step = fm.train.get_or_create_global_step()
        rate = fm.train.piecewise_constant(step, [0], [1.0, 0.25])
        args = {"Momentum": (0.0,)}.get(optimizer, ())
        opt = getattr(fm.train, optimizer)(rate, *args)
        train = opt.minimize(fm.reduce_sum(w * [1.0, -2.0]), global_step=step)
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            values = []
            for _ in range(3):
                sess.run(train)
                values.append(sess.run(w.value()))
            assert sess.run(step) == 3
    first, second, third = values
    if optimizer in ("GradientDescent", "Momentum"):
        np.testing.assert_allclose(first, [-1.0, 2.0])
        np.testing.assert_allclose(second - first, [-0.25, 0.5])
        np.testing.assert_allclose(third - second, [-0.25, 0.5])
    else:  # Adam: a step of the rate's size each (the gradient is constant)
        ratio = (second - first) / first
        np.testing.assert_allclose(ratio, [0.25, 0.25], rtol=0.05)


def test_fm_train_gives_the_optimizers_and_the_schedules():
    from flowmill.runtime import learning_rate, optimizers

    for module in (optimizers, learning_rate):
        assert all(getattr(fm.train, n) is getattr(module, n) for n in module.__all__)
