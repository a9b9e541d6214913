"""Iterator state: an input pipeline behind a handle, read one element per ``get_next``.

The pipeline itself (sources, map workers, shuffle buffers, prefetch threads) is Python
that the process building the graph defines (``flowmill.runtime.data``); an op's attrs
cannot carry it, so, as TensorFlow's ``py_func`` does with its token, the op names it by
a token that process registered here (``register_dataset``). The iterator ops therefore
run only in that process: they are placed on the task that runs the script, never sent
to another task.

``IteratorState`` keeps the one thing the rest of a job needs to know about the stream:
its position, the number of elements delivered so far. ``seek`` puts the stream at any
position (the pipeline is rebuilt there when next read, fast-forwarding
deterministically), which is how a restored job resumes its data where it stood and how
an initializable iterator starts again at 0.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Protocol

import numpy as np

from .cancellation import Cancellation, CancelledError
from .fifo_queue import OutOfRangeError
from .registry import KernelContext, kernel, step_cancellation
from .resources import UninitializedError

_HOST = "the input pipeline runs on host threads"


class Pipeline(Protocol):
    """An opened pipeline: ``next`` returns one element (a tuple of arrays) or None at
    the end; it may wait, and then ends early when ``cancellation`` is cancelled."""

    def next(self, cancellation: Cancellation | None) -> tuple | None: ...

    def close(self) -> None: ...


class Opener(Protocol):
    """What a graph's iterator registers: ``open(position, name)`` builds the pipeline
    standing at ``position`` (elements already delivered); ``label`` names it in errors."""

    label: str

    def open(self, position: int, name: str) -> Pipeline: ...


# token -> opener. Weak: the graph that built the iterator keeps its opener alive, and a
# graph that is gone takes its pipeline definition (and the arrays it holds) with it.
_DATASETS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_tokens = itertools.count()
_tokens_lock = threading.Lock()


def register_dataset(opener: Opener) -> str:
    """Register ``opener`` for the iterator ops of this process; returns its token."""
    with _tokens_lock:
        token = f"dataset-{next(_tokens)}"
        _DATASETS[token] = opener
    return token


def lookup_dataset(token: str, op_name: str) -> Opener:
    opener = _DATASETS.get(token)
    if opener is None:
        raise RuntimeError(
            f"iterator op {op_name!r}: its dataset ({token!r}) is not defined in this process. "
            "An iterator's pipeline is Python of the process that built the graph, so its ops "
            "run only on the task running the script (and only while that graph exists)"
        )
    return opener


class IteratorState:
    """One iterator's stream and position, shared by the steps of a session.

    ``get_next`` calls are served one at a time, in order. ``close`` (the session or the
    task's server closing) stops the pipeline's threads and wakes a ``get_next`` waiting on
    them, which then raises ``CancelledError``. An ``initializable`` iterator is read only
    after a first ``seek`` (its initializer), as in TensorFlow.
    """

    def __init__(self, name: str, opener: Opener, initializable: bool = False):
        self.name = name
        self.opener = opener
        self._initialized = not initializable
        self._position = 0
        self._pipeline: Pipeline | None = None
        self._ended = False
        self._closed = False
        self._reading = threading.Lock()  # one get_next or seek at a time
        self._lock = threading.Lock()  # the pipeline and closed flag, never held while waiting

    @property
    def position(self) -> int:
        """Elements delivered since the stream started (or the position last sought)."""
        return self._position

    def get_next(self, cancellation: Cancellation | None = None) -> tuple:
        with self._reading:
            with self._lock:
                if self._closed:
                    raise CancelledError(f"iterator {self.name!r} is closed")
                if not self._initialized:
                    raise UninitializedError(
                        f"iterator {self.name!r} is read before it is initialized "
                        "(run its initializer first)"
                    )
                if self._ended:
                    raise self._end_error()
                pipeline = self._pipeline
                if pipeline is None:
                    pipeline = self._pipeline = self.opener.open(self._position, self.name)
            element = pipeline.next(cancellation)
            if element is None:
                self._ended = True
                raise self._end_error()
            self._position += 1
            return element

    def _end_error(self) -> OutOfRangeError:
        return OutOfRangeError(
            f"End of sequence: iterator {self.name!r} over {self.opener.label} has no elements "
            f"after the first {self._position}"
        )

    def seek(self, position: int) -> None:
        """Stand at ``position``: the next ``get_next`` returns element ``position`` of the
        stream (the pipeline is rebuilt there unless it already stands there unread)."""
        if position < 0:
            raise ValueError(f"iterator {self.name!r}: cannot seek to position {position}")
        with self._reading:
            with self._lock:
                if self._closed:
                    raise CancelledError(f"iterator {self.name!r} is closed")
                fresh = self._pipeline is None and not self._ended and self._initialized
                self._initialized = True
                if fresh and position == self._position:
                    return
                old, self._pipeline = self._pipeline, None
                self._position, self._ended = int(position), False
            if old is not None:
                old.close()

    def close(self, cancel_pending_enqueues: bool = True) -> None:
        """Stop the pipeline (``Resources.close`` calls this with the queues' signature)."""
        with self._lock:
            self._closed = True
            pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()

    def __repr__(self) -> str:
        return f"<IteratorState {self.name!r} at {self._position} over {self.opener.label}>"


def get_iterator(resources: Any, key: str, opener: Opener, initializable: bool = False,
                 name: str | None = None) -> IteratorState:
    """The iterator kept in ``resources`` under ``key``, made on first use (``name``, its
    op's, is what errors call it)."""
    state = resources.get_or_create(
        key, lambda: IteratorState(name or key, opener, initializable)
    )
    if not isinstance(state, IteratorState):
        raise TypeError(
            f"resource {key!r} is a {type(state).__name__}, not an iterator; "
            "give the iterator another shared_name"
        )
    if state.opener is not opener:
        raise ValueError(
            f"an iterator shared as {key!r} over {state.opener.label} already exists here; "
            f"this one reads {opener.label}: give it another shared_name"
        )
    return state


@kernel("IteratorV2", host_only=_HOST)
def _iterator(ctx: KernelContext):
    attrs = ctx.attrs
    opener = lookup_dataset(attrs["dataset"], ctx.name)
    key = attrs["shared_name"] or ctx.name
    state = get_iterator(ctx.resources, key, opener, bool(attrs["initializable"]), ctx.name)
    return lambda: state


@kernel("IteratorGetNext", frame=True, host_only=_HOST)
def _get_next(ctx: KernelContext):
    if len(ctx.output_dtypes) == 1:
        return lambda frame, state: state.get_next(step_cancellation(frame))[0]
    return lambda frame, state: state.get_next(step_cancellation(frame))


@kernel("IteratorSeek", host_only=_HOST)
def _seek(ctx: KernelContext):
    def fn(state, position):
        state.seek(int(position))

    return fn


@kernel("IteratorPosition", host_only=_HOST)
def _position(ctx: KernelContext):
    return lambda state: np.asarray(state.position, dtype=np.int64)
