"""Train a small convolutional network (the paper's image classifier, Fig. 7) with Flowmill.

    python examples/convnet/train.py [--dataset digits|fashion-mnist] [--epochs N] [--seed S]

Two conv-pool blocks (3x3 convolution, batch normalization, ReLU, 2x2 max pooling), then a
dense ReLU layer, dropout and a dense softmax head, written with ``fm.layers`` the way a
TensorFlow 1.x script writes it: ``variable_scope`` names the variables, batch
normalization's moving averages are updated by the ``UPDATE_OPS`` the training step runs,
and the evaluation tower is a second copy of the network over the same variables
(``reuse=True``, ``training=False``), which normalizes with the moving averages and keeps
every unit (no dropout). Data:

- ``digits``: scikit-learn's 1797 bundled 8x8 images, split as ``examples/digits`` splits
  them (stratified, 360 test images, the split fixed whatever the seed);
- ``fashion-mnist``: Zalando's 28x28 images, read from the IDX files of Debian's
  ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``, or
  ``--data-dir``); 60000 training and its own 10000 test images.

As ``examples/digits/train.py``, the script runs unchanged alone and as a task of a job
(``flowmill run examples/convnet/job.yaml --local``, or the operator's pods): ``task()``
gives this worker its shard, ``minimize`` builds the job's training mode (sync with backup
workers in ``job.yaml``), and ``initialize_or_wait`` lets the chief initialize or restore.
``--straggler-delay SECONDS`` makes one worker (``--straggler-index``, by default the
last) sleep that long before each of its steps: a slow machine, for the backup-workers
benchmark (``bench/backup_workers.py``) and for seeing the effect by hand.

Progress goes to stderr. On stdout every task ends with a ``step times:`` line (median
step and steps per second after the first steps, which build and warm the step); the chief
(or the lone process) then prints ``train_accuracy: <value>`` and, last,
``test_accuracy: <value>``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import time
from pathlib import Path

# These matrices are small and the machine is shared: one BLAS thread unless told otherwise
# (a spinning BLAS pool waits for a free core on every matmul of a busy machine).
if "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

import flowmill.runtime as fm  # noqa: E402
from flowmill.runtime.job import (  # noqa: E402
    max_steps,
    own_steps,
    steps_done,
    task,
    training_done,
)
from flowmill.runtime.progress import ProgressBar  # noqa: E402
from flowmill.runtime.session_manager import initialize_or_wait  # noqa: E402

DEFAULT_SEED = 2016
SPLIT_SEED = 0  # the digits split is part of the task, not of a run: it never changes
NUM_CLASSES = 10
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
EVAL_BATCH = 500  # the evaluation tower's batch: bounds im2col's memory on 10000 images
TIMING_WARMUP = 5  # steps left out of the step-time summary (they build and warm the plan)
# Defaults per dataset where they differ; the flags override them.
DEFAULTS = {
    "digits": {"epochs": 12, "batch_size": 32},
    "fashion-mnist": {"epochs": 2, "batch_size": 64},
}


# ---- data


def load_digits(test_fraction: float = 0.2):
    """scikit-learn's digits as NHWC float32 in [0, 1] and int64 labels, split stratified
    by class with the seed ``examples/digits`` uses, so both examples score one test set."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=test_fraction, random_state=SPLIT_SEED, stratify=y)


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (gzipped or not): unsigned bytes with a big-endian header of dims."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    rank = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank)]
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * rank)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} ({int(np.prod(dims))} bytes), "
                         f"the file holds {body.size}")
    return body.reshape(dims)


def load_fashion_mnist(data_dir: Path = FASHION_DIR):
    """Fashion-MNIST's own train and test files, as NHWC float32 in [0, 1], int64 labels."""
    split = {}
    for part, (images, labels) in FASHION_FILES.items():
        found = []
        for name in (images, labels):
            path = data_dir / name
            if not path.exists() and (data_dir / name[:-3]).exists():
                path = data_dir / name[:-3]  # unpacked by hand
            if not path.exists():
                raise FileNotFoundError(
                    f"fashion-mnist: {path} is missing; install Debian's dataset-fashion-mnist "
                    f"package (apt-get install dataset-fashion-mnist, into {FASHION_DIR}) or "
                    "point --data-dir at a folder holding the four IDX files"
                )
            found.append(read_idx(path))
        x, y = found
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"fashion-mnist {part}: {len(x)} images of {x.shape[1:]} and "
                             f"{len(y)} labels of {y.shape[1:]} do not pair up")
        split[part] = ((x / 255.0).astype(np.float32)[..., None], y.astype(np.int64))
    (x_train, y_train), (x_test, y_test) = split["train"], split["test"]
    return x_train, x_test, y_train, y_test


