"""Accumulator and staleness-clock ops, and the classes that build them (paper section 4.4).

Like a queue, each is state behind a handle: ``ConditionalAccumulator``,
``SparseConditionalAccumulator`` and ``StalenessClock`` yield the handle, and the other ops
act on it. They are ordinary stateful ops, so they are placed like any other: an
accumulator is built colocated with its variable and runs on that variable's parameter
server, whichever task runs the step that applies to it or takes from it.

The ops carry the accumulator's dtype and shape as attrs, so gradients are checked and
averages get static shapes when the graph is built.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import Shape, ShapeError

from .. import dtypes
from ..autodiff import IndexedSlices
from ..graph import Operation, Tensor, apply_op, convert_to_tensor, get_default_graph
from ..op_def import define_op

_SPEC_ATTRS = {"dtype": None, "shape": None}


def _check_handle(handle: Tensor, what: str = "an accumulator") -> None:
    if handle.dtype != dtypes.resource:
        raise ShapeError(f"input 0 must be {what} handle (resource), got {handle.dtype}")


def _label(handle: Tensor) -> str:
    op = handle.op
    if op.type in ("ConditionalAccumulator", "SparseConditionalAccumulator", "StalenessClock"):
        return op.attrs.get("shared_name") or op.name
    return handle.name


def _check_int_scalar(t: Tensor, what: str) -> None:
    if t.dtype.kind not in "iu" or not shapes.compatible(t.shape, ()):
        raise ShapeError(
            f"{what} must be an integer scalar, got {shapes.fmt(t.shape)} {t.dtype}"
        )


def _check_spec(attrs, sparse: bool) -> tuple:
    dtype = attrs["dtype"]
    if dtype is None:
        raise ShapeError("attr dtype is required")
    dtype = dtypes.as_dtype(dtype)
    if dtype.kind != "f":
        raise ShapeError(f"attr dtype must be floating point (gradients), got {dtype}")
    shape = shapes.as_shape(attrs["shape"])
    if sparse and shape is not None and len(shape) == 0:
        raise ShapeError("a sparse accumulator's shape needs rank >= 1 (rows first), got ()")
    return dtype, shape


def _handle_op(sparse: bool):
    def fn(inputs, attrs):
        _check_spec(attrs, sparse)
        return [(dtypes.resource, ())]

    return fn


for _name, _sparse in (("ConditionalAccumulator", False), ("SparseConditionalAccumulator", True)):
    define_op(
        _name,
        attrs={**_SPEC_ATTRS, "shared_name": ""},
        num_inputs=0,
        stateful=True,
        differentiable=False,
    )(_handle_op(_sparse))


# ``worker``: which worker replica sends the gradient (-1: unsaid), so the accumulator
# can tell who has not contributed to a step that does not complete.
_APPLY_ATTRS = {**_SPEC_ATTRS, "worker": -1}


def _check_worker(attrs) -> None:
    w = attrs["worker"]
    if not isinstance(w, int) or isinstance(w, bool) or w < -1:
        raise ShapeError(f"attr worker must be a worker index or -1, got {w!r}")


@define_op(
    "AccumulatorApplyGradient",
    attrs=dict(_APPLY_ATTRS),
    num_inputs=3,
    stateful=True,
    differentiable=False,
)
def _apply_shape(inputs, attrs):
    handle, local_step, gradient = inputs
    _check_handle(handle)
    _check_int_scalar(local_step, "local_step")
    dtype, shape = _check_spec(attrs, sparse=False)
    _check_worker(attrs)
    label = _label(handle)
    if gradient.dtype != dtype:
        raise ShapeError(f"accumulator {label!r} holds {dtype} gradients, got {gradient.dtype}")
    if not shapes.compatible(shape, gradient.shape):
        raise ShapeError(
            f"accumulator {label!r} holds gradients of shape {shapes.fmt(shape)}, "
            f"got {shapes.fmt(gradient.shape)}"
        )
    return []


@define_op(
    "SparseAccumulatorApplyGradient",
    attrs=dict(_APPLY_ATTRS),
    num_inputs=4,
    stateful=True,
    differentiable=False,
)
def _sparse_apply_shape(inputs, attrs):
    handle, local_step, indices, values = inputs
    _check_handle(handle)
    _check_int_scalar(local_step, "local_step")
    dtype, shape = _check_spec(attrs, sparse=True)
    _check_worker(attrs)
    label = _label(handle)
    if indices.dtype.kind not in "iu":
        raise ShapeError(
            f"sparse accumulator {label!r}: indices must be integers, got {indices.dtype}"
        )
    if values.dtype != dtype:
        raise ShapeError(
            f"sparse accumulator {label!r} holds {dtype} gradients, got values of {values.dtype}"
        )
    if indices.shape is not None and len(indices.shape) != 1:
        raise ShapeError(
            f"sparse accumulator {label!r}: indices must be 1-D, got {shapes.fmt(indices.shape)}"
        )
    if values.shape is not None:
        if len(values.shape) == 0:
            raise ShapeError(f"sparse accumulator {label!r}: values must have rank >= 1, got ()")
        n = None if indices.shape is None else indices.shape[0]
        if n is not None and values.shape[0] is not None and n != values.shape[0]:
            raise ShapeError(
                f"sparse accumulator {label!r}: {n} indices but {values.shape[0]} value rows "
                f"(values {shapes.fmt(values.shape)})"
            )
        row = None if shape is None else shape[1:]
        if not shapes.compatible(row, values.shape[1:]):
            raise ShapeError(
                f"sparse accumulator {label!r} holds rows of shape {shapes.fmt(row)}, "
                f"got values of shape {shapes.fmt(values.shape)}"
            )
    return []


@define_op(
    "AccumulatorTakeGradient",
    attrs=dict(_SPEC_ATTRS),
    num_inputs=2,
    stateful=True,
    differentiable=False,
)
def _take_shape(inputs, attrs):
    _check_handle(inputs[0])
    _check_int_scalar(inputs[1], "num_required")
    dtype, shape = _check_spec(attrs, sparse=False)
    return [(dtype, shape)]


@define_op(
    "SparseAccumulatorTakeGradient",
    attrs=dict(_SPEC_ATTRS),
    num_inputs=2,
    stateful=True,
    differentiable=False,
)
def _sparse_take_shape(inputs, attrs):
    _check_handle(inputs[0])
    _check_int_scalar(inputs[1], "num_required")
    dtype, shape = _check_spec(attrs, sparse=True)
    values = None if shape is None else (None, *shape[1:])
    return [(dtypes.int64, (None,)), (dtype, values)]


@define_op("AccumulatorWaitReady", num_inputs=2, stateful=True, differentiable=False)
def _wait_ready_shape(inputs, attrs):
    _check_handle(inputs[0])
    _check_int_scalar(inputs[1], "num_required")
    return [(dtypes.int64, ())]


@define_op("AccumulatorStep", num_inputs=1, stateful=True, differentiable=False)
def _step_shape(inputs, attrs):
    _check_handle(inputs[0])
    return [(dtypes.int64, ())]


@define_op("AccumulatorSetGlobalStep", num_inputs=2, stateful=True, differentiable=False)
def _set_step_shape(inputs, attrs):
    _check_handle(inputs[0])
    _check_int_scalar(inputs[1], "new_global_step")
    return []


@define_op("AccumulatorReset", num_inputs=2, stateful=True, differentiable=False)
def _reset_shape(inputs, attrs):
    _check_handle(inputs[0])
    _check_int_scalar(inputs[1], "new_global_step")
    return []


@define_op("AccumulatorNumAccumulated", num_inputs=1, stateful=True, differentiable=False)
def _num_accumulated_shape(inputs, attrs):
    _check_handle(inputs[0])
    return [(dtypes.int32, ())]


@define_op("AccumulatorNumDropped", num_inputs=1, stateful=True, differentiable=False)
def _num_dropped_shape(inputs, attrs):
    _check_handle(inputs[0])
    return [(dtypes.int64, ())]


# ---- the staleness clock


def _clock_spec(attrs) -> int:
    n, s = attrs["num_workers"], attrs["staleness"]
    if not isinstance(n, int) or n < 1:
        raise ShapeError(f"attr num_workers must be a positive int, got {n!r}")
    if not isinstance(s, int) or s < 0:
        raise ShapeError(f"attr staleness must be a non-negative int, got {s!r}")
    return n


@define_op(
    "StalenessClock",
    attrs={"num_workers": None, "staleness": 0, "shared_name": ""},
    num_inputs=0,
    stateful=True,
    differentiable=False,
)
def _clock_shape(inputs, attrs):
    _clock_spec(attrs)
    return [(dtypes.resource, ())]


@define_op("StalenessClockAdvance", num_inputs=2, stateful=True, differentiable=False)
def _advance_shape(inputs, attrs):
    _check_handle(inputs[0], "a staleness clock")
    _check_int_scalar(inputs[1], "worker_index")
    return [(dtypes.int64, ())]


@define_op("WaitForStaleness", num_inputs=3, stateful=True, differentiable=False)
def _wait_shape(inputs, attrs):
    _check_handle(inputs[0], "a staleness clock")
    _check_int_scalar(inputs[1], "worker_index")
    _check_int_scalar(inputs[2], "step")
    return [(dtypes.int64, ())]


@define_op(
    "StalenessClockRead",
    attrs={"num_workers": None},
    num_inputs=1,
    stateful=True,
    differentiable=False,
)
def _read_clock_shape(inputs, attrs):
    _check_handle(inputs[0], "a staleness clock")
    n = attrs["num_workers"]
    return [(dtypes.int64, (n if isinstance(n, int) and n > 0 else None,))]


# ---- the Python classes


class _Accumulator:
    _handle_type = ""

    def __init__(self, dtype, shape, shared_name: str | None, name: str):
        self.dtype = dtypes.as_dtype(dtype)
        self.shape: Shape = shapes.as_shape(shape)
        graph = get_default_graph()
        with graph.name_scope(name) as scope:
            self.name = scope.rstrip("/")
            self.shared_name = shared_name or self.name
            self._attrs = {"dtype": self.dtype, "shape": self.shape}
            self.handle = apply_op(
                self._handle_type,
                [],
                {**self._attrs, "shared_name": self.shared_name},
                self._handle_type,
            ).outputs[0]
        self._base = self.name.rpartition("/")[2]

    @property
    def op(self) -> Operation:
        return self.handle.op

    @property
    def graph(self):
        return self.handle.graph

    def _apply(self, op_type: str, inputs, attrs, name) -> Operation:
        with self.graph.colocate_with(self.handle):
            return apply_op(op_type, [self.handle, *inputs], attrs, name)

    def _count(self, n) -> Tensor:
        return n if isinstance(n, Tensor) else convert_to_tensor(int(n), dtype=dtypes.int32)

    def set_global_step(self, new_global_step, name: str | None = None) -> Operation:
        """An op that sets the step gradients are judged against (e.g. after a restore)."""
        step = _as_step(new_global_step)
        return self._apply(
            "AccumulatorSetGlobalStep", [step], None, name or f"{self._base}_set_global_step"
        )

    def reset(self, new_global_step, name: str | None = None) -> Operation:
        """An op that drops what is accumulated and judges later gradients against
        ``new_global_step``: a sync chief rejoining a job whose last update it left half
        done (taken on one PS task, not on another) starts every accumulator afresh."""
        step = _as_step(new_global_step)
        return self._apply("AccumulatorReset", [step], None, name or f"{self._base}_reset")

    def wait_ready(self, num_required, name: str | None = None) -> Tensor:
        """Waits, taking nothing, until ``num_required`` gradients of the pending step are
        in; its value is that step. A sync chief runs one on every accumulator before any
        take, so a chief that dies mid-wait has consumed no gradients."""
        op = self._apply("AccumulatorWaitReady", [self._count(num_required)], None,
                         name or f"{self._base}_wait_ready")
        return op.outputs[0]

    def step(self, name: str | None = None) -> Tensor:
        """The step this accumulator is collecting gradients for."""
        op = self._apply("AccumulatorStep", [], None, name or f"{self._base}_step")
        return op.outputs[0]

    def num_accumulated(self, name: str | None = None) -> Tensor:
        op = self._apply(
            "AccumulatorNumAccumulated", [], None, name or f"{self._base}_num_accumulated"
        )
        return op.outputs[0]

    def num_dropped(self, name: str | None = None) -> Tensor:
        """How many stale gradients this accumulator refused since it was made."""
        op = self._apply("AccumulatorNumDropped", [], None, name or f"{self._base}_num_dropped")
        return op.outputs[0]

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r} shape={shapes.fmt(self.shape)} "
            f"dtype={self.dtype}>"
        )


def _as_step(step) -> Tensor:
    if hasattr(step, "_as_graph_element"):
        step = step._as_graph_element()
    return step if isinstance(step, Tensor) else convert_to_tensor(int(step), dtype=dtypes.int64)


class ConditionalAccumulator(_Accumulator):
    """Averages dense gradients for one variable, dropping those of past steps."""

    _handle_type = "ConditionalAccumulator"

    def __init__(
        self,
        dtype,
        shape=None,
        shared_name: str | None = None,
        name: str = "conditional_accumulator",
    ):
        super().__init__(dtype, shape, shared_name, name)

    def apply_grad(self, grad, local_step=0, name: str | None = None,
                   worker: int = -1) -> Operation:
        """An op that adds ``grad``, computed at ``local_step``, unless that step is past;
        ``worker`` is the sender's replica index, for telling who holds a step up."""
        if not isinstance(grad, Tensor):
            grad = convert_to_tensor(grad, dtype=self.dtype)
        return self._apply(
            "AccumulatorApplyGradient",
            [_as_step(local_step), grad],
            {**self._attrs, "worker": int(worker)},
            name or f"{self._base}_apply_grad",
        )

    def take_grad(self, num_required, name: str | None = None) -> Tensor:
        """The average of ``num_required`` (or more) gradients, once they are in.

        Taking resets the accumulator and advances its step by one.
        """
        op = self._apply(
            "AccumulatorTakeGradient",
            [self._count(num_required)],
            self._attrs,
            name or f"{self._base}_take_grad",
        )
        return op.outputs[0]


