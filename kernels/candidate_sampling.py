"""Candidate samplers, for losses that score a few sampled classes instead of a whole
vocabulary (sampled softmax). Follows TensorFlow's ``range_sampler.cc``.

The log-uniform (Zipfian) sampler draws class ``v`` of ``[0, range_max)`` with probability
``P(v) = log((v + 2) / (v + 1)) / log(range_max + 1)``, which suits vocabularies sorted by
decreasing frequency. A draw is ``floor(exp(u * log(range_max + 1))) - 1`` for uniform
``u``. With ``unique`` it draws until it has ``num_sampled`` distinct classes, counting
the tries; the expected count of a class is then the chance it came up in that many tries,
``1 - (1 - P)^tries``, else ``P * num_sampled``. Cost depends on ``num_sampled`` (and the
tries), never on ``range_max``: no per-class table is kept.
"""

from __future__ import annotations

import math

from .random import make_generator
from .registry import KernelContext, kernel

_HOST = "draws its few ids on the host, as TensorFlow's sampler"

_MIN_CHUNK = 256  # draws per round of unique sampling: fewer rounds near the end


def _generator(ctx: KernelContext):
    """The op's stream, kept in the session's resources like the random ops' (see random)."""
    seed, seed2 = ctx.attrs["seed"], ctx.attrs["seed2"]

    def factory():
        return make_generator(ctx.xp, seed, seed2)

    if ctx.resources is None:
        return factory()
    return ctx.resources.get_or_create(f"{ctx.name}/generator", factory)


@kernel("LogUniformCandidateSampler", host_only=_HOST)
def _log_uniform_candidate_sampler(ctx: KernelContext):
    xp, rng = ctx.xp, _generator(ctx)
    num_sampled, unique = ctx.attrs["num_sampled"], ctx.attrs["unique"]
    range_max = ctx.attrs["range_max"]
    log_range = math.log1p(range_max)

    def draw(m: int):
        u = rng.random(m)
        # exp() may round up to range_max + 1 in the last ulp: wrap, as TensorFlow does.
        return (xp.exp(u * log_range).astype(xp.int64) - 1) % range_max

    def draw_unique():
        """The first ``num_sampled`` distinct draws, in draw order, and how many draws that
        took; drawn in chunks, so the result is the one-at-a-time sampler's."""
        picked = xp.empty(0, xp.int64)
        drawn = tries = 0
        while picked.size < num_sampled:
            need = num_sampled - picked.size
            chunk = draw(max(2 * need, _MIN_CHUNK))
            values, first = xp.unique(chunk, return_index=True)
            fresh = xp.sort(first[~xp.isin(values, picked)])[:need]
            if fresh.size == need:
                tries = drawn + int(fresh[-1]) + 1
            picked = xp.concatenate([picked, chunk[fresh]])
            drawn += chunk.size
        return picked, tries

    def expected_count(classes, tries: int):
        p = xp.log((classes + 2.0) / (classes + 1.0)) / log_range
        if tries == num_sampled:  # always so without ``unique``
            count = p * num_sampled
        else:
            count = -xp.expm1(tries * xp.log1p(-p))
        return count.astype(xp.float32)

    def fn(true_classes):
        if unique:
            sampled, tries = draw_unique()
        else:
            sampled, tries = draw(num_sampled), num_sampled
        return sampled, expected_count(true_classes, tries), expected_count(sampled, tries)

    return fn
