"""The convolution and pooling kernels walk a CPU batch a chunk of images at a time
(``kernels/nn.py``, ``_chunks``); the op cases of ``test_ops_nn`` (batches of one or two
images) fit in one chunk, so here they run again with one image per chunk: the chunked
paths must compute what the reference functions and numerical gradients say."""

from __future__ import annotations

import numpy
import pytest
from test_ops_nn import CASES

from flowmill.kernels import nn as nn_kernels

from opcheck import check_forward, check_grads

CHUNKED = [c for c in CASES if c.id.startswith(("conv", "max_pool"))]


@pytest.fixture(autouse=True)
def one_image_per_chunk(monkeypatch):
    monkeypatch.setattr(nn_kernels, "CHUNK_BYTES", 1)


@pytest.mark.parametrize("case", CHUNKED, ids=repr)
def test_forward_one_image_per_chunk(case):
    check_forward(case)


@pytest.mark.parametrize("case", [c for c in CHUNKED if c.grad], ids=repr)
def test_gradient_one_image_per_chunk(case):
    check_grads(case)


def test_chunks_cover_the_batch_in_order(monkeypatch):
    monkeypatch.setattr(nn_kernels, "CHUNK_BYTES", 10)
    assert nn_kernels._chunks(numpy, 15, 4) == [slice(i, min(i + 2, 15)) for i in range(0, 15, 2)]
    assert nn_kernels._chunks(numpy, 5, 100) == [slice(i, i + 1) for i in range(5)]
    assert nn_kernels._chunks(numpy, 5, 8) == [slice(0, 5)]  # 40 bytes: 4 chunks or fewer
    assert nn_kernels._chunks(object(), 5, 4) == [slice(0, 5)]  # off the CPU: whole


def _first_max_reference(x, g, k):
    """MaxPoolGrad by its definition: each window's gradient to its first maximum in
    row-major order (``k`` x ``k`` windows, stride ``k``, SAME padding)."""
    n, h, w, c = x.shape
    dx = numpy.zeros_like(x)
    for b, i, j, ch in numpy.ndindex(n, -(-h // k), -(-w // k), c):
        window = x[b, i * k:(i + 1) * k, j * k:(j + 1) * k, ch]
        if numpy.isnan(window).any():
            continue  # no entry equals a NaN maximum
        r, s = numpy.unravel_index(numpy.argmax(window), window.shape)
        dx[b, i * k + r, j * k + s, ch] = g[b, i, j, ch]
    return dx


@pytest.mark.parametrize("shape", [(6, 4, 6, 3), (5, 5, 7, 2)])  # the second is padded
@pytest.mark.parametrize("inputs", ["distinct", "ties_later", "nan"])
def test_max_pool_grad_routes_to_the_first_maximum(monkeypatch, shape, inputs):
    """Windows that tile the input take one pass per chunk when each holds its maximum
    once; a chunk with a tie or a NaN goes offset by offset. Both give the definition's
    answer, chunk by chunk."""
    from flowmill.kernels.registry import KernelContext, get_builder

    routed = []  # per chunk: one pass (True) or offset by offset (False)
    one_pass = nn_kernels._route_unique_maxima
    monkeypatch.setattr(nn_kernels, "_route_unique_maxima",
                        lambda *a: routed.append(one_pass(*a)) or routed[-1])
    rng = numpy.random.default_rng(1)
    x = rng.standard_normal(shape).astype(numpy.float32)
    if inputs == "ties_later":
        x[3:] = numpy.maximum(numpy.round(x[3:]), 0)  # a ReLU's zeros, from the second chunk
    elif inputs == "nan":
        x[1, 0, 0, 0] = numpy.nan
    attrs = {"ksize": (1, 2, 2, 1), "strides": (1, 2, 2, 1), "padding": "SAME"}

    def run(op, *args):
        return get_builder(op, "CPU")(KernelContext(op, op, attrs, "CPU", None))(*args)

    y = run("MaxPool", x)
    g = rng.standard_normal(y.shape).astype(numpy.float32)
    numpy.testing.assert_array_equal(run("MaxPoolGrad", x, y, g), _first_max_reference(x, g, 2))
    # One image a chunk; after the first chunk with a tie the rest go offset by offset.
    assert routed == {"distinct": [True] * shape[0], "ties_later": [True] * 3 + [False],
                      "nan": [True, False]}[inputs]
