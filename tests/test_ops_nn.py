import math
import warnings

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.ops import nn_ops as nn

from opcheck import OpCase, case_tests

rng = np.random.default_rng(2)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def off_zero(*shape):
    """Values at least 0.1 away from 0, so finite differences never straddle a kink."""
    x = r(*shape, low=0.1, high=2.0)
    return x * rng.choice([-1.0, 1.0], size=shape).astype(np.float32)


def distinct(*shape):
    """Distinct values at least 0.05 apart: no ties inside a max-pooling window."""
    n = math.prod(shape)
    return (rng.permutation(n).reshape(shape) * 0.05 - n * 0.025).astype(np.float32)


def distribution(*shape):
    p = rng.uniform(0.1, 1.0, size=shape)
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


# ---- NumPy references, written directly from the definitions (loops are fine: tiny shapes)


def ref_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def ref_log_softmax(x):
    x = x.astype(np.float64)
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def ref_softmax(x):
    return np.exp(ref_log_softmax(x))


def _geometry(size, k, stride, dilation, padding):
    span = (k - 1) * dilation + 1
    if padding == "SAME":
        out = math.ceil(size / stride)
        total = max((out - 1) * stride + span - size, 0)
        return out, total // 2
    return (size - span) // stride + 1, 0


def _pads(x_shape, k_hw, strides, padding, dilations=(1, 1)):
    _, h, w, _ = x_shape
    oh, top = _geometry(h, k_hw[0], strides[0], dilations[0], padding)
    ow, left = _geometry(w, k_hw[1], strides[1], dilations[1], padding)
    return oh, ow, top, left


def _taps(x_shape, k_hw, strides, padding, dilations=(1, 1)):
    """(i, j, a, b, row, col) for each output pixel and kernel tap that lands inside x."""
    _, h, w, _ = x_shape
    oh, ow, top, left = _pads(x_shape, k_hw, strides, padding, dilations)
    for i in range(oh):
        for j in range(ow):
            for a in range(k_hw[0]):
                for b in range(k_hw[1]):
                    row = i * strides[0] + a * dilations[0] - top
                    col = j * strides[1] + b * dilations[1] - left
                    if 0 <= row < h and 0 <= col < w:
                        yield i, j, a, b, row, col


def ref_conv(x, f, strides=(1, 1), padding="VALID", dilations=(1, 1)):
    oh, ow, _, _ = _pads(x.shape, f.shape[:2], strides, padding, dilations)
    out = np.zeros((x.shape[0], oh, ow, f.shape[3]))
    for i, j, a, b, row, col in _taps(x.shape, f.shape[:2], strides, padding, dilations):
        out[:, i, j, :] += x[:, row, col, :].astype(np.float64) @ f[a, b]
    return out


def ref_conv_backprop_input(x, f, g, strides=(1, 1), padding="VALID", dilations=(1, 1)):
    dx = np.zeros(x.shape)
    for i, j, a, b, row, col in _taps(x.shape, f.shape[:2], strides, padding, dilations):
        dx[:, row, col, :] += g[:, i, j, :].astype(np.float64) @ f[a, b].T
    return dx


def ref_conv_backprop_filter(x, f, g, strides=(1, 1), padding="VALID", dilations=(1, 1)):
    df = np.zeros(f.shape)
    for i, j, a, b, row, col in _taps(x.shape, f.shape[:2], strides, padding, dilations):
        df[a, b] += x[:, row, col, :].T.astype(np.float64) @ g[:, i, j, :]
    return df


def _windows(x, k, strides, padding):
    """{(i, j): [(row, col), ...]} — the real entries of each window, in row-major order."""
    out: dict = {}
    for i, j, _, _, row, col in _taps(x.shape, k, strides, padding):
        out.setdefault((i, j), []).append((row, col))
    return out


def ref_max_pool(x, k, strides, padding):
    oh, ow, _, _ = _pads(x.shape, k, strides, padding)
    out = np.zeros((x.shape[0], oh, ow, x.shape[3]), x.dtype)
    for (i, j), cells in _windows(x, k, strides, padding).items():
        out[:, i, j] = np.max([x[:, rr, cc] for rr, cc in cells], axis=0)
    return out


def ref_avg_pool(x, k, strides, padding):
    oh, ow, _, _ = _pads(x.shape, k, strides, padding)
    out = np.zeros((x.shape[0], oh, ow, x.shape[3]))
    for (i, j), cells in _windows(x, k, strides, padding).items():
        out[:, i, j] = np.mean([x[:, rr, cc] for rr, cc in cells], axis=0)
    return out


