"""Constants, placeholders, identity and the ops that move, reshape, slice or scatter data.

The sparse ops at the end compose the paper's sharded embedding lookup: ``DynamicPartition``
(Part) splits ids by shard, ``Gather`` reads each shard's rows, ``DynamicStitch`` (Stitch)
puts the rows back in order; Gather's gradient is an ``IndexedSlices`` of just those rows.

Like TensorFlow's ``array_ops.py``, one op family per file, each op's definition, shape
function, constructor and gradient side by side: the file is long because the family is.
"""

from __future__ import annotations

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.array import decode_index
from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..autodiff import IndexedSlices, defvjp
from ..graph import (
    Operation,
    Tensor,
    apply_op,
    convert_to_tensor,
    get_default_graph,
    register_constant,
)
from ..op_def import define_op, require_same_dtype, same_as_input
from .fill_ops import dynamic_fill
from .math_ops import maximum, size


@define_op("Const", attrs={"value": None, "dtype": None}, num_inputs=0, differentiable=False)
def _const_shape(inputs, attrs):
    return [(attrs["dtype"], tuple(attrs["value"].shape))]


def constant(value, dtype=None, shape=None, name: str | None = None) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else None
    array = np.asarray(value, dtype=dtype)
    if dtype is None:
        # Python floats become float32 and ints int32, as in TensorFlow.
        if array.dtype == np.float64 and not isinstance(value, np.ndarray):
            array = array.astype(np.float32)
        elif array.dtype == np.int64 and not isinstance(value, np.ndarray):
            array = array.astype(np.int32)
    if shape is not None:
        array = np.broadcast_to(array, tuple(shape)).copy()
    array.setflags(write=False)
    op = get_default_graph().create_op(
        "Const", [], {"value": array, "dtype": array.dtype}, name or "Const"
    )
    return op.outputs[0]


register_constant(constant)


@define_op("Placeholder", attrs={"dtype": None, "shape": None}, num_inputs=0, differentiable=False)
def _placeholder_shape(inputs, attrs):
    return [(attrs["dtype"], attrs["shape"])]


def placeholder(dtype, shape=None, name: str | None = None) -> Tensor:
    attrs = {"dtype": dtypes.as_dtype(dtype), "shape": shapes.as_shape(shape)}
    return get_default_graph().create_op("Placeholder", [], attrs, name or "Placeholder").outputs[0]


define_op("Identity", num_inputs=1)(same_as_input())
define_op("StopGradient", num_inputs=1, differentiable=False)(same_as_input())


