"""Train the TensorFlow paper's LSTM language model (section 6.4) on Wikipedia text with
Flowmill.

    python examples/lm/train.py [--steps 1500] [--hidden 200 200] [--num-sampled 512]
    python examples/lm/train.py --hidden 512 512 --embedding-size 512   # the paper's size

The model is Zaremba et al.'s as the paper trains it for its Figure 9 (LSTM-512-512 over
a 40,000-word One Billion Word vocabulary): word embeddings, a stack of LSTM layers run
over ``num_steps`` words by ``dynamic_rnn`` (a while loop, differentiated as one), and an
output softmax trained by sampled softmax (``num_sampled`` classes drawn per step, log
uniform, instead of the whole vocabulary) and evaluated in full. Truncated
backpropagation through time as in TensorFlow's PTB tutorial: each batch row reads on
where it stopped, its final LSTM state fetched and fed back as the next batch's initial
state, the gradient cut at the batch boundary. Gradients are clipped by their global
norm; the optimizer is SGD or Adagrad. The corpus is gensim's bundled Wikipedia articles
(``corpus.py``: 10,000 words + ``<unk>``, split by article).

The embedding and the softmax weights and biases are each held as row shards (row ``r``
in shard ``r % n``, TensorFlow's partitioned variables), looked up with
``fm.nn.embedding_lookup``. In a job (``flowmill run examples/lm/job.yaml --local``)
there is one shard per PS task by default: each variable goes to the PS task holding the
fewest bytes, in creation order, so a table's shards land on distinct PS tasks, every Gather
runs where its shard lives, and a step moves only the rows it touches, never a table.
Each worker trains on its own contiguous share of the training text (``fm.task()``), the
chief (worker 0) evaluates; alone, the process is worker 0 of 1.

Every ``--log-every`` steps a line gives the sampled training loss and the full-softmax
perplexity on the first ``--eval-words`` words of this worker's training text and of the
validation text; at the end the whole validation and test texts are scored. The last
line on stdout of the chief (or the lone process) is ``test_perplexity: <value>``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# One BLAS thread unless told otherwise: a thread pool on a busy two-core machine turns
# every matmul into a wait for a free core (see bench/README.md).
if "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

import flowmill.runtime as fm  # noqa: E402
from flowmill.runtime.cluster import from_env  # noqa: E402
from flowmill.runtime.embedding import partitioned_table  # noqa: E402
from flowmill.runtime.initializers import random_uniform  # noqa: E402
from flowmill.runtime.job import (  # noqa: E402
    max_steps,
    own_steps,
    steps_done,
    task,
    training_done,
)
from flowmill.runtime.progress import ProgressBar  # noqa: E402
from flowmill.runtime.session_manager import initialize_or_wait  # noqa: E402

try:  # run as a script (examples/lm on sys.path) or imported as examples.lm.train
    import corpus as lm_corpus
except ImportError:  # pragma: no cover
    from . import corpus as lm_corpus

DEFAULT_SEED = 2016
OPTIMIZERS = ("sgd", "adagrad")


# ---- the model


def shard_rows(rows: int, shards: int, p: int) -> int:
    """How many of ``rows`` rows shard ``p`` of ``shards`` holds (rows p, p + n, ...)."""
    return (rows - p + shards - 1) // shards


def sharded_variable(name: str, rows: int, cols: int | None, shards: int, initializer):
    """A ``[rows, cols]`` (or ``[rows]``) table as ``shards`` variables ``name/part_<p>``,
    made one after another so placement by size gives each its own PS task. They are
    recorded as one table, ``name``, split row ``r`` to part ``r % shards`` as the lookup
    routes it, so a checkpoint restores into another ``--shards`` too."""
    with fm.variable_scope(name):
        parts = [
            fm.get_variable(
                f"part_{p}",
                [shard_rows(rows, shards, p)] + ([cols] if cols is not None else []),
                initializer=initializer,
            )
            for p in range(shards)
        ]
    partitioned_table(parts, parts[0].name.rsplit("/", 1)[0])
    return parts


def build_model(
    vocab_size: int,
    hidden: tuple[int, ...],
    embedding_size: int,
    num_steps: int,
    num_sampled: int,
    shards: int,
    init_scale: float = 0.1,
    dropout: bool = False,
    seed: int = 0,
    sampled_values=None,
) -> dict:
    """The graph of one truncated-BPTT batch: placeholders, the LSTM's initial and final
    states (flat lists of c and h per layer), the sampled training loss (mean per word)
    and the full-softmax loss (summed over the batch's words) for evaluation.

    ``sampled_values`` replaces the in-graph log-uniform sampler (the benchmark feeds the
    candidates it gives PyTorch too)."""
    if num_sampled >= vocab_size:
        raise ValueError(
            f"--num-sampled {num_sampled} must be below the vocabulary size {vocab_size}"
        )
    init = random_uniform(-init_scale, init_scale, seed=seed)
    inputs = fm.placeholder(fm.int64, (None, num_steps), name="inputs")
    targets = fm.placeholder(fm.int64, (None, num_steps), name="targets")
    rate = fm.placeholder(fm.float32, (), name="dropout_rate") if dropout else None
    state_in = []
    for k, units in enumerate(hidden):
        c = fm.placeholder(fm.float32, (None, units), name=f"state_in/c{k}")
        h = fm.placeholder(fm.float32, (None, units), name=f"state_in/h{k}")
        state_in.append(fm.nn.rnn_cell.LSTMStateTuple(c, h))

    # Creation order decides placement: the embedding's shards, the LSTM's
    # weights, then the softmax weights' and biases' shards, each table's in a row.
    embedding = sharded_variable("embedding", vocab_size, embedding_size, shards, init)
    x = fm.nn.embedding_lookup(embedding, inputs)  # [batch, steps, embedding]
    if rate is not None:
        x = fm.nn.dropout(x, rate, seed=seed + 1)
    with fm.variable_scope("lstm", initializer=init):
        cells = [fm.nn.rnn_cell.LSTMCell(units, forget_bias=0.0) for units in hidden]
        cell = fm.nn.rnn_cell.MultiRNNCell(cells)
        outputs, state_out = fm.nn.dynamic_rnn(cell, x, initial_state=tuple(state_in))
    if rate is not None:
        outputs = fm.nn.dropout(outputs, rate, seed=seed + 2)
    top = hidden[-1]
    flat = fm.reshape(outputs, (-1, top))  # [batch * steps, top]
    labels = fm.reshape(targets, (-1, 1))
    softmax_w = sharded_variable("softmax_w", vocab_size, top, shards, init)
    softmax_b = sharded_variable("softmax_b", vocab_size, None, shards, fm.initializers.zeros())

    sampled = fm.nn.sampled_softmax_loss(
        softmax_w, softmax_b, labels, flat, num_sampled, vocab_size,
        sampled_values=sampled_values, seed=seed + 3,
    )
    train_loss = fm.reduce_mean(sampled)

    # Full softmax: each shard's logits side by side. Column order is shard by shard, so
    # the label of word r is column offset[r % n] + r // n.
    logits = fm.concat(
        [fm.matmul(flat, w, transpose_b=True) + b for w, b in zip(softmax_w, softmax_b,
                                                                   strict=True)],
        axis=1,
    ) if shards > 1 else fm.matmul(flat, softmax_w[0], transpose_b=True) + softmax_b[0]
    flat_labels = fm.reshape(targets, (-1,))
    if shards > 1:
        offsets = np.cumsum([0] + [shard_rows(vocab_size, shards, p) for p in range(shards)])
        flat_labels = fm.gather(fm.constant(offsets[:-1].astype(np.int64)), flat_labels % shards)
        flat_labels = flat_labels + fm.reshape(targets, (-1,)) // shards
    eval_loss = fm.reduce_sum(
        fm.nn.sparse_softmax_cross_entropy_with_logits(labels=flat_labels, logits=logits)
    )
    flat_state_in = [t for s in state_in for t in (s.c, s.h)]
    flat_state_out = [t for s in state_out for t in (s.c, s.h)]
    return {
        "inputs": inputs, "targets": targets, "dropout_rate": rate,
        "state_in": flat_state_in, "state_out": flat_state_out,
        "train_loss": train_loss, "eval_loss_sum": eval_loss,
        "tables": {"embedding": embedding, "softmax_w": softmax_w, "softmax_b": softmax_b},
    }


class _ClipByGlobalNorm:
    """Gradients scaled to a global norm of at most ``clip_norm`` as they are computed.

    Clipping inside ``compute_gradients`` (rather than between it and
    ``apply_gradients`` in the script) keeps ``minimize`` whole, so in a job the training
    mode, which computes each worker's gradients through this optimizer, clips them too."""

    clip_norm: float = 5.0

    def compute_gradients(self, loss, var_list=None, gate_gradients=True):
        pairs = super().compute_gradients(loss, var_list, gate_gradients)
        clipped, _ = fm.clip_by_global_norm([g for g, _ in pairs], self.clip_norm)
        return list(zip(clipped, [v for _, v in pairs], strict=True))


class ClippedGradientDescent(_ClipByGlobalNorm, fm.train.GradientDescent):
    pass


class ClippedAdagrad(_ClipByGlobalNorm, fm.train.Adagrad):
    pass


def build_train_op(loss, optimizer: str, learning_rate: float, clip_norm: float):
    """The optimizer's train op over the clipped gradients, and the global step."""
    global_step = fm.train.create_global_step()
    if optimizer == "sgd":
        opt = ClippedGradientDescent(learning_rate)
    elif optimizer == "adagrad":
        opt = ClippedAdagrad(learning_rate)
    else:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    opt.clip_norm = clip_norm
    return opt.minimize(loss, global_step=global_step), global_step


# ---- running it


def ps_tasks() -> int:
    """How many PS tasks this process's job has (0 alone)."""
    config = from_env()
    return config.cluster.num_tasks("ps") if config is not None else 0


def _task_of(device: str) -> str:
    """``/job:ps/task:1/device:CPU:0`` -> ``ps:1``."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    return f"{parts.get('job', '?')}:{parts.get('task', '?')}"


def zero_state(hidden, batch_size: int) -> list[np.ndarray]:
    return [np.zeros((batch_size, units), np.float32) for units in hidden for _ in (0, 1)]


def perplexity(run_eval, ids: np.ndarray, hidden, batch_size: int, num_steps: int) -> float:
    """exp(mean full-softmax cross-entropy) over ``ids`` read as the training reads."""
    rows, n = lm_corpus.batches(ids, batch_size, num_steps)
    state = zero_state(hidden, batch_size)
    total = 0.0
    for i in range(n):
        x, y = lm_corpus.batch(rows, num_steps, i)
        loss, *state = run_eval(x, y, *state)
        total += float(loss)
    return math.exp(total / (n * batch_size * num_steps))


def train(args) -> float | None:
    """Train, then return the test perplexity (None on a worker that is not the chief)."""
    corpus = lm_corpus.load(args.vocab_size, args.cache_dir, log=print)
    me = task()
    per = corpus.train.size // me.count
    shard = corpus.train[me.index * per : (me.index + 1) * per]
    rows, epoch = lm_corpus.batches(shard, args.batch_size, args.num_steps)
    shards = args.shards or max(ps_tasks(), 1)
    hidden = tuple(args.hidden)
    total = max_steps(args.steps)
    graph = fm.Graph(seed=args.seed)
    with graph.as_default():
        model = build_model(
            corpus.vocab_size, hidden, args.embedding_size or hidden[0], args.num_steps,
            args.num_sampled, shards, args.init_scale, args.dropout > 0, args.seed,
        )
        train_op, global_step = build_train_op(
            model["train_loss"], args.optimizer, args.learning_rate, args.clip_norm
        )
        init = fm.global_variables_initializer()
    where = f"worker {me.index} of {me.count}, " if me.count > 1 else ""
    print(
        f"lm: {where}{shard.size:,} train words ({epoch} batches an epoch), "
        f"{corpus.valid.size:,} valid, {corpus.test.size:,} test; vocabulary "
        f"{corpus.vocab_size:,}; LSTM-{'-'.join(map(str, hidden))}, {shards} shard(s) per "
        f"table, sampled softmax {args.num_sampled}, {args.optimizer} lr {args.learning_rate}, "
        f"batch {args.batch_size}x{args.num_steps}, {total} steps, seed {args.seed}"
    )
    rate = [] if model["dropout_rate"] is None else [model["dropout_rate"]]
    feeds = [model["inputs"], model["targets"], *rate, *model["state_in"]]
    train_rate = [] if not rate else [np.float32(args.dropout)]
    eval_rate = [] if not rate else [np.float32(0.0)]
    if me.is_chief:
        print(f"unigram perplexity (training frequencies) on valid: "
              f"{corpus.unigram_perplexity('valid'):.1f}")
    with fm.Session(graph) as sess:
        start = initialize_or_wait(sess, init)
        if me.is_chief and ps_tasks():  # in a job: which PS task holds which rows
            for name, parts in model["tables"].items():
                where_ = ", ".join(_task_of(sess.variable_device(v.op)) for v in parts)
                print(f"{name}: {len(parts)} shard(s) on {where_}")
        step = sess.make_callable(
            [model["train_loss"], global_step.value(), *model["state_out"]], feeds,
            targets=[train_op],
        )
        evaluate = sess.make_callable([model["eval_loss_sum"], *model["state_out"]], feeds)

        def score(ids: np.ndarray) -> float:
            return perplexity(
                lambda x, y, *s: evaluate(x, y, *eval_rate, *s),
                ids, hidden, args.batch_size, args.num_steps,
            )

        sample = args.eval_words

        def report(k: int, seen: int, loss: str, rate: str) -> None:
            print(
                f"step {k:>6}  global {seen:>6}  sampled loss {loss:>6}  train ppl "
                f"{score(shard[:sample]):8.1f}  valid ppl {score(corpus.valid[:sample]):8.1f}"
                f"  {rate}",
                flush=True,
            )

        first = k = steps_done(start)
        if me.is_chief:  # where the curve starts: untrained, about the vocabulary size
            report(k, start, "-", "")  # (in an async job, others may have stepped already)
        state = zero_state(hidden, args.batch_size)
        window: list[float] = []
        trained_s = 0.0
        with ProgressBar(max(own_steps(total), first + 1), desc="train") as bar:
            while True:
                i = k % epoch
                if i == 0:  # a new epoch starts each row at its beginning, from zero
                    state = zero_state(hidden, args.batch_size)
                x, y = lm_corpus.batch(rows, args.num_steps, i)
                began = time.perf_counter()
                loss, seen, *state = step(x, y, *train_rate, *state)
                trained_s += time.perf_counter() - began
                k += 1
                window.append(float(loss))
                bar.update(step=k, loss=loss, examples=x.size, global_step=int(seen))
                done = training_done(sess, global_step, int(seen), total)
                if me.is_chief and (k % args.log_every == 0 or done):
                    words_per_s = len(window) * x.size / max(trained_s, 1e-9)
                    report(k, int(seen) + 1, f"{np.mean(window):.3f}",
                           f"{words_per_s:,.0f} words/s")
                    window, trained_s = [], 0.0
                if done:
                    break
        steps = int(sess.run(global_step.value()))
        taken = k - first
        if not me.is_chief:
            print(f"trained {taken} steps; global step {steps}")
            return None
        final = args.final_eval_words or None  # None: every word
        valid = score(corpus.valid[:final])
        test = score(corpus.test[:final])
    print(f"trained {taken} steps; global step {steps}; valid perplexity {valid:.2f} "
          f"(unigram {corpus.unigram_perplexity('valid'):.1f}); test unigram perplexity "
          f"{corpus.unigram_perplexity('test'):.1f}")
    return test


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--steps", type=int, default=1500, help="global steps (a job's "
                   "training.maxSteps overrides)")
    p.add_argument("--hidden", type=int, nargs="+", default=[200, 200],
                   help="LSTM layer sizes (the paper: 512 512)")
    p.add_argument("--embedding-size", type=int, default=0, help="default: the first layer's")
    p.add_argument("--num-steps", type=int, default=20, help="words per truncated BPTT batch")
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--num-sampled", type=int, default=512)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad")
    p.add_argument("--learning-rate", type=float, default=1.0)
    p.add_argument("--clip-norm", type=float, default=5.0)
    p.add_argument("--init-scale", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.0, help="rate on the LSTM's input "
                   "and output (0: none)")
    p.add_argument("--shards", type=int, default=0,
                   help="row shards per table (default: one per PS task, 1 alone)")
    p.add_argument("--vocab-size", type=int, default=lm_corpus.DEFAULT_VOCAB_SIZE)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-words", type=int, default=4000,
                   help="words of train and valid text scored at each log line")
    p.add_argument("--final-eval-words", type=int, default=0,
                   help="words of valid and test text scored at the end (0: all)")
    p.add_argument("--cache-dir", default=None, help="default: $XDG_CACHE_HOME/flowmill/lm")
    args = p.parse_args(argv)
    positive = ["steps", "num_steps", "batch_size", "num_sampled", "log_every", "eval_words",
                "learning_rate", "clip_norm", "init_scale"]
    for name in positive:
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(h <= 0 for h in args.hidden):
        p.error(f"--hidden sizes must be positive, got {args.hidden}")
    for name in ("embedding_size", "shards", "final_eval_words"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be positive (or 0 for the default), "
                    f"got {getattr(args, name)}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.vocab_size < lm_corpus.DEFAULT_VOCAB_SIZE:
        p.error(f"--vocab-size must be at least {lm_corpus.DEFAULT_VOCAB_SIZE:,}, "
                f"got {args.vocab_size}")
    if args.num_sampled >= args.vocab_size:
        p.error(f"--num-sampled {args.num_sampled} must be below --vocab-size {args.vocab_size}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        test = train(args)
    except lm_corpus.CorpusError as e:
        print(f"lm: {e}", file=sys.stderr)
        return 2
    if test is not None:
        print(f"test_perplexity: {test:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
