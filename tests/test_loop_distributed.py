"""A recurrent model across processes: its weights and a sharded embedding on two PS
tasks, the while loop (forward and backward, its stacks and TensorArrays) on the worker.
The loop frames and the new ops travel in the worker's GraphDef, and training computes
exactly what one process computes."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.cluster import ClusterSpec
from flowmill.runtime.embedding import ShardedEmbedding
from flowmill.runtime.placement import replica_device_setter

from local_cluster import LocalCluster

VOCAB, EMBED, HIDDEN, STEPS, BATCH = 11, 4, 5, 6, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


def build(spec: ClusterSpec):
    with fm.device(replica_device_setter(spec, worker_device="/job:worker/task:0")):
        ids = fm.placeholder(fm.int32, (None, STEPS + 1), name="ids")
        table = ShardedEmbedding(VOCAB, EMBED, 2, fm.initializers.random_normal(stddev=0.5))
        x = table.lookup(ids[:, :STEPS])
        cell = fm.nn.rnn_cell.MultiRNNCell(
            [fm.nn.rnn_cell.LSTMCell(HIDDEN), fm.nn.rnn_cell.LSTMCell(HIDDEN)]
        )
        out, _ = fm.nn.dynamic_rnn(cell, x, dtype=fm.float32)
        w = fm.Variable(np.linspace(-1, 1, HIDDEN * VOCAB, dtype=np.float32)
                        .reshape(HIDDEN, VOCAB), name="softmax_w")
        logits = fm.matmul(fm.reshape(out, [-1, HIDDEN]), w)
        labels = fm.reshape(ids[:, 1:], [-1])
        loss = fm.reduce_mean(
            fm.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        )
        train = fm.train.GradientDescent(0.5).minimize(loss)
    return ids, loss, train


def test_a_dynamic_rnn_trains_across_processes_as_in_one(cluster):
    rng = np.random.default_rng(1)
    data = [rng.integers(0, VOCAB, (BATCH, STEPS + 1)).astype(np.int32) for _ in range(8)]
    g = fm.Graph(seed=4)
    with g.as_default():
        ids, loss, train = build(cluster.spec)
        init = fm.global_variables_initializer()
        weights = fm.trainable_variables()
    with fm.Session(g) as sess:
        sess.run(init)
        expected = [sess.run([loss, train], {ids: b})[0] for b in data]
        expected_weights = sess.run([v.value() for v in weights])
    sess = cluster.session(g)
    sess.run(init)
    got = [sess.run([loss, train], {ids: b})[0] for b in data]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got[-1] < got[0]
    for want, have in zip(expected_weights, sess.run([v.value() for v in weights]), strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    placed = {v.device for v in weights}
    assert any("/job:ps/task:0" in d for d in placed) and any("/job:ps/task:1" in d for d in placed)
