"""Graphs of operations joined by tensors and control edges. Building a graph does no math.

Ops are created through ``Graph.create_op``, which checks attrs against the op's
definition and runs its shape function, so a wrong shape fails here, at build time,
with the op and its inputs named.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.shapes import Shape, ShapeError

from . import dtypes
from .device_names import merge_device
from .op_def import get_op_def


class GraphError(ValueError):
    """An op that cannot be built: the message names the op, its inputs and their shapes."""


class Tensor:
    """One output of an operation: a symbolic value with a static dtype and shape."""

    __slots__ = ("op", "index", "dtype", "shape", "_consumers", "__weakref__")

    def __init__(self, op: Operation, index: int, dtype: np.dtype, shape: Shape):
        self.op = op
        self.index = index
        self.dtype = dtype
        self.shape = shape
        self._consumers: list[Operation] = []

    @property
    def name(self) -> str:
        return f"{self.op.name}:{self.index}"

    @property
    def graph(self) -> Graph:
        return self.op.graph

    @property
    def device(self) -> str:
        return self.op.device

    def consumers(self) -> list[Operation]:
        return list(self._consumers)

    def set_shape(self, shape) -> None:
        """Refine the static shape (e.g. after a Reshape with an unknown dim)."""
        shape = shapes.as_shape(shape)
        if not shapes.compatible(self.shape, shape):
            raise ShapeError(
                f"tensor {self.name}: shape {shapes.fmt(self.shape)} "
                f"is incompatible with {shapes.fmt(shape)}"
            )
        self.shape = shapes.merge(self.shape, shape)

    def __repr__(self) -> str:
        return f"<Tensor {self.name} shape={shapes.fmt(self.shape)} dtype={self.dtype}>"

    # Tensors are dict keys (feeds, gradients): identity equality, as in TensorFlow 1.x.
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise TypeError(
            f"the truth value of symbolic tensor {self.name} is unknown while building; "
            "use flowmill.runtime.cond for data-dependent branches"
        )

    def __iter__(self):
        raise TypeError(f"tensor {self.name} is not iterable while building the graph")


class Operation:
    """A node: an op type with attrs, input tensors, control inputs, and outputs."""

    __slots__ = (
        "graph",
        "name",
        "type",
        "inputs",
        "control_inputs",
        "attrs",
        "outputs",
        "device",
        "colocation",
        "id",
        "cf_context",
        "op_def",
        "_control_outputs",
    )

    def __init__(self, graph, name, op_type, inputs, control_inputs, attrs, device, op_def):
        self.graph: Graph = graph
        self.name: str = name
        self.type: str = op_type
        self.inputs: list[Tensor] = inputs
        self.control_inputs: list[Operation] = control_inputs
        self.attrs: dict[str, Any] = attrs
        self.outputs: list[Tensor] = []
        self.device: str = device
        self.colocation: tuple[str, ...] = ()
        self.id: int = len(graph._ops)
        self.cf_context = None
        self.op_def = op_def
        self._control_outputs: list[Operation] = []

    @property
    def stateful(self) -> bool:
        return self.op_def.stateful

    def get_attr(self, name: str) -> Any:
        return self.attrs[name]

    def _update_input(self, index: int, tensor: Tensor) -> None:
        """Rewire one input; only loop construction needs this (Merge <- NextIteration)."""
        old = self.inputs[index]
        old._consumers.remove(self)
        self.inputs[index] = tensor
        tensor._consumers.append(self)

    def _add_control_input(self, op: Operation) -> None:
        if op not in self.control_inputs:
            self.control_inputs.append(op)
            op._control_outputs.append(self)

    def __repr__(self) -> str:
        return f"<Operation {self.name!r} type={self.type}>"

    def run(self, session=None, feed_dict=None) -> None:
        (session or get_default_session()).run(None, feed_dict, targets=[self])

    __hash__ = object.__hash__


DeviceFn = Callable[[Operation], str]


class Graph:
    def __init__(self, seed: int | None = None):
        self._ops: list[Operation] = []
        self._by_name: dict[str, Operation] = {}
        self._name_counts: dict[str, int] = {}
        self._lock = threading.RLock()
        self._finalized = False
        self.seed = seed
        self.collections: dict[str, list] = {}
        self.cond_predicates: dict[Operation, Tensor] = {}  # cond's Merge -> predicate
        self._local = threading.local()

    # Per-thread building state: scopes entered in one thread do not leak into another.
    def _state(self):
        s = self._local
        if not hasattr(s, "name_stack"):
            s.name_stack = ""
            s.control_deps = []
            s.device_stack = []
            s.colocation = None
            s.cf_context = None
        return s

    # ---- lookups
    def get_operations(self) -> list[Operation]:
        return list(self._ops)

    def get_operation_by_name(self, name: str) -> Operation:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no operation named {name!r} in this graph") from None

    def get_tensor_by_name(self, name: str) -> Tensor:
        op_name, _, index = name.rpartition(":")
        if not op_name:
            raise KeyError(f"tensor name {name!r} must look like 'op:index'")
        op = self.get_operation_by_name(op_name)
        return op.outputs[int(index)]

    def as_graph_element(self, obj) -> Tensor | Operation:
        if isinstance(obj, (Tensor, Operation)):
            if obj.graph is not self:
                raise GraphError(f"{obj.name!r} belongs to another graph than this session's")
            return obj
        if isinstance(obj, str):
            return self.get_tensor_by_name(obj) if ":" in obj else self.get_operation_by_name(obj)
        if hasattr(obj, "_as_graph_element"):
            return self.as_graph_element(obj._as_graph_element())
        raise TypeError(f"cannot interpret {obj!r} as a tensor or operation")

    # ---- building
    def finalize(self) -> None:
        self._finalized = True

    def unique_name(self, name: str) -> str:
        s = self._state()
        full = f"{s.name_stack}/{name}" if s.name_stack else name
        with self._lock:
            if full not in self._name_counts and full not in self._by_name:
                self._name_counts[full] = 1
                return full
            n = self._name_counts.get(full, 1)
            while f"{full}_{n}" in self._by_name or f"{full}_{n}" in self._name_counts:
                n += 1
            self._name_counts[full] = n + 1
            self._name_counts[f"{full}_{n}"] = 1
            return f"{full}_{n}"

    def create_op(
        self,
        op_type: str,
        inputs: Iterable[Tensor],
        attrs: dict[str, Any] | None = None,
        name: str | None = None,
        num_outputs_hint: int | None = None,
    ) -> Operation:
        if self._finalized:
            raise GraphError(f"graph is finalized; cannot add op {op_type!r}")
        op_def = get_op_def(op_type)
        s = self._state()
        inputs = list(inputs)
        for t in inputs:
            if not isinstance(t, Tensor):
                raise GraphError(f"{op_type}: input {t!r} is not a Tensor")
            if t.graph is not self:
                raise GraphError(f"{op_type}: input {t.name} belongs to another graph")
        if s.cf_context is not None:
            inputs = s.cf_context.capture_inputs(inputs)
        full_attrs = dict(op_def.attrs)
        for key, value in (attrs or {}).items():
            if key not in op_def.attrs:
                allowed = ", ".join(sorted(op_def.attrs)) or "none"
                raise GraphError(f"{op_type}: unknown attr {key!r} (accepted: {allowed})")
            full_attrs[key] = value
        if op_def.num_inputs is not None and len(inputs) != op_def.num_inputs:
            raise GraphError(f"{op_type}: takes {op_def.num_inputs} inputs, got {len(inputs)}")
        with self._lock:
            op_name = self.unique_name(name or op_type)
            try:
                specs = op_def.shape_fn(inputs, full_attrs)
            except ShapeError as e:
                raise GraphError(_describe(op_name, op_type, inputs, str(e))) from None
            control: list[Operation] = []
            for deps in s.control_deps:
                for d in deps:
                    if d not in control:
                        control.append(d)
            op = Operation(self, op_name, op_type, inputs, [], full_attrs, "", op_def)
            for d in control:
                op._add_control_input(d)
            op.outputs = [Tensor(op, i, dt, sh) for i, (dt, sh) in enumerate(specs)]
            op.device = self._device_for(op, s)
            if s.colocation is not None:
                # Colocation wins over device scopes: the op goes where its group's owner is.
                op.colocation = s.colocation
                op.device = self._by_name[s.colocation[0]].device
            for t in inputs:
                t._consumers.append(op)
            self._ops.append(op)
            self._by_name[op_name] = op
        if s.cf_context is not None:
            s.cf_context.add_op(op)
        return op

    def _device_for(self, op: Operation, s) -> str:
        device = ""
        for spec in s.device_stack:
            if spec is None:
                device = ""
            elif callable(spec):
                device = merge_device(device, spec(op) or "")
            else:
                device = merge_device(device, spec)
        return device

    # ---- scopes
    @contextlib.contextmanager
    def as_default(self) -> Iterator[Graph]:
        _default_graphs().append(self)
        try:
            yield self
        finally:
            _default_graphs().pop()

    @contextlib.contextmanager
    def name_scope(self, name: str | None) -> Iterator[str]:
        s = self._state()
        old = s.name_stack
        if name is None or name == "":
            s.name_stack = ""
        elif name.endswith("/"):
            s.name_stack = name[:-1]
        else:
            s.name_stack = self.unique_name(name)
        try:
            yield s.name_stack + "/" if s.name_stack else ""
        finally:
            s.name_stack = old

    @contextlib.contextmanager
    def control_dependencies(self, deps: Iterable[Tensor | Operation] | None) -> Iterator[None]:
        s = self._state()
        saved = s.control_deps
        if deps is None:
            s.control_deps = []
        else:
            ops = [d.op if isinstance(d, Tensor) else self.as_graph_element(d) for d in deps]
            s.control_deps = saved + [ops]
        try:
            yield
        finally:
            s.control_deps = saved

    @contextlib.contextmanager
    def device(self, spec: str | DeviceFn | None) -> Iterator[None]:
        """Record where ops should run; a callable picks a device per op (a device setter)."""
        s = self._state()
        s.device_stack.append(spec)
        try:
            yield
        finally:
            s.device_stack.pop()

    @contextlib.contextmanager
    def colocate_with(self, op: Operation | Tensor) -> Iterator[None]:
        """Ops created here are placed with ``op`` (kept with the state it owns)."""
        op = op.op if isinstance(op, Tensor) else op
        s = self._state()
        saved = s.colocation
        s.colocation = op.colocation or (op.name,)
        try:
            yield
        finally:
            s.colocation = saved

    @contextlib.contextmanager
    def _control_flow_context(self, ctx) -> Iterator[None]:
        s = self._state()
        saved = s.cf_context
        s.cf_context = ctx
        try:
            yield
        finally:
            s.cf_context = saved

    def _current_cf_context(self):
        return self._state().cf_context

    # ---- collections
    def add_to_collection(self, key: str, value) -> None:
        with self._lock:
            self.collections.setdefault(key, []).append(value)

    def get_collection(self, key: str, scope: str | None = None) -> list:
        """The collection's items; with ``scope``, those whose ``name`` starts with a match
        of that regular expression (TensorFlow's filter, e.g. one layer's variables)."""
        items = list(self.collections.get(key, []))
        if scope is None:
            return items
        pattern = re.compile(scope)
        return [v for v in items if isinstance(getattr(v, "name", None), str)
                and pattern.match(v.name)]


class GraphKeys:
    """Names of the graph collections the library fills (TensorFlow's ``tf.GraphKeys``)."""

    GLOBAL_VARIABLES = "variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    # One task's own state, wherever it lives (a sync worker's local step): never saved,
    # never waited for, initialized by that task (TensorFlow's ``LOCAL_VARIABLES``). One
    # may be a global variable too, so that ``global_variables_initializer`` sets it in
    # one process.
    LOCAL_VARIABLES = "local_variables"
    GLOBAL_STEP = "global_step"
    # State updates a training step must also run (batch normalization's moving averages):
    # ``with control_dependencies(get_collection(UPDATE_OPS)): train = opt.minimize(loss)``.
    UPDATE_OPS = "update_ops"
    # The ops ``minimize`` returned: a task counts a step each time it runs one.
    TRAIN_OP = "train_op"
    # Summary ops (``fm.summary``), which ``fm.summary.merge_all()`` merges.
    SUMMARIES = "summaries"


def _describe(op_name: str, op_type: str, inputs: list[Tensor], why: str) -> str:
    ins = ", ".join(f"{t.name}: {shapes.fmt(t.shape)} {t.dtype}" for t in inputs) or "no inputs"
    return f"op {op_name!r} ({op_type}) with inputs [{ins}]: {why}"


# ---- the default graph, per thread


_global_default = Graph()
_tls = threading.local()


def _default_graphs() -> list[Graph]:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    return _tls.stack


def get_default_graph() -> Graph:
    stack = _default_graphs()
    return stack[-1] if stack else _global_default


def reset_default_graph() -> Graph:
    global _global_default
    if _default_graphs():
        raise RuntimeError("reset_default_graph() inside a Graph.as_default() block")
    _global_default = Graph()
    return _global_default


# ---- the default session, per thread (here, below the sessions, so that ``Operation.run``
# and ``Variable.eval`` find it without importing them)

_session_tls = threading.local()


def default_sessions() -> list:
    """This thread's stack of default sessions (``with session:`` pushes one)."""
    if not hasattr(_session_tls, "stack"):
        _session_tls.stack = []
    return _session_tls.stack


def get_default_session():
    stack = default_sessions()
    if not stack:
        raise RuntimeError("no default session: use `with Session() as sess:` or pass session=")
    return stack[-1]


def name_scope(name: str | None):
    return get_default_graph().name_scope(name)


def get_collection(key: str, scope: str | None = None) -> list:
    return get_default_graph().get_collection(key, scope)


def add_to_collection(key: str, value) -> None:
    get_default_graph().add_to_collection(key, value)


def control_dependencies(deps):
    return get_default_graph().control_dependencies(deps)


def device(spec):
    return get_default_graph().device(spec)


def colocate_with(op):
    return get_default_graph().colocate_with(op)


def convert_to_tensor(value, dtype=None, name: str | None = None) -> Tensor:
    """Tensors pass through (dtype checked); anything array-like becomes a Const."""
    if isinstance(value, Tensor):
        if dtype is not None and value.dtype != dtypes.as_dtype(dtype):
            raise GraphError(
                f"tensor {value.name} has dtype {value.dtype}, expected {dtypes.as_dtype(dtype)}"
            )
        return value
    if hasattr(value, "_as_graph_element"):
        return convert_to_tensor(value._as_graph_element(), dtype, name)
    if _constant is None:
        raise GraphError(f"cannot convert {type(value).__name__} to a tensor: no Const op yet")
    return _constant(value, dtype=dtype, name=name or "Const")


# How a Python value becomes a tensor: ``ops.array_ops`` registers ``constant`` here (as
# TensorFlow's constant_op registers its conversion function), so ops need not be imported.
_constant: Callable[..., Tensor] | None = None


def register_constant(fn: Callable[..., Tensor]) -> None:
    global _constant
    _constant = fn


def apply_op(op_type: str, inputs=(), attrs=None, name: str | None = None) -> Operation:
    """Create an op in the graph its tensor inputs live in (else the default graph)."""
    graph = next((t.graph for t in inputs if isinstance(t, Tensor)), None) or get_default_graph()
    return graph.create_op(op_type, inputs, attrs, name)
