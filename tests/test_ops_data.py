import numpy as np

import flowmill.runtime as fm
from flowmill.runtime.ops.data_flow_ops import FIFOQueue

from opcheck import OpCase, case_tests

rng = np.random.default_rng(3)


def r(*shape):
    return rng.uniform(-2.0, 2.0, size=shape).astype(np.float32)


def _queue_for(*tensors, capacity=8) -> FIFOQueue:
    return FIFOQueue(capacity, [t.dtype for t in tensors], shapes=[t.shape for t in tensors])


def _row_queue_for(*tensors, capacity=8) -> FIFOQueue:
    return FIFOQueue(capacity, [t.dtype for t in tensors], shapes=[t.shape[1:] for t in tensors])


def enqueue_dequeue(a, b):
    q = _queue_for(a, b)
    with fm.control_dependencies([q.enqueue([a, b])]):
        return q.dequeue()


def enqueue_dequeue_twice(a):
    """Two elements come out in the order they went in."""
    q = _queue_for(a)
    first = q.enqueue(a)
    with fm.control_dependencies([first]):
        second = q.enqueue(a * 2.0)
    with fm.control_dependencies([second]):
        x = q.dequeue()
    with fm.control_dependencies([x]):
        y = q.dequeue()
    return [x, y]


def enqueue_many_dequeue_many(x, ids):
    q = _row_queue_for(x, ids)
    with fm.control_dependencies([q.enqueue_many([x, ids])]):
        return q.dequeue_many(3)


def enqueue_many_dequeue_rows(x):
    """Rows enqueued as a batch come out one by one, then as a batch given by a tensor n."""
    q = _row_queue_for(x)
    with fm.control_dependencies([q.enqueue_many(x)]):
        row = q.dequeue()
    with fm.control_dependencies([row]):
        rest = q.dequeue_many(fm.constant(3))
    return [row, rest]


def size_after_enqueue_many(x):
    q = _row_queue_for(x)
    with fm.control_dependencies([q.enqueue_many(x)]):
        return q.size()


def close_then_drain(x):
    """A closed queue refuses enqueues but still hands out what it holds."""
    q = _row_queue_for(x)
    with fm.control_dependencies([q.enqueue_many(x)]):
        close = q.close()
    with fm.control_dependencies([close]):
        size = q.size()
    with fm.control_dependencies([size]):
        batch = q.dequeue_many(4)
    return [size, batch]


CASES = [
    OpCase("queue_enqueue_dequeue", enqueue_dequeue, [r(2, 3), np.array(7, np.int64)],
           lambda a, b: [a, b], grad=False),
    OpCase("queue_fifo_order", enqueue_dequeue_twice, [r(4)], lambda a: [a, a * 2], grad=False),
    OpCase("queue_enqueue_many_dequeue_many", enqueue_many_dequeue_many,
           [r(3, 2), np.array([4, 5, 6], np.int32)], lambda x, ids: [x, ids], grad=False),
    OpCase("queue_dequeue_rows", enqueue_many_dequeue_rows, [r(4, 2)],
           lambda x: [x[0], x[1:]], grad=False),
    OpCase("queue_size", size_after_enqueue_many, [r(5, 1)], lambda x: np.int32(5), grad=False),
    OpCase("queue_close_drain", close_then_drain, [r(4, 3)],
           lambda x: [np.int32(4), x], grad=False),
]


test_forward, test_gradient = case_tests(CASES)
