"""Queues in sessions: FIFO order, backpressure, batches, close, and an input pipeline.

Threads that are expected to block are observed through the queue's own count of waiting
callers, never through sleeps, so the tests do not depend on timing.
"""


import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.fifo_queue import (
    FIFOQueueState,
    OutOfRangeError,
    QueueArgumentError,
    QueueClosedError,
)
from flowmill.runtime.backprop import gradients
from flowmill.runtime.ops.data_flow_ops import FIFOQueue

from threads import Worker, wait_until


def queue_state(sess, q: FIFOQueue):
    return sess.resources.get(q.shared_name)


def waiting(sess, q, dequeues=0, enqueues=0):
    def check():
        state = queue_state(sess, q)
        return (
            state is not None
            and state.waiting_dequeues == dequeues
            and state.waiting_enqueues == enqueues
        )

    return check


@pytest.fixture
def graph():
    g = fm.Graph()
    with g.as_default():
        yield g


def scalar_queue(capacity, name="q"):
    q = FIFOQueue(capacity, [fm.float32], shapes=[()], name=name)
    value = fm.placeholder(fm.float32, (), name="value")
    return q, value, q.enqueue(value)


def test_fifo_order(graph):
    q, value, enqueue = scalar_queue(10)
    out = q.dequeue()
    assert out.shape == () and out.dtype == fm.float32
    with fm.Session(graph) as sess:
        for v in [3.0, 1.0, 4.0, 1.5, 9.0]:
            sess.run(enqueue, {value: v})
        assert sess.run(q.size()) == 5
        got = [float(sess.run(out)) for _ in range(5)]
    assert got == [3.0, 1.0, 4.0, 1.5, 9.0]


def test_multi_component_elements_keep_static_shapes(graph):
    q = FIFOQueue(4, [fm.float32, fm.int64], shapes=[(2, 3), ()])
    x, i = q.dequeue()
    xs, ids = q.dequeue_many(2)
    assert (x.shape, i.shape, xs.shape, ids.shape) == ((2, 3), (), (2, 2, 3), (2,))
    assert (xs.dtype, ids.dtype) == (fm.float32, fm.int64)
    n = fm.placeholder(fm.int32, ())
    assert q.dequeue_many(n)[0].shape == (None, 2, 3)


def test_enqueue_copies_its_values(graph):
    """A fed buffer reused by the caller must not change elements already queued."""
    q = FIFOQueue(4, [fm.float32], shapes=[(3,)])
    value = fm.placeholder(fm.float32, (3,))
    enqueue, out = q.enqueue(value), q.dequeue()
    buffer = np.zeros(3, np.float32)
    with fm.Session(graph) as sess:
        for k in range(3):
            buffer[:] = k
            sess.run(enqueue, {value: buffer})
        got = [sess.run(out) for _ in range(3)]
    for k, row in enumerate(got):
        np.testing.assert_array_equal(row, np.full(3, k, np.float32))


def test_capacity_backpressure(graph):
    q, value, enqueue = scalar_queue(2)
    out, size = q.dequeue(), q.size()
    with fm.Session(graph) as sess:
        sess.run(enqueue, {value: 1.0})
        sess.run(enqueue, {value: 2.0})
        producer = Worker(lambda: sess.run(enqueue, {value: 3.0}))
        producer.start()
        wait_until(waiting(sess, q, enqueues=1), "the producer waits for room")
        assert producer.is_alive()
        assert sess.run(size) == 2
        assert sess.run(out) == 1.0
        producer.finish()
        assert producer.error is None
        assert sess.run(size) == 2
        assert [sess.run(out), sess.run(out)] == [2.0, 3.0]


def test_dequeue_many_waits_for_n_and_stacks(graph):
    q = FIFOQueue(5, [fm.float32, fm.int32], shapes=[(2,), ()])
    x = fm.placeholder(fm.float32, (None, 2))
    i = fm.placeholder(fm.int32, (None,))
    enqueue = q.enqueue_many([x, i])
    batch = q.dequeue_many(3)
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    with fm.Session(graph) as sess:
        sess.run(enqueue, {x: rows[:1], i: [0]})
        consumer = Worker(lambda: sess.run(batch))
        consumer.start()
        wait_until(waiting(sess, q, dequeues=1), "the consumer waits for more elements")
        sess.run(enqueue, {x: rows[1:], i: [1, 2, 3]})
        consumer.finish()
        assert consumer.error is None
        xs, ids = consumer.result
        np.testing.assert_array_equal(xs, rows[:3])
        np.testing.assert_array_equal(ids, [0, 1, 2])
        assert sess.run(q.size()) == 1


