import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.autodiff import IndexedSlices
from flowmill.runtime.graph import GraphError, apply_op
from flowmill.runtime.ops import array_ops as A
from flowmill.runtime.ops import math_ops as M
from flowmill.runtime.ops.state_ops import Variable

from opcheck import OpCase, case_tests

rng = np.random.default_rng(2)


def r(*shape):
    return rng.uniform(-2.0, 2.0, size=shape).astype(np.float32)


def ints(*values, dtype=np.int32):
    return np.array(values, dtype=dtype)


def _scattered(g, x, key):
    out = np.zeros_like(x, dtype=g.dtype)
    out[key] = g
    return out


def _segment_sum(data, ids, n):
    out = np.zeros((n,) + data.shape[ids.ndim :], data.dtype)
    for i in np.ndindex(ids.shape):
        if ids[i] >= 0:
            out[ids[i]] += data[i]
    return out


def _one_hot(indices, depth, on, off, axis):
    out = np.where(indices[..., None] == np.arange(depth), on, off).astype(np.float32)
    return np.moveaxis(out, -1, axis)


def _partition(data, parts, n):
    return [data[parts == p] for p in range(n)]


def _shaped(tensors, *static):
    """Data-dependent sizes pinned to what the case's inputs give (the checks need them)."""
    for t, shape in zip(tensors, static, strict=True):
        t.set_shape(shape)
    return tensors


def _stitch(indices, data):
    size = max(int(i.max()) for i in indices) + 1
    out = np.zeros((size,) + data[0].shape[indices[0].ndim :], data[0].dtype)
    for i, d in zip(indices, data, strict=True):
        out[i] = d
    return out


SPLIT_LIKE = {"axis": 1}

