"""Queues: bounded FIFO state shared by the steps of a session (paper section 3.1).

A queue decouples the steps that produce input from the steps that consume it: an enqueue
blocks while the queue is full (backpressure on the producer), a dequeue blocks while it is
empty. Callers waiting on either side are served in arrival order, so the elements of one
``enqueue_many`` stay together and one ``dequeue_many`` takes consecutive elements, even
when a batch is larger than the capacity and has to move through the queue in pieces.

One ``threading.Condition`` guards everything; every change notifies all waiters, which
re-check their own condition (a queue rarely has more than a handful of waiters).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import shapes
from .cancellation import Cancellation, waking
from .shapes import Shape

Element = tuple  # one array per component


class QueueClosedError(RuntimeError):
    """An enqueue into a closed queue, or a pending enqueue cancelled by ``close``."""


class OutOfRangeError(RuntimeError):
    """A dequeue from a closed queue that holds fewer elements than requested."""


class QueueArgumentError(ValueError):
    """Values whose dtype or shape the queue's components do not accept."""


class FIFOQueueState:
    """The queue itself: a deque of element tuples plus its waiting callers."""

    def __init__(
        self,
        name: str,
        component_types: Sequence,
        component_shapes: Sequence | None = None,
        capacity: int = -1,
    ):
        if not component_types:
            raise QueueArgumentError(f"queue {name!r} needs at least one component type")
        self.name = name
        self.dtypes: tuple[np.dtype, ...] = tuple(np.dtype(t) for t in component_types)
        if component_shapes is None or len(component_shapes) == 0:
            self.shapes: tuple[Shape, ...] | None = None
        else:
            if len(component_shapes) != len(self.dtypes):
                raise QueueArgumentError(
                    f"queue {name!r}: {len(self.dtypes)} component types but "
                    f"{len(component_shapes)} shapes"
                )
            self.shapes = tuple(shapes.as_shape(s) for s in component_shapes)
        self.capacity = int(capacity) if capacity is not None and capacity > 0 else -1
        self._items: deque[Element] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._cancelled = False
        # Tokens of the callers in line; the head is the one being served.
        self._enqueuers: deque[object] = deque()
        self._dequeuers: deque[object] = deque()

    # ---- inspection
    def size(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting_enqueues(self) -> int:
        """Enqueue calls waiting for room (or for their turn)."""
        return len(self._enqueuers)

    @property
    def waiting_dequeues(self) -> int:
        """Dequeue calls waiting for elements (or for their turn)."""
        return len(self._dequeuers)

    def same_spec(self, component_types, component_shapes, capacity) -> bool:
        other = FIFOQueueState(self.name, component_types, component_shapes, capacity)
        return (self.dtypes, self.shapes, self.capacity) == (
            other.dtypes, other.shapes, other.capacity,
        )

    def describe(self) -> str:
        types = ", ".join(str(t) for t in self.dtypes)
        dims = "unknown" if self.shapes is None else ", ".join(map(shapes.fmt, self.shapes))
        cap = "unbounded" if self.capacity < 0 else str(self.capacity)
        return f"types [{types}], shapes [{dims}], capacity {cap}"

    # ---- validation
    def check(self, values: Sequence, batched: bool = False) -> int:
        """Raise unless ``values`` fit the components; return the batch size (1 unbatched)."""
        if len(values) != len(self.dtypes):
            raise QueueArgumentError(
                f"queue {self.name!r} has {len(self.dtypes)} components, "
                f"got {len(values)} values"
            )
        n = 1
        for i, v in enumerate(values):
            if v.dtype != self.dtypes[i]:
                raise QueueArgumentError(
                    f"queue {self.name!r} component {i} has dtype {self.dtypes[i]}, "
                    f"value has {v.dtype}"
                )
            shape = v.shape
            if batched:
                if not shape:
                    raise QueueArgumentError(
                        f"queue {self.name!r} component {i}: enqueue_many needs values with a "
                        "leading batch dimension, got a scalar"
                    )
                if i == 0:
                    n = shape[0]
                elif shape[0] != n:
                    raise QueueArgumentError(
                        f"queue {self.name!r}: enqueue_many components differ in batch size "
                        f"(component 0 has {n}, component {i} has {shape[0]})"
                    )
                shape = shape[1:]
            want = None if self.shapes is None else self.shapes[i]
            if not shapes.compatible(want, shape):
                raise QueueArgumentError(
                    f"queue {self.name!r} component {i} has shape {shapes.fmt(want)}, "
                    f"value{' rows have' if batched else ' has'} shape {shapes.fmt(shape)}"
                )
        return n

    # ---- producers
    def enqueue(self, element: Element) -> None:
        """Add one element, waiting while the queue is full."""
        cond = self._cond
        with cond:
            if self._closed:
                raise QueueClosedError(f"queue {self.name!r} is closed; cannot enqueue")
            if not self._enqueuers and (self.capacity < 0 or len(self._items) < self.capacity):
                self._items.append(element)
                cond.notify_all()
                return
        self.enqueue_many([element])

    def enqueue_many(self, elements: Sequence[Element]) -> None:
        """Add ``elements`` in order, as room appears; no other enqueue interleaves with them."""
        cond = self._cond
        with cond:
            if self._closed:
                raise QueueClosedError(f"queue {self.name!r} is closed; cannot enqueue")
            if not elements:
                return
            token = object()
            self._enqueuers.append(token)
            try:
                done = 0
                while True:
                    if self._cancelled:
                        raise QueueClosedError(
                            f"queue {self.name!r} was closed while an enqueue waited for room "
                            f"({done} of {len(elements)} elements enqueued); "
                            "the rest was cancelled"
                        )
                    if self._enqueuers[0] is token:
                        room = len(elements) - done
                        if self.capacity >= 0:
                            room = min(room, self.capacity - len(self._items))
                        if room > 0:
                            self._items.extend(elements[done:done + room])
                            done += room
                            cond.notify_all()
                            if done == len(elements):
                                return
                    cond.wait()
            finally:
                self._enqueuers.remove(token)
                cond.notify_all()

    # ---- consumers
    def dequeue(self, cancellation: Cancellation | None = None) -> Element:
        """Remove the oldest element, waiting while the queue is empty."""
        cond = self._cond
        with cond:
            if self._items and not self._dequeuers:
                element = self._items.popleft()
                cond.notify_all()
                return element
        return self.dequeue_many(1, cancellation)[0]

    def dequeue_many(self, n: int, cancellation: Cancellation | None = None) -> list[Element]:
        """Remove the ``n`` oldest elements, taking them as they arrive.

        After ``close`` the remaining elements can still be drained; a request the queue
        can no longer fill puts back what it took and raises ``OutOfRangeError``. A
        ``cancellation`` of the step waiting here puts back what it took and raises
        ``CancelledError``.
        """
        if n < 0:
            raise QueueArgumentError(f"queue {self.name!r}: cannot dequeue {n} elements")
        with waking(cancellation, self._cond):
            return self._dequeue_many(n, cancellation)

    def _dequeue_many(self, n: int, cancellation: Cancellation | None) -> list[Element]:
        cond = self._cond
        with cond:
            token = object()
            self._dequeuers.append(token)
            taken: list[Element] = []
            try:
                while True:
                    if cancellation is not None and cancellation.cancelled:
                        self._items.extendleft(reversed(taken))
                        taken = []
                        cancellation.check(f"dequeuing from queue {self.name!r}")
                    if self._dequeuers[0] is token:
                        items = self._items
                        if items and len(taken) < n:
                            while items and len(taken) < n:
                                taken.append(items.popleft())
                            cond.notify_all()
                        if len(taken) == n:
                            return taken
                        if self._closed and (self._cancelled or not self._enqueuers):
                            items.extendleft(reversed(taken))
                            have = len(items)
                            taken = []
                            raise OutOfRangeError(
                                f"queue {self.name!r} is closed and has {have} elements, "
                                f"{n} requested"
                            )
                    cond.wait()
            finally:
                self._dequeuers.remove(token)
                cond.notify_all()

    def close(self, cancel_pending_enqueues: bool = False) -> None:
        """Refuse further enqueues; waiting dequeues drain what is left, then fail.

        Enqueues already waiting for room still complete unless ``cancel_pending_enqueues``
        is set, which makes them raise instead (a closing session does this, so that no
        caller stays blocked on state that is going away).
        """
        with self._cond:
            self._closed = True
            if cancel_pending_enqueues:
                self._cancelled = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"<FIFOQueueState {self.name!r} size={len(self._items)} {self.describe()}>"


def get_queue(resources: Any, name: str, component_types, component_shapes, capacity):
    """The queue named ``name`` in ``resources``, made on first use; a clash is an error."""
    queue = resources.get_or_create(
        name, lambda: FIFOQueueState(name, component_types, component_shapes, capacity)
    )
    if not isinstance(queue, FIFOQueueState):
        raise QueueArgumentError(
            f"resource {name!r} is a {type(queue).__name__}, not a queue; "
            "give the queue another shared_name"
        )
    if not queue.same_spec(component_types, component_shapes, capacity):
        wanted = FIFOQueueState(name, component_types, component_shapes, capacity)
        raise QueueArgumentError(
            f"queue {name!r} already exists with {queue.describe()}; "
            f"this op asks for {wanted.describe()}"
        )
    return queue
