"""Accumulator and staleness-clock ops: forward cases, then the blocking and closing rules.

Threads that are expected to block are observed through the state's own count of waiters,
never through sleeps, so the tests do not depend on timing.
"""


import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.conditional_accumulator import (
    AccumulatorArgumentError,
    AccumulatorClosedError,
    ConditionalAccumulatorState,
    SparseConditionalAccumulatorState,
    StalenessClockClosedError,
    StalenessClockState,
)
from flowmill.runtime.ops.accumulator_ops import (
    ConditionalAccumulator,
    SparseConditionalAccumulator,
    StalenessClock,
)

from opcheck import OpCase, case_tests
from threads import Worker, wait_until

rng = np.random.default_rng(5)


def r(*shape):
    return rng.uniform(-2.0, 2.0, size=shape).astype(np.float32)


# ---- forward cases


def take_average(g1, g2, step):
    """Two gradients of the current step are averaged; the take leaves nothing behind."""
    acc = ConditionalAccumulator(g1.dtype, g1.shape)
    a = acc.apply_grad(g1, step)
    b = acc.apply_grad(g2, step)
    with fm.control_dependencies([a, b]):
        avg = acc.take_grad(2)
    with fm.control_dependencies([avg]):
        left = acc.num_accumulated()
    return [avg, left]


def drop_stale(g1, g2):
    """After set_global_step(3), a gradient of step 2 is dropped and one of step 3 kept."""
    acc = ConditionalAccumulator(g1.dtype, g1.shape)
    set_step = acc.set_global_step(3)
    with fm.control_dependencies([set_step]):
        stale = acc.apply_grad(g1, 2)
    with fm.control_dependencies([stale]):
        fresh = acc.apply_grad(g2, 3)
    with fm.control_dependencies([fresh]):
        counts = [acc.num_accumulated(), acc.num_dropped()]
    with fm.control_dependencies(counts):
        avg = acc.take_grad(1)
    return [*counts, avg]


def reset_drops_what_is_held(g1, g2):
    """A reset (a sync chief rejoining) drops what is held and moves to the given step."""
    acc = ConditionalAccumulator(g1.dtype, g1.shape)
    held = acc.apply_grad(g1, 0)
    with fm.control_dependencies([held]):
        reset = acc.reset(5)
    with fm.control_dependencies([reset]):
        stale = acc.apply_grad(g1, 4)
    with fm.control_dependencies([stale]):
        fresh = acc.apply_grad(g2, 5)
    with fm.control_dependencies([fresh]):
        counts = [acc.num_accumulated(), acc.num_dropped()]
    with fm.control_dependencies(counts):
        avg = acc.take_grad(1)
    return [*counts, avg]


def take_advances_step(g1, g2):
    """A take moves the accumulator to the next step: a late gradient of the old one drops."""
    acc = ConditionalAccumulator(g1.dtype, None)
    first = acc.apply_grad(g1, 0)
    with fm.control_dependencies([first]):
        taken = acc.take_grad(1)
    with fm.control_dependencies([taken]):
        late = acc.apply_grad(g2, 0)
    with fm.control_dependencies([late]):
        on_time = acc.apply_grad(g2 * 2.0, 1)
    with fm.control_dependencies([on_time]):
        second = acc.take_grad(fm.constant(1))
    with fm.control_dependencies([second]):
        dropped = acc.num_dropped()
    return [taken, second, dropped]


def one_gradient_per_worker(g1, g2):
    """Worker 1 sends twice for step 0 (restarted, it computed the step again): the second
    is a duplicate and dropped; wait_ready returns once two workers' are in, taking none;
    the accumulator's step moves with the take."""
    acc = ConditionalAccumulator(g1.dtype, g1.shape)
    a = acc.apply_grad(g1, 0, worker=1)
    with fm.control_dependencies([a]):
        again = acc.apply_grad(g1 * 3.0, 0, worker=1)
    with fm.control_dependencies([again]):
        b = acc.apply_grad(g2, 0, worker=0)
    with fm.control_dependencies([b]):
        ready = acc.wait_ready(2)
    with fm.control_dependencies([ready]):
        held = acc.num_accumulated()
    with fm.control_dependencies([held]):
        avg = acc.take_grad(2)
    with fm.control_dependencies([avg]):
        step = acc.step()
    return [ready, held, avg, step]


def sparse_take(i1, v1, i2, v2):
    acc = SparseConditionalAccumulator(v1.dtype, (6, 2))
    a = acc.apply_grad(i1, v1, 0)
    b = acc.apply_grad(i2, v2, 0)
    with fm.control_dependencies([a, b]):
        indices, values = acc.take_grad(2)
    return [indices, values]


