"""``_FusedElementwise``: a tree of elementwise ops as one node, made by ``fusion`` on a
GPU. Users never build it."""

from __future__ import annotations

from ..op_def import define_op


@define_op("_FusedElementwise", attrs={"program": (), "fused": ()}, differentiable=False)
def _fused_shape(inputs, attrs):
    raise ValueError("_FusedElementwise is made from placed ops, which keep their shapes")