class SparseConditionalAccumulator(_Accumulator):
    """Averages sparse (``IndexedSlices``) gradients row by row.

    ``shape`` is the dense shape of the variable; the take returns each row that any
    gradient touched once, with the sum of its gradients divided by how many gradients
    were taken.
    """

    _handle_type = "SparseConditionalAccumulator"

    def __init__(
        self,
        dtype,
        shape=None,
        shared_name: str | None = None,
        name: str = "sparse_conditional_accumulator",
    ):
        super().__init__(dtype, shape, shared_name, name)

    def apply_grad(
        self, grad_indices, grad_values, local_step=0, name: str | None = None,
        worker: int = -1,
    ) -> Operation:
        indices = convert_to_tensor(grad_indices)
        values = grad_values
        if not isinstance(values, Tensor):
            values = convert_to_tensor(values, dtype=self.dtype)
        return self._apply(
            "SparseAccumulatorApplyGradient",
            [_as_step(local_step), indices, values],
            {**self._attrs, "worker": int(worker)},
            name or f"{self._base}_apply_grad",
        )

    def apply_indexed_slices_grad(
        self, grad: IndexedSlices, local_step=0, name: str | None = None, worker: int = -1
    ) -> Operation:
        return self.apply_grad(grad.indices, grad.values, local_step, name, worker)

    def take_grad(self, num_required, name: str | None = None) -> tuple[Tensor, Tensor]:
        """(indices, values) of the averaged gradient: unique rows, in increasing order."""
        op = self._apply(
            "SparseAccumulatorTakeGradient",
            [self._count(num_required)],
            self._attrs,
            name or f"{self._base}_take_grad",
        )
        return op.outputs[0], op.outputs[1]

    def take_indexed_slices_grad(self, num_required, name: str | None = None) -> IndexedSlices:
        indices, values = self.take_grad(num_required, name)
        return IndexedSlices(values, indices, self.shape)


