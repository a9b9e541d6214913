"""Elements and their structure: what flows through a pipeline, and how it is checked.

Inside a pipeline an element is a flat tuple of NumPy arrays, one per component. The user
sees it in its own structure (a single array, a tuple, a dict, nested), as TensorFlow's
``tf.data`` does: ``from_tensor_slices((x, y))`` yields ``(x_i, y_i)``, a map function is
called as ``fn(x_i, y_i)``, and ``get_next()`` returns ``(images, labels)``. A
``Structure`` holds the nest (its leaves numbered), one dtype and one static shape per
component, and converts between the two forms. Dict keys are taken in sorted order, as
in TensorFlow's ``nest``; lists are values (converted to arrays), not structure.

Values from user code (a generator, a map function) are checked here on their way in,
so a wrong dtype or shape fails where it was made, naming the dataset and the element,
instead of somewhere in the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.debug import InvalidArgumentError
from flowmill.kernels.shapes import Shape

from .. import dtypes

INFINITE = -1  # cardinality of a dataset that never ends
UNKNOWN = -2  # cardinality nobody can tell without reading the data


def flatten(value) -> list:
    """The leaves of a nest of tuples and dicts, in order (dict keys sorted)."""
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in flatten(v)]
    if isinstance(value, dict):
        return [leaf for k in sorted(value) for leaf in flatten(value[k])]
    return [value]


def template_of(value, start: int = 0) -> tuple[Any, int]:
    """The nest of ``value`` with its leaves replaced by their flat index; and the count."""
    if isinstance(value, tuple):
        out = []
        for v in value:
            t, start = template_of(v, start)
            out.append(t)
        return (type(value)(out) if _is_namedtuple(value) else tuple(out)), start
    if isinstance(value, dict):
        res = {}
        for k in sorted(value):
            res[k], start = template_of(value[k], start)
        return res, start
    return start, start + 1


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def pack(template, leaves):
    """Rebuild the nest ``template`` describes from its flat ``leaves``."""
    if isinstance(template, int):
        return leaves[template]
    if isinstance(template, tuple):
        items = [pack(t, leaves) for t in template]
        return type(template)(*items) if _is_namedtuple(template) else tuple(items)
    return {k: pack(t, leaves) for k, t in template.items()}


def same_nest(a, b) -> bool:
    return flatten(a) == flatten(b) and _kinds(a) == _kinds(b)


def _kinds(t):
    if isinstance(t, tuple):
        return ("t", len(t), tuple(_kinds(x) for x in t))
    if isinstance(t, dict):
        return ("d", tuple(sorted(t)), tuple(_kinds(t[k]) for k in sorted(t)))
    return "."


def as_dtype(value) -> np.dtype:
    """A dtype as the pipeline takes it: ``bytes``/``str``/``"string"`` mean byte strings."""
    if value in (bytes, str, "string") or (isinstance(value, np.dtype) and value.kind in "SU"):
        return dtypes.string
    return dtypes.as_dtype(value)


def same_dtype(want: np.dtype, got: np.dtype) -> bool:
    return got == want or (want.kind == "S" and got.kind == "S")


Where = str | Callable[[], str]  # where a value comes from, for errors: built on failure


def _text(where: Where) -> str:
    return where if isinstance(where, str) else where()


def conform(value, dtype: np.dtype, shape: Shape, where: Where) -> np.ndarray:
    """``value`` as an array of ``dtype`` (converting within a kind: float64 to float32,
    Python ints to int32, str to UTF-8 bytes) whose shape fits ``shape``; else an
    ``InvalidArgumentError`` that says ``where``."""
    a = value if type(value) is np.ndarray else np.asarray(value)
    if not same_dtype(dtype, a.dtype):
        if dtype.kind == "S" and a.dtype.kind == "U":
            a = np.char.encode(a, "utf-8")
        elif dtype.kind != "S" and a.dtype.kind not in "OSUV" and np.can_cast(
            a.dtype, dtype, "same_kind"
        ):
            a = a.astype(dtype)
        else:
            raise InvalidArgumentError(
                f"{_text(where)} has dtype {a.dtype}, expected {dtype} "
                f"(value {_short(value)})"
            )
    if shape is not None and not shapes.compatible(shape, a.shape):
        raise InvalidArgumentError(
            f"{_text(where)} has shape {shapes.fmt(a.shape)}, expected {shapes.fmt(shape)}"
        )
    return a


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Structure:
    """The structure of a dataset's elements: a nest, and per component a dtype and a
    static shape (``None`` dims unknown, ``None`` alone: unknown rank)."""

    template: Any
    types: tuple[np.dtype, ...]
    shapes: tuple[Shape, ...]

    def __post_init__(self):
        # The common cases checked without walking the nest: a plain tuple of components,
        # and components whose shape is fully known.
        flat = type(self.template) is tuple and self.template == tuple(range(len(self.types)))
        object.__setattr__(self, "_flat", flat)
        object.__setattr__(self, "_exact", tuple(
            s if s is not None and None not in s else None for s in self.shapes
        ))

    @classmethod
    def of(cls, value) -> Structure:
        """The structure of one concrete element (a nest of arrays or array-likes)."""
        template, _ = template_of(value)
        leaves = [np.asarray(v) for v in flatten(value)]
        types = tuple(dtypes.string if a.dtype.kind in "SU" else a.dtype for a in leaves)
        return cls(template, types, tuple(tuple(a.shape) for a in leaves))

    @classmethod
    def declared(cls, types, out_shapes=None) -> Structure:
        """From the nests a user declares (``output_types``, ``output_shapes``)."""
        template, count = template_of(types)
        flat_types = tuple(as_dtype(t) for t in flatten(types))
        if out_shapes is None:
            flat_shapes: tuple = (None,) * count
        else:
            flat_shapes = tuple(shapes.as_shape(s) for s in _flatten_shapes(out_shapes,
                                                                             template))
            if len(flat_shapes) != count:
                raise ValueError(
                    f"output_shapes has {len(flat_shapes)} components, output_types {count}"
                )
        return cls(template, flat_types, flat_shapes)

    def __len__(self) -> int:
        return len(self.types)

    def pack(self, leaves):
        if self._flat:
            return tuple(leaves)
        return pack(self.template, leaves)

    def flatten(self, value, where: str) -> list:
        """The leaves of ``value``, which must have this structure."""
        if isinstance(self.template, int):
            return [value]
        if not isinstance(value, (tuple, dict)):
            raise InvalidArgumentError(
                f"{where} is a single {type(value).__name__}, expected the structure "
                f"{self.describe()}"
            )
        template, _ = template_of(value)
        if not same_nest(template, self.template):
            raise InvalidArgumentError(
                f"{where} has the structure {_nest_text(template)}, expected "
                f"{self.describe()}"
            )
        return flatten(value)

    def conform(self, value, where: Where) -> tuple:
        """One element from user code, flattened, converted and checked."""
        n = len(self.types)
        if isinstance(self.template, int):
            leaves = (value,)
        elif (self._flat and type(value) is tuple and len(value) == n
              and not any(type(v) is tuple or type(v) is dict for v in value)):
            leaves = value
        else:
            leaves = self.flatten(value, _text(where))
        out = []
        for i in range(n):
            v, exact = leaves[i], self._exact[i]
            if exact is not None and isinstance(v, (np.ndarray, np.generic)) and (
                v.shape == exact and v.dtype == self.types[i]
            ):
                out.append(v if type(v) is np.ndarray else np.asarray(v))  # as it must be
                continue
            text = _text(where)
            out.append(conform(v, self.types[i], self.shapes[i],
                               text if n == 1 else f"{text}, component {i}"))
        return tuple(out)

    def batched(self, size: int | None) -> Structure:
        """The structure of a batch of these elements (``size`` None: not always full)."""
        return Structure(
            self.template,
            self.types,
            tuple(None if s is None else (size, *s) for s in self.shapes),
        )

    def output_types(self):
        return self.pack(list(self.types))

    def output_shapes(self):
        return self.pack(list(self.shapes))

    def describe(self) -> str:
        parts = [f"{t}{shapes.fmt(s)}" for t, s in zip(self.types, self.shapes, strict=True)]
        return _nest_text(self.template, parts)


def _flatten_shapes(out_shapes, template) -> list:
    """Shapes nested like ``template``; a shape is a tuple or list of dims, or None."""
    if isinstance(template, int):
        return [out_shapes]
    if isinstance(template, tuple):
        if not isinstance(out_shapes, (tuple, list)) or len(out_shapes) != len(template):
            raise ValueError(f"output_shapes {out_shapes!r} does not match output_types")
        return [s for sub, t in zip(out_shapes, template, strict=True)
                for s in _flatten_shapes(sub, t)]
    if not isinstance(out_shapes, dict) or sorted(out_shapes) != sorted(template):
        raise ValueError(f"output_shapes {out_shapes!r} does not match output_types")
    return [s for k in sorted(template) for s in _flatten_shapes(out_shapes[k], template[k])]


def _nest_text(template, parts=None) -> str:
    if isinstance(template, int):
        return parts[template] if parts is not None else "x"
    if isinstance(template, tuple):
        inner = ", ".join(_nest_text(t, parts) for t in template)
        return f"({inner}{',' if len(template) == 1 else ''})"
    return "{" + ", ".join(f"{k!r}: {_nest_text(t, parts)}" for k, t in template.items()) + "}"


# ---- blocks: consecutive elements stacked, one array per component


def block_len(block: tuple) -> int:
    return len(block[0])


def stack(rows: list[tuple], where: str) -> tuple:
    """Consecutive elements as one block (each component stacked on a new axis 0)."""
    out = []
    for i in range(len(rows[0])):
        column = [r[i] for r in rows]
        try:
            out.append(np.stack(column))
        except ValueError:
            seen = sorted({tuple(np.shape(c)) for c in column})
            raise InvalidArgumentError(
                f"{where}: cannot batch elements whose component {i} has different shapes "
                f"{seen}; map them to one shape first"
            ) from None
    return tuple(out)


def concat(blocks: list[tuple]) -> tuple:
    if len(blocks) == 1:
        return blocks[0]
    return tuple(np.concatenate([b[i] for b in blocks]) for i in range(len(blocks[0])))


def rows(block: tuple) -> list[tuple]:
    """The elements of a block (views of its rows; a scalar component stays 0-d)."""
    return [tuple(c[j, ...] for c in block) for j in range(block_len(block))]
