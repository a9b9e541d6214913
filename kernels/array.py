"""Kernels for constants, identities and the ops that move, slice and scatter data.

Most return views where NumPy can (reshape, transpose, slices); no kernel writes to an input.
"""

from __future__ import annotations

import math

import numpy

from .registry import KernelContext, kernel


@kernel("Const")
def _const(ctx: KernelContext):
    value = ctx.xp.asarray(ctx.attrs["value"])
    return lambda: value


@kernel("Placeholder")
def _placeholder(ctx: KernelContext):
    def fn():
        raise ValueError(f"placeholder {ctx.name!r} must be fed")

    return fn


def _identity(ctx: KernelContext):
    return lambda x: x


kernel("Identity")(_identity)
kernel("StopGradient")(_identity)


def _nothing() -> None:
    return None


@kernel("NoOp")
def _noop(ctx: KernelContext):
    return _nothing  # one shared function: calls through it are the cheapest dispatch


@kernel("ZerosLike")
def _zeros_like(ctx: KernelContext):
    return ctx.xp.zeros_like


@kernel("OnesLike")
def _ones_like(ctx: KernelContext):
    return ctx.xp.ones_like


@kernel("Select")
def _select(ctx: KernelContext):
    """TensorFlow 1.x's Select: ``x`` where ``condition``, else ``y``; the condition is a
    scalar, shaped like ``x``, or a vector picking whole rows (first dim) of ``x``."""
    where, name = ctx.xp.where, ctx.name

    def fn(c, x, y):
        if x.shape != y.shape:
            raise ValueError(
                f"Select {name!r}: x has shape {x.shape} but y has shape {y.shape}"
            )
        if c.ndim == 0 or c.shape == x.shape:
            return where(c, x, y)
        if c.ndim == 1 and x.ndim > 1 and c.shape[0] == x.shape[0]:
            return where(c.reshape(c.shape + (1,) * (x.ndim - 1)), x, y)
        raise ValueError(
            f"Select {name!r}: condition of shape {c.shape} must be a scalar, have x's "
            f"shape {x.shape}, or be a vector of its first dim"
        )

    return fn


# ---- reshaping: NumPy returns views, so these cost no copy


@kernel("Reshape")
def _reshape(ctx: KernelContext):
    shape = tuple(ctx.attrs["shape"])
    return lambda x: x.reshape(shape)


@kernel("ReshapeToShapeOf")
def _reshape_to_shape_of(ctx: KernelContext):
    return lambda x, like: x.reshape(like.shape)


@kernel("ExpandDims")
def _expand_dims(ctx: KernelContext):
    xp, axis = ctx.xp, ctx.attrs["axis"]
    return lambda x: xp.expand_dims(x, axis)


@kernel("Squeeze")
def _squeeze(ctx: KernelContext):
    xp, axis = ctx.xp, ctx.attrs["axis"]
    return lambda x: xp.squeeze(x, axis)


@kernel("Transpose")
def _transpose(ctx: KernelContext):
    xp, perm = ctx.xp, ctx.attrs["perm"]
    return lambda x: xp.transpose(x, perm)


@kernel("Concat")
def _concat(ctx: KernelContext):
    concatenate, axis = ctx.xp.concatenate, ctx.attrs["axis"]
    return lambda *xs: concatenate(xs, axis=axis)


@kernel("Split")
def _split(ctx: KernelContext):
    xp, axis = ctx.xp, ctx.attrs["axis"]
    n, sizes = ctx.attrs["num_split"], ctx.attrs["size_splits"]
    if len(ctx.output_dtypes) == 1:
        return lambda x, *likes: x
    if n is not None:
        return lambda x: tuple(xp.split(x, n, axis=axis))
    if sizes is None:  # split like the other inputs (Concat's gradient)

        def like(x, *likes):
            cuts, at = [], 0
            for t in likes[:-1]:
                at += t.shape[axis]
                cuts.append(at)
            return tuple(xp.split(x, cuts, axis=axis))

        return like
    if -1 not in sizes:
        cuts = list(_cumulative(sizes[:-1]))
        return lambda x: tuple(xp.split(x, cuts, axis=axis))
    hole = sizes.index(-1)
    fixed = sum(s for s in sizes if s != -1)

    def with_hole(x):
        dims = list(sizes)
        dims[hole] = x.shape[axis] - fixed
        return tuple(xp.split(x, list(_cumulative(dims[:-1])), axis=axis))

    return with_hole


def _cumulative(sizes):
    total = 0
    for s in sizes:
        total += s
        yield total


