"""The rendezvous: where a ``_Send`` and its ``_Recv`` meet, one key per tensor per step.

A key is ``src_device;dst_device;tensor_name;step_id`` (TensorFlow's key without the
incarnation and frame parts: a restarted task gets a new server, and loops never cross
devices here). Whichever side comes first leaves its half in the table: a sent value, or a
waiting receiver that the send completes. Each key is used once, so a second send (or a
second receiver) is a bug in the partition and fails loudly instead of silently pairing
the wrong values.

Finished keys leave a small tombstone until ``cleanup(step_id)``, which is what lets a late
duplicate be reported; a long-running task must therefore clean up every step once *all*
tasks are done with it (a producer finishes its step before its consumers have pulled its
values, so cleaning up when the local partition returns would drop them).

One lock guards the table; a waiting receiver blocks on its own latch (a bare lock), so a
send wakes exactly its receiver and nothing else contends.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

_SEP = ";"
_FINISHED_STEPS_KEPT = 4096  # cleaned-up step ids remembered to refuse stragglers


class RendezvousKey(NamedTuple):
    src_device: str
    dst_device: str
    tensor_name: str
    step_id: int


class RendezvousError(RuntimeError):
    """Misuse of a key: sent twice, received twice, or used after its step was cleaned up."""


class DuplicateKeyError(RendezvousError):
    pass


class StepCancelledError(RendezvousError):
    pass


def make_key(src_device: str, dst_device: str, tensor_name: str, step_id: int) -> str:
    """The key both sides of a cut edge compute independently from the same attrs."""
    key = f"{src_device}{_SEP}{dst_device}{_SEP}{tensor_name}{_SEP}{int(step_id)}"
    parse_key(key)  # the same checks the receiving server applies
    return key


def parse_key(key: str) -> RendezvousKey:
    """Split and check a key; raises ValueError naming the key and what is wrong with it."""
    if not isinstance(key, str):
        raise ValueError(f"rendezvous key must be a str, got {type(key).__name__}")
    parts = key.split(_SEP)
    if len(parts) != 4:
        raise ValueError(
            f"rendezvous key {key!r} has {len(parts)} fields; expected "
            "'src_device;dst_device;tensor_name;step_id'"
        )
    src, dst, name, step = parts
    for field, part in (("src_device", src), ("dst_device", dst)):
        if not part.startswith("/"):
            raise ValueError(f"rendezvous key {key!r}: {field} {part!r} is not a device name")
    if not name:
        raise ValueError(f"rendezvous key {key!r}: empty tensor name")
    if not step.isdigit() or not step.isascii():
        raise ValueError(f"rendezvous key {key!r}: step id {step!r} is not a non-negative integer")
    return RendezvousKey(src, dst, name, int(step))


def _step_of(key: str) -> str:
    i = key.rfind(_SEP)
    if i < 0:
        raise ValueError(f"rendezvous key {key!r} has no step id (expected 'src;dst;tensor;step')")
    return key[i + 1 :]


class PendingRecv:
    """A receiver registered for one key: completed once, by a send, an abort or a cancel.

    ``on_done(pending)``, when given, is called right after completion, on the thread that
    completed it (the sender's, mostly): a server answers a remote receiver from there,
    without waking a thread of its own. It must not raise, and must be quick or hand off."""

    __slots__ = ("key", "_latch", "_value", "_error", "on_done")

    def __init__(self, key: str, value: Any = None, done: bool = False,
                 on_done: Callable[[PendingRecv], None] | None = None):
        self.key = key
        self._value = value
        self._error: BaseException | None = None
        self._latch: threading.Lock | None = None
        self.on_done = on_done
        if not done:
            self._latch = threading.Lock()
            self._latch.acquire()

    @property
    def done(self) -> bool:
        return self._latch is None or not self._latch.locked()

    def wait(self, timeout: float | None = None) -> bool:
        """True once completed; False if ``timeout`` seconds passed first."""
        latch = self._latch
        if latch is None:
            return True
        if latch.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            latch.release()  # leave it open: later waits return at once
            return True
        return False

    def result(self) -> Any:
        """The received value, or the error that ended the wait (call after ``wait``)."""
        if self._error is not None:
            raise self._error
        return self._value

    def _complete(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self._latch.release()
        if self.on_done is not None:
            self.on_done(self)


_ABSENT = object()
_CONSUMED = object()  # tombstone: the key was sent and received


class Rendezvous:
    """A thread-safe table of keys, each carrying one value from one send to one recv."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[str, dict[str, Any]] = {}
        self._error: BaseException | None = None
        self._finished: set[str] = set()
        self._finished_order: deque[str] = deque()

    def _entries(self, key: str) -> dict[str, Any]:
        """The table of ``key``'s step (lock held)."""
        if self._error is not None:
            raise self._error
        step = _step_of(key)
        entries = self._steps.get(step)
        if entries is None:
            if step in self._finished:
                raise StepCancelledError(
                    f"rendezvous key {key!r} belongs to step {step}, which was already cleaned up"
                )
            entries = self._steps[step] = {}
        return entries

    def send(self, key: str, value: Any) -> None:
        """Hand ``value`` to the receiver of ``key`` (now, or whenever it comes). Never blocks."""
        with self._lock:
            entries = self._entries(key)
            entry = entries.get(key, _ABSENT)
            if entry is _ABSENT:
                entries[key] = value
                return
            if type(entry) is not PendingRecv:
                raise DuplicateKeyError(f"rendezvous key {key!r} was sent twice")
            entries[key] = _CONSUMED
        entry._complete(value, None)

    def start_recv(self, key: str,
                   on_done: Callable[[PendingRecv], None] | None = None) -> PendingRecv:
        """Register a receiver for ``key`` without blocking; wait on the returned handle,
        or have ``on_done`` called when it completes (see ``PendingRecv``; not called for
        a handle that is done on return, nor for one withdrawn by ``cancel_recv`` without
        an error). Servers use this to answer remote receivers."""
        with self._lock:
            entries = self._entries(key)
            entry = entries.get(key, _ABSENT)
            if entry is _ABSENT:
                pending = entries[key] = PendingRecv(key, on_done=on_done)
                return pending
            if type(entry) is PendingRecv or entry is _CONSUMED:
                raise DuplicateKeyError(f"rendezvous key {key!r} was received twice")
            entries[key] = _CONSUMED
        return PendingRecv(key, entry, done=True)

    def cancel_recv(self, pending: PendingRecv, error: BaseException | None = None) -> bool:
        """Withdraw a receiver that no send has completed yet; the key is free again. With
        ``error``, the handle completes with it (waking its waiter). False when too late:
        the handle is, or is about to be, completed with a value."""
        step = _step_of(pending.key)
        with self._lock:
            entries = self._steps.get(step)
            if entries is None or entries.get(pending.key) is not pending:
                return False
            del entries[pending.key]
        if error is not None:
            pending._complete(None, error)
        return True

    def recv(self, key: str, timeout: float | None = None) -> Any:
        """The value sent under ``key``, waiting up to ``timeout`` seconds (None: forever)."""
        with self._lock:  # fast path: the value is already here
            entries = self._entries(key)
            entry = entries.get(key, _ABSENT)
            if entry is not _ABSENT and type(entry) is not PendingRecv and entry is not _CONSUMED:
                entries[key] = _CONSUMED
                return entry
        pending = self.start_recv(key)
        if not pending.wait(timeout):
            if self.cancel_recv(pending):
                raise TimeoutError(f"rendezvous: no value was sent for key {key!r} in {timeout}s")
            pending.wait()  # a send won the race; its value is on the way
        return pending.result()

    def abort(self, error: BaseException) -> None:
        """Fail every waiting and every future send/recv with ``error`` (the first abort wins),
        so that a dead peer or a failed partition cannot leave receivers hanging."""
        with self._lock:
            if self._error is None:
                self._error = error
            error = self._error
            waiters = [
                e for t in self._steps.values() for e in t.values() if type(e) is PendingRecv
            ]
            self._steps.clear()
        for pending in waiters:
            pending._complete(None, error)

    @property
    def aborted(self) -> BaseException | None:
        return self._error

    def cleanup(self, step_id: int) -> int:
        """Drop everything left of a finished step: unreceived values and tombstones go, and
        waiters fail with StepCancelledError. Later sends/recvs of that step are refused.
        Returns how many entries were dropped."""
        step = str(int(step_id))
        with self._lock:
            entries = self._steps.pop(step, None) or {}
            if step not in self._finished:
                self._finished.add(step)
                self._finished_order.append(step)
                if len(self._finished_order) > _FINISHED_STEPS_KEPT:
                    self._finished.discard(self._finished_order.popleft())
        for key, entry in entries.items():
            if type(entry) is PendingRecv:
                entry._complete(
                    None, StepCancelledError(f"step {step} was cleaned up while {key!r} waited")
                )
        return len(entries)

    def num_waiting(self) -> int:
        """Receivers currently blocked (lets tests and servers observe waiting, not guess)."""
        with self._lock:
            return sum(type(e) is PendingRecv for t in self._steps.values() for e in t.values())

    def __len__(self) -> int:
        """Values sent and not yet received."""
        with self._lock:
            return sum(
                e is not _CONSUMED and type(e) is not PendingRecv
                for t in self._steps.values()
                for e in t.values()
            )
