"""Fused batch normalization over the last (channel) axis, training mode.

Made of small ops, batch normalization walks a convolution's whole activation a dozen
times each way (mean, centred values, their squares, scale, shift, and as many again in
the gradient). These kernels do it in a few passes, as TensorFlow's ``FusedBatchNorm`` and
PyTorch's kernels do: one for the mean, one for the centred values, one for the variance,
two in place for scale and shift; the gradient likewise. Statistics of float16 inputs are
taken in float32.
"""

from __future__ import annotations

from .registry import KernelContext, kernel, may_overwrite


def _widen(x):
    """``x`` (channels last) as ``[rows, k * channels]``: ``k`` rows side by side, so a
    per-channel loop runs over thousands of elements instead of a few dozen channels
    (NumPy's broadcast over a short last axis costs per row). ``k`` divides the rows."""
    c = x.shape[-1]
    n = x.size // c
    k = max(1, min(n, _WIDE // max(c, 1)))
    while n % k:
        k -= 1
    return x.reshape(n // k, k * c), k


_WIDE = 2048  # elements per row of the widened view


def _per_channel(xp, wide, k: int):
    """Sum over the rows of a widened view, per channel: a matrix-vector product (BLAS),
    much faster than a reduction down axis 0."""
    ones = xp.ones(wide.shape[0], wide.dtype)
    return (ones @ wide).reshape(k, -1).sum(axis=0)


def _squares_per_channel(xp, a, b, k: int):
    return xp.einsum("ij,ij->j", a, b).reshape(k, -1).sum(axis=0)


@kernel("FusedBatchNorm")
def _fused_batch_norm(ctx: KernelContext):
    xp, eps, name = ctx.xp, float(ctx.attrs["epsilon"]), ctx.name

    def fn(x, scale, offset):
        c = x.shape[-1]
        n = x.size // c if c else 0
        if n == 0:
            raise ValueError(f"FusedBatchNorm {name!r}: the batch {x.shape} has no elements")
        work = x.astype(xp.float32) if x.dtype == xp.float16 else x
        wide, k = _widen(work)
        mean = _per_channel(xp, wide, k) / n
        y = xp.empty_like(work)  # a buffer of its own (not a view): the next op may reuse it
        y_wide, _ = _widen(y)
        xp.subtract(wide, xp.tile(mean, k), out=y_wide)
        variance = _squares_per_channel(xp, y_wide, y_wide, k) / n
        y_wide *= xp.tile(scale / xp.sqrt(variance + eps), k)
        y_wide += xp.tile(offset, k)
        del y_wide
        return y.astype(x.dtype, copy=False), mean.astype(x.dtype), variance.astype(x.dtype)

    return fn


@kernel("FusedBatchNormGrad")
def _fused_batch_norm_grad(ctx: KernelContext):
    xp, eps = ctx.xp, float(ctx.attrs["epsilon"])
    reuse_g = ctx.forward(0)

    def fn(g, x, scale, mean, variance, g_mean, g_variance):
        half = x.dtype == xp.float16
        if half:
            g, x = g.astype(xp.float32), x.astype(xp.float32)
        n = x.size // x.shape[-1]
        inv = 1.0 / xp.sqrt(variance + eps)
        wide, k = _widen(x)
        centred = wide - xp.tile(mean, k)
        g_wide, _ = _widen(g)
        d_offset = _per_channel(xp, g_wide, k)
        d_scale = _squares_per_channel(xp, g_wide, centred, k) * inv
        del g_wide  # a view holds g: without it, g may be written into below
        a = scale * inv
        # dx = a g - a/n (d_offset + x_hat d_scale), x_hat = (x - mean) inv, plus what
        # reached the batch mean and variance directly (1/n each, and 2 (x - mean) / n).
        centred *= xp.tile(inv * (-(a * d_scale) / n) + 2.0 * g_variance / n, k)
        centred += xp.tile((g_mean - a * d_offset) / n, k)
        reuse = reuse_g and not half and may_overwrite(g)
        g_wide, _ = _widen(g)
        dx = xp.multiply(g_wide, xp.tile(a, k), out=g_wide if reuse else None)
        dx += centred
        dx = g if reuse else dx.reshape(x.shape)  # g itself: a buffer the next op may reuse
        return dx.astype(ctx.output_dtypes[0], copy=False), d_scale.astype(
            ctx.output_dtypes[1]), d_offset.astype(ctx.output_dtypes[2])

    return fn
