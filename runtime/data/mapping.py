"""``map``: a Python function applied to every element, in order, on one thread or many.

Its input keeps random access through a sequential map (the function is applied to the
elements actually used, when they are used), so ``from_tensor_slices(...).map(f)
.shuffle(...)`` still shuffles indices; a parallel map is a stream of its own, whose
workers run ahead of the reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .dataset import AUTOTUNE, Dataset, builds, check_count
from .streams import Context, Gather, ParallelMapStream, Stream
from .structure import Structure, block_len, rows, stack


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@builds("map")
class MapDataset(Dataset):
    """``map_func`` applied to every element, as a Python function of NumPy values.

    Not a graph function, because the pipeline runs outside the step: a graph function
    would cost a step (compile once, then dispatch every op) per element, and could not
    use what Python code that prepares data uses (parsing, NumPy, file formats). As in
    TensorFlow, a tuple element arrives as arguments (``fn(x, y)``), any other as one.

    ``num_parallel_calls`` (``AUTOTUNE``: one per core) runs it on that many threads; they
    help where ``map_func`` releases the GIL (NumPy on large arrays, I/O, decoders).
    Results keep the input order unless ``deterministic=False``. ``map_func`` should be a
    function of its element alone: a sequential map over a random-access input is applied
    lazily, when an element is used, and a resumed stream does not apply it to the
    elements it skips.

    The output structure is ``output_types``/``output_shapes`` where given (an extension
    of TensorFlow's signature, which traces the function instead), else it is inferred by
    applying ``map_func`` to a representative element of the input when the dataset is
    made: dtypes and shapes as that output has them, except that a leading dimension
    matching the input's unknown batch dimension stays unknown. An element that does not
    fit fails naming the map and the element; give ``output_shapes`` with ``None`` for
    dims that vary.
    """

    def __init__(self, input: Dataset, map_func: Callable, num_parallel_calls=None,
                 deterministic=None, output_types=None, output_shapes=None):
        if not callable(map_func):
            raise TypeError(f"map: map_func must be callable, got {type(map_func).__name__}")
        if num_parallel_calls is None:
            workers = 1
        elif num_parallel_calls == AUTOTUNE:
            workers = os.cpu_count() or 1
        else:
            workers = check_count(num_parallel_calls, "map: num_parallel_calls")
            if workers == 0:
                raise ValueError("map: num_parallel_calls must be positive")
        self._inputs = (input,)
        self._fn, self._workers = map_func, workers
        self._deterministic = True if deterministic is None else bool(deterministic)
        self.label = f"{input.label}.map({_name(map_func)})"
        if output_types is not None:
            self.structure = Structure.declared(output_types, output_shapes)
        else:
            self.structure = self._infer(input)

    def _infer(self, input: Dataset) -> Structure:
        probe = input._probe()
        if probe is None:
            raise ValueError(
                f"{self.label}: the input is empty, so the output structure cannot be "
                "inferred; pass output_types (and output_shapes)"
            )
        try:
            value = self._invoke(probe, input.structure)
        except Exception as e:
            e.add_note(f"while inferring the output structure of {self.label} "
                       "from a representative element")
            raise
        found = Structure.of(value)
        batch = {p.shape[0] for p, s in zip(probe, input.structure.shapes, strict=True)
                 if p.ndim and (s is None or s[0] is None)}
        found_shapes = tuple(
            (None, *s[1:]) if s and s[0] in batch else s for s in found.shapes
        )
        return Structure(found.template, found.types, found_shapes)

    def _invoke(self, flat: tuple, structure: Structure):
        """``map_func`` on one element: arrays, a scalar component as a NumPy scalar (a
        string as ``bytes``), as TensorFlow 1.x's ``py_func`` gives them."""
        element = structure.pack([a[()] if a.ndim == 0 else a for a in flat])
        if isinstance(structure.template, tuple):
            return self._fn(*element)
        return self._fn(element)

    def _call(self, flat: tuple, index: int) -> tuple:
        source = self._input.structure
        try:
            value = self._invoke(flat, source)
        except Exception as e:
            e.add_note(f"raised by {self.label} at element {index}")
            raise
        return self.structure.conform(
            value, lambda: f"{self.label}: output for element {index}"
        )

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _gather(self) -> Gather | None:
        g = self._input._gather() if self._workers == 1 else None
        if g is None:
            return None
        call, label = self._call, self.label

        def take(idx) -> tuple:
            block = g.take(idx)
            return stack([call(r, int(i)) for r, i in zip(rows(block), idx, strict=True)],
                         label)

        return Gather(g.count, lambda i: call(g.get(i), i), take)

    def _probe(self) -> tuple | None:
        probe = self._input._probe()
        return None if probe is None else self._call(probe, 0)

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        input = self._input._stream(ctx, epoch)
        if self._workers > 1:
            return ParallelMapStream(input, self._call, self._workers, self._deterministic,
                                     ctx, self.label)
        return _MapStream(input, self._call, self.label)


class _MapStream(Stream):
    def __init__(self, input: Stream, call, label: str):
        self.input, self.call, self.label, self.index = input, call, label, 0

    def next(self) -> tuple | None:
        element = self.input.next()
        if element is None:
            return None
        self.index += 1
        return self.call(element, self.index - 1)

    def next_block(self, n: int, where: str | None = None) -> tuple | None:
        block = self.input.next_block(n)
        if block is None:
            return None
        first, self.index = self.index, self.index + block_len(block)
        outputs = [self.call(r, first + j) for j, r in enumerate(rows(block))]
        return stack(outputs, where or self.label)

    def skip(self, n: int) -> int:
        done = self.input.skip(n)
        self.index += done
        return done
