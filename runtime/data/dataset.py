"""``Dataset``: a sequence of elements, described by a source and transformations, read
through an iterator whose ``get_next()`` is an op of the graph (TensorFlow 1.x's
``tf.data.Dataset``).

A dataset is a description; nothing is read until an iterator's stream is opened (by the
first ``get_next`` step). Every dataset can open a ``Stream`` of itself for an epoch, say
how many elements it has (``cardinality``: a count, ``INFINITE`` or ``UNKNOWN``), give
random access where its elements can be read at any index (a ``Gather``: the cheap path
for batches and for fast-forwarding), and show a representative element (``_probe``),
from which a map function's output structure is inferred.

The classes live in ``sources``, ``transformations`` and ``iterator``, which import this
module; the constructors here reach them through ``_BUILDERS``, which those modules fill
when ``flowmill.runtime.data`` is imported (as the kernels fill their registry), so that
no two modules import each other.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from .streams import Context, Gather, IndexStream, Stream
from .structure import INFINITE, UNKNOWN, Structure

AUTOTUNE = -1  # num_parallel_calls / prefetch size chosen by the pipeline

_BUILDERS: dict[str, Callable[..., Any]] = {}


def builds(name: str) -> Callable:
    """Register the constructor a ``Dataset`` method stands for."""

    def register(fn):
        _BUILDERS[name] = fn
        return fn

    return register


def _build(name: str, *args, **kwargs):
    return _BUILDERS[name](*args, **kwargs)


class Dataset:
    """A sequence of elements, each a nest (single, tuple, dict) of arrays.

    Build one from a source (``from_tensor_slices``, ``from_tensors``, ``from_generator``,
    ``range``, ``TextLineDataset``, ``FixedLengthRecordDataset``), chain transformations
    (``map``, ``shuffle``, ``repeat``, ``batch``, ``prefetch``, ``shard``, ``take``,
    ``skip``), and read it in the graph through ``make_one_shot_iterator()`` or
    ``make_initializable_iterator()``. Datasets are immutable: each method returns a new one.
    """

    label = "dataset"
    structure: Structure
    _inputs: tuple[Dataset, ...] = ()
    is_source = False
    is_shard = False

    # ---- what each kind of dataset says about itself

    def _stream(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        """A stream of this dataset's elements for ``epoch`` (the iteration count of every
        enclosing ``repeat``, outermost first: it seeds each epoch's shuffle)."""
        gather = self._gather()
        if gather is not None:
            return IndexStream(gather, self.label)
        return self._sequential(ctx, epoch)

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        raise NotImplementedError

    def _gather(self) -> Gather | None:
        """Random access to the elements, where they can be read at any index."""
        return None

    def _cardinality(self) -> int:
        return UNKNOWN

    def _probe(self) -> tuple | None:
        """A representative element (flat), or None for a dataset known to be empty."""
        return self._inputs[0]._probe() if self._inputs else None

    @property
    def _input(self) -> Dataset:
        return self._inputs[0]

    def _with_inputs(self, inputs) -> Dataset:
        clone = copy.copy(self)
        clone._inputs = tuple(inputs)
        return clone

    def _rebuild(self, fn: Callable[[Dataset, Dataset], Dataset]) -> Dataset:
        """The chain rebuilt bottom-up: ``fn(original, rebuilt)`` for every dataset of it,
        ``rebuilt`` being the original over its rebuilt inputs."""
        inputs = [d._rebuild(fn) for d in self._inputs]
        same = all(a is b for a, b in zip(inputs, self._inputs, strict=True))
        return fn(self, self if same else self._with_inputs(inputs))

    def _chain(self) -> list[Dataset]:
        """Every dataset of the chain, this one first."""
        out = [self]
        for d in self._inputs:
            out += d._chain()
        return out

    # ---- what a user reads

    @property
    def output_types(self):
        """The dtypes of an element's components, nested as the element is."""
        return self.structure.output_types()

    @property
    def output_shapes(self):
        """The static shapes of an element's components (None dims unknown)."""
        return self.structure.output_shapes()

    def cardinality(self) -> int:
        """The number of elements: a count, ``INFINITE`` (-1) or ``UNKNOWN`` (-2)."""
        return self._cardinality()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}: {self.structure.describe()}>"

    # ---- sources

    @staticmethod
    def from_tensor_slices(tensors) -> Dataset:
        """The rows of ``tensors`` (a nest of arrays sharing their first dimension), one
        element per row. The arrays are read in place, not copied."""
        return _build("from_tensor_slices", tensors)

    @staticmethod
    def from_tensors(tensors) -> Dataset:
        """One element: ``tensors`` itself."""
        return _build("from_tensors", tensors)

    @staticmethod
    def from_generator(generator, output_types, output_shapes=None, args=None) -> Dataset:
        """The elements ``generator(*args)`` yields, each checked against ``output_types``
        and ``output_shapes`` (converted within a kind: float64 to float32, ints)."""
        return _build("from_generator", generator, output_types, output_shapes, args)

    @staticmethod
    def range(*args) -> Dataset:
        """``range(stop)``, ``range(start, stop[, step])``: int64 scalars."""
        return _build("range", *args)

    # ---- transformations

    def map(self, map_func, num_parallel_calls: int | None = None,
            deterministic: bool | None = None, output_types=None,
            output_shapes=None) -> Dataset:
        """``map_func`` applied to every element: a Python function of NumPy values (see
        ``transformations.MapDataset`` for why, and how its output structure is found)."""
        return _build("map", self, map_func, num_parallel_calls, deterministic,
                      output_types, output_shapes)

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> Dataset:
        """Elements in random order, drawn from a buffer of ``buffer_size``; deterministic
        given ``seed`` (or the graph's seed), differently in every epoch of a ``repeat``."""
        return _build("shuffle", self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: int | None = None) -> Dataset:
        """The elements ``count`` times over (None or -1: forever)."""
        return _build("repeat", self, count)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Consecutive elements stacked in batches of ``batch_size``; the last may be
        smaller unless ``drop_remainder``."""
        return _build("batch", self, batch_size, drop_remainder)

    def prefetch(self, buffer_size: int) -> Dataset:
        """The elements produced in a thread of their own, up to ``buffer_size`` ahead."""
        return _build("prefetch", self, buffer_size)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element from the ``index``-th. Written anywhere in a
        chain, it replaces the job's default sharding of the source."""
        return _build("shard", self, num_shards, index)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (-1: all)."""
        return _build("take", self, count)

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (-1: none)."""
        return _build("skip", self, count)

    # ---- iterators

    def make_one_shot_iterator(self, shared_name: str | None = None):
        """An iterator read from its first element on, with nothing to initialize; in a
        job it reads this task's shard and resumes where a restored job stood."""
        return _build("iterator", self, one_shot=True, shared_name=shared_name)

    def make_initializable_iterator(self, shared_name: str | None = None):
        """An iterator that starts (again) at its first element when ``initializer`` runs."""
        return _build("iterator", self, one_shot=False, shared_name=shared_name)


def known(count: int) -> bool:
    return count >= 0


def check_count(value, what: str, allow_all: bool = False) -> int:
    """An int argument: non-negative (or -1 for "all" where ``allow_all``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if value < 0 and not (allow_all and value == -1):
        raise ValueError(f"{what} must be >= 0{' or -1' if allow_all else ''}, got {value}")
    return value


__all__ = ["AUTOTUNE", "Dataset", "INFINITE", "UNKNOWN"]