def _first_max(x, cells, n, c):
    best = cells[0]
    for cell in cells[1:]:
        if x[n, cell[0], cell[1], c] > x[n, best[0], best[1], c]:
            best = cell
    return best


def ref_max_pool_grad(x, g, k, strides, padding):
    dx = np.zeros(x.shape)
    for (i, j), cells in _windows(x, k, strides, padding).items():
        for n in range(x.shape[0]):
            for c in range(x.shape[3]):
                rr, cc = _first_max(x, cells, n, c)
                dx[n, rr, cc, c] += g[n, i, j, c]
    return dx


def ref_max_pool_grad_grad(x, h, k, strides, padding):
    oh, ow, _, _ = _pads(x.shape, k, strides, padding)
    out = np.zeros((x.shape[0], oh, ow, x.shape[3]))
    for (i, j), cells in _windows(x, k, strides, padding).items():
        for n in range(x.shape[0]):
            for c in range(x.shape[3]):
                rr, cc = _first_max(x, cells, n, c)
                out[n, i, j, c] = h[n, rr, cc, c]
    return out


def ref_avg_pool_grad(x, g, k, strides, padding):
    dx = np.zeros(x.shape)
    for (i, j), cells in _windows(x, k, strides, padding).items():
        for rr, cc in cells:
            dx[:, rr, cc] += g[:, i, j] / len(cells)
    return dx


# ---- builders


def grad_of(y_fn):
    """Builds d<y_fn(x), g>/dx: puts the forward op's gradient op in the case's graph."""
    return lambda x, g: fm.gradients(y_fn(x), x, grad_ys=g)[0]


def both_outputs(t):
    return [t, t.op.outputs[1]]


def conv_case(id, x, f, strides=(1, 1), padding="VALID", dilations=(1, 1), **kw):
    return OpCase(
        id,
        lambda a, b: nn.conv2d(a, b, strides, padding, dilations=dilations),
        [x, f],
        lambda a, b: ref_conv(a, b, strides, padding, dilations),
        rtol=1e-4, atol=1e-5, **kw,
    )


def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def pool_case(id, kind, x, k, s, padding):
    k, s = pair(k), pair(s)
    op, ref = (nn.max_pool, ref_max_pool) if kind == "max" else (nn.avg_pool, ref_avg_pool)
    return OpCase(id, lambda a: op(a, k, s, padding), [x], lambda a: ref(a, k, s, padding))


X_POOL = distinct(2, 5, 6, 2)
G_POOL_SAME = r(2, 3, 3, 2)  # 3x3 windows, stride 2, SAME on 5x6
tie = np.zeros((1, 4, 4, 1), np.float32)
tie[0, 1, 1, 0] = tie[0, 0, 3, 0] = -1.0  # windows of zeros and a few lower entries


