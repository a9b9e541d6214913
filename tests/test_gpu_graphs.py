"""CUDA graph replay (``Session(cuda_graphs=True)``) on the strict stand-in, whose streams
capture as CUDA's do: nothing runs during a capture, a launch reruns the captured calls
on the very buffers they were given, and a copy or a host synchronization during a
capture raises."""

from __future__ import annotations

import logging

import numpy as np

import flowmill.runtime as fm
from flowmill.runtime.ops.unique_ops import unique


def _mlp(device: str = "/gpu:0", optimizer=lambda: fm.train.AdamOptimizer(0.01),
         printing: bool = False):
    """A small MLP on ``device``; with ``printing`` its hidden layer is printed, so its
    value goes to the host mid-step."""
    rng = np.random.default_rng(0)
    graph = fm.Graph(seed=2)
    with graph.as_default(), fm.device(device):
        x = fm.placeholder(fm.float32, [None, 6], name="x")
        y = fm.placeholder(fm.int64, [None], name="y")
        w1 = fm.Variable(rng.normal(size=(6, 16)).astype(np.float32), name="w1")
        w2 = fm.Variable(rng.normal(size=(16, 3)).astype(np.float32), name="w2")
        h = fm.nn.relu(fm.matmul(x, w1))
        if printing:
            h = fm.print(h, summarize=1, message="hidden: ")
        loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=fm.matmul(h, w2)))
        train = optimizer().minimize(loss)
    batches = [(rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8))
               for _ in range(6)]
    return graph, (x, y, w1, w2, loss, train), batches


def _losses(cuda_graphs: bool, steps: int = 6, printing: bool = False):
    graph, (x, y, w1, w2, loss, train), batches = _mlp(printing=printing)
    with fm.Session(graph, cuda_graphs=cuda_graphs) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(loss, [x, y], targets=[train])
        losses = [float(step(*batches[i % len(batches)])) for i in range(steps)]
        return losses, sess.run([w1, w2]), step


def test_a_replayed_step_trains_as_the_eager_one(standin_gpu):
    replayed, weights, step = _losses(True)
    eager, eager_weights, _ = _losses(False)
    np.testing.assert_allclose(replayed, eager, rtol=1e-6)
    for a, b in zip(weights, eager_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert type(step.plan).__name__ == "GraphedPlan"


def test_after_its_capture_a_step_is_one_launch(standin_gpu):
    graph, (x, y, w1, w2, loss, train), batches = _mlp()
    with fm.Session(graph, cuda_graphs=True) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(loss, [x, y], targets=[train])
        step(*batches[0])  # an ordinary step
        step(*batches[1])  # the step to be captured, in the graph's own pool
        step(*batches[2])  # captured, launched
        standin_gpu.reset_counts()
        step(*batches[3])
        counts = standin_gpu.counts()
    assert counts["launches"] == 1
    assert counts["h2d"] == 2 and counts["d2h"] == 1 and counts["syncs"] == 0


def test_a_fetched_variable_is_its_value_before_the_steps_update(standin_gpu):
    """The graph updates the variable in its own buffer; the fetch is a snapshot taken on
    the device where the read happens, as copy-on-write gives an eager step."""
    def run(cuda_graphs):
        graph, (x, y, w1, w2, loss, train), batches = _mlp(
            optimizer=lambda: fm.train.GradientDescentOptimizer(0.5))
        with fm.Session(graph, cuda_graphs=cuda_graphs) as sess:
            sess.run(fm.global_variables_initializer())
            step = sess.make_callable([w2, loss], [x, y], targets=[train])
            return [step(*batches[i])[0] for i in range(4)]

    for replayed, eager in zip(run(True), run(False), strict=True):
        np.testing.assert_allclose(replayed, eager, rtol=1e-6)


def test_an_eager_update_between_launches_is_seen_by_the_graph(standin_gpu):
    """A variable a graph uses stays in its buffer: another step's update writes there."""
    graph, (x, y, w1, w2, loss, train), batches = _mlp()
    with graph.as_default(), fm.device("/gpu:0"):
        shrink = w2.assign(w2.read_value() * 0.5)
    with fm.Session(graph, cuda_graphs=True) as sess:
        sess.run(fm.global_variables_initializer())
        forward = sess.make_callable(loss, [x, y])
        for _ in range(4):
            before = forward(*batches[0])
        sess.run(shrink)
        after = forward(*batches[0])
        expected = sess.run(loss, {x: batches[0][0], y: batches[0][1]})
    assert after != before
    np.testing.assert_allclose(after, expected, rtol=1e-6)


def test_each_feed_shape_gets_its_own_graph(standin_gpu):
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        x = fm.placeholder(fm.float32, [None])
        y = fm.reduce_sum(fm.tanh(x) * 2.0)
    with fm.Session(graph, cuda_graphs=True) as sess:
        f = sess.make_callable(y, [x])
        for n in (3, 5, 3, 5, 3, 5):
            value = np.linspace(-1, 1, n).astype(np.float32)
            np.testing.assert_allclose(f(value), np.sum(np.tanh(value) * 2), rtol=1e-6)
        assert len([r for r in f.plan.replays.values() if r not in ("warm", "eager")]) == 2


def test_a_step_with_host_variables_captures_its_gpu_work_and_says_what_stays_out(
        standin_gpu, caplog):
    """Variables on the host: their values go up to the GPU and the gradients come back,
    as a worker's do with its PS; the GPU work between is captured."""
    def run(cuda_graphs):
        graph, (x, y, w1, w2, loss, train), batches = _mlp(device="")  # variables on the CPU
        with fm.Session(graph, cuda_graphs=cuda_graphs) as sess:
            sess.run(fm.global_variables_initializer())
            step = sess.make_callable(loss, [x, y], targets=[train])
            return [float(step(*b)) for b in batches[:4]], step

    with caplog.at_level(logging.INFO, logger="flowmill.cuda_graphs"):
        losses, step = run(True)
    np.testing.assert_allclose(losses, run(False)[0], rtol=1e-6)
    assert type(step.plan).__name__ == "GraphedPlan"
    assert [r.graph is not None for r in step.plan.replays.values()] == [True]
    assert any("runs on the host and depends on a feed or on state" in r.getMessage()
               for r in caplog.records)


def test_a_capture_that_fails_leaves_the_step_eager(standin_gpu, caplog):
    """``unique``'s size is read back to the host: no capture can hold it."""
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        x = fm.placeholder(fm.int64, [6])
        values, _ = unique(x * 2)
        total = fm.reduce_sum(values)
    with caplog.at_level(logging.WARNING, logger="flowmill.cuda_graphs"), \
            fm.Session(graph, cuda_graphs=True) as sess:
        f = sess.make_callable(total, [x])
        got = [f(np.array([1, 1, 2, 3, 3, i])) for i in range(4)]
    assert [int(g) for g in got] == [2 * (1 + 2 + 3), 2 * (0 + 1 + 2 + 3), 12, 12]
    assert any("capture as a CUDA graph failed" in r.getMessage() for r in caplog.records)
