"""Flowmill's dataflow runtime: build a graph, then run steps of it in a Session.

``import flowmill.runtime as fm`` gives the names a model script uses (``fm.placeholder``,
``fm.Session``, ``fm.train.Adam``, ...). They are loaded on first use, so importing one
module of the package (the task contract in ``cluster``, say, as the operator does) does
not load the rest. The modules, in TensorFlow's terms (``README.md`` here has the map):
building (``graph``, ``op_def``, ``ops/``, ``autodiff``, ``optimizers``), one step
(``prune`` -> ``passes`` -> ``placement`` -> ``partition`` -> ``executor`` over
``step_graph``), sessions (``session``, ``distributed``), tasks (``server``,
``remote_rendezvous``, ``rendezvous``, ``transport``), the job (``cluster``, ``job``,
``training_mode``, ``replicas``, ``session_manager``, ``saver``, ``checkpoint_policy``,
``task_exit``).

In a training task of a cluster (``FLOWMILL_CONFIG`` names the chief or a worker),
``Session()`` is that task's ``DistributedSession`` and ``Optimizer.minimize`` builds the
job's training mode: both ask ``hooks``, which this package sets below. In any task its
BLAS/OpenMP thread count is set when this package loads (``threads``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from . import hooks as _hooks
from .cluster import ENV_VAR as _CLUSTER_ENV

if os.environ.get(_CLUSTER_ENV):
    # A task of a cluster: its math libraries get its share of the cores, not all of them.
    from .threads import apply_in_task as _apply_threads

    _apply_threads()

# module -> the names it gives the facade under their own names
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".graph": (
        "colocate_with", "control_dependencies", "convert_to_tensor", "device",
        "get_default_graph", "get_default_session", "Graph", "GraphError", "name_scope",
        "Operation", "reset_default_graph", "Tensor",
        "add_to_collection", "get_collection", "GraphKeys",
    ),
    ".session": (
        "FeedError", "Session", "SessionClosedError",
    ),
    ".session_manager": (
        "initialize_or_wait",
    ),
    ".task_errors": (
        "TaskError",
    ),
    ".job": (
        "max_steps", "own_steps", "steps_done", "task", "training_done",
    ),
    ".autodiff": (
        "defvjp", "IndexedSlices",
    ),
    ".backprop": (
        "gradients",
    ),
    ".dtypes": (
        "bool_", "float16", "float32", "float64", "int32", "int64", "int8", "uint8",
        "string",
    ),
    ".ops.array_ops": (
        "concat", "constant", "dynamic_partition", "dynamic_stitch", "expand_dims", "fill",
        "gather", "group", "identity", "no_op", "one_hot", "ones", "ones_like", "pad",
        "placeholder", "reshape", "shape", "split", "squeeze", "stop_gradient", "strided_slice",
        "tile", "transpose", "tuple_", "unsorted_segment_sum", "zeros", "zeros_like",
    ),
    ".ops.math_ops": (
        "abs", "add", "add_n", "argmax", "cast", "divide", "equal", "exp", "floordiv",
        "floormod", "greater", "greater_equal", "less", "less_equal", "log", "logical_and",
        "logical_not", "logical_or", "matmul", "maximum", "minimum", "multiply", "negative",
        "not_equal", "pow", "reciprocal", "reduce_max", "reduce_mean", "reduce_min",
        "reduce_prod", "reduce_sum", "rsqrt", "sign", "size", "sqrt", "square",
        "squared_difference", "subtract",
    ),
    ".ops.nn_ops": (
        "sigmoid", "tanh",
    ),
    ".progress": (
        "ProgressBar",
    ),
    ".ops.control_flow_ops": (
        "cond", "while_loop",
    ),
    ".ops.data_flow_ops": (
        "FIFOQueue",
    ),
    ".ops.random_ops": (
        "random_normal", "random_uniform", "truncated_normal",
    ),
    ".ops.state_ops": (
        "global_variables", "global_variables_initializer", "local_variables",
        "local_variables_initializer", "trainable_variables", "Variable", "variables_initializer",
    ),
    ".ops.select_ops": (
        "where",
    ),
    ".ops.tensor_array_ops": (
        "TensorArray",
    ),
    ".ops.pack_ops": (
        "stack", "unstack",
    ),
    ".ops.clip_ops": (
        "clip_by_global_norm", "clip_by_norm", "clip_by_value", "global_norm",
    ),
    ".variable_scopes": (
        "AUTO_REUSE", "get_variable", "get_variable_scope", "variable_scope", "VariableScope",
    ),
    ".gpu_memory": (
        "ResourceExhaustedError",
    ),
    ".session_config": (
        "ConfigProto", "GPUOptions",
    ),
    "flowmill.kernels.debug": (
        "InvalidArgumentError",
    ),
    "flowmill.kernels.fifo_queue": (
        "OutOfRangeError", "QueueClosedError",
    ),
    "flowmill.kernels.shapes": (
        "ShapeError",
    ),
}
# facade name -> (module, name there); a module itself where the name is None
_RENAMED: dict[str, tuple[str, str | None]] = {
    "print": (".ops.debug_ops", "print_"),
    "range": (".ops.array_ops", "range_"),
    "slice": (".ops.array_ops", "slice_"),
    "data": (".data", None),
    "debugging": (".ops.debug_ops", None),
    "dtypes": (".dtypes", None),
    "initializers": (".initializers", None),
    "layers": (".layers", None),
    "nn": (".nn", None),
    "saved_model": (".saved_model", None),
    "summary": (".summary", None),
    "train": (".train", None),
}
_WHERE: dict[str, tuple[str, str | None]] = {
    name: (module, name) for module, names in _EXPORTS.items() for name in names
} | _RENAMED

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        from .tf_names import missing

        raise missing("fm", name, __all__)
    module = importlib.import_module(where[0], __name__)
    value = module if where[1] is None else getattr(module, where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# ---- the job's hooks: the modules they need load only in a task of a cluster


def _cluster_session(*args, **kwargs):
    if not os.environ.get(_CLUSTER_ENV):
        return None
    from .task_server import cluster_session

    return cluster_session(*args, **kwargs)


def _replicated_minimize(optimizer, loss, global_step=None, var_list=None):
    if not os.environ.get(_CLUSTER_ENV):
        return None
    from .training_mode import replicated_minimize

    return replicated_minimize(optimizer, loss, global_step, var_list)


_hooks.cluster_session = _cluster_session
_hooks.replicated_minimize = _replicated_minimize
