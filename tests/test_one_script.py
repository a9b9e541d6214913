"""A model built with no device in sight: a DistributedSession puts its variables on the PS
tasks (the same way in every task) and computes what one process computes; ``Session()``
becomes one in a training task of a cluster, and nothing changes without the cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.launcher.local import free_ports
from flowmill.runtime import task_server
from flowmill.runtime.cluster import (
    ENV_TRAINING,
    ENV_VAR,
    ClusterSpec,
    ClusterSpecError,
    TaskConfig,
)
from flowmill.runtime.distributed import DistributedSession
from flowmill.runtime.job import task, training_config
from flowmill.runtime.placement import VariablePlacer
from flowmill.runtime.prune import prune
from flowmill.runtime.session_manager import initialize_or_wait
from flowmill.runtime.task_exit import lost_ps
from flowmill.runtime.training_mode import (
    REPLICAS_COLLECTION,
    replicated_minimize,
    replicated_training,
)

from threads import Worker


def make_spec(num_ps: int, num_workers: int) -> ClusterSpec:
    ports = free_ports(num_ps + num_workers)
    return ClusterSpec.from_dict(
        {
            "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
        }
    )


def build_mlp(optimize: bool = True):
    """A plain model script: no device scopes, an optimizer with slots, a global step."""
    x = fm.placeholder(fm.float32, (None, 4), name="x")
    y = fm.placeholder(fm.int64, (None,), name="y")
    w1 = fm.Variable(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), name="w1")
    b1 = fm.Variable(np.zeros(8, np.float32), name="b1")
    w2 = fm.Variable(np.linspace(1, -1, 24, dtype=np.float32).reshape(8, 3), name="w2")
    logits = fm.matmul(fm.nn.relu(fm.matmul(x, w1) + b1), w2)
    loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    step = fm.train.create_global_step()
    train = fm.train.Momentum(0.1, 0.9).minimize(loss, global_step=step) if optimize else None
    return x, y, [w1, b1, w2], step, loss, train


def batches(n: int):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6)) for _ in range(n)]


# ---- placement decisions, without a cluster


def _placed(graph: fm.Graph, placer: VariablePlacer, fetches) -> dict[str, str]:
    step = prune(fetches, [], [])
    placer.apply(step, graph)
    return {n.name: n.device for n in step.nodes}


def test_round_robin_in_creation_order_and_colocated_state_follows():
    g = fm.Graph()
    with g.as_default():
        build_mlp()
    placer = VariablePlacer(2, "round_robin")
    devices = placer.assignments(g)
    assert devices == {
        "w1/VarHandleOp": "/job:ps/task:0",
        "b1/VarHandleOp": "/job:ps/task:1",
        "w2/VarHandleOp": "/job:ps/task:0",
        "global_step/VarHandleOp": "/job:ps/task:1",
    }
    # Momentum's slots are colocated with their variable: never dealt out on their own.
    reads = [op.outputs[0] for op in g.get_operations() if op.type == "ReadVariableOp"]
    placed = _placed(g, placer, reads)
    assert placed["w1/Momentum/VarHandleOp"] == "/job:ps/task:0"
    assert placed["b1/Momentum/VarHandleOp"] == "/job:ps/task:1"
    # A slot's initializer goes with the variable though the variable is not in its step.
    assign = g.get_operation_by_name("w1/Momentum/Assign")
    step = prune([], [assign], [])
    assert "w1/VarHandleOp" not in {n.name for n in step.nodes}
    placer.apply(step, g)
    by_name = {n.name: n.device for n in step.nodes}
    assert by_name["w1/Momentum/Assign"] == by_name["w1/Momentum/VarHandleOp"] == "/job:ps/task:0"
    # The increment of the global step runs where the global step lives.
    increment = next(op for op in g.get_operations() if op.name.endswith("increment_global_step"))
    assert _placed(g, placer, [increment.outputs[0]])[increment.name] == "/job:ps/task:1"


def test_same_script_same_assignment_and_earlier_variables_never_move():
    def build(extra: bool):
        g = fm.Graph()
        with g.as_default():
            build_mlp()
            if extra:
                fm.Variable(np.zeros(3, np.float32), name="late")
        return g

    for strategy, late in [("round_robin", "/job:ps/task:1"), ("bytes", "/job:ps/task:1")]:
        a, b = VariablePlacer(3, strategy), VariablePlacer(3, strategy)
        first = dict(a.assignments(build(False)))
        g = build(True)
        assert {k: v for k, v in b.assignments(g).items() if k in first} == first, strategy
        # round robin: the 5th variable of 3 ps; bytes: the task holding least (b1 and the
        # global step, 40 bytes, to w1's 128 and w2's 96)
        assert b.assignments(g)["late/VarHandleOp"] == late, strategy


def test_by_bytes_the_big_variables_spread_first():
    g = fm.Graph()
    with g.as_default():
        fm.Variable(np.zeros((100, 100), np.float32), name="big")
        fm.Variable(np.zeros((10, 10), np.float32), name="small1")
        fm.Variable(np.zeros((10, 10), np.float32), name="small2")
        fm.Variable(np.zeros((100, 100), np.float64), name="big2")
    devices = VariablePlacer(2, "bytes").assignments(g)
    assert devices["big/VarHandleOp"] == "/job:ps/task:0"
    assert devices["small1/VarHandleOp"] == "/job:ps/task:1"
    assert devices["small2/VarHandleOp"] == "/job:ps/task:1"
    assert devices["big2/VarHandleOp"] == "/job:ps/task:1"


def test_variables_the_user_placed_stay_and_a_device_type_is_kept():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:worker/task:0"):
            fm.Variable(1.0, name="mine")
        with fm.device("/job:ps/task:1"):
            fm.Variable(1.0, name="there")
        with fm.device("/device:CPU:0"):
            fm.Variable(1.0, name="typed")
        fm.Variable(1.0, name="free")
    devices = VariablePlacer(2).assignments(g)
    assert "mine/VarHandleOp" not in devices and "there/VarHandleOp" not in devices
    assert devices["typed/VarHandleOp"] == "/job:ps/task:0/device:CPU:0"
    assert devices["free/VarHandleOp"] == "/job:ps/task:1"
    with pytest.raises(ValueError, match="strategy"):
        VariablePlacer(2, "random")


# ---- across servers: the same numbers as one process


def test_a_model_without_devices_trains_on_the_ps_tasks_as_in_one_process(servers):
    spec = make_spec(2, 1)
    ps = [servers(spec, "ps", i) for i in range(2)]
    worker = servers(spec, "worker", 0)
    data = batches(15)
    g = fm.Graph(seed=1)
    with g.as_default():
        x, y, variables, step, loss, train = build_mlp()
        init = fm.global_variables_initializer()
    with fm.Session(g) as sess:
        sess.run(init)
        expected_losses = [sess.run([loss, train], {x: bx, y: by})[0] for bx, by in data]
        expected = sess.run([v.value() for v in variables])

    sess = DistributedSession(g, server=worker)
    sess.run(init)
    losses = [sess.run([loss, train], {x: bx, y: by})[0] for bx, by in data]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    for a, b in zip(sess.run([v.value() for v in variables]), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert sess.run(step.value()) == len(data)
    # The state is where least-bytes-first put it (w1 128 B; b1 32 B and w2 96 B; the
    # global step to the lower of two tied tasks); the worker holds none of it.
    held = [{name for name, _ in s.resources.items()} for s in ps]
    assert {"w1", "w1/Momentum", "global_step"} <= held[0]
    assert {"b1", "w2", "b1/Momentum", "w2/Momentum"} <= held[1]
    assert not [name for name, _ in worker.resources.items()]
    assert sess.variable_device(variables[1].op) == "/job:ps/task:1/device:CPU:0"
    sess.close()


def test_two_workers_share_the_variables_and_the_second_waits_for_the_chief(servers):
    spec = make_spec(1, 2)
    servers(spec, "ps", 0)
    sessions, graphs = [], []
    for i in range(2):
        g = fm.Graph(seed=3)
        with g.as_default():
            built = build_mlp()
            init = fm.global_variables_initializer()
        graphs.append((g, built, init))
        sessions.append(DistributedSession(g, server=servers(spec, "worker", i)))
    # The second worker starts first and waits; the chief's init lets it go.
    waiting = Worker(initialize_or_wait, sessions[1], graphs[1][2], None, 60.0, 0.05)
    waiting.start()
    initialize_or_wait(sessions[0], graphs[0][2])
    waiting.value()
    x0, y0, _, step0, _, train0 = graphs[0][1]
    x1, y1, _, step1, _, train1 = graphs[1][1]
    bx, by = batches(1)[0]
    sessions[0].run(train0, {x0: bx, y0: by})
    sessions[1].run(train1, {x1: bx, y1: by})
    assert sessions[0].run(step0.value()) == sessions[1].run(step1.value()) == 2
    for s in sessions:
        s.close()


# ---- Session() and the process's task


@pytest.fixture
def as_task(monkeypatch):
    def become(spec: ClusterSpec, role: str, index: int, training: dict | None = None):
        monkeypatch.setenv(ENV_VAR, TaskConfig(spec, role, index).to_json())
        if training is not None:
            monkeypatch.setenv(ENV_TRAINING, json.dumps(training))

    yield become
    task_server.close_task_server()


def test_session_alone_is_a_session(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with fm.Session(fm.Graph()) as sess:
        assert type(sess) is fm.Session
    assert task() == (0, 1) and task().is_chief
    assert training_config({}) == {}


def test_session_in_a_worker_task_is_distributed_and_shares_one_server(as_task, servers):
    spec = make_spec(1, 2)
    servers(spec, "ps", 0)
    as_task(spec, "worker", 1, {"mode": "async"})
    g = fm.Graph()
    with g.as_default():
        v = fm.Variable(np.float32(2.0), name="v")
        doubled = v.value() * 2.0
    first = fm.Session(g)
    assert isinstance(first, DistributedSession) and first.task == "/job:worker/task:1"
    first.run(v.initializer)
    first.close()
    with fm.Session(g) as second:  # the same task, the same server: its port binds once
        assert second.server is first.server and not second.server.stopped
        assert second.run(doubled) == 4.0
        assert second.variable_device(v.op) == "/job:ps/task:0/device:CPU:0"
    assert task() == (1, 2) and not task().is_chief
    assert training_config() == {"mode": "async"}

    class Local(fm.Session):
        def __init__(self, graph, label):
            super().__init__(graph)
            self.label = label

    assert type(Local(g, label="mine")) is Local  # subclasses are never redirected


def test_a_ps_task_or_a_chief_job_order(as_task, monkeypatch):
    spec = ClusterSpec.from_dict(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"], "ps": ["h:4"]}
    )
    as_task(spec, "ps", 0)
    assert type(fm.Session(fm.Graph())) is fm.Session
    with pytest.raises(ClusterSpecError, match="runs no model script"):
        task()
    as_task(spec, "chief", 0)
    assert task() == (0, 3) and task().is_chief
    as_task(spec, "worker", 1)
    assert task() == (2, 3)
    monkeypatch.setenv(ENV_TRAINING, "[1]")
    with pytest.raises(ValueError, match=ENV_TRAINING):
        training_config()


# ---- the training mode a task's optimizer runs under


def test_the_training_mode_follows_the_job():
    from flowmill.runtime.replicas import BoundedStaleness, SyncReplicasOptimizer

    spec = ClusterSpec.from_dict({"ps": ["h:1"], "worker": ["h:2", "h:3", "h:4"]})
    worker = TaskConfig(spec, "worker", 2)
    opt = fm.train.GradientDescent(0.1)
    assert replicated_training(opt, worker, {"mode": "async"}) is None
    assert replicated_training(opt, TaskConfig(spec, "ps", 0), {"mode": "sync"}) is None
    sync = replicated_training(opt, worker, {"mode": "sync", "backupWorkers": 1})
    assert isinstance(sync, SyncReplicasOptimizer)
    assert (sync.replicas_to_aggregate, sync.total_num_replicas) == (2, 3)
    ssp = replicated_training(opt, worker, {"mode": "bounded-staleness", "staleness": 2})
    assert isinstance(ssp, BoundedStaleness) and ssp.staleness == 2
    with pytest.raises(ValueError, match="mode"):
        replicated_training(opt, worker, {"mode": "eventually"})


def test_minimize_alone_is_the_optimizers_and_in_sync_mode_builds_this_workers_replica(
    monkeypatch,
):
    monkeypatch.delenv(ENV_VAR, raising=False)
    g = fm.Graph()
    with g.as_default():
        _, _, _, step, loss, _ = build_mlp(optimize=False)
        train = fm.train.GradientDescent(0.1).minimize(loss, global_step=step)
    assert train.type == "AssignAddVariableOp"  # the global step's increment, as alone
    assert g.get_collection(REPLICAS_COLLECTION) == []

    spec = ClusterSpec.from_dict({"ps": ["h:1"], "worker": ["h:2", "h:3"]})
    g = fm.Graph()
    with g.as_default():
        _, _, _, step, loss, _ = build_mlp(optimize=False)
        config = TaskConfig(spec, "worker", 1)
        replicated_minimize(
            fm.train.GradientDescent(0.1), loss, step, config=config, training={"mode": "sync"}
        )
    ((replicated, index),) = g.get_collection(REPLICAS_COLLECTION)
    assert index == 1 and replicated.worker(1).local_step is not None
    local = replicated.worker(1).local_step
    assert local.op.colocation == (step.op.name,)  # with its token queue and the global step
    assert local.op.name not in VariablePlacer(1).assignments(g)


def test_only_an_unreachable_ps_is_a_lost_one():
    import grpc

    from flowmill.runtime.task_errors import TaskError

    gone = TaskError("step 1 failed", "/job:ps/task:1", grpc.StatusCode.UNAVAILABLE)
    assert lost_ps(gone) is gone
    wrapped = RuntimeError("the script's own error")
    wrapped.__cause__ = gone
    assert lost_ps(wrapped) is gone
    for error in (
        TaskError("uninitialized", "/job:ps/task:0", grpc.StatusCode.FAILED_PRECONDITION),
        TaskError("a worker", "/job:worker/task:1", grpc.StatusCode.UNAVAILABLE),
        ValueError("not a task at all"),
    ):
        assert lost_ps(error) is None