def sparse_reference(i1, v1, i2, v2):
    rows = np.unique(np.concatenate([i1, i2]))
    dense = np.zeros((6, 2), np.float32)
    np.add.at(dense, i1, v1)
    np.add.at(dense, i2, v2)
    return [rows.astype(np.int64), dense[rows] / 2]


def sparse_drop_and_count(i1, v1):
    """The sparse accumulator keeps steps and counts like the dense one."""
    acc = SparseConditionalAccumulator(v1.dtype, (None, 2))
    set_step = acc.set_global_step(1)
    with fm.control_dependencies([set_step]):
        stale = acc.apply_grad(i1, v1, 0)
    with fm.control_dependencies([stale]):
        kept = acc.apply_indexed_slices_grad(fm.IndexedSlices(v1, i1, (None, 2)), 1)
    with fm.control_dependencies([kept]):
        counts = [acc.num_accumulated(), acc.num_dropped()]
    with fm.control_dependencies(counts):
        grad = acc.take_indexed_slices_grad(1)
    return [*counts, grad.indices, grad.values]


def clock_advance_wait_read(worker):
    """Worker 0 finishes a step; with staleness 1 it may start step 1 though worker 1 has
    finished none; the clocks read [1, 0]."""
    clock = StalenessClock(2, 1)
    done = clock.advance(worker)
    slowest = clock.wait(worker, done)
    with fm.control_dependencies([slowest]):
        clocks = clock.read()
    return [done, slowest, clocks]


CASES = [
    OpCase("accumulator_take_average", take_average,
           [r(2, 3), r(2, 3), np.array(0, np.int64)],
           lambda a, b, s: [(a + b) / 2, np.int32(0)], grad=False),
    OpCase("accumulator_drop_stale", drop_stale, [r(4), r(4)],
           lambda a, b: [np.int32(1), np.int64(1), b], grad=False),
    OpCase("accumulator_reset", reset_drops_what_is_held, [r(4), r(4)],
           lambda a, b: [np.int32(1), np.int64(2), b], grad=False),
    OpCase("accumulator_one_gradient_per_worker", one_gradient_per_worker, [r(3), r(3)],
           lambda a, b: [np.int64(0), np.int32(2), (a + b) / 2, np.int64(1)], grad=False),
    OpCase("accumulator_take_advances_step", take_advances_step, [r(3, 1), r(3, 1)],
           lambda a, b: [a, b * 2, np.int64(1)], grad=False),
    OpCase("sparse_accumulator_take", sparse_take,
           [np.array([4, 0, 4], np.int64), r(3, 2), np.array([1, 0], np.int32), r(2, 2)],
           sparse_reference, grad=False),
    OpCase("sparse_accumulator_drop_and_count", sparse_drop_and_count,
           [np.array([3, 1, 3], np.int64), r(3, 2)],
           lambda i, v: [np.int32(1), np.int64(1), np.array([1, 3]),
                         np.stack([v[1], v[0] + v[2]])], grad=False),
    OpCase("staleness_clock", clock_advance_wait_read, [np.array(0, np.int32)],
           lambda w: [np.int64(1), np.int64(0), np.array([1, 0], np.int64)], grad=False),
]


test_forward, test_gradient = case_tests(CASES)


# ---- blocking, closing and errors, on the state objects and through sessions


def test_take_waits_for_enough_gradients_and_gets_exactly_the_first():
    """A waiting take is served by the gradient that completes its count; the next
    gradient of that step is already stale (a backup worker's)."""
    acc = ConditionalAccumulatorState("acc", np.float64, (2,))
    taker = Worker(lambda: acc.take(2))
    taker.start()
    wait_until(lambda: acc.waiting_takes == 1, "the take waits")
    assert acc.apply(0, np.array([1.0, 2.0]))
    assert taker.is_alive() and acc.num_accumulated() == 1
    assert acc.apply(0, np.array([3.0, 4.0]))
    assert not acc.apply(0, np.array([100.0, 100.0]))  # third of the step: too late
    taker.finish()
    assert taker.error is None
    count, total = taker.result
    assert count == 2
    np.testing.assert_array_equal(total, [4.0, 6.0])  # the kernel divides by count
    assert (acc.global_step, acc.num_accumulated(), acc.num_dropped()) == (1, 0, 1)


