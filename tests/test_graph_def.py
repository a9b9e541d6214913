"""GraphDef round trips: a step written as a message and rebuilt from it alone (no
Operations) compiles to the same code and computes the same results, every attr kind comes
back as the exact Python value it was, and malformed messages are named ValueErrors."""

import collections
import queue
import threading

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.resources import Resources
from flowmill.runtime.cluster import ClusterSpec
from flowmill.runtime.executor import Frame, compile_step
from flowmill.runtime.graph_def import GraphDefError, from_graph_def, to_graph_def
from flowmill.runtime.ops.control_flow_ops import merge, switch, while_loop
from flowmill.runtime.ops.data_flow_ops import FIFOQueue
from flowmill.runtime.partition import partition
from flowmill.runtime.passes import optimize
from flowmill.runtime.placement import place, replica_device_setter
from flowmill.runtime.protos import graph_pb2
from flowmill.runtime.prune import prune
from flowmill.runtime.step_graph import Node, StepGraph

WORKER = "/job:worker/task:0/device:CPU:0"


def through_the_wire(step: StepGraph) -> StepGraph:
    data = to_graph_def(step).SerializeToString()
    return from_graph_def(graph_pb2.GraphDef.FromString(data))


def same_value(a, b) -> bool:
    """Equal and of the same type, all the way down (a tuple is not a list, 1 is not 1.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (float, np.floating)) and np.isnan(a):
        return bool(np.isnan(b))
    return a == b


def assert_same_step(a: StepGraph, b: StepGraph) -> None:
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    for x, y in zip(a.nodes, b.nodes, strict=True):
        assert (x.type, x.device, x.num_outputs) == (y.type, y.device, y.num_outputs)
        assert [(s.name, i) for s, i in x.inputs] == [(s.name, i) for s, i in y.inputs]
        assert [c.name for c in x.control] == [c.name for c in y.control]
        assert x.dtypes == y.dtypes and x.shapes == y.shapes, x.name
        assert (x.frames, x.loop_role, x.in_control_flow) == (
            y.frames,
            y.loop_role,
            y.in_control_flow,
        ), x.name
        assert x.attrs.keys() == y.attrs.keys(), x.name
        for key in x.attrs:
            assert same_value(x.attrs[key], y.attrs[key]), (x.name, key)
        assert y.op is None
    assert [(s.name, i) for s, i in a.fetches] == [(s.name, i) for s, i in b.fetches]
    assert [t.name for t in a.targets] == [t.name for t in b.targets]
    assert [f.name for f in a.feeds] == [f.name for f in b.feeds]


def run_script(script, resources: Resources) -> list:
    """Compile each step once and run the (step index, args) list in order."""
    plans = {}
    out = []
    for k, args in script.runs:
        if k not in plans:
            plans[k] = compile_step(script.steps[k], resources)
        out.append(plans[k].run(args))
    return out


Script = collections.namedtuple("Script", "steps runs")


def assert_round_trip_computes_the_same(script: Script) -> None:
    shipped = Script([through_the_wire(s) for s in script.steps], script.runs)
    for a, b in zip(script.steps, shipped.steps, strict=True):
        assert_same_step(a, b)
        msg = to_graph_def(a)
        assert to_graph_def(b) == msg  # decoding then encoding changes nothing
        assert compile_step(b, Resources()).source == compile_step(a, Resources()).source
    expected = run_script(script, Resources())
    got = run_script(shipped, Resources())
    for e, g in zip(expected, got, strict=True):
        assert len(e) == len(g)
        for x, y in zip(e, g, strict=True):
            np.testing.assert_array_equal(x, y)


# ---- graphs


def mlp_training(optimizer, passes: bool) -> Script:
    rng = np.random.default_rng(3)
    g = fm.Graph(seed=5)
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, 6), name="x")
        y = fm.placeholder(fm.int64, (None,), name="y")
        w1 = fm.Variable(fm.random_normal((6, 16), stddev=0.3), name="w1")
        b1 = fm.Variable(np.zeros(16, np.float32), name="b1")
        w2 = fm.Variable(fm.truncated_normal((16, 3), stddev=0.3), name="w2")
        h = fm.nn.dropout(fm.nn.relu(fm.matmul(x, w1) + b1), 0.25, seed=1)
        logits = fm.matmul(h, w2)
        loss = fm.reduce_mean(
            fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
        train = optimizer.minimize(loss)
        init = fm.global_variables_initializer()
        steps = [
            prune([], [init], []),
            prune([loss], [train], [x, y]),
            prune([w1.value(), b1.value(), w2.value()], [], []),
        ]
    if passes:
        steps = [optimize(s, Resources()) for s in steps]
    batches = [
        (rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(4)
    ]
    return Script(steps, [(0, ())] + [(1, b) for b in batches] + [(2, ())])


def cnn_training() -> Script:
    rng = np.random.default_rng(4)
    g = fm.Graph(seed=2)
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, 8, 8, 1), name="x")
        labels = fm.placeholder(fm.int32, (None,), name="labels")
        w1 = fm.Variable(fm.random_normal((3, 3, 1, 4), stddev=0.3), name="w1")
        w2 = fm.Variable(fm.random_normal((64, 3), stddev=0.3), name="w2")
        h = fm.nn.relu(fm.nn.conv2d(x, w1, 1, "SAME"))
        h = fm.nn.max_pool(h, 2, 2, "SAME")
        h = fm.reshape(h[:, ::1, :, :], (-1, 64))
        logits = fm.matmul(h, w2)
        loss = fm.reduce_mean(
            fm.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        )
        train = fm.train.Adam(0.01).minimize(loss)
        init = fm.global_variables_initializer()
        steps = [prune([], [init], []), prune([loss, logits[0, None, 1:]], [train], [x, labels])]
    runs = [(0, ())] + [
        (1, (rng.normal(size=(4, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, 4, np.int32)))
        for _ in range(3)
    ]
    return Script([optimize(s, Resources()) for s in steps], runs)


def cond_with_state() -> Script:
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (), name="x")
        hits = fm.Variable(0.0, name="hits")

        def taken():
            with fm.control_dependencies([hits.assign_add(1.0)]):
                return fm.constant(10.0) + x

        out = fm.cond(x > 0.0, taken, lambda: x * 2.0)
        f, t = switch(x, x < 5.0)
        raw, index = merge([f * 3.0, t * 4.0])
        constant = fm.cond(x > 5.0, lambda: fm.constant(100.0), lambda: fm.constant(-1.0))
        steps = [
            prune([], [hits.initializer], []),
            prune([out, raw, index, constant], [], [x]),
            prune([hits.value()], [], []),
        ]
    runs = [(0, ())] + [(1, (np.float32(v),)) for v in (-3.0, 1.0, 7.0, 2.0)] + [(2, ())]
    return Script(steps, runs)


def test_shipped_conds_take_the_right_branches():
    script = cond_with_state()
    shipped = Script([through_the_wire(s) for s in script.steps], script.runs)
    got = run_script(shipped, Resources())
    assert [tuple(float(v) for v in out) for out in got[1:5]] == [
        (-6.0, -12.0, 1.0, -1.0),
        (11.0, 4.0, 1.0, -1.0),
        (17.0, 21.0, 0.0, 100.0),
        (12.0, 8.0, 1.0, -1.0),
    ]
    assert got[5] == (3.0,)  # the stateful op ran on the taken branches only


def nested_loops() -> Script:
    g = fm.Graph()
    with g.as_default():
        limit = fm.placeholder(fm.int32, (), name="limit")
        counter = fm.Variable(0, name="counter")

        def outer_body(i, acc):
            def inner_body(j, a):
                odd = fm.cond(fm.equal(j % 2, 1), lambda: a + j * 10, lambda: a + j)
                return [j + 1, odd]

            _, inner = while_loop(lambda j, a: j < i, inner_body, [fm.constant(0), acc])
            with fm.control_dependencies([counter.assign_add(1)]):
                return [i + 1, fm.identity(inner)]

        _, total = while_loop(
            lambda i, a: i < limit, outer_body, [fm.constant(0), fm.constant(0)], name="outer"
        )
        capped = while_loop(lambda v: v < 1e9, lambda v: v * 3.0, 1.0, maximum_iterations=5)
        steps = [
            prune([], [counter.initializer], []),
            prune([total, capped], [], [limit]),
            prune([counter.value()], [], []),
        ]
    return Script(steps, [(0, ()), (1, (np.int32(6),)), (1, (np.int32(3),)), (2, ())])


def queues() -> Script:
    g = fm.Graph()
    with g.as_default():
        q = FIFOQueue(10, [fm.float32, fm.int64], shapes=[(2,), ()], name="q")
        v = fm.placeholder(fm.float32, (2,), name="v")
        i = fm.placeholder(fm.int64, (), name="i")
        enqueue = q.enqueue([v, i])
        xs, ids = q.dequeue_many(2)
        steps = [prune([], [enqueue], [v, i]), prune([xs * 2.0, ids, q.size()], [], [])]
    runs = [(0, (np.array([k, -k], np.float32), np.int64(k))) for k in range(4)]
    return Script(steps, runs + [(1, ()), (1, ())])


@pytest.mark.parametrize(
    "build",
    [
        lambda: mlp_training(fm.train.Momentum(0.1, 0.9), passes=False),
        lambda: mlp_training(fm.train.Adam(0.01), passes=True),
        cnn_training,
        cond_with_state,
        nested_loops,
        queues,
    ],
    ids=["mlp-momentum", "mlp-adam-optimized", "cnn", "cond", "nested-loops", "queues"],
)
def test_round_trip_computes_the_same(build):
    assert_round_trip_computes_the_same(build())


def test_loop_structure_travels_in_the_node():
    steps = nested_loops().steps
    nodes = {n.name: n for n in through_the_wire(steps[1]).nodes}
    merges = [n for n in nodes.values() if n.loop_role == "merge"]
    assert {n.frames for n in merges} == {("outer",), ("outer", "outer/while"), ("while",)}
    cond_in_inner = next(n for n in nodes.values() if n.name.startswith("outer/while/cond/"))
    assert cond_in_inner.frames == ("outer", "outer/while") and cond_in_inner.in_control_flow
    assert cond_in_inner.loop_role is None
    assert not nodes["_arg_limit:0"].in_control_flow


# ---- partitions


class _Rendezvous:
    def __init__(self):
        self.lock = threading.Lock()
        self.slots: dict[str, queue.Queue] = {}

    def _slot(self, key):
        with self.lock:
            return self.slots.setdefault(key, queue.Queue(maxsize=1))

    def send(self, key, value):
        self._slot(key).put(value)

    def recv(self, key):
        return self._slot(key).get(timeout=30)


def run_partitions(parts: list[dict[str, StepGraph]], runs) -> list:
    """Run a list of (partition set, args) as steps, each partition in its own thread."""
    resources: dict[str, Resources] = {}
    rendezvous = _Rendezvous()
    plans: dict[tuple, object] = {}
    results = []
    for step_id, (k, args) in enumerate(runs):
        out, errors = {}, []

        def run_part(device, part, k=k, args=args, step_id=step_id, out=out, errors=errors):
            try:
                task = "/".join(device.split("/")[:3])
                key = (k, device)
                if key not in plans:
                    plans[key] = compile_step(part, resources.setdefault(task, Resources()))
                out[device] = plans[key].run(
                    args if device == WORKER else (), Frame(step_id, rendezvous)
                )
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run_part, args=(d, p)) for d, p in parts[k].items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        results.append(out[WORKER])
    return results


def test_partitions_round_trip_and_run_as_shipped():
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["h:3"]})
    rng = np.random.default_rng(0)
    g = fm.Graph()
    with g.as_default():
        with fm.device(replica_device_setter(cluster, worker_device="/job:worker/task:0")):
            x = fm.placeholder(fm.float32, (None, 4), name="x")
            y = fm.placeholder(fm.int64, (None,), name="y")
            w1 = fm.Variable(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), name="w1")
            b1 = fm.Variable(np.zeros(8, np.float32), name="b1")
            w2 = fm.Variable(np.linspace(1, -1, 24, dtype=np.float32).reshape(8, 3), name="w2")
            h = fm.nn.relu(fm.matmul(x, w1) + b1)
            loss = fm.reduce_mean(
                fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=fm.matmul(h, w2))
            )
            train = fm.train.Momentum(0.1, 0.9).minimize(loss)
            init = fm.global_variables_initializer()
            with fm.device("/job:ps/task:1"):
                flag = fm.reduce_sum(x) > 0.0  # the branch taken varies by batch
            gated = fm.cond(flag, lambda: fm.reduce_max(w1.value()), lambda: fm.constant(-1.0))

    def parts_of(fetches, targets, feeds):
        step = optimize(prune(fetches, targets, feeds), Resources())
        place(step, WORKER)
        return partition(step, WORKER)

    original = [
        parts_of([], [init], []),
        parts_of([loss, gated], [train], [x, y]),
        parts_of([w1.value(), b1.value(), w2.value()], [], []),
    ]
    assert len(original[1]) == 3
    assert all(any(n.type == "_Send" for n in part.nodes) for part in original[1].values())
    shipped = []
    for parts in original:
        rebuilt = {}
        for device, part in parts.items():
            wire = through_the_wire(part)
            assert_same_step(part, wire)
            rebuilt[device] = wire
        shipped.append(rebuilt)
    batches = [
        (rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6)) for _ in range(3)
    ]
    runs = [(0, ())] + [(1, b) for b in batches] + [(2, ())]
    expected = run_partitions(original, runs)
    got = run_partitions(shipped, runs)
    for e, r in zip(expected, got, strict=True):
        for a, b in zip(e, r, strict=True):
            np.testing.assert_array_equal(a, b)
    recv = next(n for n in shipped[1][WORKER].nodes if n.type == "_Recv")
    assert set(recv.attrs) == {
        "tensor_name",
        "src_device",
        "dst_device",
        "dtype",
        "shape",
        "may_be_dead",
    }
    assert isinstance(recv.attrs["dtype"], np.dtype)


# ---- attrs


def one_node(attrs: dict, op_type: str = "Const") -> StepGraph:
    node = Node(op_type, "n", attrs, [], [], 1, [np.dtype("float32")], [(None, 3)])
    return StepGraph(nodes=[node], fetches=[(node, 0)], targets=[])


Point = collections.namedtuple("Point", "x y")

ATTR_VALUES = [
    0,
    -7,
    (1 << 63) - 1,
    -(1 << 63),
    True,
    False,
    1.5,
    -0.0,
    float("inf"),
    float("nan"),
    "",
    "SAME",
    "ünïcode",
    None,
    np.dtype("float32"),
    np.dtype("bool"),
    np.dtype("int64"),
    np.dtype("uint8"),
    np.dtype("float16"),
    np.dtype("object"),
    np.dtype(">i4"),
    np.dtype("<U3"),
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not C-contiguous
    np.array(3.5, np.float64),
    np.array([True, False]),
    np.array([], np.int32).reshape(0, 5),
    np.array([1, -2, 3], ">i8"),
    np.array(["ab", "c"]),
    np.array([[1, 2]], np.int8),
    np.array([np.nan, 1.0], np.float16),
    np.float32(2.5),
    np.int64(-3),
    np.bool_(True),
    (),
    [],
    (1,),
    [1, 2],
    (-1, 4),
    ((0, 1), (2, 3)),
    [[1], (2, [3])],
    ((None, 1, "s"), (None, "n"), (2, "i")),
    (np.dtype("float32"), np.dtype("int64")),
    (None,),
    ("a", 1.0, True, None),
]


@pytest.mark.parametrize("value", ATTR_VALUES, ids=[repr(v)[:40] for v in ATTR_VALUES])
def test_attr_round_trips_exactly(value):
    got = through_the_wire(one_node({"value": value})).nodes[0].attrs["value"]
    assert same_value(value, got), (value, got)
    if isinstance(value, np.ndarray):
        assert got.flags.writeable  # as a Const's value must be, like any built one


SHAPE_VALUES = [None, (), (3,), (None,), (None, 4), (0, None, 7), [2, 3], (-1, 4), (True, 2)]


@pytest.mark.parametrize("value", SHAPE_VALUES, ids=[repr(v) for v in SHAPE_VALUES])
def test_shape_attrs_round_trip_exactly(value):
    node = through_the_wire(one_node({"shape": value, "dtype": np.dtype("float32")}, "Placeholder"))
    assert same_value(node.nodes[0].attrs["shape"], value)
    shapes = (value, (1, None), None)
    queue_node = one_node(
        {"component_types": (np.dtype("float32"),) * 3, "shapes": shapes}, "FIFOQueueV2"
    )
    assert same_value(through_the_wire(queue_node).nodes[0].attrs["shapes"], shapes)


def test_shapes_travel_as_tensor_shapes():
    msg = to_graph_def(one_node({"shape": (None, 4), "dtype": np.dtype("float32")}, "Placeholder"))
    assert list(msg.node[0].attr["shape"].shape.dim) == [-1, 4]
    assert list(msg.node[0].output_shape[0].dim) == [-1, 3]
    # A tuple holding a real -1 (a Reshape target, an axis) is not a shape: it stays a list.
    msg = to_graph_def(one_node({"shape": (-1, 4), "dtype": np.dtype("float32")}, "Placeholder"))
    assert msg.node[0].attr["shape"].WhichOneof("value") == "list"


def test_unknown_rank_outputs_and_decoded_defaults():
    node = Node("Identity", "id", {}, [], [], 1, [np.dtype("int32")], [None])
    arg = Node("_Arg", "_arg_a:0", {"index": 0}, [], [], 1, [np.dtype("int32")], [None])
    node.inputs = [(arg, 0)]
    step = StepGraph(nodes=[arg, node], fetches=[(node, 0)], targets=[], feeds=[arg])
    rebuilt = through_the_wire(step)
    assert rebuilt.nodes[1].shapes == [None]
    assert rebuilt.feeds == [rebuilt.nodes[0]]
    assert compile_step(rebuilt, Resources()).run((np.int32(4),)) == (4,)
    msg = to_graph_def(one_node({"value": np.float32(1)}))
    rebuilt = from_graph_def(msg)
    assert rebuilt.nodes[0].attrs["dtype"] is None  # a default the message left out


@pytest.mark.parametrize(
    "value, why",
    [
        ({"a": 1}, "type builtins.dict"),
        ({1, 2}, "type builtins.set"),
        (object(), "type builtins.object"),
        (b"raw", "type builtins.bytes"),
        ("\ud800", "not valid Unicode"),
        (1 << 64, "does not fit in 64 bits"),
        (Point(1, 2), "Point"),
        ((1, [2, {3}]), "type builtins.set"),
        (np.array([object()]), "Python objects"),
        (np.zeros(2, "f4,i4"), "dtype"),
        (np.dtype("f4,i4"), "dtype"),
        (np.ma.masked_array([1, 2]), "MaskedArray"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_unsupported_attr_values_are_named(value, why):
    with pytest.raises(GraphDefError, match=rf"node 'n' \(Const\) attr 'value': .*{why}"):
        to_graph_def(one_node({"value": value}))


def test_steps_that_cannot_be_written_are_named():
    step = one_node({"value": 1.0})
    step.nodes.append(Node("Const", "n", {}, [], [], 0))
    with pytest.raises(GraphDefError, match="two nodes of the step are named 'n'"):
        to_graph_def(step)
    outside = Node("Const", "elsewhere", {}, [], [], 1, [np.dtype("int32")], [()])
    step = one_node({"value": 1.0})
    step.nodes[0].control = [outside]
    with pytest.raises(GraphDefError, match="'elsewhere', which is not a node of the step"):
        to_graph_def(step)
    step = one_node({"value": 1.0})
    step.nodes[0].dtypes = []
    with pytest.raises(GraphDefError, match=r"node 'n' \(Const\): 1 outputs but 0 dtypes"):
        to_graph_def(step)


# ---- malformed messages


def sample_message() -> graph_pb2.GraphDef:
    g = fm.Graph()
    with g.as_default():
        n = fm.placeholder(fm.int32, (), name="n")
        i, total = while_loop(
            lambda i, s: i < n, lambda i, s: [i + 1, s + i], [fm.constant(0), fm.constant(0)]
        )
        out = fm.identity(total * 2, name="out")
        step = prune([out, i], [out.op], [n])
    return to_graph_def(step)


def node_named(msg, name):
    return next(nd for nd in msg.node if nd.name == name)


def test_sample_message_decodes_and_runs():
    step = from_graph_def(sample_message().SerializeToString())
    assert compile_step(step, Resources()).run((np.int32(5),)) == (20, 5)


def _unknown_op(m):
    node_named(m, "out").op = "Frobnicate"


def _dangling_input(m):
    node_named(m, "out").input[0].node = "nowhere"


def _input_slot(m):
    node_named(m, "out").input[0].index = 3


def _dangling_control(m):
    node_named(m, "out").control_input.append("ghost")


def _dangling_fetch(m):
    m.fetch[0].node = "ghost"


def _dangling_target(m):
    m.target[0] = "ghost"


def _duplicate_name(m):
    m.node.add().CopyFrom(node_named(m, "out"))


def _unknown_attr(m):
    node_named(m, "out").attr["color"].s = "red"


def _attr_without_value(m):
    node_named(m, "while/Enter").attr["frame_name"].Clear()


def _bad_dtype(m):
    node_named(m, "out").output_dtype[0] = "float33"


def _structured_dtype(m):
    node_named(m, "out").output_dtype[0] = "f4,i4"


def _short_tensor(m):
    const = next(nd for nd in m.node if nd.op == "Const")
    const.attr["value"].tensor.content = b"\x00"


def _bad_shape(m):
    node_named(m, "out").output_shape[0].dim.append(-2)


def _unknown_rank_with_dims(m):
    node_named(m, "out").output_shape[0].unknown_rank = True
    node_named(m, "out").output_shape[0].dim.append(2)


def _shapes_count(m):
    node_named(m, "out").output_shape.add()


def _arity(m):
    node_named(m, "out").input.add(node="out", index=0)


def _feed_count(m):
    m.num_feeds = 2


def _huge_feed_count(m):
    m.num_feeds = 2**31 - 1  # eight bytes that once built a list of two billion indexes


def _self_edge(m):
    node_named(m, "out").input[0].node = "out"


def _cycle(m):
    a = m.node.add(name="a", op="Identity")
    b = m.node.add(name="b", op="Identity")
    for node, src in ((a, "b"), (b, "a")):
        node.input.add(node=src, index=0)
        node.output_dtype.append("float32")
        node.output_shape.add(unknown_rank=True)


def _arg_index(m):
    node_named(m, "_arg_n:0").attr["index"].i = 7


def _role_type(m):
    node_named(m, "out").loop_role = "merge"
    node_named(m, "out").frame.append("while")


def _unknown_role(m):
    node_named(m, "while/LoopCond").loop_role = "spin"


def _no_loop_cond(m):
    node_named(m, "while/LoopCond").loop_role = ""


def _role_outside_frame(m):
    del node_named(m, "while/LoopCond").frame[:]


def _misnested_frame(m):
    node_named(m, "while/LoopCond").frame.insert(0, "elsewhere")


def _merge_inputs(m):
    merge_node = next(nd for nd in m.node if nd.loop_role == "merge")
    merge_node.input[0].CopyFrom(merge_node.input[1])


MALFORMED = [
    (_unknown_op, r"node 'out' \(Frobnicate\): unknown op type 'Frobnicate'"),
    (_dangling_input, r"node 'out' \(Identity\) input 0 nowhere:0 names no node"),
    (_input_slot, r"node 'out' \(Identity\) input 0 .*:3: node .* has 1 outputs"),
    (_dangling_control, r"node 'out' \(Identity\) control input 'ghost' names no node"),
    (_dangling_fetch, "fetch 0 ghost:0 names no node"),
    (_dangling_target, "target 'ghost' names no node"),
    (_duplicate_name, "two nodes are named 'out'"),
    (_unknown_attr, r"node 'out' \(Identity\): unknown attr 'color'"),
    (_attr_without_value, r"node 'while/Enter' \(Enter\) attr 'frame_name': no value set"),
    (_bad_dtype, r"node 'out' \(Identity\) output 0: 'float33' is not a dtype"),
    (_structured_dtype, r"node 'out' \(Identity\) output 0: 'f4,i4' is a structured dtype"),
    (_short_tensor, r"attr 'value': 1 bytes of content for a int32 tensor of shape \(\)"),
    (_bad_shape, r"node 'out' \(Identity\) output 0: shape dims must be -1"),
    (_unknown_rank_with_dims, "a shape of unknown rank lists dims"),
    (_shapes_count, r"node 'out' \(Identity\): 1 output dtypes but 2 shapes"),
    (_arity, r"node 'out' \(Identity\): takes 1 inputs, the message gives 2"),
    (_feed_count, r"num_feeds is 2, the graph has 1 _Arg node\(s\)"),
    (_huge_feed_count, r"num_feeds is 2147483647, the graph has 1 _Arg node\(s\)"),
    (_self_edge, r"node 'out' \(Identity\) takes its own output: a cycle"),
    (_cycle, r"cycle outside a while loop \(involving \['a', 'b'\]\)"),
    (_arg_index, r"node '_arg_n:0' \(_Arg\): index 7 is not one of the 1 feeds"),
    (_role_type, r"node 'out' \(Identity\): loop role 'merge' belongs to Merge ops"),
    (_unknown_role, r"node 'while/LoopCond' \(LoopCond\): unknown loop role 'spin'"),
    (_no_loop_cond, "loop frame 'while' has 0 LoopCond nodes"),
    (_role_outside_frame, "loop role 'loop_cond' outside any loop frame"),
    (_misnested_frame, "frame 'while' is nested in"),
    (_merge_inputs, "a loop merge takes its frame's Enter, then its NextIteration"),
]


@pytest.mark.parametrize("corrupt, message", MALFORMED, ids=[f.__name__ for f, _ in MALFORMED])
def test_malformed_messages_are_named_value_errors(corrupt, message):
    msg = sample_message()
    corrupt(msg)
    with pytest.raises(ValueError, match=message):
        from_graph_def(msg)
    with pytest.raises(GraphDefError, match=message):
        from_graph_def(msg.SerializeToString())


def test_garbage_bytes_are_a_value_error():
    with pytest.raises(GraphDefError, match="not a serialized GraphDef"):
        from_graph_def(b"\xff\xff\xff\xff not a message")
    with pytest.raises(GraphDefError, match="expected a GraphDef or its bytes, got str"):
        from_graph_def("node {}")
