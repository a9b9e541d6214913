"""Accumulator and staleness-clock kernels. The state lives in the step's ``Resources``.

A dense take returns the accumulator's own sum buffer, divided in place: the accumulator
starts a fresh buffer with the next gradient, so the average costs no copy. A sparse take
merges the rows of every gradient it took with one sort (``unique``) and one scatter-add.
"""

from __future__ import annotations

from .conditional_accumulator import get_accumulator, get_staleness_clock
from .registry import KernelContext, kernel, step_cancellation

_HOST = "coordination state: taken, waited on and counted on the host"


def _accumulator_handle(kind: str):
    def build(ctx: KernelContext):
        a = ctx.attrs
        state = get_accumulator(
            ctx.resources, a["shared_name"] or ctx.name, kind, a["dtype"], a["shape"]
        )
        return lambda: state

    return build


kernel("ConditionalAccumulator")(_accumulator_handle("dense"))
kernel("SparseConditionalAccumulator")(_accumulator_handle("sparse"))


@kernel("AccumulatorApplyGradient", host_only=_HOST)
def _apply(ctx: KernelContext):
    asarray, worker = ctx.xp.asarray, int(ctx.attrs.get("worker", -1))

    def fn(state, local_step, gradient):
        state.apply(int(local_step), asarray(gradient), worker)

    return fn


@kernel("SparseAccumulatorApplyGradient", host_only=_HOST)
def _sparse_apply(ctx: KernelContext):
    asarray, worker = ctx.xp.asarray, int(ctx.attrs.get("worker", -1))

    def fn(state, local_step, indices, values):
        state.apply(int(local_step), asarray(indices), asarray(values), worker)

    return fn


@kernel("AccumulatorTakeGradient", frame=True, host_only=_HOST)
def _take(ctx: KernelContext):
    divide = ctx.xp.divide

    def fn(frame, state, num_required):
        count, total = state.take(int(num_required), step_cancellation(frame))
        return divide(total, count, out=total)

    return fn


@kernel("SparseAccumulatorTakeGradient", frame=True, host_only=_HOST)
def _sparse_take(ctx: KernelContext):
    xp = ctx.xp

    def fn(frame, state, num_required):
        count, (indices, values) = state.take(int(num_required), step_cancellation(frame))
        all_indices = xp.concatenate(indices) if len(indices) > 1 else indices[0]
        all_values = xp.concatenate(values) if len(values) > 1 else values[0]
        rows, where = xp.unique(all_indices, return_inverse=True)
        summed = xp.zeros((rows.shape[0], *all_values.shape[1:]), dtype=all_values.dtype)
        xp.add.at(summed, where.reshape(-1), all_values)
        summed /= count
        return rows.astype(xp.int64, copy=False), summed

    return fn


@kernel("AccumulatorWaitReady", frame=True, host_only=_HOST)
def _wait_ready(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]

    def fn(frame, state, num_required):
        step = state.wait_ready(int(num_required), step_cancellation(frame))
        return xp.asarray(step, dtype=dtype)

    return fn


@kernel("AccumulatorStep", host_only=_HOST)
def _step(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]
    return lambda state: xp.asarray(state.global_step, dtype=dtype)


@kernel("AccumulatorSetGlobalStep", host_only=_HOST)
def _set_global_step(ctx: KernelContext):
    def fn(state, step):
        state.set_global_step(int(step))

    return fn


@kernel("AccumulatorReset", host_only=_HOST)
def _reset(ctx: KernelContext):
    def fn(state, step):
        state.reset(int(step))

    return fn


@kernel("AccumulatorNumAccumulated", host_only=_HOST)
def _num_accumulated(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]
    return lambda state: xp.asarray(state.num_accumulated(), dtype=dtype)


@kernel("AccumulatorNumDropped", host_only=_HOST)
def _num_dropped(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]
    return lambda state: xp.asarray(state.num_dropped(), dtype=dtype)


@kernel("StalenessClock", host_only=_HOST)
def _clock(ctx: KernelContext):
    a = ctx.attrs
    state = get_staleness_clock(
        ctx.resources, a["shared_name"] or ctx.name, a["num_workers"], a["staleness"]
    )
    return lambda: state


@kernel("StalenessClockAdvance", host_only=_HOST)
def _advance(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]
    return lambda state, worker: xp.asarray(state.advance(int(worker)), dtype=dtype)


@kernel("WaitForStaleness", frame=True, host_only=_HOST)
def _wait(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]

    def fn(frame, state, worker, step):
        slowest = state.wait(int(worker), int(step), step_cancellation(frame))
        return xp.asarray(slowest, dtype=dtype)

    return fn


@kernel("StalenessClockRead", host_only=_HOST)
def _read_clock(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]
    return lambda state: xp.asarray(state.clocks(), dtype=dtype)
