"""Sampled softmax (Jean et al., 2015), as TensorFlow's ``tf.nn.sampled_softmax_loss``.

A softmax over a large vocabulary costs ``batch x vocabulary`` per step in the output
layer alone. The sampled loss scores each example's true classes and a few classes
sampled for the whole batch (``log_uniform_candidate_sampler`` by default), corrects
every logit by the log of its expected count (so the estimate of the full softmax is
right in expectation), and takes the softmax cross-entropy over those columns only.

Only the true and sampled rows of the output weights and biases are read, through
``embedding_lookup``: the step's cost does not depend on the vocabulary size, the
gradient of a Variable's weights is an ``IndexedSlices`` of those rows (so optimizers
update only them), and the weights may be a list of shards on several PS tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowmill.kernels import shapes

from . import dtypes
from .embedding import embedding_lookup
from .graph import GraphError, Tensor, convert_to_tensor
from .ops.array_ops import (
    concat,
    expand_dims,
    ones_like,
    reshape,
    split,
    stop_gradient,
    zeros_like,
)
from .ops.candidate_sampling_ops import log_uniform_candidate_sampler
from .ops.math_ops import cast, equal, log, matmul, reduce_max, reduce_sum
from .ops.nn_ops import (
    softmax_cross_entropy_with_logits,
    sparse_softmax_cross_entropy_with_logits,
)
from .ops.state_ops import Variable

# What TensorFlow adds to the logit of a sampled class that is also a true class of the
# example (an "accidental hit"), so that its softmax weight is zero.
_ACCIDENTAL_HIT = float(-np.finfo(np.float32).max)


def sampled_softmax_loss(
    weights,
    biases,
    labels,
    inputs,
    num_sampled: int,
    num_classes: int,
    num_true: int = 1,
    sampled_values=None,
    remove_accidental_hits: bool = True,
    partition_strategy: str = "mod",
    name: str = "sampled_softmax_loss",
    seed: int | None = None,
) -> Tensor:
    """Per-example sampled softmax cross-entropy, shape ``[batch_size]``; for training only
    (evaluate with the full softmax).

    ``weights``: ``[num_classes, dim]`` (a Variable, a tensor, or a list of row shards as
    ``embedding_lookup`` takes them); ``biases``: ``[num_classes]`` (likewise);
    ``labels``: ``[batch_size, num_true]`` integer classes; ``inputs``: ``[batch_size,
    dim]``. ``sampled_values``: a ``(sampled_candidates, true_expected_count,
    sampled_expected_count)`` triple as a candidate sampler returns it; by default
    ``log_uniform_candidate_sampler(labels, num_true, num_sampled, True, num_classes,
    seed)``, which fits classes numbered by decreasing frequency. With
    ``remove_accidental_hits`` a sampled class that is one of an example's true classes
    is left out of that example's softmax.
    """
    inputs = convert_to_tensor(inputs)
    graph = inputs.graph
    with graph.as_default(), graph.name_scope(name):
        logits, targets = _sampled_logits(
            weights, biases, labels, inputs, num_sampled, num_classes, num_true,
            sampled_values, remove_accidental_hits, partition_strategy, seed,
        )
        if num_true == 1:  # the target is column 0: no target matrix to build or read
            first = zeros_like(reshape(convert_to_tensor(labels), (-1,)))
            return sparse_softmax_cross_entropy_with_logits(labels=first, logits=logits)
        return softmax_cross_entropy_with_logits(labels=stop_gradient(targets), logits=logits)


def _sampled_logits(
    weights, biases, labels, inputs: Tensor, num_sampled: int, num_classes: int,
    num_true: int, sampled_values, remove_accidental_hits: bool, partition_strategy: str,
    seed: int | None,
) -> tuple[Tensor, Tensor]:
    """(logits, target distribution), both ``[batch_size, num_true + num_sampled]``: the
    true classes' columns first, each target ``1 / num_true``, then the sampled ones."""
    what = "sampled_softmax_loss"
    if isinstance(num_sampled, bool) or not isinstance(num_sampled, int) or num_sampled < 1:
        raise ValueError(f"{what}: num_sampled must be a positive int, got {num_sampled!r}")
    if isinstance(num_true, bool) or not isinstance(num_true, int) or num_true < 1:
        raise ValueError(f"{what}: num_true must be a positive int, got {num_true!r}")
    if inputs.dtype.kind != "f":
        raise TypeError(f"{what}: inputs {inputs.name} must be floating point, are {inputs.dtype}")
    if inputs.shape is not None and len(inputs.shape) != 2:
        raise GraphError(
            f"{what}: inputs must be [batch_size, dim], {inputs.name} has shape "
            f"{shapes.fmt(inputs.shape)}"
        )
    labels = _labels(labels, num_true, inputs, what)
    weights, biases = _shards(weights), _shards(biases)
    dim = _check_rows(weights, inputs, what)
    if sampled_values is None:
        sampled_values = log_uniform_candidate_sampler(
            labels, num_true, num_sampled, True, num_classes, seed=seed
        )
    sampled, true_expected, sampled_expected = _sampled(sampled_values, num_sampled, what)
    dtype = inputs.dtype

    # One lookup for the true and sampled rows together: one Part/Gather/Stitch per shard.
    all_ids = concat([reshape(labels, (-1,)), sampled], 0)
    all_w = embedding_lookup(weights, all_ids, partition_strategy, name="weights")
    all_b = embedding_lookup(biases, all_ids, partition_strategy, name="biases")
    # Split, not two slices: its gradient is one Concat, not two zero-filled copies summed.
    true_w, sampled_w = split(all_w, [-1, num_sampled], 0)
    true_b, sampled_b = split(all_b, [-1, num_sampled], 0)

    # Each example against its own true rows: [batch, 1, dim] * [batch, num_true, dim].
    true_rows = reshape(true_w, (-1, num_true, dim))
    true_logits = reduce_sum(expand_dims(inputs, 1) * true_rows, axis=-1)
    true_logits = true_logits + reshape(true_b, (-1, num_true))
    # Every example against the shared sampled rows: [batch, num_sampled].
    sampled_logits = matmul(inputs, sampled_w, transpose_b=True) + sampled_b

    if remove_accidental_hits:
        same = equal(expand_dims(labels, -1), reshape(sampled, (1, 1, num_sampled)))
        hit = reduce_max(cast(same, dtype), axis=1)  # [batch, num_sampled]: 1 for a hit
        sampled_logits = sampled_logits + hit * _ACCIDENTAL_HIT
    # Subtract log Q: the logits of the sampled softmax estimate the full one's.
    true_logits = true_logits - log(cast(true_expected, dtype))
    sampled_logits = sampled_logits - log(cast(sampled_expected, dtype))

    logits = concat([true_logits, sampled_logits], 1)
    targets = concat([ones_like(true_logits) / float(num_true), zeros_like(sampled_logits)], 1)
    return logits, targets


