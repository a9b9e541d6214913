"""Softmax cross-entropy on a GPU in four launches (``nn``'s kernels take it from here).

Op by op, the loss and its backprop cost a launch per array operation: ten for dense
labels, eighteen for sparse ones (the gather and scatter at the labels, the masks for
labels out of range). ``cupy.fuse`` compiles a function into one kernel holding elementwise
work and at most one reduction (with elementwise work on the reduced value alone after
it), so the fewest launches it allows are one per reduction the math needs, plus one for
the elementwise backprop:

1. the row maximum ``m`` (a reduction);
2. ``s = sum(exp(x - m))`` over the row (elementwise, then the reduction);
3. the loss row, ``sum(labels * (log(s) - (x - m)))``: dense labels weigh every column,
   a sparse label picks its column by comparing it with the column numbers (no gather:
   a fused kernel cannot index), and a label out of range makes the row NaN;
4. the backprop, ``exp(x - m) / s - labels`` (the label's column one for sparse labels).

Each term is computed as the CPU kernel computes it (the same operations in the same
order; the log of ``s`` per element rather than per row, which gives the same value), so
results agree with the CPU's to the rounding of the device's own exp, log and sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType, SimpleNamespace


@functools.cache
def fused(xp: ModuleType) -> SimpleNamespace:
    """The fused functions over ``xp``, made once per array module: ``cupy.fuse`` caches a
    compiled kernel per function object."""

    def sum_exp(x, m):
        return xp.sum(xp.exp(x - m), axis=-1)

    def dense_loss(x, m, s, labels):
        return xp.sum((xp.log(s) - (x - m)) * labels, axis=-1)

    def dense_backprop(x, m, s, labels):
        return xp.exp(x - m) / s - labels

    def sparse_loss(x, m, s, label, column, classes):
        picked = xp.where(column == label, xp.log(s) - (x - m), 0)
        return xp.sum(xp.where((label < 0) | (label >= classes), xp.nan, picked), axis=-1)

    def sparse_backprop(x, m, s, label, column, classes):
        backprop = xp.exp(x - m) / s - (column == label)
        return xp.where((label < 0) | (label >= classes), xp.nan, backprop)

    return SimpleNamespace(**{f.__name__: xp.fuse(f) for f in (
        sum_exp, dense_loss, dense_backprop, sparse_loss, sparse_backprop)})


def dense(xp: ModuleType) -> Callable:
    """``(logits, labels) -> (loss, backprop)`` for labels of the logits' shape."""
    f = fused(xp)

    def fn(logits, labels):
        m = logits.max(axis=-1, keepdims=True)
        s = f.sum_exp(logits, m)[..., None]
        return f.dense_loss(logits, m, s, labels), f.dense_backprop(logits, m, s, labels)

    return fn


def sparse(xp: ModuleType) -> Callable:
    """``(logits, labels) -> (loss, backprop)`` for class numbers; the column numbers a
    label is compared with are made once per class count and kept on the device."""
    f = fused(xp)
    columns: dict = {}

    def fn(logits, labels):
        c = logits.shape[-1]
        column = columns.get((c, labels.dtype))
        if column is None:
            column = columns[(c, labels.dtype)] = xp.arange(c, dtype=labels.dtype)
        m = logits.max(axis=-1, keepdims=True)
        s = f.sum_exp(logits, m)[..., None]
        label = labels[..., None]
        return (f.sparse_loss(logits, m, s, label, column, c),
                f.sparse_backprop(logits, m, s, label, column, c))

    return fn
