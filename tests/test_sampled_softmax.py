"""Sampled softmax and its log-uniform sampler, as a model uses them: the sampler draws
with the log-uniform law and reports expected counts that match what it draws; the loss
approaches the full softmax when nearly every class is sampled; only the true and
sampled rows of the output layer get a gradient, sharded or not."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.autodiff import IndexedSlices


def log_uniform(range_max):
    v = np.arange(range_max)
    return np.log((v + 2.0) / (v + 1.0)) / np.log(range_max + 1.0)


def test_sampler_draws_the_log_uniform_distribution():
    range_max, num_sampled, steps = 20, 50, 200
    with fm.Graph(seed=1).as_default():
        true = fm.constant(np.array([[0], [5]], np.int64))
        sampled, true_exp, sampled_exp = fm.nn.log_uniform_candidate_sampler(
            true, 1, num_sampled, False, range_max
        )
        with fm.Session() as sess:
            draws = [sess.run([sampled, true_exp, sampled_exp]) for _ in range(steps)]
    counts = np.bincount(np.concatenate([d[0] for d in draws]), minlength=range_max)
    p = log_uniform(range_max)
    n = num_sampled * steps
    # Every class within 4.5 standard deviations of its binomial count.
    assert np.all(np.abs(counts - n * p) < 4.5 * np.sqrt(n * p * (1 - p)) + 1), counts
    s, te, se = draws[0]
    np.testing.assert_allclose(te[:, 0], p[[0, 5]] * num_sampled, rtol=1e-6)
    np.testing.assert_allclose(se, p[s] * num_sampled, rtol=1e-6)


def test_unique_sampling_draws_distinct_classes_as_often_as_it_expects():
    range_max, num_sampled, steps = 30, 10, 400
    with fm.Graph(seed=2).as_default():
        # Every class as a true class: each run reports every class's expected count.
        true = fm.constant(np.arange(range_max, dtype=np.int64).reshape(-1, 1))
        values = fm.nn.log_uniform_candidate_sampler(true, 1, num_sampled, True, range_max)
        with fm.Session() as sess:
            draws = [sess.run(values) for _ in range(steps)]
    seen = np.zeros(range_max)
    expected = np.zeros(range_max)
    for s, te, se in draws:
        assert len(set(s.tolist())) == num_sampled and s.min() >= 0 and s.max() < range_max
        np.testing.assert_array_equal(se, te[s, 0])
        assert np.all(te > 0)  # above 1 only where no draw was repeated (p * num_sampled)
        seen[s] += 1
        expected += te[:, 0]
    # How often each class came up matches the sum of its expected counts.
    assert np.all(np.abs(seen - expected) < 4.5 * np.sqrt(expected) + 2), (seen, expected)
    assert seen[0] > seen[-1] * 3  # the law is far from uniform


def test_sampler_refuses_more_unique_samples_than_classes():
    with fm.Graph().as_default():
        true = fm.constant(np.array([[1]], np.int64))
        with pytest.raises(fm.GraphError, match="cannot sample 11 unique classes from 10"):
            fm.nn.log_uniform_candidate_sampler(true, 1, 11, True, 10)
        with pytest.raises(fm.GraphError, match="must be \\[batch_size, num_true=2\\]"):
            fm.nn.log_uniform_candidate_sampler(true, 2, 3, True, 10)


def _full_and_sampled(num_sampled, steps, seed=0):
    rng = np.random.default_rng(seed)
    vocab, dim, batch = 30, 4, 6
    w = rng.normal(size=(vocab, dim)).astype(np.float32)
    b = rng.normal(size=vocab).astype(np.float32)
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    labels = rng.integers(0, vocab, size=(batch, 1))
    with fm.Graph(seed=seed).as_default():
        sampled = fm.nn.sampled_softmax_loss(w, b, labels, x, num_sampled, vocab)
        full = fm.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels[:, 0], logits=fm.matmul(x, w, transpose_b=True) + b
        )
        with fm.Session() as sess:
            full_loss = sess.run(full)
            sampled_loss = np.mean([sess.run(sampled) for _ in range(steps)], axis=0)
    return full_loss, sampled_loss


def test_with_nearly_every_class_sampled_the_loss_approaches_full_softmax():
    full, all_sampled = _full_and_sampled(num_sampled=30, steps=20)
    # Every class is sampled, the true one removed as an accidental hit: the only gap is
    # the expected counts falling a little short of 1 for the rarest classes.
    np.testing.assert_allclose(all_sampled, full, rtol=0.03)
    # With a few classes left out each step, the average over steps stays close.
    _, most_sampled = _full_and_sampled(num_sampled=25, steps=200)
    np.testing.assert_allclose(most_sampled.mean(), full.mean(), rtol=0.1)


def test_weights_gradient_is_row_sparse_and_a_step_touches_only_those_rows():
    rng = np.random.default_rng(1)
    vocab, dim = 1000, 8
    sampled_ids = np.array([3, 17, 999], np.int64)
    values = (sampled_ids, np.full((2, 1), 0.5, np.float32), np.full(3, 0.25, np.float32))
    labels = np.array([[5], [17]], np.int64)
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    with fm.Graph().as_default():
        w = fm.Variable(table, name="softmax_w")
        b = fm.Variable(np.zeros(vocab, np.float32), name="softmax_b")
        x = fm.constant(rng.normal(size=(2, dim)).astype(np.float32))
        loss = fm.reduce_sum(fm.nn.sampled_softmax_loss(w, b, labels, x, 3, vocab,
                                                        sampled_values=values))
        gw, gb = fm.gradients(loss, [w, b])
        assert isinstance(gw, IndexedSlices) and isinstance(gb, IndexedSlices)
        train = fm.train.GradientDescent(0.5).minimize(loss)
        with fm.Session() as sess:
            sess.run(fm.global_variables_initializer())
            assert sorted(set(sess.run(gw.indices).tolist())) == [3, 5, 17, 999]
            sess.run(train)
            after = sess.run(w.value())
    touched = [3, 5, 17, 999]
    untouched = np.setdiff1d(np.arange(vocab), touched)
    np.testing.assert_array_equal(after[untouched], table[untouched])
    assert np.all(np.any(after[touched] != table[touched], axis=1))


def test_sharded_weights_give_the_single_table_result():
    rng = np.random.default_rng(2)
    vocab, dim, shards = 11, 3, 3
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    bias = rng.normal(size=vocab).astype(np.float32)
    x = rng.normal(size=(4, dim)).astype(np.float32)
    labels = np.array([[1], [10], [4], [1]], np.int64)
    values = (np.array([0, 4, 7, 9], np.int64), np.full((4, 1), 0.3, np.float32),
              np.full(4, 0.2, np.float32))

    def train(sharded):
        with fm.Graph().as_default():
            if sharded:
                w = [fm.Variable(table[p::shards], name=f"w_{p}") for p in range(shards)]
            else:
                w = fm.Variable(table, name="w")
            loss = fm.reduce_mean(fm.nn.sampled_softmax_loss(
                w, fm.constant(bias), labels, x, 4, vocab, sampled_values=values
            ))
            grads = fm.gradients(loss, w if sharded else [w])
            assert all(isinstance(g, IndexedSlices) for g in grads)
            step = fm.train.Adam(0.1).minimize(loss)
            with fm.Session() as sess:
                sess.run(fm.global_variables_initializer())
                losses = [sess.run([loss, step])[0] for _ in range(3)]
                parts = sess.run([v.value() for v in (w if sharded else [w])])
        if sharded:
            full = np.empty_like(table)
            for p, part in enumerate(parts):
                full[p::shards] = part
            parts = [full]
        return losses, parts[0]

    want_losses, want_table = train(sharded=False)
    got_losses, got_table = train(sharded=True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_named():
    with fm.Graph().as_default():
        w = fm.Variable(np.zeros((10, 4), np.float32), name="w")
        b = fm.Variable(np.zeros(10, np.float32), name="b")
        x = fm.placeholder(fm.float32, (None, 4))
        with pytest.raises(fm.GraphError, match="labels must be \\[batch_size, num_true\\]"):
            fm.nn.sampled_softmax_loss(w, b, fm.placeholder(fm.int64, (None,)), x, 3, 10)
        with pytest.raises(fm.GraphError, match="inputs .* and the weights' rows"):
            fm.nn.sampled_softmax_loss(w, b, fm.placeholder(fm.int64, (None, 1)),
                                       fm.placeholder(fm.float32, (None, 5)), 3, 10)
        with pytest.raises(ValueError, match="num_sampled must be a positive int"):
            fm.nn.sampled_softmax_loss(w, b, fm.placeholder(fm.int64, (None, 1)), x, 0, 10)
        with pytest.raises(ValueError, match="partition_strategy must be 'mod' or 'div'"):
            fm.nn.embedding_lookup([w, w], [1, 2], partition_strategy="range")


def test_across_tasks_only_the_true_and_sampled_rows_move():
    """Weights sharded over PS tasks: the Gathers run where the shards live, so what
    crosses to the worker is rows (and their gradient rows), never a shard."""
    from flowmill.runtime.partition import partition
    from flowmill.runtime.placement import place, replica_device_setter
    from flowmill.runtime.prune import prune

    vocab, dim = 5000, 16
    with fm.Graph(seed=3).as_default():
        with fm.device(replica_device_setter(2)):
            shards = [fm.Variable(fm.initializers.zeros(), name=f"w_{p}", shape=(vocab // 2, dim))
                      for p in range(2)]
            b = fm.Variable(np.zeros(vocab, np.float32), name="b")
            x = fm.placeholder(fm.float32, (None, dim), name="x")
            labels = fm.placeholder(fm.int64, (None, 1), name="labels")
            loss = fm.reduce_mean(fm.nn.sampled_softmax_loss(shards, b, labels, x, 20, vocab))
            train = fm.train.GradientDescent(0.1).minimize(loss)
        assert [s.device for s in shards] == ["/job:ps/task:0", "/job:ps/task:1"]
        step = prune([loss], [train], [x, labels])
        place(step, "/job:worker/task:0")
        parts = partition(step, "/job:worker/task:0/device:CPU:0")
    moved = [n.attrs["shape"] for part in parts.values() for n in part.nodes if n.type == "_Recv"]
    assert moved
    table_dims = {vocab, vocab // 2}
    assert all(shape is None or not table_dims & set(shape) for shape in moved), moved
