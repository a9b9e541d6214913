"""Placement and partitioning: a model built under a replica device setter, split per
device with Send/Recv pairs and run partition by partition (each in its own thread, with
its own state, meeting in a rendezvous), computes exactly what one process computes."""

import itertools
import threading

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.resources import Resources
from flowmill.runtime.cluster import ClusterSpec
from flowmill.runtime.executor import Frame, compile_step
from flowmill.runtime.partition import DUPLICATE_CONST_BYTES, PartitionError, partition
from flowmill.runtime.passes import optimize
from flowmill.runtime.placement import (
    PlacementError,
    complete_device,
    describe,
    format_bytes,
    place,
    replica_device_setter,
)
from flowmill.runtime.prune import prune
from flowmill.runtime.rendezvous import Rendezvous

WORKER = "/job:worker/task:0/device:CPU:0"
CLUSTER = ClusterSpec.from_dict({"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3"]})


class PartitionedRunner:
    """Runs a graph's steps as partitions, one thread per device, one Resources per task."""

    def __init__(self, graph):
        self.graph = graph
        self.resources: dict[str, Resources] = {}
        self.rendezvous = Rendezvous()
        self.step_ids = itertools.count()
        self.last_parts = None

    def run(self, fetches, feed_dict=None, targets=()):
        feed_dict = feed_dict or {}
        step = prune(list(fetches), list(targets), list(feed_dict))
        step = optimize(step, Resources())
        place(step, WORKER)
        parts = partition(step, WORKER)
        self.last_parts = parts
        step_id = next(self.step_ids)
        results, errors = {}, []

        def run_part(device, part):
            try:
                task = "/".join(device.split("/")[:3])
                resources = self.resources.setdefault(task, Resources())
                plan = compile_step(part, resources)
                args = tuple(np.asarray(v, dtype=t.dtype) for t, v in feed_dict.items())
                results[device] = plan.run(
                    args if device == WORKER else (), Frame(step_id, self.rendezvous)
                )
            except Exception as e:  # surfaced by the caller
                errors.append(e)
                self.rendezvous.abort(e)

        threads = [threading.Thread(target=run_part, args=item) for item in parts.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if errors:
            raise errors[0]
        return list(results[WORKER])


def build_mlp(strategy: str = "bytes"):
    setter = replica_device_setter(CLUSTER, worker_device="/job:worker/task:0", strategy=strategy)
    with fm.device(setter):
        x = fm.placeholder(fm.float32, (None, 4), name="x")
        y = fm.placeholder(fm.int64, (None,), name="y")
        w1 = fm.Variable(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), name="w1")
        b1 = fm.Variable(np.zeros(8, np.float32), name="b1")
        w2 = fm.Variable(np.linspace(1, -1, 24, dtype=np.float32).reshape(8, 3), name="w2")
        h = fm.nn.relu(fm.matmul(x, w1) + b1)
        logits = fm.matmul(h, w2)
        loss = fm.reduce_mean(
            fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
        train = fm.train.Momentum(0.1, 0.9).minimize(loss)
    return x, y, [w1, b1, w2], loss, train


def test_replica_device_setter_puts_variables_on_ps_round_robin():
    with fm.Graph().as_default():
        _, _, (w1, b1, w2), loss, _ = build_mlp("round_robin")
        assert [v.device for v in (w1, b1, w2)] == [
            "/job:ps/task:0",
            "/job:ps/task:1",
            "/job:ps/task:0",
        ]
        assert loss.op.device == "/job:worker/task:0"
        # ops made by the optimizer next to each variable follow it
        slot_update = next(
            op for op in loss.graph.get_operations() if op.name.startswith("w2/Momentum")
        )
        assert slot_update.device == "/job:ps/task:0"


def test_bytes_strategy_balances_ps_load():
    with fm.Graph().as_default():
        with fm.device(replica_device_setter(2, strategy="bytes")):
            big = fm.Variable(np.zeros(1000, np.float32), name="big")
            small = [fm.Variable(np.zeros(10, np.float32), name=f"s{i}") for i in range(3)]
        assert big.device == "/job:ps/task:0"
        assert {v.device for v in small} == {"/job:ps/task:1"}


def _kernels_and_biases(strategy=None):
    """Three layers' 2 MB kernels and 10 KB biases, made kernel, bias, kernel, ...: the
    order that deals every kernel to one task in turn."""
    kwargs = {} if strategy is None else {"strategy": strategy}
    with fm.Graph().as_default() as g:
        with fm.device(replica_device_setter(2, **kwargs)):
            for i in range(3):
                fm.Variable(fm.zeros((1000, 500), fm.float32), name=f"kernel{i}")
                fm.Variable(fm.zeros((2500,), fm.float32), name=f"bias{i}")
    return {op.name.split("/")[0]: op.device for op in g.get_operations()
            if op.type == "VarHandleOp"}


def test_variables_go_by_bytes_by_default():
    assert _kernels_and_biases() == _kernels_and_biases("bytes") == {
        "kernel0": "/job:ps/task:0",
        "bias0": "/job:ps/task:1",
        "kernel1": "/job:ps/task:1",
        "bias1": "/job:ps/task:0",
        "kernel2": "/job:ps/task:0",
        "bias2": "/job:ps/task:1",
    }
    # Dealt in turn, every kernel lands on one task.
    by_turn = _kernels_and_biases("round_robin")
    assert {by_turn[f"kernel{i}"] for i in range(3)} == {"/job:ps/task:0"}


def test_describe_shows_bytes_and_variables_per_ps_task():
    with fm.Graph().as_default() as g:
        with fm.device(replica_device_setter(2)):
            big = fm.Variable(np.zeros((1000, 250), np.float32), name="big")  # 1 MB
            small = [fm.Variable(np.zeros(2500, np.float32), name=f"s{i}") for i in range(2)]
        with fm.device("/job:worker/task:0"):
            total = fm.reduce_sum(big) + fm.add_n([fm.reduce_sum(v) for v in small])
        step = prune([total], [], [])
        place(step, WORKER)
    text = describe(step)
    assert text.splitlines()[-1] == "variables on 2 PS tasks: ps-0 1.00 MB (1), ps-1 20.0 KB (2)"
    assert "/job:ps/task:0/device:CPU:0" in text and "big/VarHandleOp" in text
    assert g.get_operation_by_name("big/VarHandleOp").device == "/job:ps/task:0"


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 999, 1000, 10_500, 999_999, 1_050_000, 3 * 10**9)] == [
        "0 B", "999 B", "1.00 KB", "10.5 KB", "1.00 MB", "1.05 MB", "3.00 GB",
    ]


