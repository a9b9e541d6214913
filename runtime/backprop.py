"""Reverse-mode autodiff as a user-level library: it only builds more graph.

``gradients`` walks the ops between ``xs`` and ``ys`` in reverse, calls each op's
vector-Jacobian product from the registry (``autodiff.defvjp``), sums the partial
gradients reaching a tensor along every path, and hands Gather's row gradients on as
``IndexedSlices``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .autodiff import GRADIENTS, SPARSE_PASSTHROUGH, IndexedSlices
from .graph import Operation, Tensor, convert_to_tensor
from .ops.array_ops import concat, ones_like, unsorted_segment_sum, zeros_like
from .ops.math_ops import add_n


def to_dense(g):
    if isinstance(g, IndexedSlices):
        return unsorted_segment_sum(g.values, g.indices, g.dense_shape[0])
    return g


def _sum(grads: list):
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    if all(isinstance(g, IndexedSlices) for g in grads):
        return IndexedSlices(
            concat([g.values for g in grads], 0),
            concat([g.indices for g in grads], 0),
            grads[0].dense_shape,
        )
    return add_n([to_dense(g) for g in grads])


def gradients(
    ys: Tensor | Sequence[Tensor],
    xs: Tensor | Sequence[Tensor],
    grad_ys: Tensor | Sequence[Tensor] | None = None,
    name: str = "gradients",
) -> list:
    """d(sum of ys)/d(x) for each x: a Tensor, an IndexedSlices, or None if x does not reach ys."""
    ys = _listify(ys)
    xs = [_as_tensor(x) for x in _listify(xs)]
    if grad_ys is None:
        grad_ys = [None] * len(ys)
    grad_ys = _listify(grad_ys)
    ys = [_as_tensor(y) for y in ys]
    graph = ys[0].graph
    # Ops on some path from an x to a y: downstream of an x's consumers and upstream of a y.
    between = _ops_reaching(ys) & _ops_from(xs)
    x_set = set(xs)
    grads: dict[Tensor, list] = {}
    with graph.as_default(), graph.name_scope(name):
        for y, gy in zip(ys, grad_ys, strict=True):
            grads.setdefault(y, []).append(ones_like(y) if gy is None else convert_to_tensor(gy))
        for op in sorted(between, key=lambda o: o.id, reverse=True):
            out_grads = [_sum(grads.get(t, [])) for t in op.outputs]
            if all(g is None for g in out_grads):
                continue
            vjp = GRADIENTS.get(op.type)
            if vjp is None:
                if not op.op_def.differentiable:
                    continue
                raise LookupError(f"no gradient registered for op {op.name!r} ({op.type})")
            if op.type not in SPARSE_PASSTHROUGH:
                out_grads = [to_dense(g) for g in out_grads]
            out_grads = [
                g if g is not None else _zeros_for(t)
                for t, g in zip(op.outputs, out_grads, strict=True)
            ]
            with graph.name_scope(op.name + "_grad"):
                in_grads = vjp(op, *out_grads)
            if len(in_grads) != len(op.inputs):
                raise ValueError(
                    f"gradient of {op.type} gave {len(in_grads)} grads for {len(op.inputs)} inputs"
                )
            for t, g in zip(op.inputs, in_grads, strict=True):
                if g is not None and (t.op in between or t in x_set):
                    grads.setdefault(t, []).append(g)
        return [_sum(grads.get(x, [])) for x in xs]


def _zeros_for(t: Tensor):
    if t.dtype.kind == "O":
        return None
    return zeros_like(t)


def _listify(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _as_tensor(x) -> Tensor:
    if hasattr(x, "_as_graph_element"):
        x = x._as_graph_element()
    return convert_to_tensor(x)


def _ops_reaching(ys: list[Tensor]) -> set[Operation]:
    # Loop back edges: Merge reads NextIteration; gradients do not cross loops.
    return _closure([y.op for y in ys], lambda op: [t.op for t in op.inputs])


def _ops_from(xs: list[Tensor]) -> set[Operation]:
    return _closure(
        [op for x in xs for op in x._consumers],
        lambda op: [c for t in op.outputs for c in t._consumers],
    )


def _closure(start: list[Operation], successors) -> set[Operation]:
    """Every op reached from ``start`` by ``successors``, ``start`` included."""
    seen: set[Operation] = set()
    stack = list(start)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(successors(op))
    return seen
