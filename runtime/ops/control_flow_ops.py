"""Conditionals and loops as dataflow (paper section 3.4, Fig. 2).

``Switch`` sends its input to one of two outputs and a *dead* value to the other; dead
values flow through every op except ``Merge``, which forwards its first live input. So an
untaken branch costs nothing and its stateful ops never run. ``cond`` is Switch + Merge;
``while_loop`` adds frames: ``Enter`` into the loop, ``NextIteration`` back to its
``Merge``, ``LoopCond`` to decide, ``Exit`` out. Ops built inside a branch or loop body are
recorded in a context, which routes outside tensors in through a Switch or Enter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import defvjp
from ..graph import GraphError, Operation, Tensor, apply_op, convert_to_tensor, get_default_graph
from ..op_def import define_op, require_same_dtype, same_as_input
from .array_ops import identity
from .math_ops import less, logical_and
from .stack_ops import stack, stack_pop, stack_push


@define_op("Switch", num_inputs=2)
def _switch_shape(inputs, attrs):
    data, pred = inputs
    if pred.dtype != dtypes.bool_ or (pred.shape is not None and pred.shape != ()):
        raise ShapeError(
            f"Switch predicate must be a bool scalar, got {shapes.fmt(pred.shape)} {pred.dtype}"
        )
    return [(data.dtype, data.shape), (data.dtype, data.shape)]


@define_op("Merge")
def _merge_shape(inputs, attrs):
    dtype = require_same_dtype(inputs)
    shape = inputs[0].shape
    for t in inputs[1:]:
        shape = (
            shapes.merge(shape, t.shape)
            if shapes.compatible(shape, t.shape)
            else _relax(shape, t.shape)
        )
    return [(dtype, shape), (dtypes.int32, ())]


def _relax(a, b):
    if a is None or b is None or len(a) != len(b):
        return None
    return tuple(x if x == y else None for x, y in zip(a, b, strict=True))


define_op(
    "Enter", attrs={"frame_name": "", "is_constant": False}, num_inputs=1, differentiable=False
)(same_as_input())
define_op("Exit", num_inputs=1, differentiable=False)(same_as_input())
define_op("NextIteration", num_inputs=1, differentiable=False)(same_as_input())


@define_op("LoopCond", num_inputs=1, differentiable=False)
def _loop_cond_shape(inputs, attrs):
    (pred,) = inputs
    if pred.dtype != dtypes.bool_:
        raise ShapeError(f"loop condition must be bool, got {pred.dtype}")
    return [(dtypes.bool_, ())]


def switch(data, pred, name=None) -> tuple[Tensor, Tensor]:
    """(output_false, output_true): the one not chosen by ``pred`` is dead."""
    op = apply_op("Switch", [convert_to_tensor(data), convert_to_tensor(pred)], name=name)
    return op.outputs[0], op.outputs[1]


def merge(inputs: Sequence[Tensor], name=None) -> tuple[Tensor, Tensor]:
    """(value, value_index) of the first live input."""
    op = apply_op("Merge", [convert_to_tensor(t) for t in inputs], name=name)
    return op.outputs[0], op.outputs[1]


# ---- contexts


def _in_context(op: Operation, ctx) -> bool:
    c = op.cf_context
    while c is not None:
        if c is ctx:
            return True
        c = c.outer
    return False


class CondContext:
    """One branch of a ``cond``: outside tensors enter through a Switch on the predicate."""

    is_loop = False

    def __init__(self, pred: Tensor, pivot: Operation, branch: int, outer):
        self.pred = pred
        self.pivot = pivot
        self.branch = branch
        self.outer = outer
        self._captured: dict[Tensor, Tensor] = {}

    def capture_inputs(self, inputs: list[Tensor]) -> list[Tensor]:
        return [t if _in_context(t.op, self) else self._capture(t) for t in inputs]

    def _capture(self, t: Tensor) -> Tensor:
        if t not in self._captured:
            graph = t.graph
            with graph._control_flow_context(self.outer):
                self._captured[t] = switch(t, self.pred, name="capture")[self.branch]
        return self._captured[t]

    def add_op(self, op: Operation) -> None:
        op.cf_context = self
        if not op.inputs:
            op._add_control_input(self.pivot)  # so it runs only when the branch is taken


class WhileContext:
    """One while loop's frame: outside tensors enter as loop constants.

    It also keeps what the loop's gradient reads: each loop variable's Enter, its value
    entering the body (``body_in``) and leaving it (``body_out``), its Exit, the loop
    constants, and (made when a gradient first asks) a count of the iterations run."""

    is_loop = True

    def __init__(
        self,
        name: str,
        outer,
        maximum_iterations: int | None = None,
        swap_memory: bool = False,
    ):
        self.name = name
        self.outer = outer
        self.maximum_iterations = maximum_iterations
        self.swap_memory = swap_memory
        self.pivot: Operation | None = None  # set once the body starts
        self.roles: dict[Operation, str] = {}
        self._captured: dict[Tensor, Tensor] = {}
        self.loop_cond: Tensor | None = None
        self.body_in: list[Tensor] = []
        self.body_out: list[Tensor] = []
        self.exits: list[Tensor] = []
        self._count: Tensor | None = None
        self._count_next: Operation | None = None

    @property
    def constants(self) -> dict[Tensor, Tensor]:
        """Outside tensor -> its loop-constant Enter, for every tensor the loop reads (the
        Enter's own input: a tensor from outside a cond branch enters through its Switch)."""
        return {inside.op.inputs[0]: inside for inside in self._captured.values()}

    def iterations(self) -> Tensor:
        """The number of times the body ran, as an int32 out of the loop (built once: one
        more loop variable, counting). Ops made ``run_each_iteration`` run before it."""
        if self._count is None:
            graph = self.pivot.graph
            with graph._control_flow_context(self.outer):
                zero = convert_to_tensor(0, dtypes.int32, name=f"{self.name}_count_init")
            enter = self.enter(zero, is_constant=False)
            with graph._control_flow_context(self):
                value, _ = merge([enter, enter], name="count")
                self.roles[value.op] = "merge"
                f, t = switch(value, self.loop_cond, name="count_switch")
                self.roles[f.op] = "switch"
                nxt = apply_op("NextIteration", [identity(t) + 1])
                self.roles[nxt] = "next"
                value.op._update_input(1, nxt.outputs[0])
            with graph._control_flow_context(self.outer):
                self._count = apply_op("Exit", [f], name=f"{self.name}_count").outputs[0]
            self._count_next = nxt
        return self._count

    def run_each_iteration(self, op: Operation) -> None:
        """Make ``op`` (built in this frame, output-less: a stack push) run in every
        iteration whose body runs, whenever the iteration count is needed."""
        self.iterations()
        op._add_control_input(self.pivot)
        self._count_next._add_control_input(op)

    def role_of(self, op: Operation) -> str | None:
        return self.roles.get(op)

    def capture_inputs(self, inputs: list[Tensor]) -> list[Tensor]:
        return [t if _in_context(t.op, self) else self._capture(t) for t in inputs]

    def _capture(self, t: Tensor) -> Tensor:
        if t not in self._captured:
            self._captured[t] = self.enter(t, is_constant=True)
        return self._captured[t]

    def enter(self, t: Tensor, is_constant: bool) -> Tensor:
        graph = t.graph
        with graph._control_flow_context(self.outer):
            op = apply_op("Enter", [t], {"frame_name": self.name, "is_constant": is_constant})
        op.cf_context = self
        self.roles[op] = "enter_const" if is_constant else "enter"
        return op.outputs[0]

    def add_op(self, op: Operation) -> None:
        op.cf_context = self
        # A body op that reads nothing the loop changes would otherwise run once more on
        # the iteration that exits; tie it to the pivot so it runs only inside the body.
        if self.pivot is not None and not any(self._varies(t) for t in op.inputs):
            op._add_control_input(self.pivot)

    def _varies(self, t: Tensor) -> bool:
        return _in_context(t.op, self) and self.roles.get(t.op) != "enter_const"


class GradWhileContext(WhileContext):
    """The frame of a loop's gradient: the forward loop run backwards (paper section 4.1).

    A gradient op here that reads a value of the forward loop reads it off a stack: the
    forward loop pushes the value every iteration and this loop pops it, so iteration
    ``k`` from the end sees the values of forward iteration ``k`` from the end. A forward
    loop constant is entered here as a constant, as it is outside both loops."""

    def __init__(self, forward: WhileContext, name: str, outer, maximum_iterations, swap_memory):
        super().__init__(name, outer, maximum_iterations, swap_memory)
        self.forward = forward

    def _capture(self, t: Tensor) -> Tensor:
        if t in self._captured:
            return self._captured[t]
        fwd = self.forward
        if not _in_context(t.op, fwd):
            return super()._capture(t)
        if fwd.roles.get(t.op) == "enter_const":
            value = self._capture(t.op.inputs[0])
        else:
            value = self._pop(t)
        self._captured[t] = value
        return value

    def _pop(self, t: Tensor) -> Tensor:
        fwd = self.forward
        graph = t.graph
        # Dead when not taken: a value of a cond branch, or of the Switch in front of one.
        may_be_dead = t.op.type == "Switch" and fwd.roles.get(t.op) != "switch"
        c = t.op.cf_context
        while c is not fwd:
            may_be_dead |= not c.is_loop
            c = c.outer
        with graph.colocate_with(t.op):
            with graph._control_flow_context(None):
                handle = stack(t.dtype, _stack_bound(fwd), stack_name=t.name)
            with graph._control_flow_context(fwd):
                push = stack_push(handle, t, swap_memory=fwd.swap_memory)
            fwd.run_each_iteration(push)
            return stack_pop(handle, t, fwd.swap_memory, may_be_dead)


def _stack_bound(ctx) -> int:
    """How many values a stack of ``ctx``'s may hold: the product of the maximum
    iterations of it and the loops around it, or -1 (unbounded) if one has none."""
    bound = 1
    while ctx is not None:
        if ctx.is_loop:
            if ctx.maximum_iterations is None:
                return -1
            bound *= max(int(ctx.maximum_iterations), 1)
        ctx = ctx.outer
    return bound


# ---- cond


def cond(pred, true_fn: Callable, false_fn: Callable, name: str | None = None):
    """``true_fn()`` if ``pred`` else ``false_fn()``; only the taken branch runs."""
    graph = get_default_graph()
    pred = convert_to_tensor(pred)
    if pred.dtype != dtypes.bool_ or (pred.shape is not None and pred.shape != ()):
        raise GraphError(
            f"cond predicate {pred.name} must be a bool scalar, got "
            f"{shapes.fmt(pred.shape)} {pred.dtype}"
        )
    outer = graph._current_cf_context()
    with graph.name_scope(name or "cond"):
        p_false, p_true = switch(pred, pred)
        results = {}
        for branch, pivot_src, fn in ((1, p_true, true_fn), (0, p_false, false_fn)):
            pivot = identity(pivot_src, name="switch_t" if branch else "switch_f").op
            ctx = CondContext(pred, pivot, branch, outer)
            with graph._control_flow_context(ctx):
                out = fn()
                flat, structure = _flatten(out)
                # Route every result through the branch so it is dead when not taken.
                flat = [identity(convert_to_tensor(t)) for t in flat]
            results[branch] = (flat, structure)
        (f_flat, _), (t_flat, t_struct) = results[0], results[1]
        if len(f_flat) != len(t_flat):
            raise GraphError(
                f"cond branches return different numbers of tensors: true {len(t_flat)}, "
                f"false {len(f_flat)}"
            )
        merged = []
        for i, (f, t) in enumerate(zip(f_flat, t_flat, strict=True)):
            if f.dtype != t.dtype:
                raise GraphError(f"cond output {i}: true branch gives {t.dtype}, false {f.dtype}")
            value, _ = merge([f, t])
            graph.cond_predicates[value.op] = pred  # for the gradient
            merged.append(value)
    return _unflatten(merged, t_struct)


def _flatten(out):
    if out is None:
        raise GraphError("a cond branch must return at least one tensor")
    if isinstance(out, (list, tuple)):
        return list(out), (type(out), len(out))
    return [out], None


def _unflatten(flat, structure):
    if structure is None:
        return flat[0]
    kind, _ = structure
    return kind(flat)


@defvjp("Switch")
def _switch_grad(op, g_false, g_true):
    value, _ = merge([g_false, g_true])
    return [value, None]


@defvjp("Merge")
def _merge_grad(op, g, g_index):
    pred = op.graph.cond_predicates.get(op)
    if pred is None:
        raise LookupError(f"no gradient through {op.name}: only cond's Merge is differentiable")
    g_false, g_true = switch(g, pred)
    return [g_false, g_true]


# ---- while_loop


def while_loop(
    cond_fn: Callable,
    body_fn: Callable,
    loop_vars: Sequence,
    maximum_iterations: int | None = None,
    name: str | None = None,
    swap_memory: bool = False,
    _context: Callable | None = None,
) -> list[Tensor] | Tensor:
    """Run ``loop_vars = body_fn(*loop_vars)`` while ``cond_fn(*loop_vars)``.

    ``gradients`` through the loop runs it backwards, keeping each iteration's values on
    stacks: ``maximum_iterations`` bounds them too, and ``swap_memory`` keeps a device's
    values in host memory while they wait. (``_context`` makes the frame: a gradient loop's
    reads its forward loop's values off those stacks.)"""
    graph = get_default_graph()
    single = not isinstance(loop_vars, (list, tuple))
    values = [convert_to_tensor(v) for v in ([loop_vars] if single else loop_vars)]
    if not values:
        raise GraphError("while_loop needs at least one loop variable")
    if maximum_iterations is not None:
        counter_cond, counter_body = cond_fn, body_fn
        limit = int(maximum_iterations)
        if limit < 0:
            raise GraphError(f"while_loop maximum_iterations must be >= 0, got {limit}")

        def cond_fn(i, *vs):
            return logical_and(less(i, limit), convert_to_tensor(counter_cond(*vs)))

        def body_fn(i, *vs):
            out = counter_body(*vs)
            out = list(out) if isinstance(out, (list, tuple)) else [out]
            return [i + 1, *out]

        values = [convert_to_tensor(0, dtypes.int32), *values]
    outer = graph._current_cf_context()
    with graph.name_scope(name or "while") as scope:
        make = _context or WhileContext
        ctx = make(scope.rstrip("/"), outer, maximum_iterations, swap_memory)
        enters = [ctx.enter(v, is_constant=False) for v in values]
        with graph._control_flow_context(ctx):
            merges = []
            for e in enters:
                value, _ = merge([e, e])
                ctx.roles[value.op] = "merge"
                merges.append(value)
            pred = convert_to_tensor(cond_fn(*merges))
            loop_cond = apply_op("LoopCond", [pred], name="LoopCond")
            ctx.roles[loop_cond] = "loop_cond"
            ctx.loop_cond = loop_cond.outputs[0]
            switches = []
            for m in merges:
                f, t = switch(m, loop_cond.outputs[0])
                ctx.roles[f.op] = "switch"
                switches.append((f, t))
            body_in = [identity(t) for _, t in switches]
            ctx.pivot = body_in[0].op
            ctx.body_in = body_in
            out = body_fn(*body_in)
            out = list(out) if isinstance(out, (list, tuple)) else [out]
            if len(out) != len(values):
                raise GraphError(
                    f"while_loop body returns {len(out)} values for {len(values)} loop vars"
                )
            for i, (m, o) in enumerate(zip(merges, out, strict=True)):
                o = convert_to_tensor(o, dtype=m.dtype)
                if not shapes.compatible(m.shape, o.shape):
                    raise GraphError(
                        f"while_loop var {i} enters with shape {shapes.fmt(m.shape)}, "
                        f"body returns {shapes.fmt(o.shape)}"
                    )
                nxt = apply_op("NextIteration", [o])
                ctx.roles[nxt] = "next"
                ctx.body_out.append(nxt.inputs[0])
                m.op._update_input(1, nxt.outputs[0])
        exits = [apply_op("Exit", [f]).outputs[0] for f, _ in switches]
        ctx.exits = exits
    if maximum_iterations is not None:
        exits = exits[1:]
    return exits[0] if single else exits
