"""Sparse embeddings over a table sharded by rows across PS tasks (paper section 4.2).

Row ``r`` of the table lives in shard ``r % n`` at row ``r // n``. A lookup is the paper's
Part, Gather, Stitch: the ids are partitioned by shard, each shard gathers its rows where
the shard lives (the Gather is colocated with the shard's variable, so only the rows looked
up cross the network, never the table), and the rows are stitched back into id order. The
gradient of a shard is an ``IndexedSlices`` of those rows, which the optimizers apply row
by row, so a step costs the same whatever the table's size.
"""

from __future__ import annotations

from collections.abc import Callable

from . import dtypes
from .graph import Tensor, convert_to_tensor, get_default_graph
from .ops.array_ops import dynamic_partition, dynamic_stitch, gather, range_, reshape
from .ops.math_ops import size
from .ops.state_ops import Variable


class ShardedEmbedding:
    """A ``vocab_size`` x ``dim`` table in ``num_shards`` variables.

    ``initializer(shape, dtype)`` makes each shard's initial value (e.g.
    ``flowmill.runtime.initializers.random_normal(stddev=0.05)``); place the shards with a
    device function such as ``replica_device_setter``, which puts one per PS task in turn.
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
        with graph.name_scope(name):
            self.shards = [
                Variable(initializer, name=f"shard_{p}", dtype=dtype, shape=(self._rows(p), dim))
                for p in range(num_shards)
            ]

    def _rows(self, shard: int) -> int:
        """How many table rows shard ``shard`` holds (rows shard, shard + n, ...)."""
        return (self.vocab_size - shard + self.num_shards - 1) // self.num_shards

    def lookup(self, ids, name: str = "lookup") -> Tensor:
        """The rows of ``ids``, shaped ``ids.shape + (dim,)`` (at most one unknown dim)."""
        ids = convert_to_tensor(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"embedding ids must be integers, got {ids.name} of {ids.dtype}")
        if ids.shape is None or sum(d is None for d in ids.shape) > 1:
            raise ValueError(
                f"embedding ids {ids.name} need a known rank and at most one unknown dim, "
                f"have shape {ids.shape}"
            )
        n = self.num_shards
        with ids.graph.name_scope(name):
            flat = ids if len(ids.shape) == 1 else reshape(ids, (-1,))
            if n == 1:
                rows = self._gather(0, flat)
            else:
                owner = flat % n
                local = dynamic_partition(flat // n, owner, n)
                positions = dynamic_partition(range_(size(flat)), owner, n)
                rows = dynamic_stitch(positions, [self._gather(p, local[p]) for p in range(n)])
            if len(ids.shape) == 1:
                return rows
            return reshape(rows, (*ids.shape, self.dim))

    def _gather(self, shard: int, ids: Tensor) -> Tensor:
        variable = self.shards[shard]
        with variable.graph.colocate_with(variable.handle):
            return gather(variable, ids)