def test_placement_is_deterministic_and_colocates_state():
    outputs = []
    for _ in range(2):
        g = fm.Graph()
        with g.as_default():
            x, y, _, loss, train = build_mlp()
            step = prune([loss], [train], [x, y])
            place(step, WORKER)
            outputs.append(describe(step))
            for n in step.nodes:
                if n.type in ("ReadVariableOp", "AssignSubVariableOp", "AssignVariableOp"):
                    handle = next(src for src, _ in n.inputs if src.type == "VarHandleOp")
                    assert n.device == handle.device
    assert outputs[0] == outputs[1]
    assert "/job:ps/task:1/device:CPU:0" in outputs[0]


def _trains_as_one_process(g, x, y, variables, loss, train, seed: int, steps: int):
    """Train ``steps`` batches in one process and through the partitions, from the same
    start; the losses and the variables after must agree. Returns the partitioned runner
    and the batches."""
    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6))
               for _ in range(steps)]
    with g.as_default():
        init = fm.global_variables_initializer()
    with fm.Session(g) as sess:
        sess.run(init)
        expected = [sess.run([loss, train], {x: bx, y: by})[0] for bx, by in batches]
        expected_vars = sess.run([v.value() for v in variables])

    runner = PartitionedRunner(g)
    runner.run([], targets=[init])
    got = [runner.run([loss], {x: bx, y: by}, targets=[train])[0] for bx, by in batches]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for a, b in zip(runner.run([v.value() for v in variables]), expected_vars, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    return runner, batches


def test_partitioned_training_matches_one_process():
    g = fm.Graph()
    with g.as_default():
        x, y, variables, loss, train = build_mlp()
    runner, _ = _trains_as_one_process(g, x, y, variables, loss, train, seed=0, steps=5)
    assert set(runner.last_parts) == {
        WORKER,
        "/job:ps/task:0/device:CPU:0",
        "/job:ps/task:1/device:CPU:0",
    }
    # The PS tasks hold the variables; the worker holds none.
    assert runner.resources["/job:worker/task:0"].get("w1") is None
    assert runner.resources["/job:ps/task:0"].get("w1") is not None


def test_one_send_recv_pair_per_tensor_and_destination():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            a = fm.constant(np.ones(3, np.float32)) * 2.0
        with fm.device("/job:worker/task:0"):
            b = fm.reduce_sum(a) + fm.reduce_max(a)  # two consumers of one remote tensor
        step = prune([b], [], [])
        place(step, WORKER)
        parts = partition(step, WORKER)
    sends = [n for n in parts["/job:ps/task:0/device:CPU:0"].nodes if n.type == "_Send"]
    recvs = [n for n in parts[WORKER].nodes if n.type == "_Recv"]
    assert len(sends) == len(recvs) == 1
    assert sends[0].attrs["tensor_name"] == recvs[0].attrs["tensor_name"]


def test_small_constants_are_copied_to_the_tasks_that_read_them():
    """A learning rate on the global step's PS task read by an update on another: a copy
    of the constant there, no pull per step. A big constant still travels."""
    big = np.arange(DUPLICATE_CONST_BYTES // 4 + 1, dtype=np.float32)
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            lr = fm.constant(0.5, name="lr")
            table = fm.constant(big, name="table")
            guarded = fm.constant(2.0, name="guarded")
            with fm.control_dependencies([guarded]):
                after = fm.constant(3.0, name="after")  # waits on a control edge: sent
        with fm.device("/job:ps/task:1"):
            v = fm.Variable(4.0, name="v")  # not foldable: the constants stay as they are
            out = lr * v + fm.reduce_sum(table * v) * 0.0 + after
    runner = PartitionedRunner(g)
    runner.run([], targets=[v.initializer])
    assert runner.run([out]) == [5.0]
    parts = runner.last_parts
    ps1 = parts["/job:ps/task:1/device:CPU:0"]
    received = {n.attrs["tensor_name"] for n in ps1.nodes if n.type == "_Recv"}
    assert received == {"table:0", "after:0"}
    copies = [n for n in ps1.nodes if n.type == "Const" and n.name.startswith("lr/")]
    assert len(copies) == 1 and copies[0].device == "/job:ps/task:1/device:CPU:0"
    sent = {n.attrs["tensor_name"] for n in parts["/job:ps/task:0/device:CPU:0"].nodes
            if n.type == "_Send"}
    assert "lr:0" not in sent


def test_control_edges_and_dead_values_cross_devices():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            counter = fm.Variable(0.0, name="counter")
            bump = counter.assign_add(1.0)
        with fm.device("/job:worker/task:0"):
            flag = fm.placeholder(fm.bool_, (), name="flag")
            with fm.control_dependencies([bump]):
                after = fm.constant(5.0) * 2.0
            p_false, p_true = fm.ops.control_flow_ops.switch(fm.constant(3.0), flag)
        with fm.device("/job:ps/task:0"):
            remote = p_true * 10.0  # computed on the PS from a maybe-dead value
        with fm.device("/job:worker/task:0"):
            merged, _ = fm.ops.control_flow_ops.merge([p_false, remote])
        init = counter.initializer
    runner = PartitionedRunner(g)
    runner.run([], targets=[init])
    assert runner.run([after]) == [10.0]
    assert runner.run([merged], {flag: True}) == [30.0]
    assert runner.run([merged], {flag: False}) == [3.0]
    assert runner.run([counter.value()]) == [1.0]


def test_a_group_run_as_a_target_sends_no_control_tensors():
    """A ``group()`` of updates on two PS tasks, run on the worker (a train op): each update
    becomes a target of its own partition and no control tensor crosses; a group that
    another op waits on still hears from each task."""
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            a = fm.Variable(0.0, name="a")
        with fm.device("/job:ps/task:1"):
            b = fm.Variable(0.0, name="b")
        with fm.device("/job:worker/task:0"):
            train = fm.group(a.assign_add(1.0), b.assign_add(2.0), name="train")
            with fm.control_dependencies([fm.group(a.assign_add(10.0), name="gate")]):
                after = fm.constant(1.0) + 1.0
        init = fm.group(a.initializer, b.initializer)
    runner = PartitionedRunner(g)
    runner.run([], targets=[init])
    for _ in range(3):
        runner.run([], targets=[train])
    assert runner.run([a.value(), b.value()]) == [3.0, 6.0]
    runner.run([], targets=[train])
    parts = runner.last_parts
    for device, part in parts.items():
        assert not [n for n in part.nodes if n.type in ("_Send", "_Recv")], device
    assert [t.type for t in parts["/job:ps/task:0/device:CPU:0"].targets] == ["AssignAddVariableOp"]
    assert [t.type for t in parts["/job:ps/task:1/device:CPU:0"].targets] == ["AssignAddVariableOp"]
    assert parts[WORKER].targets[0].control == []

    assert runner.run([after]) == [2.0]
    assert runner.run([a.value()]) == [14.0]
    runner.run([after])
    received = [n.attrs["tensor_name"] for n in runner.last_parts[WORKER].nodes
                if n.type == "_Recv"]
    assert len(received) == 1 and received[0].endswith("/_control:0")


def _control_recvs(part) -> list[str]:
    return [n.attrs["tensor_name"] for n in part.nodes
            if n.type == "_Recv" and "/_control" in n.attrs["tensor_name"]]


def test_an_update_group_waited_on_by_the_global_step_runs_with_it():
    """``minimize`` with a global step: the optimizer's ``group()`` of its updates (a
    ``NoOp`` placed on the worker) is what the increment waits on. It runs on the global
    step's task instead: no control value reaches the worker, and each other PS task
    sends the global step's task one, after all its updates. Training is unchanged."""
    g = fm.Graph()
    with g.as_default():
        x, y, variables, loss, _ = build_mlp(strategy="round_robin")
        with fm.device(replica_device_setter(CLUSTER, worker_device="/job:worker/task:0",
                                             strategy="round_robin")):
            step = fm.train.get_or_create_global_step()
            train = fm.train.GradientDescent(0.1).minimize(loss, global_step=step)
    runner, batches = _trains_as_one_process(g, x, y, variables, loss, train, seed=1, steps=4)
    assert runner.run([step.value()]) == [4]

    runner.run([loss], {x: batches[0][0], y: batches[0][1]}, targets=[train])
    parts = runner.last_parts
    assert _control_recvs(parts[WORKER]) == []
    assert not [n for n in parts[WORKER].nodes
                if n.type == "_Send" and "/_control" in n.attrs["tensor_name"]]
    gs_task = step.handle.op.device.split("/device")[0]
    gs_part = parts[gs_task + "/device:CPU:0"]
    assert "update" in {n.name.rsplit("/", 1)[-1] for n in gs_part.nodes if n.type == "NoOp"}
    other = [d for d in parts if d != WORKER and not d.startswith(gs_task)]
    assert len(other) == 1  # the PS task without the global step: one token, all updates
    assert len(_control_recvs(gs_part)) == 1


def test_control_edges_from_one_task_cross_as_one_value():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            vs = [fm.Variable(0.0, name=f"v{i}") for i in range(3)]
        with fm.device("/job:worker/task:0"):
            with fm.control_dependencies([v.assign_add(float(i + 1)).op
                                          for i, v in enumerate(vs)]):
                after = fm.constant(1.0) + 1.0
        init = fm.group(*[v.initializer for v in vs])
    runner = PartitionedRunner(g)
    runner.run([], targets=[init])
    assert runner.run([after]) == [2.0]
    assert runner.run([v.value() for v in vs]) == [1.0, 2.0, 3.0]
    runner.run([after])
    assert runner.run([v.value() for v in vs]) == [2.0, 4.0, 6.0]  # each waited-on op ran
    runner.run([after])
    (token,) = _control_recvs(runner.last_parts[WORKER])  # one value, after all three
    (made,) = [n for n in runner.last_parts["/job:ps/task:0/device:CPU:0"].nodes
               if n.type == "Const" and "/_control" in n.name]
    assert sorted(c.type for c in made.control) == ["AssignAddVariableOp"] * 3


def test_colocation_wins_over_device_scopes_and_conflicts_are_reported():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            a = fm.constant(1.0, name="a")
        with fm.device("/job:ps/task:1"), fm.colocate_with(a):
            b = fm.identity(a, name="b")
        assert b.op.device == "/job:ps/task:0"
        step = prune([b], [], [])
        step.nodes[-1].device = "/job:ps/task:1"  # a request that contradicts the group
        with pytest.raises(PlacementError, match="a on /job:ps/task:0, b on /job:ps/task:1"):
            place(step, WORKER)


def test_loops_must_stay_on_one_device():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:worker/task:0"):
            i = fm.constant(0)

            def body(i):
                with fm.device("/job:ps/task:0"):
                    return i + 1

            out = fm.while_loop(lambda i: i < 3, body, i)
        step = prune([out], [], [])
        place(step, WORKER)
        with pytest.raises(PartitionError, match="spans"):
            partition(step, WORKER)


def test_complete_device():
    assert complete_device("/job:ps", WORKER) == "/job:ps/task:0/device:CPU:0"
    assert complete_device("/device:GPU:1", WORKER) == "/job:worker/task:0/device:GPU:1"
    assert complete_device("", "/job:worker/task:3") == "/job:worker/task:3/device:CPU:0"


def test_sent_variable_read_is_a_snapshot_not_the_live_buffer():
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            v = fm.Variable(np.zeros(3, np.float32), name="v")
            read = v.value()
            with fm.control_dependencies([read]):
                bump = v.assign_add(np.ones(3, np.float32))
        with fm.device("/job:worker/task:0"):
            y = read * 1.0
    runner = PartitionedRunner(g)
    runner.run([], targets=[v.initializer])
    for step in range(3):
        (got,) = runner.run([y], targets=[bump.op])
        np.testing.assert_array_equal(got, [step] * 3)
