"""CUDA graphs per segment of a step (``cuda_graph_segments``, ``cuda_graphs``): which
nodes form a segment, on small hand-built steps, and steps with a host synchronization
in the middle or a ``_Recv``/``_Send`` around their GPU work, run on the strict stand-in
(whose launches of a captured graph count one each)."""

from __future__ import annotations

import logging

import numpy as np
from test_gpu_graphs import _losses, _mlp

import flowmill.runtime as fm
from flowmill.kernels import ARRAY_MODULES
from flowmill.kernels.resources import Resources
from flowmill.runtime.cuda_graph_segments import (
    Role,
    classify,
    contract,
    find_segments,
)
from flowmill.runtime.cuda_graphs import graphed
from flowmill.runtime.executor import Frame, compile_step
from flowmill.runtime.ops.unique_ops import unique
from flowmill.runtime.step_graph import Node, StepGraph, topological_order

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
F32 = np.dtype(np.float32)


def _node(kind: str, name: str, *inputs: Node, device: str = GPU, control=(), **attrs) -> Node:
    return Node(kind, name, attrs, [(n, 0) for n in inputs], list(control), 1, [F32], [(4,)],
                device=device)


def _recv(name: str) -> Node:
    return _node("_Recv", name, device=CPU, src_device="/job:ps/task:0", dst_device=CPU,
                 tensor_name=name, may_be_dead=False)


def _send(name: str, value: Node) -> Node:
    send = _node("_Send", name, value, device=CPU, src_device=CPU,
                 dst_device="/job:ps/task:0", tensor_name=name)
    send.num_outputs, send.dtypes, send.shapes = 0, [], []
    return send


def _names(segments) -> list[list[str]]:
    return [[n.name for n in s.nodes] for s in segments]


def test_a_host_node_between_two_kernels_splits_them_and_no_cycle_forms():
    """``b`` reads ``a`` directly and through the host: one segment of both would wait for
    the host node that waits for it."""
    x = _node("_Arg", "x", device=CPU, index=0)
    up = _node("_HostToDevice", "x/up", x)
    a = _node("Tanh", "a", up)
    a2 = _node("Exp", "a2", a)
    down = _node("_DeviceToHost", "a2/down", a2)
    host = _node("Neg", "host", down, device=CPU)
    back = _node("_HostToDevice", "host/up", host)
    b = _node("Mul", "b", a, back)
    b2 = _node("Sin", "b2", b)
    out = _node("_DeviceToHost", "b2/down", b2)
    step = StepGraph([x, up, a, a2, down, host, back, b, b2, out], [(out, 0)], [], [x])
    segments, outside = find_segments(step, GPU)
    assert _names(segments) == [["x/up", "a", "a2", "a2/down"],
                                ["host/up", "b", "b2", "b2/down"]]
    assert "depends on a feed or on state" in outside[host]
    first, second = segments
    assert [ref[0].name for _, ref in second.inputs] == ["host", "a"]
    assert [n.name for n, _ in first.outputs] == ["a", "a2/down"]
    nodes = [Node("_CudaGraphSegment", s.name, {}, [r for _, r in s.inputs], list(s.control),
                  len(s.outputs), [F32] * len(s.outputs), [(4,)] * len(s.outputs), device=GPU)
             for s in segments]
    contracted = contract(step, segments, nodes)
    assert [n.name for n in topological_order(contracted.nodes)] == [
        "x", "cuda_graph_segment_0", "host", "cuda_graph_segment_1"]
    assert contracted.fetches == [(nodes[1], 0)]


def test_loops_conditionals_and_a_second_gpu_stay_outside():
    x = _node("_Arg", "x", device=CPU, index=0)
    up = _node("_HostToDevice", "x/up", x)
    a = _node("Tanh", "a", up)
    in_loop = _node("Exp", "in_loop", a)
    in_loop.frames = ("while",)
    in_cond = _node("Exp", "in_cond", a)
    in_cond.in_control_flow = True
    other = _node("Exp", "other_gpu", a, device=GPU[:-1] + "1")
    verdicts = classify(StepGraph([x, up, a, in_loop, in_cond, other], [], [], [x]), GPU)
    assert verdicts[a].role is Role.KERNEL and verdicts[up].role is Role.UPLOAD
    assert verdicts[in_loop].reason == verdicts[in_cond].reason == "is in a loop or a conditional"
    assert verdicts[other].reason.startswith("runs on another GPU")


