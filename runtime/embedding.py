"""Sparse embeddings over a table sharded by rows across PS tasks (paper section 4.2).

Row ``r`` of the table lives in shard ``r % n`` at row ``r // n``. A lookup is the paper's
Part, Gather, Stitch: the ids are partitioned by shard, each shard gathers its rows where
the shard lives (the Gather is colocated with the shard's variable, so only the rows looked
up cross the network, never the table), and the rows are stitched back into id order. The
gradient of a shard is an ``IndexedSlices`` of those rows, which the optimizers apply row
by row, so a step costs the same whatever the table's size. ``embedding_lookup`` is the
lookup on its own, over shards a caller made (TensorFlow's ``tf.nn.embedding_lookup``).

The shards are one table to a checkpoint: ``partitioned_table`` records which rows of the
full table each shard holds, the saver stores every shard as that slice of the table, and
a job that splits the table into another number of shards (or keeps it whole) restores it
row by row, as TensorFlow's partitioned variables do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowmill.kernels import shapes
from flowmill.kernels.checkpoint_store import TensorSlice

from . import dtypes
from .graph import Tensor, convert_to_tensor, get_default_graph
from .ops.array_ops import dynamic_partition, dynamic_stitch, gather, range_, reshape
from .ops.math_ops import less, maximum, size
from .ops.select_ops import where
from .ops.state_ops import Variable


class ShardedEmbedding:
    """A ``vocab_size`` x ``dim`` table in ``num_shards`` variables.

    ``initializer(shape, dtype)`` makes each shard's initial value (e.g.
    ``flowmill.runtime.initializers.random_normal(stddev=0.05)``); place the shards with a
    device function such as ``replica_device_setter``, which spreads them over the PS
    tasks. The shards are named ``<name>/shard_<p>`` and recorded as one table ``name``
    (``table``, see ``partitioned_table``), which a checkpoint restores into any number
    of shards.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_shards: int,
        initializer: Callable,
        dtype=dtypes.float32,
        name: str = "embedding",
    ):
        if num_shards < 1 or vocab_size < num_shards:
            raise ValueError(
                f"embedding {name!r}: need 1 <= num_shards <= vocab_size, "
                f"got {num_shards} shards for {vocab_size} rows"
            )
        self.vocab_size, self.dim, self.num_shards = vocab_size, dim, num_shards
        graph = get_default_graph()
        with graph.name_scope(name) as scope:
            self.shards = [
                Variable(initializer, name=f"shard_{p}", dtype=dtype, shape=(self._rows(p), dim))
                for p in range(num_shards)
            ]
        self.name = scope.rstrip("/")
        self.table = partitioned_table(self.shards, self.name, "mod")

    def _rows(self, shard: int) -> int:
        """How many table rows shard ``shard`` holds (rows shard, shard + n, ...)."""
        return (self.vocab_size - shard + self.num_shards - 1) // self.num_shards

    def lookup(self, ids, name: str = "lookup") -> Tensor:
        """The rows of ``ids``, shaped ``ids.shape + (dim,)`` (at most one unknown dim)."""
        return embedding_lookup(self.shards, ids, name=name)


# The graph collection of the tables kept as row shards (``PartitionedTable``s).
PARTITIONED_TABLES = "partitioned_tables"


@dataclass(frozen=True)
class PartitionedTable:
    """One logical table kept as row shards: its name and full shape in a checkpoint, and
    the slice of it each shard variable holds (``slices[p]`` is ``shards[p]``'s)."""

    name: str
    shape: tuple[int, ...]
    shards: tuple[Variable, ...]
    slices: tuple[TensorSlice, ...]


