"""Where elements come from: arrays in memory, a Python generator, text files (one line per
element), and files of fixed-size records.

Arrays and record files are read at any index (a ``Gather``): a batch is one gather, a
shard or a resumed position is index arithmetic, and nothing before a position is read.
A record file is mapped (``np.memmap``), so a shuffled batch reads only its own records.
Generators and text files are read in order: skipping reads (a generator is replayed,
lines are read and dropped), which is what resuming them costs.

Files are checked when the dataset is made (each exists; a record file's body is a whole
number of records) and again when a stream opens them, and a failure names the dataset
and the file.
"""

from __future__ import annotations

import bisect
import gzip
import os
from collections.abc import Callable

import numpy as np

from flowmill.kernels.debug import InvalidArgumentError

from .. import dtypes
from ..graph import Operation, Tensor
from .dataset import Dataset, builds, check_count
from .streams import Context, Gather, Stream
from .structure import Structure, flatten, template_of


def _arrays(tensors, what: str) -> list[np.ndarray]:
    leaves = flatten(tensors)
    for leaf in leaves:
        if isinstance(leaf, (Tensor, Operation)):
            raise TypeError(
                f"{what} takes NumPy values, got the graph tensor {leaf.name!r}: the pipeline "
                "runs beside the graph, on the values themselves"
            )
    out = []
    for leaf in leaves:
        a = np.asarray(leaf)
        out.append(np.char.encode(a, "utf-8") if a.dtype.kind == "U" else a)
    return out


@builds("from_tensor_slices")
class TensorSlicesDataset(Dataset):
    is_source = True

    def __init__(self, tensors):
        arrays = _arrays(tensors, "Dataset.from_tensor_slices")
        for i, a in enumerate(arrays):
            if a.ndim == 0:
                raise ValueError(f"Dataset.from_tensor_slices: component {i} is a scalar; "
                                 "every component needs a first dimension to slice")
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise ValueError(
                "Dataset.from_tensor_slices: components differ in their first dimension "
                f"({', '.join(str(len(a)) for a in arrays)})"
            )
        template, _ = template_of(tensors)
        self._arrays = arrays
        self.structure = Structure(template, tuple(_dtype(a) for a in arrays),
                                   tuple(a.shape[1:] for a in arrays))
        self.label = f"Dataset.from_tensor_slices({len(arrays[0])} x {self.structure.describe()})"

    def _cardinality(self) -> int:
        return len(self._arrays[0])

    def _gather(self) -> Gather:
        arrays = self._arrays
        return Gather(
            len(arrays[0]),
            lambda i: tuple(a[i, ...] for a in arrays),
            lambda idx: tuple(a[idx] for a in arrays),
            lambda lo, hi: tuple(a[lo:hi] for a in arrays),
        )

    def _probe(self) -> tuple | None:
        return tuple(a[0, ...] for a in self._arrays) if len(self._arrays[0]) else None


def _dtype(a: np.ndarray) -> np.dtype:
    return dtypes.string if a.dtype.kind == "S" else a.dtype


@builds("from_tensors")
class TensorsDataset(Dataset):
    is_source = True

    def __init__(self, tensors):
        self._arrays = _arrays(tensors, "Dataset.from_tensors")
        template, _ = template_of(tensors)
        self.structure = Structure(template, tuple(_dtype(a) for a in self._arrays),
                                   tuple(a.shape for a in self._arrays))
        self.label = f"Dataset.from_tensors({self.structure.describe()})"

    def _cardinality(self) -> int:
        return 1

    def _gather(self) -> Gather:
        arrays = tuple(self._arrays)
        return Gather(1, lambda i: arrays,
                      lambda idx: tuple(np.repeat(a[None], len(idx), axis=0) for a in arrays))

    def _probe(self) -> tuple:
        return tuple(self._arrays)