def test_a_segment_of_one_kernel_stays_eager():
    x = _node("_Arg", "x", device=CPU, index=0)
    up = _node("_HostToDevice", "x/up", x)
    a = _node("Tanh", "a", up)
    down = _node("_DeviceToHost", "a/down", a)
    segments, outside = find_segments(StepGraph([x, up, a, down], [(down, 0)], [], [x]), GPU)
    assert segments == [] and "too few to pay" in outside[a]


def test_work_a_receive_does_not_feed_is_not_made_to_wait_for_it():
    """What is sent without waiting on a receive must not be captured with what waits on
    it: the peer may send only after it has received."""
    recv = _recv("pulled")
    up = _node("_HostToDevice", "pulled/up", recv)
    a = _node("Tanh", "a", up)
    a2 = _node("Exp", "a2", a)
    down_a = _node("_DeviceToHost", "a2/down", a2)
    send_a = _send("pushed_a", down_a)
    c = _node("Const", "c", value=np.ones(4, np.float32))
    b = _node("Exp", "b", c)
    b2 = _node("Sin", "b2", b)
    down_b = _node("_DeviceToHost", "b2/down", b2)
    send_b = _send("pushed_b", down_b)
    step = StepGraph([recv, up, a, a2, down_a, send_a, c, b, b2, down_b, send_b], [],
                     [send_a, send_b], [])
    segments, outside = find_segments(step, GPU)
    assert _names(segments) == [["pulled/up", "a", "a2", "a2/down"], ["b", "b2", "b2/down"]]
    assert [n.name for n in segments[1].free] == ["c"]
    assert outside[recv] == outside[send_a] == "waits on the step's rendezvous or state"


class _Rendezvous:
    def __init__(self, values: dict):
        self.values = values

    def recv(self, key: str):
        return self.values.pop(key)

    def send(self, key: str, value) -> None:
        self.values[key] = value


def test_a_step_between_a_receive_and_a_send_replays_its_gpu_middle(standin_gpu):
    recv = _recv("w")
    up = _node("_HostToDevice", "w/up", recv)
    a = _node("Tanh", "a", up)
    b = _node("Mul", "b", a, up)
    c = _node("Exp", "c", b)
    down = _node("_DeviceToHost", "c/down", c)
    send = _send("grad", down)
    step = StepGraph([recv, up, a, b, c, down, send], [], [send], [])
    resources = Resources()
    plan = graphed(step, compile_step(step, resources), resources, ARRAY_MODULES["GPU"])
    assert type(plan).__name__ == "GraphedPlan" and len(plan.runners) == 1
    w_key = "/job:ps/task:0;" + CPU + ";w;"
    sent = []
    for i in range(5):
        w = np.linspace(-1, 1, 4).astype(np.float32) * (i + 1)
        values = {w_key + str(i): w}
        if i == 4:
            standin_gpu.reset_counts()
        plan.run((), Frame(i, _Rendezvous(values)))
        sent.append(values[CPU + ";/job:ps/task:0;grad;" + str(i)])
        np.testing.assert_allclose(sent[-1], np.exp(np.tanh(w) * w), rtol=1e-6)
    counts = standin_gpu.counts()
    assert counts["launches"] == 1 and counts["h2d"] == 1 and counts["d2h"] == 1


