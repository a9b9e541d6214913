"""State that outlives a step: variables and queues, owned by a session (or a PS task)."""

from __future__ import annotations

import threading
from typing import Any


class UninitializedError(RuntimeError):
    pass


class VariableState:
    """A variable's buffer. Updates take ``lock`` so concurrent steps never lose one.

    ``fixed``: a captured CUDA graph reads and writes this very buffer, so every update
    writes into it, even where a reader still holds it (copy-on-write would leave the
    graph with a stale buffer)."""

    __slots__ = ("name", "dtype", "shape", "value", "lock", "fixed")

    def __init__(self, name: str, dtype, shape):
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.value: Any = None
        self.lock = threading.Lock()
        self.fixed = False

    def read(self):
        value = self.value
        if value is None:
            raise UninitializedError(
                f"variable {self.name!r} is read before it is initialized "
                "(run its initializer, e.g. global_variables_initializer())"
            )
        return value

    def __repr__(self) -> str:
        return f"<VariableState {self.name}>"


class Resources:
    """Named state of one container; the same name always yields the same object."""

    def __init__(self, checkpoint_root: str | None = None):
        self._items: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Where checkpoint ops may write (a job's checkpoint URI): None, anywhere.
        self.checkpoint_root = checkpoint_root

    def get_or_create(self, name: str, factory):
        with self._lock:
            if self._closed:  # a step compiled during close() must not revive state
                raise RuntimeError(f"resource {name!r} requested after its session was closed")
            item = self._items.get(name)
            if item is None:
                item = self._items[name] = factory()
            return item

    def variable(self, name: str, dtype, shape) -> VariableState:
        return self.get_or_create(name, lambda: VariableState(name, dtype, shape))

    def get(self, name: str):
        return self._items.get(name)

    def items(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._items.items())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for item in self._items.values():
                close = getattr(item, "close", None)
                if close is not None:
                    close(cancel_pending_enqueues=True)
            self._items.clear()
