"""Reverse-mode autodiff as a user-level library: it only builds more graph.

``gradients`` walks the ops between ``xs`` and ``ys`` in reverse, calls each op's
vector-Jacobian product from the registry (``autodiff.defvjp``), sums the partial
gradients reaching a tensor along every path, and hands Gather's row gradients on as
``IndexedSlices``.

A while loop is one unit of the walk (paper section 4.1): its gradient is another while
loop that runs the body's gradient once per forward iteration, last iteration first,
reading the forward values it needs off per-iteration stacks
(``control_flow_ops.GradWhileContext``). It carries the gradient of every loop variable
back through the iterations and sums, over them, the gradient of every loop constant (a
weight the body reads, say). A loop nested in the body is a unit of the body's walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from .autodiff import ACCEPTS_NONE, GRADIENTS, SPARSE_PASSTHROUGH, IndexedSlices
from .graph import Operation, Tensor, convert_to_tensor
from .ops.array_ops import (
    concat,
    identity,
    ones_like,
    reshape,
    unsorted_segment_sum,
    zeros_like,
)
from .ops.control_flow_ops import GradWhileContext, WhileContext, while_loop
from .ops.math_ops import add_n, greater, matmul
from .ops.tensor_array_ops import TensorArray


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
    for x in xs:
        loop = _loop_unit(x.op, None)
        if loop is not None:
            raise ValueError(
                f"gradients with respect to {x.name}: it is computed inside while loop "
                f"{loop.name!r}; take gradients with respect to tensors outside the loop"
            )
    with graph.as_default(), graph.name_scope(name):
        seeds: dict[Tensor, list] = {}
        for y, gy in zip(ys, grad_ys, strict=True):
            seeds.setdefault(y, []).append(ones_like(y) if gy is None else convert_to_tensor(gy))
        return _walk(seeds, xs, level=None)


def _walk(grads: dict[Tensor, list], xs: list[Tensor], level: WhileContext | None) -> list:
    """The reverse walk from the tensors in ``grads`` (each with its incoming gradients)
    to ``xs``, over the ops at loop ``level`` (None: outside every loop). In a loop body
    (``level`` set) the walk stops at ``xs``: the body's inputs, upstream of which lie
    the loop's own frame and the ops before it."""
    ys = list(grads)
    x_set = set(xs)
    stop = x_set if level is not None else set()
    # Ops on some path from an x to a y: downstream of an x's consumers and upstream of a y.
    between = _ops_reaching(ys, stop) & _ops_from(xs)
    graph = ys[0].graph
    units: dict[object, int] = {}  # an op, or a loop (all its ops), -> its place in order
    for op in between:
        loop = _loop_unit(op, level)
        if loop is None:
            units[op] = op.id
        elif loop not in units:
            units[loop] = max(e.op.id for e in loop.exits)

    def wanted(t: Tensor) -> bool:
        return t.op in between or t in x_set

    for unit in sorted(units, key=units.get, reverse=True):
        if isinstance(unit, WhileContext):
            _loop_grad(unit, grads, wanted)
        else:
            _op_grad(unit, grads, wanted, graph)
    return [_sum(grads.get(x, [])) for x in xs]


def _op_grad(op: Operation, grads: dict, wanted, graph) -> None:
    out_grads = [_sum(grads.get(t, [])) for t in op.outputs]
    if all(g is None for g in out_grads):
        return
    vjp = GRADIENTS.get(op.type)
    if vjp is None:
        if not op.op_def.differentiable:
            return
        raise LookupError(f"no gradient registered for op {op.name!r} ({op.type})")
    if op.type not in SPARSE_PASSTHROUGH:
        out_grads = [to_dense(g) for g in out_grads]
    if op.type not in ACCEPTS_NONE:
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
        if g is not None and wanted(t):
            grads.setdefault(t, []).append(g)


