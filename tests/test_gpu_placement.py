"""Devices in a task, on the strict GPU stand-in: where ops go, soft placement, and the
host/device copies a step makes (counted by the stand-in)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime import local_devices, placement
from flowmill.runtime.step_graph import StepGraph


def _mlp(batch: int = 4):
    rng = np.random.default_rng(0)
    x = fm.placeholder(fm.float32, [None, 8], name="x")
    y = fm.placeholder(fm.int64, [None], name="y")
    w1 = fm.Variable(rng.normal(size=(8, 16)).astype(np.float32), name="w1")
    b1 = fm.Variable(np.zeros(16, np.float32), name="b1")
    w2 = fm.Variable(rng.normal(size=(16, 3)).astype(np.float32), name="w2")
    h = fm.nn.relu(fm.matmul(x, w1) + b1)
    logits = fm.matmul(h, w2)
    loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                          logits=logits))
    train = fm.train.GradientDescentOptimizer(0.1).minimize(loss)
    feeds = {x: rng.normal(size=(batch, 8)).astype(np.float32),
             y: rng.integers(0, 3, batch).astype(np.int64)}
    return loss, train, feeds


def _devices(call) -> dict[str, str]:
    return {n.name: n.device.rsplit("device:", 1)[-1] for n in call.plan.order}


def _train_losses(steps: int = 5) -> list[float]:
    graph = fm.Graph(seed=1)
    with graph.as_default():
        loss, train, feeds = _mlp()
        with fm.Session(graph) as sess:
            sess.run(fm.global_variables_initializer())
            return [float(sess.run([loss, train], feeds)[0]) for _ in range(steps)]


def test_a_task_lists_its_devices(standin_gpu, monkeypatch):
    assert local_devices.local_devices() == ["CPU:0", "GPU:0", "GPU:1"]
    monkeypatch.setenv("FLOWMILL_GPUS", "1")
    local_devices.gpu_count.cache_clear()
    assert local_devices.local_devices() == ["CPU:0", "GPU:0"]
    monkeypatch.setenv("FLOWMILL_GPUS", "0")
    local_devices.gpu_count.cache_clear()
    assert local_devices.local_devices() == ["CPU:0"]
    monkeypatch.setenv("FLOWMILL_GPUS", "two")
    local_devices.gpu_count.cache_clear()
    with pytest.raises(ValueError, match="FLOWMILL_GPUS must be a whole number"):
        local_devices.gpu_count()


def test_without_a_gpu_module_a_task_has_only_its_cpu():
    local_devices.gpu_count.cache_clear()
    assert local_devices.local_devices() == ["CPU:0"]


def test_compute_goes_to_gpu0_and_state_stays_on_the_cpu(standin_gpu):
    graph = fm.Graph(seed=1)
    with graph.as_default():
        loss, train, feeds = _mlp()
        with fm.Session(graph) as sess:
            sess.run(fm.global_variables_initializer())
            call = sess.make_callable([loss, train], list(feeds))
            devices = _devices(call)
            by_type = {}
            for n in call.plan.order:
                by_type.setdefault(n.type, set()).add(devices[n.name])
    assert by_type["MatMul"] == {"GPU:0"}
    assert by_type["SparseSoftmaxCrossEntropyWithLogits"] == {"GPU:0"}
    assert by_type["VarHandleOp"] == {"CPU:0"}
    assert by_type["ReadVariableOp"] == {"CPU:0"}
    assert by_type["_Arg"] == {"CPU:0"}  # feeds arrive in host memory
    assert by_type["_HostToDevice"] == {"GPU:0"}
    assert by_type["_DeviceToHost"] == {"GPU:0"}


def test_a_training_step_copies_each_value_once(standin_gpu):
    """Per step: the 2 feeds and the 3 variables' values to the GPU, the 3 gradients
    back to the variables on the CPU, the loss back to the caller; nothing else, and no
    implicit synchronization."""
    graph = fm.Graph(seed=1)
    with graph.as_default():
        loss, train, feeds = _mlp()
        with fm.Session(graph) as sess:
            sess.run(fm.global_variables_initializer())
            sess.run([loss, train], feeds)
            standin_gpu.reset_counts()
            for _ in range(3):
                value, _ = sess.run([loss, train], feeds)
            counts = standin_gpu.counts()
    assert isinstance(value, np.ndarray | np.generic)
    assert counts["h2d"] == 3 * (2 + 3)
    assert counts["d2h"] == 3 * (3 + 1)
    assert counts["syncs"] == 0


def test_variables_placed_on_a_gpu_leave_only_feeds_and_fetches_to_copy(standin_gpu):
    graph = fm.Graph(seed=1)
    with graph.as_default(), fm.device("/gpu:0"):
        loss, train, feeds = _mlp()
        with fm.Session(graph) as sess:
            sess.run(fm.global_variables_initializer())
            sess.run([loss, train], feeds)
            standin_gpu.reset_counts()
            sess.run([loss, train], feeds)
            counts = standin_gpu.counts()
            assert counts["h2d"] == 2 and counts["d2h"] == 1
            weights = sess.run(fm.global_variables())
    assert all(type(w) is np.ndarray for w in weights)


def test_training_on_the_gpu_matches_the_cpu(standin_gpu):
    on_gpu = _train_losses()
    standin_gpu_off = fm.Graph  # noqa: F841 - same graph code, the CPU below
    from flowmill.kernels import remove_array_module

    remove_array_module("GPU")
    local_devices.gpu_count.cache_clear()
    on_cpu = _train_losses()
    from flowmill.kernels import add_array_module

    add_array_module("GPU", standin_gpu.module(2))
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-5)
    assert on_gpu[-1] < on_gpu[0]


def test_an_op_without_a_gpu_kernel_falls_back_to_the_cpu_once_said(standin_gpu, caplog):
    placement._told_cpu.clear()
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        x = fm.placeholder(fm.float32, [3])
        y = fm.print(x * 2.0, x, message="x: ")
        z = fm.print(y + 1.0, y, message="y: ")
    with caplog.at_level(logging.WARNING, logger="flowmill.placement"), fm.Session(graph) as s:
        got = s.run(z, {x: np.ones(3, np.float32)})
        call = s.make_callable(z, [x])
    np.testing.assert_allclose(got, 3.0)
    devices = _devices(call)
    assert {devices[n.name] for n in call.plan.order if n.type == "Print"} == {"CPU:0"}
    assert {devices[n.name] for n in call.plan.order if n.type == "Mul"} == {"GPU:0"}
    said = [r.getMessage() for r in caplog.records if "Print" in r.getMessage()]
    assert said == ["Print runs on the CPU: decides and formats on the host"]


def test_ops_placed_on_gpu1_run_there(standin_gpu):
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [2, 2])
        with fm.device("/gpu:0"):
            a = fm.matmul(x, x)
        with fm.device("/gpu:1"):
            b = fm.tanh(a) * 2.0
        with fm.device("/gpu:0"):
            c = a + b
    value = np.arange(4, dtype=np.float32).reshape(2, 2) / 4
    with fm.Session(graph) as s:
        got = s.run(c, {x: value})
        call = s.make_callable(c, [x])
    a_ = value @ value
    np.testing.assert_allclose(got, a_ + 2 * np.tanh(a_), rtol=1e-6)
    devices = _devices(call)
    tanh = [n for n in call.plan.order if n.type == "Tanh" or
            "Tanh" in [t for t, _ in n.attrs.get("program", ())]]
    assert {devices[n.name] for n in tanh} == {"GPU:1"}
    assert {devices[n.name] for n in call.plan.order if n.type == "MatMul"} == {"GPU:0"}


def test_a_gpu_the_task_lacks_falls_back_to_the_cpu(standin_gpu, caplog):
    placement._told_cpu.clear()
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:5"):
        x = fm.placeholder(fm.float32, [2])
        y = x * 3.0
    with caplog.at_level(logging.WARNING, logger="flowmill.placement"), fm.Session(graph) as s:
        np.testing.assert_allclose(s.run(y, {x: np.ones(2, np.float32)}), 3.0)
    assert any("GPU:5 run on the CPU: this task has 2 GPUs" in r.getMessage()
               for r in caplog.records)


def test_describe_shows_each_nodes_device(standin_gpu):
    graph = fm.Graph(seed=1)
    with graph.as_default():
        loss, train, feeds = _mlp()
        with fm.Session(graph) as sess:
            call = sess.make_callable(loss, list(feeds))
    text = placement.describe(StepGraph(list(call.plan.order), [], []))
    assert any(line.split()[0].endswith("device:GPU:0") and line.split()[-1] == "MatMul"
               for line in text.splitlines())
    assert any(line.split()[0].endswith("device:CPU:0") and line.split()[-1] == "VarHandleOp"
               for line in text.splitlines())


def test_a_shape_read_on_the_gpu_stays_in_host_memory(standin_gpu):
    """``Shape`` gives its value in host memory, the arithmetic on it stays there, and the
    fill that takes it as its shape reads it there: no copy of the shape, and no
    synchronization."""
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [None, 6])
        y = fm.zeros(fm.stack([fm.shape(x)[0] * 3, 2])) + fm.reduce_sum(x)
    with fm.Session(graph) as s:
        s.run(y, {x: np.ones((2, 6), np.float32)})
        standin_gpu.reset_counts()
        got = s.run(y, {x: np.ones((2, 6), np.float32)})
    assert got.shape == (6, 2) and got[0, 0] == 12.0
    counts = standin_gpu.counts()
    assert counts["syncs"] == 0, counts


def test_a_label_out_of_range_gives_a_nan_row_on_the_gpu_without_a_synchronization(
        standin_gpu):
    """On the CPU the same step raises (test_ops_nn); a GPU would have to stop its stream
    to raise, so the row's loss is NaN (``flowmill ops`` says so)."""
    graph = fm.Graph()
    with graph.as_default():
        logits = fm.placeholder(fm.float32, [3, 4])
        labels = fm.placeholder(fm.int64, [3])
        loss = fm.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    with fm.Session(graph) as s:
        feeds = {logits: np.zeros((3, 4), np.float32), labels: np.array([0, 7, 3])}
        s.run(loss, feeds)
        standin_gpu.reset_counts()
        got = s.run(loss, feeds)
    assert np.isnan(got[1]) and np.allclose(got[[0, 2]], np.log(4.0))
    assert standin_gpu.counts()["syncs"] == 0


