"""Train a multilayer perceptron on scikit-learn's bundled 8x8 digits with Flowmill.

    python examples/digits/train.py [--seed 2016] [--epochs 30] [--batch-size 32]

The model is built by ``build_model`` and the optimizer by ``build_train_op``, apart from
the loop in ``train``, so a launcher can build the same graph under its own device scopes
and run the same script unchanged. One seed decides everything random: the graph seed,
each initializer's op seed and the order mini-batches are drawn in; the train/test split
is fixed, so runs with different seeds are scored on the same test images.

The same script runs as a task of a distributed job (``flowmill run examples/digits.yaml
--local``, or the operator's pods): ``fm.Session`` then runs its steps across the job's
parameter servers, ``task()`` gives this worker its share of the training images,
``minimize`` builds the job's training mode over Adam, and ``initialize_or_wait`` lets
the chief initialize the variables (or restore the job's newest checkpoint) while the
others wait. Each task counts its steps from the global step and draws each batch as a
function of its step, so a job restarted from a checkpoint resumes exactly where it
stood. Alone, the task is 0 of 1 and nothing changes.

Progress goes to stderr; the last line on stdout of the chief (or the lone process) is
``test_accuracy: <value>``. With ``--logdir`` (or in a job, its summary directory) the
chief writes TensorBoard summaries every ``--summary-steps`` steps: the loss, the batch
accuracy, the learning rate and each layer's weights, fetched in the same run as that
step's update, so the other steps pay nothing for them. With ``--export DIR`` the chief
exports the trained model for inference (``fm.saved_model``: input ``features``, outputs
``logits`` and ``classes``), for ``flowmill serve DIR``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Matrices this small gain nothing from BLAS threads, and on a busy machine a BLAS thread
# pool turns every matmul into a wait for a free core: one thread unless told otherwise.
if "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

import flowmill.runtime as fm  # noqa: E402
from flowmill.runtime.initializers import glorot_uniform  # noqa: E402
from flowmill.runtime.job import (  # noqa: E402
    max_steps,
    own_steps,
    steps_done,
    task,
    training_done,
)
from flowmill.runtime.ops.nn_ops import (  # noqa: E402
    bias_add,
    relu,
    sparse_softmax_cross_entropy_with_logits,
)
from flowmill.runtime.optimizers import Adam, create_global_step  # noqa: E402
from flowmill.runtime.progress import ProgressBar  # noqa: E402
from flowmill.runtime.session_manager import initialize_or_wait  # noqa: E402

DEFAULT_SEED = 2016
SPLIT_SEED = 0  # the split is part of the task, not of a run: it never changes
NUM_CLASSES = 10


def load_data(test_fraction: float = 0.2):
    """Pixels scaled to [0, 1] (float32) and int64 labels, split stratified by class."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=test_fraction, random_state=SPLIT_SEED, stratify=y)


