"""TopK and InTopK: the k largest entries of each row, and whether a target is among them.

Ties follow TensorFlow on CPU: among equal values the lower index comes first (TopK), and
a target tied with the k-th largest counts as in the top k (InTopK).
"""

from __future__ import annotations

from .registry import KernelContext, kernel


@kernel("TopK")
def _top_k(ctx: KernelContext):
    xp, k, name = ctx.xp, ctx.attrs["k"], ctx.name

    def fn(x):
        n = x.shape[-1]
        if n < k:
            raise ValueError(
                f"TopK {name!r}: input of shape {x.shape} has fewer than k={k} entries in its "
                "last dim"
            )
        # Descending by value, ties by ascending index: a stable ascending sort of the
        # reversed row, read backwards. A full sort (n log n a row): rows are one batch's
        # scores, and exact tie order matters more than the partial sort's saving.
        order = xp.argsort(x[..., ::-1], axis=-1, kind="stable")[..., ::-1][..., :k]
        indices = (n - 1 - order).astype(xp.int32)
        return xp.take_along_axis(x, indices, axis=-1), indices

    return fn


@kernel("InTopK")
def _in_top_k(ctx: KernelContext):
    """True where fewer than k classes score strictly higher than the target; False for a
    target out of range or a row with a non-finite score, as TensorFlow says."""
    xp, k = ctx.xp, ctx.attrs["k"]

    def fn(predictions, targets):
        n = predictions.shape[1]
        valid = (targets >= 0) & (targets < n)
        safe = xp.where(valid, targets, 0).astype(xp.intp)
        target_scores = xp.take_along_axis(predictions, safe[:, None], axis=1)
        higher = (predictions > target_scores).sum(axis=1)
        finite = xp.isfinite(predictions).all(axis=1)
        return valid & finite & (higher < k)

    return fn