CASES = [
    # activations
    OpCase("relu", nn.relu, [off_zero(3, 4)], lambda x: np.maximum(x, 0)),
    OpCase("relu_int", nn.relu, [np.array([-2, 0, 3], np.int32)], lambda x: np.maximum(x, 0),
           grad=False),
    OpCase("sigmoid", nn.sigmoid, [r(3, 4, low=-6, high=6)], ref_sigmoid),
    OpCase("tanh", nn.tanh, [r(3, 4)], np.tanh),
    OpCase("relu_grad_of_relu", grad_of(nn.relu), [off_zero(3, 4), r(3, 4)],
           lambda x, g: g * (x > 0), wrt=[1]),
    OpCase("relu_grad", nn.relu_grad, [r(2, 5), off_zero(2, 5)],
           lambda g, y: g * (y > 0), wrt=[0]),
    OpCase("sigmoid_grad_of_sigmoid", grad_of(nn.sigmoid), [r(3, 4), r(3, 4)],
           lambda x, g: g * ref_sigmoid(x) * (1 - ref_sigmoid(x))),
    OpCase("sigmoid_grad", nn.sigmoid_grad, [r(2, 5, low=0, high=1), r(2, 5)],
           lambda y, g: g * y * (1 - y)),
    OpCase("tanh_grad_of_tanh", grad_of(nn.tanh), [r(3, 4), r(3, 4)],
           lambda x, g: g * (1 - np.tanh(x) ** 2)),
    OpCase("tanh_grad", nn.tanh_grad, [r(2, 5, low=-1, high=1), r(2, 5)],
           lambda y, g: g * (1 - y * y)),
    # bias
    OpCase("bias_add_2d", nn.bias_add, [r(3, 4), r(4)], lambda x, b: x + b),
    OpCase("bias_add_4d", nn.bias_add, [r(2, 3, 2, 4), r(4)], lambda x, b: x + b),
    OpCase("bias_add_grad", nn.bias_add_grad, [r(2, 3, 4)], lambda g: g.sum((0, 1))),
    # softmax family
    OpCase("softmax", nn.softmax, [r(3, 5)], ref_softmax),
    OpCase("softmax_3d", nn.softmax, [r(2, 3, 4)], ref_softmax),
    OpCase("softmax_large_logits", nn.softmax, [r(2, 4) * 10 + 1000], ref_softmax, grad=False),
    OpCase("log_softmax", nn.log_softmax, [r(3, 5)], ref_log_softmax),
    OpCase("log_softmax_large_logits", nn.log_softmax, [r(2, 4) * 10 - 1000], ref_log_softmax,
           grad=False, rtol=1e-4),
    OpCase(
        "xent_both_outputs",
        lambda logits, labels: both_outputs(
            nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        ),
        [r(4, 5), distribution(4, 5)],
        lambda lg, lb: [-(lb * ref_log_softmax(lg)).sum(-1), ref_softmax(lg) - lb],
    ),
    OpCase(
        "xent_loss",
        lambda logits, labels: nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits),
        [r(2, 3, 4), distribution(2, 3, 4)],
        lambda lg, lb: -(lb * ref_log_softmax(lg)).sum(-1),
    ),
    OpCase(
        "xent_second_derivative",
        lambda logits, labels: fm.gradients(
            fm.reduce_sum(nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)),
            logits,
        )[0],
        [r(3, 4), distribution(3, 4)],
        lambda lg, lb: ref_softmax(lg) - lb,
    ),
    OpCase(
        "sparse_xent_both_outputs",
        lambda logits, labels: both_outputs(
            nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        ),
        [r(4, 5), np.array([0, 4, 2, 2], np.int32)],
        lambda lg, lb: [
            -ref_log_softmax(lg)[np.arange(4), lb],
            ref_softmax(lg) - np.eye(5)[lb],
        ],
    ),
    OpCase(
        "sparse_xent_loss_int64_3d",
        lambda logits, labels: nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits
        ),
        [r(2, 3, 4), np.array([[0, 3, 1], [2, 2, 0]], np.int64)],
        lambda lg, lb: -np.take_along_axis(ref_log_softmax(lg), lb[..., None], -1)[..., 0],
    ),
    OpCase("l2_loss", nn.l2_loss, [r(3, 4)], lambda x: np.sum(x.astype(np.float64) ** 2) / 2,
           rtol=1e-5),
    # convolution
    conv_case("conv_valid", r(2, 5, 5, 2), r(3, 3, 2, 3)),
    conv_case("conv_same_stride2", r(2, 6, 5, 2), r(3, 2, 2, 3), (2, 2), "SAME"),
    conv_case("conv_same_uneven_pad", r(1, 4, 4, 1), r(4, 4, 1, 2), (1, 1), "SAME"),
    conv_case("conv_valid_strides_12", r(1, 7, 6, 2), r(2, 3, 2, 2), (1, 2), "VALID"),
    conv_case("conv_dilated_same", r(1, 6, 6, 2), r(2, 2, 2, 2), (1, 1), "SAME", (2, 2)),
    conv_case("conv_long_rows_stride2", r(2, 5, 9, 1), r(3, 2, 1, 2), (2, 2), "SAME"),
    conv_case("conv_pointwise", r(2, 3, 4, 3), r(1, 1, 3, 2)),
    conv_case("conv_pointwise_stride2", r(1, 5, 5, 2), r(1, 1, 2, 2), (2, 2), "SAME"),
    OpCase(
        "conv_backprop_input",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, (2, 2), "SAME"),
        [r(1, 5, 5, 2), r(3, 3, 2, 3), r(1, 3, 3, 3)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (2, 2), "SAME"),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_input_dilated_valid",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, 1, "VALID", dilations=2),
        [r(1, 6, 5, 1), r(2, 2, 1, 2), r(1, 4, 3, 2)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (1, 1), "VALID", (2, 2)),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_input_many_channels",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, 1, "SAME"),
        [r(2, 4, 3, 4), r(2, 2, 4, 2), r(2, 4, 3, 2)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (1, 1), "SAME"),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    # Stride 1 with more channels than output columns: a transposed convolution.
    OpCase(
        "conv_backprop_input_many_channels_uneven_pad",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, 1, "SAME"),
        [r(2, 4, 3, 5), r(2, 3, 5, 2), r(2, 4, 3, 2)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (1, 1), "SAME"),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_input_many_channels_dilated_valid",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, 1, "VALID", dilations=2),
        [r(1, 6, 5, 6), r(2, 2, 6, 2), r(1, 4, 3, 2)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (1, 1), "VALID", (2, 2)),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    # Strided, with more channels than output columns: a matmul per tap, added in place.
    OpCase(
        "conv_backprop_input_many_channels_stride2",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, (2, 2), "SAME"),
        [r(2, 5, 5, 4), r(3, 3, 4, 2), r(2, 3, 3, 2)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (2, 2), "SAME"),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_input_pointwise",
        lambda x, f, g: nn.conv2d_backprop_input(x, f, g, 1, "SAME"),
        [r(2, 3, 3, 2), r(1, 1, 2, 3), r(2, 3, 3, 3)],
        lambda x, f, g: ref_conv_backprop_input(x, f, g, (1, 1), "SAME"),
        wrt=[1, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_filter",
        lambda x, f, g: nn.conv2d_backprop_filter(x, f, g, (1, 2), "SAME"),
        [r(2, 4, 5, 2), r(3, 2, 2, 3), r(2, 4, 3, 3)],
        lambda x, f, g: ref_conv_backprop_filter(x, f, g, (1, 2), "SAME"),
        wrt=[0, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_filter_long_rows",
        lambda x, f, g: nn.conv2d_backprop_filter(x, f, g, 1, "SAME", dilations=(1, 2)),
        [r(1, 4, 7, 1), r(2, 2, 1, 2), r(1, 4, 7, 2)],
        lambda x, f, g: ref_conv_backprop_filter(x, f, g, (1, 1), "SAME", (1, 2)),
        wrt=[0, 2], rtol=1e-4, atol=1e-5,
    ),
    OpCase(
        "conv_backprop_filter_pointwise",
        lambda x, f, g: nn.conv2d_backprop_filter(x, f, g, 1, "VALID"),
        [r(2, 3, 3, 2), r(1, 1, 2, 3), r(2, 3, 3, 3)],
        lambda x, f, g: ref_conv_backprop_filter(x, f, g),
        wrt=[0, 2], rtol=1e-4, atol=1e-5,
    ),
    # pooling
    pool_case("max_pool_valid_2x2", "max", X_POOL, 2, 2, "VALID"),
    pool_case("max_pool_same_3x3_s2", "max", X_POOL, 3, 2, "SAME"),
    pool_case("max_pool_same_2x3_s1", "max", X_POOL, (2, 3), 1, "SAME"),
    OpCase("max_pool_int_same", lambda x: nn.max_pool(x, 2, 2, "SAME"),
           [rng.integers(-50, 50, size=(1, 3, 5, 2)).astype(np.int32)],
           lambda x: ref_max_pool(x, (2, 2), (2, 2), "SAME"), grad=False),
    pool_case("avg_pool_valid_2x2", "avg", r(2, 4, 6, 2), 2, 2, "VALID"),
    pool_case("avg_pool_same_3x3_s2", "avg", r(2, 5, 6, 2), 3, 2, "SAME"),
    pool_case("avg_pool_same_2x2_s1", "avg", r(1, 3, 4, 2), 2, 1, "SAME"),
    OpCase(
        "max_pool_grad",
        lambda x, g: nn.max_pool_grad(x, nn.max_pool(x, 3, 2, "SAME"), g, 3, 2, "SAME"),
        [X_POOL, G_POOL_SAME],
        lambda x, g: ref_max_pool_grad(x, g, (3, 3), (2, 2), "SAME"),
        wrt=[1],
    ),
    OpCase(
        "max_pool_grad_nonoverlapping",
        lambda x, g: nn.max_pool_grad(x, nn.max_pool(x, 2, 2, "SAME"), g, 2, 2, "SAME"),
        [X_POOL, r(2, 3, 3, 2)],
        lambda x, g: ref_max_pool_grad(x, g, (2, 2), (2, 2), "SAME"),
        wrt=[1],
    ),
    OpCase(
        "max_pool_grad_ties_go_to_first",
        lambda x, g: nn.max_pool_grad(x, nn.max_pool(x, 2, 1, "VALID"), g, 2, 1, "VALID"),
        [tie, r(1, 3, 3, 1)],
        lambda x, g: ref_max_pool_grad(x, g, (2, 2), (1, 1), "VALID"),
        grad=False,
    ),
    OpCase(
        "max_pool_grad_grad",
        lambda x, h: nn.max_pool_grad_grad(x, nn.max_pool(x, 3, 2, "SAME"), h, 3, 2, "SAME"),
        [X_POOL, r(*X_POOL.shape)],
        lambda x, h: ref_max_pool_grad_grad(x, h, (3, 3), (2, 2), "SAME"),
        wrt=[1],
    ),
    OpCase(
        "avg_pool_grad",
        lambda x, g: nn.avg_pool_grad(x, g, 3, 2, "SAME"),
        [r(2, 5, 6, 2), r(2, 3, 3, 2)],
        lambda x, g: ref_avg_pool_grad(x, g, (3, 3), (2, 2), "SAME"),
        wrt=[1],
    ),
    OpCase(
        "avg_pool_grad_valid",
        lambda x, g: nn.avg_pool_grad(x, g, 2, 2, "VALID"),
        [r(1, 5, 4, 2), r(1, 2, 2, 2)],
        lambda x, g: ref_avg_pool_grad(x, g, (2, 2), (2, 2), "VALID"),
        wrt=[1],
    ),
]