# ---- indexing, slicing, padding, tiling


def decode_index(index: tuple) -> tuple:
    """The Python index tuple an encoded ``index`` attr stands for (the ops encode it:
    ``flowmill.runtime.ops.array_ops``; slices are unhashable before Python 3.12)."""
    out = []
    for k in index:
        if k[0] == "...":
            out.append(Ellipsis)
        elif k[0] == "new":
            out.append(None)
        elif k[0] == "slice":
            out.append(slice(k[1], k[2], k[3]))
        else:
            out.append(k[1])
    return tuple(out)


def _index_key(ctx: KernelContext) -> tuple:
    return decode_index(ctx.attrs["index"])


def _maybe_scalar(ctx: KernelContext, fn):
    """Indexing every dim of a NumPy array gives a NumPy scalar; the graph wants an array."""
    shape = ctx.output_shapes[0] if ctx.output_shapes else None
    if shape is None or shape == ():
        asarray = ctx.xp.asarray
        return lambda x: asarray(fn(x))
    return fn


@kernel("StridedSlice")
def _strided_slice(ctx: KernelContext):
    key = _index_key(ctx)
    return _maybe_scalar(ctx, lambda x: x[key])


@kernel("StridedSliceGrad")
def _strided_slice_grad(ctx: KernelContext):
    zeros, key = ctx.xp.zeros, _index_key(ctx)

    def fn(g, x):
        out = zeros(x.shape, g.dtype)
        out[key] = g
        return out

    return fn


@kernel("Slice")
def _slice(ctx: KernelContext):
    begin, size = ctx.attrs["begin"], ctx.attrs["size"]
    key = tuple(slice(b, None if s == -1 else b + s) for b, s in zip(begin, size, strict=True))
    return lambda x: x[key]


@kernel("Pad")
def _pad(ctx: KernelContext):
    xp, paddings = ctx.xp, ctx.attrs["paddings"]
    value = ctx.attrs["constant_values"]
    inner = tuple(slice(a, -b if b else None) for a, b in paddings)

    def fn(x):
        shape = tuple(d + a + b for d, (a, b) in zip(x.shape, paddings, strict=True))
        out = xp.zeros(shape, x.dtype) if value == 0 else xp.full(shape, value, x.dtype)
        out[inner] = x
        return out

    return fn


@kernel("Tile")
def _tile(ctx: KernelContext):
    xp, multiples = ctx.xp, ctx.attrs["multiples"]
    return lambda x: xp.tile(x, multiples)


@kernel("TileGrad")
def _tile_grad(ctx: KernelContext):
    multiples = ctx.attrs["multiples"]
    copies = tuple(range(0, 2 * len(multiples), 2))

    def fn(g, x):
        split = []
        for m, d in zip(multiples, x.shape, strict=True):
            split += (m, d)
        return g.reshape(split).sum(axis=copies)

    return fn


# ---- generators of values: Fill, Shape, Range, OneHot


# A Fill up to this size is made once, when its step is compiled, and shared by every
# step like a Const; a bigger one is made by each step that runs it, so compiling a step
# (a task registering a partition) never allocates what a few bytes of attrs can claim.
SHARED_FILL_BYTES = 1 << 20


@kernel("Fill")
def _fill(ctx: KernelContext):
    full, shape, fill, dtype = ctx.xp.full, ctx.attrs["shape"], ctx.attrs["value"], \
        ctx.attrs["dtype"]
    if math.prod(shape) * numpy.dtype(dtype).itemsize > SHARED_FILL_BYTES:
        return lambda: full(shape, fill, dtype)
    value = full(shape, fill, dtype)
    if hasattr(value, "setflags"):
        value.setflags(write=False)  # shared by every step, like a Const
    return lambda: value


@kernel("DynamicFill", host_inputs=(0,))
def _dynamic_fill(ctx: KernelContext):
    full, value, dtype, name = ctx.xp.full, ctx.attrs["value"], ctx.attrs["dtype"], ctx.name

    def fn(dims):
        shape = tuple(int(d) for d in dims)
        if any(d < 0 for d in shape):
            raise ValueError(f"DynamicFill {name!r}: negative dimension in {shape}")
        return full(shape, value, dtype)

    return fn


@kernel("Shape", host_outputs=(0,))
def _shape(ctx: KernelContext):
    dtype = ctx.attrs["out_type"]
    return lambda x: numpy.asarray(x.shape, dtype=dtype)  # in host memory on every device