CASES = [
    # Identity, NoOp and StopGradient (constants, placeholders and groups)
    OpCase(
        "tuple_group",
        lambda a, b: A.tuple_([a * 2.0, b * 3.0]),
        [r(2), r(3)],
        lambda a, b: [a * 2, b * 3],
    ),
    OpCase(
        "stop_gradient",
        lambda a: A.stop_gradient(a) * 2.0,
        [r(3)],
        lambda a: a * 2,
        grad=False,
    ),
    # Reshape family
    OpCase("reshape", lambda a: A.reshape(a, (3, -1)), [r(2, 6)], lambda a: a.reshape(3, 4)),
    OpCase("reshape_flat", lambda a: A.reshape(a, [-1]), [r(2, 3, 2)], lambda a: a.reshape(-1)),
    OpCase(
        "reshape_to_shape_of",
        A.reshape_to_shape_of,
        [r(2, 6), r(4, 3)],
        lambda a, b: a.reshape(4, 3),
        wrt=[0],
    ),
    OpCase("expand_dims", lambda a: A.expand_dims(a, 1), [r(2, 3)], lambda a: a[:, None]),
    OpCase("expand_dims_neg", lambda a: A.expand_dims(a, -1), [r(2, 3)], lambda a: a[..., None]),
    OpCase("squeeze_all", A.squeeze, [r(1, 3, 1, 2)], np.squeeze),
    OpCase("squeeze_axis", lambda a: A.squeeze(a, 2), [r(1, 3, 1)], lambda a: a[:, :, 0]),
    OpCase("transpose_reverse", A.transpose, [r(2, 3, 4)], np.transpose),
    OpCase(
        "transpose_perm",
        lambda a: A.transpose(a, (1, 2, 0)),
        [r(2, 3, 4)],
        lambda a: a.transpose(1, 2, 0),
    ),
    # Concat and Split
    OpCase(
        "concat",
        lambda a, b, c: A.concat([a, b, c], 1),
        [r(2, 1), r(2, 3), r(2, 2)],
        lambda a, b, c: np.concatenate([a, b, c], 1),
    ),
    OpCase(
        "concat_neg_axis",
        lambda a, b: A.concat([a, b], -1),
        [r(2, 2, 1), r(2, 2, 2)],
        lambda a, b: np.concatenate([a, b], -1),
    ),
    OpCase("split_num", lambda a: A.split(a, 3, axis=1), [r(2, 6)], lambda a: np.split(a, 3, 1)),
    OpCase(
        "split_sizes",
        lambda a: A.split(a, [1, -1, 2], axis=0),
        [r(6, 2)],
        lambda a: np.split(a, [1, 4], 0),
    ),
    OpCase(
        "split_like",
        lambda g, a, b: apply_op("Split", [g, a, b], SPLIT_LIKE).outputs,
        [r(2, 5), r(2, 3), r(2, 2)],
        lambda g, a, b: np.split(g, [3], 1),
        wrt=[0],
    ),
    # Indexing and slicing
    OpCase("getitem_int", lambda a: a[1], [r(3, 4)], lambda a: a[1]),
    OpCase("getitem_steps", lambda a: a[:, ::2], [r(3, 5)], lambda a: a[:, ::2]),
    OpCase(
        "getitem_ellipsis_newaxis",
        lambda a: a[..., None, 1:],
        [r(2, 3, 4)],
        lambda a: a[..., None, 1:],
    ),
    OpCase("getitem_reverse", lambda a: a[-1, ::-1], [r(3, 4)], lambda a: a[-1, ::-1]),
    OpCase("getitem_scalar", lambda a: a[1, 2], [r(3, 4)], lambda a: a[1, 2]),
    OpCase(
        "getitem_negative_step_bounds",
        lambda a: a[3:0:-2, :-1],
        [r(5, 3)],
        lambda a: a[3:0:-2, :-1],
    ),
    OpCase(
        "strided_slice_grad",
        lambda g, x: A.strided_slice_grad(g, x, (slice(None, None, 2), 1)),
        [r(2), r(4, 3)],
        lambda g, x: _scattered(g, x, (slice(None, None, 2), 1)),
        wrt=[0],
    ),
    OpCase(
        "slice",
        lambda a: A.slice_(a, [1, 0, 2], [2, -1, 1]),
        [r(4, 2, 3)],
        lambda a: a[1:3, :, 2:3],
    ),
    OpCase(
        "pad",
        lambda a: A.pad(a, [(1, 0), (2, 1)]),
        [r(2, 3)],
        lambda a: np.pad(a, [(1, 0), (2, 1)]),
    ),
    OpCase(
        "pad_value",
        lambda a: A.pad(a, [(0, 2)], constant_values=1.5),
        [r(3)],
        lambda a: np.pad(a, [(0, 2)], constant_values=1.5),
    ),
    OpCase("tile", lambda a: A.tile(a, (2, 3)), [r(2, 2)], lambda a: np.tile(a, (2, 3))),
    OpCase(
        "tile_grad",
        lambda g, x: A.tile_grad(g, x, (3, 1)),
        [r(6, 2), r(2, 2)],
        lambda g, x: g.reshape(3, 2, 1, 2).sum((0, 2)),
        wrt=[0],
    ),
    # Generators of values
    OpCase(
        "zeros_ones_fill",
        lambda: [A.zeros((2, 3)), A.ones((2,), fm.int32), A.fill((1, 2), 7.5, fm.float64)],
        [],
        lambda: [np.zeros((2, 3), np.float32), np.ones(2, np.int32), np.full((1, 2), 7.5)],
        grad=False,
    ),
    OpCase(
        "shape",
        lambda a: [A.shape(a), A.shape(a, fm.int64)],
        [r(2, 3, 1)],
        lambda a: [np.array([2, 3, 1], np.int32), np.array([2, 3, 1], np.int64)],
        grad=False,
    ),
    OpCase(
        "range",
        lambda n: [A.range_(n), A.range_(1, 7, 2), A.range_(0.5, 2.0, 0.5)],
        [np.int32(4)],
        lambda n: [np.arange(n), np.arange(1, 7, 2, dtype=np.int32), np.arange(0.5, 2.0, 0.5)],
        grad=False,
    ),
    OpCase(
        "one_hot",
        lambda i: [A.one_hot(i, 4), A.one_hot(i, 3, on_value=5.0, off_value=-1.0, axis=0)],
        [ints([0, 3, -1], [2, 1, 7])],
        lambda i: [_one_hot(i, 4, 1, 0, -1), _one_hot(i, 3, 5, -1, 0)],
        grad=False,
    ),
    # Sparse ops
    OpCase("gather", A.gather, [r(5, 3), ints(4, 0, 4, 2)], lambda p, i: p[i]),
    OpCase(
        "gather_2d_indices",
        A.gather,
        [r(4, 2), ints([1, 3], [1, 0], [2, 2])],
        lambda p, i: p[i],
    ),
    OpCase(
        "gather_axis1",
        lambda p, i: A.gather(p, i, axis=1),
        [r(2, 4, 3), ints([3, 0], [3, 3])],
        lambda p, i: np.take(p, i, axis=1),
    ),
    OpCase(
        "unsorted_segment_sum",
        lambda d, i: A.unsorted_segment_sum(d, i, 4),
        [r(5, 2), ints(3, 0, 3, -1, 1)],
        lambda d, i: _segment_sum(d, i, 4),
    ),
    OpCase(
        "unsorted_segment_sum_2d_ids",
        lambda d, i: A.unsorted_segment_sum(d, i, 3),
        [r(2, 2, 3), ints([2, 0], [2, 2])],
        lambda d, i: _segment_sum(d, i, 3),
    ),
    OpCase(
        "dynamic_partition",
        lambda d, p: _shaped(A.dynamic_partition(d, p, 3), (2, 2), (1, 2), (3, 2)),
        [r(6, 2), ints(2, 0, 2, 1, 0, 2)],
        lambda d, p: _partition(d, p, 3),
    ),
    OpCase(
        "dynamic_partition_2d",
        lambda d, p: _shaped(A.dynamic_partition(d, p, 2), (2,), (4,)),
        [r(2, 3), ints([1, 0, 1], [1, 1, 0])],
        lambda d, p: _partition(d, p, 2),
    ),
    OpCase(
        "dynamic_stitch",
        lambda i0, i1, d0, d1: _shaped([A.dynamic_stitch([i0, i1], [d0, d1])], (4, 2)),
        [ints(0, 3), ints([1], [2]), r(2, 2), r(2, 1, 2)],
        lambda i0, i1, d0, d1: _stitch([i0, i1], [d0, d1]),
    ),
]


