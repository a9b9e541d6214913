"""Chains of elementwise ops as one kernel (``_FusedElementwise``), for devices where each
op is a kernel launch.

``EXPRESSIONS`` writes each fusable op with the array module's ufuncs and arithmetic
alone, term by term as its own kernel computes it, so that the chain gives the same values
fused as unfused, and ``cupy.fuse`` can compile the whole chain into one kernel (one launch,
no intermediate arrays in device memory). Where the module has no ``fuse`` the program runs
op by op. A fused node's ``program`` lists its ops in order, each reading the node's inputs
(``("in", k)``) or earlier results (``("op", j)``); the last result is the output.

``_FusedAssign`` ends such a program in a variable update: its first input is the
variable, the program computes the update, and ``how`` (``add``, ``sub`` or ``set``) makes
the new value of it in the same kernel, which becomes the variable's buffer (a new one:
readers of the old value keep theirs, as with any copy-on-write update; in a step captured
as a CUDA graph, or for a variable such a graph uses, it is written into the variable's
own buffer instead). Optimizers update a variable and its slots with one op of their own
(``kernels/training.py``); what this takes in are the other updates (moving averages, a
learning rate's schedule, Adam's beta powers).
"""

from __future__ import annotations

from collections.abc import Callable

from .registry import KernelContext, kernel

EXPRESSIONS: dict[str, Callable] = {
    "Add": lambda xp, a, b: a + b,
    "Sub": lambda xp, a, b: a - b,
    "Mul": lambda xp, a, b: a * b,
    "RealDiv": lambda xp, a, b: a / b,
    "Maximum": lambda xp, a, b: xp.maximum(a, b),
    "Minimum": lambda xp, a, b: xp.minimum(a, b),
    "Neg": lambda xp, a: -a,
    "Square": lambda xp, a: xp.square(a),
    "Sqrt": lambda xp, a: xp.sqrt(a),
    "Rsqrt": lambda xp, a: xp.reciprocal(xp.sqrt(a)),
    "Reciprocal": lambda xp, a: xp.reciprocal(a),
    "Exp": lambda xp, a: xp.exp(a),
    "Log": lambda xp, a: xp.log(a),
    "Tanh": lambda xp, a: xp.tanh(a),
    "Relu": lambda xp, a: xp.maximum(a, 0),
    "ReluGrad": lambda xp, g, y: g * (y > 0),
    "Sigmoid": lambda xp, a: 1 / (xp.exp(-a) + 1),
    "SigmoidGrad": lambda xp, y, g: (1 - y) * y * g,
    "TanhGrad": lambda xp, y, g: (1 - y * y) * g,
    "BiasAdd": lambda xp, x, b: x + b,
}


def run_program(xp, program, inputs):
    """The program's result, op by op."""
    values = []
    for op_type, args in program:
        values.append(EXPRESSIONS[op_type](
            xp, *[inputs[i] if kind == "in" else values[i] for kind, i in args]))
    return values[-1]


@kernel("_FusedElementwise")
def _fused(ctx: KernelContext):
    xp, program = ctx.xp, ctx.attrs["program"]

    def chain(*inputs):
        return run_program(xp, program, inputs)

    fuse = getattr(xp, "fuse", None)
    return chain if fuse is None else fuse(chain)


@kernel("_FusedAssign")
def _fused_assign(ctx: KernelContext):
    xp, program, how = ctx.xp, ctx.attrs["program"], ctx.attrs["how"]

    if how == "set":  # a fresh array: the variable's first value, or its next

        def chain(*inputs):
            return run_program(xp, program, inputs)
    else:
        sign = 1 if how == "add" else -1

        def chain(value, *inputs):
            delta = run_program(xp, program, inputs)
            return value + delta if sign > 0 else value - delta

    fuse = getattr(xp, "fuse", None)
    fused = chain if fuse is None else fuse(chain)
    used, fix = ctx.outputs_used, ctx.in_place_updates

    def fn(state, *inputs):
        if fix or state.fixed:  # the new value into the variable's own buffer
            with state.lock:
                value = state.read()
                state.fixed = True
                new = fused(*inputs) if how == "set" else fused(value, *inputs)
                value[...] = new
                return value if used else None
        with state.lock:
            # An assignment may be a variable's first value; an update reads the current one.
            value = None if how == "set" else state.read()
            new = fused(*inputs) if value is None else fused(value, *inputs)
            shape = tuple(state.shape) if value is None else value.shape
            if new.dtype != state.dtype or new.shape != shape:
                raise ValueError(f"{ctx.name}: the update of {state.name!r} gives "
                                 f"{new.dtype}{list(new.shape)}, not {state.dtype}{list(shape)}")
            state.value = new
            return state.value if used else None

    return fn
