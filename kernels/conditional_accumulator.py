"""Coordination state for replicated training, kept on the parameter server (paper section 4.4).

A *conditional accumulator* collects the gradients workers compute for one variable and
hands their average to the chief once enough have arrived. Each gradient carries the
global step its worker read the parameters at; one older than the accumulator's own step
was computed on parameters that have since changed, so it is dropped and counted. Taking
the average advances the accumulator's step, which is what makes backup workers work: the
first ``m`` gradients of a step are aggregated, the ``n - m`` that arrive after the take
are stale on arrival.

When a take is already waiting, the gradient that completes its count is handed over in
the same critical section, so a gradient that arrives a moment later is not mixed in: the
chief gets exactly the first ``m``. A take that finds more than it asked for (it came
late) averages all of them, as TensorFlow's accumulator does.

A *staleness clock* bounds how far workers of asynchronous training may drift apart, as
PMLS's stale synchronous parallel model does: each worker counts the steps it finished,
and a worker may start its step ``t`` (counting from 0) only once every worker has
finished at least ``t - s`` steps. So the step a worker starts is at most ``s`` ahead of
the slowest worker's finished count; ``s = 0`` is bulk-synchronous.

Both are plain Python objects guarded by one ``threading.Condition`` each, like the
queues; both refuse new work and wake every waiter with an error when closed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np

from . import shapes
from .cancellation import Cancellation, waking
from .shapes import Shape


class CoordinationClosedError(RuntimeError):
    """Coordination state was closed (its session or task went away) while in use."""


class AccumulatorClosedError(CoordinationClosedError):
    """An accumulator was closed: a waiting take wakes with this, a later apply fails."""


class StalenessClockClosedError(CoordinationClosedError):
    """A staleness clock was closed: a waiting worker wakes with this."""


class AccumulatorArgumentError(ValueError):
    """A gradient whose dtype or shape the accumulator does not accept, or a bad count."""


class _Taker:
    """One waiting take: how many gradients it needs and, once served, what it got."""

    __slots__ = ("required", "result")

    def __init__(self, required: int):
        self.required = required
        self.result: tuple[int, Any] | None = None


class _AccumulatorBase:
    """Step bookkeeping, dropping and the take protocol; subclasses store the gradients."""

    kind = ""

    def __init__(self, name: str, dtype, shape: Shape):
        self.name = name
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise AccumulatorArgumentError(
                f"accumulator {name!r}: gradients must be floating point, got {self.dtype}"
            )
        # ``shape`` may be refined by the first gradient; the spec keeps what the ops declared.
        self.declared_shape: Shape = shapes.as_shape(shape)
        self.shape: Shape = self.declared_shape
        self._cond = threading.Condition()
        self._count = 0
        self._global_step = 0
        self._dropped = 0
        self._takers: deque[_Taker] = deque()
        self._closed = False
        self._contributors: set[int] = set()  # workers with a gradient in the pending step
        self._step_began = time.monotonic()  # when the pending step became the pending one
        self._duplicates = 0
        self._ready_needs: list[int] = []  # what each waiting wait_ready needs

    # ---- inspection
    def num_accumulated(self) -> int:
        return self._count

    def num_dropped(self) -> int:
        """Gradients refused because their step was older than the accumulator's."""
        return self._dropped

    def num_duplicates(self) -> int:
        """Gradients refused because their worker had sent one for the step already."""
        return self._duplicates

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def waiting_takes(self) -> int:
        return len(self._takers)

    @property
    def waiting_ready(self) -> int:
        """``wait_ready`` calls waiting for gradients (a sync chief's, before its takes)."""
        return len(self._ready_needs)

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> dict[str, Any]:
        """The step being accumulated: its number, how long it has been the pending one,
        the gradients in and the workers that sent them (those that said who they are), as
        JSON-ready values."""
        with self._cond:
            return {"step": self._global_step, "count": self._count,
                    "waitedSeconds": round(time.monotonic() - self._step_began, 3),
                    "workers": sorted(self._contributors),
                    "waitingTakes": len(self._takers) + len(self._ready_needs)}

    def same_spec(self, kind: str, dtype, shape) -> bool:
        return (self.kind, self.dtype, self.declared_shape) == (
            kind, np.dtype(dtype), shapes.as_shape(shape),
        )

    def describe(self) -> str:
        shape = shapes.fmt(self.declared_shape)
        return f"{self.kind} accumulator of {self.dtype}, shape {shape}"

    # ---- storage, per kind
    def _add(self, gradient) -> None:
        raise NotImplementedError

    def _release(self) -> Any:
        """Hand over what was accumulated (the caller owns it now) and start empty."""
        raise NotImplementedError

    # ---- the protocol
    def _apply(self, local_step: int, gradient, worker: int = -1) -> bool:
        with self._cond:
            if self._closed:
                raise AccumulatorClosedError(
                    f"accumulator {self.name!r} is closed; cannot apply a gradient"
                )
            if local_step < self._global_step:
                self._dropped += 1
                return False
            if worker >= 0 and worker in self._contributors and local_step == self._global_step:
                self._duplicates += 1
                return False
            self._add(gradient)
            self._count += 1
            if worker >= 0:
                self._contributors.add(worker)
            self._serve()
            if self._ready_needs and self._count >= min(self._ready_needs):
                self._cond.notify_all()  # only then: a wake-up per gradient costs a step
            return True

    def _serve(self) -> None:
        """Give the oldest waiting take what it asked for, if it is all there."""
        if self._takers and self._count >= self._takers[0].required:
            taker = self._takers.popleft()
            taker.result = (self._count, self._release())
            self._count = 0
            self._contributors.clear()
            self._global_step += 1
            self._step_began = time.monotonic()
            self._cond.notify_all()

    def take(self, num_required: int, cancellation: Cancellation | None = None
             ) -> tuple[int, Any]:
        """Wait until ``num_required`` gradients are in; return (how many, their storage).

        Takes are served in arrival order. The accumulator's step advances with each take.
        A take whose step is cancelled while it waits leaves the queue of takes and raises
        ``CancelledError``; what was accumulated stays for the next one.
        """
        if num_required < 1:
            raise AccumulatorArgumentError(
                f"accumulator {self.name!r}: num_required must be at least 1, "
                f"got {num_required}"
            )
        with self._cond:
            if self._closed:
                raise AccumulatorClosedError(
                    f"accumulator {self.name!r} is closed; cannot take gradients"
                )
            taker = _Taker(num_required)
            self._takers.append(taker)
            self._serve()
        with waking(cancellation, self._cond):
            return self._wait_for(taker, num_required, cancellation)

    def wait_ready(self, num_required: int, cancellation: Cancellation | None = None) -> int:
        """Wait until ``num_required`` gradients are in, taking none; returns the step they
        are for. A wait whose step is cancelled raises ``CancelledError``."""
        if num_required < 1:
            raise AccumulatorArgumentError(
                f"accumulator {self.name!r}: num_required must be at least 1, "
                f"got {num_required}"
            )
        with waking(cancellation, self._cond), self._cond:
            self._ready_needs.append(num_required)
            try:
                while self._count < num_required:
                    if cancellation is not None:
                        cancellation.check(
                            f"waiting for {num_required} gradients in {self.name!r}")
                    if self._closed:
                        raise AccumulatorClosedError(
                            f"accumulator {self.name!r} was closed while waiting for "
                            f"{num_required} gradients ({self._count} accumulated at step "
                            f"{self._global_step})"
                        )
                    self._cond.wait()
                return self._global_step
            finally:
                self._ready_needs.remove(num_required)

    def _wait_for(self, taker: _Taker, num_required: int,
                  cancellation: Cancellation | None) -> tuple[int, Any]:
        with self._cond:
            while taker.result is None:
                if cancellation is not None and cancellation.cancelled:
                    self._takers.remove(taker)
                    cancellation.check(f"taking {num_required} gradients from {self.name!r}")
                if self._closed:
                    self._takers.remove(taker)
                    raise AccumulatorClosedError(
                        f"accumulator {self.name!r} was closed while a take waited for "
                        f"{num_required} gradients ({self._count} accumulated at step "
                        f"{self._global_step})"
                    )
                self._cond.wait()
            return taker.result

    def reset(self, step: int) -> None:
        """Drop what is accumulated and judge later gradients against ``step``."""
        with self._cond:
            if self._closed:
                raise AccumulatorClosedError(
                    f"accumulator {self.name!r} is closed; cannot reset it"
                )
            if self._count:
                self._dropped += self._count
                self._release()
                self._count = 0
            self._contributors.clear()
            self._global_step = int(step)
            self._step_began = time.monotonic()

    def set_global_step(self, step: int) -> None:
        """Gradients already accumulated stay; later ones are judged against ``step``."""
        with self._cond:
            if self._closed:
                raise AccumulatorClosedError(
                    f"accumulator {self.name!r} is closed; cannot set its global step"
                )
            if int(step) != self._global_step:
                self._step_began = time.monotonic()
            self._global_step = int(step)

    def close(self, cancel_pending_enqueues: bool = False) -> None:
        """Refuse further use and wake every waiting take with an error.

        ``cancel_pending_enqueues`` is accepted for the session's ``Resources.close``; an
        apply never waits, so there is nothing else to cancel.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r} step={self._global_step} "
            f"accumulated={self._count} dropped={self._dropped}>"
        )


class ConditionalAccumulatorState(_AccumulatorBase):
    """Sums dense gradients in one buffer; the take divides that buffer in place."""

    kind = "dense"

    def __init__(self, name: str, dtype, shape: Shape):
        super().__init__(name, dtype, shape)
        self._sum = None

    def check(self, gradient) -> None:
        if gradient.dtype != self.dtype:
            raise AccumulatorArgumentError(
                f"accumulator {self.name!r} holds {self.dtype} gradients, got {gradient.dtype}"
            )
        if not shapes.compatible(self.shape, tuple(gradient.shape)):
            raise AccumulatorArgumentError(
                f"accumulator {self.name!r} holds gradients of shape {shapes.fmt(self.shape)}, "
                f"got shape {shapes.fmt(tuple(gradient.shape))}"
            )

    def apply(self, local_step: int, gradient, worker: int = -1) -> bool:
        """Add ``gradient`` (an array) unless it is stale; True when it was added.
        ``worker`` (>= 0) says which worker sent it."""
        self.check(gradient)
        return self._apply(local_step, gradient, worker)

    def _add(self, gradient) -> None:
        if self._sum is None:
            # The first gradient of a step is copied: later ones are added into it in place.
            self._sum = gradient.copy()
            if self.shape is None or None in self.shape:
                self.shape = tuple(gradient.shape)
        else:
            self._sum += gradient

    def _release(self):
        total, self._sum = self._sum, None
        return total


class SparseConditionalAccumulatorState(_AccumulatorBase):
    """Keeps each gradient's (indices, values); the take merges repeated rows once.

    Merging on take rather than on every apply costs one sort per step instead of one
    per gradient; the memory held is what the workers sent for that step.
    """

    kind = "sparse"

    def __init__(self, name: str, dtype, shape: Shape):
        super().__init__(name, dtype, shape)
        if self.shape is not None and len(self.shape) == 0:
            raise AccumulatorArgumentError(
                f"sparse accumulator {name!r}: shape must have rank >= 1 (rows first), got ()"
            )
        self._indices: list = []
        self._values: list = []

    def check(self, indices, values) -> None:
        label = f"sparse accumulator {self.name!r}"
        if indices.dtype.kind not in "iu":
            raise AccumulatorArgumentError(
                f"{label}: indices must be integers, got {indices.dtype}"
            )
        if values.dtype != self.dtype:
            raise AccumulatorArgumentError(
                f"{label} holds {self.dtype} gradients, got values of {values.dtype}"
            )
        if indices.ndim != 1 or values.ndim < 1 or values.shape[0] != indices.shape[0]:
            raise AccumulatorArgumentError(
                f"{label}: needs 1-D indices and values with one row per index, got indices "
                f"of shape {tuple(indices.shape)} and values of shape {tuple(values.shape)}"
            )
        row = None if self.shape is None else self.shape[1:]
        if not shapes.compatible(row, tuple(values.shape[1:])):
            raise AccumulatorArgumentError(
                f"{label} holds rows of shape {shapes.fmt(row)}, got values of shape "
                f"{tuple(values.shape)}"
            )
        rows = None if self.shape is None else self.shape[0]
        if rows is not None and indices.shape[0]:
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= rows:
                bad = low if low < 0 else high
                raise AccumulatorArgumentError(
                    f"{label}: index {bad} is out of range for {rows} rows"
                )

    def apply(self, local_step: int, indices, values, worker: int = -1) -> bool:
        """Keep copies of (indices, values) unless stale; True when they were kept."""
        self.check(indices, values)
        # Copied: the arrays may be a caller's feed buffers, reused after the step.
        return self._apply(local_step, (indices.copy(), values.copy()), worker)

    def _add(self, gradient) -> None:
        indices, values = gradient
        self._indices.append(indices)
        self._values.append(values)

    def _release(self):
        parts = (self._indices, self._values)
        self._indices, self._values = [], []
        return parts


class StalenessClockState:
    """Per-worker counts of finished steps, and the wait that bounds how far they drift."""

    def __init__(self, name: str, num_workers: int, staleness: int):
        if num_workers < 1:
            raise AccumulatorArgumentError(
                f"staleness clock {name!r}: num_workers must be at least 1, got {num_workers}"
            )
        if staleness < 0:
            raise AccumulatorArgumentError(
                f"staleness clock {name!r}: staleness must be >= 0, got {staleness}"
            )
        self.name = name
        self.num_workers = int(num_workers)
        self.staleness = int(staleness)
        self._clocks = [0] * self.num_workers
        self._slowest = 0
        self._cond = threading.Condition()
        self._waiting = 0
        self._closed = False

    def same_spec(self, num_workers: int, staleness: int) -> bool:
        return (self.num_workers, self.staleness) == (int(num_workers), int(staleness))

    def describe(self) -> str:
        return f"{self.num_workers} workers, staleness {self.staleness}"

    @property
    def waiting(self) -> int:
        """Workers blocked until the slowest catches up."""
        return self._waiting

    def clocks(self) -> list[int]:
        with self._cond:
            return list(self._clocks)

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise AccumulatorArgumentError(
                f"staleness clock {self.name!r}: worker index {worker} is out of range for "
                f"{self.num_workers} workers"
            )

    def advance(self, worker: int) -> int:
        """Record that ``worker`` finished a step; return its count of finished steps."""
        self._check_worker(worker)
        with self._cond:
            if self._closed:
                raise StalenessClockClosedError(
                    f"staleness clock {self.name!r} is closed; worker {worker} cannot finish "
                    "its step"
                )
            self._clocks[worker] += 1
            slowest = min(self._clocks)
            if slowest != self._slowest:
                self._slowest = slowest
                self._cond.notify_all()
            return self._clocks[worker]

    def wait(self, worker: int, step: int, cancellation: Cancellation | None = None) -> int:
        """Block until ``worker`` may start ``step``; return the slowest finished count."""
        self._check_worker(worker)
        with waking(cancellation, self._cond):
            return self._wait(worker, step, cancellation)

    def _wait(self, worker: int, step: int, cancellation: Cancellation | None) -> int:
        with self._cond:
            if self._closed:
                raise StalenessClockClosedError(
                    f"staleness clock {self.name!r} is closed; worker {worker} cannot start "
                    f"step {step}"
                )
            if self._slowest >= step - self.staleness:
                return self._slowest
            self._waiting += 1
            try:
                while self._slowest < step - self.staleness:
                    if cancellation is not None:
                        cancellation.check(f"worker {worker} waited to start step {step}")
                    if self._closed:
                        raise StalenessClockClosedError(
                            f"staleness clock {self.name!r} was closed while worker {worker} "
                            f"waited to start step {step} (the slowest worker has finished "
                            f"{self._slowest} steps, staleness {self.staleness})"
                        )
                    self._cond.wait()
                return self._slowest
            finally:
                self._waiting -= 1

    def close(self, cancel_pending_enqueues: bool = False) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"<StalenessClockState {self.name!r} clocks={self._clocks} s={self.staleness}>"


_KINDS = {"dense": ConditionalAccumulatorState, "sparse": SparseConditionalAccumulatorState}


def get_accumulator(resources: Any, name: str, kind: str, dtype, shape) -> _AccumulatorBase:
    """The accumulator named ``name`` in ``resources``, made on first use; a clash is an error."""
    cls = _KINDS[kind]
    acc = resources.get_or_create(name, lambda: cls(name, dtype, shape))
    if not isinstance(acc, _AccumulatorBase):
        raise AccumulatorArgumentError(
            f"resource {name!r} is a {type(acc).__name__}, not an accumulator; "
            "give the accumulator another shared_name"
        )
    if not acc.same_spec(kind, dtype, shape):
        wanted = f"{kind} accumulator of {np.dtype(dtype)}, shape {shapes.fmt(shape)}"
        raise AccumulatorArgumentError(
            f"accumulator {name!r} already exists as a {acc.describe()}; this op asks for a "
            f"{wanted}"
        )
    return acc


def get_staleness_clock(
    resources: Any, name: str, num_workers: int, staleness: int
) -> StalenessClockState:
    clock = resources.get_or_create(
        name, lambda: StalenessClockState(name, num_workers, staleness)
    )
    if not isinstance(clock, StalenessClockState):
        raise AccumulatorArgumentError(
            f"resource {name!r} is a {type(clock).__name__}, not a staleness clock; "
            "give the clock another shared_name"
        )
    if not clock.same_spec(num_workers, staleness):
        raise AccumulatorArgumentError(
            f"staleness clock {name!r} already exists with {clock.describe()}; this op asks "
            f"for {num_workers} workers, staleness {staleness}"
        )
    return clock


__all__ = [
    "AccumulatorArgumentError",
    "AccumulatorClosedError",
    "CoordinationClosedError",
    "ConditionalAccumulatorState",
    "SparseConditionalAccumulatorState",
    "StalenessClockClosedError",
    "StalenessClockState",
    "get_accumulator",
    "get_staleness_clock",
]
