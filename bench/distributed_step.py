"""A distributed step beside the one-process step: what PS tasks and workers cost on one
machine, and what the launcher's thread defaults save.

The models (``--model``): ``mlp``, an MLP 784-256-256-10 with sigmoid hidden layers,
sparse softmax cross-entropy, plain SGD, on scikit-learn's ``make_classification`` (784
features, 10 classes, seed 0), global batch 256; ``digits``, the digits example's MLP
64-512-256-10 with ReLU and Adam on scikit-learn's 8x8 digits, global batch 32. Each runs

- in one process (a plain ``Session``, BLAS threads = the machine's cores);
- as local jobs (``flowmill run --local``): 1 PS + 2 workers in sync mode (each worker
  128 of the 256, one update per step), the same with every task given all the cores
  (``--inherit``: what the launcher did before it shared them out), 1 PS + 2 workers
  async, and 2 PS + 2 workers sync; all with mutual TLS between the tasks (the default,
  ``spec.security.tls``), and the sync job once more in plain TCP (``sync-plain``), which
  shows what securing the traffic costs a step (the handshakes and gRPC's TLS: between
  the tasks of one machine the tensor channel's local socket is authenticated, not
  sealed). Workers warm up, meet at a barrier (files in a
  directory the bench owns), take ``--steps`` timed steps and report when they started
  and ended.

The figure is the time per global batch trained (a sync step; two async updates of half
a batch each) over the span from the first timed step's start to the last one's end, and
its ratio to the one-process step. Same weights (seed), same batches everywhere. Each job
then runs again, ``--trace-steps`` steps with ``FLOWMILL_TRACE`` on, and the figures say
where a step's time went on the workers and on the PS tasks (``breakdown``: milliseconds
per step by kernel type, ``_Recv`` being time spent waiting for values, and the PS's
many-key pulls as ``prefetch``).

    python bench/distributed_step.py [--model mlp|digits] [--steps 200] [--warmup 20]
        [--examples 60000] [--trace-steps 50]
        [--configs one,sync,sync-plain,sync-inherit,async,sync-2ps]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import local_job

# name: (hidden widths, activation, optimizer, learning rate, global batch)
MODELS = {
    "mlp": ((256, 256), "sigmoid", "sgd", 0.1, 256),
    "digits": ((512, 256), "relu", "adam", 0.002, 32),
}
# name: (ps tasks, workers, mode, every task given all the cores, mutual TLS)
CONFIGS = {
    "sync": (1, 2, "sync", False, True),
    "sync-plain": (1, 2, "sync", False, False),
    "sync-inherit": (1, 2, "sync", True, True),
    "async": (1, 2, "async", False, True),
    "sync-2ps": (2, 2, "sync", False, True),
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps (of 256 examples)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--examples", type=int, default=60000)
    p.add_argument("--model", default="mlp", choices=sorted(MODELS))
    p.add_argument("--lr", type=float, default=None, help="default: the model's")
    p.add_argument("--trace-steps", type=int, default=50,
                   help="steps of the traced run of each job (0: none)")
    p.add_argument("--configs", default="one," + ",".join(CONFIGS))
    p.add_argument("--job-timeout", type=float, default=600.0)
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c != "one" and c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from one, {', '.join(CONFIGS)}")
    args.hidden, args.activation, args.optimizer, default_lr, args.batch = MODELS[args.model]
    args.lr = default_lr if args.lr is None else args.lr
    if args.steps < 1 or args.warmup < 1 or args.trace_steps < 0:
        p.error("--steps and --warmup must be positive, --trace-steps at least 0")
    if args.model == "mlp" and args.examples < args.batch:
        p.error("--examples: at least one batch")
    return args


def data(args):
    if args.model == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        return (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=args.examples, n_features=784, n_informative=64,
                               n_classes=10, random_state=0)
    return x.astype("float32"), y.astype("int64")


def build(fm, args, features: int):
    """The model's placeholders, loss and train op (the same in every process)."""
    x = fm.placeholder(fm.float32, (None, features), name="x")
    y = fm.placeholder(fm.int64, (None,), name="y")
    h = x
    activation = {"sigmoid": fm.nn.sigmoid, "relu": fm.nn.relu}[args.activation]
    for i, width in enumerate(args.hidden):
        h = fm.layers.dense(h, width, activation=activation, name=f"hidden{i}")
    logits = fm.layers.dense(h, 10, name="logits")
    loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))
    optimizer = (fm.train.Adam(args.lr) if args.optimizer == "adam"
                 else fm.train.GradientDescent(args.lr))
    train = optimizer.minimize(loss, fm.train.get_or_create_global_step())
    return x, y, loss, train