def test_batches_larger_than_capacity_pass_through(graph):
    q = FIFOQueue(2, [fm.int32], shapes=[()])
    x = fm.placeholder(fm.int32, (None,))
    enqueue, batch = q.enqueue_many(x), q.dequeue_many(7)
    with fm.Session(graph) as sess:
        consumer = Worker(lambda: sess.run(batch))
        consumer.start()
        sess.run(enqueue, {x: np.arange(7, dtype=np.int32)})
        consumer.finish()
        assert consumer.error is None
        np.testing.assert_array_equal(consumer.result, np.arange(7))


def test_enqueue_many_is_not_interleaved():
    """Callers are served in arrival order: a waiting batch goes in whole before the next."""
    q = FIFOQueueState("q", ["int64"], [()], capacity=2)
    rows = [(np.array(k),) for k in range(6)]
    first = Worker(lambda: q.enqueue_many(rows))
    first.start()
    wait_until(lambda: q.waiting_enqueues == 1 and q.size() == 2, "the batch waits for room")
    second = Worker(lambda: q.enqueue((np.array(100),)))
    second.start()
    wait_until(lambda: q.waiting_enqueues == 2, "the single enqueue waits behind it")
    got = [int(e[0]) for e in q.dequeue_many(7)]
    first.finish(), second.finish()
    assert got == [0, 1, 2, 3, 4, 5, 100]


def test_close_drains_then_raises_out_of_range(graph):
    q, value, enqueue = scalar_queue(5)
    out, batch, close = q.dequeue(), q.dequeue_many(3), q.close()
    with fm.Session(graph) as sess:
        for v in (1.0, 2.0):
            sess.run(enqueue, {value: v})
        sess.run(close)
        with pytest.raises(QueueClosedError, match="queue 'q' is closed"):
            sess.run(enqueue, {value: 3.0})
        with pytest.raises(OutOfRangeError, match="'q' is closed and has 2 elements, 3 requested"):
            sess.run(batch)
        # A failed batch takes nothing: both elements are still there, in order.
        assert [sess.run(out), sess.run(out)] == [1.0, 2.0]
        with pytest.raises(OutOfRangeError, match="closed and has 0 elements, 1 requested"):
            sess.run(out)


def test_blocked_dequeue_wakes_on_close(graph):
    q, _, _ = scalar_queue(5)
    out, close = q.dequeue(), q.close()
    with fm.Session(graph) as sess:
        consumer = Worker(lambda: sess.run(out))
        consumer.start()
        wait_until(waiting(sess, q, dequeues=1), "the consumer waits on the empty queue")
        sess.run(close)
        consumer.finish()
        assert isinstance(consumer.error, OutOfRangeError)


@pytest.mark.parametrize("cancel", [False, True])
def test_close_and_pending_enqueues(graph, cancel):
    q, value, enqueue = scalar_queue(1)
    out, close = q.dequeue(), q.close(cancel_pending_enqueues=cancel)
    with fm.Session(graph) as sess:
        sess.run(enqueue, {value: 1.0})
        producer = Worker(lambda: sess.run(enqueue, {value: 2.0}))
        producer.start()
        wait_until(waiting(sess, q, enqueues=1), "the producer waits for room")
        sess.run(close)
        if cancel:
            producer.finish()
            assert isinstance(producer.error, QueueClosedError)
            assert "cancelled" in str(producer.error)
            assert sess.run(out) == 1.0
        else:
            # A pending enqueue survives a plain close and completes once there is room.
            assert sess.run(out) == 1.0
            producer.finish()
            assert producer.error is None
            assert sess.run(out) == 2.0
        with pytest.raises(OutOfRangeError):
            sess.run(out)


def test_closing_the_session_wakes_blocked_callers(graph):
    q, value, enqueue = scalar_queue(1)
    out = q.dequeue()
    other = FIFOQueue(1, [fm.float32], shapes=[()], name="other")
    other_out = other.dequeue()
    sess = fm.Session(graph)
    sess.run(enqueue, {value: 1.0})
    producer = Worker(lambda: sess.run(enqueue, {value: 2.0}))
    consumer = Worker(lambda: sess.run(other_out))
    producer.start()
    consumer.start()
    wait_until(waiting(sess, q, enqueues=1), "the producer waits for room")
    wait_until(waiting(sess, other, dequeues=1), "the consumer waits for an element")
    sess.close()
    producer.finish(), consumer.finish()
    assert isinstance(producer.error, QueueClosedError)
    assert isinstance(consumer.error, OutOfRangeError)
    with pytest.raises(fm.SessionClosedError):
        sess.run(out)