@builds("range")
class RangeDataset(Dataset):
    is_source = True

    def __init__(self, *args):
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 arguments, got {len(args)}")
        bounds = [int(a) for a in args]
        start, stop, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds, 1)[:3]
        if step == 0:
            raise ValueError("Dataset.range: step must not be 0")
        self._start, self._step, self._count = start, step, len(range(start, stop, step))
        self.structure = Structure(0, (dtypes.int64,), ((),))
        self.label = f"Dataset.range({', '.join(map(str, args))})"

    def _cardinality(self) -> int:
        return self._count

    def _gather(self) -> Gather:
        start, step = self._start, self._step

        def take(idx):
            return (np.asarray(idx, np.int64) * step + start,)

        return Gather(
            self._count,
            lambda i: (np.array(start + i * step, np.int64),),
            take,
            lambda lo, hi: take(np.arange(lo, hi, dtype=np.int64)),
        )

    def _probe(self) -> tuple | None:
        return (np.array(self._start, np.int64),) if self._count else None


@builds("from_generator")
class GeneratorDataset(Dataset):
    is_source = True

    def __init__(self, generator: Callable, output_types, output_shapes=None, args=None):
        if not callable(generator):
            raise TypeError(
                f"Dataset.from_generator: generator must be callable (a function returning "
                f"an iterator), got {type(generator).__name__}"
            )
        self._generator, self._args = generator, tuple(args or ())
        self.structure = Structure.declared(output_types, output_shapes)
        name = getattr(generator, "__name__", type(generator).__name__)
        self.label = f"Dataset.from_generator({name})"

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _GeneratorStream(self)

    def _probe(self) -> tuple | None:
        return _GeneratorStream(self).next()


class _GeneratorStream(Stream):
    def __init__(self, ds: GeneratorDataset):
        self.ds, self.label = ds, ds.label
        self._it = None
        self._index = 0
        self._ended = False

    def _raw(self):
        """The generator's next value; ``_END`` at its end."""
        if self._ended:
            return _END
        try:
            if self._it is None:
                self._it = iter(self.ds._generator(*self.ds._args))
            value = next(self._it)
        except StopIteration:
            self._ended = True
            return _END
        except Exception as e:
            e.add_note(f"raised by the generator of {self.label} at element {self._index}")
            raise
        self._index += 1
        return value

    def next(self) -> tuple | None:
        value = self._raw()
        if value is _END:
            return None
        index = self._index - 1
        return self.ds.structure.conform(value, lambda: f"{self.label}: element {index}")

    def skip(self, n: int) -> int:
        done = 0
        while done < n and self._raw() is not _END:
            done += 1
        return done


_END = object()


def _filenames(filenames, who: str) -> list[str]:
    if isinstance(filenames, (str, bytes, os.PathLike)):
        filenames = [filenames]
    if isinstance(filenames, (Tensor, Operation)):
        raise TypeError(f"{who} takes file names, not the graph tensor {filenames.name!r}")
    names = [os.fsdecode(f) for f in filenames]
    if not names:
        raise ValueError(f"{who}: no file names given")
    for name in names:
        _exists(name, who)
    return names


def _exists(name: str, label: str) -> None:
    if not os.path.isfile(name):
        what = "is not a file" if os.path.exists(name) else "does not exist"
        raise FileNotFoundError(f"{label}: {name!r} {what}")


def _describe_files(names: list[str]) -> str:
    return repr(names[0]) if len(names) == 1 else f"{len(names)} files from {names[0]!r}"


class TextLineDataset(Dataset):
    """The lines of text files, in order, one byte string per element (the newline, and a
    carriage return before it, removed). ``compression_type`` may be ``"GZIP"``."""

    is_source = True

    def __init__(self, filenames, compression_type: str | None = None, buffer_size=None):
        self._files = _filenames(filenames, "TextLineDataset")
        if compression_type not in (None, "", "GZIP"):
            raise ValueError(f"TextLineDataset: compression_type must be None, '' or 'GZIP', "
                             f"got {compression_type!r}")
        self._gzip = compression_type == "GZIP"
        self.structure = Structure(0, (dtypes.string,), ((),))
        self.label = f"TextLineDataset({_describe_files(self._files)})"

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _LineStream(self)

    def _probe(self) -> tuple | None:
        return _LineStream(self).next()