def batches(x, y, batch: int, share: slice):
    per_epoch = len(x) // batch

    def get(k: int):
        rows = slice((k % per_epoch) * batch, (k % per_epoch + 1) * batch)
        return x[rows][share], y[rows][share]

    return get


def one_process(args) -> float:
    """Seconds per 256-example step in one process."""
    import flowmill.runtime as fm

    x, y = data(args)
    get = batches(x, y, args.batch, slice(None))
    graph = fm.Graph(seed=0)
    with graph.as_default():
        xs, ys, loss, train = build(fm, args, x.shape[1])
        init = fm.global_variables_initializer()
    with fm.Session(graph) as sess:
        sess.run(init)
        step = sess.make_callable(loss, [xs, ys], targets=[train])
        for k in range(args.warmup):
            step(*get(k))
        start = time.perf_counter()
        for k in range(args.warmup, args.warmup + args.steps):
            step(*get(k))
        return (time.perf_counter() - start) / args.steps


def worker_main(args) -> int:
    """One worker of a bench job: its share of every batch, warm up, barrier, time."""
    import flowmill.runtime as fm
    from flowmill.runtime.job import task
    from flowmill.runtime.session_manager import initialize_or_wait

    out = Path(args.worker)
    me = task()
    x, y = data(args)
    half = args.batch // me.count
    get = batches(x, y, args.batch, slice(me.index * half, (me.index + 1) * half))
    graph = fm.Graph(seed=0)
    with graph.as_default():
        xs, ys, loss, train = build(fm, args, x.shape[1])
        init = fm.global_variables_initializer()
    from threadpoolctl import threadpool_info

    blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    with fm.Session(graph) as sess:
        initialize_or_wait(sess, init)
        step = sess.make_callable(loss, [xs, ys], targets=[train])
        for k in range(args.warmup):
            step(*get(k))
        local_job.barrier(out, me, args.job_timeout)
        start = time.time()
        for k in range(args.warmup, args.warmup + args.steps):
            step(*get(k))
        end = time.time()
    local_job.report(out, me, {"start": start, "end": end, "examples": args.steps * half,
                               "blas_threads": blas[0] if blas else None}, args.job_timeout)
    return 0


def command(args, steps: int) -> Callable[[Path], list[str]]:
    """The workers' command line, given the directory the job reports in."""
    return lambda out: [
        "python", str(Path(__file__).resolve()), "--worker", str(out), "--model", args.model,
        "--steps", str(steps), "--warmup", str(args.warmup), "--examples", str(args.examples),
        "--lr", str(args.lr), "--job-timeout", str(args.job_timeout)]


def run_job(args, name: str, trace_dir: str | None = None) -> dict:
    ps, workers, mode, inherit, tls = CONFIGS[name]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                        "FLOWMILL_TRACE")}
    if inherit:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(len(os.sched_getaffinity(0)))
    if trace_dir is not None:
        env["FLOWMILL_TRACE"] = trace_dir
    steps = args.steps if trace_dir is None else args.trace_steps
    reports, stderr = local_job.run(f"{args.model}-{name}-w{workers}",
                                    command(args, steps), ps, workers, mode, args.job_timeout,
                                    env, tls)
    threads = [line.split("flowmill: ", 1)[-1] for line in stderr.splitlines()
               if "BLAS/OpenMP threads on" in line]
    start, end = local_job.window(reports)
    examples = sum(r["examples"] for r in reports)
    return {"step_s": (end - start) / (examples / args.batch),
            "worker_blas_threads": [r["blas_threads"] for r in reports],
            "launcher": threads[0] if threads else None, "window": (start, end)}


