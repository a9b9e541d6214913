"""``_CudaGraphSegment``: part of a step captured as one CUDA graph. Its kernel is the
segment's runner, made where the step is compiled (``runtime/cuda_graphs.py``) and handed
over in the node's attrs: the runner owns the segment's own compiled steps, which this
layer cannot build."""

from __future__ import annotations

from .registry import KernelContext, kernel


@kernel("_CudaGraphSegment")
def _segment(ctx: KernelContext):
    return ctx.attrs["runner"]
