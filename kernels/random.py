"""Random kernels. Each op's generator lives in the session's resources, made on first use
from the op's seeds, so every compiled step of one session continues the same stream.

The stream for seeds ``(seed, seed2)`` is ``numpy.random.default_rng([seed, seed2])`` on
CPU; CuPy's generator on GPU is seeded from the same ``SeedSequence`` (its numbers differ).
"""

from __future__ import annotations

import numpy

from .registry import KernelContext, kernel

TRUNCATE_AT = 2.0  # TruncatedNormal redraws values farther out than this many stddevs


def make_generator(xp, seed: int | None, seed2: int | None):
    if seed is None and seed2 is None:
        entropy = None
    else:
        entropy = [int(seed or 0), int(seed2 or 0)]
    if xp is numpy:
        return numpy.random.default_rng(entropy)
    state = numpy.random.SeedSequence(entropy).generate_state(1, numpy.uint64)[0]
    return xp.random.default_rng(int(state))


def _generator(ctx: KernelContext):
    seed, seed2 = ctx.attrs["seed"], ctx.attrs["seed2"]

    def factory():
        return make_generator(ctx.xp, seed, seed2)

    if ctx.resources is None:
        return factory()
    return ctx.resources.get_or_create(f"{ctx.name}/generator", factory)


def _draw_dtype(dtype):
    """Generators draw float32 or float64; float16 is drawn as float32 and cast."""
    return dtype if dtype in (numpy.float32, numpy.float64) else numpy.dtype(numpy.float32)


def _sampler(ctx: KernelContext, draw_fn):
    """A kernel calling ``draw_fn(shape)``; the shape comes from the attr or the input."""
    shape = ctx.attrs["shape"]
    if shape is not None:
        return lambda: draw_fn(shape)
    return lambda dims: draw_fn(tuple(int(d) for d in dims.tolist()))


@kernel("RandomUniform", host_inputs=(0,))
def _random_uniform(ctx: KernelContext):
    rng, dtype = _generator(ctx), ctx.attrs["dtype"]
    draw = _draw_dtype(dtype)
    if draw == dtype:
        return _sampler(ctx, lambda shape: rng.random(shape, dtype=dtype))
    return _sampler(ctx, lambda shape: rng.random(shape, dtype=draw).astype(dtype))


@kernel("RandomStandardNormal", host_inputs=(0,))
def _random_normal(ctx: KernelContext):
    rng, dtype = _generator(ctx), ctx.attrs["dtype"]
    draw = _draw_dtype(dtype)
    if draw == dtype:
        return _sampler(ctx, lambda shape: rng.standard_normal(shape, dtype=dtype))
    return _sampler(ctx, lambda shape: rng.standard_normal(shape, dtype=draw).astype(dtype))


@kernel("TruncatedNormal", host_inputs=(0,))
def _truncated_normal(ctx: KernelContext):
    xp, rng, dtype = ctx.xp, _generator(ctx), ctx.attrs["dtype"]
    draw = _draw_dtype(dtype)

    def fn(shape):
        x = rng.standard_normal(shape, dtype=draw)
        flat = x.reshape(-1)
        redo = xp.flatnonzero(xp.abs(flat) > TRUNCATE_AT)
        while redo.size:  # about 4.6% fall outside; each pass keeps 4.6% of those
            fresh = rng.standard_normal(redo.size, dtype=draw)
            flat[redo] = fresh
            redo = redo[xp.abs(fresh) > TRUNCATE_AT]
        return x if draw == dtype else x.astype(dtype)

    return _sampler(ctx, fn)