class StalenessClock:
    """Counts each worker's finished steps and holds back a worker that is too far ahead.

    A worker may start its step ``t`` (counting from 0) once every worker has finished at
    least ``t - staleness`` steps (PMLS's stale synchronous parallel; 0 is bulk-synchronous).
    """

    def __init__(
        self,
        num_workers: int,
        staleness: int,
        shared_name: str | None = None,
        name: str = "staleness_clock",
    ):
        self.num_workers = int(num_workers)
        self.staleness = int(staleness)
        graph = get_default_graph()
        with graph.name_scope(name) as scope:
            self.name = scope.rstrip("/")
            self.shared_name = shared_name or self.name
            attrs = {
                "num_workers": self.num_workers,
                "staleness": self.staleness,
                "shared_name": self.shared_name,
            }
            self.handle = apply_op("StalenessClock", [], attrs, "StalenessClock").outputs[0]
        self._base = self.name.rpartition("/")[2]

    @property
    def graph(self):
        return self.handle.graph

    def _apply(self, op_type: str, inputs, attrs, name) -> Tensor:
        with self.graph.colocate_with(self.handle):
            return apply_op(op_type, [self.handle, *inputs], attrs, name).outputs[0]

    def advance(self, worker_index, name: str | None = None) -> Tensor:
        """The worker's count of finished steps after counting one more."""
        return self._apply(
            "StalenessClockAdvance",
            [_as_index(worker_index)],
            None,
            name or f"{self._base}_advance",
        )

    def wait(self, worker_index, step, name: str | None = None) -> Tensor:
        """Wait until the worker may start ``step``; the slowest worker's finished count."""
        return self._apply(
            "WaitForStaleness",
            [_as_index(worker_index), _as_step(step)],
            None,
            name or f"{self._base}_wait",
        )

    def read(self, name: str | None = None) -> Tensor:
        """Every worker's count of finished steps (int64, one per worker)."""
        attrs = {"num_workers": self.num_workers}
        return self._apply("StalenessClockRead", [], attrs, name or f"{self._base}_read")

    def __repr__(self) -> str:
        return (
            f"<StalenessClock {self.name!r} workers={self.num_workers} "
            f"staleness={self.staleness}>"
        )


def _as_index(worker_index) -> Tensor:
    if isinstance(worker_index, Tensor):
        return worker_index
    return convert_to_tensor(int(worker_index), dtype=dtypes.int32)
