"""Flowmill's dataflow runtime: build a graph, then run steps of it in a Session."""

from . import dtypes, initializers
from . import optimizers as train
from .dtypes import bool_, float16, float32, float64, int8, int32, int64, uint8
from .gradients import IndexedSlices, defvjp, gradients
from .graph import (
    Graph,
    GraphError,
    Operation,
    Tensor,
    colocate_with,
    control_dependencies,
    convert_to_tensor,
    device,
    get_default_graph,
    name_scope,
    reset_default_graph,
)
from .ops import nn_ops as nn
from .ops.array_ops import (
    concat,
    constant,
    dynamic_partition,
    dynamic_stitch,
    expand_dims,
    fill,
    gather,
    group,
    identity,
    no_op,
    one_hot,
    ones,
    ones_like,
    pad,
    placeholder,
    reshape,
    shape,
    split,
    squeeze,
    stop_gradient,
    strided_slice,
    tile,
    transpose,
    tuple_,
    unsorted_segment_sum,
    zeros,
    zeros_like,
)
from .ops.array_ops import range_ as range
from .ops.array_ops import slice_ as slice
from .ops.control_flow_ops import cond, while_loop
from .ops.data_flow_ops import FIFOQueue
from .ops.math_ops import (
    abs,
    add,
    add_n,
    argmax,
    cast,
    divide,
    equal,
    exp,
    greater,
    less,
    log,
    matmul,
    maximum,
    minimum,
    multiply,
    negative,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_sum,
    sqrt,
    square,
    subtract,
)
from .ops.random_ops import random_normal, random_uniform, truncated_normal
from .ops.state_ops import (
    Variable,
    global_variables,
    global_variables_initializer,
    trainable_variables,
    variables_initializer,
)
from .queues import OutOfRangeError, QueueClosedError
from .session import FeedError, Session, SessionClosedError, get_default_session
from .shapes import ShapeError
from .transparent import initialize_or_wait, task

__all__ = [name for name in dir() if not name.startswith("_")]