def test_enqueue_errors_name_queue_component_and_shapes(graph):
    q = FIFOQueue(3, [fm.float32, fm.int32], shapes=[(2,), ()], name="inputs")
    shape_error = r"'inputs' component 0 has shape \(2,?\), value has shape \(3,?\)"
    with pytest.raises(fm.GraphError, match=shape_error):
        q.enqueue([np.zeros(3, np.float32), 1])
    wrong = fm.placeholder(fm.int64, ())
    dtype_error = "'inputs' component 1 has dtype int32, value has int64"
    with pytest.raises(fm.GraphError, match=dtype_error):
        q.enqueue([np.zeros(2, np.float32), wrong])
    with pytest.raises(fm.ShapeError, match="queue 'inputs' has 2 components, got 3 values"):
        q.enqueue([1.0, 2, 3])
    rows = fm.placeholder(fm.float32, (4, 2))
    with pytest.raises(fm.GraphError, match="differ in batch size"):
        q.enqueue_many([rows, np.zeros(3, np.int32)])
    # An unknown static shape is checked when the step runs.
    loose = fm.placeholder(fm.float32, None)
    enqueue = q.enqueue([loose, 1])
    with fm.Session(graph) as sess:
        run_error = r"'inputs' component 0 has shape \(2,?\), value has shape \(2, 2\)"
        with pytest.raises(QueueArgumentError, match=run_error):
            sess.run(enqueue, {loose: np.zeros((2, 2), np.float32)})
        assert sess.run(q.size()) == 0


def test_shared_name_shares_state_and_checks_spec(graph):
    a = FIFOQueue(3, [fm.float32], shapes=[()], shared_name="shared")
    b = FIFOQueue(3, [fm.float32], shapes=[()], shared_name="shared")
    c = FIFOQueue(4, [fm.float32], shapes=[()], shared_name="shared")
    with fm.Session(graph) as sess:
        sess.run(a.enqueue(5.0))
        assert sess.run(b.dequeue()) == 5.0
        with pytest.raises(QueueArgumentError, match="queue 'shared' already exists"):
            sess.run(c.size())


def test_input_pipeline_feeds_training(graph):
    """A producer thread fills the queue with batches while training steps dequeue them."""
    n_batches, batch_size, capacity = 30, 16, 24
    data_rng = np.random.default_rng(0)
    true_w = np.array([[1.5], [-2.0], [0.5]], np.float32)
    xs = data_rng.normal(size=(n_batches, batch_size, 3)).astype(np.float32)
    ys = (xs @ true_w + 0.3 + 0.01 * data_rng.normal(size=(n_batches, batch_size, 1)))
    ys = ys.astype(np.float32)
    ids = np.arange(n_batches * batch_size, dtype=np.int64).reshape(n_batches, batch_size)

    q = FIFOQueue(capacity, [fm.float32, fm.float32, fm.int64], shapes=[(3,), (1,), ()])
    x_in = fm.placeholder(fm.float32, (None, 3))
    y_in = fm.placeholder(fm.float32, (None, 1))
    id_in = fm.placeholder(fm.int64, (None,))
    enqueue, close = q.enqueue_many([x_in, y_in, id_in]), q.close()

    x, y, row_ids = q.dequeue_many(batch_size)
    w = fm.Variable(np.zeros((3, 1), np.float32), name="w")
    b = fm.Variable(np.zeros((1,), np.float32), name="b")
    loss = fm.reduce_mean(fm.square(fm.matmul(x, w) + b - y))
    grad_w, grad_b = gradients(loss, [w, b])
    lr = 0.1
    train = fm.group(w.assign_sub(lr * grad_w), b.assign_sub(lr * grad_b))

    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())

        def produce():
            for k in range(n_batches):
                sess.run(enqueue, {x_in: xs[k], y_in: ys[k], id_in: ids[k]})
            sess.run(close)

        producer = Worker(produce)
        producer.start()
        losses, consumed = [], []
        while True:
            try:
                value, batch_ids, _ = sess.run([loss, row_ids, train])
            except OutOfRangeError:
                break
            losses.append(float(value))
            consumed.append(batch_ids)
        producer.finish()
        assert producer.error is None

    assert len(consumed) == n_batches
    # One producer, one consumer: batches come out whole, in order, each exactly once.
    for k, batch_ids in enumerate(consumed):
        np.testing.assert_array_equal(batch_ids, ids[k])
    assert losses[-1] < 0.1 * losses[0]
