"""Executor dispatch cost, the shape of TensorFlow's BM_executor benchmark.

A random DAG of ``width`` x ``depth`` null ops joined by control edges (each node waits on
``fan_in`` random nodes of the layer above) is run as one step, many times, from a cached
plan. The figure is null kernels invoked per second; the count comes from the compiled
plan and is checked once against a counting kernel, so a pass that deleted null ops would
lower it rather than inflate it. TensorFlow's own executor runs the same graph beside it
(graph optimizer and grappler off, one thread) when it is installed.

    python bench/dispatch.py [--width 64] [--depth 64] [--fan-in 2] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flowmill.runtime as fm  # noqa: E402
from flowmill.kernels import KERNELS  # noqa: E402


def dag_edges(width: int, depth: int, fan_in: int, seed: int) -> list[list[list[int]]]:
    """For each layer after the first, each node's control inputs (indices in the layer above)."""
    rng = random.Random(seed)
    return [[rng.sample(range(width), fan_in) for _ in range(width)] for _ in range(depth - 1)]


def build_dag(no_op, control_dependencies, width: int, edges):
    """The DAG plus one sink that waits on every node nothing else waits on, so the whole
    DAG is needed by the step (nothing is pruned). Returns the sink."""
    layers = [[no_op(name=f"n0_{i}") for i in range(width)]]
    for d, wiring in enumerate(edges, start=1):
        nxt = []
        for i, sources in enumerate(wiring):
            with control_dependencies([layers[-1][s] for s in sources]):
                nxt.append(no_op(name=f"n{d}_{i}"))
        layers.append(nxt)
    used = {id(layers[d][s]) for d, wiring in enumerate(edges) for srcs in wiring for s in srcs}
    leaves = [op for layer in layers for op in layer if id(op) not in used]
    with control_dependencies(leaves):
        return no_op(name="sink")


def build_flowmill(width: int, edges) -> tuple[fm.Graph, fm.Operation]:
    graph = fm.Graph()
    with graph.as_default():
        sink = build_dag(fm.no_op, fm.control_dependencies, width, edges)
    return graph, sink


def count_invocations(graph, targets) -> int:
    """Run one step with a counting NoOp kernel: how many null kernels really ran."""
    calls = [0]
    real = KERNELS[("NoOp", "CPU")]

    def counting(ctx):
        def noop():
            calls[0] += 1

        return noop

    KERNELS[("NoOp", "CPU")] = counting
    try:
        with fm.Session(graph) as sess:
            sess.run(targets)
    finally:
        KERNELS[("NoOp", "CPU")] = real
    return calls[0]


def time_interleaved(runs: dict, seconds: float, repeats: int = 7) -> dict[str, float]:
    """Median seconds per step of each runner, timed in alternating batches so that a
    noisy, shared machine slows every runner alike."""
    batch = {}
    for name, run in runs.items():
        run()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.1:
            run()
            n += 1
        batch[name] = max(1, int(n * seconds / repeats / len(runs) / 0.1))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(batch[name]):
                run()
            samples[name].append((time.perf_counter() - t0) / batch[name])
    return {name: statistics.median(v) for name, v in samples.items()}


def flowmill_step(width, edges) -> tuple:
    graph, targets = build_flowmill(width, edges)
    sess = fm.Session(graph)
    step = sess.make_callable(targets)
    kernel_calls = step.plan.kernel_calls
    invoked = count_invocations(graph, targets)
    if invoked != kernel_calls:
        raise SystemExit(f"plan says {kernel_calls} null kernels per step, {invoked} ran")
    return step, kernel_calls


def tensorflow_step(width, edges):
    try:
        import tensorflow as tf
    except ImportError:
        return None
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        sink = build_dag(tf.no_op, tf.control_dependencies, width, edges)
    config = v1.ConfigProto(
        inter_op_parallelism_threads=1,
        intra_op_parallelism_threads=1,
        use_per_session_threads=True,
    )
    config.graph_options.optimizer_options.opt_level = v1.OptimizerOptions.L0
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    sess = v1.Session(graph=graph, config=config)
    return sess.make_callable(sink)


def python_calls_step(n: int):
    """The floor: ``n`` straight-line calls of a Python function that does nothing."""

    def noop():
        return None

    src = "def step():\n" + "".join(f"    f{i}()\n" for i in range(n))
    namespace = {f"f{i}": noop for i in range(n)}
    exec(src, namespace)
    return namespace["step"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--fan-in", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0, help="total timed seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tensorflow", action="store_true")
    args = p.parse_args(argv)
    edges = dag_edges(args.width, args.depth, args.fan_in, args.seed)
    nodes = args.width * args.depth + 1  # with the sink

    fm_run, calls = flowmill_step(args.width, edges)
    runs = {"flowmill": fm_run, "python": python_calls_step(nodes)}
    if not args.no_tensorflow:
        tf_run = tensorflow_step(args.width, edges)
        if tf_run is not None:
            runs["tensorflow"] = tf_run
    times = time_interleaved(runs, args.seconds)
    fm_step, floor_step, tf_step = times["flowmill"], times["python"], times.get("tensorflow")
    result = {
        "bench": "dispatch",
        "graph": f"{args.width}x{args.depth} NoOp DAG, fan-in {args.fan_in}, control edges",
        "kernels_per_step": calls,
        "null_ops_per_sec": round(calls / fm_step),
        "step_us": round(fm_step * 1e6, 1),
        "python_call_floor_per_sec": round(nodes / floor_step),
        "tensorflow_null_ops_per_sec": round(nodes / tf_step) if tf_step else None,
        "ratio_vs_tensorflow": round((calls / fm_step) / (nodes / tf_step), 3) if tf_step else None,
        "python": sys.version.split()[0],
    }
    print(f"flowmill   {result['null_ops_per_sec']:>12,} null ops/s ({result['step_us']} us/step)")
    print(f"python     {result['python_call_floor_per_sec']:>12,} calls/s (straight-line floor)")
    if tf_step:
        print(f"tensorflow {result['tensorflow_null_ops_per_sec']:>12,} null ops/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
