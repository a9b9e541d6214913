"""The graph-level saver: save, commit and restore steps for a graph's shared variables.

``Saver`` builds them, one shard per task that holds some (``ps-0``, ``ps-1``; ``local``
when one process holds them all): the save step starts every shard's upload on its own
task and returns, the commit step waits for them and writes the manifest; the restore step
reads, on each task, the checkpoint shards that hold that task's variables (found by
name, so a checkpoint written with other parameter servers, or in one process, restores
into this layout) and assigns them there. No variable bytes cross the network between
tasks on either path. Variables that live on a training task are that task's own state
and are initialized, not restored; so are local variables (``LOCAL_VARIABLES``: a sync
worker's local step), wherever they live. The format and the storage are
``flowmill.kernels.checkpoint_store``'s; when a job saves is ``checkpoint_policy``'s.

The shards of a table kept as row shards (``embedding.partitioned_table``, which
``ShardedEmbedding`` uses), and the state an optimizer keeps with each shard (its slots,
named under the shard and shaped like it), are saved with the slice of the full table
each holds. A job that splits the table another way (more or fewer shards, or one whole
variable named as the table) restores it row by row: each task reads the saved slices
that hold its shards' rows. ``list_variables`` shows such a table whole, under its own
name, and ``load_variable`` assembles it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flowmill.kernels.checkpoint import (
    Wanted,
    assemble,
    logical_variables,
    plan_restore,
)
from flowmill.kernels.checkpoint_store import (
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    TensorSlice,
    latest,
    load_manifest,
    mark_verified,
    open_store,
    read_shard,
    restore_newest,
)

from . import dtypes
from .cluster import TRAINING_ROLES
from .device_names import parse_device
from .embedding import PARTITIONED_TABLES
from .graph import Graph, Operation
from .hooks import resume_at_step
from .ops.array_ops import group, placeholder
from .ops.checkpoint_ops import commit_checkpoint, restore_shard, save_shard, shard_saved
from .ops.state_ops import Variable, global_variables, local_variables

LOCAL_SHARD = "local"
DEFAULT_KEEP = 5


def shard_name(device: str) -> str:
    """The shard of the task a device belongs to: ``/job:ps/task:1/...`` -> ``ps-1``."""
    fields = parse_device(device)
    if "job" not in fields:
        return LOCAL_SHARD
    return f"{fields['job']}-{fields.get('task', '0')}"


class Saver:
    """Save, commit and restore steps for ``var_list`` (default: the graph's variables that
    are not a training task's own) as placed by ``session``, alone or in a job.

    ``snapshot`` takes the values and returns once every upload has started;
    ``commit_step`` waits for them and writes the manifest; ``save`` does both. Restoring
    assigns every variable of a shard, or none when the shard does not match them, and the
    checkpoint restored from is never pruned by this saver's commits."""

    def __init__(
        self,
        session,
        uri: str,
        var_list: Sequence[Variable] | None = None,
        keep: int = DEFAULT_KEEP,
        metadata: Mapping | None = None,
    ):
        open_store(uri)  # a malformed URI fails before anything is built
        graph = session.graph
        self.uri = uri
        self.restored_step: int | None = None
        self.shards: dict[str, list[Variable]] = {}
        self.local: list[Variable] = []  # a training task's own: initialized, never saved
        own = {id(v) for v in local_variables(graph)}
        for v in var_list if var_list is not None else global_variables(graph):
            device = session.variable_device(v.op)
            job = shard_name(device).rsplit("-", 1)[0]
            if var_list is None and (job in TRAINING_ROLES or id(v) in own):
                self.local.append(v)
            else:
                self.shards.setdefault(shard_name(device), []).append(v)
        if not self.shards:
            raise CheckpointError(f"nothing to checkpoint to {uri}: the graph has no variables")
        self.slices = saved_slices(graph, self.variables)
        with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None):
            with graph.name_scope("checkpoint"):
                self.step = placeholder(dtypes.int64, (), name="step")
                self.restored = placeholder(dtypes.int64, (), name="restored")
                saves, saved, restores = [], [], []
                for shard, variables in self.shards.items():
                    slices = {v.name: self.slices[v.name] for v in variables
                              if v.name in self.slices}
                    with graph.colocate_with(variables[0].handle):
                        values = {v.name: v.read_value() for v in variables}
                        saves.append(save_shard(
                            uri, shard, self.step, values, name=f"save_{shard}", slices=slices
                        ))
                        saved.append(shard_saved(uri, shard, self.step, name=f"saved_{shard}"))
                        specs = {v.name: (v.dtype, v.shape) for v in variables}
                        read = restore_shard(
                            uri, shard, self.step, specs, name=f"read_{shard}", slices=slices
                        )
                    restores += [v.assign(t).op for v, t in zip(variables, read, strict=True)]
                self.save_op: Operation = group(*saves, name="save")
                self.commit = commit_checkpoint(
                    uri, self.step, saved, keep, dict(metadata or {}), name="commit",
                    restored=self.restored,
                )
                self.restore_op: Operation = group(*restores, name="restore")

    @property
    def variables(self) -> list[Variable]:
        return [v for vs in self.shards.values() for v in vs]

    def snapshot(self, session, step: int) -> None:
        """Start every shard's upload at ``step``; returns once the values are taken."""
        session.run(self.save_op, {self.step: step})

    def commit_step(self, session, step: int) -> int:
        """Wait for the uploads of ``step`` and write its manifest."""
        restored = -1 if self.restored_step is None else self.restored_step
        return int(session.run(self.commit, {self.step: step, self.restored: restored}))

    def save(self, session, step: int) -> int:
        """Checkpoint the variables at ``step`` and wait until it is committed."""
        self.snapshot(session, step)
        return self.commit_step(session, step)

    def restore(self, session, start_fresh: bool = False) -> int | None:
        """Load the newest complete checkpoint that reads back intact; its step, or None
        when there is none. A damaged one is quarantined with a warning and the one before
        is tried; when every checkpoint is damaged this raises ``NoUsableCheckpointError``
        naming them, unless ``start_fresh`` (a warning, and None). What the graph resumes
        by step (an input pipeline's position) is put at the restored step too."""
        store, prefix = open_store(self.uri)
        found = restore_newest(
            store,
            prefix,
            lambda manifest: self._load(session, manifest),
            start_fresh=start_fresh,
            where=self.uri,
        )
        if found is None:
            return None
        manifest = found[0]
        mark_verified(store, manifest)  # every shard was read and its CRC32C checked
        self.restored_step = manifest.step
        resume_at_step(session, manifest.step)
        return manifest.step

    def _load(self, session, manifest: Manifest) -> None:
        """Assign the checkpoint's shards on their tasks; ``CorruptCheckpointError`` when a
        task found its shard damaged. Every variable is first found in the manifest (by
        name, or as rows of a table's saved slices) and its shape checked, so a checkpoint
        that does not fit assigns nothing anywhere."""
        plan_restore(
            manifest,
            [Wanted(v.name, v.dtype, v.shape, self.slices.get(v.name)) for v in self.variables],
        )
        try:
            session.run(self.restore_op, {self.step: manifest.step})
        except CorruptCheckpointError:
            raise
        except Exception as e:
            if not _lost_data(e):
                raise
            raise CorruptCheckpointError(manifest.directory, str(e)) from e


