"""Variable scopes and ``get_variable``: variables found by name, made once, shared on
request (TensorFlow 1.x's ``variable_scope.py``).

``get_variable("w")`` inside ``variable_scope("layer")`` names the variable ``layer/w``,
whatever name scope the ops are in. The rules are TensorFlow's: with ``reuse`` unset the
variable must not exist yet (a second layer of the same name is a bug, so it fails,
naming the variable); with ``reuse=True`` it must exist (and agree in shape and dtype);
with ``AUTO_REUSE`` it is made if missing and shared otherwise. Reuse is inherited by
nested scopes and cannot be switched off inside them (``reuse=False`` means "inherit").

Each graph has one store of the variables made this way; the stack of open scopes is
per thread, as the graph's name scopes are.

The module is ``variable_scopes``, not TensorFlow's ``variable_scope``: a submodule of
that name would replace the facade's ``fm.variable_scope`` function on the package as
soon as it was imported.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from flowmill.kernels import shapes

from . import dtypes, initializers
from .graph import Graph, GraphError, Tensor, get_default_graph
from .ops.state_ops import Variable


class _Reuse(enum.Enum):
    AUTO_REUSE = "AUTO_REUSE"

    def __repr__(self) -> str:
        return self.value


AUTO_REUSE = _Reuse.AUTO_REUSE
Reuse = bool | _Reuse | None


@dataclass
class VariableScope:
    """A scope's name (``""`` at the root), reuse mode and defaults for its variables."""

    name: str
    reuse: Reuse = None
    initializer: Callable | None = None
    dtype: np.dtype | None = None
    original_name_scope: str = ""  # the op name scope opened with it, with its "/"

    def reuse_variables(self) -> None:
        """From here on, variables of this scope are shared (``reuse=True``)."""
        self.reuse = True

    def get_variable(self, name: str, *args, **kwargs) -> Variable:
        with variable_scope(self):
            return get_variable(name, *args, **kwargs)


@dataclass
class _Store:
    """One graph's variables made by ``get_variable`` and how often each scope was opened."""

    variables: dict[str, Variable] = field(default_factory=dict)
    scope_counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_stores: weakref.WeakKeyDictionary[Graph, _Store] = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()
_local = threading.local()


def _store(graph: Graph) -> _Store:
    with _stores_lock:
        store = _stores.get(graph)
        if store is None:
            store = _stores[graph] = _Store()
        return store


def _stack(graph: Graph) -> list[VariableScope]:
    """This thread's open scopes in ``graph``, innermost last (the root is always there)."""
    stacks = getattr(_local, "stacks", None)
    if stacks is None:
        stacks = _local.stacks = weakref.WeakKeyDictionary()
    stack = stacks.get(graph)
    if stack is None:
        stack = stacks[graph] = [VariableScope("")]
    return stack


def get_variable_scope() -> VariableScope:
    """The innermost open variable scope of the default graph in this thread."""
    return _stack(get_default_graph())[-1]


def _check_reuse(reuse) -> Reuse:
    if reuse is False:
        return None  # as in TensorFlow: a scope cannot turn its parent's reuse off
    if reuse is None or reuse is True or reuse is AUTO_REUSE:
        return reuse
    raise ValueError(
        f"variable_scope: reuse must be True, False, None or AUTO_REUSE, got {reuse!r}"
    )


@contextlib.contextmanager
def variable_scope(
    name_or_scope: str | VariableScope | None,
    default_name: str | None = None,
    values=None,
    initializer: Callable | None = None,
    reuse: Reuse = None,
    dtype=None,
) -> Iterator[VariableScope]:
    """Open a variable scope, and an op name scope with it.

    ``name_or_scope`` extends the current scope's name; a ``VariableScope`` (as captured
    by ``with variable_scope(...) as scope``) re-enters that scope whatever is open now.
    Without a name, ``default_name`` is made unique (``dense``, ``dense_1``, ...). ``values``
    are the tensors the scope's ops take: they pick the graph.
    """
    reuse = _check_reuse(reuse)
    if name_or_scope is None and default_name is None:
        raise TypeError("variable_scope: pass name_or_scope or default_name")
    if name_or_scope is None and reuse is True:
        raise ValueError("variable_scope: reuse=True needs a name_or_scope, not a default_name")
    graph = _graph_of(values)
    stack, store = _stack(graph), _store(graph)
    outer = stack[-1]
    if isinstance(name_or_scope, VariableScope):
        full = name_or_scope.name
        scope = VariableScope(
            full,
            reuse or name_or_scope.reuse,
            initializer or name_or_scope.initializer,
            dtypes.as_dtype(dtype) if dtype is not None else name_or_scope.dtype,
        )
        name_scope = graph.name_scope(name_or_scope.original_name_scope or None)
    else:
        if name_or_scope is None:
            short = _unique_scope(store, outer.name, default_name)
        else:
            short = str(name_or_scope)
            if not short or short.endswith("/"):
                raise ValueError(f"variable_scope: invalid scope name {name_or_scope!r}")
        full = f"{outer.name}/{short}" if outer.name else short
        scope = VariableScope(
            full,
            reuse or outer.reuse,
            initializer or outer.initializer,
            dtypes.as_dtype(dtype) if dtype is not None else outer.dtype,
        )
        name_scope = graph.name_scope(short)
    with store.lock:
        store.scope_counts[full] = store.scope_counts.get(full, 0) + 1
    with graph.as_default(), name_scope as opened:
        scope.original_name_scope = opened
        stack.append(scope)
        try:
            yield scope
        finally:
            stack.pop()