def load_data(dataset: str, data_dir: Path | None = None):
    if dataset == "digits":
        return load_digits()
    if dataset == "fashion-mnist":
        return load_fashion_mnist(data_dir or FASHION_DIR)
    raise ValueError(f"unknown dataset {dataset!r}: digits or fashion-mnist")


# ---- the model


def build_model(images, labels, *, training: bool, filters=(32, 64), dense=128,
                dropout=0.3, bn_momentum=0.9, seed: int = 0, reuse=None) -> dict:
    """The network over NHWC ``images`` and its loss and accuracy.

    Built once with ``training=True`` for the step and once more with ``training=False,
    reuse=True`` for evaluation: the same variables, batch statistics and dropout in the
    first, the moving averages and every unit in the second. The convolutions have no bias:
    batch normalization's ``beta`` is the shift. ``bn_momentum`` defaults to 0.9 rather than
    TensorFlow's 0.99 because a digits run is only a few hundred steps, too few for 0.99's
    averages to forget their initial zeros and ones.
    """
    h = images
    for i, width in enumerate(filters):
        with fm.variable_scope(f"block{i}", reuse=reuse):
            h = fm.layers.conv2d(h, width, 3, padding="same", use_bias=False, name="conv")
            h = fm.layers.batch_normalization(h, momentum=bn_momentum, training=training,
                                              name="bn")
            h = fm.nn.relu(h)
            h = fm.layers.max_pooling2d(h, 2, 2, padding="same", name="pool")
    h = fm.layers.flatten(h)
    h = fm.layers.dense(h, dense, activation=fm.nn.relu, name="fc", reuse=reuse)
    h = fm.layers.dropout(h, dropout, seed=seed + 1, training=training)
    logits = fm.layers.dense(h, NUM_CLASSES, name="logits", reuse=reuse)
    loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))
    correct = fm.reduce_sum(fm.cast(fm.equal(fm.argmax(logits, axis=1), labels), fm.float32))
    return {"logits": logits, "loss": loss, "correct": correct}


def build_train_op(loss, learning_rate: float, total_steps: int, final_fraction: float):
    """Adam, the rate decayed exponentially from the global step to ``final_fraction`` of
    itself at ``total_steps``, built under batch normalization's moving-average updates
    (``UPDATE_OPS``, TensorFlow 1.x's idiom), so every step runs them. In a job
    ``minimize`` builds the job's training mode over Adam, and each worker updates the
    moving averages on the parameter servers itself, as TensorFlow's workers do."""
    global_step = fm.train.create_global_step()
    rate = fm.train.exponential_decay(learning_rate, global_step.value(), total_steps,
                                      final_fraction)
    with fm.control_dependencies(fm.get_collection(fm.GraphKeys.UPDATE_OPS)):
        train_op = fm.train.Adam(rate).minimize(loss, global_step=global_step)
    return train_op, global_step


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The examples of a task's ``step``-th batch: epoch ``e`` visits the shard in the order
    of a permutation seeded by ``(seed, e)``; a pure function of the step, so a task that
    resumes at step ``k`` feeds what it would have fed uninterrupted."""
    per_epoch = -(-n // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(n)
    return order[i * batch_size : (i + 1) * batch_size]


def evaluate(sess, model: dict, features, labels, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy of the evaluation tower over ``x`` in batches of ``EVAL_BATCH``."""
    right = 0.0
    for i in range(0, len(x), EVAL_BATCH):
        right += float(sess.run(model["correct"], {features: x[i : i + EVAL_BATCH],
                                                   labels: y[i : i + EVAL_BATCH]}))
    return right / len(x)


def step_summary(ends: list[float], began: float) -> str:
    """Median step and steps per second, leaving out the first ``TIMING_WARMUP`` steps
    (all of them counted when there are too few to leave any out)."""
    times = np.diff([began, *ends])
    skip = TIMING_WARMUP if len(times) > 2 * TIMING_WARMUP else 0
    steady = times[skip:]
    if not len(steady):
        return "step times: no steps"
    rate = len(steady) / max(float(steady.sum()), 1e-9)
    return (f"step times: {len(steady)} steps, median {statistics.median(steady) * 1e3:.1f} "
            f"ms, {rate:.2f} steps/s (after the first {skip})")


# ---- the loop


def straggler_of(args, count: int) -> int | None:
    """The worker index that sleeps before each step, or None."""
    if not args.straggler_delay:
        return None
    index = count - 1 if args.straggler_index is None else args.straggler_index
    if not 0 <= index < count:
        raise ValueError(f"--straggler-index {index} names no worker of the {count} in this job")
    return index


