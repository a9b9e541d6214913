"""Training modes with threads as worker replicas on one shared session.

Every thread is joined with a timeout; blocked threads are observed through the state's
own counts of waiters, never through sleeps; nothing asserts how long anything took.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.conditional_accumulator import (
    AccumulatorClosedError,
    StalenessClockClosedError,
)
from flowmill.kernels.fifo_queue import OutOfRangeError
from flowmill.kernels.resources import Resources
from flowmill.runtime import optimizers as O
from flowmill.runtime.cluster import ClusterSpec
from flowmill.runtime.device_names import task_of
from flowmill.runtime.executor import Frame, compile_step
from flowmill.runtime.partition import partition
from flowmill.runtime.passes import optimize
from flowmill.runtime.placement import place, replica_device_setter
from flowmill.runtime.prune import prune
from flowmill.runtime.replicas import (
    CLOSED_ERRORS,
    BoundedStaleness,
    SyncReplicasOptimizer,
    make_training,
)

from threads import JOIN_TIMEOUT, Worker, finish_all, wait_until

ROWS, DIM = 8, 3  # embedding table
BATCH = 8


# ---- a small model: an embedding lookup (sparse gradient) into a dense layer


def initial_values(seed=0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {
        "emb": r.normal(size=(ROWS, DIM)),
        "w": r.normal(size=(DIM, 1)),
        "b": np.zeros(1),
    }


def make_variables(init) -> dict[str, fm.Variable]:
    return {k: fm.Variable(v, name=k) for k, v in init.items()}


def model_loss(params, ids, y):
    # The identity keeps the fed placeholder out of the optimizer's gradient gate, whose
    # control edge to a placeholder would make the step demand it even though it is fed.
    e = fm.gather(params["emb"], fm.identity(ids))
    pred = fm.matmul(fm.nn.tanh(e), params["w"]) + params["b"]
    return fm.reduce_mean(fm.square(pred - y))


def dataset(steps, seed=1):
    r = np.random.default_rng(seed)
    ids = r.integers(0, ROWS, size=(steps, BATCH))
    target = r.normal(size=(ROWS, 1))
    y = target[ids] + 0.01 * r.normal(size=(steps, BATCH, 1))
    return ids.astype(np.int64), y


def worker_inputs(i):
    ids = fm.placeholder(fm.int64, (None,), name=f"ids_{i}")
    y = fm.placeholder(fm.float64, (None, 1), name=f"y_{i}")
    return ids, y


OPTIMIZERS = {
    "sgd": lambda: O.GradientDescent(0.2),
    "momentum": lambda: O.Momentum(0.1, 0.9),
    "adam": lambda: O.Adam(0.05),
}


def single_replica(make_opt, steps, ids, y):
    """One replica trains on whole batches: the result sync training must reproduce."""
    g = fm.Graph()
    with g.as_default():
        params = make_variables(initial_values())
        step = O.create_global_step()
        x_ids, x_y = worker_inputs(0)
        train = make_opt().minimize(model_loss(params, x_ids, x_y), global_step=step)
        with fm.Session(g) as sess:
            sess.run(fm.global_variables_initializer())
            for k in range(steps):
                sess.run(train, {x_ids: ids[k], x_y: y[k]})
            return sess.run({k: v.value() for k, v in params.items()})


# ---- sync


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [2, 4])
def test_sync_matches_one_replica_on_the_whole_batch(n, opt_name):
    steps = 50
    ids, y = dataset(steps)
    want = single_replica(OPTIMIZERS[opt_name], steps, ids, y)

    g = fm.Graph()
    with g.as_default():
        params = make_variables(initial_values())
        global_step = O.create_global_step()
        sync = SyncReplicasOptimizer(OPTIMIZERS[opt_name](), n, n)
        inputs = []
        for i in range(n):
            x_ids, x_y = worker_inputs(i)
            sync.minimize(model_loss(params, x_ids, x_y), global_step, worker_index=i)
            inputs.append((x_ids, x_y))
        init = fm.global_variables_initializer()
    assert [a.op.type for a in sync.accumulators] == [
        "SparseConditionalAccumulator", "ConditionalAccumulator", "ConditionalAccumulator",
    ]
    share = BATCH // n

    def work(i):
        rows = slice(i * share, (i + 1) * share)
        sess.run(sync.worker(i).init_op)
        step = sess.make_callable(sync.train_op(i), list(inputs[i]))
        for k in range(steps):
            step(ids[k, rows], y[k, rows])

    with fm.Session(g) as sess:
        sess.run(init)
        threads = [Worker(work, i) for i in range(n)]
        chief = Worker(sync.chief_loop, sess, None, steps)
        for t in [chief, *threads]:
            t.start()
        finish_all([chief, *threads])
        assert chief.result == steps
        got = sess.run({k: v.value() for k, v in params.items()})
        assert sess.run(global_step.value()) == steps
        assert sess.run(sync.num_dropped) == 0
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_sync_aggregates_more_gradients_than_workers():
    """m=2 with one worker: the initial token lets it send two gradients, computed at the
    same parameters, per update; that is one replica on batches twice as large."""
    steps = 20
    ids, y = dataset(steps)
    want = single_replica(OPTIMIZERS["momentum"], steps, ids, y)
    g = fm.Graph()
    with g.as_default():
        params = make_variables(initial_values())
        global_step = O.create_global_step()
        sync = SyncReplicasOptimizer(OPTIMIZERS["momentum"](), 2, 1)
        x_ids, x_y = worker_inputs(0)
        train = sync.minimize(model_loss(params, x_ids, x_y), global_step)
        init = fm.global_variables_initializer()
    half = BATCH // 2

    def work():
        for k in range(steps):
            for rows in (slice(0, half), slice(half, BATCH)):
                sess.run(train, {x_ids: ids[k, rows], x_y: y[k, rows]})

    with fm.Session(g) as sess:
        sess.run(init)
        worker, chief = Worker(work), Worker(sync.chief_loop, sess, None, steps)
        chief.start(), worker.start()
        finish_all([chief, worker])
        got = sess.run({k: v.value() for k, v in params.items()})
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


class Mailbox:
    """A minimal rendezvous: each key carries one value from a send to a recv."""

    def __init__(self):
        self._cond = threading.Condition()
        self._values = {}

    def send(self, key, value):
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def recv(self, key):
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values, timeout=JOIN_TIMEOUT):
                raise AssertionError(f"nothing was sent under {key!r}")
            return self._values.pop(key)


class PartitionedSteps:
    """Runs steps split over tasks as a distributed runtime would: placed, partitioned,
    each partition in its own thread against its task's own Resources."""

    def __init__(self):
        self.resources: dict[str, Resources] = {}
        self.mailbox = Mailbox()
        self._ids = itertools.count()
        self._plans = {}
        self._lock = threading.Lock()

    def _compile(self, client, target, feeds):
        step = optimize(prune([], [target], list(feeds)), Resources())
        place(step, client)
        plans = {}
        for device, part in partition(step, client).items():
            state = self.resources.setdefault(task_of(device), Resources())
            plans[device] = compile_step(part, state)
        return plans

    def run(self, client, target, feed_dict=None):
        feed_dict = feed_dict or {}
        key = (client, target, tuple(feed_dict))
        with self._lock:
            if key not in self._plans:
                self._plans[key] = self._compile(client, target, feed_dict)
            plans = self._plans[key]
        frame = Frame(next(self._ids), self.mailbox)
        args = tuple(np.asarray(v, dtype=t.dtype) for t, v in feed_dict.items())
        parts = [
            Worker(plan.run, args if device == client else (), frame)
            for device, plan in plans.items()
        ]
        for t in parts:
            t.start()
        finish_all(parts)
        return sorted(plans)

    def value(self, variable: fm.Variable):
        return self.resources[task_of(variable.device)].get(variable.name).value