def test_gather_indices_wrap_around_on_the_gpu(standin_gpu):
    graph = fm.Graph()
    with graph.as_default():
        params = fm.placeholder(fm.float32, [4])
        indices = fm.placeholder(fm.int64, [2])
        got = fm.gather(params, indices)
    with fm.Session(graph) as s:
        value = s.run(got, {params: np.arange(4, dtype=np.float32), indices: np.array([1, 5])})
    np.testing.assert_array_equal(value, [1.0, 1.0])


def test_values_copied_off_a_gpu_and_big_tensors_received_land_in_pinned_memory(standin_gpu):
    from flowmill.kernels import pinned_allocator
    from flowmill.runtime.transport import BufferPool

    pool = BufferPool()
    pool.allocate = pinned_allocator()
    big, small = pool.take(2 << 20), pool.take(100)
    assert big.nbytes == 2 << 20 and big.dtype == np.uint8 and small.nbytes == 100
    assert standin_gpu.counts()["pinned"] == 1  # the small one is not worth pinning
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [3])
        y = x * 2.0
    with fm.Session(graph) as s:
        s.run(y, {x: np.ones(3, np.float32)})
    assert standin_gpu.counts()["pinned"] == 2  # the fetch came back through pinned memory


def test_a_task_with_a_gpu_exports_its_device_memory(standin_gpu):
    from flowmill.runtime import telemetry as tm

    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        v = fm.Variable(np.zeros((256, 256), np.float32))  # 256 KiB on the GPU
    with fm.Session(graph) as sess:
        sess.run(v.initializer)
        text = tm.Telemetry().prometheus()
    used = [line for line in text.splitlines() if line.startswith("flowmill_gpu_memory_used")]
    held = [line for line in text.splitlines() if line.startswith("flowmill_gpu_memory_held")]
    assert used and held and "# TYPE flowmill_gpu_memory_used_bytes gauge" in text
    assert float(used[0].rsplit(" ", 1)[1]) >= 256 * 256 * 4
    assert float(held[0].rsplit(" ", 1)[1]) >= float(used[0].rsplit(" ", 1)[1])


