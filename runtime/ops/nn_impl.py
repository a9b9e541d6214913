"""Neural-network functions composed of existing ops (TensorFlow's ``nn_impl.py``):
``moments`` and ``sigmoid_cross_entropy_with_logits``. They need no kernel of their own:
the ops they are made of run one vectorized kernel each and bring their gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowmill.kernels import shapes

from .. import dtypes
from ..graph import GraphError, Tensor, convert_to_tensor
from .array_ops import squeeze, stop_gradient, zeros_like
from .math_ops import cast, exp, greater_equal, reduce_mean, squared_difference
from .select_ops import where
from .unary_math_ops import log1p


def moments(
    x, axes: Sequence[int], shift=None, name=None, keep_dims=None, keepdims=None
) -> tuple[Tensor, Tensor]:
    """(mean, variance) of ``x`` over ``axes``, as batch normalization needs them.

    The variance is the mean squared distance to a mean that is held constant for the
    gradient (TensorFlow does the same): the gradient is still exact, because the mean's
    own term sums to zero, and the backward pass skips a reduction. ``shift`` is accepted
    for TensorFlow's signature and unused, as there. float16 is reduced in float32.
    """
    if keep_dims is not None and keepdims is not None and bool(keep_dims) != bool(keepdims):
        raise ValueError("moments: keep_dims and keepdims disagree")
    keep = bool(keepdims if keepdims is not None else keep_dims)
    x = convert_to_tensor(x)
    if x.dtype.kind != "f":
        raise TypeError(f"moments: {x.name} must be floating point, is {x.dtype}")
    if isinstance(axes, int):
        raise TypeError(f"moments: axes must be a list of ints, got {axes!r}")
    axes = [int(a) for a in axes]
    if x.shape is not None:
        try:
            shapes.normalize_axes(axes, len(x.shape))
        except shapes.ShapeError as e:
            raise GraphError(f"moments of {x.name} {shapes.fmt(x.shape)}: {e}") from None
    graph = x.graph
    with graph.as_default(), graph.name_scope(name or "moments"):
        y = cast(x, dtypes.float32) if x.dtype == dtypes.float16 else x
        mean = reduce_mean(y, axes, keepdims=True, name="mean")
        variance = reduce_mean(
            squared_difference(y, stop_gradient(mean)), axes, keepdims=True, name="variance"
        )
        if not keep:
            mean, variance = squeeze(mean, axes), squeeze(variance, axes)
        if x.dtype == dtypes.float16:
            mean, variance = cast(mean, x.dtype), cast(variance, x.dtype)
        return mean, variance


def sigmoid_cross_entropy_with_logits(labels=None, logits=None, name=None) -> Tensor:
    """Elementwise ``-z log(sigmoid(x)) - (1 - z) log(1 - sigmoid(x))`` for logits ``x`` and
    labels ``z`` (independent binary classes), in TensorFlow's stable form
    ``max(x, 0) - x z + log(1 + exp(-|x|))``, which never overflows. The branches are
    Selects, not ``abs``/``maximum``, so the gradient is ``sigmoid(x) - z`` even at 0.
    """
    if labels is None or logits is None:
        raise ValueError("sigmoid_cross_entropy_with_logits: pass both labels= and logits=")
    logits = convert_to_tensor(logits)
    if logits.dtype.kind != "f":
        raise TypeError(
            f"sigmoid_cross_entropy_with_logits: logits {logits.name} must be floating "
            f"point, are {logits.dtype}"
        )
    labels = convert_to_tensor(labels, dtype=None if isinstance(labels, Tensor) else logits.dtype)
    if labels.dtype != logits.dtype:
        raise TypeError(
            f"sigmoid_cross_entropy_with_logits: labels {labels.name} are {labels.dtype}, "
            f"logits {logits.name} are {logits.dtype}"
        )
    if not shapes.compatible(labels.shape, logits.shape):
        raise GraphError(
            f"sigmoid_cross_entropy_with_logits: labels {shapes.fmt(labels.shape)} and logits "
            f"{shapes.fmt(logits.shape)} must have the same shape"
        )
    graph = logits.graph
    with graph.as_default(), graph.name_scope(name or "logistic_loss"):
        zeros = zeros_like(logits)
        positive = greater_equal(logits, zeros)
        relu_logits = where(positive, logits, zeros)
        neg_abs_logits = where(positive, -logits, logits)
        return relu_logits - logits * labels + log1p(exp(neg_abs_logits))
