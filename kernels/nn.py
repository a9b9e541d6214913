"""Neural-network kernels: activations, softmax and cross-entropy, bias, convolution, pooling.

Convolution is im2col: a strided view lays every receptive field out as one row (the only
copy), then one matmul with the filter does all the arithmetic in BLAS (cuBLAS on GPU).
Pooling and the scatter back of gradients loop over the few offsets inside a window, each
step one vectorized operation over the whole batch, never over pixels; a stride-1
convolution's input gradient is a convolution itself (``_transposed_conv``), its adds
done inside BLAS.

On the CPU the convolutions and MaxPoolGrad walk the batch a few images at a time
(``_chunks``): over the whole batch every pass (the im2col copy, the matmul reading it, the
adds of col2im, the masks of max pooling) streams its operands through memory again, while
a chunk of about a megabyte is still in cache for the next pass. On a shared two-core
machine this took about a quarter off the forward and filter-gradient kernels of the convnet
example's 14x14x32 -> 64 convolution at batch 64, and a quarter off MaxPoolGrad of its
28x28x32 layer (``bench/conv_step.py``); BLAS sees fewer rows per call, which costs it
nothing at these sizes. A batch of a few chunks or less stays whole, as it does on a GPU.

The file is long because the family is: each forward kernel sits beside its gradient
kernels, which share its window geometry and chunking (batch normalization, which shares
nothing with them, has its own module, ``batch_norm``).

One family per file, as the ops are (``runtime/ops/nn_ops.py``): each forward kernel
beside its backward kernel, which shares its im2col layout.
"""

from __future__ import annotations

import numpy

from . import fused_xent
from .registry import KernelContext, kernel, may_overwrite

# ---- window geometry


class _Windows:
    """Where the windows of a 2-D sliding op lie, for one input height and width.

    Built once per input size and kernel size (then cached), so a step only slices.
    """

    __slots__ = (
        "out_h", "out_w", "pads", "padded", "padded_h", "padded_w", "interior", "offsets",
        "pointwise", "unit_stride", "overlap", "tiles", "_counts",
    )

    def __init__(self, name, h, w, kh, kw, sh, sw, dh, dw, same):
        self.out_h, top, bottom = _axis(name, "height", h, kh, sh, dh, same)
        self.out_w, left, right = _axis(name, "width", w, kw, sw, dw, same)
        self.pads = (top, bottom, left, right)
        self.padded_h = h + top + bottom
        self.padded_w = w + left + right
        self.interior = (slice(top, top + h), slice(left, left + w))
        # Offsets in row-major window order: MaxPoolGrad relies on it to pick the first max.
        self.offsets = [
            (
                slice(i * dh, i * dh + sh * (self.out_h - 1) + 1, sh),
                slice(j * dw, j * dw + sw * (self.out_w - 1) + 1, sw),
            )
            for i in range(kh)
            for j in range(kw)
        ]
        self.pointwise = kh == kw == sh == sw == 1
        self.unit_stride = sh == sw == 1
        self.overlap = (kh - 1) * dh + 1 > sh or (kw - 1) * dw + 1 > sw
        self.padded = any(self.pads)
        # Every (padded) input entry lies in exactly one window: a gradient needs no zeros.
        self.tiles = (
            (kh, kw) == (sh, sw) and dh == dw == 1
            and self.out_h * kh == self.padded_h and self.out_w * kw == self.padded_w
        )
        # How many real (unpadded) entries each window holds: AvgPool's divisors.
        rows = _valid(self.out_h, sh, top, (kh - 1) * dh + 1, h)
        cols = _valid(self.out_w, sw, left, (kw - 1) * dw + 1, w)
        self._counts = (rows[:, None] * cols[None, :])[None, :, :, None]

    def counts(self, xp, dtype):
        if not isinstance(self._counts, xp.ndarray) or self._counts.dtype != dtype:
            self._counts = xp.asarray(self._counts, dtype)
        return self._counts


