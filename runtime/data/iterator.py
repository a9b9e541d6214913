"""The graph side of an input pipeline: ``Iterator``, whose ``get_next()`` gives tensors
the model is built on, so a training step reads its batch without a feed.

**Design: a Python-side pipeline behind one stateful op.** The pipeline is Python (NumPy
sources, map functions, a shuffle buffer) run by the iterator's own threads (a prefetch
stage, parallel map workers); the graph sees one op, ``IteratorGetNext``, whose kernel
takes the next element from the iterator resource (``flowmill.kernels.iterator``) on the
task that runs the script. The alternative of the paper's era, queues filled by
enqueue steps from runner threads, pays a whole step (and, in a job, the step's
round trips) per enqueue and splits one pipeline over several graphs and threads that
must be started, stopped and restarted together; here a prefetched element costs the
step one kernel call, the pipeline is one object that a checkpoint can put back at a
position, and ordering, seeding and errors are plain Python. The ops are built on
``CPU:0`` with no job or task, so placement puts them on the session's own task: the
worker that runs the script, never a PS.

**Sharding.** In a job, a dataset read through an iterator reads only this task's share
(``job.task()``: ``(index, count)``, ``(0, 1)`` alone): every source of the chain gets
``shard(count, index)`` right after it, before any shuffle, map or batch, so each worker
shuffles and batches its own elements (TensorFlow's auto-shard by data). Arrays and record
files shard by index arithmetic; a generator or text file is read whole by every worker,
each keeping its share. A ``shard`` written anywhere in the chain replaces this default
(``shard(1, 0)``: read everything).

**A checkpointable position, from the global step.** A job's checkpoint stands at a
global step; a one-shot iterator resumes at ``steps_done(step)`` elements of its stream
(the step count alone or in sync mode; this task's share of it in async modes), which is
one element per training step, the TensorFlow 1.x loop's. ``Saver.restore`` and
``initialize_or_wait`` call the graph's resume hooks (``hooks.RESUME_AT_STEP``) with the
step, and the iterator seeks there: the stream is rebuilt at that position, skipping
without reading where the data has random access (index arithmetic; a shuffle over such
data redraws its choices, reading nothing) and replaying otherwise (a generator, lines).
The stream is a function of its seed and position, so sync training resumed from a
checkpoint is bit-exact with an uninterrupted run. Why not a position kept in variables:
the chief takes a sync checkpoint between two updates, but the workers' next steps (and
so their next ``get_next``) may already have started by then, so a position the workers
wrote would be a step ahead of the parameters, at random; and a chief that rejoins a
running job must read the batch of the current step again, which the global step names.
Nothing is stored, and no step pays for it.

Unseeded shuffles get a seed from the graph's seed (or a random one without it: such a
stream is neither reproducible nor resumable exactly, as in TensorFlow).
"""

from __future__ import annotations

import contextlib

import numpy as np

from flowmill.kernels import shapes
from flowmill.kernels.debug import InvalidArgumentError
from flowmill.kernels.iterator import register_dataset

from .. import dtypes
from ..graph import Graph, Operation, Tensor, get_default_graph
from ..hooks import RESUME_AT_STEP
from ..job import steps_done, task
from ..ops.array_ops import constant, placeholder
from ..ops.iterator_ops import (
    iterator_get_next,
    iterator_handle,
    iterator_position,
    iterator_seek,
)
from .dataset import Dataset, builds
from .streams import Context, Stream
from .structure import Structure, same_dtype
from .transformations import ShardDataset, ShuffleDataset

ITERATORS = "iterators"  # graph collection: every Iterator built (it keeps its opener alive)
DEVICE = "/device:CPU:0"


def bind(dataset: Dataset, graph: Graph, index: int, count: int) -> Dataset:
    """The chain an iterator reads: the job's shard at every source (unless the chain has
    a shard of its own) and a seed for every unseeded shuffle."""
    if count > 1 and not any(d.is_shard for d in dataset._chain()):
        dataset = dataset._rebuild(
            lambda d, new: ShardDataset(new, count, index) if d.is_source else new
        )
    unseeded = [d for d in dataset._chain() if isinstance(d, ShuffleDataset) and d.seed is None]
    if not unseeded:
        return dataset
    if graph.seed is not None:
        entropy = [int(graph.seed) & (2**64 - 1), len(graph.get_operations())]
    else:
        entropy = [np.random.SeedSequence().entropy]
    seeds = iter(np.random.SeedSequence(entropy).generate_state(len(unseeded), np.uint64))
    order = {id(d): int(next(seeds)) for d in reversed(unseeded)}  # sources first
    return dataset._rebuild(lambda d, new: new.with_seed(order[id(d)]) if id(d) in order else new)