test_forward, test_gradient = case_tests(CASES)


# ---- the paper's sharded embedding lookup: Part, Gather per shard, Stitch


def _embedding_lookup(shards, ids):
    """Rows ``ids`` of a table whose row r lives in shard r % n at row r // n."""
    n = len(shards)
    owner, local = ids % n, ids // n
    shard_ids = A.dynamic_partition(local, owner, n)
    positions = A.dynamic_partition(A.range_(M.size(ids)), owner, n)
    rows = [A.gather(s, i) for s, i in zip(shards, shard_ids, strict=True)]
    return A.dynamic_stitch(positions, rows)


def test_sharded_embedding_lookup_and_sparse_update():
    table = rng.normal(size=(10, 4)).astype(np.float32)
    ids_value = np.array([7, 1, 4, 1, 9], np.int32)
    proj_value = rng.normal(size=(5, 4)).astype(np.float32)
    graph = fm.Graph()
    with graph.as_default():
        shards = [Variable(table[p::3], name=f"shard{p}") for p in range(3)]
        ids = fm.placeholder(fm.int32, (None,), name="ids")
        emb = _embedding_lookup(shards, ids)
        assert emb.shape == (None, 4)
        loss = M.reduce_sum(emb * fm.constant(proj_value))
        grads = fm.gradients(loss, [s.value() for s in shards])
        assert all(isinstance(g, IndexedSlices) for g in grads)
        assert [g.dense_shape for g in grads] == [(4, 4), (3, 4), (3, 4)]
        updates = [
            s.scatter_sub(g.indices, g.values * 0.5) for s, g in zip(shards, grads, strict=True)
        ]
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        got = sess.run(emb, {ids: ids_value})
        np.testing.assert_array_equal(got, table[ids_value])
        slices = sess.run([(g.indices, g.values) for g in grads], {ids: ids_value})
        dense = np.zeros_like(table)
        np.add.at(dense, ids_value, proj_value)
        for p, (indices, values) in enumerate(slices):
            mine = ids_value[ids_value % 3 == p]
            # Only the rows that were looked up, once per lookup, in lookup order.
            np.testing.assert_array_equal(indices, mine // 3)
            np.testing.assert_allclose(values, proj_value[ids_value % 3 == p])
        sess.run(updates, {ids: ids_value})
        for p, s in enumerate(shards):
            want = table[p::3] - 0.5 * dense[p::3]
            np.testing.assert_allclose(sess.run(s.value()), want, rtol=1e-6, atol=1e-7)
        untouched = sorted(set(range(10)) - set(ids_value.tolist()))
        assert untouched == [0, 2, 3, 5, 6, 8]
        for row in untouched:
            np.testing.assert_array_equal(sess.run(shards[row % 3].value())[row // 3], table[row])


def test_embedding_lookup_with_an_empty_shard():
    graph = fm.Graph()
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    with graph.as_default():
        shards = [Variable(table[p::3]) for p in range(3)]
        ids = fm.placeholder(fm.int32, (None,))
        emb = _embedding_lookup(shards, ids)
        g = fm.gradients(M.reduce_sum(emb), shards[1].value())[0]
    with fm.Session(graph) as sess:
        sess.run(fm.global_variables_initializer())
        feed = {ids: np.array([3, 0, 5], np.int32)}
        np.testing.assert_array_equal(sess.run(emb, feed), table[[3, 0, 5]])
        indices, values = sess.run([g.indices, g.values], feed)
        assert indices.shape == (0,) and values.shape == (0, 2)


# ---- static shapes and build-time errors


def test_reshape_infers_the_hole_and_keeps_unknown_batch():
    with fm.Graph().as_default():
        x = fm.placeholder(fm.float32, (None, 4, 3))
        assert A.reshape(x, (-1, 12)).shape == (None, 12)
        assert A.reshape(x[0], (2, -1)).shape == (2, 6)
        assert A.reshape(x, (None, 2, 6)).shape == (None, 2, 6)
        with pytest.raises(GraphError, match=r"\(4, 3\) \(12 elements\).*not a multiple of 5"):
            A.reshape(x[0], (5, -1))
        with pytest.raises(GraphError, match="12 elements"):
            A.reshape(x[0], (5, 2))
        with pytest.raises(GraphError, match="at most one -1"):
            A.reshape(x, (-1, -1))


def test_shape_functions_name_what_is_wrong():
    with fm.Graph().as_default():
        a = fm.placeholder(fm.float32, (2, 3))
        b = fm.placeholder(fm.float32, (4, 3))
        with pytest.raises(GraphError, match="differ in dim 1"):
            A.concat([a, fm.placeholder(fm.float32, (2, 4))], 0)
        assert A.concat([a, b], 0).shape == (6, 3)
        with pytest.raises(GraphError, match="does not split into 4"):
            A.split(a, 4, axis=1)
        with pytest.raises(GraphError, match="cannot squeeze axis 0 of size 2"):
            A.squeeze(a, 0)
        with pytest.raises(GraphError, match="out of range for dim 0 of size 2"):
            a[2]
        with pytest.raises(GraphError, match="3 entries for rank 2"):
            a[0, 0, 0]
        with pytest.raises(GraphError, match="exceeds its size 3"):
            A.slice_(a, [0, 2], [1, 2])
        with pytest.raises(GraphError, match="indices must be integers"):
            A.gather(a, b)
        with pytest.raises(TypeError, match="use gather"):
            a[fm.placeholder(fm.int32, ())]
        with pytest.raises(GraphError, match="not a permutation"):
            A.transpose(a, (0, 0))


def test_unknown_dims_propagate():
    with fm.Graph().as_default():
        x = fm.placeholder(fm.float32, (None, 5))
        assert x[:, 1:3].shape == (None, 2)
        assert x[::2].shape == (None, 5)
        assert A.concat([x, x], 0).shape == (None, 5)
        assert A.concat([x, x], 1).shape == (None, 10)
        assert A.pad(x, [(1, 1), (0, 2)]).shape == (None, 7)
        assert A.tile(x, (2, 2)).shape == (None, 10)
        assert A.squeeze(x).shape is None
        assert A.shape(x).shape == (2,)
        assert A.gather(x, fm.placeholder(fm.int32, (None, 2))).shape == (None, 2, 5)
        assert [p.shape for p in A.split(x, [2, -1], axis=1)] == [(None, 2), (None, 3)]
        assert A.dynamic_partition(x, fm.placeholder(fm.int32, (None,)), 2)[1].shape == (None, 5)
        unknown = fm.placeholder(fm.float32, None)
        assert unknown[0].shape is None
        assert A.reshape(unknown, (-1, 2)).shape == (None, 2)


def _numeric_grad(sess, loss, x, value, feeds, eps=1e-6):
    out = np.zeros_like(value)
    for j in range(value.size):
        flat = value.reshape(-1)
        old = flat[j]
        flat[j] = old + eps
        up = sess.run(loss, {x: value, **feeds})
        flat[j] = old - eps
        down = sess.run(loss, {x: value, **feeds})
        flat[j] = old
        out.reshape(-1)[j] = (up - down) / (2 * eps)
    return out


@pytest.mark.parametrize(
    "build",
    [
        lambda x, i: A.gather(x, i),
        lambda x, i: A.gather(x, i, axis=1),
        lambda x, i: A.concat([x, x * 2.0], 0),
        lambda x, i: A.reshape(x, (-1,)),
        lambda x, i: A.tile(x[1:], (2, 1)),
        lambda x, i: A.pad(x, [(0, 1), (1, 0)]) * A.pad(x, [(1, 0), (0, 1)]),
        lambda x, i: A.slice_(x, [1, 1], [-1, 1]),
        lambda x, i: A.dynamic_partition(x, i % 2, 2)[1],
    ],
    ids=["gather", "gather_axis1", "concat", "reshape", "tile", "pad", "slice", "partition"],
)
def test_gradients_with_unknown_dims(build):
    """Gradients that read sizes at run time: the placeholder's dims are all unknown."""
    graph = fm.Graph()
    value = rng.normal(size=(3, 3))
    i_value = np.array([2, 0, 2], np.int32)
    with graph.as_default():
        x = fm.placeholder(fm.float64, (None, None))
        i = fm.placeholder(fm.int32, (None,))
        y = build(x, i)
        loss = M.reduce_sum(M.square(y) * 0.5 + y)
        g = fm.gradients(loss, x)[0]
        from flowmill.runtime.backprop import to_dense

        g = to_dense(g)
    with fm.Session(graph) as sess:
        got = sess.run(g, {x: value, i: i_value})
        want = _numeric_grad(sess, loss, x, value.copy(), {i: i_value})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_unsorted_segment_sum_counts_from_a_tensor():
    with fm.Graph().as_default() as graph:
        data = fm.placeholder(fm.float32, (None, 2))
        ids = fm.placeholder(fm.int32, (None,))
        n = fm.placeholder(fm.int32, ())
        y = A.unsorted_segment_sum(data, ids, n)
        assert y.shape == (None, 2)
    d = np.arange(6, dtype=np.float32).reshape(3, 2)
    with fm.Session(graph) as sess:
        got = sess.run(y, {data: d, ids: [1, 1, 3], n: 5})
    np.testing.assert_array_equal(got, _segment_sum(d, np.array([1, 1, 3]), 5))


def test_run_time_index_errors_name_the_op():
    with fm.Graph().as_default() as graph:
        params = fm.placeholder(fm.float32, (3, 2))
        ids = fm.placeholder(fm.int32, (None,))
        g = A.gather(params, ids, name="lookup")
        s = A.unsorted_segment_sum(params, ids, 2, name="segsum")
        p = A.dynamic_partition(params, ids, 2, name="part")
    p_value = np.zeros((3, 2), np.float32)
    with fm.Session(graph) as sess:
        with pytest.raises(IndexError, match="lookup"):
            sess.run(g, {params: p_value, ids: [0, 5]})
        with pytest.raises(IndexError, match="segsum.*segment id 2"):
            sess.run(s, {params: p_value, ids: [0, 2, 1]})
        with pytest.raises(IndexError, match=r"part.*\[0, 2\)"):
            sess.run(p, {params: p_value, ids: [0, 2, 1]})


def test_fill_is_shared_read_only_and_constants_fold():
    with fm.Graph().as_default() as graph:
        z = A.zeros((2, 2))
        y = z + 1.0
    with fm.Session(graph) as sess:
        a = sess.run(z)
        assert not a.flags.writeable
        np.testing.assert_array_equal(sess.run(y), np.ones((2, 2)))
