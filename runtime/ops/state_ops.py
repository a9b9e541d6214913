"""Variables: state behind a handle, read and updated by ops (paper section 3.1)."""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import defvjp
from ..graph import (
    GraphError,
    GraphKeys,
    Operation,
    Tensor,
    apply_op,
    convert_to_tensor,
    get_default_graph,
    get_default_session,
)
from ..op_def import define_op
from .array_ops import group

GLOBAL_VARIABLES = GraphKeys.GLOBAL_VARIABLES
TRAINABLE_VARIABLES = GraphKeys.TRAINABLE_VARIABLES
LOCAL_VARIABLES = GraphKeys.LOCAL_VARIABLES


@define_op(
    "VarHandleOp",
    attrs={"dtype": None, "shape": None, "shared_name": ""},
    num_inputs=0,
    stateful=True,
    differentiable=False,
)
def _var_handle_shape(inputs, attrs):
    return [(dtypes.resource, ())]


@define_op("ReadVariableOp", attrs={"dtype": None, "shape": None}, num_inputs=1, stateful=True)
def _read_shape(inputs, attrs):
    return [(attrs["dtype"], attrs["shape"])]


@define_op("VarIsInitializedOp", num_inputs=1, stateful=True, differentiable=False)
def _is_initialized_shape(inputs, attrs):
    return [(dtypes.bool_, ())]


def _assign_shape(inputs, attrs):
    handle, value = inputs
    want_dtype, want_shape = attrs["dtype"], attrs["shape"]
    if value.dtype != want_dtype:
        raise ShapeError(f"variable has dtype {want_dtype}, value has {value.dtype}")
    if not shapes.compatible(want_shape, value.shape):
        raise ShapeError(
            f"variable has shape {shapes.fmt(want_shape)}, value has {shapes.fmt(value.shape)}"
        )
    return [(want_dtype, want_shape)]


for _name in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
    define_op(
        _name,
        attrs={"dtype": None, "shape": None},
        num_inputs=2,
        stateful=True,
        differentiable=False,
    )(_assign_shape)


def _scatter_shape(inputs, attrs):
    handle, indices, updates = inputs
    if updates.dtype != attrs["dtype"]:
        raise ShapeError(f"variable has dtype {attrs['dtype']}, updates have {updates.dtype}")
    if indices.dtype.kind not in "iu":
        raise ShapeError(f"indices must be integers, got {indices.dtype}")
    return [(attrs["dtype"], attrs["shape"])]


for _name in ("ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate"):
    define_op(
        _name,
        attrs={"dtype": None, "shape": None},
        num_inputs=3,
        stateful=True,
        differentiable=False,
    )(_scatter_shape)


@defvjp("ReadVariableOp")
def _read_grad(op, g):
    return [g]


