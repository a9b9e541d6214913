"""One training step of the convnet example: Flowmill beside PyTorch and TensorFlow.

The network is ``examples/convnet/train.py``'s own ``build_model`` (two blocks of 3x3
convolution without bias, batch normalization, ReLU and 2x2 max pooling; a dense ReLU
layer, dropout, a dense head; sparse softmax cross-entropy), and the step is forward,
backward, batch normalization's moving-average updates and a plain SGD update of every
trainable variable. The peers write the same network the way their users would:

- PyTorch: eager autograd over ``torch.nn.functional`` (``conv2d``, ``batch_norm`` in
  training mode, which updates the running statistics, ``max_pool2d``, ``dropout``), NCHW
  (its native CPU layout), ``loss.backward()`` and in-place ``sub_`` under ``no_grad``;
- TensorFlow: the step as one ``tf.function`` over ``tf.nn.conv2d``, the fused batch norm
  (``FusedBatchNormV3``, what ``tf.layers.batch_normalization`` runs on images) with its
  moving averages assigned, ``tf.nn.max_pool2d`` and ``tf.nn.dropout``; NHWC.

Same weights (the dense layer's rows permuted for PyTorch's NCHW flattening), same images
and labels, same batch, same thread count (BLAS/OpenMP env vars set before NumPy loads;
TensorFlow intra-op threads and one inter-op thread; ``torch.set_num_threads``). Dropout
draws its own mask in each framework, so to show the three compute one step, each is built
a second time without dropout and the losses of its first three steps are printed side by
side (they agree to float32 rounding). The default is one thread, as in ``mlp_step.py``:
spinning thread pools measure the neighbours on a shared two-core machine.

Steps are timed in interleaved blocks (frameworks in rotating order, after a warm-up);
the figure is the median block's time per step.

    python bench/conv_step.py [--image 28] [--batch 64] [--threads 1] [--blocks 11]
                              [--block-steps 5] [--only flowmill,torch]

``--image 8 --batch 32`` is the digits run's step, ``--image 28 --batch 64`` (default)
Fashion-MNIST's. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", type=int, default=28, help="image height and width")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--filters", type=int, nargs=2, default=[32, 64])
    p.add_argument("--dense", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--blocks", type=int, default=11, help="timed blocks per framework")
    p.add_argument("--block-steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per framework")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--only", default="", help="comma-separated subset: flowmill,torch,tensorflow")
    return p.parse_args(argv)


ARGS = _parse() if __name__ == "__main__" else _parse([])
# Thread counts must be fixed before NumPy (OpenBLAS), TensorFlow or PyTorch load.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "convnet" / "train.py"
NUM_CLASSES = 10
BN_EPSILON = 1e-3  # fm.layers.batch_normalization's default, given to the peers too
BN_MOMENTUM = 0.9
CHECK_STEPS = 3


def load_example():
    """The example script as a module (it is a script, not a package): its ``build_model``
    is the network every framework here runs."""
    spec = importlib.util.spec_from_file_location("convnet_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the problem: weights and data, NHWC and HWIO as Flowmill and TensorFlow hold them


def make_problem(args, seed: int = 0):
    """Glorot-uniform kernels, BN's gamma 1 and beta 0, zero biases; images in [0, 1)."""
    rng = np.random.default_rng(seed)

    def glorot(shape, fan_in, fan_out):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape).astype(np.float32)

    params = {}
    channels = 1
    side = args.image
    for i, width in enumerate(args.filters):
        params[f"block{i}/conv/kernel"] = glorot((3, 3, channels, width), 9 * channels, 9 * width)
        params[f"block{i}/bn/gamma"] = np.ones(width, np.float32)
        params[f"block{i}/bn/beta"] = np.zeros(width, np.float32)
        channels = width
        side = -(-side // 2)
    flat = side * side * channels
    params["fc/kernel"] = glorot((flat, args.dense), flat, args.dense)
    params["fc/bias"] = np.zeros(args.dense, np.float32)
    params["logits/kernel"] = glorot((args.dense, NUM_CLASSES), args.dense, NUM_CLASSES)
    params["logits/bias"] = np.zeros(NUM_CLASSES, np.float32)
    x = rng.random((args.batch, args.image, args.image, 1), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=args.batch).astype(np.int64)
    return params, x, y, side


# ---- the steps: each maker returns a () -> float loss


def flowmill_step(example, params, x, y, args, dropout, device: str = ""):
    """The example's network, SGD over its trainable variables, BN updates first; the step
    through ``make_callable``. Returns the step and the plan's kernel-call count. With
    ``device`` (``/gpu:0``) the whole model, variables too, is placed there."""
    import flowmill.runtime as fm

    graph = fm.Graph(seed=0)
    with graph.as_default(), fm.device(device):
        xs = fm.placeholder(fm.float32, (None, *x.shape[1:]), name="x")
        ys = fm.placeholder(fm.int64, (None,), name="y")
        model = example.build_model(xs, ys, training=True, filters=tuple(args.filters),
                                    dense=args.dense, dropout=dropout, bn_momentum=BN_MOMENTUM)
        with fm.control_dependencies(fm.get_collection(fm.GraphKeys.UPDATE_OPS)):
            train = fm.train.GradientDescent(args.lr).minimize(model["loss"])
        by_name = {v.name: v for v in fm.trainable_variables()}
        if set(by_name) != set(params):
            raise RuntimeError(f"the example's variables {sorted(by_name)} are not the bench's "
                               f"{sorted(params)}: update make_problem")
        load = [by_name[k].assign(fm.constant(v)) for k, v in params.items()]
        init = fm.global_variables_initializer()
    sess = fm.Session(graph)
    sess.run(init)
    sess.run(load)
    fast = sess.make_callable(model["loss"], [xs, ys], targets=[train])
    return (lambda: float(fast(x, y))), fast.plan.kernel_calls


def torch_step(params, x, y, args, dropout, side,
               device: str = "cpu") -> Callable[[], float] | None:
    """With ``device`` ``cuda`` the weights live on the GPU and each step copies its
    batch there from host memory, as a feed does."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    f = torch.nn.functional
    p = {}
    for k, v in params.items():
        if k.endswith("conv/kernel"):
            v = v.transpose(3, 2, 0, 1)  # HWIO -> OIHW
        elif k == "fc/kernel":  # rows from NHWC's (h, w, c) flattening to NCHW's (c, h, w)
            c = args.filters[-1]
            v = v.reshape(side, side, c, -1).transpose(2, 0, 1, 3).reshape(v.shape)
        p[k] = torch.tensor(np.ascontiguousarray(v), requires_grad=True, device=device)
    stats = {i: (torch.zeros(w, device=device), torch.ones(w, device=device))
             for i, w in enumerate(args.filters)}
    hx = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    hy = torch.from_numpy(y)
    blocks = len(args.filters)

    def step():
        h, ty = hx.to(device), hy.to(device)
        for i in range(blocks):
            h = f.conv2d(h, p[f"block{i}/conv/kernel"], padding=1)
            h = f.batch_norm(h, *stats[i], p[f"block{i}/bn/gamma"], p[f"block{i}/bn/beta"],
                             training=True, momentum=1 - BN_MOMENTUM, eps=BN_EPSILON)
            h = f.max_pool2d(torch.relu(h), 2, 2, ceil_mode=True)
        h = torch.relu(h.flatten(1) @ p["fc/kernel"] + p["fc/bias"])
        if dropout:
            h = f.dropout(h, dropout, training=True)
        loss = f.cross_entropy(h @ p["logits/kernel"] + p["logits/bias"], ty)
        loss.backward()
        with torch.no_grad():
            for param in p.values():
                param.sub_(param.grad, alpha=args.lr)
                param.grad = None
        return float(loss.detach())

    return step


def tensorflow_step(params, x, y, args, dropout) -> Callable[[], float] | None:
    try:
        import tensorflow as tf
    except ImportError:
        return None
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.random.set_seed(0)
    names = list(params)
    variables = {k: tf.Variable(v) for k, v in params.items()}
    moving = {i: (tf.Variable(tf.zeros(w)), tf.Variable(tf.ones(w)))
              for i, w in enumerate(args.filters)}
    tx, ty = tf.constant(x), tf.constant(y)
    blocks = len(args.filters)

    @tf.function
    def train(xb, yb):
        with tf.GradientTape() as tape:
            h = xb
            for i in range(blocks):
                h = tf.nn.conv2d(h, variables[f"block{i}/conv/kernel"], 1, "SAME")
                mean, var = moving[i]
                h, batch_mean, batch_var = tf.compat.v1.nn.fused_batch_norm(
                    h, variables[f"block{i}/bn/gamma"], variables[f"block{i}/bn/beta"],
                    mean=mean, variance=var, epsilon=BN_EPSILON, is_training=True,
                    exponential_avg_factor=1 - BN_MOMENTUM)
                mean.assign(batch_mean)
                var.assign(batch_var)
                h = tf.nn.max_pool2d(tf.nn.relu(h), 2, 2, "SAME")
            h = tf.reshape(h, (tf.shape(h)[0], -1))
            h = tf.nn.relu(tf.matmul(h, variables["fc/kernel"]) + variables["fc/bias"])
            if dropout:
                h = tf.nn.dropout(h, rate=dropout)
            logits = tf.matmul(h, variables["logits/kernel"]) + variables["logits/bias"]
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        trainable = [variables[k] for k in names]
        grads = tape.gradient(loss, trainable)
        for v, g in zip(trainable, grads, strict=True):
            v.assign_sub(args.lr * g)
        return loss

    return lambda: float(train(tx, ty))


# ---- timing


def time_interleaved(steps: dict[str, Callable], blocks: int, block_steps: int):
    """Median milliseconds per step over ``blocks`` blocks, frameworks in rotating order."""
    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        for n in names[b % len(names):] + names[: b % len(names)]:
            fn = steps[n]
            start = time.perf_counter()
            for _ in range(block_steps):
                fn()
            samples[n].append((time.perf_counter() - start) / block_steps * 1e3)
    return {n: statistics.median(v) for n, v in samples.items()}


def make_steps(example, params, x, y, args, side, dropout, only):
    makers = {
        "flowmill": lambda: flowmill_step(example, params, x, y, args, dropout)[0],
        "torch": lambda: torch_step(params, x, y, args, dropout, side),
        "tensorflow": lambda: tensorflow_step(params, x, y, args, dropout),
    }
    steps = {}
    for name, make in makers.items():
        if only and name not in only and name != "flowmill":
            continue
        fn = make()
        if fn is not None:
            steps[name] = fn
    return steps


def main() -> None:
    args = ARGS
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    example = load_example()
    params, x, y, side = make_problem(args)
    sizes = {"image": [args.image, args.image, 1], "filters": args.filters,
             "dense": args.dense, "classes": NUM_CLASSES, "dropout": args.dropout}
    print(f"conv_step: {args.image}x{args.image}x1 images, conv3x3 {args.filters[0]}-"
          f"{args.filters[1]} + BN + ReLU + maxpool2, dense {args.dense}, dropout "
          f"{args.dropout}, {NUM_CLASSES} classes; batch {args.batch}, float32, SGD, "
          f"{args.threads} thread(s); median of {args.blocks} blocks of {args.block_steps} steps")
    # Same work: without dropout, every framework's first losses from the same start.
    checks = make_steps(example, params, x, y, args, side, 0.0, only)
    for name, fn in checks.items():
        losses = " ".join(f"{fn():.5f}" for _ in range(CHECK_STEPS))
        print(f"  {name:<10} losses of its first {CHECK_STEPS} steps without dropout: {losses}")
    del checks
    steps = make_steps(example, params, x, y, args, side, args.dropout, only)
    _, kernel_calls = flowmill_step(example, params, x, y, args, args.dropout)
    print(f"  flowmill plan: {kernel_calls} kernel calls per step")
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    ms = time_interleaved(steps, args.blocks, args.block_steps)
    for name, value in ms.items():
        print(f"  {name:<10} {value:8.2f} ms/step")
    peers = {n: ms.get(n) for n in ("torch", "tensorflow")}
    best = min((v for v in peers.values() if v is not None), default=None)
    ratio = ms["flowmill"] / best if best else None
    if ratio is not None:
        print(f"  flowmill / best peer: {ratio:.2f}x")

    def r(v):
        return None if v is None else round(v, 3)

    print(json.dumps({
        "bench": "conv_step",
        "flowmill_ms": r(ms["flowmill"]),
        "torch_ms": r(peers["torch"]),
        "tensorflow_ms": r(peers["tensorflow"]),
        "ratio_vs_best_peer": None if ratio is None else round(ratio, 3),
        "threads": args.threads,
        "batch": args.batch,
        "sizes": sizes,
    }))


if __name__ == "__main__":
    sys.exit(main())