def build_model(features: fm.Tensor, labels: fm.Tensor, hidden=(512, 256), seed: int = 0) -> dict:
    """The MLP and its loss; returns the tensors the loop (or a launcher) needs."""
    h = features
    width = features.shape[-1]
    for i, units in enumerate((*hidden, NUM_CLASSES)):
        with fm.name_scope(f"layer{i}"):
            w = fm.Variable(glorot_uniform(seed=seed + i), shape=(width, units), name="kernel")
            b = fm.Variable(np.zeros(units, np.float32), name="bias")
            h = bias_add(fm.matmul(h, w), b)
            if i < len(hidden):
                h = relu(h)
        width = units
    logits = h
    loss = fm.reduce_mean(sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    classes = fm.argmax(logits, axis=1)
    correct = fm.equal(classes, labels)
    accuracy = fm.reduce_mean(fm.cast(correct, fm.float32))
    return {"logits": logits, "classes": classes, "loss": loss, "accuracy": accuracy}


def build_summaries(model: dict, rate: fm.Tensor) -> fm.Tensor:
    """What TensorBoard shows of a run: scalars of the loss, batch accuracy and learning
    rate, histograms of every weight."""
    fm.summary.scalar("loss", model["loss"])
    fm.summary.scalar("accuracy", model["accuracy"])
    fm.summary.scalar("learning_rate", rate)
    for v in fm.trainable_variables():
        fm.summary.histogram(f"weights/{v.name}", v.value())
    return fm.summary.merge_all()


def build_train_op(loss: fm.Tensor, learning_rate: float, total_steps: int, final_fraction: float):
    """Adam with the learning rate decayed exponentially, in the graph, from the global step:
    ``lr * final_fraction ** (step / total_steps)``."""
    global_step = create_global_step()
    progress = fm.cast(global_step.value(), fm.float32) / float(total_steps)
    rate = learning_rate * fm.constant(final_fraction, fm.float32) ** progress
    # In a job, minimize builds the job's training mode (sync, async, bounded staleness)
    # over Adam; alone it is Adam's own.
    return Adam(rate).minimize(loss, global_step=global_step), global_step, rate


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The examples of a task's ``step``-th batch: epoch ``e`` visits the shard in the order
    of a permutation seeded by ``(seed, e)``. A pure function of the step, so a task that
    resumes from a checkpoint at step ``k`` feeds what it would have fed uninterrupted."""
    per_epoch = -(-n // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(n)
    return order[i * batch_size : (i + 1) * batch_size]


def train(args) -> float | None:
    """Train, then return the accuracy on the held-out test images (None on a worker that
    is not the chief: the chief evaluates the shared model)."""
    x_train, x_test, y_train, y_test = load_data()
    me = task()
    # Each worker trains on every ``count``-th image from its own index: its shard. Shards
    # are equal (a remainder of fewer than ``count`` images is left out), so every worker
    # takes as many steps, which sync mode needs: each update waits for every worker.
    per = len(x_train) // me.count
    x_shard = x_train[me.index : per * me.count : me.count]
    y_shard = y_train[me.index : per * me.count : me.count]
    n = len(x_shard)
    # The schedule counts global steps, which every worker advances: as many as one process
    # takes over all images (``training.maxSteps`` of the job, where it sets one).
    total = max_steps(args.epochs * -(-len(x_train) // args.batch_size))
    graph = fm.Graph(seed=args.seed)
    with graph.as_default():
        features = fm.placeholder(fm.float32, (None, x_train.shape[1]), name="features")
        labels = fm.placeholder(fm.int64, (None,), name="labels")
        model = build_model(features, labels, hidden=tuple(args.hidden), seed=args.seed)
        train_op, global_step, rate = build_train_op(
            model["loss"], args.learning_rate, total, args.final_lr_fraction
        )
        summaries = build_summaries(model, rate)
        init = fm.global_variables_initializer()
    where = f"worker {me.index} of {me.count}, " if me.count > 1 else ""
    print(
        f"digits: {where}{n} train / {len(x_test)} test images, MLP 64-"
        + "-".join(str(u) for u in args.hidden)
        + f"-10, Adam lr {args.learning_rate}, batch {args.batch_size}, "
        f"{total} steps, seed {args.seed}"
    )
    with fm.Session(graph) as sess:
        # Alone or on the chief this initializes the variables, or restores the job's
        # newest checkpoint; elsewhere it waits for the chief.
        start = initialize_or_wait(sess, init)
        step = sess.make_callable(
            [model["loss"], global_step.value()], [features, labels], targets=[train_op]
        )
        # The chief writes the job's summaries (alone, this process does, given a logdir).
        logdir = fm.summary.job_logdir(args.logdir) if me.is_chief else None
        writer = fm.summary.FileWriter(logdir, graph) if logdir else None
        summary_step = sess.make_callable(
            [model["loss"], global_step.value(), summaries], [features, labels],
            targets=[train_op]
        )
        # This task's steps, counted from the global step the job starts at: 0 on a fresh
        # start, the checkpoint's step after a restart. Training ends when the job's global
        # step reaches the total, however the workers shared the steps.
        first = k = steps_done(start)
        began = time.perf_counter()
        with ProgressBar(max(own_steps(total), first + 1), desc="train") as bar:
            while True:
                batch = batch_indices(n, args.batch_size, args.seed + 7919 * me.index, k)
                if writer is not None and k % args.summary_steps == 0:
                    loss, seen, summary = summary_step(x_shard[batch], y_shard[batch])
                    writer.add_summary(summary, int(seen))
                else:
                    loss, seen = step(x_shard[batch], y_shard[batch])
                k += 1
                bar.update(step=k, loss=loss, examples=len(batch), global_step=int(seen))
                if training_done(sess, global_step, int(seen), total):
                    break
        elapsed = time.perf_counter() - began
        steps = int(sess.run(global_step.value()))
        taken = k - first
        if not me.is_chief:
            print(f"trained {taken} steps in {elapsed:.2f} s; global step {steps}")
            return None
        accuracy = float(sess.run(model["accuracy"], {features: x_test, labels: y_test}))
        train_accuracy = float(sess.run(model["accuracy"], {features: x_train, labels: y_train}))
        if args.export:
            fm.saved_model.save(sess, args.export, inputs={"features": features},
                                outputs={"logits": model["logits"], "classes": model["classes"]})
            print(f"exported the model to {args.export} (flowmill serve {args.export})")
    if writer is not None:
        writer.add_summary(fm.summary.Summary(value=[
            fm.summary.Summary.Value(tag="test_accuracy", simple_value=accuracy)]), steps)
        writer.close()
    print(
        f"trained {taken} steps in {elapsed:.2f} s ({taken / max(elapsed, 1e-9):,.0f} steps/s); "
        f"global step {steps}; train accuracy {train_accuracy:.4f}"
    )
    return accuracy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=0.002)
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 256])
    p.add_argument("--final-lr-fraction", type=float, default=0.01)
    p.add_argument("--logdir", default=None,
                   help="write TensorBoard summaries here (in a job: its summary directory)")
    p.add_argument("--export", default=None,
                   help="export the trained model here for inference (the chief)")
    p.add_argument("--summary-steps", type=int, default=25,
                   help="write summaries every this many steps")
    return p.parse_args(argv)


def main(argv=None) -> int:
    accuracy = train(parse_args(argv))
    if accuracy is not None:
        print(f"test_accuracy: {accuracy:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