def _loop_grad(loop: WhileContext, grads: dict, wanted) -> None:
    """The gradient of a whole while loop: a while loop over the body's gradient, run as
    many times as the forward loop ran."""
    exit_grads = [_sum(grads.get(e, [])) for e in loop.exits]
    if all(g is None for g in exit_grads):
        return
    graph = loop.exits[0].graph
    carried = [k for k, e in enumerate(loop.exits) if _differentiable(e)]
    constants = [
        (outside, inside)
        for outside, inside in loop.constants.items()
        if _differentiable(outside) and wanted(outside)
    ]
    # A weight multiplied in the body (x_t @ W) has gradient sum_t x_t^T g_t: rather than
    # a matmul and an add of a weight-sized sum per iteration, its factors are written
    # into TensorArrays and multiplied once after the loop, as one matmul over all steps.
    deferred = [j for j, (_, inside) in enumerate(constants) if _matmul_weight(inside)]
    summed_here = [j for j in range(len(constants)) if j not in deferred]
    with graph.name_scope(loop.name.rsplit("/", 1)[-1] + "_grad"):
        count = loop.iterations()
        start = [
            to_dense(exit_grads[k]) if exit_grads[k] is not None else zeros_like(loop.exits[k])
            for k in carried
        ]
        sums = [zeros_like(constants[j][0]) for j in summed_here]
        factors = {j: _factor_arrays(constants[j][1], count) for j in deferred}
        flows = [ta.flow for j in deferred for ta in factors[j]]
        n_sums = len(summed_here)
        unreached: set[int] = set()

        def cond(i, *_):
            return greater(i, 0)

        def body(i, *state):
            gs = state[: len(carried)]
            acc = state[len(carried) : len(carried) + n_sums]
            flow = list(state[len(carried) + n_sums :])
            seeds: dict[Tensor, list] = {}
            for k, g in zip(carried, gs, strict=True):
                seeds.setdefault(loop.body_out[k], []).append(g)
            xs = [loop.body_in[k] for k in carried] + [inside for _, inside in constants]
            found = _walk(seeds, xs, level=loop)
            back = [
                to_dense(f) if f is not None else zeros_like(g)
                for f, g in zip(found[: len(carried)], gs, strict=True)
            ]
            per_constant = found[len(carried) :]
            summed = [
                a + to_dense(per_constant[j]) if per_constant[j] is not None else identity(a)
                for j, a in zip(summed_here, acc, strict=True)
            ]
            for n, j in enumerate(deferred):
                f = per_constant[j]
                if f is None:  # no gradient reaches the weight: its arrays stay unwritten
                    unreached.add(j)
                    continue
                a, g = _matmul_factors(f, constants[j][1])
                ta_a, ta_g = factors[j]
                flow[2 * n] = ta_a._with_flow(flow[2 * n]).write(i - 1, a).flow
                flow[2 * n + 1] = ta_g._with_flow(flow[2 * n + 1]).write(i - 1, g).flow
            return [i - 1, *back, *summed, *flow]

        out = while_loop(
            cond,
            body,
            [count, *start, *sums, *flows],
            name="while",
            swap_memory=loop.swap_memory,
            _context=partial(GradWhileContext, loop),
        )
        after = out[1 + len(carried) :]
        weight_grads: dict[int, Tensor] = dict(zip(summed_here, after[:n_sums], strict=True))
        for n, j in enumerate(deferred):
            if j in unreached:
                weight_grads[j] = zeros_like(constants[j][0])
                continue
            ta_a, ta_g = factors[j]
            weight_grads[j] = _matmul_of_stacks(
                ta_a._with_flow(after[n_sums + 2 * n]), ta_g._with_flow(after[n_sums + 2 * n + 1])
            )
    enters = [_enter_of(loop, k) for k in range(len(loop.exits))]
    for k, g in zip(carried, out[1 : 1 + len(carried)], strict=True):
        if wanted(enters[k]):
            grads.setdefault(enters[k], []).append(g)
    for j, (outside, _) in enumerate(constants):
        grads.setdefault(outside, []).append(weight_grads[j])


def _matmul_weight(inside: Tensor) -> bool:
    """A loop constant read only as ``x @ W`` (a 2-D weight, MatMul's right operand)."""
    users = inside._consumers
    if len(users) != 1 or users[0].type != "MatMul" or users[0].inputs[1] is not inside:
        return False
    op = users[0]
    if op.attrs["transpose_a"] or op.attrs["transpose_b"] or op.inputs[0] is inside:
        return False
    return all(
        t.shape is not None and len(t.shape) == 2 and t.shape[-1] is not None
        for t in (inside, op.inputs[0])
    )


def _factor_arrays(inside: Tensor, count: Tensor) -> tuple[TensorArray, TensorArray]:
    """Arrays for each iteration's ``x_t`` and ``g_t`` of ``x_t @ W``."""
    op = inside._consumers[0]
    k, n = inside.shape
    rows = op.inputs[0].shape[0]
    return (
        TensorArray(inside.dtype, count, element_shape=(rows, k), name="weight_inputs"),
        TensorArray(inside.dtype, count, element_shape=(rows, n), name="weight_grads"),
    )


def _matmul_factors(f: Tensor, inside: Tensor) -> tuple[Tensor, Tensor]:
    """``(x, g)`` of MatMul's gradient for its right operand, ``x^T g``."""
    op = f.op
    if op.type != "MatMul" or not op.attrs["transpose_a"] or op.attrs["transpose_b"]:
        raise LookupError(
            f"gradient of loop weight {inside.name}: expected x^T g from MatMul's gradient, "
            f"got {op.type} {op.name!r}"
        )
    return op.inputs[0], op.inputs[1]


def _matmul_of_stacks(ta_a: TensorArray, ta_g: TensorArray) -> Tensor:
    """sum_t a_t^T g_t as one matmul of the stacked factors."""
    k = ta_a.element_shape[-1]
    n = ta_g.element_shape[-1]
    a = reshape(ta_a.stack(), [-1, k])
    g = reshape(ta_g.stack(), [-1, n])
    return matmul(a, g, transpose_a=True)


def _enter_of(loop: WhileContext, k: int) -> Tensor:
    """The tensor that entered loop variable ``k`` (the input of its Enter)."""
    merge = loop.body_in[k].op.inputs[0].op.inputs[0].op  # Identity <- Switch <- Merge
    return merge.inputs[0].op.inputs[0]


def _differentiable(t: Tensor) -> bool:
    return t.dtype.kind in "fc"


def _loop_unit(op: Operation, level) -> WhileContext | None:
    """The outermost while loop, inside ``level``, that ``op`` belongs to (an Exit belongs
    to the loop it leaves), or None if ``op`` is directly at ``level``."""
    c = op.inputs[0].op.cf_context if op.type == "Exit" else op.cf_context
    loop = None
    while c is not None and c is not level:
        if c.is_loop:
            loop = c
        c = c.outer
    return loop


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


def _ops_reaching(ys: list[Tensor], stop: set[Tensor]) -> set[Operation]:
    """Ops upstream of ``ys`` (loop back edges included), not passing the tensors in ``stop``."""
    stop_ops = {t.op for t in stop}
    return _closure(
        [y.op for y in ys if y not in stop],
        lambda op: [t.op for t in op.inputs if t not in stop and t.op not in stop_ops],
    )


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
