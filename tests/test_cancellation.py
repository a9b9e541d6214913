"""Steps that end while a kernel waits on state: the waiter wakes with CancelledError and
leaves the state as it found it, so a client's next incarnation gets what it waits for."""

from __future__ import annotations

import numpy as np
import pytest

from flowmill.kernels.cancellation import Cancellation, CancelledError
from flowmill.kernels.conditional_accumulator import (
    ConditionalAccumulatorState,
    StalenessClockState,
)
from flowmill.kernels.fifo_queue import FIFOQueueState

from threads import Worker, wait_until


def test_a_cancelled_dequeue_leaves_the_next_element_to_the_next_dequeue():
    queue = FIFOQueueState("tokens", [np.int64], [()])
    step = Cancellation("step 7")
    zombie = Worker(lambda: queue.dequeue(step))
    zombie.start()
    wait_until(lambda: queue.waiting_dequeues == 1, "the dequeue to wait")
    step.cancel(RuntimeError("its client restarted"))
    zombie.finish()
    assert isinstance(zombie.error, CancelledError)
    assert "step 7 was cancelled while dequeuing from queue 'tokens'" in str(zombie.error)
    assert "its client restarted" in str(zombie.error)
    queue.enqueue((np.int64(41),))
    assert queue.dequeue()[0] == 41 and queue.waiting_dequeues == 0


def test_a_cancelled_take_leaves_the_gradients_to_the_next_take():
    acc = ConditionalAccumulatorState("w/grad", np.float32, (2,))
    step = Cancellation("step 8")
    zombie = Worker(lambda: acc.take(2, step))
    zombie.start()
    wait_until(lambda: acc.waiting_takes == 1, "the take to wait")
    step.cancel(RuntimeError("gone"))
    zombie.finish()
    assert isinstance(zombie.error, CancelledError) and acc.waiting_takes == 0
    acc.apply(0, np.ones(2, np.float32))
    acc.apply(0, np.full(2, 3.0, np.float32))
    count, total = acc.take(2)
    assert count == 2
    np.testing.assert_array_equal(total, [4.0, 4.0])


def test_a_cancelled_staleness_wait_wakes():
    clock = StalenessClockState("clock", 2, staleness=0)
    step = Cancellation("step 9")
    clock.advance(0)
    waiter = Worker(lambda: clock.wait(0, 1, step))
    waiter.start()
    wait_until(lambda: clock.waiting == 1, "worker 0 to wait for worker 1")
    step.cancel(RuntimeError("gone"))
    waiter.finish()
    assert isinstance(waiter.error, CancelledError)


def test_a_step_cancelled_before_the_wait_never_blocks():
    queue = FIFOQueueState("tokens", [np.int64], [()])
    step = Cancellation("step 10")
    step.cancel(RuntimeError("ended"))
    with pytest.raises(CancelledError, match="step 10 was cancelled"):
        queue.dequeue(step)
