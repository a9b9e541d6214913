"""Queue ops and the ``FIFOQueue`` class that builds them (paper section 3.1, "Queues").

A queue is state behind a handle, like a variable: ``FIFOQueueV2`` yields the handle and
the enqueue, dequeue, close and size ops act on it. Steps that enqueue and steps that
dequeue usually run in different threads (an input pipeline feeding a training loop);
the queue's capacity is what makes a fast producer wait for a slow consumer.

The ops carry the queue's component types and shapes as attrs, so enqueued values are
checked and dequeued tensors get static shapes when the graph is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.shapes import Shape, ShapeError

from .. import dtypes
from ..dtypes import as_dtype
from ..graph import Operation, Tensor, apply_op, convert_to_tensor, get_default_graph
from ..op_def import define_op

_QUEUE_ATTRS = {"component_types": None, "shapes": None}


def _spec(attrs) -> tuple[list, list[Shape] | None]:
    types = attrs["component_types"]
    if not types:
        raise ShapeError("attr component_types must list at least one dtype")
    types = [dtypes.as_dtype(t) for t in types]
    component_shapes = attrs["shapes"]
    if not component_shapes:
        return types, None
    if len(component_shapes) != len(types):
        raise ShapeError(
            f"attr shapes lists {len(component_shapes)} shapes for {len(types)} component types"
        )
    return types, [shapes.as_shape(s) for s in component_shapes]


def _check_handle(handle: Tensor) -> None:
    if handle.dtype != dtypes.resource:
        raise ShapeError(f"input 0 must be a queue handle (resource), got {handle.dtype}")


def _queue_label(handle: Tensor) -> str:
    op = handle.op
    if op.type == "FIFOQueueV2":
        return op.attrs.get("shared_name") or op.name
    return handle.name


@define_op(
    "FIFOQueueV2",
    attrs={**_QUEUE_ATTRS, "capacity": -1, "shared_name": ""},
    num_inputs=0,
    stateful=True,
    differentiable=False,
)
def _fifo_queue_shape(inputs, attrs):
    _spec(attrs)
    capacity = attrs["capacity"]
    if not isinstance(capacity, int) or (capacity < 1 and capacity != -1):
        raise ShapeError(
            f"attr capacity must be a positive int or -1 (unbounded), got {capacity!r}"
        )
    return [(dtypes.resource, ())]


def _components_shape(batched: bool):
    def fn(inputs, attrs):
        if not inputs:
            raise ShapeError("takes a queue handle and its components")
        handle, values = inputs[0], inputs[1:]
        _check_handle(handle)
        if attrs["component_types"] is None:
            return []  # nothing known about the queue: checked when the step runs
        types, component_shapes = _spec(attrs)
        label = _queue_label(handle)
        if len(values) != len(types):
            raise ShapeError(
                f"queue {label!r} has {len(types)} components, got {len(values)} values"
            )
        batch = None
        for i, v in enumerate(values):
            if v.dtype != types[i]:
                raise ShapeError(
                    f"queue {label!r} component {i} has dtype {types[i]}, value has {v.dtype}"
                )
            shape = v.shape
            if batched and shape is not None:
                if len(shape) == 0:
                    raise ShapeError(
                        f"queue {label!r} component {i}: enqueue_many needs a leading batch "
                        "dimension, value is a scalar"
                    )
                if batch is not None and shape[0] is not None and shape[0] != batch:
                    raise ShapeError(
                        f"queue {label!r}: enqueue_many components differ in batch size "
                        f"({batch} and {shape[0]} in component {i})"
                    )
                batch = batch if shape[0] is None else shape[0]
                shape = shape[1:]
            want = None if component_shapes is None else component_shapes[i]
            if not shapes.compatible(want, shape):
                rows = " rows have" if batched else " has"
                raise ShapeError(
                    f"queue {label!r} component {i} has shape {shapes.fmt(want)}, "
                    f"value{rows} shape {shapes.fmt(shape)}"
                )
        return []

    return fn


for _name, _batched in (("QueueEnqueueV2", False), ("QueueEnqueueManyV2", True)):
    define_op(_name, attrs=dict(_QUEUE_ATTRS), stateful=True, differentiable=False)(
        _components_shape(_batched)
    )


@define_op(
    "QueueDequeueV2", attrs=dict(_QUEUE_ATTRS), num_inputs=1, stateful=True, differentiable=False
)
def _dequeue_shape(inputs, attrs):
    _check_handle(inputs[0])
    types, component_shapes = _spec(attrs)
    if component_shapes is None:
        return [(t, None) for t in types]
    return list(zip(types, component_shapes, strict=True))


@define_op(
    "QueueDequeueManyV2", attrs={**_QUEUE_ATTRS, "n": None}, stateful=True, differentiable=False
)
def _dequeue_many_shape(inputs, attrs):
    if len(inputs) not in (1, 2):
        raise ShapeError(f"takes a queue handle and optionally n, got {len(inputs)} inputs")
    _check_handle(inputs[0])
    types, component_shapes = _spec(attrs)
    n = attrs["n"]
    if len(inputs) == 2:
        if n is not None:
            raise ShapeError("n is given both as attr and as input")
        count = inputs[1]
        if count.dtype.kind not in "iu" or not shapes.compatible(count.shape, ()):
            raise ShapeError(
                f"n must be an integer scalar, got {shapes.fmt(count.shape)} {count.dtype}"
            )
        n = int(count.op.attrs["value"]) if count.op.type == "Const" else None
    elif not isinstance(n, int) or n < 0:
        raise ShapeError(f"attr n must be a non-negative int (or n given as input), got {n!r}")
    if component_shapes is None:
        return [(t, None) for t in types]
    pairs = zip(types, component_shapes, strict=True)
    return [(t, None if s is None else (n, *s)) for t, s in pairs]


@define_op(
    "QueueCloseV2",
    attrs={"cancel_pending_enqueues": False},
    num_inputs=1,
    stateful=True,
    differentiable=False,
)
def _close_shape(inputs, attrs):
    _check_handle(inputs[0])
    return []


@define_op("QueueSizeV2", num_inputs=1, stateful=True, differentiable=False)
def _size_shape(inputs, attrs):
    _check_handle(inputs[0])
    return [(dtypes.int32, ())]


# ---- the Python class


def _normalize_shapes(component_shapes, count: int) -> list[Shape] | None:
    """One shape per component; a one-component queue may be given its bare shape.

    A bare shape is ``()`` or dims with at least one int: ``[None]`` stays one unknown
    shape, so a rank-1 shape of unknown size is written ``[(None,)]``.
    """
    if component_shapes is None:
        return None
    if not isinstance(component_shapes, (list, tuple)):
        raise TypeError(f"shapes must be a list of shapes, got {component_shapes!r}")
    dims = (int, np.integer)
    bare = all(d is None or isinstance(d, dims) for d in component_shapes) and (
        not component_shapes or any(isinstance(d, dims) for d in component_shapes)
    )
    if count == 1 and bare:
        component_shapes = [component_shapes]
    if len(component_shapes) != count:
        raise ShapeError(f"{count} component types but {len(component_shapes)} shapes")
    return [shapes.as_shape(s) for s in component_shapes]


class FIFOQueue:
    """A bounded first-in first-out queue of tuples of tensors.

    Every method builds an op (or tensor) in the queue's graph, to be run in a session;
    ``dequeue`` and ``dequeue_many`` return one tensor for a one-component queue, else a
    list of tensors.
    """

    def __init__(
        self,
        capacity: int,
        dtypes: Sequence,
        shapes: Sequence | None = None,
        name: str | None = None,
        shared_name: str | None = None,
    ):
        if not isinstance(dtypes, (list, tuple)):
            dtypes = [dtypes]
        self.dtypes = [as_dtype(t) for t in dtypes]
        self.shapes = _normalize_shapes(shapes, len(self.dtypes))
        self.capacity = capacity = int(capacity)
        graph = get_default_graph()
        with graph.name_scope(name or "fifo_queue") as scope:
            self.name = scope.rstrip("/")
            self.shared_name = shared_name or self.name
            self._attrs = {"component_types": tuple(self.dtypes), "shapes": self._shape_attr()}
            self.handle = apply_op(
                "FIFOQueueV2",
                [],
                {**self._attrs, "capacity": capacity, "shared_name": self.shared_name},
                "FIFOQueueV2",
            ).outputs[0]
        self._base = self.name.rpartition("/")[2]

    def _shape_attr(self):
        return None if self.shapes is None else tuple(self.shapes)

    @property
    def op(self) -> Operation:
        return self.handle.op

    @property
    def graph(self):
        return self.handle.graph

    def _components(self, vals, batched: bool) -> list[Tensor]:
        if isinstance(vals, dict):
            raise TypeError(f"queue {self.name!r}: pass values as a list, one per component")
        if not isinstance(vals, (list, tuple)) or (len(self.dtypes) == 1 and len(vals) != 1):
            vals = [vals]
        if len(vals) != len(self.dtypes):
            raise ShapeError(
                f"queue {self.name!r} has {len(self.dtypes)} components, got {len(vals)} values"
            )
        out = []
        for v, dtype in zip(vals, self.dtypes, strict=True):
            # A tensor of another dtype is left for the op to reject, naming the component.
            out.append(v if isinstance(v, Tensor) else convert_to_tensor(v, dtype=dtype))
        return out

    def _apply(self, op_type: str, inputs, attrs, name) -> Operation:
        with self.graph.colocate_with(self.handle):
            return apply_op(op_type, [self.handle, *inputs], attrs, name)

    def enqueue(self, vals, name: str | None = None) -> Operation:
        """An op that adds one element (one value per component), waiting while full."""
        inputs = self._components(vals, batched=False)
        return self._apply("QueueEnqueueV2", inputs, self._attrs, name or f"{self._base}_enqueue")

    def enqueue_many(self, vals, name: str | None = None) -> Operation:
        """An op that adds the rows of ``vals`` (split along dimension 0) as elements."""
        inputs = self._components(vals, batched=True)
        return self._apply(
            "QueueEnqueueManyV2", inputs, self._attrs, name or f"{self._base}_enqueue_many"
        )

    def _unpack(self, op: Operation) -> Tensor | list[Tensor]:
        return op.outputs[0] if len(op.outputs) == 1 else list(op.outputs)

    def dequeue(self, name: str | None = None) -> Tensor | list[Tensor]:
        op = self._apply("QueueDequeueV2", [], self._attrs, name or f"{self._base}_dequeue")
        return self._unpack(op)

    def dequeue_many(self, n, name: str | None = None) -> Tensor | list[Tensor]:
        """The ``n`` oldest elements, stacked along a new dimension 0."""
        name = name or f"{self._base}_dequeue_many"
        if isinstance(n, int):
            op = self._apply("QueueDequeueManyV2", [], {**self._attrs, "n": n}, name)
        else:
            op = self._apply("QueueDequeueManyV2", [convert_to_tensor(n)], self._attrs, name)
        return self._unpack(op)

    def close(self, cancel_pending_enqueues: bool = False, name: str | None = None) -> Operation:
        attrs = {"cancel_pending_enqueues": bool(cancel_pending_enqueues)}
        return self._apply("QueueCloseV2", [], attrs, name or f"{self._base}_close")

    def size(self, name: str | None = None) -> Tensor:
        return self._apply("QueueSizeV2", [], None, name or f"{self._base}_size").outputs[0]

    def __repr__(self) -> str:
        shapes_txt = "?" if self.shapes is None else ", ".join(map(shapes.fmt, self.shapes))
        types = ", ".join(map(str, self.dtypes))
        return f"<FIFOQueue {self.name!r} capacity={self.capacity} [{types}] [{shapes_txt}]>"
