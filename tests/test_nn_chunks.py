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
