"""Sharded embeddings: Part/Gather/Stitch lookups, row-wise sparse updates, across
processes only looked-up rows travel (a step never moves the table), and the shards are
recorded as one table for checkpoints (``test_saver`` moves them between splits)."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.checkpoint_store import TensorSlice
from flowmill.runtime.autodiff import IndexedSlices
from flowmill.runtime.embedding import PARTITIONED_TABLES, ShardedEmbedding, partitioned_table
from flowmill.runtime.partition import partition
from flowmill.runtime.placement import place, replica_device_setter
from flowmill.runtime.prune import prune

from local_cluster import LocalCluster

VOCAB, DIM = 11, 4
TABLE = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM) / 10.0
IDS = np.array([7, 1, 10, 1, 4, 0], np.int32)


def build(num_shards, device_fn=None):
    with fm.device(device_fn):
        emb = ShardedEmbedding(VOCAB, DIM, num_shards, fm.initializers.zeros(), name="emb")
        ids = fm.placeholder(fm.int32, (None,), name="ids")
        rows = emb.lookup(ids)
        loss = fm.reduce_sum(rows * fm.constant(np.linspace(-1, 1, DIM, dtype=np.float32)))
        train = fm.train.GradientDescent(0.5).minimize(loss)
        load = fm.group(*[s.assign(TABLE[p::num_shards]) for p, s in enumerate(emb.shards)])
    return emb, ids, rows, loss, train, load


@pytest.mark.parametrize("num_shards", [1, 3])
def test_lookup_and_row_wise_update(num_shards):
    g = fm.Graph()
    with g.as_default():
        emb, ids, rows, loss, train, load = build(num_shards)
        grads = fm.gradients(loss, [s.value() for s in emb.shards])
        assert all(isinstance(gr, IndexedSlices) for gr in grads)
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        sess.run(load)
        np.testing.assert_array_equal(sess.run(rows, {ids: IDS}), TABLE[IDS])
        sess.run(train, {ids: IDS})
        table = np.concatenate(sess.run([s.value() for s in emb.shards]))
    order = np.concatenate([np.arange(VOCAB)[p::num_shards] for p in range(num_shards)])
    updated = np.empty_like(TABLE)
    updated[order] = table
    want = TABLE.copy()
    np.subtract.at(want, IDS, 0.5 * np.linspace(-1, 1, DIM, dtype=np.float32))
    np.testing.assert_allclose(updated, want, rtol=1e-6)
    untouched = np.setdiff1d(np.arange(VOCAB), IDS)
    np.testing.assert_array_equal(updated[untouched], TABLE[untouched])


def test_multi_dimensional_ids():
    g = fm.Graph()
    with g.as_default():
        emb = ShardedEmbedding(VOCAB, DIM, 2, fm.initializers.zeros())
        ids = fm.placeholder(fm.int32, (None, 3), name="ids")
        rows = emb.lookup(ids)
        assert rows.shape == (None, 3, DIM)
        load = fm.group(*[s.assign(TABLE[p::2]) for p, s in enumerate(emb.shards)])
    with fm.Session(g) as sess:
        sess.run(load)
        batch = IDS.reshape(2, 3)
        np.testing.assert_array_equal(sess.run(rows, {ids: batch}), TABLE[batch])


def test_bad_arguments_are_named():
    with fm.Graph().as_default():
        with pytest.raises(ValueError, match="num_shards"):
            ShardedEmbedding(3, DIM, 5, fm.initializers.zeros())
        emb = ShardedEmbedding(VOCAB, DIM, 2, fm.initializers.zeros())
        with pytest.raises(TypeError, match="must be integers"):
            emb.lookup(fm.constant([1.0]))


def test_only_looked_up_rows_cross_devices():
    g = fm.Graph()
    with g.as_default():
        emb, ids, rows, loss, train, _ = build(2, replica_device_setter(2))
        assert [s.device for s in emb.shards] == ["/job:ps/task:0", "/job:ps/task:1"]
        step = prune([loss], [train], [ids])
        place(step, "/job:worker/task:0")
        parts = partition(step, "/job:worker/task:0/device:CPU:0")
    shard_shapes = {tuple(s.shape) for s in emb.shards}
    moved = [n.attrs["shape"] for part in parts.values() for n in part.nodes if n.type == "_Recv"]
    assert moved and not any(shape in shard_shapes for shape in moved), moved


def test_training_across_processes_matches_one_process(tmp_path):
    def run(session_factory, graph_parts):
        emb, ids, rows, loss, train, load = graph_parts
        with session_factory() as sess:
            sess.run(fm.global_variables_initializer())
            sess.run(load)
            losses = [sess.run([loss, train], {ids: IDS[: k + 2]})[0] for k in range(4)]
            return losses, sess.run([s.value() for s in emb.shards])

    cluster = LocalCluster(2, tmp_path)
    try:
        g = fm.Graph()
        with g.as_default():
            setter = replica_device_setter(cluster.spec, worker_device="/job:worker/task:0")
            parts = build(2, setter)
        want = run(lambda: fm.Session(g), parts)
        got = run(lambda: cluster.session(g), parts)
    finally:
        cluster.close()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_sharded_embedding_is_one_table_to_a_checkpoint():
    with fm.Graph().as_default() as g:
        emb = ShardedEmbedding(VOCAB, DIM, 3, fm.initializers.zeros(), name="emb")
        (table,) = g.get_collection(PARTITIONED_TABLES)
    assert table.name == emb.name == "emb" and table.shape == (VOCAB, DIM)
    assert list(table.shards) == emb.shards
    assert table.slices == tuple(TensorSlice("emb", (VOCAB, DIM), p, 3) for p in range(3))


def test_partitioned_tables_made_by_hand_are_checked():
    with fm.Graph().as_default() as g:
        def shards(*rows, dim=DIM, name="t"):
            with fm.name_scope(name):
                return [fm.Variable(np.zeros((r, dim), np.float32), name=f"p{i}")
                        for i, r in enumerate(rows)]

        div = partitioned_table(shards(4, 4, 3), "t", "div")
        assert [(s.offset, s.stride) for s in div.slices] == [(0, 1), (4, 1), (8, 1)]
        with pytest.raises(ValueError, match=r"3 'mod' shards of 11 rows hold \[4, 4, 3\] rows "
                           r"each, the shards have \[3, 4, 4\]"):
            partitioned_table(shards(3, 4, 4, name="u"), "u")
        with pytest.raises(ValueError, match="one known shape"):
            partitioned_table(shards(6, name="v") + shards(5, dim=DIM + 1, name="v"), "v")
        with pytest.raises(ValueError, match="table 't' already"):
            partitioned_table(shards(6, 5, name="t"), "t")
        with pytest.raises(ValueError, match="table 't' already"):
            partitioned_table(div.shards[:1], "w", "div")
        with pytest.raises(ValueError, match="partition_strategy must be 'mod' or 'div'"):
            partitioned_table(shards(6, 5, name="x"), "x", "range")
        with pytest.raises(ValueError, match="no shards"):
            partitioned_table([], "y")
        assert [t.name for t in g.get_collection(PARTITIONED_TABLES)] == ["t"]
