"""The log-uniform candidate sampler (TensorFlow's ``LogUniformCandidateSampler``): the
classes a sampled loss scores besides the true ones, and how often each was expected to
come up, which the loss corrects for. The sampling and its arithmetic are in
``flowmill.kernels.candidate_sampling``; seeds follow the random ops (``random_ops``).
"""

from __future__ import annotations

import numbers

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Tensor, convert_to_tensor
from ..op_def import define_op
from .math_ops import cast
from .random_ops import get_seed


def _positive_int(value, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ShapeError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


@define_op(
    "LogUniformCandidateSampler",
    attrs={
        "num_true": None, "num_sampled": None, "unique": None, "range_max": None,
        "seed": None, "seed2": None,
    },
    num_inputs=1,
    stateful=True,
    differentiable=False,
)
def _log_uniform_shape(inputs, attrs):
    (true_classes,) = inputs
    num_true = _positive_int(attrs["num_true"], "num_true", 1)
    num_sampled = _positive_int(attrs["num_sampled"], "num_sampled", 0)
    range_max = _positive_int(attrs["range_max"], "range_max", 1)
    if not isinstance(attrs["unique"], bool):
        raise ShapeError(f"unique must be a bool, got {attrs['unique']!r}")
    if attrs["unique"] and num_sampled > range_max:
        raise ShapeError(
            f"cannot sample {num_sampled} unique classes from {range_max} (range_max)"
        )
    if true_classes.dtype != dtypes.int64:
        raise ShapeError(f"true_classes must be int64, {true_classes.name} is {true_classes.dtype}")
    want = (None, num_true)
    if not shapes.compatible(true_classes.shape, want):
        raise ShapeError(
            f"true_classes must be [batch_size, num_true={num_true}], has shape "
            f"{shapes.fmt(true_classes.shape)}"
        )
    true_shape = shapes.merge(true_classes.shape, want)
    return [
        (dtypes.int64, (num_sampled,)),
        (dtypes.float32, true_shape),
        (dtypes.float32, (num_sampled,)),
    ]


def _as_int(value):
    """NumPy integers as Python ints; anything else is left for the shape function to refuse."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def log_uniform_candidate_sampler(
    true_classes, num_true: int, num_sampled: int, unique: bool, range_max: int,
    seed: int | None = None, name=None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Draw ``num_sampled`` classes of ``[0, range_max)`` with P(v) proportional to
    ``log((v + 2) / (v + 1))`` (Zipfian: for a vocabulary sorted by decreasing frequency),
    without repeats when ``unique``.

    Returns ``(sampled_candidates, true_expected_count, sampled_expected_count)``: int64
    ``[num_sampled]``, float32 ``[batch_size, num_true]`` and ``[num_sampled]``; an expected
    count is how many times the sampler was expected to draw that class in this batch.
    ``true_classes`` is ``[batch_size, num_true]``, int64 (other integers are cast).
    """
    true_classes = convert_to_tensor(true_classes)
    if true_classes.dtype.kind not in "iu":
        raise TypeError(
            f"log_uniform_candidate_sampler: true_classes {true_classes.name} must be "
            f"integer class ids, are {true_classes.dtype}"
        )
    if true_classes.dtype != dtypes.int64:
        true_classes = cast(true_classes, dtypes.int64)
    graph = true_classes.graph
    seed, seed2 = get_seed(seed, graph)
    attrs = {
        "num_true": _as_int(num_true), "num_sampled": _as_int(num_sampled),
        "unique": bool(unique), "range_max": _as_int(range_max), "seed": seed, "seed2": seed2,
    }
    op = graph.create_op(
        "LogUniformCandidateSampler", [true_classes], attrs, name or "LogUniformCandidateSampler"
    )
    return op.outputs[0], op.outputs[1], op.outputs[2]