test_forward, test_gradient = case_tests(CASES)


# ---- shapes, errors and edge cases


def _build_error(fn) -> str:
    with fm.Graph().as_default(), pytest.raises(fm.GraphError) as info:
        fn()
    return str(info.value)


def test_conv_checks_channels_and_names_shapes():
    msg = _build_error(
        lambda: nn.conv2d(
            fm.placeholder(fm.float32, (None, 8, 8, 3)),
            fm.placeholder(fm.float32, (3, 3, 4, 16)),
            1, "SAME",
        )
    )
    assert "Conv2D" in msg and "(?, 8, 8, 3)" in msg and "(3, 3, 4, 16)" in msg


def test_conv_checks_rank_padding_and_fit():
    x4 = lambda: fm.placeholder(fm.float32, (1, 4, 4, 1))  # noqa: E731
    f = lambda k: fm.placeholder(fm.float32, (k, k, 1, 1))  # noqa: E731
    assert "rank 4" in _build_error(
        lambda: nn.conv2d(fm.placeholder(fm.float32, (4, 4, 1)), f(3), 1, "SAME")
    )
    assert "does not fit" in _build_error(lambda: nn.conv2d(x4(), f(5), 1, "VALID"))
    assert "padding" in _build_error(lambda: nn.conv2d(x4(), f(3), 1, "FULL"))
    assert "batch and channel" in _build_error(lambda: nn.conv2d(x4(), f(3), (2, 1, 1, 1), "SAME"))