# ---- ConfigProto's placement options


def _placed_print(device: str):
    graph = fm.Graph()
    with graph.as_default(), fm.device(device):
        x = fm.placeholder(fm.float32, [3], name="x")
        y = fm.print(x * 2.0, message="x: ", name="shown")
    return graph, x, y


def test_without_soft_placement_an_op_with_no_gpu_kernel_is_an_error(standin_gpu):
    graph, x, y = _placed_print("/gpu:0")
    config = fm.ConfigProto(allow_soft_placement=False)
    with fm.Session(graph, config=config) as sess:
        with pytest.raises(placement.PlacementError,
                           match=r"cannot place shown \(Print\) on GPU:0 \(Print: .+\); "
                                 r"ConfigProto\(allow_soft_placement=True\)"):
            sess.run(y, {x: np.ones(3, np.float32)})
    with fm.Session(graph) as sess:  # soft, by default: the Print runs on the CPU
        np.testing.assert_array_equal(sess.run(y, {x: np.ones(3, np.float32)}), [2, 2, 2])


def test_without_soft_placement_a_gpu_the_task_lacks_is_an_error(standin_gpu):
    graph, x, y = _placed_print("/gpu:0")
    with graph.as_default(), fm.device("/gpu:5"):
        z = fm.exp(x, name="far")
    with fm.Session(graph, config=fm.ConfigProto(allow_soft_placement=False)) as sess:
        with pytest.raises(placement.PlacementError,
                           match=r"cannot place far \(Exp\) on GPU:5 \(this task has 2 GPUs\)"):
            sess.run(z, {x: np.ones(3, np.float32)})


