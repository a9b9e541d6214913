"""Step traces (``runtime.trace``): with FLOWMILL_TRACE set, every task of a local job
writes its spans and the launcher merges them into one Chrome trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import yaml
from test_launcher import ROOT, job

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import flowmill.runtime as fm
    from flowmill.runtime.session_manager import initialize_or_wait
    x = fm.placeholder(fm.float32, (None, 4))
    w = fm.Variable(np.ones((4, 1), np.float32), name="w")
    loss = fm.reduce_mean(fm.matmul(x, w) ** 2)
    train = fm.train.GradientDescent(0.01).minimize(loss, fm.train.get_or_create_global_step())
    init = fm.global_variables_initializer()
    with fm.Session() as sess:
        initialize_or_wait(sess, init)
        for _ in range(5):
            sess.run(train, {x: np.ones((8, 4), np.float32)})
    """
)


def test_a_sync_job_s_tasks_are_traced_into_one_file(tmp_path):
    manifest = job(["python", "-c", SCRIPT], workers=2, ps=1)
    manifest["spec"]["training"] = {"mode": "sync"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    traces = tmp_path / "traces"
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, env={**os.environ, "FLOWMILL_TRACE": str(traces)}, capture_output=True,
        text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"step trace of every task: {traces / 'trace.json'}" in proc.stderr
    body = json.loads((traces / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in body["traceEvents"]
             if e["name"] == "process_name"}
    assert sorted(names.values()) == ["ps-0", "worker-0", "worker-1"]
    spans: dict[str, set] = {task: set() for task in names.values()}
    for e in body["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] > 0
            spans[names[e["pid"]]].add(e["name"] if e["cat"] in ("session", "task")
                                        else e["cat"])
    for worker in ("worker-0", "worker-1"):  # steps, and the pulls inside them
        assert {"step", "_Recv", "MatMul"} <= spans[worker], spans[worker]
    # The PS runs the workers' partitions: their gradients into the accumulator, the
    # chief's update, the tokens.
    assert {"RunGraph", "AccumulatorApplyGradient", "AccumulatorTakeGradient",
            "QueueDequeueV2"} <= spans["ps-0"], spans["ps-0"]


def test_kernels_are_wrapped_only_when_tracing(tmp_path):
    """Off, the executor binds the plain kernels; on, each call is a span."""
    code = textwrap.dedent(
        """
        import flowmill.runtime as fm
        x = fm.placeholder(fm.float32, (2,))
        with fm.Session() as sess:
            call = sess.make_callable(fm.exp(x * 2.0), [x])
            call([1.0, 2.0])
            bound = call.plan.run.__globals__
            kernels = [bound[f"k{i}"] for i in range(len(call.plan.order)) if f"k{i}" in bound]
            print(len(kernels), sum(k.__name__ == "traced" for k in kernels))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "FLOWMILL_TRACE"}
    run = dict(capture_output=True, text=True, check=True, cwd="/")
    off = subprocess.run([sys.executable, "-c", code], env=env, **run).stdout.split()
    assert int(off[0]) >= 2 and off[1] == "0", off
    traced = {**env, "FLOWMILL_TRACE": str(tmp_path)}
    on = subprocess.run([sys.executable, "-c", code], env=traced, **run).stdout.split()
    assert on[0] == on[1] == off[0], on
    assert [p.name.split("-")[1] for p in tmp_path.glob("trace-*.json")] == ["local"]
