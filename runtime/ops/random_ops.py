"""Random ops: stateful generators whose streams are reproducible from a pair of seeds.

The shape to draw is a static attr or, for dims known only at run time, a 1-D int tensor
such as ``shape(x)``.

Seeding follows TensorFlow. An op draws from the stream named by ``(seed, seed2)``: the
graph-level seed (``Graph.seed``) and the op-level seed. With only the graph seed set, the
op seed is derived from the number of ops built so far, so a graph built the same way twice
draws the same numbers; with neither set, each session draws differently. Every session
starts each op's stream afresh, so two sessions of one graph and seed see the same sequence.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import Tensor, get_default_graph
from ..op_def import define_op

# The graph seed used when only an op seed is given (TensorFlow's DEFAULT_GRAPH_SEED).
DEFAULT_GRAPH_SEED = 87654321


def get_seed(op_seed: int | None, graph=None) -> tuple[int | None, int | None]:
    """The ``(seed, seed2)`` pair an op built now should use; ``(None, None)``: unseeded."""
    graph = graph or get_default_graph()
    if graph.seed is not None:
        seed = int(graph.seed)
        seed2 = int(op_seed) if op_seed is not None else len(graph._ops)
        return seed, seed2
    if op_seed is not None:
        return DEFAULT_GRAPH_SEED, int(op_seed)
    return None, None


def _random_shape(inputs, attrs):
    """The shape is an attr, or a run-time 1-D int input (``shape(x)`` for an unknown batch)."""
    dtype = attrs["dtype"]
    if dtype is None or dtype.kind != "f":
        raise ShapeError(f"random ops draw floating-point values, not {dtype}")
    if inputs:
        (dims,) = inputs
        if attrs["shape"] is not None:
            raise ShapeError("random ops take a shape attr or a shape input, not both")
        if dims.dtype.kind not in "iu" or (dims.shape is not None and len(dims.shape) != 1):
            raise ShapeError(
                f"a shape input must be a 1-D int tensor, {dims.name} is "
                f"{shapes.fmt(dims.shape)} {dims.dtype}"
            )
        return [(dtype, _static_shape_of(dims))]
    shape = attrs["shape"]
    if shape is None or any(d is None or d < 0 for d in shape):
        raise ShapeError(
            f"random ops need a fully known shape attr, got {shapes.fmt(shape)}; pass a "
            "shape tensor such as shape(x) for dims known only at run time"
        )
    return [(dtype, tuple(shape))]


def _static_shape_of(dims: Tensor):
    """What the graph knows of the value of a shape tensor."""
    if dims.op.type == "Shape":
        return dims.op.inputs[0].shape
    if dims.op.type == "Const":
        return tuple(int(d) for d in dims.op.attrs["value"])
    if dims.shape is None or dims.shape[0] is None:
        return None
    return (None,) * dims.shape[0]


RANDOM_OPS = ("RandomUniform", "RandomStandardNormal", "TruncatedNormal")
for _name in RANDOM_OPS:
    define_op(
        _name,
        attrs={"shape": None, "dtype": dtypes.float32, "seed": None, "seed2": None},
        stateful=True,
        differentiable=False,
    )(_random_shape)


def _draw(op_type: str, shape, dtype, seed, name) -> Tensor:
    graph = get_default_graph()
    seed, seed2 = get_seed(seed, graph)
    attrs = {"dtype": dtypes.as_dtype(dtype), "seed": seed, "seed2": seed2}
    if isinstance(shape, Tensor):
        inputs = [shape]
    else:
        inputs, attrs["shape"] = [], shapes.as_shape(shape)
    return graph.create_op(op_type, inputs, attrs, name or op_type).outputs[0]


def _affine(x: Tensor, scale, shift) -> Tensor:
    """``x * scale + shift``, leaving out the ops a default scale or shift would waste."""
    if isinstance(scale, Tensor) or scale != 1:
        x = x * scale
    if isinstance(shift, Tensor) or shift != 0:
        x = x + shift
    return x


def random_uniform(
    shape, minval=0.0, maxval=1.0, dtype=dtypes.float32, seed=None, name=None
) -> Tensor:
    """Uniform on ``[minval, maxval)``."""
    x = _draw("RandomUniform", shape, dtype, seed, name)
    if isinstance(minval, Tensor) or isinstance(maxval, Tensor):
        return x * (maxval - minval) + minval
    return _affine(x, maxval - minval, minval)


def random_normal(shape, mean=0.0, stddev=1.0, dtype=dtypes.float32, seed=None, name=None):
    x = _draw("RandomStandardNormal", shape, dtype, seed, name)
    return _affine(x, stddev, mean)


def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=dtypes.float32, seed=None, name=None):
    """Normal, with values more than two standard deviations from the mean drawn again."""
    x = _draw("TruncatedNormal", shape, dtype, seed, name)
    return _affine(x, stddev, mean)