def test_without_soft_placement_and_without_a_gpu_a_gpu_op_is_an_error():
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [3], name="x")
        with fm.device("/gpu:0"):
            z = fm.exp(x, name="on_gpu")
        w = fm.exp(x, name="anywhere")
    with fm.Session(graph, config=fm.ConfigProto(allow_soft_placement=False)) as sess:
        np.testing.assert_allclose(sess.run(w, {x: np.zeros(3, np.float32)}), [1, 1, 1])
        with pytest.raises(placement.PlacementError, match=r"this task has 0 GPUs"):
            sess.run(z, {x: np.zeros(3, np.float32)})


def test_device_count_keeps_a_session_off_the_gpus(standin_gpu):
    graph = fm.Graph(seed=1)
    with graph.as_default():
        loss, train, feeds = _mlp()
    with fm.Session(graph, config=fm.ConfigProto(device_count={"GPU": 0})) as sess:
        sess.run(fm.global_variables_initializer())
        standin_gpu.reset_counts()
        for _ in range(2):
            sess.run([loss, train], feeds)
        counts = standin_gpu.counts()
        assert counts["launches"] == counts["h2d"] == counts["d2h"] == 0
    with pytest.raises(ValueError, match=r"device_count\['GPU'\] must be a count >= 0"):
        fm.ConfigProto(device_count={"GPU": -1})
    with pytest.raises(ValueError, match="unknown device type 'TPU'"):
        fm.ConfigProto(device_count={"TPU": 1})


def test_log_device_placement_says_where_each_op_runs(standin_gpu, capsys):
    graph, x, y = _placed_print("/gpu:0")
    with fm.Session(graph, config=fm.ConfigProto(log_device_placement=True)) as sess:
        sess.run(y, {x: np.ones(3, np.float32)})
    err = capsys.readouterr().err
    assert "Device mapping:" in err
    lines = {line.split()[1]: line.split()[0] for line in err.splitlines()
             if len(line.split()) == 3}
    assert lines["shown"].endswith("CPU:0") and lines["Mul"].endswith("GPU:0")


def test_device_buffers_are_released_after_their_last_use(standin_gpu):
    """As on the CPU, a step drops each value after its last reader: a chain of twelve
    1 MiB products never holds more than a few of them on the device at once."""
    n, mib = 12, 2**20
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        x = fm.placeholder(fm.float32, [512, 512], name="x")
        h = x
        for _ in range(n):
            h = fm.matmul(h, x) * 0.001
        total = fm.reduce_sum(h)
    with fm.Session(graph) as sess:
        step = sess.make_callable(total, [x])
        value = np.eye(512, dtype=np.float32)
        step(value)
        pool = standin_gpu.get_default_memory_pool()
        pool.free_all_blocks()
        step(value)
        peak = pool.total_bytes()
    assert peak <= 4 * mib, f"{peak / mib:.1f} MiB held at once for a chain of {n} MiB"
    assert peak >= 2 * mib  # the feed and a product, at least: the count is not vacuous