def test_pool_and_softmax_shape_errors():
    assert "rank 4" in _build_error(
        lambda: nn.max_pool(fm.placeholder(fm.float32, (4, 4)), 2, 2, "VALID")
    )
    assert "same shape" in _build_error(
        lambda: nn.softmax_cross_entropy_with_logits(
            labels=fm.placeholder(fm.float32, (2, 3)), logits=fm.placeholder(fm.float32, (2, 4))
        )
    )
    assert "integer" in _build_error(
        lambda: nn.sparse_softmax_cross_entropy_with_logits(
            labels=fm.placeholder(fm.float32, (2,)), logits=fm.placeholder(fm.float32, (2, 4))
        )
    )
    assert "bias" in _build_error(
        lambda: nn.bias_add(fm.placeholder(fm.float32, (2, 3)), fm.placeholder(fm.float32, (4,)))
    )


def test_unknown_batch_and_spatial_dims():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, None, None, 2))
        f = fm.placeholder(fm.float32, (3, 3, 2, 4))
        y = nn.max_pool(nn.relu(nn.conv2d(x, f, 2, "SAME")), 2, 2, "SAME")
        assert y.shape == (None, None, None, 4)
        gx, gf = fm.gradients(fm.reduce_sum(y), [x, f])
        assert gx.shape == (None, None, None, 2) and gf.shape == (3, 3, 2, 4)
        fixed = fm.placeholder(fm.float32, (None, 9, 7, 2))
        assert nn.avg_pool(nn.conv2d(fixed, f, 2, "SAME"), 2, 2, "VALID").shape == (None, 2, 2, 4)
    fv = r(3, 3, 2, 4)
    with fm.Session(g) as sess:
        for shape in [(1, 6, 6, 2), (3, 9, 7, 2)]:
            xv = r(*shape)
            want = ref_max_pool(np.maximum(ref_conv(xv, fv, (2, 2), "SAME"), 0), (2, 2), (2, 2),
                                "SAME")
            got, dx = sess.run([y, gx], {x: xv, f: fv})
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            assert dx.shape == shape