def test_a_print_mid_step_leaves_the_gpu_work_around_it_captured(standin_gpu, capfd):
    replayed, weights, step = _losses(True, printing=True)
    eager, eager_weights, _ = _losses(False, printing=True)
    np.testing.assert_allclose(replayed, eager, rtol=1e-6)
    for a, b in zip(weights, eager_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    runners = step.plan.runners
    assert len(runners) == 2 and all(r.failed is None for r in runners)
    assert all(r.graph is not None for r in step.plan.replays.values())
    assert capfd.readouterr().err.count("hidden: ") == 12  # every step printed, both runs


def test_a_printing_step_launches_its_segments_and_the_copies_between_them(standin_gpu):
    graph, (x, y, w1, w2, loss, train), batches = _mlp(printing=True)
    with fm.Session(graph, cuda_graphs=True) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(loss, [x, y], targets=[train])
        for b in batches[:3]:
            step(*b)
        standin_gpu.reset_counts()
        step(*batches[3])
        counts = standin_gpu.counts()
        eager_counts = _eager_launches(graph, (x, y, loss, train), batches[3], standin_gpu)
    runners = step.plan.runners
    copies = sum(kind == "value" for r in runners for kind, _ in r.segment.inputs)
    copies += sum(kind == "device" for r in runners for kind in r.kinds)
    assert counts["launches"] == len(runners) + copies
    assert counts["launches"] < eager_counts / 3 and counts["syncs"] == 0


def _eager_launches(graph, tensors, batch, standin) -> int:
    x, y, loss, train = tensors
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(loss, [x, y], targets=[train])
        step(*batch)
        standin.reset_counts()
        step(*batch)
        return standin.counts()["launches"]


def test_a_segment_whose_capture_fails_runs_eagerly_and_the_others_replay(standin_gpu,
                                                                         caplog):
    """``unique``'s size is read back to the host: no capture can hold the segment after
    the print; the one before it still replays."""
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        x = fm.placeholder(fm.float32, [6])
        total = fm.reduce_sum(fm.tanh(x) * 2.0)
        shown = fm.print(total, message="total: ")
        values, _ = unique(x * fm.reshape(shown, [1]))
        result = fm.reduce_sum(values) + total
    with caplog.at_level(logging.WARNING, logger="flowmill.cuda_graphs"), \
            fm.Session(graph, cuda_graphs=True) as sess:
        f = sess.make_callable(result, [x])
        for i in range(5):
            value = np.array([1, 1, 2, 3, 3, i], np.float32) / 4
            s = np.sum(np.tanh(value) * 2).astype(np.float32)
            np.testing.assert_allclose(f(value), np.sum(np.unique(value * s)) + s,
                                       rtol=1e-6)
        first, second = f.plan.runners
    assert first.failed is None and second.failed is not None
    assert [r.graph is not None for r in first.replays.values()] == [True]
    assert "Unique" in {n.type for n in second.segment.nodes}
    failures = [r for r in caplog.records if "capture as a CUDA graph failed" in r.getMessage()]
    assert len(failures) == 1 and second.segment.name in failures[0].getMessage()


def _worker_losses(cluster, standin, cuda_graphs: bool, steps: int = 6):
    """An MLP with its variables on the PS task and its compute on the worker's GPU:
    losses, final weights, and (segments captured, launches of its last step)."""
    rng = np.random.default_rng(4)
    graph = fm.Graph(seed=5)
    with graph.as_default():
        with fm.device("/job:ps/task:0"):
            w1 = fm.Variable(rng.normal(size=(6, 16)).astype(np.float32), name="dw1")
            w2 = fm.Variable(rng.normal(size=(16, 3)).astype(np.float32), name="dw2")
        with fm.device("/job:worker/task:0/device:GPU:0"):
            x = fm.placeholder(fm.float32, [None, 6], name="x")
            y = fm.placeholder(fm.int64, [None], name="y")
            h = fm.nn.relu(fm.matmul(x, w1))
            loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=fm.matmul(h, w2)))
            train = fm.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
    batches = [(rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8))
               for _ in range(3)]
    with cluster.session(graph, cuda_graphs=cuda_graphs) as sess:
        sess.run(fm.global_variables_initializer())
        step = sess.make_callable(loss, [x, y], targets=[train])
        losses = [float(step(*batches[i % 3])) for i in range(steps - 1)]
        standin.reset_counts()
        losses.append(float(step(*batches[(steps - 1) % 3])))
        launches = standin.counts()["launches"]
        segments = len(getattr(step.plan, "runners", ()))
        return losses, sess.run([w1, w2]), (segments, launches)


def test_a_distributed_workers_step_replays_its_gpu_work_between_receives_and_sends(
        standin_gpu, tmp_path):
    from local_cluster import LocalCluster

    cluster = LocalCluster(1, tmp_path)
    try:
        eager, eager_weights, eager_launches = _worker_losses(cluster, standin_gpu, False)
        replayed, weights, replayed_launches = _worker_losses(cluster, standin_gpu, True)
    finally:
        cluster.close()
    np.testing.assert_allclose(replayed, eager, rtol=1e-6)
    for a, b in zip(weights, eager_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert eager[-1] < eager[0]
    # From the third step on, the worker's GPU work between its receives and its sends is
    # two graphs (the first layer waits for one variable's receive, the rest for both),
    # a launch each, plus the copies at their edges; eagerly it is a launch per kernel.
    assert eager_launches == (0, 16)
    assert replayed_launches == (2, 6)