def test_wait_ready_takes_nothing_and_a_cancelled_one_leaves_everything():
    from flowmill.kernels.cancellation import Cancellation, CancelledError

    acc = ConditionalAccumulatorState("a", np.float32, (2,))
    acc.apply(0, np.ones(2, np.float32), worker=0)
    cancellation = Cancellation()
    waiter = Worker(acc.wait_ready, 2, cancellation)
    waiter.start()
    wait_until(lambda: acc.waiting_ready == 1, "the wait for two gradients")
    cancellation.cancel(RuntimeError("the chief restarted"))
    waiter.finish()
    assert isinstance(waiter.error, CancelledError) and acc.waiting_ready == 0
    assert acc.num_accumulated() == 1  # what was in stays for the next chief
    again = Worker(acc.wait_ready, 2)
    again.start()
    wait_until(lambda: acc.waiting_ready == 1, "a second wait")
    assert acc.apply(0, np.ones(2, np.float32), worker=0) is False  # a duplicate
    assert acc.num_duplicates() == 1 and acc.waiting_ready == 1
    acc.apply(0, np.full(2, 3.0, np.float32), worker=1)
    again.finish()
    assert again.error is None and again.result == 0
    count, total = acc.take(2)
    assert count == 2 and total.tolist() == [4.0, 4.0]


def test_late_take_averages_everything_accumulated():
    acc = ConditionalAccumulatorState("acc", np.float32, None)
    for k in range(3):
        acc.apply(0, np.full((2, 2), k, np.float32))
    count, total = acc.take(2)
    assert count == 3
    np.testing.assert_array_equal(total, np.full((2, 2), 3.0, np.float32))
    assert acc.shape == (2, 2)  # fixed by the first gradient


def test_apply_copies_the_first_gradient():
    acc = ConditionalAccumulatorState("acc", np.float64, (3,))
    g = np.ones(3)
    acc.apply(0, g)
    acc.apply(0, g)
    np.testing.assert_array_equal(g, np.ones(3))
    np.testing.assert_array_equal(acc.take(1)[1], np.full(3, 2.0))


def test_takes_are_served_in_order():
    acc = ConditionalAccumulatorState("acc", np.float64, ())
    first = Worker(lambda: acc.take(1))
    first.start()
    wait_until(lambda: acc.waiting_takes == 1, "the first take waits")
    second = Worker(lambda: acc.take(1))
    second.start()
    wait_until(lambda: acc.waiting_takes == 2, "the second take waits")
    acc.apply(0, np.array(1.0))
    first.finish()
    assert acc.waiting_takes == 1 and second.is_alive()
    acc.apply(0, np.array(5.0))  # step 0 is past now: dropped
    acc.apply(1, np.array(7.0))
    second.finish()
    assert float(first.result[1]) == 1.0 and float(second.result[1]) == 7.0
    assert acc.num_dropped() == 1


def test_sparse_state_checks_rows_and_copies():
    acc = SparseConditionalAccumulatorState("emb", np.float32, (4, 2))
    with pytest.raises(AccumulatorArgumentError, match="index 4 is out of range for 4 rows"):
        acc.apply(0, np.array([1, 4]), np.zeros((2, 2), np.float32))
    with pytest.raises(AccumulatorArgumentError, match=r"rows of shape \(2,\), got values"):
        acc.apply(0, np.array([1]), np.zeros((1, 3), np.float32))
    with pytest.raises(AccumulatorArgumentError, match="one row per index"):
        acc.apply(0, np.array([1, 2]), np.zeros((3, 2), np.float32))
    with pytest.raises(AccumulatorArgumentError, match="holds float32 gradients"):
        acc.apply(0, np.array([1]), np.zeros((1, 2), np.float64))
    values = np.ones((1, 2), np.float32)
    acc.apply(0, np.array([2]), values)
    values[:] = 9
    count, (indices, kept) = acc.take(1)
    np.testing.assert_array_equal(kept[0], np.ones((1, 2)))


def test_dense_state_rejects_wrong_gradients():
    acc = ConditionalAccumulatorState("w", np.float32, (2, None))
    with pytest.raises(AccumulatorArgumentError, match=r"shape \(2, \?\), got shape \(3, 1\)"):
        acc.apply(0, np.zeros((3, 1), np.float32))
    with pytest.raises(AccumulatorArgumentError, match="holds float32 gradients, got int64"):
        acc.apply(0, np.zeros((2, 1), np.int64))
    with pytest.raises(AccumulatorArgumentError, match="num_required must be at least 1"):
        acc.take(0)
    with pytest.raises(AccumulatorArgumentError, match="must be floating point"):
        ConditionalAccumulatorState("ints", np.int32, ())


