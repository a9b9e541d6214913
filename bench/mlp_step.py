"""One training step of a 784-512-512-10 MLP: Flowmill beside NumPy, TensorFlow and PyTorch.

Each framework runs the same step on the same data from the same initial weights:
forward (relu layers, softmax cross-entropy with integer labels, mean over the batch),
backward, and a plain SGD update of the six parameters, returning the loss. The peers:

- a hand-written NumPy step (the floor for Flowmill's NumPy kernels: same BLAS, no graph);
- TensorFlow: the step as one ``tf.function`` (GradientTape + ``assign_sub``);
- PyTorch: eager autograd, ``loss.backward()`` and in-place ``sub_`` under ``no_grad``.

Every framework is held to the same number of threads (BLAS/OpenMP env vars are set
before NumPy is imported; TensorFlow intra-op threads, one inter-op thread; PyTorch
intra-op threads). The default is one thread: thread pools that spin while they wait
(OpenBLAS, OpenMP) slow down several-fold as soon as another process holds one of a small
machine's cores, which would measure the neighbours rather than the step; pass
``--threads N`` on a quiet machine. Steps are timed in interleaved blocks so that a noisy
machine slows every framework alike; the figure is the median over blocks of the time per
step. Every framework runs the same number of steps, and the losses after them are
printed side by side, so a framework that skipped work would show.

With ``--check-numerics`` the Flowmill step also runs, timed in the same blocks, in a
session that checks every float output for NaN and Inf (``Session(check_numerics=True)``),
and the JSON line gives what that costs.

    python bench/mlp_step.py [--threads 1] [--batch 256] [--blocks 15] [--block-steps 5]
                             [--check-numerics]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--blocks", type=int, default=15, help="timed blocks per framework")
    p.add_argument("--block-steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per framework")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--only", default="", help="comma-separated subset of frameworks to run")
    p.add_argument("--check-numerics", action="store_true",
                   help="also time the Flowmill step with the session's numerics check on")
    return p.parse_args(argv)


ARGS = _parse() if __name__ == "__main__" else _parse([])
# Thread counts must be fixed before NumPy (OpenBLAS), TensorFlow or PyTorch load.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

SIZES = (784, 512, 512, 10)


def make_problem(batch: int, seed: int = 0):
    """Glorot-uniform weights, zero biases, random inputs and labels (float32, int64)."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:], strict=True):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        params.append(rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    x = rng.normal(size=(batch, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=batch).astype(np.int64)
    return params, x, y


# ---- the steps: each maker returns a () -> float loss


def numpy_step(params, x, y, lr) -> Callable[[], float]:
    p = [a.copy() for a in params]
    rows = np.arange(len(y))

    def step():
        w1, b1, w2, b2, w3, b3 = p
        h1 = np.maximum(x @ w1 + b1, 0)
        h2 = np.maximum(h1 @ w2 + b2, 0)
        logits = h2 @ w3 + b3
        shifted = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=1, keepdims=True)
        loss = np.mean(np.log(s[:, 0]) - shifted[rows, y])
        d3 = e / s
        d3[rows, y] -= 1
        d3 /= len(y)
        g_w3, g_b3 = h2.T @ d3, d3.sum(axis=0)
        d2 = d3 @ w3.T
        d2 *= h2 > 0
        g_w2, g_b2 = h1.T @ d2, d2.sum(axis=0)
        d1 = d2 @ w2.T
        d1 *= h1 > 0
        g_w1, g_b1 = x.T @ d1, d1.sum(axis=0)
        for param, g in zip(p, (g_w1, g_b1, g_w2, g_b2, g_w3, g_b3), strict=True):
            g *= lr
            param -= g
        return float(loss)

    return step


def flowmill_step(
    params, x, y, lr, check_numerics: bool = False, device: str = "", cuda_graphs: bool = False
) -> tuple[Callable[[], float], Callable[[], float], object]:
    """The fast path (``make_callable``), the plain ``Session.run`` path, and the plan;
    with ``device`` (``/gpu:0``) the whole model, variables too, is placed there, and with
    ``cuda_graphs`` its sessions replay captured steps."""
    import flowmill.runtime as fm
    from flowmill.runtime.ops.nn_ops import bias_add, relu, sparse_softmax_cross_entropy_with_logits
    from flowmill.runtime.optimizers import GradientDescent

    graph = fm.Graph(seed=0)
    with graph.as_default(), fm.device(device):
        xs = fm.placeholder(fm.float32, (None, SIZES[0]), name="x")
        ys = fm.placeholder(fm.int64, (None,), name="y")
        h = xs
        variables = [fm.Variable(a, name=f"p{i}") for i, a in enumerate(params)]
        for i in range(3):
            h = bias_add(fm.matmul(h, variables[2 * i]), variables[2 * i + 1])
            if i < 2:
                h = relu(h)
        loss = fm.reduce_mean(sparse_softmax_cross_entropy_with_logits(labels=ys, logits=h))
        train = GradientDescent(lr).minimize(loss)
        init = fm.global_variables_initializer()
    # Two sessions, so each path trains its own copy of the weights from the same start.
    fast_sess = fm.Session(graph, check_numerics=check_numerics, cuda_graphs=cuda_graphs)
    run_sess = fm.Session(graph, check_numerics=check_numerics, cuda_graphs=cuda_graphs)
    fast_sess.run(init)
    run_sess.run(init)
    fast = fast_sess.make_callable(loss, [xs, ys], targets=[train])

    def step():
        return float(fast(x, y))

    def run_step():
        return float(run_sess.run([loss, train], {xs: x, ys: y})[0])

    return step, run_step, fast.plan