@kernel("Range", host_inputs=(0, 1, 2))
def _range(ctx: KernelContext):
    arange, dtype = ctx.xp.arange, ctx.output_dtypes[0]
    return lambda start, limit, delta: arange(start.item(), limit.item(), delta.item(), dtype=dtype)


@kernel("OneHot")
def _one_hot(ctx: KernelContext):
    xp, depth, axis = ctx.xp, ctx.attrs["depth"], ctx.attrs["axis"]
    # Row ``depth`` of the table is all off: every out-of-range index is sent there.
    table = xp.full((depth + 1, depth), ctx.attrs["off_value"], ctx.attrs["dtype"])
    table[xp.arange(depth), xp.arange(depth)] = ctx.attrs["on_value"]

    def fn(indices):
        rows = xp.where((indices >= 0) & (indices < depth), indices, depth)
        out = table[rows]
        return out if axis == -1 else xp.moveaxis(out, -1, axis)

    return fn


# ---- sparse: Gather, UnsortedSegmentSum, DynamicPartition, DynamicStitch


@kernel("Gather", gpu_note="out-of-range indices wrap around, unchecked (CuPy's take)")
def _gather(ctx: KernelContext):
    take, axis, name = ctx.xp.take, ctx.attrs["axis"], ctx.name

    def fn(params, indices):
        try:
            return take(params, indices, axis=axis)
        except IndexError as e:
            raise IndexError(f"Gather {name!r}: {e}") from None

    return fn


@kernel("Unique", gpu_note="its output size depends on the values: a host synchronization")
def _unique(ctx: KernelContext):
    xp, idx_dtype = ctx.xp, ctx.attrs["out_idx"]

    def fn(x):
        y, idx = xp.unique(x, return_inverse=True)
        return y, idx.reshape(x.shape).astype(idx_dtype, copy=False)

    return fn


@kernel("UnsortedSegmentSum", gpu_note="segment ids are not checked against the count")
def _unsorted_segment_sum(ctx: KernelContext):
    xp, name, attr_n = ctx.xp, ctx.name, ctx.attrs["num_segments"]
    check = xp.__name__ == "numpy"  # on a GPU the bounds check would stall the stream

    def fn(data, ids, num=None):
        n = attr_n if num is None else int(num)
        if check and ids.size and int(ids.max()) >= n:
            raise IndexError(
                f"UnsortedSegmentSum {name!r}: segment id {int(ids.max())} is out of range "
                f"for {n} segments"
            )
        if ids.dtype.kind == "u":
            out = xp.zeros((n,) + data.shape[ids.ndim :], data.dtype)
            xp.add.at(out, ids, data)
            return out
        # One spare row takes the dropped (negative) ids: -1 indexes it.
        out = xp.zeros((n + 1,) + data.shape[ids.ndim :], data.dtype)
        xp.add.at(out, xp.maximum(ids, -1), data)
        return out[:n]

    return fn


@kernel("DynamicPartition", gpu_note="reads the partition sizes back to the host")
def _dynamic_partition(ctx: KernelContext):
    xp, n, name = ctx.xp, ctx.attrs["num_partitions"], ctx.name

    def fn(data, partitions):
        flat = partitions.reshape(-1)
        rows = data.reshape((flat.size,) + data.shape[partitions.ndim :])
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(
                f"DynamicPartition {name!r}: partitions must lie in [0, {n}), got "
                f"[{int(flat.min())}, {int(flat.max())}]"
            )
        # One stable sort groups the rows by partition and keeps their order within each.
        order = xp.argsort(flat, kind="stable")
        counts = xp.bincount(flat, minlength=n).tolist()
        parts = xp.split(rows[order], list(_cumulative(counts[:-1])))
        return parts[0] if n == 1 else tuple(parts)

    return fn


@kernel("DynamicStitch")
def _dynamic_stitch(ctx: KernelContext):
    xp, dtype = ctx.xp, ctx.output_dtypes[0]

    def fn(*args):
        half = len(args) // 2
        indices, data = args[:half], args[half:]
        tail = data[0].shape[indices[0].ndim :]
        flat = [i.reshape(-1) for i in indices]
        rows = [d.reshape((f.size,) + tail) for d, f in zip(data, flat, strict=True)]
        if half > 1:
            flat, rows = [xp.concatenate(flat)], [xp.concatenate(rows)]
        size = int(flat[0].max()) + 1 if flat[0].size else 0
        out = xp.zeros((size,) + tail, dtype)
        out[flat[0]] = rows[0]
        return out

    return fn