def _graph_of(values) -> Graph:
    for v in values or ():
        if isinstance(v, Tensor):
            return v.graph
        if hasattr(v, "graph") and isinstance(v.graph, Graph):
            return v.graph
    return get_default_graph()


def _unique_scope(store: _Store, outer: str, prefix: str) -> str:
    """``prefix``, or ``prefix_1``, ``prefix_2``...: the first not yet opened under ``outer``."""
    def opened(name: str) -> bool:
        return store.scope_counts.get(f"{outer}/{name}" if outer else name, 0) > 0

    if not opened(prefix):
        return prefix
    i = 1
    while opened(f"{prefix}_{i}"):
        i += 1
    return f"{prefix}_{i}"


def get_variable(
    name: str,
    shape=None,
    dtype=None,
    initializer=None,
    trainable: bool = True,
    collections: list[str] | None = None,
) -> Variable:
    """The variable ``<scope>/<name>``: made now, or the existing one when the scope reuses.

    ``initializer`` is an initializer (``fn(shape, dtype)``, see ``initializers``), or a
    value (then ``shape`` may be left out). Without one, the scope's initializer is used,
    else Glorot uniform for floating-point variables (as TensorFlow) and zeros otherwise.
    """
    if not isinstance(name, str) or not name or name.startswith("/") or name.endswith("/"):
        raise ValueError(f"get_variable: invalid variable name {name!r}")
    graph = get_default_graph()
    scope = _stack(graph)[-1]
    full = f"{scope.name}/{name}" if scope.name else name
    dtype = dtypes.as_dtype(dtype) if dtype is not None else scope.dtype
    store = _store(graph)
    with store.lock:
        existing = store.variables.get(full)
        if existing is not None:
            if not scope.reuse:
                raise ValueError(
                    f"Variable {full} already exists, disallowed. Did you mean to set "
                    "reuse=True or reuse=AUTO_REUSE in variable_scope?"
                )
            _check_shared(existing, shape, dtype)
            return existing
        if scope.reuse is True:
            raise ValueError(
                f"Variable {full} does not exist, or was not created with get_variable(). "
                "Did you mean to set reuse=AUTO_REUSE in variable_scope?"
            )
        variable = _make(graph, scope, full, name, shape, dtype, initializer, trainable,
                         collections)
        store.variables[full] = variable
        return variable


def _check_shared(existing: Variable, shape, dtype) -> None:
    if shape is not None and not shapes.compatible(existing.shape, shapes.as_shape(shape)):
        raise ValueError(
            f"Trying to share variable {existing.name}, but specified shape "
            f"{shapes.fmt(shapes.as_shape(shape))} and found shape {shapes.fmt(existing.shape)}"
        )
    if dtype is not None and dtype != existing.dtype:
        raise ValueError(
            f"Trying to share variable {existing.name}, but specified dtype {dtype} and "
            f"found dtype {existing.dtype}"
        )


def _make(
    graph: Graph, scope: VariableScope, full: str, name: str, shape, dtype, initializer,
    trainable: bool, collections,
) -> Variable:
    initializer = initializer if initializer is not None else scope.initializer
    if initializer is not None and not callable(initializer):  # a value
        value = np.asarray(initializer) if not isinstance(initializer, Tensor) else initializer
        if shape is not None and not shapes.compatible(shapes.as_shape(shape), value.shape):
            raise ValueError(
                f"get_variable {full}: the initial value has shape {shapes.fmt(value.shape)}, "
                f"shape says {shapes.fmt(shapes.as_shape(shape))}"
            )
        init, shape = initializer, None
    else:
        if shape is None:
            raise ValueError(f"get_variable {full}: a shape is needed to make the variable")
        shape = shapes.as_shape(shape)
        if None in shape:
            raise ValueError(
                f"get_variable {full}: the shape {shapes.fmt(shape)} must be fully known"
            )
        dtype = dtype if dtype is not None else dtypes.float32
        if initializer is None:
            initializer = (
                initializers.glorot_uniform() if dtype.kind == "f" else initializers.zeros()
            )
        init = initializer
    parent = full.rpartition("/")[0]
    # The variable is state, not part of whatever the caller's ops depend on.
    with graph.name_scope(parent + "/" if parent else None), graph.control_dependencies(None):
        variable = Variable(init, trainable=trainable, name=full.rpartition("/")[2],
                            dtype=dtype, shape=shape, collections=collections)
    if variable.name != full:
        raise GraphError(
            f"get_variable {full}: the graph already has an op named {full!r} (not made by "
            f"get_variable); the variable came out as {variable.name!r}"
        )
    return variable


__all__ = [
    "AUTO_REUSE",
    "VariableScope",
    "get_variable",
    "get_variable_scope",
    "variable_scope",
]
