"""Sparse updates: repeated rows summed by ``unique`` + ``unsorted_segment_sum``, values of
the step, so concurrent updates of one variable (async workers) never see each other's
scratch rows: Adagrad once used its accumulator as scratch, and two workers updating the
same rows at once left a row's accumulator at zero, then 0/0 in the update (NaN)."""

import threading

import numpy as np

import flowmill.runtime as fm
from flowmill.runtime.ops.unique_ops import unique

from opcheck import OpCase, case_tests


def ref_unique(x):
    y, idx = np.unique(x, return_inverse=True)
    return [y, idx.astype(np.int32)]


CASES = [
    OpCase("unique", lambda x: list(unique(x)), [np.array([4, 1, 4, 7, 1, 1], np.int64)],
           ref_unique, grad=False),
]

test_forward, _ = case_tests(CASES)


def test_concurrent_sparse_adagrad_updates_stay_finite():
    rows, dim, threads, steps = 8, 4, 4, 150
    g = fm.Graph()
    with g.as_default():
        table = fm.Variable(np.ones((rows, dim), np.float32), name="table")
        ids = fm.placeholder(fm.int32, (None,), name="ids")
        scale = fm.placeholder(fm.float32, (), name="scale")
        # Some steps send a zero gradient for their rows: with a zeroed accumulator that
        # was 0/0.
        loss = fm.reduce_sum(fm.gather(table, ids)) * scale
        train = fm.train.Adagrad(0.1, initial_accumulator_value=0.1).minimize(loss)
    failures = []
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(train, [ids, scale])

        def work(seed):
            rng = np.random.default_rng(seed)
            try:
                for k in range(steps):
                    batch = rng.integers(0, rows, 6).astype(np.int32)
                    step(batch, 0.0 if k % 3 == 0 else 1.0)
            except Exception as e:  # reported below
                failures.append(e)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert not any(w.is_alive() for w in workers)
        assert not failures, failures
        value = sess.run(table)
        slot = sess.run([v for v in fm.global_variables(g) if "Adagrad" in v.name][0])
    assert np.all(np.isfinite(value)), value
    assert np.all(slot >= 0.1)  # never below its initial value: nothing zeroed it
