"""Static shapes: tuples of dims, ``None`` for an unknown dim; ``None`` alone: unknown rank."""

from __future__ import annotations

from collections.abc import Sequence

Shape = tuple[int | None, ...] | None


class ShapeError(ValueError):
    """A shape or dtype that cannot work, found while building the graph."""


def as_shape(value) -> Shape:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,)
    return tuple(None if d is None or d == -1 else int(d) for d in value)


def fmt(shape: Shape) -> str:
    if shape is None:
        return "<unknown>"
    dims = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def num_elements(shape: Shape) -> int | None:
    if shape is None or any(d is None for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


def compatible(a: Shape, b: Shape) -> bool:
    if a is None or b is None:
        return True
    if len(a) != len(b):
        return False
    return all(x is None or y is None or x == y for x, y in zip(a, b, strict=True))


def merge(a: Shape, b: Shape) -> Shape:
    """The most specific shape both agree with (caller checked ``compatible``)."""
    if a is None:
        return b
    if b is None:
        return a
    return tuple(x if x is not None else y for x, y in zip(a, b, strict=True))


def broadcast(a: Shape, b: Shape) -> Shape:
    """NumPy broadcasting over static shapes; raises ShapeError on a definite mismatch."""
    if a is None or b is None:
        return None
    out: list[int | None] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == 1:
            out.append(y)
        elif y == 1:
            out.append(x)
        elif x is None or y is None:
            out.append(x if y is None else y)
        elif x == y:
            out.append(x)
        else:
            raise ShapeError(f"cannot broadcast {fmt(a)} with {fmt(b)}")
    return tuple(reversed(out))


def normalize_axes(axes: int | Sequence[int] | None, rank: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(rank))
    if isinstance(axes, int):
        axes = (axes,)
    out = []
    for a in axes:
        if not -rank <= a < max(rank, 1):
            raise ShapeError(f"axis {a} out of range for rank {rank}")
        out.append(a % rank if rank else 0)
    return tuple(sorted(set(out)))
