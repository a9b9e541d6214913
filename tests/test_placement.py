"""Where a job's variables go by default (least bytes first, the same in every task) and
what the chief says about it: one line, once in its task's life, with the bytes and the
count of variables each PS task holds."""

from __future__ import annotations

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.launcher.local import free_ports
from flowmill.runtime import distributed
from flowmill.runtime.cluster import ENV_PS_STRATEGY, PS_STRATEGIES, ClusterSpec
from flowmill.runtime.distributed import DistributedSession
from flowmill.runtime.job import ps_strategy
from flowmill.runtime.placement import VariablePlacer, format_loads, ps_loads


def test_bytes_is_the_default_everywhere():
    assert PS_STRATEGIES[0] == "bytes"
    assert ps_strategy({}) == "bytes"
    assert ps_strategy({ENV_PS_STRATEGY: "round_robin"}) == "round_robin"
    with pytest.raises(ValueError, match="must be one of bytes, round_robin, got 'random'"):
        ps_strategy({ENV_PS_STRATEGY: "random"})
    assert VariablePlacer(2).strategy == "bytes"


def kernels_and_biases():
    """Three layers' 2 MB kernels and 10 KB biases, no devices, made kernel, bias, ...:
    dealt in turn, every kernel would go to ps-0 and every bias to ps-1."""
    g = fm.Graph()
    with g.as_default():
        variables = []
        for i in range(3):
            variables.append(fm.Variable(fm.zeros((1000, 500), fm.float32), name=f"kernel{i}"))
            variables.append(fm.Variable(fm.zeros((2500,), fm.float32), name=f"bias{i}"))
        total = fm.add_n([fm.reduce_sum(v) for v in variables])
        init = fm.global_variables_initializer()
    return g, total, init


def test_least_bytes_first_is_the_same_in_every_task():
    assignments = [VariablePlacer(2).assignments(kernels_and_biases()[0]) for _ in range(2)]
    assert assignments[0] == assignments[1]
    kernels = [assignments[0][f"kernel{i}/VarHandleOp"] for i in range(3)]
    assert kernels == ["/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:0"]


def test_loads_are_counted_per_ps_task_in_task_order():
    f32 = {"dtype": np.dtype("float32")}
    loads = ps_loads([
        ("/job:ps/task:10/device:CPU:0", {**f32, "shape": (250,)}),
        ("/job:ps/task:2", {**f32, "shape": (1000, 1000)}),
        ("/job:ps/task:2", {"dtype": np.dtype("float64"), "shape": (3,)}),
        ("/job:worker/task:0", {**f32, "shape": (7,)}),  # not a PS task's
    ])
    assert format_loads(loads) == "variables on 2 PS tasks: ps-2 4.00 MB (2), ps-10 1.00 KB (1)"


def test_the_chief_says_once_what_each_ps_task_holds(servers, capsys, monkeypatch):
    monkeypatch.setattr(distributed, "_placement_told", set())  # a fresh task life
    ports = free_ports(4)
    spec = ClusterSpec.from_dict({
        "ps": [f"127.0.0.1:{p}" for p in ports[:2]],
        "worker": [f"127.0.0.1:{p}" for p in ports[2:]],
    })
    for i in range(2):
        servers(spec, "ps", i)
    chief_server, other_server = servers(spec, "worker", 0), servers(spec, "worker", 1)
    g, total, init = kernels_and_biases()
    chief = DistributedSession(g, server=chief_server)
    chief.run(init)
    assert chief.run(total) == 0.0  # a second step: nothing more said
    chief.close()
    again = DistributedSession(g, server=chief_server)  # the same task's next session
    again.run(total)
    again.close()
    other = DistributedSession(g, server=other_server)  # not the chief
    other.run(total)
    other.close()
    err = capsys.readouterr().err
    line = "flowmill: variables on 2 PS tasks: ps-0 4.01 MB (3), ps-1 2.02 MB (3)"
    assert [x for x in err.splitlines() if "PS task" in x] == [line], err