def breakdown(args, name: str) -> dict:
    """Where a step's time goes, from a traced run of the job: per role (the workers'
    mean, the PS tasks' sum), milliseconds per global step by category (kernel type,
    ``prefetch`` for the many-key pulls), over the timed steps only; the largest few."""
    with tempfile.TemporaryDirectory(prefix="distributed-trace-") as tmp:
        job = run_job(args, name, trace_dir=tmp)
        trace = json.loads((Path(tmp) / "trace.json").read_text())
    start_us, end_us = (t * 1e6 for t in job["window"])
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "process_name"}
    ps, workers, mode, _, _ = CONFIGS[name]
    steps = args.trace_steps if mode == "sync" else args.trace_steps * workers
    totals: dict[str, dict[str, float]] = {"worker": {}, "ps": {}}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or not start_us <= e["ts"] <= end_us:
            continue
        role = names.get(e["pid"], "").split("-")[0]
        if role not in totals or e["cat"] in ("session", "task"):
            continue
        cat = totals[role]
        cat[e["cat"]] = cat.get(e["cat"], 0.0) + e["dur"] / 1e3
    out = {}
    for role, cats in totals.items():
        share = workers if role == "worker" else 1  # the workers' mean, the PS tasks' sum
        top = sorted(cats.items(), key=lambda kv: -kv[1])[:8]
        out[role] = {k: round(v / share / steps, 3) for k, v in top}
    out["traced_step_ms"] = round(job["step_s"] * 1e3, 3)
    return out


def main() -> int:
    args = _parse()
    if args.worker:
        return worker_main(args)
    cores = len(os.sched_getaffinity(0))
    widths = "-".join(str(w) for w in args.hidden)
    print(f"distributed_step: {args.model}, MLP {widths}-10 {args.activation}, "
          f"{args.optimizer}, global batch {args.batch}, {args.steps} timed steps after "
          f"{args.warmup} warm-up; {cores} core(s)")
    figures: dict[str, dict] = {}
    if "one" in args.configs:
        # One process: BLAS threads = the machine's cores, set before NumPy loads.
        code = ("import sys; sys.argv = sys.argv[:1] + " + repr(sys.argv[1:]) + "; "
                "sys.path.insert(0, " + repr(str(Path(__file__).parent)) + "); "
                "import distributed_step as d; print(d.one_process(d._parse()))")
        env = {**os.environ, **{v: str(cores) for v in
                                ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, cwd="/")
        figures["one"] = {"step_s": float(out.stdout.split()[-1])}
        print(f"  {'one process':<14} {figures['one']['step_s'] * 1e3:8.2f} ms/step", flush=True)
    for name in args.configs:
        if name == "one":
            continue
        figures[name] = run_job(args, name)
        ratio = ""
        if "one" in figures:
            figures[name]["ratio"] = round(figures[name]["step_s"] / figures["one"]["step_s"], 2)
            ratio = f"  {figures[name]['ratio']:.2f}x one process"
        print(f"  {name:<14} {figures[name]['step_s'] * 1e3:8.2f} ms/step{ratio}   "
              f"({figures[name]['launcher']})", flush=True)
        del figures[name]["window"]
        if args.trace_steps:
            figures[name]["breakdown"] = breakdown(args, name)
            print(f"  {'':<14} breakdown (ms/step): {figures[name]['breakdown']}", flush=True)
    for f in figures.values():
        f["step_ms"] = round(f.pop("step_s") * 1e3, 3)
    print(json.dumps({"bench": "distributed_step", "model": args.model, "cores": cores,
                      "batch": args.batch, "steps": args.steps, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
