"""A training step fed by an ``fm.data`` pipeline beside the same step on synthetic data.

The TensorFlow benchmarks (seed 004) train once on synthetic data held statically by the
graph and once through the full input pipeline, and find them close: the pipeline keeps
the step fed. This is that comparison for one step of a 784-256-256-10 ReLU MLP (softmax
cross-entropy, SGD), batch 256, float32, CPU, each variant in its own graph and session
from the same initial weights, with no feed in any step:

- ``synthetic``: one normalized batch held by the graph (variables: nothing to read, and
  nothing a constant would let the step fold away);
- ``pipeline``: 60,000 uint8 images and int64 labels in memory (MNIST's size), read by
  ``from_tensor_slices(...).shuffle(10000).repeat().batch(256).map(normalize)
  .prefetch(2)``: a batch is one gather of shuffled rows, normalized as a whole
  (TensorFlow's guide: batch before a cheap map, to vectorize it);
- ``pipeline_elementwise``: the same with ``map`` before ``batch``, so ``normalize`` runs
  once per image (256 Python calls per batch, on the prefetch thread);
- ``records``: the same images as a file of 60,000 785-byte records (label byte, then the
  pixels, CIFAR's binary layout), read by ``FixedLengthRecordDataset`` (memory-mapped)
  with the same shuffle, batch, decoding map and prefetch.

Steps are timed in interleaved blocks in rotating order after a warm-up, so load from
elsewhere slows every variant alike; the figure is the median block's time per step.
Thread counts are fixed before NumPy loads (``--threads``, default 1, as ``mlp_step.py``).

    python bench/input_pipeline.py [--threads 1] [--batch 256] [--blocks 15] [--block-steps 10]

Last, the pipeline is timed alone (no prefetch, no model): the work per batch that the
prefetch thread has to hide behind the step.

The last line of output is one JSON object; ``ratio`` is ``pipeline_ms / synthetic_ms``.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--examples", type=int, default=60_000)
    p.add_argument("--blocks", type=int, default=15, help="timed blocks per variant")
    p.add_argument("--block-steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per variant")
    p.add_argument("--lr", type=float, default=0.01)
    return p.parse_args(argv)


ARGS = _parse() if __name__ == "__main__" else _parse([])
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)

import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import flowmill.runtime as fm  # noqa: E402
from flowmill.runtime.ops.nn_ops import (  # noqa: E402
    bias_add,
    relu,
    sparse_softmax_cross_entropy_with_logits,
)
from flowmill.runtime.optimizers import GradientDescent  # noqa: E402

SIZES = (784, 256, 256, 10)
SHUFFLE_BUFFER = 10_000
SEED = 0


def make_data(n: int, seed: int = SEED):
    """MNIST-shaped data: ``n`` uint8 images of 784 pixels, int64 labels; and weights."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, SIZES[0]), dtype=np.uint8)
    labels = rng.integers(0, SIZES[-1], size=n).astype(np.int64)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:], strict=True):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        params.append(rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return images, labels, params


def normalize(images, labels):
    """uint8 pixels to float32 in [0, 1], one image or a batch of them alike (one pass:
    the cast happens inside the multiply)."""
    return np.multiply(images, np.float32(1 / 255), dtype=np.float32), labels


def decode(records):
    """A batch of 785-byte records: the label byte, then the pixels."""
    pixels = np.multiply(records[:, 1:], np.float32(1 / 255), dtype=np.float32)
    return pixels, records[:, 0].astype(np.int64)


def write_records(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    table = np.empty((len(images), 1 + images.shape[1]), np.uint8)
    table[:, 0], table[:, 1:] = labels, images
    path.write_bytes(table.tobytes())


def build_step(params, lr: float, inputs: Callable[[], tuple]) -> tuple[Callable[[], float], int]:
    """The step on whatever ``inputs()`` builds in the graph: () -> loss; and its kernel count."""
    graph = fm.Graph(seed=0)
    with graph.as_default():
        x, y = inputs()
        h = x
        variables = [fm.Variable(a, name=f"p{i}") for i, a in enumerate(params)]
        for i in range(3):
            h = bias_add(fm.matmul(h, variables[2 * i]), variables[2 * i + 1])
            if i < 2:
                h = relu(h)
        loss = fm.reduce_mean(sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        train = GradientDescent(lr).minimize(loss)
        init = fm.global_variables_initializer()
    sess = fm.Session(graph)
    sess.run(init)
    step = sess.make_callable(loss, targets=[train])
    return (lambda: float(step())), step.plan.kernel_calls


def pipeline_alone(images, labels, b: int, batches: int = 200) -> float:
    """Milliseconds per batch the pipeline costs by itself (read in the step's own thread,
    no prefetch, no model): the work a prefetch thread has to hide behind the step."""
    graph = fm.Graph(seed=0)
    with graph.as_default():
        ds = (fm.data.Dataset.from_tensor_slices((images, labels))
              .shuffle(SHUFFLE_BUFFER, seed=SEED).repeat().batch(b, drop_remainder=True)
              .map(normalize))
        batch = ds.make_one_shot_iterator().get_next()
    with fm.Session(graph) as sess:
        read = sess.make_callable(batch)
        for _ in range(10):
            read()
        start = time.perf_counter()
        for _ in range(batches):
            read()
        return (time.perf_counter() - start) / batches * 1e3


def time_interleaved(steps: dict[str, Callable], blocks: int, block_steps: int):
    """Median milliseconds per step over ``blocks`` blocks, variants in rotating order."""
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


def main() -> None:
    args = ARGS
    images, labels, params = make_data(args.examples)
    b = args.batch
    data = fm.data.Dataset

    def synthetic():
        # Held by the graph as (non-trainable) variables, not constants: a constant batch
        # would let the step fold what it computes from it, doing less than a real step.
        x, y = normalize(images[:b], labels[:b])
        return (fm.Variable(x, trainable=False, name="x").value(),
                fm.Variable(y, trainable=False, name="y").value())

    def pipeline():
        ds = (data.from_tensor_slices((images, labels)).shuffle(SHUFFLE_BUFFER, seed=SEED)
              .repeat().batch(b, drop_remainder=True).map(normalize).prefetch(2))
        return ds.make_one_shot_iterator().get_next()

    def pipeline_elementwise():
        ds = (data.from_tensor_slices((images, labels)).shuffle(SHUFFLE_BUFFER, seed=SEED)
              .repeat().map(normalize).batch(b, drop_remainder=True).prefetch(2))
        return ds.make_one_shot_iterator().get_next()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "images.bin"
        write_records(path, images, labels)

        def records():
            ds = (fm.data.FixedLengthRecordDataset(path, 1 + SIZES[0])
                  .shuffle(SHUFFLE_BUFFER, seed=SEED).repeat().batch(b, drop_remainder=True)
                  .map(decode).prefetch(2))
            return ds.make_one_shot_iterator().get_next()

        variants = {"synthetic": synthetic, "pipeline": pipeline,
                    "pipeline_elementwise": pipeline_elementwise, "records": records}
        steps, kernels = {}, {}
        for name, inputs in variants.items():
            steps[name], kernels[name] = build_step(params, args.lr, inputs)
        for fn in steps.values():
            for _ in range(args.warmup):
                fn()
        print(f"input_pipeline: {'-'.join(map(str, SIZES))} MLP, batch {b}, float32, SGD, "
              f"{args.threads} thread(s), {args.examples} examples; median of {args.blocks} "
              f"blocks of {args.block_steps} steps")
        print("  kernel calls per step: " + ", ".join(f"{n} {k}" for n, k in kernels.items()))
        ms = time_interleaved(steps, args.blocks, args.block_steps)
    alone = pipeline_alone(images, labels, b)
    for name, value in ms.items():
        ratio = value / ms["synthetic"]
        print(f"  {name:<22} {value:8.2f} ms/step   {ratio:6.3f}x synthetic   "
              f"{b / value * 1e3:9,.0f} examples/s")
    print(f"  the pipeline alone (no prefetch, no model): {alone:.3f} ms per batch")

    def r(v):
        return round(v, 3)

    print(json.dumps({
        "bench": "input_pipeline",
        "synthetic_ms": r(ms["synthetic"]),
        "pipeline_ms": r(ms["pipeline"]),
        "records_ms": r(ms["records"]),
        "pipeline_elementwise_ms": r(ms["pipeline_elementwise"]),
        "ratio": r(ms["pipeline"] / ms["synthetic"]),
        "records_ratio": r(ms["records"] / ms["synthetic"]),
        "elementwise_ratio": r(ms["pipeline_elementwise"] / ms["synthetic"]),
        "pipeline_alone_ms": r(alone),
        "threads": args.threads,
        "batch": b,
        "examples": args.examples,
    }))


if __name__ == "__main__":
    sys.exit(main())
