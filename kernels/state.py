"""Variable kernels. State lives in the step's ``Resources``; updates hold the variable's lock."""

from __future__ import annotations

from .registry import KernelContext, kernel


@kernel("VarHandleOp")
def _var_handle(ctx: KernelContext):
    state = ctx.resources.variable(
        ctx.attrs["shared_name"] or ctx.name, ctx.attrs["dtype"], ctx.attrs["shape"]
    )
    return lambda: state


@kernel("ReadVariableOp")
def _read(ctx: KernelContext):
    return lambda state: state.read()


def _result(ctx: KernelContext):
    """Return a snapshot only when someone uses the op's output; the buffer stays private."""
    if ctx.outputs_used:
        return lambda state: state.value.copy()
    return lambda state: None


@kernel("AssignVariableOp")
def _assign(ctx: KernelContext):
    xp, result = ctx.xp, _result(ctx)

    def fn(state, value):
        fresh = xp.array(value, dtype=state.dtype, copy=True)
        if state.shape is not None and fresh.shape != state.shape and None not in state.shape:
            raise ValueError(
                f"assigning shape {fresh.shape} to variable {state.name!r} of shape {state.shape}"
            )
        with state.lock:
            state.value = fresh
            return result(state)

    return fn


def _update(ufunc_name: str):
    def build(ctx: KernelContext):
        ufunc, result = getattr(ctx.xp, ufunc_name), _result(ctx)

        def fn(state, delta):
            with state.lock:
                ufunc(state.read(), delta, out=state.value)
                return result(state)

        return fn

    return build


kernel("AssignAddVariableOp")(_update("add"))
kernel("AssignSubVariableOp")(_update("subtract"))


def _scatter(how: str):
    def build(ctx: KernelContext):
        xp, result = ctx.xp, _result(ctx)

        def fn(state, indices, updates):
            with state.lock:
                value = state.read()
                if how == "add":
                    xp.add.at(value, indices, updates)
                elif how == "sub":
                    xp.subtract.at(value, indices, updates)
                else:
                    value[indices] = updates
                return result(state)

        return fn

    return build


kernel("ResourceScatterAdd")(_scatter("add"))
kernel("ResourceScatterSub")(_scatter("sub"))
kernel("ResourceScatterUpdate")(_scatter("update"))
