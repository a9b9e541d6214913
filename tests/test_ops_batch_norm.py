"""Fused batch normalization (channels last) against NumPy, and its gradient, through the
output and through the batch moments it returns, against central differences."""

import numpy as np
import pytest

import flowmill.runtime as fm

from opcheck import OpCase, case_tests

rng = np.random.default_rng(8)


def ref_fused(x, scale, offset, eps=1e-3):
    x64 = x.astype(np.float64)
    axes = tuple(range(x.ndim - 1))
    mean = x64.mean(axes)
    var = ((x64 - mean) ** 2).mean(axes)
    y = (x64 - mean) / np.sqrt(var + eps) * scale + offset
    return [y, mean, var]


def fused(x, scale, offset):
    return list(fm.nn.fused_batch_norm(x, scale, offset))


def fused_inference(x, scale, offset, mean, var):
    return fm.nn.fused_batch_norm(x, scale, offset, mean, var, is_training=False)[0]


def ref_inference(x, scale, offset, mean, var, eps=1e-3):
    return (x - mean) / np.sqrt(var + eps) * scale + offset


def f32(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


P = rng.normal(size=(5, 3))


def fused_gradient(x, scale, offset):
    """The gradient as an op's output: forward-checks FusedBatchNormGrad."""
    y, _, _ = fm.nn.fused_batch_norm(x, scale, offset)
    return fm.gradients(fm.reduce_sum(y * fm.constant(P.astype(np.float32))), [x, scale, offset])


def ref_fused_gradient(x, scale, offset, eps=1e-3):
    x64 = x.astype(np.float64)
    n = x.shape[0]
    mean, var = x64.mean(0), x64.var(0)
    x_hat = (x64 - mean) / np.sqrt(var + eps)
    d_offset, d_scale = P.sum(0), (P * x_hat).sum(0)
    a = scale / np.sqrt(var + eps)
    return [a / n * (n * P - d_offset - x_hat * d_scale), d_scale, d_offset]


CASES = [
    OpCase("fused_batch_norm_nhwc", fused, [f32(3, 4, 5, 6), f32(6, low=0.5), f32(6)],
           ref_fused, rtol=1e-4, atol=1e-4),
    OpCase("fused_batch_norm_2d", fused, [f32(7, 3), f32(3, low=0.5), f32(3)], ref_fused,
           rtol=1e-4, atol=1e-4),
    OpCase("fused_batch_norm_gradient", fused_gradient, [f32(5, 3), f32(3, low=0.5), f32(3)],
           ref_fused_gradient, grad=False, rtol=1e-4, atol=1e-4),
    OpCase("fused_batch_norm_inference", fused_inference,
           [f32(2, 3, 3, 4), f32(4), f32(4), f32(4), f32(4, low=0.1)], ref_inference,
           rtol=1e-5, atol=1e-5),
]

test_forward, test_gradient = case_tests(CASES)


def test_float16_statistics_are_taken_in_float32():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float16, (64, 4))
        y, mean, var = fm.nn.fused_batch_norm(x, np.ones(4, np.float16), np.zeros(4, np.float16))
    value = (rng.normal(size=(64, 4)) * 30 + 200).astype(np.float16)
    with fm.Session(g) as sess:
        out = sess.run([y, mean, var], {x: value})
    assert [o.dtype for o in out] == [np.float16] * 3
    want = ref_fused(value, np.ones(4), np.zeros(4))
    np.testing.assert_allclose(out[0], want[0], atol=2e-2)
    np.testing.assert_allclose(out[1], want[1], rtol=1e-3)


def test_bad_fused_batch_norm_input_is_named():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (2, 3, 3, 4), name="images")
        with pytest.raises(fm.GraphError, match=r"scale must be \[4\] \(one per channel\)"):
            fm.nn.fused_batch_norm(x, np.ones(3, np.float32), np.zeros(4, np.float32))
        with pytest.raises(fm.GraphError, match="channels must be last"):
            fm.nn.fused_batch_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32),
                                   data_format="NCHW")
        with pytest.raises(fm.GraphError, match="needs mean and variance"):
            fm.nn.fused_batch_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32),
                                   is_training=False)
