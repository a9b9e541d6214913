"""``_FusedElementwise``: a tree of elementwise ops as one node, and ``_FusedAssign``: one
ending in a variable update; made by ``fusion`` on a GPU. ``_CudaGraphSegment``: nodes
captured as one CUDA graph, made by ``cuda_graphs``. Users never build them."""

from __future__ import annotations

from ..op_def import define_op


@define_op("_FusedElementwise", attrs={"program": (), "fused": ()}, differentiable=False)
def _fused_shape(inputs, attrs):
    raise ValueError("_FusedElementwise is made from placed ops, which keep their shapes")


@define_op("_FusedAssign", attrs={"program": (), "fused": (), "how": "add"}, stateful=True,
           differentiable=False)
def _fused_assign_shape(inputs, attrs):
    raise ValueError("_FusedAssign is made from placed ops, which keep their shapes")


@define_op("_CudaGraphSegment", attrs={"runner": None}, stateful=True, differentiable=False)
def _segment_shape(inputs, attrs):
    raise ValueError("_CudaGraphSegment is made from placed ops, which keep their shapes")
