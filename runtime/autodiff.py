"""The gradient registry, at the bottom of autodiff (``backprop`` walks the graph above).

Each differentiable op registers a vector-Jacobian product with ``@defvjp(op_type)``:
``fn(op, *output_grads) -> [grad for each input or None]``. A gradient may be an
``IndexedSlices`` (Gather's row gradients), so optimizers update only the rows looked up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .graph import Tensor

VJP = Callable[..., list]
GRADIENTS: dict[str, VJP] = {}
ACCEPTS_NONE: set[str] = set()  # gradients given None, not zeros, for outputs none reached
# Ops whose gradient accepts IndexedSlices as is (they only pass it along).
SPARSE_PASSTHROUGH = {"Identity", "ReadVariableOp"}


def defvjp(op_type: str, none_ok: bool = False) -> Callable[[VJP], VJP]:
    """Register ``fn`` as ``op_type``'s gradient. With ``none_ok`` it is given None for
    an output no gradient reached, instead of zeros made for it (an output kept only for
    the gradient, which would otherwise cost a zeros tensor every step)."""

    def register(fn: VJP) -> VJP:
        if op_type in GRADIENTS:
            raise ValueError(f"gradient for {op_type!r} registered twice")
        GRADIENTS[op_type] = fn
        if none_ok:
            ACCEPTS_NONE.add(op_type)
        return fn

    return register


@dataclass
class IndexedSlices:
    """A sparse gradient: ``values[i]`` is the gradient of row ``indices[i]`` (may repeat)."""

    values: Tensor
    indices: Tensor
    dense_shape: tuple

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def name(self) -> str:
        return self.values.name
