"""Building graphs: names, scopes, control and device records, build-time shape errors."""

import numpy as np
import pytest

import flowmill.runtime as fm


@pytest.fixture
def graph():
    g = fm.Graph()
    with g.as_default():
        yield g


def test_names_are_unique_and_scoped(graph):
    a = fm.constant(1.0, name="c")
    b = fm.constant(2.0, name="c")
    with fm.name_scope("layer"):
        c = fm.add(a, b)
        with fm.name_scope("inner"):
            d = c * 2.0
    with fm.name_scope("layer"):
        e = fm.add(a, b)
    assert (a.op.name, b.op.name) == ("c", "c_1")
    assert c.op.name == "layer/Add"
    assert d.op.name == "layer/inner/Mul"
    assert e.op.name == "layer_1/Add"
    assert graph.get_tensor_by_name("layer/Add:0") is c


def test_control_dependencies_and_device_scopes_are_recorded(graph):
    a = fm.constant(1.0)
    with fm.control_dependencies([a]):
        b = fm.constant(2.0)
        with fm.control_dependencies(None):
            c = fm.constant(3.0)
    assert b.op.control_inputs == [a.op]
    assert c.op.control_inputs == []
    with fm.device("/job:ps/task:1"):
        with fm.device("/device:CPU:0"):
            v = fm.Variable(np.zeros(3, np.float32), name="v")
    assert v.device == "/job:ps/task:1/device:CPU:0"
    with fm.device(lambda op: "/job:worker/task:0" if op.type == "MatMul" else ""):
        m = fm.matmul(
            fm.constant(np.eye(2, dtype=np.float32)), fm.constant(np.eye(2, dtype=np.float32))
        )
    assert m.op.device == "/job:worker/task:0"


def test_variable_ops_are_colocated_with_their_handle(graph):
    v = fm.Variable(np.zeros(2, np.float32), name="w")
    upd = v.assign_add(np.ones(2, np.float32))
    assert upd.op.colocation == (v.handle.op.name,)
    assert v.initializer.colocation == (v.handle.op.name,)


def test_shape_error_names_op_inputs_and_shapes(graph):
    a = fm.placeholder(fm.float32, (None, 3), name="a")
    b = fm.placeholder(fm.float32, (4, 5), name="b")
    with pytest.raises(fm.GraphError) as err:
        fm.matmul(a, b, name="proj")
    msg = str(err.value)
    assert "'proj'" in msg and "MatMul" in msg and "a:0: (?, 3)" in msg and "b:0: (4, 5)" in msg


def test_broadcast_and_dtype_errors_at_build_time(graph):
    with pytest.raises(fm.GraphError, match=r"cannot broadcast \(2, 3\) with \(4,\)"):
        fm.constant(np.ones((2, 3), np.float32)) + fm.constant(np.ones(4, np.float32))
    with pytest.raises(fm.GraphError, match="dtypes differ"):
        fm.add(fm.constant(np.ones(2, np.float32)), fm.constant(np.ones(2, np.float64)))


def test_unknown_dims_propagate(graph):
    x = fm.placeholder(fm.float32, (None, 3))
    w = fm.constant(np.ones((3, 4), np.float32))
    y = fm.reduce_sum(fm.matmul(x, w), axis=1, keepdims=True)
    assert y.shape == (None, 1)
    z = fm.placeholder(fm.float32, None) * 2.0
    assert z.shape is None


def test_unknown_attr_is_rejected(graph):
    x = fm.constant(1.0)
    with pytest.raises(fm.GraphError, match=r"MatMul: unknown attr 'transpose_c'"):
        graph.create_op("MatMul", [x, x], {"transpose_c": True})


def test_symbolic_tensor_has_no_truth_value(graph):
    with pytest.raises(TypeError, match="cond"):
        if fm.constant(True):
            pass


def test_finalized_graph_rejects_new_ops(graph):
    graph.finalize()
    with pytest.raises(fm.GraphError, match="finalized"):
        fm.constant(1.0)