CLUSTER = ClusterSpec.from_dict(
    {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3", "127.0.0.1:4"]}
)


def worker_device(i):
    return f"/job:worker/task:{i}/device:CPU:0"


def train_split_sync(runner, sync, init, inputs, ids, y, steps):
    """Initializes, then runs ``steps`` sync rounds with the chief and each worker in its
    own thread, worker ``i`` fed its share of each batch; returns the devices of the
    chief's last step and, per worker, the tasks its steps ran on."""
    n, chief_client = len(inputs), worker_device(0)
    share = BATCH // n
    runner.run(chief_client, init)
    runner.run(chief_client, sync.chief_init_op)

    def work(i):
        rows = slice(i * share, (i + 1) * share)
        runner.run(worker_device(i), sync.worker(i).init_op)
        tasks = set()
        for k in range(steps):
            feed = {inputs[i][0]: ids[k, rows], inputs[i][1]: y[k, rows]}
            tasks |= {task_of(d) for d in runner.run(worker_device(i), sync.train_op(i), feed)}
        return tasks

    def chief():
        devices = []
        for _ in range(steps):
            devices = runner.run(chief_client, sync.chief_train_op)
        return devices

    threads = [Worker(chief)] + [Worker(work, i) for i in range(n)]
    for t in threads:
        t.start()
    finish_all(threads)
    return threads[0].result, [t.result for t in threads[1:]]


def test_sync_runs_unchanged_when_split_over_ps_and_worker_tasks():
    """Variables on two PS tasks, two workers: accumulators sit with their variables, the
    token queue with the global step, each local step on its worker; the result is the
    one-replica result."""
    n, steps = 2, 15
    ids, y = dataset(steps)
    want = single_replica(OPTIMIZERS["adam"], steps, ids, y)
    g = fm.Graph()
    with g.as_default():
        with fm.device(replica_device_setter(CLUSTER, worker_device=worker_device(0))):
            params = make_variables(initial_values())
            global_step = O.create_global_step()
        sync = SyncReplicasOptimizer(OPTIMIZERS["adam"](), n, n)
        inputs = []
        for i in range(n):
            with fm.device(replica_device_setter(CLUSTER, worker_device=worker_device(i))):
                x_ids, x_y = worker_inputs(i)
                loss = model_loss(params, x_ids, x_y)
                sync.minimize(loss, global_step, worker_index=i)
            inputs.append((x_ids, x_y))
        with fm.device(worker_device(0)):
            init = fm.global_variables_initializer()
    devices = {v: params[v].device for v in params}
    assert devices == {"emb": "/job:ps/task:0", "w": "/job:ps/task:1", "b": "/job:ps/task:1"}
    for v, acc in zip(sync.variables, sync.accumulators, strict=True):
        assert acc.handle.op.device == v.device
    assert all(q.handle.op.device == global_step.device for q in sync.token_queues)
    for i in range(n):  # with its token queue: a step's label and token stay on that task
        assert sync.worker(i).local_step.device == global_step.device
    # Each is its worker's own: never saved, never waited for by the other workers.
    assert g.get_collection(fm.GraphKeys.LOCAL_VARIABLES) == [
        sync.worker(i).local_step for i in range(n)]

    runner = PartitionedSteps()
    chief_devices, _ = train_split_sync(runner, sync, init, inputs, ids, y, steps)
    assert any("/job:ps/task:1" in d for d in chief_devices)  # the chief's step spans PS tasks
    for k, v in params.items():
        np.testing.assert_allclose(runner.value(v), want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    for state in runner.resources.values():
        state.close()

    # A worker's step sends its gradients and receives the parameters, nothing else: its
    # local step (the label) and its token stay with the token queue on the PS task.
    step = optimize(prune([], [sync.train_op(1)], list(inputs[1])), Resources())
    place(step, worker_device(1))
    parts = partition(step, worker_device(1))
    (mine,) = [p for d, p in parts.items() if d.startswith(worker_device(1))]
    received = {n.attrs["tensor_name"].split("/")[0] for n in mine.nodes if n.type == "_Recv"}
    assert received and received <= set(params), received
    assert not [n for n in mine.nodes if n.type == "_Send" and "local_step" in n.name]


def test_tokens_live_beside_the_accumulators_when_the_global_step_has_none():
    """The global step alone on ps 0, every variable on ps 1: the token queues and the
    workers' local steps go to ps 1, so a worker's step runs on ps 1 and no other PS task
    (its label is read where its accumulators are), the chief's release there takes the
    new step from ps 0, and training is still the one-replica result."""
    n, steps = 2, 6
    ids, y = dataset(steps)
    want = single_replica(OPTIMIZERS["sgd"], steps, ids, y)
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            global_step = O.create_global_step()
        with fm.device("/job:ps/task:1"):
            params = make_variables(initial_values())
        sync = SyncReplicasOptimizer(OPTIMIZERS["sgd"](), n, n)
        inputs = []
        for i in range(n):
            with fm.device(worker_device(i)):
                x_ids, x_y = worker_inputs(i)
                sync.minimize(model_loss(params, x_ids, x_y), global_step, worker_index=i)
            inputs.append((x_ids, x_y))
        with fm.device(worker_device(0)):
            init = fm.global_variables_initializer()
    assert global_step.device == "/job:ps/task:0"
    assert {q.handle.op.device for q in sync.token_queues} == {"/job:ps/task:1"}
    assert {sync.worker(i).local_step.device for i in range(n)} == {"/job:ps/task:1"}

    runner = PartitionedSteps()
    _, worker_tasks = train_split_sync(runner, sync, init, inputs, ids, y, steps)
    for i, tasks in enumerate(worker_tasks):
        assert tasks == {"/job:ps/task:1", task_of(worker_device(i))}, tasks
    assert runner.value(global_step) == steps
    for k, v in params.items():
        np.testing.assert_allclose(runner.value(v), want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # A chief and workers coming back into the job: the rejoin's tokens (of the step read
    # on ps 0) reach the queues on ps 1, and each worker's rejoin drops its stale one.
    runner.run(worker_device(0), sync.chief_rejoin_op)
    queues = [runner.resources["/job:ps/task:1"].get(q.shared_name) for q in sync.token_queues]
    assert [q.size() for q in queues] == [1] * n
    for i in range(n):
        runner.run(worker_device(i), sync.worker(i).rejoin_op)
        assert runner.value(sync.worker(i).local_step) == steps
    assert [q.size() for q in queues] == [0] * n
    for state in runner.resources.values():
        state.close()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_the_chief_update_needs_nothing_from_the_chief_task(opt_name):
    """Every op of the chief's update (the optimizer's hyperparameters and groups
    included) lives on the PS tasks: once they run it, no value from the chief's task
    is waited for, so a chief killed then leaves the update whole on every PS task
    (test_resume.py kills one)."""
    g = fm.Graph()
    with g.as_default():
        with fm.device(replica_device_setter(CLUSTER, worker_device=worker_device(0))):
            params = make_variables(initial_values())
            global_step = O.create_global_step()
        sync = SyncReplicasOptimizer(OPTIMIZERS[opt_name](), 2, 2)
        for i in range(2):
            with fm.device(replica_device_setter(CLUSTER, worker_device=worker_device(i))):
                loss = model_loss(params, *worker_inputs(i))
                sync.minimize(loss, global_step, worker_index=i)
    step = optimize(prune([], [sync.chief_train_op], []), Resources())
    place(step, worker_device(0))
    parts = partition(step, worker_device(0))
    ps_parts = {d: p for d, p in parts.items() if "/job:ps/" in d}
    assert len(ps_parts) == 2
    for device, part in ps_parts.items():
        sources = {n.attrs["src_device"] for n in part.nodes if n.type == "_Recv"}
        assert all("/job:ps/" in src for src in sources), (device, sources)


def test_sync_backup_worker_survives_a_lost_worker_and_drops_late_gradients():
    """n=3, m=2: worker 2 runs a few steps, stalls until the others have moved on, then
    sends one late gradient (dropped and counted) and quits; training goes on."""
    n, m, early, target = 3, 2, 5, 40
    ids, y = dataset(200, seed=2)
    g = fm.Graph()
    with g.as_default():
        params = make_variables(initial_values())
        global_step = O.create_global_step()
        training = make_training("sync", O.GradientDescent(0.2), n, backup_workers=1)
        assert isinstance(training, SyncReplicasOptimizer)
        assert (training.replicas_to_aggregate, training.total_num_replicas) == (m, n)
        inputs = []
        for i in range(n):
            x_ids, x_y = worker_inputs(i)
            training.minimize(model_loss(params, x_ids, x_y), global_step)
            inputs.append((x_ids, x_y))
        all_ids, all_y = worker_inputs("all")
        full_loss = model_loss(params, all_ids, all_y)
        init = fm.global_variables_initializer()
    everything = {all_ids: ids.reshape(-1), all_y: y.reshape(-1, 1)}
    stop, paused, late_go = threading.Event(), threading.Event(), threading.Event()

    def batches(i):
        r = np.random.default_rng(10 + i)
        while True:
            k = r.integers(0, len(ids))
            yield ids[k], y[k]

    def steady(i):
        step = sess.make_callable(training.train_op(i), list(inputs[i]))
        data = batches(i)
        done = 0
        try:
            while not stop.is_set():
                step(*next(data))
                done += 1
        except CLOSED_ERRORS:
            if not stop.is_set():
                raise
        return done

    def straggler():
        step = sess.make_callable(training.train_op(2), list(inputs[2]))
        data = batches(2)
        for _ in range(early):
            step(*next(data))
        paused.set()
        assert late_go.wait(JOIN_TIMEOUT)
        step(*next(data))  # labelled with a step the chief has taken already

    sess = fm.Session(g)
    try:
        sess.run(init)
        before = sess.run(full_loss, everything)
        chief = Worker(training.chief_loop, sess, stop)
        workers = [Worker(steady, 0), Worker(steady, 1), Worker(straggler)]
        for t in [chief, *workers]:
            t.start()
        assert paused.wait(JOIN_TIMEOUT)
        label = int(sess.run(training.worker(2).local_step.value()))
        wait_until(lambda: sess.run(global_step.value()) > label, "the others move on")
        dropped_before = sess.run(training.num_dropped_by_variable)
        late_go.set()
        workers[2].finish()
        assert workers[2].error is None
        dropped_after = sess.run(training.num_dropped_by_variable)
        assert np.all(dropped_after >= dropped_before + 1), (dropped_before, dropped_after)
        # Worker 2 is gone; the two others still make every step.
        wait_until(lambda: sess.run(global_step.value()) >= target, "training goes on")
        after = sess.run(full_loss, everything)
        stop.set()
    finally:
        stop.set()
        sess.close()  # wakes whoever waits on a take or a token
    finish_all([chief, *workers])
    assert chief.result >= target
    assert after < 0.5 * before, (before, after)


# ---- bounded staleness


def linear_problem(num_workers, steps, seed=3):
    r = np.random.default_rng(seed)
    w_true = r.normal(size=(4, 1))
    xs = r.normal(size=(num_workers, steps, 16, 4))
    return xs, xs @ w_true


def build_linear(training, num_workers, global_step=None):
    w = fm.Variable(np.zeros((4, 1)), name="w")
    inputs = []
    for i in range(num_workers):
        x = fm.placeholder(fm.float64, (None, 4), name=f"x_{i}")
        y = fm.placeholder(fm.float64, (None, 1), name=f"y_{i}")
        loss = fm.reduce_mean(fm.square(fm.matmul(x, w) - y))
        training.minimize(loss, global_step, worker_index=i)
        inputs.append((x, y))
    x_all = fm.placeholder(fm.float64, (None, 4), name="x_all")
    y_all = fm.placeholder(fm.float64, (None, 1), name="y_all")
    full = fm.reduce_mean(fm.square(fm.matmul(x_all, w) - y_all))
    return inputs, (x_all, y_all, full)


def test_bounded_staleness_holds_a_fast_worker_within_s_steps():
    """Worker 1 only moves when the test lets it; worker 0 runs freely and must stop
    exactly where staleness 1 says: it may start step t once worker 1 finished t - 1."""
    s, steps = 1, 6
    xs, ys = linear_problem(2, steps)
    g = fm.Graph()
    with g.as_default():
        training = BoundedStaleness(O.GradientDescent(0.05), 2, staleness=s)
        inputs, _ = build_linear(training, 2)
    done = [0, 0]
    starts: list[tuple[int, int, tuple[int, int]]] = []  # (worker, step, done counts then)
    lock = threading.Lock()
    gate = threading.Semaphore(0)

    def work(i):
        ops = training.worker(i)
        update = sess.make_callable(ops.update_op, list(inputs[i]))
        finish = sess.make_callable(ops.finish_op)
        for t in range(steps):
            if i == 1:
                assert gate.acquire(timeout=JOIN_TIMEOUT)
            update(xs[i, t], ys[i, t])
            with lock:
                done[i] += 1
            finish()  # report the step, then wait until step t + 1 may start
            with lock:
                starts.append((i, t + 1, tuple(done)))

    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        clock = None
        fast, slow = Worker(work, 0), Worker(work, 1)
        fast.start(), slow.start()
        for k in range(steps + 1):
            bound = min(steps, k + s + 1)

            def fast_parked(bound=bound):
                nonlocal clock
                clock = clock or sess.resources.get(training.clock.shared_name)
                with lock:
                    assert done[0] <= bound, f"worker 0 ran to step {done[0]}, bound {bound}"
                    at_bound = done[0] == bound
                return at_bound and (clock.waiting == 1 or not fast.is_alive())

            wait_until(fast_parked, f"worker 0 is held at {bound} steps while worker 1 has {k}")
            if k < steps:
                gate.release()
                wait_until(lambda k=k: done[1] == k + 1, "worker 1 finishes a step")
        finish_all([fast, slow])
        assert list(sess.run(training.clocks)) == [steps, steps]
    for worker, t, counts in starts:
        assert min(counts) >= t - s, f"worker {worker} started step {t} with done={counts}"


def test_bounded_staleness_trains_free_running_workers():
    n, s, steps = 3, 1, 40
    xs, ys = linear_problem(n, steps, seed=4)
    g = fm.Graph()
    with g.as_default():
        global_step = O.create_global_step()
        training = make_training("bounded_staleness", O.GradientDescent(0.05), n, staleness=s)
        inputs, (x_all, y_all, full) = build_linear(training, n, global_step)
    everything = {x_all: xs.reshape(-1, 4), y_all: ys.reshape(-1, 1)}

    def work(i):
        step = sess.make_callable(training.train_op(i), list(inputs[i]))
        for t in range(steps):
            step(xs[i, t], ys[i, t])

    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        before = sess.run(full, everything)
        threads = [Worker(work, i) for i in range(n)]
        for t in threads:
            t.start()
        finish_all(threads)
        assert list(sess.run(training.clocks)) == [steps] * n
        assert sess.run(global_step.value()) == n * steps
        assert sess.run(full, everything) < 0.05 * before


# ---- async


def test_async_workers_apply_updates_as_they_arrive():
    n, steps = 3, 30
    xs, ys = linear_problem(n, steps, seed=5)
    g = fm.Graph()
    with g.as_default():
        global_step = O.create_global_step()
        training = make_training("async", O.GradientDescent(0.05), n)
        inputs, (x_all, y_all, full) = build_linear(training, n, global_step)
    everything = {x_all: xs.reshape(-1, 4), y_all: ys.reshape(-1, 1)}
    assert not training.has_chief

    def work(i):
        sess.run(training.worker(i).init_op)
        step = sess.make_callable(training.train_op(i), list(inputs[i]))
        for t in range(steps):
            step(xs[i, t], ys[i, t])

    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        before = sess.run(full, everything)
        assert training.chief_loop(sess) == 0
        threads = [Worker(work, i) for i in range(n)]
        for t in threads:
            t.start()
        finish_all(threads)
        assert sess.run(global_step.value()) == n * steps  # every update was applied
        assert sess.run(full, everything) < 0.05 * before


# ---- closing the session


def test_closing_the_session_wakes_sync_worker_and_chief():
    """Only one of two workers runs: the chief waits on a take, the worker on a token."""
    g = fm.Graph()
    with g.as_default():
        global_step = O.create_global_step()
        sync = SyncReplicasOptimizer(O.GradientDescent(0.1), 2, 2)
        inputs, _ = build_linear(sync, 2, global_step)
        init = fm.global_variables_initializer()
    xs, ys = linear_problem(2, 1)
    sess = fm.Session(g)
    sess.run(init)
    feed = {inputs[0][0]: xs[0, 0], inputs[0][1]: ys[0, 0]}
    worker = Worker(lambda: sess.run(sync.train_op(0), feed))
    chief = Worker(sync.chief_loop, sess)
    worker.start(), chief.start()
    queue = accumulator = None

    def both_blocked():
        nonlocal queue, accumulator
        queue = queue or sess.resources.get(sync.token_queues[0].shared_name)
        accumulator = accumulator or sess.resources.get(sync.accumulators[0].shared_name)
        return (
            queue is not None
            and accumulator is not None
            and queue.waiting_dequeues == 1
            and accumulator.waiting_ready == 1  # the chief takes from none before all are in
        )

    wait_until(both_blocked, "the worker waits for a token and the chief for gradients")
    sess.close()
    worker.finish(), chief.finish()
    assert isinstance(worker.error, OutOfRangeError)
    assert "sync_token_q_0" in str(worker.error)
    assert isinstance(chief.error, AccumulatorClosedError)
    assert "was closed while waiting for 2 gradients (1 accumulated" in str(chief.error)
    with pytest.raises(fm.SessionClosedError):
        sync.chief_loop(sess, initialize=False)


def test_closing_the_session_wakes_a_worker_held_by_the_staleness_clock():
    g = fm.Graph()
    with g.as_default():
        training = BoundedStaleness(O.GradientDescent(0.1), 2, staleness=0)
        inputs, _ = build_linear(training, 2)
        init = fm.global_variables_initializer()
    xs, ys = linear_problem(2, 2)
    sess = fm.Session(g)
    sess.run(init)
    # Worker 0 finishes step 0 and may not start step 1 before worker 1 finishes step 0.
    feed = {inputs[0][0]: xs[0, 0], inputs[0][1]: ys[0, 0]}
    worker = Worker(lambda: sess.run(training.train_op(0), feed))
    worker.start()
    wait_until(
        lambda: (c := sess.resources.get(training.clock.shared_name)) is not None
        and c.waiting == 1,
        "worker 0 waits for worker 1",
    )
    sess.close()
    worker.finish()
    assert isinstance(worker.error, StalenessClockClosedError)
    assert "worker 0 waited to start step 1" in str(worker.error)


# ---- configuration


def test_make_training_checks_its_configuration():
    opt = O.GradientDescent(0.1)
    with pytest.raises(ValueError, match="training mode must be one of async, sync"):
        make_training("hogwild", opt, 2)
    with pytest.raises(ValueError, match="backup_workers=1 applies to sync mode only"):
        make_training("async", opt, 2, backup_workers=1)
    with pytest.raises(ValueError, match="staleness=2 applies to bounded_staleness mode only"):
        make_training("sync", opt, 2, staleness=2)
    with pytest.raises(ValueError, match=r"backup_workers must be in \[0, 2\)"):
        make_training("sync", opt, 2, backup_workers=2)
    sync = make_training("sync", opt, 4, backup_workers=1)
    assert (sync.replicas_to_aggregate, sync.total_num_replicas, sync.has_chief) == (3, 4, True)
    ssp = make_training("bounded_staleness", opt, 3, staleness=2)
    assert (ssp.num_workers, ssp.staleness, ssp.mode) == (3, 2, "bounded_staleness")


def test_sync_workers_must_train_the_same_variables():
    g = fm.Graph()
    with g.as_default():
        a = fm.Variable(np.ones(2), name="a")
        b = fm.Variable(np.ones(2), name="b")
        sync = SyncReplicasOptimizer(O.GradientDescent(0.1), 2)
        sync.minimize(fm.reduce_sum(a * b))
        with pytest.raises(ValueError, match=r"missing \['b'\]"):
            sync.minimize(fm.reduce_sum(a * a))
        with pytest.raises(ValueError, match="worker 0 is already built"):
            sync.minimize(fm.reduce_sum(a * b), worker_index=0)
        sync.minimize(fm.reduce_sum(a + b))
        with pytest.raises(ValueError, match="all 2 workers are already built"):
            sync.minimize(fm.reduce_sum(a * b))


def test_sync_worker_init_and_rejoin_do_not_wait_on_the_callers_dependencies():
    """``with control_dependencies(UPDATE_OPS): minimize(...)`` (batch-norm updates that
    read a batch): the worker's init and rejoin ops run before any batch is fed."""
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, 2), name="features")
        w = fm.Variable(np.ones((2, 1), np.float32), name="w")
        moving = fm.Variable(0.0, name="moving_mean", trainable=False)
        update = moving.assign(fm.reduce_mean(x))
        loss = fm.reduce_sum(fm.matmul(x, w))
        sync = SyncReplicasOptimizer(fm.train.GradientDescent(0.1), 1, 1)
        with fm.control_dependencies([update]):
            sync.minimize(loss, O.create_global_step(), worker_index=0)
        init = fm.global_variables_initializer()
    with fm.Session(g) as sess:
        sess.run(init)
        sess.run(sync.chief_init_op)
        sess.run(sync.worker(0).init_op)  # no feed: it must not reach the placeholder
        sess.run(sync.worker(0).rejoin_op)