def train(args) -> tuple[float, float] | None:
    """Train, then return (train accuracy, test accuracy); None on a worker that is not the
    chief (the chief evaluates the shared model)."""
    x_train, x_test, y_train, y_test = load_data(args.dataset, args.data_dir)
    me = task()
    # Equal shards (a remainder of fewer than ``count`` images is left out) so every worker
    # takes as many steps, which sync mode needs.
    per = len(x_train) // me.count
    x_shard = x_train[me.index : per * me.count : me.count]
    y_shard = y_train[me.index : per * me.count : me.count]
    n = len(x_shard)
    total = max_steps(args.epochs * -(-len(x_train) // args.batch_size))
    straggler = straggler_of(args, me.count)
    delay = args.straggler_delay if straggler == me.index else 0.0
    graph = fm.Graph(seed=args.seed)
    with graph.as_default():
        features = fm.placeholder(fm.float32, (None, *x_train.shape[1:]), name="features")
        labels = fm.placeholder(fm.int64, (None,), name="labels")
        shape = {"filters": tuple(args.filters), "dense": args.dense, "dropout": args.dropout,
                 "bn_momentum": args.bn_momentum, "seed": args.seed}
        model = build_model(features, labels, training=True, **shape)
        train_op, global_step = build_train_op(model["loss"], args.learning_rate, total,
                                               args.final_lr_fraction)
        evaluation = build_model(features, labels, training=False, reuse=True, **shape)
        init = fm.global_variables_initializer()
    where = f"worker {me.index} of {me.count}, " if me.count > 1 else ""
    slow = f", sleeps {delay:g} s per step (straggler)" if delay else ""
    h, w = x_train.shape[1:3]
    print(f"convnet {args.dataset}: {where}{n} train / {len(x_test)} test images {h}x{w}, "
          f"conv {'-'.join(map(str, args.filters))} + BN, dense {args.dense}, dropout "
          f"{args.dropout}, Adam lr {args.learning_rate}, batch {args.batch_size}, {total} "
          f"steps, seed {args.seed}{slow}", flush=True)
    with fm.Session(graph) as sess:
        start = initialize_or_wait(sess, init)
        step = sess.make_callable([model["loss"], global_step.value()], [features, labels],
                                  targets=[train_op])
        first = k = steps_done(start)
        ends: list[float] = []
        began = time.perf_counter()
        with ProgressBar(max(own_steps(total), first + 1), desc="train") as bar:
            while True:
                if delay:
                    time.sleep(delay)
                batch = batch_indices(n, args.batch_size, args.seed + 7919 * me.index, k)
                loss, seen = step(x_shard[batch], y_shard[batch])
                ends.append(time.perf_counter())
                k += 1
                bar.update(step=k, loss=loss, examples=len(batch), global_step=int(seen))
                if training_done(sess, global_step, int(seen), total):
                    break
        elapsed = time.perf_counter() - began
        steps = int(sess.run(global_step.value()))
        print(f"trained {k - first} steps in {elapsed:.2f} s; global step {steps}")
        print(step_summary(ends, began), flush=True)
        if not me.is_chief:
            return None
        evaluated = time.perf_counter()
        test_accuracy = evaluate(sess, evaluation, features, labels, x_test, y_test)
        train_accuracy = evaluate(sess, evaluation, features, labels, x_train, y_train)
        print(f"evaluated {len(x_test) + len(x_train)} images in "
              f"{time.perf_counter() - evaluated:.2f} s", file=sys.stderr)
    return train_accuracy, test_accuracy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=sorted(DEFAULTS), default="digits")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"fashion-mnist's IDX files (default {FASHION_DIR})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--epochs", type=int, default=None, help="digits 12, fashion-mnist 2")
    p.add_argument("--batch-size", type=int, default=None, help="digits 32, fashion-mnist 64")
    p.add_argument("--learning-rate", type=float, default=0.005)
    p.add_argument("--final-lr-fraction", type=float, default=0.05)
    p.add_argument("--filters", type=int, nargs="+", default=[32, 64])
    p.add_argument("--dense", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--bn-momentum", type=float, default=0.9)
    p.add_argument("--straggler-delay", type=float, default=0.0, metavar="SECONDS",
                   help="one worker sleeps this long before each step (a straggler)")
    p.add_argument("--straggler-index", type=int, default=None, metavar="INDEX",
                   help="the straggling worker's index (default: the last worker)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.dataset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.straggler_delay < 0:
        p.error(f"--straggler-delay must be >= 0, got {args.straggler_delay}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = train(args)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result is not None:
        print(f"train_accuracy: {result[0]:.4f}")
        print(f"test_accuracy: {result[1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
