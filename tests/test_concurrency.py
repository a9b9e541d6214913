"""Steps of one session run concurrently, each in its caller's thread.

State updates must not be lost, plans compiled from several threads at once must be
right, and a step blocked on a queue must not hold up other threads' steps.
"""

import threading
import time

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.fifo_queue import OutOfRangeError
from flowmill.runtime.ops.data_flow_ops import FIFOQueue

from threads import JOIN_TIMEOUT, Worker


def run_all(workers):
    for w in workers:
        w.start()
    return [w.value() for w in workers]


@pytest.fixture
def graph():
    g = fm.Graph()
    with g.as_default():
        yield g


def test_concurrent_assign_add_loses_no_update(graph):
    counter = fm.Variable(np.float32(0.0), name="counter")
    increment = counter.assign_add(1.0).op
    per_thread = 10_000
    with fm.Session(graph) as sess:
        sess.run(counter.initializer)
        start = threading.Barrier(2, timeout=JOIN_TIMEOUT)

        def work():
            start.wait()
            for _ in range(per_thread):
                sess.run(increment)

        run_all([Worker(work), Worker(work)])
        assert sess.run(counter) == 2 * per_thread


def test_concurrent_runs_of_different_signatures(graph):
    """Each thread compiles its own step at the same moment, then runs it many times."""
    a = fm.placeholder(fm.float32, (3,), name="a")
    b = fm.placeholder(fm.float32, (3,), name="b")
    total = a + b
    fetches = [
        (total, lambda x, y: x + y),
        ([total, a * b], lambda x, y: [x + y, x * y]),
        ({"d": a - b, "s": fm.reduce_sum(total)}, lambda x, y: {"d": x - y, "s": (x + y).sum()}),
        ((fm.maximum(a, b), fm.square(a)), lambda x, y: (np.maximum(x, y), x * x)),
        (fm.reduce_max(a) * b - fm.reduce_min(b), lambda x, y: x.max() * y - y.min()),
        (fm.exp(a) / (1.0 + fm.exp(b)), lambda x, y: np.exp(x) / (1 + np.exp(y))),
    ]
    start = threading.Barrier(len(fetches), timeout=JOIN_TIMEOUT)

    with fm.Session(graph) as sess:

        def work(k):
            fetch, reference = fetches[k]
            rng = np.random.default_rng(k)
            start.wait()
            for _ in range(200):
                x = rng.normal(size=3).astype(np.float32)
                y = rng.normal(size=3).astype(np.float32)
                got, want = sess.run(fetch, {a: x, b: y}), reference(x, y)
                if isinstance(want, dict):
                    assert got.keys() == want.keys()
                    keys = sorted(got)
                    got, want = [got[key] for key in keys], [want[key] for key in keys]
                if isinstance(want, (list, tuple)):
                    assert type(got) is type(want) and len(got) == len(want)
                    for g, w in zip(got, want, strict=True):
                        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            return k

        indices = list(range(len(fetches)))
        assert run_all([Worker(work, k) for k in indices]) == indices


def test_blocked_dequeue_does_not_stop_other_steps(graph):
    q = FIFOQueue(4, [fm.float32], shapes=[()])
    value = fm.placeholder(fm.float32, ())
    enqueue, out, size = q.enqueue(value), q.dequeue(), q.size()
    counter = fm.Variable(np.int64(0), name="steps")
    increment = counter.assign_add(np.int64(1)).op
    with fm.Session(graph) as sess:
        sess.run(counter.initializer)
        consumer = Worker(lambda: sess.run(out))
        consumer.start()
        deadline = time.monotonic() + JOIN_TIMEOUT
        while getattr(sess.resources.get(q.shared_name), "waiting_dequeues", 0) != 1:
            assert time.monotonic() < deadline, "the consumer never started waiting"
            time.sleep(0.001)
        # The consumer's step is blocked inside its kernel; this thread's steps still run.
        for _ in range(100):
            sess.run(increment)
        assert sess.run(counter) == 100
        assert sess.run(size) == 0
        assert consumer.is_alive()
        sess.run(enqueue, {value: 42.0})
        assert consumer.value() == 42.0


def test_many_producers_and_consumers(graph):
    """Every value enqueued by any producer is dequeued exactly once by some consumer."""
    n_producers, n_consumers, per_producer = 3, 3, 300
    q = FIFOQueue(8, [fm.int64], shapes=[()])
    value = fm.placeholder(fm.int64, ())
    enqueue, out, close = q.enqueue(value), q.dequeue(), q.close()
    with fm.Session(graph) as sess:

        def produce(p):
            for i in range(per_producer):
                sess.run(enqueue, {value: p * 100_000 + i})

        def consume():
            got = []
            while True:
                try:
                    got.append(int(sess.run(out)))
                except OutOfRangeError:
                    return got

        consumers = [Worker(consume) for _ in range(n_consumers)]
        for c in consumers:
            c.start()
        run_all([Worker(produce, p) for p in range(n_producers)])
        sess.run(close)
        results = [c.value() for c in consumers]

    everything = sorted(v for got in results for v in got)
    produced = [p * 100_000 + i for p in range(n_producers) for i in range(per_producer)]
    assert everything == produced
    # FIFO: each consumer sees every producer's values in the order they were produced.
    for got in results:
        for p in range(n_producers):
            mine = [v for v in got if v // 100_000 == p]
            assert mine == sorted(mine)