class _LineStream(Stream):
    def __init__(self, ds: TextLineDataset):
        self.ds, self.label = ds, ds.label
        self._lines = self._read()

    def _read(self):
        for name in self.ds._files:
            _exists(name, self.label)
            opener = gzip.open if self.ds._gzip else open
            with opener(name, "rb") as f:
                yield from f

    def _line(self) -> bytes | None:
        return next(self._lines, None)

    def next(self) -> tuple | None:
        line = self._line()
        if line is None:
            return None
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        return (np.array(line),)

    def skip(self, n: int) -> int:
        done = 0
        while done < n and self._line() is not None:
            done += 1
        return done


class FixedLengthRecordDataset(Dataset):
    """The records of binary files, each ``record_bytes`` long, after ``header_bytes`` and
    before ``footer_bytes`` of every file; one ``uint8[record_bytes]`` vector per element.

    TensorFlow yields each record as a string for ``decode_raw`` to turn into numbers; here
    the record already is the array ``decode_raw(record, uint8)`` gives (a NumPy byte string
    would lose its trailing zero bytes), and ``map`` views or slices it
    (``r[1:].view(np.float32)``). Files are memory-mapped: a record is read when used."""

    is_source = True

    def __init__(self, filenames, record_bytes: int, header_bytes: int | None = None,
                 footer_bytes: int | None = None, buffer_size=None):
        self._files = _filenames(filenames, "FixedLengthRecordDataset")
        self._record = check_count(record_bytes, "FixedLengthRecordDataset: record_bytes")
        if self._record == 0:
            raise ValueError("FixedLengthRecordDataset: record_bytes must be positive")
        self._header = check_count(header_bytes or 0, "FixedLengthRecordDataset: header_bytes")
        self._footer = check_count(footer_bytes or 0, "FixedLengthRecordDataset: footer_bytes")
        self.structure = Structure(0, (dtypes.uint8,), ((self._record,),))
        self.label = f"FixedLengthRecordDataset({_describe_files(self._files)})"
        self._counts()  # every file's size is checked now, and again when it is read

    def _counts(self) -> list[int]:
        counts = []
        for name in self._files:
            _exists(name, self.label)
            size = os.path.getsize(name)
            body = size - self._header - self._footer
            if body < 0 or body % self._record:
                raise InvalidArgumentError(
                    f"{self.label}: {name!r} has {size} bytes; without its header "
                    f"({self._header} bytes) and footer ({self._footer} bytes) that is "
                    f"{body} bytes, not a whole number of {self._record}-byte records"
                )
            counts.append(body // self._record)
        return counts

    def _cardinality(self) -> int:
        return sum(self._counts())

    def _gather(self) -> Gather:
        counts, rb = self._counts(), self._record
        maps = [
            np.memmap(name, np.uint8, "r", offset=self._header, shape=(n, rb))
            if n else np.empty((0, rb), np.uint8)
            for name, n in zip(self._files, counts, strict=True)
        ]
        starts = np.cumsum([0, *counts])[:-1].tolist()
        total = sum(counts)

        def get(i: int) -> tuple:
            f = bisect.bisect_right(starts, i) - 1
            while counts[f] == 0 or i - starts[f] >= counts[f]:
                f += 1
            return (np.array(maps[f][i - starts[f]]),)

        def take(idx) -> tuple:
            idx = np.asarray(idx, np.int64)
            if len(maps) == 1:
                return (np.asarray(maps[0][idx]),)
            out = np.empty((len(idx), rb), np.uint8)
            which = np.searchsorted(starts, idx, side="right") - 1
            for f in np.unique(which):
                sel = which == f
                out[sel] = maps[f][idx[sel] - starts[f]]
            return (out,)

        def take_range(lo: int, hi: int) -> tuple:
            f = bisect.bisect_right(starts, lo) - 1
            if counts[f] and hi - starts[f] <= counts[f]:
                return (np.array(maps[f][lo - starts[f]:hi - starts[f]]),)
            return take(np.arange(lo, hi, dtype=np.int64))

        return Gather(total, get, take, take_range)

    def _probe(self) -> tuple | None:
        gather = self._gather()
        return gather.get(0) if gather.count else None
