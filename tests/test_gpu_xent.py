"""Softmax cross-entropy on a GPU as fused kernels (``kernels/fused_xent.py``): the loss and
its backprop in four launches, the values the CPU kernels give, bad sparse labels as NaN rows
without a host sync; and the stand-in's ``fuse`` refusing what ``cupy.fuse`` cannot compile
into one kernel, so that a kernel relying on it fails here as it would on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from flowmill.kernels import ARRAY_MODULES, KernelContext, get_builder, nn, standin

DENSE, SPARSE = "SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits"
# Float results of the device's own exp, log and sums, against NumPy's.
RTOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}


def _kernel(op: str, device: str = "GPU"):
    return get_builder(op, device)(KernelContext(op, "xent", {}, device, None))


def _inputs(op: str, dtype=np.float32, shape=(6, 5)):
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=shape) * 3).astype(dtype)
    if op == DENSE:
        labels = rng.dirichlet(np.ones(shape[-1]), shape[:-1]).astype(dtype)
    else:
        labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    return logits, labels


def _launches(gpu, op: str) -> int:
    xp = ARRAY_MODULES["GPU"]
    fn = _kernel(op)
    logits, labels = (xp.asarray(v) for v in _inputs(op))
    fn(logits, labels)  # the first step makes the sparse op's column numbers
    gpu.reset_counts()
    fn(logits, labels)
    counts = gpu.counts()
    assert counts["syncs"] == counts["h2d"] == counts["d2h"] == 0
    return counts["launches"]


# Launches of one step, fused and op by op: the row maximum, the sum of exponentials, the
# loss row and the backprop, where one launch per array operation took ten (dense) and
# eighteen (sparse: the gather and scatter at the labels, the masks of labels out of range).
LAUNCHES = {DENSE: (4, 10), SPARSE: (4, 18)}


@pytest.mark.parametrize("op", sorted(LAUNCHES))
def test_the_loss_and_its_backprop_take_four_launches(standin_gpu, monkeypatch, op):
    if standin_gpu.counts() is None:
        pytest.skip("launches are counted on the stand-in")
    fused = _launches(standin_gpu, op)
    monkeypatch.setattr(nn, "_fuses", lambda xp: False)
    assert (fused, _launches(standin_gpu, op)) == LAUNCHES[op]


@pytest.mark.parametrize("dtype", sorted(RTOL, key=lambda d: d.__name__))
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 4), (0, 3)])
@pytest.mark.parametrize("op", [DENSE, SPARSE])
def test_the_fused_kernels_compute_what_the_cpu_kernels_do(standin_gpu, op, shape, dtype):
    xp = ARRAY_MODULES["GPU"]
    logits, labels = _inputs(op, dtype, shape)
    want = _kernel(op, "CPU")(logits, labels)
    got = _kernel(op)(xp.asarray(logits), xp.asarray(labels))
    for g, w in zip(got, want, strict=True):
        g = xp.asnumpy(g)
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=RTOL[dtype], atol=RTOL[dtype])


def test_a_sparse_label_out_of_range_is_a_nan_row_without_a_sync(standin_gpu):
    xp = ARRAY_MODULES["GPU"]
    logits, _ = _inputs(SPARSE, shape=(4, 5))
    labels = np.array([0, 5, -1, 4], np.int64)
    fn = _kernel(SPARSE)
    args = xp.asarray(logits), xp.asarray(labels)
    standin_gpu.reset_counts()
    loss, backprop = fn(*args)
    if standin_gpu.counts() is not None:
        assert standin_gpu.counts()["syncs"] == 0
    loss, backprop = xp.asnumpy(loss), xp.asnumpy(backprop)
    want_loss, want_backprop = _kernel(SPARSE, "CPU")(logits[[0, 3]], labels[[0, 3]])
    assert np.isnan(loss[1:3]).all() and np.isnan(backprop[1:3]).all()
    np.testing.assert_allclose(loss[[0, 3]], want_loss, rtol=RTOL[np.float32])
    np.testing.assert_allclose(backprop[[0, 3]], want_backprop, rtol=RTOL[np.float32],
                               atol=1e-7)


# ---- the stand-in's fuse, against what cupy.fuse compiles (the stand-in itself, no GPU)


@pytest.fixture
def xp():
    return standin.module(2)


def _x(xp):
    return xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))


def test_a_fused_function_may_end_in_one_reduction(xp):
    def log_sum_exp(x, m):
        return xp.log(xp.sum(xp.exp(x - m), axis=-1))

    x = _x(xp)
    m = x.max(axis=-1, keepdims=True)
    standin.reset_counts()
    got = xp.fuse(log_sum_exp)(x, m)
    assert standin.counts()["launches"] == 1
    host = xp.asnumpy(x)
    want = np.log(np.exp(host - host.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_array_equal(xp.asnumpy(got), want)


def _refused(xp, fn, *args) -> str:
    with pytest.raises((NotImplementedError, TypeError, ValueError)) as e:
        xp.fuse(fn)(*args)
    return str(e.value)


def test_a_second_reduction_is_refused(xp):
    def sum_exp_of_max(x):
        return xp.sum(xp.exp(xp.max(x, axis=-1)))

    assert "Multiple reduction" in _refused(xp, sum_exp_of_max, _x(xp))
    assert "Multiple reduction" in _refused(xp, lambda x: x.sum().max(), _x(xp))
    assert "Multiple reduction" in _refused(xp, lambda x: xp.add.reduce(xp.max(x, 1)), _x(xp))


def test_keepdims_is_refused(xp):
    message = _refused(xp, lambda x: xp.sum(x, axis=-1, keepdims=True), _x(xp))
    assert "keepdims" in message


def test_after_the_reduction_only_the_reduced_value_is_computed_on(xp):
    assert "Shape mismatch" in _refused(xp, lambda x: xp.sum(x, axis=-1) + x, _x(xp))
    assert "Shape mismatch" in _refused(xp, lambda x: (xp.sum(x, axis=-1), x * 2), _x(xp))


def test_indexing_shapes_host_reads_and_arrays_made_inside_are_refused(xp):
    x = _x(xp)
    assert "indexing" in _refused(xp, lambda x: x[:, None] * 2, x)
    assert "reshape" in _refused(xp, lambda x: x.reshape(-1), x)
    assert "shape" in _refused(xp, lambda x: x * x.shape[0], x)
    assert "Python scalar" in _refused(xp, lambda x: x * float(x), x)
    assert "Concrete" in _refused(xp, lambda x: x + xp.arange(3, dtype=np.float32), x)
    outside = xp.ones(3, np.float32)
    assert "Concrete" in _refused(xp, lambda x: x + outside, x)