def identity(x, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    return apply_op("Identity", [x], name=name).outputs[0]


def stop_gradient(x, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    return apply_op("StopGradient", [x], name=name).outputs[0]


@defvjp("Identity")
def _identity_grad(op, grad):
    return [grad]


@define_op("NoOp", num_inputs=0, differentiable=False)
def _noop_shape(inputs, attrs):
    return []


def no_op(name: str | None = None) -> Operation:
    return get_default_graph().create_op("NoOp", [], None, name or "NoOp")


def group(*inputs, name: str | None = None) -> Operation:
    """One op that runs after all of ``inputs`` (ops or tensors)."""
    flat = []
    for x in inputs:
        flat.extend(x if isinstance(x, (list, tuple)) else [x])
    graph = get_default_graph()
    with graph.control_dependencies(flat):
        return no_op(name=name or "group_deps")


def tuple_(tensors: list[Tensor], name: str | None = None) -> list[Tensor]:
    """Identities of ``tensors`` that are each available only once all of them are."""
    gate = group(*tensors, name=name or "tuple")
    graph = get_default_graph()
    with graph.control_dependencies([gate]):
        return [identity(t) for t in tensors]


define_op("ZerosLike", num_inputs=1, differentiable=False)(same_as_input())
define_op("OnesLike", num_inputs=1, differentiable=False)(same_as_input())


def zeros_like(x, name: str | None = None) -> Tensor:
    return apply_op("ZerosLike", [convert_to_tensor(x)], name=name).outputs[0]


def ones_like(x, name: str | None = None) -> Tensor:
    return apply_op("OnesLike", [convert_to_tensor(x)], name=name).outputs[0]


# ---- helpers shared by the shape functions below


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _rank(t: Tensor) -> int | None:
    return None if t.shape is None else len(t.shape)


def _norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


def _int_tuple(values, what: str) -> tuple[int, ...]:
    if isinstance(values, Tensor):
        raise TypeError(f"{what} must be a list of Python ints, not the tensor {values.name}")
    if isinstance(values, (int, np.integer)):
        return (int(values),)
    return tuple(int(v) for v in values)


# ---- Reshape, ExpandDims, Squeeze, Transpose


@define_op("Reshape", attrs={"shape": None}, num_inputs=1)
def _reshape_shape(inputs, attrs):
    x = inputs[0]
    target = attrs["shape"]
    if target is None:
        raise ShapeError("Reshape needs a shape attr")
    holes = [i for i, d in enumerate(target) if d == -1]
    if len(holes) > 1 or any(d < -1 for d in target):
        raise ShapeError(f"target shape {target} may hold at most one -1 and no other negative")
    n_in = shapes.num_elements(x.shape)
    known = _prod(d for d in target if d != -1)
    if not holes:
        if n_in is not None and n_in != known:
            raise ShapeError(
                f"cannot reshape {shapes.fmt(x.shape)} ({n_in} elements) to {target} "
                f"({known} elements)"
            )
        return [(x.dtype, tuple(target))]
    if n_in is None:
        hole = None
    elif known == 0:
        raise ShapeError(f"cannot infer the -1 of {target}: the other dims hold zero elements")
    elif n_in % known:
        raise ShapeError(
            f"cannot reshape {shapes.fmt(x.shape)} ({n_in} elements) to {target}: "
            f"{n_in} is not a multiple of {known}"
        )
    else:
        hole = n_in // known
    return [(x.dtype, tuple(hole if d == -1 else d for d in target))]


@define_op("ReshapeToShapeOf", num_inputs=2)
def _reshape_to_shape_of_shape(inputs, attrs):
    x, like = inputs
    n_x, n_like = shapes.num_elements(x.shape), shapes.num_elements(like.shape)
    if n_x is not None and n_like is not None and n_x != n_like:
        raise ShapeError(
            f"cannot reshape {shapes.fmt(x.shape)} to the shape {shapes.fmt(like.shape)} of "
            f"{like.name}"
        )
    return [(x.dtype, like.shape)]


@define_op("ExpandDims", attrs={"axis": 0}, num_inputs=1)
def _expand_dims_shape(inputs, attrs):
    x = inputs[0]
    if x.shape is None:
        return [(x.dtype, None)]
    axis = _norm_axis(attrs["axis"], len(x.shape) + 1)
    return [(x.dtype, x.shape[:axis] + (1,) + x.shape[axis:])]


@define_op("Squeeze", attrs={"axis": None}, num_inputs=1)
def _squeeze_shape(inputs, attrs):
    x = inputs[0]
    if x.shape is None:
        return [(x.dtype, None)]
    if attrs["axis"] is None:
        if None in x.shape:
            return [(x.dtype, None)]  # which unknown dims are 1 is known only at run time
        return [(x.dtype, tuple(d for d in x.shape if d != 1))]
    axes = {_norm_axis(a, len(x.shape)) for a in attrs["axis"]}
    for a in axes:
        if x.shape[a] not in (1, None):
            raise ShapeError(f"cannot squeeze axis {a} of size {x.shape[a]}")
    return [(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in axes))]


@define_op("Transpose", attrs={"perm": None}, num_inputs=1)
def _transpose_shape(inputs, attrs):
    x, perm = inputs[0], attrs["perm"]
    if perm is None:
        return [(x.dtype, None if x.shape is None else x.shape[::-1])]
    if sorted(perm) != list(range(len(perm))):
        raise ShapeError(f"perm {perm} is not a permutation of 0..{len(perm) - 1}")
    if x.shape is None:
        return [(x.dtype, (None,) * len(perm))]
    if len(perm) != len(x.shape):
        raise ShapeError(f"perm {perm} has {len(perm)} entries for rank {len(x.shape)}")
    return [(x.dtype, tuple(x.shape[p] for p in perm))]


def reshape(x, shape, name: str | None = None) -> Tensor:
    """``shape`` holds ints; one -1 (or None) stands for whatever the element count leaves."""
    x = convert_to_tensor(x)
    target = tuple(-1 if d is None else int(d) for d in _as_dims(shape))
    return apply_op("Reshape", [x], {"shape": target}, name).outputs[0]


def _as_dims(shape):
    if isinstance(shape, Tensor):
        raise TypeError(f"shape must be a list of Python ints, not the tensor {shape.name}")
    if isinstance(shape, (int, np.integer)):
        return (shape,)
    return tuple(shape)


def reshape_to_shape_of(x, like: Tensor, name: str | None = None) -> Tensor:
    """``x`` reshaped to ``like``'s run-time shape (static shapes may be partly unknown)."""
    x = convert_to_tensor(x)
    if like.shape is not None and None not in like.shape and x.shape == like.shape:
        return x
    return apply_op("ReshapeToShapeOf", [x, like], name=name).outputs[0]


def expand_dims(x, axis: int, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    return apply_op("ExpandDims", [x], {"axis": int(axis)}, name).outputs[0]


def squeeze(x, axis=None, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    axes = None if axis is None else _int_tuple(axis, "squeeze axis")
    return apply_op("Squeeze", [x], {"axis": axes}, name).outputs[0]


def transpose(x, perm=None, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    perm = None if perm is None else _int_tuple(perm, "perm")
    return apply_op("Transpose", [x], {"perm": perm}, name).outputs[0]


@defvjp("Reshape")
def _reshape_grad(op, g):
    return [reshape_to_shape_of(g, op.inputs[0])]


@defvjp("ReshapeToShapeOf")
def _reshape_to_shape_of_grad(op, g):
    return [reshape_to_shape_of(g, op.inputs[0]), None]


@defvjp("ExpandDims")
def _expand_dims_grad(op, g):
    return [reshape_to_shape_of(g, op.inputs[0])]


@defvjp("Squeeze")
def _squeeze_grad(op, g):
    return [reshape_to_shape_of(g, op.inputs[0])]


@defvjp("Transpose")
def _transpose_grad(op, g):
    perm = op.attrs["perm"]
    if perm is None:
        return [transpose(g)]
    return [transpose(g, tuple(int(i) for i in np.argsort(perm)))]


# ---- Concat and Split


@define_op("Concat", attrs={"axis": 0})
def _concat_shape(inputs, attrs):
    if not inputs:
        raise ShapeError("Concat needs at least one input")
    dtype = require_same_dtype(inputs)
    known = [t.shape for t in inputs if t.shape is not None]
    if not known:
        return [(dtype, None)]
    rank = len(known[0])
    if any(len(s) != rank for s in known):
        raise ShapeError(f"Concat inputs differ in rank: {[shapes.fmt(s) for s in known]}")
    if rank == 0:
        raise ShapeError("Concat cannot join scalars; expand_dims them first")
    axis = _norm_axis(attrs["axis"], rank)
    out: list[int | None] = []
    for i in range(rank):
        dims = [s[i] for s in known]
        if i == axis:
            total = None if len(known) < len(inputs) or None in dims else sum(dims)
            out.append(total)
            continue
        sizes = {d for d in dims if d is not None}
        if len(sizes) > 1:
            raise ShapeError(
                f"Concat along axis {axis}: inputs differ in dim {i}: "
                f"{[shapes.fmt(s) for s in known]}"
            )
        out.append(sizes.pop() if sizes else None)
    return [(dtype, tuple(out))]


@define_op("Split", attrs={"num_split": None, "size_splits": None, "axis": 0})
def _split_shape(inputs, attrs):
    """Split ``inputs[0]`` by count, by sizes, or (when more inputs follow) like their sizes."""
    x, likes = inputs[0], inputs[1:]
    n, sizes = attrs["num_split"], attrs["size_splits"]
    if (n is not None) + (sizes is not None) + bool(likes) != 1:
        raise ShapeError("Split takes exactly one of num_split, size_splits or like-inputs")
    if x.shape is None:
        count = n if n is not None else len(sizes) if sizes is not None else len(likes)
        return [(x.dtype, None)] * count
    axis = _norm_axis(attrs["axis"], len(x.shape))
    dim = x.shape[axis]

    def with_dim(d):
        return (x.dtype, x.shape[:axis] + (d,) + x.shape[axis + 1 :])

    if likes:
        for t in likes:
            if t.shape is not None and len(t.shape) != len(x.shape):
                raise ShapeError(f"Split like-input {t.name} has another rank than the value")
        return [with_dim(None if t.shape is None else t.shape[axis]) for t in likes]
    if n is not None:
        if n < 1:
            raise ShapeError(f"num_split must be positive, got {n}")
        if dim is not None and dim % n:
            raise ShapeError(f"dim {axis} of size {dim} does not split into {n} equal parts")
        return [with_dim(None if dim is None else dim // n)] * n
    holes = [i for i, s in enumerate(sizes) if s == -1]
    if len(holes) > 1 or any(s < -1 for s in sizes):
        raise ShapeError(f"size_splits {sizes} may hold at most one -1 and no other negative")
    fixed = sum(s for s in sizes if s != -1)
    if dim is not None:
        if (holes and fixed > dim) or (not holes and fixed != dim):
            raise ShapeError(f"size_splits {sizes} do not add up to dim {axis} of size {dim}")
        sizes = [dim - fixed if s == -1 else s for s in sizes]
    return [with_dim(None if s == -1 else s) for s in sizes]


def concat(values, axis: int, name: str | None = None) -> Tensor:
    values = [convert_to_tensor(v) for v in values]
    if len(values) == 1:
        return values[0]
    return apply_op("Concat", values, {"axis": int(axis)}, name).outputs[0]


def split(value, num_or_size_splits, axis: int = 0, name: str | None = None) -> list[Tensor]:
    """An int splits into that many equal parts; a list gives the sizes (one may be -1)."""
    value = convert_to_tensor(value)
    if isinstance(num_or_size_splits, (int, np.integer)):
        attrs = {"num_split": int(num_or_size_splits), "axis": int(axis)}
    else:
        attrs = {"size_splits": _int_tuple(num_or_size_splits, "size_splits"), "axis": int(axis)}
    return apply_op("Split", [value], attrs, name).outputs


@defvjp("Concat")
def _concat_grad(op, g):
    # Split like the inputs: their sizes along the axis may be known only at run time.
    return apply_op("Split", [g, *op.inputs], {"axis": op.attrs["axis"]}).outputs


@defvjp("Split")
def _split_grad(op, *grads):
    return [concat(list(grads), op.attrs["axis"])] + [None] * (len(op.inputs) - 1)


# ---- Slice, StridedSlice (Tensor.__getitem__), Pad, Tile


def _encode_index(key) -> tuple:
    """A Python index expression as a hashable attr (slices are unhashable before 3.12)."""
    if not isinstance(key, tuple):
        key = (key,)
    out = []
    for k in key:
        if k is Ellipsis:
            out.append(("...",))
        elif k is None:
            out.append(("new",))
        elif isinstance(k, slice):
            parts = []
            for p in (k.start, k.stop, k.step):
                if isinstance(p, Tensor):
                    raise TypeError(f"slice bounds must be Python ints; {p.name} is a tensor")
                parts.append(None if p is None else _index_int(p))
            if parts[2] == 0:
                raise ValueError("slice step cannot be zero")
            out.append(("slice", *parts))
        elif isinstance(k, Tensor):
            raise TypeError(f"cannot index with tensor {k.name}; use gather() for that")
        else:
            out.append(("int", _index_int(k)))
    if sum(1 for k in out if k[0] == "...") > 1:
        raise ValueError("an index can hold only one Ellipsis")
    return tuple(out)


def _index_int(k) -> int:
    if isinstance(k, (bool, np.bool_)):
        raise TypeError("boolean indices are not supported; use a comparison and gather()")
    try:
        return int(k.__index__())
    except AttributeError:
        raise TypeError(
            f"index {k!r} is not supported: use ints, slices, ..., None, or gather()"
        ) from None


def _index_shape(in_shape, index) -> tuple | None:
    if in_shape is None:
        return None
    consuming = sum(1 for k in index if k[0] in ("int", "slice"))
    if consuming > len(in_shape):
        raise ShapeError(
            f"index {decode_index(index)} has {consuming} entries for rank {len(in_shape)}"
        )
    out: list[int | None] = []
    dim = 0
    for k in index:
        if k[0] == "...":
            n = len(in_shape) - consuming
            out.extend(in_shape[dim : dim + n])
            dim += n
        elif k[0] == "new":
            out.append(1)
        elif k[0] == "int":
            d = in_shape[dim]
            if d is not None and not -d <= k[1] < d:
                raise ShapeError(f"index {k[1]} is out of range for dim {dim} of size {d}")
            dim += 1
        else:
            d = in_shape[dim]
            out.append(None if d is None else len(range(*slice(*k[1:]).indices(d))))
            dim += 1
    out.extend(in_shape[dim:])
    return tuple(out)


@define_op("StridedSlice", attrs={"index": ()}, num_inputs=1)
def _strided_slice_shape(inputs, attrs):
    x = inputs[0]
    return [(x.dtype, _index_shape(x.shape, attrs["index"]))]


@define_op("StridedSliceGrad", attrs={"index": ()}, num_inputs=2)
def _strided_slice_grad_shape(inputs, attrs):
    g, x = inputs
    want = _index_shape(x.shape, attrs["index"])
    if not shapes.compatible(want, g.shape):
        raise ShapeError(
            f"gradient {shapes.fmt(g.shape)} does not fit {decode_index(attrs['index'])} of "
            f"{shapes.fmt(x.shape)}"
        )
    return [(g.dtype, x.shape)]


def strided_slice(x, key, name: str | None = None) -> Tensor:
    """``x[key]`` for basic NumPy indexing: ints, slices with steps, ``...`` and ``None``."""
    x = convert_to_tensor(x)
    return apply_op("StridedSlice", [x], {"index": _encode_index(key)}, name).outputs[0]


def strided_slice_grad(g, x: Tensor, key, name: str | None = None) -> Tensor:
    """Zeros shaped like ``x`` with ``g`` written at ``x[key]``: the gradient of indexing."""
    g = convert_to_tensor(g)
    return apply_op("StridedSliceGrad", [g, x], {"index": _encode_index(key)}, name).outputs[0]


def _getitem(self: Tensor, key) -> Tensor:
    return strided_slice(self, key)


Tensor.__getitem__ = _getitem


@defvjp("StridedSlice")
def _strided_slice_grad(op, g):
    attrs = {"index": op.attrs["index"]}
    return [apply_op("StridedSliceGrad", [g, op.inputs[0]], attrs).outputs[0]]


@defvjp("StridedSliceGrad")
def _strided_slice_grad_grad(op, gg):
    return [apply_op("StridedSlice", [gg], {"index": op.attrs["index"]}).outputs[0], None]


def _slice_key(begin, size) -> tuple:
    return tuple(slice(b, None if s == -1 else b + s) for b, s in zip(begin, size, strict=True))


@define_op("Slice", attrs={"begin": (), "size": ()}, num_inputs=1)
def _slice_shape(inputs, attrs):
    x, begin, size = inputs[0], attrs["begin"], attrs["size"]
    if len(begin) != len(size):
        raise ShapeError(f"begin {begin} and size {size} differ in length")
    if any(b < 0 for b in begin) or any(s < -1 for s in size):
        raise ShapeError(f"begin {begin} must be >= 0 and size {size} >= -1")
    if x.shape is None:
        return [(x.dtype, tuple(None if s == -1 else s for s in size))]
    if len(x.shape) != len(begin):
        raise ShapeError(f"begin {begin} has {len(begin)} entries for rank {len(x.shape)}")
    out = []
    for i, (d, b, s) in enumerate(zip(x.shape, begin, size, strict=True)):
        if d is not None and b + max(s, 0) > d:
            raise ShapeError(f"slice [{b}:{b + s}] of dim {i} exceeds its size {d}")
        out.append(s if s != -1 else (None if d is None else d - b))
    return [(x.dtype, tuple(out))]


def slice_(x, begin, size, name: str | None = None) -> Tensor:
    """``x[begin[i] : begin[i] + size[i]]`` in every dim; a size of -1 runs to the end."""
    x = convert_to_tensor(x)
    attrs = {"begin": _int_tuple(begin, "begin"), "size": _int_tuple(size, "size")}
    return apply_op("Slice", [x], attrs, name).outputs[0]


@defvjp("Slice")
def _slice_grad(op, g):
    key = _slice_key(op.attrs["begin"], op.attrs["size"])
    return [strided_slice_grad(g, op.inputs[0], key)]


@define_op("Pad", attrs={"paddings": (), "constant_values": 0}, num_inputs=1)
def _pad_shape(inputs, attrs):
    x, paddings = inputs[0], attrs["paddings"]
    if any(len(p) != 2 or p[0] < 0 or p[1] < 0 for p in paddings):
        raise ShapeError(f"paddings {paddings} must be non-negative (before, after) pairs")
    if x.shape is None:
        return [(x.dtype, (None,) * len(paddings))]
    if len(paddings) != len(x.shape):
        raise ShapeError(f"paddings {paddings} have {len(paddings)} pairs for rank {len(x.shape)}")
    return [
        (
            x.dtype,
            tuple(
                None if d is None else d + a + b
                for d, (a, b) in zip(x.shape, paddings, strict=True)
            ),
        )
    ]


def pad(x, paddings, constant_values=0, name: str | None = None) -> Tensor:
    """Constant padding: ``paddings[i] = (before, after)`` for dim i."""
    x = convert_to_tensor(x)
    pairs = tuple((int(a), int(b)) for a, b in paddings)
    attrs = {"paddings": pairs, "constant_values": constant_values}
    return apply_op("Pad", [x], attrs, name).outputs[0]


@defvjp("Pad")
def _pad_grad(op, g):
    key = tuple(slice(a, -b if b else None) for a, b in op.attrs["paddings"])
    return [strided_slice(g, key)]


@define_op("Tile", attrs={"multiples": ()}, num_inputs=1)
def _tile_shape(inputs, attrs):
    x, multiples = inputs[0], attrs["multiples"]
    if any(m < 0 for m in multiples):
        raise ShapeError(f"multiples {multiples} must be non-negative")
    if x.shape is None:
        return [(x.dtype, (None,) * len(multiples))]
    if len(multiples) != len(x.shape):
        raise ShapeError(
            f"multiples {multiples} have {len(multiples)} entries for rank {len(x.shape)}"
        )
    return [
        (
            x.dtype,
            tuple(None if d is None else d * m for d, m in zip(x.shape, multiples, strict=True)),
        )
    ]


@define_op("TileGrad", attrs={"multiples": ()}, num_inputs=2)
def _tile_grad_shape(inputs, attrs):
    g, x = inputs
    return [(g.dtype, x.shape)]


def tile(x, multiples, name: str | None = None) -> Tensor:
    x = convert_to_tensor(x)
    return apply_op("Tile", [x], {"multiples": _int_tuple(multiples, "multiples")}, name).outputs[0]


def tile_grad(g, x: Tensor, multiples, name: str | None = None) -> Tensor:
    """``g`` (shaped like ``tile(x, multiples)``) summed over the copies: shaped like ``x``."""
    attrs = {"multiples": _int_tuple(multiples, "multiples")}
    return apply_op("TileGrad", [convert_to_tensor(g), x], attrs, name).outputs[0]


@defvjp("Tile")
def _tile_grad(op, g):
    return [tile_grad(g, op.inputs[0], op.attrs["multiples"])]


@defvjp("TileGrad")
def _tile_grad_grad(op, gg):
    return [tile(gg, op.attrs["multiples"]), None]


# ---- Fill (zeros, ones), Shape, Range, OneHot


@define_op(
    "Fill", attrs={"shape": (), "value": 0, "dtype": None}, num_inputs=0, differentiable=False
)
def _fill_shape(inputs, attrs):
    shape = attrs["shape"]
    if any(d is None or d < 0 for d in shape):
        raise ShapeError(f"Fill needs a fully known shape, got {shapes.fmt(shape)}")
    return [(attrs["dtype"], tuple(shape))]


def fill(shape, value, dtype=None, name: str | None = None) -> Tensor:
    """A tensor of one value; unlike a Const, the graph stores the value, not the array.
    ``shape`` may be an int vector tensor, known only when the step runs."""
    if dtype is None:
        dtype = constant_dtype(value)
    if isinstance(shape, Tensor):
        return dynamic_fill(shape, value, dtype, name=name or "Fill")
    dims = shapes.as_shape(_as_dims(shape))
    attrs = {"shape": dims, "value": value, "dtype": dtypes.as_dtype(dtype)}
    return get_default_graph().create_op("Fill", [], attrs, name or "Fill").outputs[0]


def constant_dtype(value) -> np.dtype:
    """The dtype ``constant(value)`` would pick: Python floats are float32, ints int32."""
    if isinstance(value, (bool, np.bool_)):
        return dtypes.bool_
    if isinstance(value, (int, np.integer)):
        return np.asarray(value).dtype if isinstance(value, np.integer) else dtypes.int32
    if isinstance(value, float):
        return dtypes.float32
    return np.asarray(value).dtype


def zeros(shape, dtype=dtypes.float32, name: str | None = None) -> Tensor:
    return fill(shape, 0, dtype, name=name or "zeros")


def ones(shape, dtype=dtypes.float32, name: str | None = None) -> Tensor:
    return fill(shape, 1, dtype, name=name or "ones")


@define_op("Shape", attrs={"out_type": dtypes.int32}, num_inputs=1, differentiable=False)
def _shape_shape(inputs, attrs):
    return [(attrs["out_type"], (_rank(inputs[0]),))]


def shape(x, out_type=dtypes.int32, name: str | None = None) -> Tensor:
    """The run-time shape of ``x`` as a 1-D tensor (static dims are in ``x.shape``)."""
    x = convert_to_tensor(x)
    return apply_op("Shape", [x], {"out_type": dtypes.as_dtype(out_type)}, name).outputs[0]


@define_op("Range", num_inputs=3, differentiable=False)
def _range_shape(inputs, attrs):
    dtype = require_same_dtype(inputs)
    for t in inputs:
        if t.shape is not None and t.shape != ():
            raise ShapeError(f"Range takes scalars; {t.name} has shape {shapes.fmt(t.shape)}")
    if all(t.op.type == "Const" for t in inputs):
        start, limit, delta = (t.op.attrs["value"].item() for t in inputs)
        if delta == 0:
            raise ShapeError("Range delta must not be zero")
        return [(dtype, (len(np.arange(start, limit, delta)),))]
    return [(dtype, (None,))]


def range_(start, limit=None, delta=1, dtype=None, name: str | None = None) -> Tensor:
    """``[start, start + delta, ...)`` up to ``limit``; ``range_(n)`` counts from 0 to n."""
    if limit is None:
        start, limit = 0, start
    known = next((v for v in (start, limit, delta) if isinstance(v, Tensor)), None)
    if dtype is None:
        if known is not None:
            dtype = known.dtype
        else:
            dtype = np.result_type(*(constant_dtype(v) for v in (start, limit, delta)))
    dtype = dtypes.as_dtype(dtype)
    inputs = [
        convert_to_tensor(v, dtype if not isinstance(v, Tensor) else None)
        for v in (start, limit, delta)
    ]
    return apply_op("Range", inputs, name=name).outputs[0]


@define_op(
    "OneHot",
    attrs={"depth": None, "on_value": 1, "off_value": 0, "axis": -1, "dtype": dtypes.float32},
    num_inputs=1,
    differentiable=False,
)
def _one_hot_shape(inputs, attrs):
    indices, depth = inputs[0], attrs["depth"]
    if indices.dtype.kind not in "iu":
        raise ShapeError(f"one_hot indices must be integers, got {indices.dtype}")
    if depth is None or depth < 0:
        raise ShapeError(f"depth must be a non-negative int, got {depth}")
    if indices.shape is None:
        return [(attrs["dtype"], None)]
    axis = _norm_axis(attrs["axis"], len(indices.shape) + 1)
    return [(attrs["dtype"], indices.shape[:axis] + (depth,) + indices.shape[axis:])]


def one_hot(
    indices,
    depth: int,
    on_value=1,
    off_value=0,
    axis: int = -1,
    dtype=dtypes.float32,
    name: str | None = None,
) -> Tensor:
    """Indices outside [0, depth) give a row of ``off_value``, as in TensorFlow."""
    indices = convert_to_tensor(indices)
    attrs = {
        "depth": int(depth),
        "on_value": on_value,
        "off_value": off_value,
        "axis": int(axis),
        "dtype": dtypes.as_dtype(dtype),
    }
    return apply_op("OneHot", [indices], attrs, name).outputs[0]


# ---- sparse ops: Gather, UnsortedSegmentSum, DynamicPartition, DynamicStitch


def _require_ints(t: Tensor, what: str) -> None:
    if t.dtype.kind not in "iu":
        raise ShapeError(f"{what} must be integers, {t.name} is {t.dtype}")


@define_op("Gather", attrs={"axis": 0}, num_inputs=2)
def _gather_shape(inputs, attrs):
    params, indices = inputs
    _require_ints(indices, "Gather indices")
    if params.shape is None or indices.shape is None:
        return [(params.dtype, None)]
    if not params.shape:
        raise ShapeError("Gather params must have rank >= 1")
    axis = _norm_axis(attrs["axis"], len(params.shape))
    return [(params.dtype, params.shape[:axis] + indices.shape + params.shape[axis + 1 :])]


def gather(params, indices, axis: int = 0, name: str | None = None) -> Tensor:
    """``params`` sliced at ``indices`` along ``axis``; its gradient is sparse when axis is 0."""
    params = convert_to_tensor(params)
    indices = convert_to_tensor(indices)
    return apply_op("Gather", [params, indices], {"axis": int(axis)}, name).outputs[0]


@defvjp("Gather")
def _gather_grad(op, g):
    params, indices = op.inputs
    if params.shape is None:
        raise ShapeError(f"gradient of {op.name}: params rank must be known")
    axis = _norm_axis(op.attrs["axis"], len(params.shape))
    tail = params.shape[axis + 1 :]
    if axis == 0 and params.shape[0] is not None:
        if _rank(indices) == 1:
            return [IndexedSlices(g, indices, params.shape), None]
        if None not in tail:
            values = reshape(g, (-1,) + tail)
            return [IndexedSlices(values, reshape(indices, (-1,)), params.shape), None]
    # Dense: sum g's rows into params' rows, with the gathered axis moved to the front.
    n = params.shape[axis]
    num = n if n is not None else strided_slice(shape(params, indices.dtype), axis)
    if axis == 0:
        return [unsorted_segment_sum(g, indices, num), None]
    r = _rank(indices)
    if r is None:
        raise ShapeError(f"gradient of {op.name}: indices rank must be known for axis {axis}")
    rank_g = len(params.shape) - 1 + r
    front = tuple(range(axis, axis + r)) + tuple(range(axis)) + tuple(range(axis + r, rank_g))
    summed = unsorted_segment_sum(transpose(g, front), indices, num)
    back = tuple(range(1, axis + 1)) + (0,) + tuple(range(axis + 1, len(params.shape)))
    return [transpose(summed, back), None]


@define_op("UnsortedSegmentSum", attrs={"num_segments": None})
def _unsorted_segment_sum_shape(inputs, attrs):
    """``num_segments`` is an int attr, or (when None) a scalar third input."""
    if len(inputs) not in (2, 3) or (len(inputs) == 3) == (attrs["num_segments"] is not None):
        raise ShapeError(
            "UnsortedSegmentSum takes (data, segment_ids) with a num_segments "
            "attr, or (data, segment_ids, num_segments)"
        )
    data, ids = inputs[:2]
    _require_ints(ids, "segment_ids")
    n = attrs["num_segments"]
    if len(inputs) == 3:
        _require_ints(inputs[2], "num_segments")
    elif n < 0:
        raise ShapeError(f"num_segments must be non-negative, got {n}")
    if data.shape is None or ids.shape is None:
        return [(data.dtype, None)]
    k = len(ids.shape)
    if not shapes.compatible(data.shape[:k], ids.shape) or len(data.shape) < k:
        raise ShapeError(
            f"segment_ids {shapes.fmt(ids.shape)} must be a prefix of data {shapes.fmt(data.shape)}"
        )
    return [(data.dtype, (n,) + data.shape[k:])]


def unsorted_segment_sum(data, segment_ids, num_segments, name: str | None = None) -> Tensor:
    """``out[j] = sum of data[i] where segment_ids[i] == j``; negative ids are dropped."""
    data = convert_to_tensor(data)
    segment_ids = convert_to_tensor(segment_ids)
    if isinstance(num_segments, Tensor):
        inputs, attrs = [data, segment_ids, num_segments], {}
    else:
        inputs, attrs = [data, segment_ids], {"num_segments": int(num_segments)}
    return apply_op("UnsortedSegmentSum", inputs, attrs, name).outputs[0]


@defvjp("UnsortedSegmentSum")
def _unsorted_segment_sum_grad(op, g):
    ids = op.inputs[1]
    if ids.dtype.kind == "u":
        return [gather(g, ids)] + [None] * (len(op.inputs) - 1)
    if g.shape is None:
        raise ShapeError(f"gradient of {op.name}: output rank must be known")
    # Dropped (negative) ids read a zero row appended to g: gather wraps -1 to it.
    padded = pad(g, ((0, 1),) + ((0, 0),) * (len(g.shape) - 1))
    grads = [gather(padded, maximum(ids, -1)), None]
    return grads + [None] * (len(op.inputs) - 2)


@define_op("DynamicPartition", attrs={"num_partitions": None}, num_inputs=2)
def _dynamic_partition_shape(inputs, attrs):
    data, partitions = inputs
    _require_ints(partitions, "partitions")
    n = attrs["num_partitions"]
    if n is None or n < 1:
        raise ShapeError(f"num_partitions must be a positive int, got {n}")
    if data.shape is None or partitions.shape is None:
        return [(data.dtype, None)] * n
    k = len(partitions.shape)
    if len(data.shape) < k or not shapes.compatible(data.shape[:k], partitions.shape):
        raise ShapeError(
            f"partitions {shapes.fmt(partitions.shape)} must be a prefix of data "
            f"{shapes.fmt(data.shape)}"
        )
    return [(data.dtype, (None,) + data.shape[k:])] * n


def dynamic_partition(data, partitions, num_partitions: int, name: str | None = None):
    """The paper's Part: ``out[p]`` holds the rows of ``data`` whose partition is p, in order."""
    data = convert_to_tensor(data)
    partitions = convert_to_tensor(partitions)
    attrs = {"num_partitions": int(num_partitions)}
    return apply_op("DynamicPartition", [data, partitions], attrs, name).outputs


@defvjp("DynamicPartition")
def _dynamic_partition_grad(op, *grads):
    data, partitions = op.inputs
    positions = reshape_to_shape_of(range_(size(partitions)), partitions)
    where = dynamic_partition(positions, partitions, op.attrs["num_partitions"])
    return [reshape_to_shape_of(dynamic_stitch(where, list(grads)), data), None]


@define_op("DynamicStitch")
def _dynamic_stitch_shape(inputs, attrs):
    if not inputs or len(inputs) % 2:
        raise ShapeError(f"DynamicStitch takes N indices then N data, got {len(inputs)} inputs")
    n = len(inputs) // 2
    indices, data = inputs[:n], inputs[n:]
    for t in indices:
        _require_ints(t, "DynamicStitch indices")
    dtype = require_same_dtype(data)
    tail = None
    for i, d in zip(indices, data, strict=True):
        if i.shape is None or d.shape is None:
            continue
        k = len(i.shape)
        if len(d.shape) < k or not shapes.compatible(d.shape[:k], i.shape):
            raise ShapeError(
                f"indices {i.name} {shapes.fmt(i.shape)} must be a prefix of data {d.name} "
                f"{shapes.fmt(d.shape)}"
            )
        if tail is not None and not shapes.compatible(tail, d.shape[k:]):
            raise ShapeError(f"data rows differ: {shapes.fmt(tail)} vs {shapes.fmt(d.shape[k:])}")
        tail = shapes.merge(tail, d.shape[k:])
    return [(dtype, None if tail is None else (None,) + tail)]


def dynamic_stitch(indices, data, name: str | None = None) -> Tensor:
    """The paper's Stitch: ``out[indices[m][i]] = data[m][i]``, sized by the largest index."""
    indices = [convert_to_tensor(i) for i in indices]
    data = [convert_to_tensor(d) for d in data]
    if len(indices) != len(data):
        raise ValueError(f"dynamic_stitch: {len(indices)} index tensors for {len(data)} data")
    return apply_op("DynamicStitch", indices + data, name=name).outputs[0]


@defvjp("DynamicStitch")
def _dynamic_stitch_grad(op, g):
    n = len(op.inputs) // 2
    return [None] * n + [gather(g, i) for i in op.inputs[:n]]
