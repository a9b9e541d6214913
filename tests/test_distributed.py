"""Steps across processes: PS tasks run ``python -m flowmill.runtime.server``, the worker
runs a DistributedSession in the test process, and training computes exactly what one
process computes. Failures (a malformed graph, an unknown handle, an op failing on a PS, a
PS killed mid-run) come back as errors naming the task, never as a hang."""

import signal
import threading
import time

import grpc
import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.cluster import ClusterSpec
from flowmill.runtime.graph_def import to_graph_def
from flowmill.runtime.partition import partition
from flowmill.runtime.placement import place, replica_device_setter
from flowmill.runtime.protos import task_service_pb2 as pb
from flowmill.runtime.prune import prune
from flowmill.runtime.task_errors import TaskError

from local_cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


@pytest.fixture
def own_cluster(tmp_path):
    clusters = []

    def start(num_ps: int) -> LocalCluster:
        clusters.append(LocalCluster(num_ps, tmp_path))
        return clusters[-1]

    yield start
    for c in clusters:
        c.close()


def build_mlp(spec: ClusterSpec, prefix: str):
    with fm.device(replica_device_setter(spec, worker_device="/job:worker/task:0")):
        x = fm.placeholder(fm.float32, (None, 4), name="x")
        y = fm.placeholder(fm.int64, (None,), name="y")
        w1 = fm.Variable(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), name=f"{prefix}w1")
        b1 = fm.Variable(np.zeros(8, np.float32), name=f"{prefix}b1")
        w2 = fm.Variable(np.linspace(1, -1, 24, dtype=np.float32).reshape(8, 3), name=f"{prefix}w2")
        h = fm.nn.relu(fm.matmul(x, w1) + b1)
        logits = fm.matmul(h, w2)
        loss = fm.reduce_mean(
            fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
        train = fm.train.Momentum(0.1, 0.9).minimize(loss)
    return x, y, [w1, b1, w2], loss, train


def batches(n: int):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6)) for _ in range(n)]


def test_training_across_processes_matches_one_process(cluster):
    data = batches(20)
    g = fm.Graph()
    with g.as_default():
        x, y, variables, loss, train = build_mlp(cluster.spec, "mlp/")
        init = fm.global_variables_initializer()
    with fm.Session(g) as sess:
        sess.run(init)
        expected_losses = [sess.run([loss, train], {x: bx, y: by})[0] for bx, by in data]
        expected = sess.run([v.value() for v in variables])

    sess = cluster.session(g)
    sess.run(init)
    losses = [sess.run([loss, train], {x: bx, y: by})[0] for bx, by in data]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    got = sess.run([v.value() for v in variables])
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # A PS variable fetched by itself; the worker holds none of them.
    np.testing.assert_allclose(sess.run(variables[2]), expected[2], rtol=1e-6)
    assert all(cluster.worker.resources.get(v.op.name) is None for v in variables)
    # make_callable runs the same plan
    step = sess.make_callable(loss, [x, y])
    np.testing.assert_allclose(step(*data[0]), sess.run(loss, {x: data[0][0], y: data[0][1]}))
    # Every value sent was received; the worker's rendezvous holds nothing of the steps.
    assert len(cluster.worker.rendezvous) == 0 and cluster.worker.rendezvous.num_waiting() == 0
    for i in range(2):
        status = cluster.stub(i).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert status.unreceived_values == 0 and status.num_graphs >= 2
    sess.close()