def _axis(name, what, size, k, stride, dilation, same):
    span = (k - 1) * dilation + 1
    if same:
        out = -(-size // stride)
        total = max((out - 1) * stride + span - size, 0)
        return out, total // 2, total - total // 2
    if size < span:
        raise ValueError(
            f"{name}: VALID window of {what} {span} does not fit in input {what} {size}"
        )
    return (size - span) // stride + 1, 0, 0


def _valid(out, stride, pad, k, size):
    start = numpy.arange(out) * stride - pad
    return numpy.minimum(start + k, size) - numpy.maximum(start, 0)


def _geometry(ctx: KernelContext):
    """A cached ``(h, w, kh, kw) -> _Windows`` for this op's strides, dilations and padding."""
    sh, sw = ctx.attrs["strides"][1:3]
    dh, dw = ctx.attrs.get("dilations", (1, 1, 1, 1))[1:3]
    same = ctx.attrs["padding"] == "SAME"
    cache: dict[tuple, _Windows] = {}

    def get(h, w, kh, kw) -> _Windows:
        key = (h, w, kh, kw)
        win = cache.get(key)
        if win is None:
            if len(cache) > 64:
                cache.clear()
            win = cache[key] = _Windows(ctx.name, h, w, kh, kw, sh, sw, dh, dw, same)
        return win

    return get


def _pad(xp, x, win: _Windows, fill):
    """``x`` inside a border of ``fill``; ``x`` itself when the windows need no padding."""
    if not win.padded:
        return x
    top, bottom, left, right = win.pads
    n, _, _, c = x.shape
    out = xp.empty((n, win.padded_h, win.padded_w, c), x.dtype)
    if top:
        out[:, :top] = fill
    if bottom:
        out[:, win.padded_h - bottom :] = fill
    if left:
        out[:, :, :left] = fill
    if right:
        out[:, :, win.padded_w - right :] = fill
    out[:, win.interior[0], win.interior[1]] = x
    return out


def _crop(dx, win: _Windows):
    return dx[:, win.interior[0], win.interior[1]] if win.padded else dx


def _patches(xp, xpad, win: _Windows, kh, kw, strides, dilations):
    """im2col: an (output pixels, kh * kw * c) matrix holding each pixel's receptive field.

    The copy is the cost, and it runs fastest when its innermost runs are long: a field's
    row has ``kw * c`` entries, an output row ``out_w``. When output rows are the
    longer (few channels, as in a first layer), fields are laid out one per column and the
    transposed view is returned; matmul reads either layout without another copy.
    """
    n, _, _, c = xpad.shape
    s0, s1, s2, s3 = xpad.strides
    (sh, sw), (dh, dw) = strides, dilations
    m, k = n * win.out_h * win.out_w, kh * kw * c
    as_strided = xp.lib.stride_tricks.as_strided
    if _by_column(win, kw, c):
        view = as_strided(
            xpad,
            (kh, kw, c, n, win.out_h, win.out_w),
            (s1 * dh, s2 * dw, s3, s0, s1 * sh, s2 * sw),
        )
        return view.reshape(k, m).T
    view = as_strided(
        xpad,
        (n, win.out_h, win.out_w, kh, kw, c),
        (s0, s1 * sh, s2 * sw, s1 * dh, s2 * dw, s3),
    )
    return view.reshape(m, k)


def _by_column(win: _Windows, kw, c) -> bool:
    return win.out_w > kw * c


# Bytes of the operands one chunk of the batch should hold (see the module docstring).
CHUNK_BYTES = 1 << 20


def _chunks(xp, n: int, per_item: int) -> list[slice]:
    """The batch of ``n`` in slices of about ``CHUNK_BYTES`` at ``per_item`` bytes an item
    (at least one item); one slice off the CPU, or when the whole batch is a few chunks at
    most (it stays in cache then, and each slice is one more call)."""
    if xp is not numpy or n * per_item <= 4 * CHUNK_BYTES:
        return [slice(0, n)]
    step = max(1, CHUNK_BYTES // max(per_item, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _lowest(dtype):
    dtype = numpy.dtype(dtype)
    return -numpy.inf if dtype.kind == "f" else numpy.iinfo(dtype).min


# ---- activations


@kernel("Relu")
def _relu(ctx: KernelContext):
    maximum = ctx.xp.maximum
    if ctx.forward(0):
        return lambda x: maximum(x, 0, out=x) if may_overwrite(x) else maximum(x, 0)
    return lambda x: maximum(x, 0)


@kernel("ReluGrad")
def _relu_grad(ctx: KernelContext):
    multiply = ctx.xp.multiply
    if ctx.forward(0):

        def fn(g, y):
            if may_overwrite(g, y):
                return multiply(g, y > 0, out=g)
            return multiply(g, y > 0, dtype=g.dtype)

        return fn
    return lambda g, y: multiply(g, y > 0, dtype=g.dtype)


@kernel("Sigmoid")
def _sigmoid(ctx: KernelContext):
    xp = ctx.xp

    def fn(x):
        # 1 / (1 + exp(-x)): exp overflows to inf for very negative x, and 1 / inf is the
        # right limit, so the overflow is expected; it keeps tiny results' relative precision.
        with numpy.errstate(over="ignore"):
            y = xp.negative(x)
            xp.exp(y, out=y)
        y += 1
        return xp.reciprocal(y, out=y)

    return fn


@kernel("Tanh")
def _tanh(ctx: KernelContext):
    return ctx.xp.tanh


@kernel("SigmoidGrad")
def _sigmoid_grad(ctx: KernelContext):
    xp = ctx.xp

    def fn(y, g):
        t = xp.subtract(1, y)
        t *= y
        t *= g
        return t

    return fn


@kernel("TanhGrad")
def _tanh_grad(ctx: KernelContext):
    xp = ctx.xp

    def fn(y, g):
        t = xp.multiply(y, y)
        xp.subtract(1, t, out=t)
        t *= g
        return t

    return fn


# ---- bias


@kernel("BiasAdd")
def _bias_add(ctx: KernelContext):
    add = ctx.xp.add

    forward = ctx.forward(0)

    def fn(x, b):
        if b.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{ctx.name}: bias of shape {b.shape} does not match the last dim of {x.shape}"
            )
        if forward and may_overwrite(x):
            return add(x, b, out=x)
        return add(x, b)

    return fn


@kernel("BiasAddGrad")
def _bias_add_grad(ctx: KernelContext):
    # A row of ones times the gradient, as a matrix: BLAS sums the rows several times faster
    # than a reduction over the leading axis, with the same row-by-row accumulation.
    xp = ctx.xp
    ones = {}

    def fn(g):
        g2 = g.reshape(-1, g.shape[-1])
        m = g2.shape[0]
        row = ones.get(m)
        if row is None:
            ones.clear()
            row = ones[m] = xp.ones(m, g.dtype)
        return xp.matmul(row, g2)

    return fn


# ---- softmax and cross-entropy


@kernel("Softmax")
def _softmax(ctx: KernelContext):
    xp = ctx.xp

    def fn(x):
        e = xp.subtract(x, x.max(axis=-1, keepdims=True))
        xp.exp(e, out=e)
        e /= e.sum(axis=-1, keepdims=True)
        return e

    return fn


@kernel("LogSoftmax")
def _log_softmax(ctx: KernelContext):
    xp = ctx.xp

    def fn(x):
        z = xp.subtract(x, x.max(axis=-1, keepdims=True))
        z -= xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
        return z

    return fn


def _fuses(xp) -> bool:
    """Whether ``xp`` is a device module that compiles fused kernels (``fused_xent``)."""
    return xp is not numpy and hasattr(xp, "fuse")


@kernel("SoftmaxCrossEntropyWithLogits")
def _xent(ctx: KernelContext):
    xp = ctx.xp
    if _fuses(xp):
        return fused_xent.dense(xp)

    def fn(logits, labels):
        z = xp.subtract(logits, logits.max(axis=-1, keepdims=True))
        e = xp.exp(z)
        s = e.sum(axis=-1, keepdims=True)
        xp.subtract(xp.log(s), z, out=z)  # -log_softmax
        z *= labels
        loss = z.sum(axis=-1)
        e /= s
        e -= labels
        return loss, e

    return fn


@kernel("SparseSoftmaxCrossEntropyWithLogits",
        gpu_note="a label out of range gives a NaN loss row instead of an error")
def _sparse_xent(ctx: KernelContext):
    xp = ctx.xp
    if _fuses(xp):  # bad labels give NaN rows there, instead of a sync to raise
        return fused_xent.sparse(xp)
    checked = xp is numpy  # a GPU reports bad labels as NaN rows instead of syncing to raise

    def fn(logits, labels):
        c = logits.shape[-1]
        flat = labels.reshape(-1)
        bad = None
        if flat.size:
            if checked:
                lo, hi = int(flat.min()), int(flat.max())
                if lo < 0 or hi >= c:
                    raise ValueError(
                        f"{ctx.name}: label value {lo if lo < 0 else hi} is outside "
                        f"the valid range [0, {c})"
                    )
            else:
                bad = (flat < 0) | (flat >= c)
                flat = xp.clip(flat, 0, c - 1)
        # One buffer for the shifted logits and then their exponentials: the labels'
        # entries are picked out before the exp overwrites them.
        e = xp.subtract(logits, logits.max(axis=-1, keepdims=True))
        rows = xp.arange(flat.size)
        picked = e.reshape(-1, c)[rows, flat]
        xp.exp(e, out=e)
        s = e.sum(axis=-1, keepdims=True)
        loss = xp.log(s).reshape(-1) - picked
        e /= s
        backprop = e.reshape(-1, c)
        backprop[rows, flat] -= 1
        if bad is not None:
            loss[bad] = numpy.nan
            backprop[bad] = numpy.nan
        return loss.reshape(labels.shape), e

    return fn


@kernel("L2Loss")
def _l2_loss(ctx: KernelContext):
    xp = ctx.xp

    def fn(x):
        flat = x.reshape(-1)
        return xp.asarray(xp.dot(flat, flat) / 2, dtype=x.dtype)

    return fn


# ---- convolution


def _conv_params(ctx: KernelContext):
    return tuple(ctx.attrs["strides"][1:3]), tuple(ctx.attrs["dilations"][1:3])


def _check_channels(name, x_shape, f_shape):
    if x_shape[3] != f_shape[2]:
        raise ValueError(
            f"{name}: input of shape {x_shape} has {x_shape[3]} channels, filter of shape "
            f"{f_shape} expects {f_shape[2]}"
        )


@kernel("Conv2D")
def _conv2d(ctx: KernelContext):
    xp, geometry = ctx.xp, _geometry(ctx)
    strides, dilations = _conv_params(ctx)

    def fn(x, f):
        n, h, w, c = x.shape
        kh, kw, _, o = f.shape
        _check_channels(ctx.name, x.shape, f.shape)
        win = geometry(h, w, kh, kw)
        if win.pointwise:
            out = xp.matmul(x.reshape(-1, c), f.reshape(c, o))
            return out.reshape(n, win.out_h, win.out_w, o)
        xpad = _pad(xp, x, win, 0)
        fmat = f.reshape(-1, o)
        pixels = win.out_h * win.out_w
        out = xp.empty((n * pixels, o), xp.result_type(x, f))
        for s in _chunks(xp, n, pixels * kh * kw * c * x.itemsize):
            cols = _patches(xp, xpad[s], win, kh, kw, strides, dilations)
            xp.matmul(cols, fmat, out=out[s.start * pixels : s.stop * pixels])
        return out.reshape(n, win.out_h, win.out_w, o)

    return fn


@kernel("Conv2DBackpropInput")
def _conv2d_backprop_input(ctx: KernelContext):
    xp, geometry = ctx.xp, _geometry(ctx)
    _, dilations = _conv_params(ctx)

    def fn(x_like, f, g):
        n, h, w, c = x_like.shape
        kh, kw, _, o = f.shape
        _check_channels(ctx.name, x_like.shape, f.shape)
        win = geometry(h, w, kh, kw)
        g2 = g.reshape(-1, o)
        if win.pointwise:
            return xp.matmul(g2, f.reshape(c, o).T).reshape(n, h, w, c)
        # col2im: each output pixel's field gradient, then added back where the field lay.
        if win.out_w > c:
            # Few channels: accumulate channels-first so each add runs along output rows.
            fields = xp.matmul(f.reshape(-1, o), g2.T).reshape(kh * kw, c, n, win.out_h, win.out_w)
            acc = xp.zeros((c, n, win.padded_h, win.padded_w), g.dtype)
            for field, (rows, cols) in zip(fields, win.offsets, strict=True):
                view = acc[:, :, rows, cols]
                xp.add(view, field, out=view)
            inner = acc[:, :, win.interior[0], win.interior[1]]
            return xp.ascontiguousarray(inner.transpose(1, 2, 3, 0))
        if win.unit_stride:
            return _transposed_conv(xp, g, f, win, (h, w, c), dilations)
        # Many channels, strided: one matmul per filter tap into a reused buffer, so each
        # add reads contiguous memory instead of striding through one big matrix of all
        # taps. A chunk of images at a time keeps its field and its dx in cache across them.
        taps = f.reshape(kh * kw, c, o)
        pixels = win.out_h * win.out_w
        dx = xp.zeros((n, win.padded_h, win.padded_w, c), g.dtype)
        chunks = _chunks(xp, n, (win.padded_h * win.padded_w * c + pixels * (c + o))
                         * g.itemsize)
        buffer = xp.empty(((chunks[0].stop - chunks[0].start) * pixels, c), g.dtype)
        for s in chunks:
            m = s.stop - s.start
            field = buffer[: m * pixels]
            field4 = field.reshape(m, win.out_h, win.out_w, c)
            gs, ds = g2[s.start * pixels : s.stop * pixels], dx[s]
            for tap, (rows, cols) in zip(taps, win.offsets, strict=True):
                xp.matmul(gs, tap.T, out=field)
                view = ds[:, rows, cols]
                xp.add(view, field4, out=view)
        return _crop(dx, win)

    return fn


def _transposed_conv(xp, g, f, win: _Windows, x_hw_c, dilations):
    """The input gradient of a stride-1 convolution as a convolution itself: ``g`` padded
    by what the forward's window overhung on the far side, convolved (VALID, same
    dilation) with the filter flipped in space and with its channel axes swapped. Every
    add of col2im becomes BLAS arithmetic, and the copy into im2col rows is the only pass
    outside it: on the convnet example's 14x14x32 -> 64 layer at batch 64 this took the
    kernel from 8.4 to 7.4 ms where one matmul per tap plus its strided add had been
    (``bench/conv_step.py``). A chunk of images at a time goes through a padded buffer
    whose border is zeroed once; its im2col rows are counted at half their bytes, which
    put four images in a chunk there (two or eight measured slower)."""
    h, w, c = x_hw_c
    n, out_h, out_w, o = g.shape
    kh, kw = f.shape[:2]
    dh, dw = dilations
    top, bottom, left, right = win.pads
    # g padded so that input pixel q's window holds g[q + top - i * dh] for every tap i.
    span_h, span_w = (kh - 1) * dh, (kw - 1) * dw
    pad_top, pad_left = span_h - top, span_w - left
    padded_h, padded_w = pad_top + out_h + span_h - bottom, pad_left + out_w + span_w - right
    flipped = xp.ascontiguousarray(f[::-1, ::-1].transpose(0, 1, 3, 2)).reshape(-1, c)
    back = _Windows("", padded_h, padded_w, kh, kw, 1, 1, dh, dw, False)
    pixels = h * w
    dx = xp.empty((n * pixels, c), g.dtype)
    chunks = _chunks(xp, n, pixels * kh * kw * o * g.itemsize // 2)
    buffer = xp.zeros((chunks[0].stop - chunks[0].start, padded_h, padded_w, o), g.dtype)
    inside = (slice(pad_top, pad_top + out_h), slice(pad_left, pad_left + out_w))
    for s in chunks:
        m = s.stop - s.start
        gpad = buffer[:m]
        gpad[:, inside[0], inside[1]] = g[s]
        cols = _patches(xp, gpad, back, kh, kw, (1, 1), dilations)
        xp.matmul(cols, flipped, out=dx[s.start * pixels : s.stop * pixels])
    return dx.reshape(n, h, w, c)


@kernel("Conv2DBackpropFilter")
def _conv2d_backprop_filter(ctx: KernelContext):
    xp, geometry = ctx.xp, _geometry(ctx)
    strides, dilations = _conv_params(ctx)

    def fn(x, f_like, g):
        n, h, w, c = x.shape
        kh, kw, _, o = f_like.shape
        _check_channels(ctx.name, x.shape, f_like.shape)
        win = geometry(h, w, kh, kw)
        g2 = g.reshape(-1, o)
        if win.pointwise:
            return xp.matmul(x.reshape(-1, c).T, g2).reshape(1, 1, c, o)
        xpad = _pad(xp, x, win, 0)
        pixels = win.out_h * win.out_w
        dw = None
        for s in _chunks(xp, n, pixels * kh * kw * c * x.itemsize):
            cols = _patches(xp, xpad[s], win, kh, kw, strides, dilations)
            part = xp.matmul(cols.T, g2[s.start * pixels : s.stop * pixels])
            if dw is None:
                dw = part
            else:
                dw += part
        return dw.reshape(kh, kw, c, o)

    return fn


# ---- pooling


def _pool_window(ctx: KernelContext):
    kh, kw = ctx.attrs["ksize"][1:3]
    geometry = _geometry(ctx)

    def get(x_shape) -> _Windows:
        return geometry(x_shape[1], x_shape[2], kh, kw)

    return get, kh, kw


@kernel("MaxPool")
def _max_pool(ctx: KernelContext):
    xp = ctx.xp
    window, _, _ = _pool_window(ctx)

    def fn(x):
        win = window(x.shape)
        xpad = _pad(xp, x, win, _lowest(x.dtype))
        (rows, cols), *rest = win.offsets
        out = xpad[:, rows, cols].copy()
        for rows, cols in rest:
            xp.maximum(out, xpad[:, rows, cols], out=out)
        return out

    return fn


def _first_max_masks(xp, xpad, y, win: _Windows):
    """For each window offset, where that offset holds its window's first maximum.

    The mask yielded is reused for the next offset: consume it before advancing.
    """
    hit = xp.empty(y.shape, bool)
    free = None  # windows whose maximum is not found yet (None: all of them)
    last = len(win.offsets) - 1
    for k, (rows, cols) in enumerate(win.offsets):
        xp.equal(xpad[:, rows, cols], y, out=hit)
        if free is not None:
            hit &= free
        if k < last:
            free = ~hit if free is None else xp.logical_xor(free, hit, out=free)
        yield rows, cols, hit


@kernel("MaxPoolGrad")
def _max_pool_grad(ctx: KernelContext):
    xp = ctx.xp
    window, _, _ = _pool_window(ctx)

    def fn(x, y, g):
        win = window(x.shape)
        xpad = _pad(xp, x, win, _lowest(x.dtype))
        n, _, _, c = x.shape
        # Windows that tile the input write every entry of dx once: no zeros needed.
        dx = (xp.empty if win.tiles else xp.zeros)((n, win.padded_h, win.padded_w, c), g.dtype)
        routed = xp.empty(g.shape, g.dtype) if win.overlap else None
        tiles = _tiled(xpad, dx, y, g, win) if win.tiles and xp is numpy else None
        for s in _chunks(xp, n, xpad[:1].nbytes):
            ds, gs = dx[s], g[s]
            if tiles is not None:
                if _route_unique_maxima(xp, s, *tiles):
                    continue
                tiles = None  # ties (a ReLU's zeros) come in every chunk: stop looking
            for rows, cols, hit in _first_max_masks(xp, xpad[s], y[s], win):
                view = ds[:, rows, cols]
                if routed is None:  # each input entry lies in one window only
                    xp.multiply(gs, hit, out=view)
                else:
                    xp.multiply(gs, hit, out=routed[s])
                    xp.add(view, routed[s], out=view)
        return _crop(dx, win)

    return fn


def _tiled(xpad, dx, y, g, win: _Windows):
    """Windows that tile the input, as views with each window's entries on axes of their
    own: ``(x, dx)`` as ``(n, out_h, kh, out_w, kw, c)``, ``y`` and ``g`` broadcast over
    the window axes."""
    n, _, _, c = xpad.shape
    kh, kw = win.padded_h // win.out_h, win.padded_w // win.out_w
    shape = (n, win.out_h, kh, win.out_w, kw, c)
    return (xpad.reshape(shape), dx.reshape(shape), y[:, :, None, :, None, :],
            g[:, :, None, :, None, :])


def _route_unique_maxima(xp, s: slice, x6, d6, y6, g6) -> bool:
    """One pass for the chunk ``s`` when every window holds its maximum once (almost
    always with real-valued inputs): each entry equal to its window's maximum takes the
    window's gradient, the rest 0. False, with nothing written, where a window holds its
    maximum twice (or is NaN): the caller routes to the first maximum, offset by offset.
    """
    hit = xp.equal(x6[s], y6[s])
    windows = y6[s]
    if xp.count_nonzero(hit) != windows.size or (
        windows.dtype.kind == "f" and xp.isnan(windows).any()
    ):
        return False
    xp.multiply(g6[s], hit, out=d6[s])
    return True


@kernel("MaxPoolGradGrad")
def _max_pool_grad_grad(ctx: KernelContext):
    xp = ctx.xp
    window, _, _ = _pool_window(ctx)

    def fn(x, y, h):
        win = window(x.shape)
        xpad = _pad(xp, x, win, _lowest(x.dtype))
        hpad = _pad(xp, h, win, 0)
        out = xp.zeros(y.shape, h.dtype)
        for rows, cols, hit in _first_max_masks(xp, xpad, y, win):
            xp.copyto(out, hpad[:, rows, cols], where=hit)
        return out

    return fn


@kernel("AvgPool")
def _avg_pool(ctx: KernelContext):
    xp = ctx.xp
    window, kh, kw = _pool_window(ctx)

    def fn(x):
        win = window(x.shape)
        xpad = _pad(xp, x, win, 0)
        (rows, cols), *rest = win.offsets
        out = xpad[:, rows, cols].copy()
        for rows, cols in rest:
            xp.add(out, xpad[:, rows, cols], out=out)
        if win.padded:
            out /= win.counts(xp, x.dtype)
        else:
            out /= kh * kw
        return out

    return fn


@kernel("AvgPoolGrad")
def _avg_pool_grad(ctx: KernelContext):
    xp = ctx.xp
    window, kh, kw = _pool_window(ctx)

    def fn(x_like, g):
        win = window(x_like.shape)
        n, _, _, c = x_like.shape
        if win.padded:
            share = g / win.counts(xp, g.dtype)
        else:
            share = g / (kh * kw)
        dx = xp.zeros((n, win.padded_h, win.padded_w, c), g.dtype)
        for rows, cols in win.offsets:
            view = dx[:, rows, cols]
            if win.overlap:
                xp.add(view, share, out=view)
            else:
                view[...] = share
        return _crop(dx, win)

    return fn