def _lost_data(e: BaseException) -> bool:
    """A task that read its shard found it not matching the manifest (gRPC DATA_LOSS)."""
    code = getattr(e, "code", None)
    return getattr(code, "name", None) == "DATA_LOSS"


# ---- reading a checkpoint without a graph (TensorFlow's tf.train.list_variables)


def _manifest(uri: str, step: int | None) -> Manifest:
    store, prefix = open_store(uri)
    if step is not None:
        return load_manifest(store, prefix, step)
    manifest = latest(store, prefix)
    if manifest is None:
        raise CheckpointError(f"no complete checkpoint under {uri}")
    return manifest


def list_variables(
    uri: str, step: int | None = None, slices: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every variable in the newest checkpoint under ``uri`` (or the
    one of ``step``), sorted by name, whichever shard holds it. A table saved as row shards
    is listed whole, once, under its own name and full shape (as TensorFlow lists a
    partitioned variable); with ``slices`` every tensor is listed as stored instead, a
    table's shards under their own names and shapes."""
    manifest = _manifest(uri, step)
    if slices:
        return sorted((t.name, tuple(t.shape)) for s in manifest.shards for t in s.tensors)
    return sorted((name, shape) for name, (_, shape) in logical_variables(manifest).items())


def load_variable(uri: str, name: str, step: int | None = None) -> np.ndarray:
    """The value of variable ``name`` in the newest checkpoint under ``uri`` (or the one of
    ``step``), as a NumPy array; each shard it is read from is read whole and its CRC32C
    checked. ``name`` may be a table saved as row shards (its rows are put together in
    order) or one of its shards as stored."""
    manifest = _manifest(uri, step)
    (plan,) = plan_restore(manifest, [Wanted(name, None, None)])
    store, _ = open_store(uri)
    (value,) = assemble([plan], lambda shard: read_shard(store, manifest, shard))
    return value


def saved_slices(graph: Graph, variables: Sequence[Variable]) -> dict[str, TensorSlice]:
    """Variable name -> the slice of a larger table it holds, for those of ``variables``
    that hold one: the shards of the graph's partitioned tables, and the state kept with
    a shard, named under it and shaped like it (an optimizer's slots), whose rows follow
    the shard's rows (the slot ``emb/shard_0/Adagrad`` of ``emb``'s shard 0 is shard 0 of
    the table ``emb/Adagrad``). A table's name that is also a saved variable's is refused:
    a checkpoint could not tell them apart."""
    by_op: dict[str, tuple[Variable, TensorSlice]] = {}
    for table in graph.get_collection(PARTITIONED_TABLES):
        for v, s in zip(table.shards, table.slices, strict=True):
            by_op[v.op.name] = (v, s)
    found: dict[str, TensorSlice] = {}
    for v in variables:
        if v.op.name in by_op:
            found[v.name] = by_op[v.op.name][1]
            continue
        owner = by_op.get(v.op.colocation[0]) if v.op.colocation else None
        if owner is None:
            continue
        shard, s = owner
        if v.name.startswith(shard.name + "/") and tuple(v.shape or ()) == tuple(shard.shape):
            found[v.name] = TensorSlice(
                s.full_name + v.name[len(shard.name) :], s.full_shape, s.offset, s.stride
            )
    tables = {s.full_name for s in found.values()}
    clash = sorted(tables & {v.name for v in variables if v.name not in found})
    if clash:
        raise CheckpointError(
            f"variable {clash[0]!r} has the name of a table saved as row shards; rename "
            "one of them"
        )
    return found
