"""``Session(check_numerics=True)``: the first op whose float output holds a NaN or Inf
fails the step, named with its type and its inputs' shapes, before anything downstream of
it runs; in one process, across a real PS process, and turned on by the job's
``training.checkNumerics``. Off, the compiled step is exactly what it was."""

import json

import grpc
import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.launcher.local import free_ports
from flowmill.runtime import task_server
from flowmill.runtime.cluster import ENV_TRAINING, ENV_VAR, ClusterSpec, TaskConfig
from flowmill.runtime.distributed import DistributedSession
from flowmill.runtime.task_errors import TaskError

from local_cluster import LocalCluster

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")


def build_mlp(ps_device: str | None = None):
    """A 4-8-3 MLP whose hidden layer goes through a log (a negative input, NaN there) and
    whose first layer's weights through a square root. With ``ps_device`` the variables
    and the square root live on that PS task."""
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, 4), name="x")
        y = fm.placeholder(fm.int64, (None,), name="y")
        with fm.device(ps_device):
            w1 = fm.Variable(np.linspace(0.1, 1, 32, dtype=np.float32).reshape(4, 8), name="w1")
            w2 = fm.Variable(np.linspace(1, -1, 24, dtype=np.float32).reshape(8, 3), name="w2")
            root = fm.sqrt(w1.value(), name="mlp/sqrt_w1")
        with fm.device("/job:worker/task:0" if ps_device else None):
            h = fm.log(fm.matmul(x, root), name="mlp/log")
            logits = fm.matmul(h, w2, name="mlp/logits")
            loss = fm.reduce_mean(
                fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )
            train = fm.train.GradientDescent(0.1).minimize(loss)
        init = fm.global_variables_initializer()
    return g, x, y, [w1, w2], loss, train, init


def data(n: int = 6, sign: float = 1.0):
    rng = np.random.default_rng(0)
    x = sign * np.abs(rng.normal(size=(n, 4))).astype(np.float32) + sign * 0.1
    return x, rng.integers(0, 3, n)