class _Pipeline:
    """An opened stream and the context of its threads, as the iterator resource uses it."""

    def __init__(self, ctx: Context, stream: Stream, structure: Structure, label: str):
        self.ctx, self.stream, self.structure, self.label = ctx, stream, structure, label

    def next(self, cancellation) -> tuple | None:
        self.ctx.set_cancellation(cancellation)
        try:
            element = self.stream.next()
        finally:
            self.ctx.set_cancellation(None)
        if element is None:
            return None
        out = []
        for i, (v, t, s) in enumerate(zip(element, self.structure.types, self.structure.shapes,
                                          strict=True)):
            v = v if type(v) is np.ndarray else np.asarray(v)
            if not same_dtype(t, v.dtype) or (s is not None and not shapes.compatible(s, v.shape)):
                raise InvalidArgumentError(
                    f"iterator {self.ctx.name!r} over {self.label}: component {i} is "
                    f"{v.dtype}{shapes.fmt(v.shape)}, the iterator's outputs are "
                    f"{self.structure.describe()}"
                )
            out.append(v)
        return tuple(out)

    def close(self) -> None:
        self.ctx.close()


class _Opener:
    """What the kernels' registry holds for one iterator: its dataset, opened on demand."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.label = dataset.label

    def open(self, position: int, name: str) -> _Pipeline:
        ctx = Context(name)
        try:
            stream = self.dataset._stream(ctx, ())
            if position:
                stream.skip(position)
        except BaseException:
            ctx.close()
            raise
        return _Pipeline(ctx, stream, self.dataset.structure, self.label)


@contextlib.contextmanager
def _on_this_task(graph: Graph):
    """Ops built here go to CPU:0 of whichever task runs the step: the script's own."""
    with graph.device(None), graph.device(DEVICE):
        yield


@builds("iterator")
class Iterator:
    """Reads a dataset in the graph: ``get_next()`` is a nest of tensors, one step's
    element; at the end of the data a step that needs it raises ``OutOfRangeError``.

    A one-shot iterator needs no initializer and resumes with its job (see the module's
    docstring), so it is the one a training loop reads, one element per step; an
    initializable one is read only after ``initializer`` runs, which starts it again at
    the first element, and a restore leaves it alone (evaluation data). ``position()`` is
    the number of elements delivered. In a job the iterator's state belongs to the task's
    server, like the task's variables, and outlives one session; in one process it is the
    session's."""

    def __init__(self, dataset: Dataset, one_shot: bool = True, shared_name: str | None = None):
        graph = get_default_graph()
        index, count = task()
        self.dataset = bind(dataset, graph, index, count)
        self.structure = self.dataset.structure
        self.one_shot = one_shot
        self._opener = _Opener(self.dataset)
        token = register_dataset(self._opener)
        types, out_shapes = self.structure.types, self.structure.shapes
        with _on_this_task(graph), graph.control_dependencies(None):
            # Without a shared_name the state is this iterator's alone, whatever else the
            # session or the task's server holds.
            self._handle = iterator_handle(
                types, out_shapes, shared_name or token, token, initializable=not one_shot,
                name="Iterator" if one_shot else "InitializableIterator",
            )
            scope = self._handle.op.name
            self._position_feed = placeholder(dtypes.int64, (), name=f"{scope}_seek_to")
            self._seek_op = iterator_seek(self._handle, self._position_feed,
                                          name=f"{scope}_seek")
            self._initializer = None if one_shot else iterator_seek(
                self._handle, constant(0, dtypes.int64), name=f"{scope}_initializer"
            )
        graph.add_to_collection(ITERATORS, self)
        if one_shot:
            graph.add_to_collection(RESUME_AT_STEP, self.resume_at_step)

    @property
    def name(self) -> str:
        return self._handle.op.name

    @property
    def graph(self) -> Graph:
        return self._handle.graph

    @property
    def output_types(self):
        return self.structure.output_types()

    @property
    def output_shapes(self):
        return self.structure.output_shapes()

    @property
    def initializer(self) -> Operation:
        if self._initializer is None:
            raise ValueError(f"{self.name} is a one-shot iterator: it has no initializer")
        return self._initializer

    def get_next(self, name: str | None = None):
        """The next element, as tensors nested like the dataset's elements."""
        with self.graph.as_default(), _on_this_task(self.graph):
            outputs = iterator_get_next(self._handle, self.structure.types,
                                        self.structure.shapes, name=name)
        return self.structure.pack(outputs)

    def position(self, name: str | None = None) -> Tensor:
        """The number of elements this iterator has delivered (int64 scalar)."""
        with self.graph.as_default(), _on_this_task(self.graph):
            return iterator_position(self._handle, name=name)

    def seek(self, session, position: int) -> None:
        """Stand at ``position``: the next ``get_next`` gives element ``position``."""
        session.run(self._seek_op, {self._position_feed: int(position)})

    def resume_at_step(self, session, global_step: int) -> None:
        """Where a job restored at ``global_step`` stands: this task's steps by then, one
        element each (``hooks.RESUME_AT_STEP``)."""
        self.seek(session, steps_done(int(global_step)))

    def __repr__(self) -> str:
        kind = "one-shot" if self.one_shot else "initializable"
        return f"<Iterator {self.name!r} ({kind}) over {self.dataset.label}>"
