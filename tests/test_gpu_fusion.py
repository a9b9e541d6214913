"""Elementwise fusion on a GPU (the strict stand-in, which counts a fused call as one
launch): fused steps compute what unfused steps do, with fewer launches."""

from __future__ import annotations

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime import fusion

OPTIMIZERS = {
    "adam": lambda: fm.train.AdamOptimizer(0.01),
    "momentum": lambda: fm.train.MomentumOptimizer(0.05, 0.9),
    "rmsprop": lambda: fm.train.RMSPropOptimizer(0.01),
    "sgd": lambda: fm.train.GradientDescentOptimizer(0.1),
}


def _train(optimizer: str, steps: int = 3, device: str = "/gpu:0"):
    """Losses, final weights, and the plan of a small MLP trained on the stand-in."""
    rng = np.random.default_rng(0)
    graph = fm.Graph(seed=3)
    with graph.as_default(), fm.device(device):
        x = fm.placeholder(fm.float32, [None, 6])
        y = fm.placeholder(fm.int64, [None])
        w1 = fm.Variable(rng.normal(size=(6, 8)).astype(np.float32))
        b1 = fm.Variable(np.full(8, 0.1, np.float32))
        w2 = fm.Variable(rng.normal(size=(8, 8)).astype(np.float32))
        w3 = fm.Variable(rng.normal(size=(8, 3)).astype(np.float32))
        h = fm.nn.sigmoid(fm.nn.bias_add(fm.matmul(x, w1), b1))
        h = fm.tanh(fm.matmul(h, w2)) * 0.5 + fm.nn.relu(fm.matmul(h, w2))
        logits = fm.matmul(h, w3)
        loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                              logits=logits))
        train = OPTIMIZERS[optimizer]().minimize(loss)
    feeds = {x: rng.normal(size=(5, 6)).astype(np.float32), y: rng.integers(0, 3, 5)}
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(loss, list(feeds), targets=[train])
        losses = [float(step(*feeds.values())) for _ in range(steps)]
        return losses, sess.run([w1, b1, w2, w3]), step.plan


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_fused_training_step_computes_what_the_unfused_one_does(standin_gpu, monkeypatch,
                                                                   optimizer):
    fused_losses, fused_weights, plan = _train(optimizer)
    assert any(n.type == "_FusedElementwise" for n in plan.order)
    monkeypatch.setattr(fusion, "ENABLED", False)
    losses, weights, plan = _train(optimizer)
    assert not any(n.type == "_FusedElementwise" for n in plan.order)
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-6)
    for a, b in zip(fused_weights, weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _launches(standin, optimizer: str, variables: int) -> int:
    rng = np.random.default_rng(0)
    graph = fm.Graph(seed=3)
    with graph.as_default(), fm.device("/gpu:0"):
        ws = [fm.Variable(rng.normal(size=(64, 64)).astype(np.float32))
              for _ in range(variables)]
        g = fm.placeholder(fm.float32, [64, 64])
        apply = OPTIMIZERS[optimizer]().apply_gradients([(g, w) for w in ws])
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(apply, [g])
        value = rng.normal(size=(64, 64)).astype(np.float32)
        step(value)
        standin.reset_counts()
        step(value)
        return standin.counts()["launches"]


# Launches of one apply, fused and unfused: one per variable (its ``ResourceApply*`` op
# updates the variable and every slot), plus, for Adam, what all variables share: the
# bias-corrected rate (one fused launch, five unfused) and the two beta powers.
SHARED = {"adam": (3, 7), "momentum": (0, 0), "rmsprop": (0, 0), "sgd": (0, 0)}


@pytest.mark.parametrize("optimizer", sorted(SHARED))
def test_an_update_is_one_launch_per_variable(standin_gpu, monkeypatch, optimizer):
    fused = [_launches(standin_gpu, optimizer, k) for k in (1, 3)]
    monkeypatch.setattr(fusion, "ENABLED", False)
    unfused = [_launches(standin_gpu, optimizer, k) for k in (1, 3)]
    assert fused[1] - fused[0] == unfused[1] - unfused[0] == 2  # one launch per variable
    assert (fused[0] - 1, unfused[0] - 1) == SHARED[optimizer]


def test_what_is_read_twice_fetched_or_on_the_cpu_is_not_fused(standin_gpu):
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [4])
        with fm.device("/gpu:0"):
            a = fm.exp(x)
            b = a * 2.0  # ``a`` has two readers: it stays a node of its own
            c = fm.sqrt(a) + b
            d = fm.tanh(c) * 3.0
        with fm.device("/cpu:0"):
            e = fm.exp(x) * 2.0  # on the CPU: never fused
    value = np.linspace(0.1, 1.0, 4).astype(np.float32)
    with fm.Session(graph) as sess:
        got_c, got_d, got_e = sess.run([c, d, e], {x: value})
        plan = sess.make_callable([c, d, e], [x]).plan
    np.testing.assert_allclose(got_c, np.sqrt(np.exp(value)) + 2 * np.exp(value), rtol=1e-6)
    np.testing.assert_allclose(got_d, np.tanh(got_c) * 3, rtol=1e-6)
    np.testing.assert_allclose(got_e, np.exp(value) * 2, rtol=1e-6)
    fused = [[t for t, _ in n.attrs["program"]] for n in plan.order
             if n.type == "_FusedElementwise"]
    # c is fetched, so d's tree stops at it; a's two readers keep it out of both trees.
    assert sorted(fused) == [["Sqrt", "Mul", "Add"], ["Tanh", "Mul"]]
    assert {n.type for n in plan.order if n.device.endswith("CPU:0")} >= {"Exp", "Mul"}


def test_a_variable_initialized_by_an_elementwise_tree_on_a_gpu(standin_gpu):
    graph = fm.Graph(seed=5)
    with graph.as_default(), fm.device("/gpu:0"):
        w = fm.Variable(fm.random_uniform([3, 4], seed=1) * 2.0 - 1.0)
    with fm.Session(graph) as sess:
        init = sess.make_callable(w.initializer)
        assert [n.attrs["how"] for n in init.plan.order if n.type == "_FusedAssign"] == ["set"]
        init()
        value = sess.run(w)
    assert value.shape == (3, 4) and value.dtype == np.float32
    assert -1.0 <= value.min() and value.max() <= 1.0 and len(np.unique(value)) == 12