def test_the_first_op_to_make_a_nan_is_named_and_nothing_downstream_runs():
    g, x, y, variables, loss, train, init = build_mlp()
    with fm.Session(g, check_numerics=True) as sess:
        sess.run(init)
        before = sess.run([v.value() for v in variables])
        bx, by = data()
        assert np.isfinite(sess.run([loss, train], {x: bx, y: by})[0])
        after_one = sess.run([v.value() for v in variables])
        assert not np.array_equal(after_one[1], before[1])
        with pytest.raises(fm.InvalidArgumentError) as info:
            sess.run([loss, train], {x: -bx, y: by})  # log of a negative: NaN in mlp/log
        message = str(info.value)
        assert "NaN found in the output of op 'mlp/log' (Log)" in message, message
        assert "(shape (6, 8), float32); its inputs had shapes (6, 8)" in message
        # The update is downstream of the NaN: no variable changed.
        for got, want in zip(sess.run([v.value() for v in variables]), after_one, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_nan_fed_is_named_as_the_feed():
    g, x, y, _, loss, _, init = build_mlp()
    with fm.Session(g, check_numerics=True) as sess:
        sess.run(init)
        bx, by = data()
        bx[2, 1] = np.nan
        with pytest.raises(fm.InvalidArgumentError, match="NaN found in the value fed to 'x:0'"):
            sess.run(loss, {x: bx, y: by})


def test_an_inf_from_a_binary_op_names_both_input_shapes():
    g = fm.Graph()
    with g.as_default():
        a = fm.placeholder(fm.float32, (None, 3), name="a")
        b = fm.placeholder(fm.float32, (3,), name="b")
        out = fm.reduce_sum(fm.divide(a, b, name="ratio") + 1.0)
    with fm.Session(g, check_numerics=True) as sess:
        assert sess.run(out, {a: np.ones((2, 3)), b: np.ones(3)}) == 12.0
        with np.errstate(divide="ignore"), pytest.raises(fm.InvalidArgumentError) as info:
            sess.run(out, {a: np.ones((2, 3)), b: [1.0, 0.0, 1.0]})
    assert str(info.value) == (
        "Inf found in the output of op 'ratio' (RealDiv) (shape (2, 3), float32); "
        "its inputs had shapes (2, 3), (3,)"
    )


def test_inside_a_while_loop_the_op_of_the_body_is_named():
    g = fm.Graph()
    with g.as_default():
        start = fm.placeholder(fm.float32, (2,), name="start")
        _, grown = fm.while_loop(
            lambda i, v: fm.less(i, 10),
            lambda i, v: [i + 1, fm.multiply(v, 1e10, name="grow")],
            [fm.constant(0), start],
        )
    with fm.Session(g) as plain, np.errstate(over="ignore"):
        assert np.isinf(plain.run(grown, {start: [1.0, 2.0]})).all()
    with fm.Session(g, check_numerics=True) as sess:
        np.testing.assert_array_equal(sess.run(grown, {start: [0.0, 0.0]}), [0.0, 0.0])
        with np.errstate(over="ignore"), pytest.raises(fm.InvalidArgumentError) as info:
            sess.run(grown, {start: [1.0, 2.0]})
    assert str(info.value) == (
        "Inf found in the output of op 'while/grow' (Mul) (shape (2,), float32); "
        "its inputs had shapes (2,), ()"
    )


def test_training_with_the_check_computes_what_it_computes_without():
    losses = {}
    for checked in (False, True):
        g, x, y, variables, loss, train, init = build_mlp()
        with fm.Session(g, check_numerics=checked) as sess:
            sess.run(init)
            step = sess.make_callable(loss, [x, y], targets=[train])
            losses[checked] = [float(step(*data(6 + i))) for i in range(5)]
            losses[checked].append(sess.run([v.value() for v in variables]))
    np.testing.assert_array_equal(losses[True][:5], losses[False][:5])
    for got, want in zip(losses[True][5], losses[False][5], strict=True):
        np.testing.assert_array_equal(got, want)


def test_off_the_compiled_step_is_as_before():
    g, x, y, _, loss, train, init = build_mlp()
    sources, orders = {}, {}
    for option in ({}, {"check_numerics": False}, {"check_numerics": True}):
        with fm.Session(g, **option) as sess:
            sess.run(init)
            plan = sess.make_callable(loss, [x, y], targets=[train]).plan
            key = option.get("check_numerics")
            sources[key], orders[key] = plan.source, [n.type for n in plan.order]
    assert sources[False] == sources[None]
    assert orders[False] == orders[None] and "CheckNumerics" not in orders[None]
    assert sources[True] != sources[None]
    checks = orders[True].count("CheckNumerics")
    assert checks > 0 and len(orders[True]) == len(orders[None]) + checks


def test_a_variable_read_is_still_deferred_to_its_first_use_with_its_check():
    g = fm.Graph()
    with g.as_default():
        idx = fm.placeholder(fm.int64, (None,), name="ids")
        table = fm.Variable(np.arange(12, dtype=np.float32).reshape(4, 3), name="table")
        bias = fm.Variable(np.ones(3, np.float32), name="bias")
        b = bias.value()  # read first, used last
        out = fm.gather(table.value(), idx, name="lookup") * 2.0 + b
    with fm.Session(g, check_numerics=True) as sess:
        sess.run([table.initializer, bias.initializer])
        step = sess.make_callable(out, [idx])
        np.testing.assert_array_equal(step([1]), [[7.0, 9.0, 11.0]])
    names = [n.name for n in step.plan.order]
    read = names.index("bias/Read")
    assert names[read + 1:read + 3] == ["bias/Read/check_numerics_0", "Add"]
    assert names.index("Mul/check_numerics_0") < read


# ---- across a real PS process


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(1, tmp_path_factory.mktemp("numerics"))
    yield c
    c.close()


def test_a_nan_made_on_a_ps_is_named_by_that_task(cluster):
    g, x, y, variables, loss, train, init = build_mlp("/job:ps/task:0")
    w1 = variables[0]
    with g.as_default():
        negate = w1.assign(-w1.value())  # the square root on the PS then makes NaN
    sess = cluster.session(g, check_numerics=True, step_timeout=60)
    try:
        sess.run(init)
        bx, by = data()
        assert np.isfinite(sess.run([loss, train], {x: bx, y: by})[0])
        sess.run(negate)
        kept = sess.run([v.value() for v in variables])
        with pytest.raises(TaskError) as info:
            sess.run([loss, train], {x: bx, y: by})
        message = str(info.value)
        assert info.value.task == "/job:ps/task:0"
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "NaN found in the output of op 'mlp/sqrt_w1' (Sqrt)" in message, message
        assert "its inputs had shapes (4, 8)" in message
        for got, want in zip(sess.run([v.value() for v in variables]), kept, strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        sess.close()


def test_a_nan_made_on_the_worker_of_a_cluster_is_raised_there(cluster):
    g, x, y, _, loss, train, init = build_mlp("/job:ps/task:0")
    sess = cluster.session(g, check_numerics=True, step_timeout=60)
    try:
        sess.run(init)
        bx, by = data()
        with pytest.raises(fm.InvalidArgumentError, match=r"op 'mlp/log' \(Log\)"):
            sess.run([loss, train], {x: -bx, y: by})
        assert np.isfinite(sess.run(loss, {x: bx, y: by}))
    finally:
        sess.close()


# ---- the job's training.checkNumerics


@pytest.mark.parametrize(
    "training, asked, on",
    [({"mode": "async"}, False, False), ({"mode": "async", "checkNumerics": True}, False, True),
     ({"mode": "async", "checkNumerics": False}, True, True)],
)
def test_the_job_turns_the_check_on_for_its_sessions(monkeypatch, training, asked, on):
    ps_port, worker_port = free_ports(2)
    spec = ClusterSpec.from_dict(
        {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    )
    monkeypatch.setenv(ENV_VAR, TaskConfig(spec, "worker", 0).to_json())
    monkeypatch.setenv(ENV_TRAINING, json.dumps(training))
    try:
        sess = fm.Session(fm.Graph(), check_numerics=asked)
        assert isinstance(sess, DistributedSession)
        assert sess.check_numerics is on
        sess.close()
    finally:
        task_server.close_task_server()
