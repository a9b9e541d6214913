"""Variable kernels. State lives in the step's ``Resources``; updates hold the variable's lock.

Reads hand out the variable's buffer itself, with no copy. Updates are copy-on-write: a
buffer nobody else holds is updated in place (the common case: a training step has
dropped its reads before it applies the update), but if any reader still holds it (a
fetched value, a tensor waiting in a rendezvous, a view) the update writes a new buffer,
so a value once read never changes under its reader.
"""

from __future__ import annotations

import sys

from .registry import KernelContext, kernel

# References to a variable's buffer inside an update: ``state.value``, the kernel's local,
# and getrefcount's own argument. Any more and someone else holds it.
_PRIVATE_REFS = 3


@kernel("VarHandleOp")
def _var_handle(ctx: KernelContext):
    state = ctx.resources.variable(
        ctx.attrs["shared_name"] or ctx.name, ctx.attrs["dtype"], ctx.attrs["shape"]
    )
    return lambda: state


@kernel("ReadVariableOp")
def _read(ctx: KernelContext):
    if ctx.in_place_updates:  # a captured graph reads this buffer at every launch

        def read_fixed(state):
            state.fixed = True
            return state.read()

        return read_fixed
    return lambda state: state.read()


@kernel("VarIsInitializedOp")
def _is_initialized(ctx: KernelContext):
    xp = ctx.xp
    return lambda state: xp.asarray(state.value is not None)


def _result(ctx: KernelContext):
    """The updated value, for ops whose output someone uses."""
    if ctx.outputs_used:
        return lambda state: state.value
    return lambda state: None


@kernel("AssignVariableOp")
def _assign(ctx: KernelContext):
    xp, result = ctx.xp, _result(ctx)

    def fn(state, value):
        if ctx.in_place_updates or state.fixed:
            with state.lock:
                _into(state, value, ctx.in_place_updates)
                return result(state)
        fresh = xp.array(value, dtype=state.dtype, copy=True)
        if state.shape is not None and fresh.shape != state.shape and None not in state.shape:
            raise ValueError(
                f"assigning shape {fresh.shape} to variable {state.name!r} of shape {state.shape}"
            )
        with state.lock:
            state.value = fresh
            return result(state)

    return fn


def _into(state, value, fix: bool) -> None:
    """``value`` written into the variable's own buffer (which ``fix`` fixes there)."""
    current = state.read()
    if value.shape != current.shape:
        raise ValueError(f"assigning shape {value.shape} to variable {state.name!r} of shape "
                         f"{current.shape}: a captured step keeps each variable's buffer")
    current[...] = value
    state.fixed = state.fixed or fix


def writable(state, fix: bool):
    """The buffer an update of ``state`` may write in place, its lock held: the variable's
    own, or, where a reader still holds that one, a copy that becomes the variable's
    (copy-on-write). ``fix`` (a captured step) fixes the variable in its own buffer."""
    value = state.read()
    if fix:
        state.fixed = True
    if sys.getrefcount(value) > _PRIVATE_REFS and not state.fixed:
        value = state.value = value.copy()
    return value


def _update(ufunc_name: str):
    def build(ctx: KernelContext):
        xp, ufunc, result = ctx.xp, getattr(ctx.xp, ufunc_name), _result(ctx)
        fix = ctx.in_place_updates

        def fn(state, delta):
            with state.lock:
                value = state.read()
                if fix:
                    state.fixed = True
                if sys.getrefcount(value) > _PRIVATE_REFS and not state.fixed:
                    # held elsewhere: the result itself becomes the new buffer (no copy)
                    state.value = xp.asarray(ufunc(value, delta), dtype=state.dtype)
                else:
                    ufunc(value, delta, out=value)
                return result(state)

        return fn

    return build


kernel("AssignAddVariableOp")(_update("add"))
kernel("AssignSubVariableOp")(_update("subtract"))


# Levels summed one fancy-indexed add each; a run longer than this (one index repeated
# thousands of times) has the rest added by ``add.at``, which costs per row, not per level.
_LEVELS = 64


def _scatter_accumulate(xp, value, indices, updates, subtract: bool) -> None:
    """``value[indices] +=`` (or ``-=``) ``updates``, repeated indices adding up.

    ``ufunc.at`` does this element by element, and ``add.reduceat`` over rows is not much
    faster (11 ms for the 2,304 rows of 512 a sampled-softmax step scatters). Here the
    indices are sorted, and the rows of each index summed level by level: the first
    row of every run, then every run's second row added at once (one index each, so
    one fancy-indexed add), and so on, as many levels as the longest run (a frequent
    word's) up to ``_LEVELS``. The sums are applied with one fancy-indexed update, which
    sees each row once (about 2 ms for the same scatter)."""
    flat = indices.reshape(-1)
    rows = updates.reshape((flat.size,) + value.shape[1:]) if flat.size else updates
    if value.ndim < 2 or flat.size < 2 or xp.__name__ != "numpy":
        # add.at of the negated rows, not subtract.at: CuPy's takes integers only (and
        # x + (-u) is x - u to the bit).
        xp.add.at(value, indices, -updates if subtract else updates)
        return
    order = xp.argsort(flat, kind="stable")
    ordered = flat[order]
    first = xp.concatenate(([True], ordered[1:] != ordered[:-1]))
    starts = xp.flatnonzero(first)
    run = xp.cumsum(first) - 1  # each sorted row's run
    level = xp.arange(flat.size) - starts[run]  # its place in its run
    by_level = xp.argsort(level, kind="stable")
    sums = rows[order[starts]]
    end = starts.size
    for count in xp.bincount(level)[1:_LEVELS]:
        at = by_level[end : end + count]
        end += count
        sums[run[at]] += rows[order[at]]
    if end < flat.size:  # runs longer than _LEVELS: the rest row by row
        at = by_level[end:]
        xp.add.at(sums, run[at], rows[order[at]])
    where = ordered[starts]
    if subtract:
        value[where] -= sums
    else:
        value[where] += sums


def _scatter(how: str):
    def build(ctx: KernelContext):
        xp, result = ctx.xp, _result(ctx)

        fix = ctx.in_place_updates

        def fn(state, indices, updates):
            with state.lock:
                value = writable(state, fix)
                if how == "update":
                    value[indices] = updates
                else:
                    _scatter_accumulate(xp, value, indices, updates, how == "sub")
                return result(state)

        return fn

    return build


kernel("ResourceScatterAdd")(_scatter("add"))
kernel("ResourceScatterSub")(_scatter("sub"))
kernel("ResourceScatterUpdate")(_scatter("update"))
