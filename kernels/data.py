"""Queue kernels. The queue lives in the step's ``Resources``; kernels only move arrays.

Enqueued values are copied: an input may be a caller's feed buffer or a variable's live
buffer, and either can change after the step while the element waits in the queue.
Batches are split into row views of one copy and stacked again on ``dequeue_many``.
"""

from __future__ import annotations

from .fifo_queue import QueueArgumentError, get_queue
from .registry import KernelContext, kernel, step_cancellation

_HOST = "a queue holds values between steps and tasks in host memory"


@kernel("FIFOQueueV2", host_only=_HOST)
def _fifo_queue(ctx: KernelContext):
    attrs = ctx.attrs
    queue = get_queue(
        ctx.resources,
        attrs["shared_name"] or ctx.name,
        attrs["component_types"],
        attrs["shapes"],
        attrs["capacity"],
    )
    return lambda: queue


@kernel("QueueEnqueueV2", host_only=_HOST)
def _enqueue(ctx: KernelContext):
    array = ctx.xp.array

    def fn(queue, *values):
        queue.check(values)
        queue.enqueue(tuple(array(v, copy=True) for v in values))

    return fn


@kernel("QueueEnqueueManyV2", host_only=_HOST)
def _enqueue_many(ctx: KernelContext):
    array = ctx.xp.array

    def fn(queue, *values):
        n = queue.check(values, batched=True)
        if n:
            batch = [array(v, copy=True) for v in values]
            # ``[j, ...]`` keeps scalar rows as 0-d arrays (plain iteration yields scalars).
            queue.enqueue_many([tuple(c[j, ...] for c in batch) for j in range(n)])

    return fn


@kernel("QueueDequeueV2", frame=True, host_only=_HOST)
def _dequeue(ctx: KernelContext):
    if len(ctx.output_dtypes) == 1:
        return lambda frame, queue: queue.dequeue(step_cancellation(frame))[0]
    return lambda frame, queue: queue.dequeue(step_cancellation(frame))


@kernel("QueueDequeueManyV2", frame=True, host_only=_HOST)
def _dequeue_many(ctx: KernelContext):
    xp = ctx.xp
    fixed_n = ctx.attrs["n"]
    single = len(ctx.output_dtypes) == 1

    def empty(queue):
        """Zero elements still have a shape when the queue's shapes are fully known."""
        out = []
        for i, dtype in enumerate(queue.dtypes):
            shape = None if queue.shapes is None else queue.shapes[i]
            if shape is None or None in shape:
                raise QueueArgumentError(
                    f"queue {queue.name!r}: dequeue_many(0) needs fully known component shapes, "
                    f"component {i} has shape {'<unknown>' if shape is None else shape}"
                )
            out.append(xp.empty((0, *shape), dtype=dtype))
        return out

    def stack(queue, elements, i):
        try:
            return xp.stack([e[i] for e in elements])
        except ValueError:
            seen = sorted({tuple(e[i].shape) for e in elements})
            raise QueueArgumentError(
                f"queue {queue.name!r} component {i}: cannot stack elements of shapes {seen} "
                "(give the queue fixed shapes to reject them at enqueue)"
            ) from None

    def fn(frame, queue, n=None):
        count = fixed_n if n is None else int(n)
        elements = queue.dequeue_many(count, step_cancellation(frame))
        if not elements:
            out = empty(queue)
        else:
            out = [stack(queue, elements, i) for i in range(len(queue.dtypes))]
        return out[0] if single else tuple(out)

    return fn


@kernel("QueueCloseV2", host_only=_HOST)
def _close(ctx: KernelContext):
    cancel = bool(ctx.attrs["cancel_pending_enqueues"])

    def fn(queue):
        queue.close(cancel_pending_enqueues=cancel)

    return fn


@kernel("QueueSizeV2", host_only=_HOST)
def _size(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]
    return lambda queue: xp.asarray(queue.size(), dtype=dtype)
