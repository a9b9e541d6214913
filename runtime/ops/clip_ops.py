"""Clipping values and gradients (TensorFlow's ``clip_ops.py``), composed of existing ops.

``clip_by_global_norm`` takes a list as ``compute_gradients`` gives it: entries may be
None (a variable the loss does not reach) and are passed through, and ``IndexedSlices``
(row gradients of an embedding) are scaled in their values, staying sparse.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..autodiff import IndexedSlices
from ..graph import GraphError, Tensor, convert_to_tensor
from .array_ops import identity
from .math_ops import add_n, cast, greater, maximum, minimum, reduce_sum, sqrt
from .nn_ops import l2_loss
from .select_ops import where


def _like(value, t: Tensor, what: str) -> Tensor:
    """A bound or norm as a tensor of ``t``'s dtype."""
    if isinstance(value, Tensor) or hasattr(value, "_as_graph_element"):
        value = convert_to_tensor(value)
        if value.dtype != t.dtype:
            raise GraphError(f"{what} {value.name} is {value.dtype}, the values are {t.dtype}")
        return value
    return convert_to_tensor(value, dtype=t.dtype, name=what)


def clip_by_value(t, clip_value_min, clip_value_max, name=None):
    """``t`` with every entry brought into ``[clip_value_min, clip_value_max]``; the
    gradient passes where the entry was inside. IndexedSlices are clipped in their values."""
    if isinstance(t, IndexedSlices):
        values = clip_by_value(t.values, clip_value_min, clip_value_max, name)
        return IndexedSlices(values, t.indices, t.dense_shape)
    t = convert_to_tensor(t)
    plain = (int, float)
    if (
        isinstance(clip_value_min, plain) and isinstance(clip_value_max, plain)
        and clip_value_min > clip_value_max
    ):
        raise ValueError(
            f"clip_by_value({t.name}): clip_value_min {clip_value_min} is greater than "
            f"clip_value_max {clip_value_max}"
        )
    with t.graph.as_default(), t.graph.name_scope(name or "clip_by_value"):
        lo = _like(clip_value_min, t, "clip_value_min")
        hi = _like(clip_value_max, t, "clip_value_max")
        return maximum(minimum(t, hi), lo)


def clip_by_norm(t, clip_norm, axes=None, name=None) -> Tensor:
    """``t * clip_norm / max(l2norm(t), clip_norm)``, the norm taken over ``axes`` (all by
    default): unchanged when its norm is at most ``clip_norm``. A zero ``t`` stays zero
    with a finite gradient."""
    t = convert_to_tensor(t)
    with t.graph.as_default(), t.graph.name_scope(name or "clip_by_norm"):
        clip = _like(clip_norm, t, "clip_norm")
        l2sum = reduce_sum(t * t, axes, keepdims=True)
        nonzero = greater(l2sum, 0.0)
        safe = where(nonzero, l2sum, l2sum + 1.0)  # sqrt(0) would give an infinite gradient
        l2norm = where(nonzero, sqrt(safe), l2sum)
        return identity(t * clip / maximum(l2norm, clip))


def global_norm(t_list: Sequence, name=None) -> Tensor:
    """``sqrt(sum of every entry squared)`` over a list of tensors (None entries skipped,
    IndexedSlices by their values), in the dtype of the first."""
    values = _values(t_list, "global_norm")
    present = [v for v in values if v is not None]
    if not present:
        raise ValueError("global_norm: every entry of t_list is None")
    dtype = present[0].dtype
    graph = present[0].graph
    with graph.as_default(), graph.name_scope(name or "global_norm"):
        halves = [cast(l2_loss(v), dtype) if v.dtype != dtype else l2_loss(v) for v in present]
        return sqrt(add_n(halves) * 2.0, name="global_norm")


def clip_by_global_norm(
    t_list: Sequence, clip_norm, use_norm=None, name=None
) -> tuple[list, Tensor]:
    """Scale every tensor of ``t_list`` by ``clip_norm / max(global_norm, clip_norm)``:
    the list's joint norm is then at most ``clip_norm`` and the directions are kept.

    Returns ``(clipped list, global norm)``. None entries stay None; IndexedSlices stay
    IndexedSlices. An infinite or NaN norm makes every value NaN, as in TensorFlow, so a
    blown-up step shows instead of being silently scaled to zero.
    """
    values = _values(t_list, "clip_by_global_norm")
    present = [v for v in values if v is not None]
    if not present:
        raise ValueError("clip_by_global_norm: every entry of t_list is None")
    graph = present[0].graph
    with graph.as_default(), graph.name_scope(name or "clip_by_global_norm"):
        norm = global_norm(values) if use_norm is None else convert_to_tensor(use_norm)
        clip = _like(clip_norm, norm, "clip_norm")
        # (norm - norm) is 0 for a finite norm and NaN otherwise.
        scale = clip / maximum(norm, clip) + (norm - norm)
        out: list = []
        for t, v in zip(t_list, values, strict=True):
            if v is None:
                out.append(None)
                continue
            s = scale if v.dtype == scale.dtype else cast(scale, v.dtype)
            with graph.colocate_with(v.op):
                clipped = identity(v * s)
            out.append(IndexedSlices(clipped, t.indices, t.dense_shape)
                       if isinstance(t, IndexedSlices) else clipped)
        return out, norm


def _values(t_list, what: str) -> list:
    """Each entry's dense values: a tensor, an IndexedSlices' values, or None."""
    if isinstance(t_list, (Tensor, IndexedSlices, str)) or not isinstance(t_list, Sequence):
        raise TypeError(f"{what}: t_list must be a list or tuple, got {type(t_list).__name__}")
    out = []
    for i, t in enumerate(t_list):
        if t is None:
            out.append(None)
        elif isinstance(t, IndexedSlices):
            out.append(t.values)
        else:
            v = convert_to_tensor(t)
            if v.dtype.kind != "f":
                raise TypeError(f"{what}: entry {i} ({v.name}) is {v.dtype}, not floating point")
            out.append(v)
    return out