class Variable:
    """A trainable (or not) buffer that survives across steps.

    In the graph a variable is a ``VarHandleOp``; using the Variable where a tensor is
    expected reads it through one ``ReadVariableOp`` made with it, which is also what
    ``gradients`` differentiates with respect to.
    """

    def __init__(
        self,
        initial_value,
        trainable: bool = True,
        name: str | None = None,
        dtype=None,
        shape=None,
        collections: list[str] | None = None,
    ):
        graph = get_default_graph()
        with graph.name_scope(name or "Variable") as scope:
            self.name = scope.rstrip("/")
            if callable(initial_value):
                if shape is None:
                    raise ShapeError(
                        f"variable {self.name!r}: an initializer function needs a shape"
                    )
                init = initial_value(shapes.as_shape(shape), dtypes.as_dtype(dtype or "float32"))
            else:
                init = initial_value
            init = convert_to_tensor(init, dtype=dtype, name="initial_value")
            self.dtype = init.dtype
            self.shape = shapes.as_shape(shape) if shape is not None else init.shape
            if not shapes.compatible(self.shape, init.shape):
                raise ShapeError(
                    f"variable {self.name!r}: initial value has shape {shapes.fmt(init.shape)}, "
                    f"declared shape is {shapes.fmt(self.shape)}"
                )
            self._attrs = {"dtype": self.dtype, "shape": self.shape}
            self.handle = apply_op(
                "VarHandleOp", [], {**self._attrs, "shared_name": self.name}, "VarHandleOp"
            ).outputs[0]
            with graph.colocate_with(self.handle):
                self.initializer = apply_op(
                    "AssignVariableOp", [self.handle, init], self._attrs, "Assign"
                )
                self._snapshot = self._read("Read")
        self.initial_value = init
        self.trainable = trainable
        for key in collections or [GLOBAL_VARIABLES] + ([TRAINABLE_VARIABLES] if trainable else []):
            graph.add_to_collection(key, self)

    @property
    def op(self) -> Operation:
        return self.handle.op

    @property
    def graph(self):
        return self.handle.graph

    @property
    def device(self) -> str:
        return self.handle.op.device

    def _read(self, name: str) -> Tensor:
        return apply_op("ReadVariableOp", [self.handle], self._attrs, name).outputs[0]

    def _as_graph_element(self) -> Tensor:
        return self._snapshot

    def value(self) -> Tensor:
        return self._snapshot

    def read_value(self) -> Tensor:
        """A fresh read, ordered by whatever control dependencies are in scope."""
        with self.graph.colocate_with(self.handle):
            return self._read("read")

    def _update(self, op_type: str, value, name) -> Tensor:
        value = self._convert(value, op_type)
        with self.graph.colocate_with(self.handle):
            return apply_op(op_type, [self.handle, value], self._attrs, name).outputs[0]

    def assign(self, value, name=None) -> Tensor:
        return self._update("AssignVariableOp", value, name)

    def assign_add(self, delta, name=None) -> Tensor:
        return self._update("AssignAddVariableOp", delta, name)

    def assign_sub(self, delta, name=None) -> Tensor:
        return self._update("AssignSubVariableOp", delta, name)

    def _convert(self, value, op_type: str) -> Tensor:
        if isinstance(value, Tensor) and value.dtype != self.dtype:
            raise GraphError(
                f"{op_type} on variable {self.name!r}: variable has dtype {self.dtype}, "
                f"value {value.name} has {value.dtype}"
            )
        return convert_to_tensor(value, dtype=self.dtype)

    def _scatter(self, op_type: str, indices, updates, name) -> Tensor:
        indices = convert_to_tensor(indices)
        updates = self._convert(updates, op_type)
        with self.graph.colocate_with(self.handle):
            return apply_op(op_type, [self.handle, indices, updates], self._attrs, name).outputs[0]

    def scatter_add(self, indices, updates, name=None) -> Tensor:
        return self._scatter("ResourceScatterAdd", indices, updates, name)

    def scatter_sub(self, indices, updates, name=None) -> Tensor:
        return self._scatter("ResourceScatterSub", indices, updates, name)

    def scatter_update(self, indices, updates, name=None) -> Tensor:
        return self._scatter("ResourceScatterUpdate", indices, updates, name)

    def is_initialized(self, name=None) -> Tensor:
        """Whether the variable holds a value (TensorFlow's ``VarIsInitializedOp``): a task
        that joins a running job asks this before it would initialize anything."""
        with self.graph.colocate_with(self.handle):
            return apply_op("VarIsInitializedOp", [self.handle], {}, name).outputs[0]

    def eval(self, session=None):
        return (session or get_default_session()).run(self._snapshot)

    def __repr__(self) -> str:
        return f"<Variable {self.name!r} shape={shapes.fmt(self.shape)} dtype={self.dtype}>"


def _forward(method: str):
    return lambda self, *args: getattr(self._snapshot, method)(*args)


for _m in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__matmul__",
    "__rmatmul__",
    "__neg__",
    "__pow__",
    "__lt__",
    "__gt__",
    "__le__",
    "__ge__",
    "__getitem__",
):
    setattr(Variable, _m, _forward(_m))


def global_variables(graph=None) -> list[Variable]:
    return (graph or get_default_graph()).get_collection(GLOBAL_VARIABLES)


def trainable_variables(graph=None) -> list[Variable]:
    return (graph or get_default_graph()).get_collection(TRAINABLE_VARIABLES)


def local_variables(graph=None) -> list[Variable]:
    return (graph or get_default_graph()).get_collection(LOCAL_VARIABLES)


def variables_initializer(variables: list[Variable], name: str = "init") -> Operation:
    return group(*[v.initializer for v in variables], name=name)


def global_variables_initializer() -> Operation:
    return variables_initializer(global_variables())


def local_variables_initializer() -> Operation:
    return variables_initializer(local_variables(), name="init_local")