def test_max_pool_ties_route_to_first_max():
    x = np.ones((1, 2, 2, 1), np.float32)
    g = fm.Graph()
    with g.as_default():
        px = fm.placeholder(fm.float32, x.shape)
        (dx,) = fm.gradients(nn.max_pool(px, 2, 2, "VALID"), [px])
    with fm.Session(g) as sess:
        got = sess.run(dx, {px: x})
    np.testing.assert_array_equal(got[0, :, :, 0], [[1, 0], [0, 0]])


def test_sparse_xent_rejects_out_of_range_labels():
    g = fm.Graph()
    with g.as_default():
        logits = fm.placeholder(fm.float32, (2, 3))
        labels = fm.placeholder(fm.int32, (2,))
        loss = nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    with fm.Session(g) as sess, pytest.raises(ValueError, match=r"label value 3 .*\[0, 3\)"):
        sess.run(loss, {logits: r(2, 3), labels: np.array([0, 3], np.int32)})


def test_sigmoid_saturates_quietly_and_precisely():
    x = np.array([-200.0, -30.0, 0.0, 30.0, 200.0], np.float32)
    g = fm.Graph()
    with g.as_default():
        px = fm.placeholder(fm.float32, x.shape)
        y = nn.sigmoid(px)
    with fm.Session(g) as sess, warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sess.run(y, {px: x})
    np.testing.assert_allclose(got, ref_sigmoid(x).astype(np.float32), rtol=1e-6, atol=0)


def test_bias_add_rejects_mismatch_at_run_time():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, (2, None))
        b = fm.placeholder(fm.float32, (None,))
        y = nn.bias_add(x, b)
    with fm.Session(g) as sess, pytest.raises(ValueError, match="bias of shape"):
        sess.run(y, {x: r(2, 3), b: r(1)})


def test_dropout_keeps_expectation_and_routes_gradient():
    g = fm.Graph(seed=3)
    with g.as_default():
        x = fm.placeholder(fm.float32, (2000,))
        y = nn.dropout(x, 0.25)
        (dx,) = fm.gradients(fm.reduce_sum(y), [x])
        same = nn.dropout(x, 0.0)
    assert same is x
    with fm.Session(g) as sess:
        got, grad = sess.run([y, dx], {x: np.ones(2000, np.float32)})
    kept = got != 0
    np.testing.assert_allclose(got[kept], 1 / 0.75, rtol=1e-6)
    assert 0.70 < kept.mean() < 0.80
    np.testing.assert_array_equal(grad, got)  # d(sum(x * mask))/dx = mask, and x is ones


def test_dropout_noise_shape_broadcasts_and_unknown_batch_works():
    g = fm.Graph(seed=5)
    with g.as_default():
        x = fm.placeholder(fm.float32, (4, 50))
        y = nn.dropout(x, 0.5, noise_shape=(1, 50))
        batch = fm.placeholder(fm.float32, (None, 50))
        z = nn.dropout(batch, 0.5)
        assert z.shape == (None, 50)
        with pytest.raises(ValueError, match="unknown dims"):
            nn.dropout(x, 0.5, noise_shape=(None, 50))
        with pytest.raises(ValueError, match="rate"):
            nn.dropout(x, 1.0)
    with fm.Session(g) as sess:
        got, rows = sess.run([y, z], {x: np.ones((4, 50), np.float32),
                                      batch: np.ones((3, 50), np.float32)})
    assert (got == got[0]).all() and 0 < (got[0] != 0).sum() < 50
    assert rows.shape == (3, 50) and set(np.unique(rows)) <= {0.0, 2.0}