def test_close_wakes_a_waiting_take_and_refuses_applies():
    acc = ConditionalAccumulatorState("w/grad_accum", np.float64, ())
    acc.apply(0, np.array(1.0))
    taker = Worker(lambda: acc.take(3))
    taker.start()
    wait_until(lambda: acc.waiting_takes == 1, "the take waits")
    acc.close(cancel_pending_enqueues=True)
    taker.finish()
    assert isinstance(taker.error, AccumulatorClosedError)
    assert "'w/grad_accum' was closed while a take waited for 3 gradients (1 accumulated" in str(
        taker.error
    )
    with pytest.raises(AccumulatorClosedError, match="is closed; cannot apply"):
        acc.apply(0, np.array(1.0))


def test_clock_holds_back_the_fast_worker():
    clock = StalenessClockState("clock", 2, staleness=1)
    assert clock.wait(0, 0) == 0
    assert clock.advance(0) == 1
    assert clock.wait(0, 1) == 0  # one step ahead of worker 1: allowed
    assert clock.advance(0) == 2
    fast = Worker(lambda: clock.wait(0, 2))
    fast.start()
    wait_until(lambda: clock.waiting == 1, "worker 0 waits two steps ahead")
    clock.advance(1)
    fast.finish()
    assert fast.error is None and fast.result == 1
    assert clock.clocks() == [2, 1]
    with pytest.raises(AccumulatorArgumentError, match="worker index 2 is out of range"):
        clock.advance(2)


def test_closing_the_clock_wakes_waiting_workers():
    clock = StalenessClockState("ssp", 3, staleness=0)
    clock.advance(1)
    waiter = Worker(lambda: clock.wait(1, 1))
    waiter.start()
    wait_until(lambda: clock.waiting == 1, "worker 1 waits")
    clock.close()
    waiter.finish()
    assert isinstance(waiter.error, StalenessClockClosedError)
    assert "worker 1 waited to start step 1" in str(waiter.error)


def test_closing_the_session_wakes_a_blocked_take():
    g = fm.Graph()
    with g.as_default():
        acc = ConditionalAccumulator(fm.float32, (2,), name="acc")
        take = acc.take_grad(2)
    sess = fm.Session(g)
    taker = Worker(lambda: sess.run(take))
    taker.start()
    wait_until(
        lambda: sess.resources.get("acc") is not None
        and sess.resources.get("acc").waiting_takes == 1,
        "the take waits",
    )
    sess.close()
    taker.finish()
    assert isinstance(taker.error, AccumulatorClosedError)


def test_build_time_errors_name_the_accumulator():
    g = fm.Graph()
    with g.as_default():
        acc = ConditionalAccumulator(fm.float32, (2, 3), name="w_accum")
        with pytest.raises(fm.GraphError, match=r"'w_accum' holds gradients of shape \(2, 3\)"):
            acc.apply_grad(fm.placeholder(fm.float32, (3, 2)))
        with pytest.raises(fm.GraphError, match="'w_accum' holds float32 gradients, got float64"):
            acc.apply_grad(fm.placeholder(fm.float64, (2, 3)))
        with pytest.raises(fm.GraphError, match="local_step must be an integer scalar"):
            acc.apply_grad(fm.placeholder(fm.float32, (2, 3)), fm.constant(1.0))
        with pytest.raises(fm.GraphError, match="dtype must be floating point"):
            ConditionalAccumulator(fm.int32, ())
        sparse = SparseConditionalAccumulator(fm.float32, (5, 4), name="emb_accum")
        with pytest.raises(fm.GraphError, match=r"'emb_accum' holds rows of shape \(4,\)"):
            sparse.apply_grad(np.array([1, 2]), fm.placeholder(fm.float32, (2, 3)))
        with pytest.raises(fm.GraphError, match="2 indices but 3 value rows"):
            sparse.apply_grad(np.array([1, 2]), fm.placeholder(fm.float32, (3, 4)))
        avg = acc.take_grad(1)
        indices, values = sparse.take_grad(1)
    assert avg.shape == (2, 3) and avg.dtype == fm.float32
    assert (indices.shape, values.shape) == ((None,), (None, 4))


def test_shared_name_shares_state_and_checks_spec():
    g = fm.Graph()
    with g.as_default():
        a = ConditionalAccumulator(fm.float64, (2,), shared_name="shared")
        b = ConditionalAccumulator(fm.float64, (2,), shared_name="shared")
        c = ConditionalAccumulator(fm.float64, (3,), shared_name="shared")
        apply = a.apply_grad(np.array([1.0, 3.0]), 0)
        take = b.take_grad(1)
    with fm.Session(g) as sess:
        sess.run(apply)
        np.testing.assert_array_equal(sess.run(take), [1.0, 3.0])
        with pytest.raises(AccumulatorArgumentError, match="'shared' already exists as a dense"):
            sess.run(c.num_accumulated())