def tensorflow_step(params, x, y, lr, threads) -> Callable[[], float] | None:
    try:
        import tensorflow as tf
    except ImportError:
        return None
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    variables = [tf.Variable(a) for a in params]
    tx, ty = tf.constant(x), tf.constant(y)

    @tf.function
    def train(xb, yb):
        with tf.GradientTape() as tape:
            w1, b1, w2, b2, w3, b3 = variables
            h1 = tf.nn.relu(tf.matmul(xb, w1) + b1)
            h2 = tf.nn.relu(tf.matmul(h1, w2) + b2)
            logits = tf.matmul(h2, w3) + b3
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits)
            )
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads, strict=True):
            v.assign_sub(lr * g)
        return loss

    return lambda: float(train(tx, ty))


def torch_step(params, x, y, lr, threads, device: str = "cpu") -> Callable[[], float] | None:
    """With ``device`` ``cuda`` the weights live on the GPU and each step copies its
    batch there from host memory, as a feed does."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    p = [torch.tensor(a, requires_grad=True, device=device) for a in params]
    hx, hy = torch.from_numpy(x), torch.from_numpy(y)
    f = torch.nn.functional

    def step():
        tx, ty = hx.to(device), hy.to(device)
        w1, b1, w2, b2, w3, b3 = p
        h1 = torch.relu(tx @ w1 + b1)
        h2 = torch.relu(h1 @ w2 + b2)
        loss = f.cross_entropy(h2 @ w3 + b3, ty)
        loss.backward()
        with torch.no_grad():
            for param in p:
                param.sub_(param.grad, alpha=lr)
                param.grad = None
        return float(loss.detach())

    return step


# ---- timing


def time_interleaved(
    steps: dict[str, Callable], blocks: int, block_steps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median milliseconds per step over ``blocks`` blocks, frameworks in rotating order;
    and each framework's loss at its last step."""
    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, float] = {}
    for b in range(blocks):
        order = names[b % len(names):] + names[: b % len(names)]
        for n in order:
            fn = steps[n]
            start = time.perf_counter()
            for _ in range(block_steps):
                loss = fn()
            samples[n].append((time.perf_counter() - start) / block_steps * 1e3)
            last[n] = loss
    return {n: statistics.median(v) for n, v in samples.items()}, last


def main() -> None:
    args = ARGS
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    params, x, y = make_problem(args.batch)
    fm_fast, fm_run, plan = flowmill_step(params, x, y, args.lr)
    checked = (
        flowmill_step(params, x, y, args.lr, check_numerics=True) if args.check_numerics else None
    )
    candidates = {
        "flowmill": lambda: fm_fast,
        "flowmill_checked": lambda: checked and checked[0],
        "flowmill_run": lambda: fm_run,
        "numpy": lambda: numpy_step(params, x, y, args.lr),
        "tensorflow": lambda: tensorflow_step(params, x, y, args.lr, args.threads),
        "torch": lambda: torch_step(params, x, y, args.lr, args.threads),
    }
    steps = {}
    for name, make in candidates.items():
        if only and name not in only and name not in ("flowmill", "flowmill_checked"):
            continue
        fn = make()
        if fn is not None:
            steps[name] = fn
    losses = {}
    for name, fn in steps.items():
        first = fn()
        for _ in range(args.warmup - 1):
            fn()
        losses[name] = first
    print(f"mlp_step: {'-'.join(map(str, SIZES))} MLP, batch {args.batch}, float32, SGD, "
          f"{args.threads} thread(s); median of {args.blocks} blocks of {args.block_steps} steps")
    print(f"  flowmill plan: {plan.kernel_calls} kernel calls per step")
    if checked is not None:
        print(f"  flowmill plan with numerics checks: {checked[2].kernel_calls} kernel calls")
    first_losses = ", ".join(f"{n} {v:.5f}" for n, v in losses.items())
    print(f"  loss at the first step (same data, same weights): {first_losses}")
    ms, last = time_interleaved(steps, args.blocks, args.block_steps)
    for name, value in ms.items():
        print(f"  {name:<16} {value:8.2f} ms/step   loss after the last step {last[name]:.5f}")
    peers = {n: ms.get(n) for n in ("numpy", "tensorflow", "torch")}
    best = min((v for v in peers.values() if v is not None), default=None)
    ratio = ms["flowmill"] / best if best else None
    if ratio is not None:
        print(f"  flowmill / best peer: {ratio:.2f}x")

    def r(v):
        return None if v is None else round(v, 3)

    print(json.dumps({
        "bench": "mlp_step",
        "flowmill_ms": r(ms["flowmill"]),
        "numpy_ms": r(peers["numpy"]),
        "tensorflow_ms": r(peers["tensorflow"]),
        "torch_ms": r(peers["torch"]),
        "ratio_vs_best_peer": None if ratio is None else round(ratio, 3),
        "flowmill_checked_ms": r(ms.get("flowmill_checked")),
        "check_numerics_overhead": (
            round(ms["flowmill_checked"] / ms["flowmill"], 3) if "flowmill_checked" in ms else None
        ),
        "threads": args.threads,
        "batch": args.batch,
    }))


if __name__ == "__main__":
    sys.exit(main())