def partitioned_table(
    shards: Sequence[Variable], name: str, partition_strategy: str = "mod"
) -> PartitionedTable:
    """Record that ``shards`` are the table ``name`` split by rows as ``embedding_lookup``
    routes ``partition_strategy`` (``"mod"``: row ``r`` in shard ``r % n``; ``"div"``:
    consecutive ranges, the first ``N % n`` one row longer), so that a checkpoint saves
    each shard as its slice of the table and restores the table into any other split of
    it (another shard count, or one whole variable named ``name``). ``ShardedEmbedding``
    records its shards this way; call it for shards made by hand."""
    shards = list(shards)
    if not shards:
        raise ValueError(f"partitioned table {name!r}: no shards")
    if partition_strategy not in ("mod", "div"):
        raise ValueError(
            f"partitioned table {name!r}: partition_strategy must be 'mod' or 'div', "
            f"got {partition_strategy!r}"
        )
    graph = shards[0].graph
    for v in shards:
        if not isinstance(v, Variable):
            raise TypeError(f"partitioned table {name!r}: shard {v!r} is not a Variable")
        if v.graph is not graph:
            raise ValueError(f"partitioned table {name!r}: its shards are in different graphs")
    if any(v.name == name for v in shards):
        raise ValueError(f"partitioned table {name!r}: a shard has the table's own name")
    row = _row_shape(shards)
    dtypes_ = {v.dtype for v in shards}
    if len(dtypes_) != 1:
        raise ValueError(
            f"partitioned table {name!r}: shards differ in dtype ({sorted(map(str, dtypes_))})"
        )
    n, sizes = len(shards), [v.shape[0] for v in shards]
    if None in sizes:
        raise ValueError(f"partitioned table {name!r}: every shard's row count must be known")
    total = sum(sizes)
    if total < n:
        raise ValueError(f"partitioned table {name!r}: {total} rows cannot fill {n} shards")
    if partition_strategy == "mod":
        expected = [(total - p + n - 1) // n for p in range(n)]
        offsets, stride = list(range(n)), n
    else:
        per, extras = divmod(total, n)
        expected = [per + (p < extras) for p in range(n)]
        offsets, stride = [sum(expected[:p]) for p in range(n)], 1
    if sizes != expected:
        raise ValueError(
            f"partitioned table {name!r}: {n} {partition_strategy!r} shards of {total} rows "
            f"hold {expected} rows each, the shards have {sizes}"
        )
    for other in graph.get_collection(PARTITIONED_TABLES):
        if other.name == name or {id(v) for v in other.shards} & {id(v) for v in shards}:
            raise ValueError(
                f"partitioned table {name!r}: the graph has table {other.name!r} already, "
                "with that name or some of these shards"
            )
    full = (total, *row)
    table = PartitionedTable(
        name,
        full,
        tuple(shards),
        tuple(TensorSlice(name, full, offset, stride) for offset in offsets),
    )
    graph.add_to_collection(PARTITIONED_TABLES, table)
    return table


def embedding_lookup(
    params: Variable | Tensor | Sequence[Variable | Tensor],
    ids,
    partition_strategy: str = "mod",
    name: str | None = None,
) -> Tensor:
    """Rows ``ids`` of a table given whole or as a list of row shards (TensorFlow's
    ``embedding_lookup``): shaped ``ids.shape + row shape``.

    With ``"mod"`` row ``r`` of an ``n``-shard table is row ``r // n`` of shard ``r % n``
    (``ShardedEmbedding``'s layout); with ``"div"`` the shards hold consecutive ranges,
    the first ``N % n`` one row longer. Each shard's Gather is colocated with the shard,
    so only looked-up rows move, and a Variable shard's gradient is an IndexedSlices of
    those rows. Several shards need the ids' rank and all but one of their dims known.
    """
    shards = list(params) if isinstance(params, (list, tuple)) else [params]
    if not shards:
        raise ValueError("embedding_lookup: params is an empty list")
    if partition_strategy not in ("mod", "div"):
        raise ValueError(
            f"embedding_lookup: partition_strategy must be 'mod' or 'div', "
            f"got {partition_strategy!r}"
        )
    ids = convert_to_tensor(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got {ids.name} of {ids.dtype}")
    n = len(shards)
    graph = ids.graph
    with graph.as_default(), graph.name_scope(name or "embedding_lookup"):
        if n == 1:
            return _gather(shards[0], ids)
        if ids.shape is None or sum(d is None for d in ids.shape) > 1:
            raise ValueError(
                f"embedding ids {ids.name} need a known rank and at most one unknown dim, "
                f"have shape {ids.shape}"
            )
        row = _row_shape(shards)
        flat = ids if len(ids.shape) == 1 else reshape(ids, (-1,))
        if partition_strategy == "mod":
            owner, local = flat % n, flat // n
        else:
            owner, local = _div_route(flat, shards)
        parts = dynamic_partition(local, owner, n)
        positions = dynamic_partition(range_(size(flat)), owner, n)
        rows = dynamic_stitch(positions, [_gather(shards[p], parts[p]) for p in range(n)])
        if len(ids.shape) == 1:
            rows.set_shape((*ids.shape, *row))  # one row per id: the Stitch cannot know it
            return rows
        return reshape(rows, (*ids.shape, *row))


def _row_shape(shards: list) -> tuple[int, ...]:
    """The shape of one row, which every shard must share and know."""
    tails = {None if s.shape is None else tuple(s.shape[1:]) for s in shards}
    if len(tails) != 1 or None in tails or None in next(iter(tails)):
        raise ValueError(
            "embedding_lookup: the shards' rows must have one known shape, have "
            f"{[shapes.fmt(s.shape) for s in shards]}"
        )
    return next(iter(tails))


def _div_route(flat: Tensor, shards: list) -> tuple[Tensor, Tensor]:
    """(shard, row in shard) of each id when shards hold consecutive ranges of rows."""
    sizes = [None if s.shape is None else s.shape[0] for s in shards]
    if None in sizes:
        raise ValueError(
            f"embedding_lookup: 'div' needs every shard's row count, have {sizes}"
        )
    n, total = len(shards), sum(sizes)
    per, extras = divmod(total, n)
    if per == 0:
        raise ValueError(f"embedding_lookup: {total} rows cannot fill {n} shards")
    owner = maximum(flat // (per + 1), (flat - extras) // per)
    early = less(owner, extras)
    local = where(early, flat % (per + 1), (flat - extras) % per)
    return owner, local


def _gather(shard: Variable | Tensor, ids: Tensor) -> Tensor:
    """Rows of one shard, read where the shard lives."""
    anchor = shard.handle if isinstance(shard, Variable) else convert_to_tensor(shard)
    with anchor.graph.colocate_with(anchor):
        return gather(shard, ids)