def test_malformed_graph_is_invalid_argument_and_the_task_keeps_serving(cluster):
    stub = cluster.stub(0)
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterGraph(
            pb.RegisterGraphRequest(graph_def=b"\xff\xfe garbage \x00\x01", session_handle="t"),
            timeout=10,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "/job:ps/task:0" in info.value.details()
    assert "GraphDef" in info.value.details()
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.task == "/job:ps/task:0" and status.tensor_address
    assert status.tensor_local_address.startswith("unix-abstract:flowmill-tensors-")
    # A well-formed partition of another task's device is refused too.
    g = fm.Graph()
    with g.as_default(), fm.device("/job:ps/task:1"):
        c = fm.constant(1.0) * 2.0
    step = prune([c], [], [])
    place(step, "/job:worker/task:0")
    parts = partition(step, "/job:worker/task:0/device:CPU:0")
    data = to_graph_def(parts["/job:ps/task:1/device:CPU:0"]).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterGraph(pb.RegisterGraphRequest(graph_def=data), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not on this task" in info.value.details()
    assert cluster.stub(1).RegisterGraph(pb.RegisterGraphRequest(graph_def=data), timeout=10)


def test_run_of_an_unknown_graph_handle_is_not_found(cluster):
    stub = cluster.stub(1)
    with pytest.raises(grpc.RpcError) as info:
        stub.RunGraph(pb.RunGraphRequest(graph_handle="graph-nope", step_id=7), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "/job:ps/task:1" in info.value.details() and "graph-nope" in info.value.details()
    stub.CleanupStep(pb.CleanupStepRequest(step_id=7), timeout=10)


def test_an_op_failing_on_a_ps_names_the_task_and_op_and_the_step_is_retried(cluster):
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:1"):
            v = fm.Variable(np.arange(3, dtype=np.float32), name="late/v")
        with fm.device("/job:worker/task:0"):
            doubled = v.value() * 2.0
    sess = cluster.session(g, step_timeout=60)
    start = time.monotonic()
    with pytest.raises(TaskError) as info:
        sess.run(doubled)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert info.value.task == "/job:ps/task:1"
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "(ReadVariableOp)" in message and "late/v" in message
    # The failed step is gone everywhere; the same step runs once the variable exists.
    sess.run(v.initializer)
    np.testing.assert_array_equal(sess.run(doubled), [0.0, 2.0, 4.0])
    assert len(cluster.worker.rendezvous) == 0
    sess.close()
    status = cluster.stub(1).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.unreceived_values == 0


def test_a_gather_failing_on_a_ps_is_named_by_name_op_type_and_task(cluster):
    """The PS compiles its partition with each variable read moved to just before its
    first use, so kernel numbers are not topological positions: the failing op is named
    from the plan's own order (a failing Gather was once reported as another op)."""
    g = fm.Graph()
    with g.as_default():
        idx = fm.placeholder(fm.int64, (None,), name="ids")
        with fm.device("/job:ps/task:0"):
            table = fm.Variable(np.arange(12, dtype=np.float32).reshape(4, 3), name="emb/table")
            bias = fm.Variable(np.ones(3, np.float32), name="emb/bias")
            b = bias.value()  # read first, used last: the compiler moves it past the Gather
            rows = fm.gather(table.value(), idx, name="emb/lookup")
            out = rows + b
    sess = cluster.session(g, step_timeout=60)
    sess.run([table.initializer, bias.initializer])
    np.testing.assert_array_equal(sess.run(out, {idx: [1]}), [[4.0, 5.0, 6.0]])
    with pytest.raises(TaskError) as info:
        sess.run(out, {idx: [1, 9]})
    message = str(info.value)
    assert info.value.task == "/job:ps/task:0"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "op 'emb/lookup' (Gather)" in message, message
    assert "/job:ps/task:0" in message
    sess.close()


def test_a_killed_ps_fails_the_next_step_with_its_name(own_cluster):
    c = own_cluster(2)
    g = fm.Graph()
    data = batches(3)
    with g.as_default():
        x, y, _, loss, train = build_mlp(c.spec, "")
        init = fm.global_variables_initializer()
    sess = c.session(g, step_timeout=60)
    sess.run(init)
    for bx, by in data[:2]:
        sess.run([loss, train], {x: bx, y: by})
    c.procs[1].kill()
    c.procs[1].wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(TaskError, match="/job:ps/task:1") as info:
        sess.run([loss, train], {x: data[2][0], y: data[2][1]})
    assert time.monotonic() - start < 30
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    sess.close()


def test_a_ps_killed_while_a_step_waits_on_it_fails_the_step(own_cluster):
    c = own_cluster(1)
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            q = fm.FIFOQueue(2, fm.float32, shapes=[()], name="q")
            item = q.dequeue()  # nothing is ever enqueued: the step waits on the PS
        with fm.device("/job:worker/task:0"):
            out = item + 1.0
    sess = c.session(g, step_timeout=60)
    sess.run(q.size())  # the queue exists on the PS
    outcome = {}

    def run():
        try:
            sess.run(out)
        except Exception as e:
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.5)
    c.procs[0].kill()
    c.procs[0].wait(timeout=30)
    t.join(timeout=30)
    assert not t.is_alive(), "the step hung after its PS died"
    assert isinstance(outcome.get("error"), TaskError), outcome
    assert "/job:ps/task:0" in str(outcome["error"])
    sess.close()


def test_a_step_past_its_timeout_fails_and_its_wait_on_the_ps_ends(cluster):
    """The step's thread reads the PS's answer only after its own partition, which waits
    for the dequeued value: the session's step timeout ends the step all the same, and
    the dequeue left waiting on the PS ends with it (a later enqueue is not taken)."""
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            q = fm.FIFOQueue(2, fm.float32, shapes=[()], name="timeout/q")
            item = q.dequeue()
            put = q.enqueue([fm.constant(7.0)])
        with fm.device("/job:worker/task:0"):
            out = item + 1.0
    sess = cluster.session(g, step_timeout=1.0)
    sess.run(q.size())
    start = time.monotonic()
    with pytest.raises((TaskError, TimeoutError)) as info:
        sess.run(out)
    took = time.monotonic() - start
    assert 1.0 <= took < 20, took
    assert "timeout" in str(info.value).lower() or "deadline" in str(info.value).lower()
    sess.run(put)
    assert sess.run(q.size()) == 1  # the timed-out dequeue did not take it
    assert sess.run(out) == 8.0
    sess.close()


def test_a_local_failure_ends_a_remote_partition_waiting_on_a_queue(cluster):
    """The worker's partition fails while the PS's waits on an empty queue: the step ends
    (the PS is told to clean the step up before its answer is read), with the local
    error, and the queue is left as it was."""
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:1"):
            q = fm.FIFOQueue(2, fm.float32, shapes=[()], name="local_fail/q")
            waiting = q.dequeue()
        with fm.device("/job:worker/task:0"):
            x = fm.placeholder(fm.float32, (None,), name="local_fail/x")
            bad = fm.debugging.check_numerics(x, "x is not finite")
    sess = cluster.session(g)
    sess.run(q.size())
    start = time.monotonic()
    with pytest.raises(Exception, match="x is not finite"):
        sess.run([bad, waiting], {x: np.array([np.nan], np.float32)})
    assert time.monotonic() - start < 20
    assert sess.run(q.size()) == 0
    sess.close()


def test_a_remote_failure_ends_the_step_while_the_client_waits_on_another_task(cluster):
    """PS 0's partition fails while the worker waits on a value PS 1 has not sent (its
    partition waits on an empty queue), with no edge between the two PS tasks: PS 0 tells
    the worker's task to end the step, so the step fails at once with PS 0's error
    (before, the worker waited for PS 1 until the step's timeout), and PS 1's wait ends."""
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:1"):
            q = fm.FIFOQueue(2, fm.float32, shapes=[()], name="remote_fail/q")
            waiting = q.dequeue()
        with fm.device("/job:ps/task:0"):
            v = fm.Variable(np.float32(np.nan), name="remote_fail/v")
            bad = fm.debugging.check_numerics(v.value(), "v is not finite")
            with fm.control_dependencies([bad]):
                checked = fm.no_op(name="remote_fail/checked")
    sess = cluster.session(g, step_timeout=60)
    sess.run(v.initializer)
    sess.run(q.size())
    start = time.monotonic()
    with pytest.raises(TaskError, match="v is not finite") as caught:
        sess.run([waiting, checked])
    assert time.monotonic() - start < 20
    assert caught.value.task == "/job:ps/task:0"
    assert sess.run(q.size()) == 0
    sess.close()


def test_shutdown_and_sigterm_stop_a_ps_with_exit_code_zero(own_cluster):
    c = own_cluster(2)
    c.stub(0).Shutdown(pb.ShutdownRequest(), timeout=10)
    assert c.procs[0].wait(timeout=30) == 0
    c.procs[1].send_signal(signal.SIGTERM)
    assert c.procs[1].wait(timeout=30) == 0
    assert "stopped" in c.log_text(0) and "SIGTERM" in c.log_text(1)


def test_concurrent_steps_from_threads_each_count_once(cluster):
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            counter = fm.Variable(np.zeros((), np.float32), name="threads/counter")
        with fm.device("/job:worker/task:0"):
            amount = fm.placeholder(fm.float32, (), name="amount")  # the PS pulls it
        with fm.device("/job:ps/task:0"):
            bump = counter.assign_add(amount)
    sess = cluster.session(g, step_timeout=60)
    sess.run(counter.initializer)
    step = sess.make_callable([], [amount], targets=[bump])
    errors = []

    def work():
        try:
            for _ in range(10):
                step(1.0)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sess.run(counter) == 40.0
    sess.close()


def test_a_step_asks_each_ps_once_for_every_value_it_receives_from_it(cluster):
    """Five variables on ps-0 and five on ps-1, read by one worker step that also sends
    each PS a value: each PS gets one request per step carrying every key (the values
    stream back in one reply each)."""
    g = fm.Graph()
    with g.as_default():
        tables, bumps = [], []
        amount = fm.placeholder(fm.float32, (), name="many/amount")
        for task in (0, 1):
            with fm.device(f"/job:ps/task:{task}"):
                tables += [fm.Variable(np.full((64, 64), 5 * task + i, np.float32),
                                       name=f"many/t{task}_{i}") for i in range(5)]
                counter = fm.Variable(np.float32(0), name=f"many/counter{task}")
                bumps.append(counter.assign_add(amount))  # the PS receives a value too
        with fm.device("/job:worker/task:0"):
            total = fm.add_n([fm.reduce_sum(t.value()) for t in tables])
        init = fm.global_variables_initializer()
    sess = cluster.session(g)
    sess.run(init)
    peers = cluster.worker.peers
    before = {t: peers.tensor_client(t).requests for t in ("/job:ps/task:0", "/job:ps/task:1")}
    steps = 10
    for _ in range(steps):
        assert sess.run([total, *bumps], {amount: 1.0})[0] == 64 * 64 * sum(range(10))
    for task, count in before.items():
        assert peers.tensor_client(task).requests - count == steps, task


def test_a_ps_partition_that_only_reads_answers_with_its_values(cluster):
    """A step that only reads from the PS tasks (an evaluation): each PS's partition
    receives nothing, so the answer to its run carries the values, and the worker pulls
    none (one exchange per PS per step). A failure there still reaches the step."""
    g = fm.Graph()
    with g.as_default():
        tables = []
        for task in (0, 1):
            with fm.device(f"/job:ps/task:{task}"):
                tables += [fm.Variable(np.full((64, 64), 5 * task + i, np.float32),
                                       name=f"answered/t{task}_{i}") for i in range(5)]
        with fm.device("/job:worker/task:0"):
            total = fm.add_n([fm.reduce_sum(t.value()) for t in tables])
        with fm.device("/job:ps/task:1"):
            broken = fm.Variable(np.float32(np.nan), name="answered/broken")
            checked = fm.debugging.check_numerics(broken.value(), "broken is not finite")
        init = fm.global_variables_initializer()
    sess = cluster.session(g)
    sess.run(init)
    peers = cluster.worker.peers
    tasks = ("/job:ps/task:0", "/job:ps/task:1")
    pulls = {t: peers.tensor_client(t).requests for t in tasks}
    runs = {t: peers.tensor_client(t).runs for t in tasks}
    steps = 10
    for _ in range(steps):
        assert sess.run(total) == 64 * 64 * sum(range(10))
    for task in tasks:
        assert peers.tensor_client(task).requests == pulls[task], task
        assert peers.tensor_client(task).runs - runs[task] == steps, task
    with pytest.raises(TaskError, match="broken is not finite") as caught:
        sess.run([total, checked])
    assert caught.value.task == "/job:ps/task:1"
    assert sess.run(total) == 64 * 64 * sum(range(10))


def test_a_message_over_the_tasks_limit_is_refused_before_it_is_decoded(own_cluster,
                                                                         monkeypatch):
    """A task holds a gRPC message whole before decoding it: past its bound (here 1 MB,
    FLOWMILL_GRPC_MAX_MESSAGE_BYTES) a request is refused, and the task keeps serving."""
    monkeypatch.setenv("FLOWMILL_GRPC_MAX_MESSAGE_BYTES", str(1 << 20))
    cluster = own_cluster(1)
    stub = cluster.stub(0)
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterGraph(pb.RegisterGraphRequest(graph_def=b"\0" * (2 << 20)), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).task == "/job:ps/task:0"


def test_a_graph_that_does_not_decode_is_refused_with_one_log_line(own_cluster):
    """Garbage and a hostile feed count are answered INVALID_ARGUMENT; the task logs one
    line for each (what, and from where), not a traceback, and serves on."""
    cluster = own_cluster(1)
    stub = cluster.stub(0)
    hostile = pb.RegisterGraphRequest(graph_def=b"\x20\xff\xff\xff\xff\x07")  # num_feeds
    for request in (pb.RegisterGraphRequest(graph_def=b"\xff" * 64), hostile):
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterGraph(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).task == "/job:ps/task:0"
    lines = [line for line in cluster.log_text(0).splitlines() if "RegisterGraph" in line]
    assert len(lines) == 2, cluster.log_text(0)
    assert "Traceback" not in cluster.log_text(0)


def _ps_partition(build) -> bytes:
    g = fm.Graph()
    with g.as_default(), fm.device("/job:ps/task:0"):
        out = build()
    step = prune([out], [], [])
    place(step, "/job:worker/task:0")
    parts = partition(step, "/job:worker/task:0/device:CPU:0")
    return to_graph_def(parts["/job:ps/task:0/device:CPU:0"]).SerializeToString()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_registering_a_big_fill_allocates_nothing_until_a_step_runs_it(cluster):
    """A 461-byte message claiming a 256 MB Fill once made the task allocate it at
    registration and keep it; a big Fill is made by the step that runs it now."""
    data = _ps_partition(lambda: fm.reduce_sum(fm.fill([1 << 26], 1.0)))
    assert len(data) < 1024
    before = _rss_mb(cluster.procs[0].pid)
    cluster.stub(0).RegisterGraph(pb.RegisterGraphRequest(graph_def=data, session_handle="t"),
                                  timeout=30)
    assert _rss_mb(cluster.procs[0].pid) - before < 64


def test_registered_graphs_and_cleanup_ids_are_bounded(cluster, monkeypatch):
    from flowmill.launcher.local import free_ports
    from flowmill.runtime import server as server_module
    from flowmill.runtime.cluster import TaskConfig

    monkeypatch.setattr(server_module, "MAX_REGISTERED_GRAPHS", 2)
    ps, worker = free_ports(2)
    spec = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]})
    with server_module.Server(TaskConfig(spec, "ps", 0)) as task:
        graphs = [_ps_partition(lambda k=k: fm.constant(float(k)) * 2.0) for k in range(3)]
        first = task.register_graph(graphs[0], "t")
        task.register_graph(graphs[1], "t")
        assert task.register_graph(graphs[0], "t") == first  # the same bytes: no new one
        with pytest.raises(server_module.ResourceExhaustedError, match="2 distinct graphs"):
            task.register_graph(graphs[2], "t")
    with pytest.raises(grpc.RpcError) as info:
        cluster.stub(0).CleanupStep(pb.CleanupStepRequest(step_id=1, more_step_ids=range(5000)),
                                    timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5000 step ids in one call" in info.value.details()


def test_a_task_writes_checkpoints_only_under_its_jobs_checkpoint_uri(monkeypatch, tmp_path):
    """A graph naming another place for SaveShard or CommitCheckpoint (an outsider's
    request to overwrite or prune elsewhere) is refused when registered."""
    from flowmill.launcher.local import free_ports
    from flowmill.runtime.cluster import TaskConfig
    from flowmill.runtime.ops import checkpoint_ops as C
    from flowmill.runtime.server import Server

    root = (tmp_path / "ckpt").as_uri()
    monkeypatch.setenv("FLOWMILL_CHECKPOINT_URI", root)
    ps, worker = free_ports(2)
    spec = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]})

    def saving(uri):
        def build():
            v = fm.Variable(np.ones(3, np.float32), name="v")
            save = C.save_shard(uri, "ps-0", 1, {"v": v.value()})
            with fm.control_dependencies([save]):
                return C.commit_checkpoint(uri, 1, [C.shard_saved(uri, "ps-0", 1)])
        return _ps_partition(build)

    with Server(TaskConfig(spec, "ps", 0)) as task:
        task.register_graph(saving(root), "t")
        task.register_graph(saving(f"{root}/nested"), "t")
        elsewhere = (tmp_path / "elsewhere").as_uri()
        with pytest.raises(ValueError, match="checkpoints are written only under this job's"):
            task.register_graph(saving(elsewhere), "t")
        with pytest.raises(ValueError, match="written only under"):
            task.register_graph(saving(root + "-sibling"), "t")