def _labels(labels, num_true: int, inputs: Tensor, what: str) -> Tensor:
    labels = convert_to_tensor(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"{what}: labels {labels.name} must be integer classes, are {labels.dtype}")
    want = (None if inputs.shape is None else inputs.shape[0], num_true)
    if not shapes.compatible(labels.shape, want):
        raise GraphError(
            f"{what}: labels must be [batch_size, num_true] = {shapes.fmt(want)}, "
            f"{labels.name} has shape {shapes.fmt(labels.shape)}"
        )
    return labels if labels.dtype == dtypes.int64 else cast(labels, dtypes.int64)


def _shards(params) -> list[Tensor | Variable]:
    """A table, or its row shards, as a list of Variables and tensors."""
    shards = list(params) if isinstance(params, (list, tuple)) else [params]
    return [p if isinstance(p, (Tensor, Variable)) else convert_to_tensor(p) for p in shards]


def _check_rows(shards: list, inputs: Tensor, what: str) -> int:
    """The embedding dim, which the weights' rows and the inputs must agree on."""
    rows = set()
    for s in shards:
        shape = s.shape
        if shape is None or len(shape) != 2:
            raise GraphError(
                f"{what}: weights must be [num_classes, dim] (or row shards of it), have "
                f"shape {shapes.fmt(shape)}"
            )
        rows.add(shape[1])
    dims = rows | ({inputs.shape[1]} if inputs.shape is not None else set())
    dims.discard(None)
    if len(dims) != 1:
        raise GraphError(
            f"{what}: inputs {inputs.name} {shapes.fmt(inputs.shape)} and the weights' rows "
            f"({sorted(rows, key=str)}) must have one known dim"
        )
    return dims.pop()


def _sampled(sampled_values: Sequence, num_sampled: int, what: str) -> list[Tensor]:
    """The sampler's triple as constants of the step: no gradient flows into a sampler."""
    if not isinstance(sampled_values, (list, tuple)) or len(sampled_values) != 3:
        raise TypeError(
            f"{what}: sampled_values must be (sampled_candidates, true_expected_count, "
            "sampled_expected_count)"
        )
    sampled, true_expected, sampled_expected = (
        stop_gradient(convert_to_tensor(v)) for v in sampled_values
    )
    if sampled.dtype.kind not in "iu":
        raise TypeError(f"{what}: sampled candidates {sampled.name} are {sampled.dtype}")
    if not shapes.compatible(sampled.shape, (num_sampled,)):
        raise GraphError(
            f"{what}: sampled candidates must have shape ({num_sampled},), "
            f"{sampled.name} has {shapes.fmt(sampled.shape)}"
        )
    if sampled.dtype != dtypes.int64:
        sampled = cast(sampled, dtypes.int64)
    return [sampled, true_expected, sampled_expected]
