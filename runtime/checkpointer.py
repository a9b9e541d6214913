"""A job's checkpoints: restore on start, save every N global steps and at the end.

``Saver`` builds the steps for a graph's shared variables, one shard per task
that holds some (``ps-0``, ``ps-1``; ``local`` when one process holds them all): the save
step starts every shard's upload on its own task and returns, the commit step waits for
them and writes the manifest; the restore step reads every shard on its own task and
assigns it there. Variables that live on a training task (a sync worker's local step) are
that task's own state and are initialized, not restored.

``Checkpointer`` is the policy the job configures (``checkpoint`` in the manifest, given
to every task as ``FLOWMILL_CHECKPOINT_URI``, ``_INTERVAL``, ``_KEEP``); the chief runs it
and the model script never sees it. Saves in sync mode happen in the chief loop between
two updates, so every shard holds the variables of one global step: the checkpoint is
consistent, which the paper's were not. In async and bounded-staleness modes nothing
stops the workers, so a save holds each variable as it was when its own task read it,
labelled with the global step read first (as in the paper).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from . import dtypes
from .checkpoint import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    checkpoints,
    open_store,
)
from .cluster import ENV_CHECKPOINT_INTERVAL, ENV_CHECKPOINT_KEEP, ENV_CHECKPOINT_URI
from .graph import Operation
from .ops.array_ops import group, placeholder
from .ops.checkpoint_ops import commit_checkpoint, restore_shard, save_shard, shard_saved
from .ops.state_ops import Variable, global_variables

LOCAL_SHARD = "local"
TRAINING_JOBS = ("chief", "worker")
DEFAULT_INTERVAL, DEFAULT_KEEP = 100, 5
POLL_S = 0.1


def shard_name(device: str) -> str:
    """The shard of the task a device belongs to: ``/job:ps/task:1/...`` -> ``ps-1``."""
    fields = dict(part.split(":", 1) for part in device.strip("/").split("/") if ":" in part)
    if "job" not in fields:
        return LOCAL_SHARD
    return f"{fields['job']}-{fields.get('task', '0')}"


def _device_of(session, v: Variable) -> str:
    where = getattr(session, "variable_device", None)
    return where(v.op) if where is not None else v.device


class Saver:
    """Save, commit and restore steps for ``var_list`` (default: the graph's variables that
    are not a training task's own) as placed by ``session``, alone or in a job.

    ``snapshot`` takes the values and returns once every upload has started;
    ``commit_step`` waits for them and writes the manifest; ``save`` does both. Restoring
    assigns every variable of a shard, or none when the shard does not match them."""

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
        self.shards: dict[str, list[Variable]] = {}
        self.local: list[Variable] = []  # a training task's own: initialized, never saved
        for v in var_list if var_list is not None else global_variables(graph):
            device = _device_of(session, v)
            job = shard_name(device).rsplit("-", 1)[0]
            if var_list is None and job in TRAINING_JOBS:
                self.local.append(v)
            else:
                self.shards.setdefault(shard_name(device), []).append(v)
        if not self.shards:
            raise CheckpointError(f"nothing to checkpoint to {uri}: the graph has no variables")
        with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None):
            with graph.name_scope("checkpoint"):
                self.step = placeholder(dtypes.int64, (), name="step")
                saves, saved, restores = [], [], []
                for shard, variables in self.shards.items():
                    with graph.colocate_with(variables[0].handle):
                        values = {v.name: v.read_value() for v in variables}
                        saves.append(
                            save_shard(uri, shard, self.step, values, name=f"save_{shard}")
                        )
                        saved.append(shard_saved(uri, shard, self.step, name=f"saved_{shard}"))
                        specs = {v.name: (v.dtype, v.shape) for v in variables}
                        read = restore_shard(uri, shard, self.step, specs, name=f"read_{shard}")
                    restores += [v.assign(t).op for v, t in zip(variables, read, strict=True)]
                self.save_op: Operation = group(*saves, name="save")
                self.commit = commit_checkpoint(
                    uri, self.step, saved, keep, dict(metadata or {}), name="commit"
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
        return int(session.run(self.commit, {self.step: step}))

    def save(self, session, step: int) -> int:
        """Checkpoint the variables at ``step`` and wait until it is committed."""
        self.snapshot(session, step)
        return self.commit_step(session, step)

    def restore(self, session) -> int | None:
        """Load the newest complete checkpoint that reads back intact; its step, or None
        when there is none. A corrupt one is skipped with a warning."""
        store, prefix = open_store(self.uri)
        wanted = set(self.shards)
        for manifest in checkpoints(store, prefix):
            held = {s.name for s in manifest.shards}
            if held != wanted:
                raise CheckpointError(
                    f"checkpoint {manifest.directory} under {self.uri} holds shards "
                    f"{sorted(held)}, this job's variables live in {sorted(wanted)}: it was "
                    "written by a job with other parameter servers (or another model)"
                )
            try:
                session.run(self.restore_op, {self.step: manifest.step})
            except Exception as e:
                if not _is_corrupt(e):
                    raise
                _warn(f"skipping corrupt checkpoint {manifest.directory} under {self.uri}: {e}")
                continue
            return manifest.step
        return None


def _is_corrupt(e: BaseException) -> bool:
    """A shard that does not match its manifest, here or on the task that read it."""
    if isinstance(e, CorruptCheckpointError):
        return True
    code = getattr(e, "code", None)
    return getattr(code, "name", None) == "DATA_LOSS"


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, CheckpointWarning, stacklevel=3)


@dataclass(frozen=True)
class CheckpointConfig:
    uri: str
    interval_steps: int = DEFAULT_INTERVAL
    keep: int = DEFAULT_KEEP

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CheckpointConfig | None:
        """The job's checkpoint settings, or None when it keeps no checkpoints."""
        uri = environ.get(ENV_CHECKPOINT_URI)
        if not uri:
            return None
        values = {}
        for key, env, default in (
            ("interval_steps", ENV_CHECKPOINT_INTERVAL, DEFAULT_INTERVAL),
            ("keep", ENV_CHECKPOINT_KEEP, DEFAULT_KEEP),
        ):
            text = environ.get(env) or str(default)
            try:
                values[key] = int(text)
            except ValueError:
                raise ValueError(f"{env} must be a positive integer, got {text!r}") from None
            if values[key] < 1:
                raise ValueError(f"{env} must be a positive integer, got {text!r}")
        return cls(uri, **values)


class Checkpointer:
    """Restores on start, then saves every ``interval_steps`` global steps and once more
    at the end. The save itself takes the values (fast); waiting for the uploads and
    committing happen on a thread of their own. A save that comes due while the previous
    one is still uploading is skipped, so snapshots never pile up in memory."""

    def __init__(self, session, config: CheckpointConfig, global_step: Variable, saver=None):
        self.session = session
        self.config = config
        self.global_step = global_step
        self.saver = saver or Saver(
            session, config.uri, keep=config.keep, metadata={"saver": "flowmill.Checkpointer"}
        )
        self._read_step = session.make_callable(global_step.value())
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._last_saved: int | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._closed = False
        self._counted: int | None = None

    # ---- start

    def restore(self) -> int | None:
        step = self.saver.restore(self.session)
        if step is not None:
            self._last_saved = step
            _say(f"restored checkpoint step {step} from {self.config.uri}")
        return step

    def poll(self) -> None:
        """Save by watching the global step from a thread (modes without a chief loop)."""
        self._poller = threading.Thread(target=self._poll, name="checkpoint-poll", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.maybe_save()
            except Exception as e:  # noqa: BLE001 - the session closing under us ends it
                if not self._stop.is_set() and not getattr(self.session, "closed", False):
                    _say(f"checkpoint poll stopped: {type(e).__name__}: {e}")
                return

    # ---- saving

    def after_update(self) -> None:
        """Called by the sync chief loop between two updates. Only that loop advances the
        global step in sync mode, so it is read once and then counted here."""
        if self._counted is None:
            self._counted = int(self._read_step())
        else:
            self._counted += 1
        last = self._last_saved if self._last_saved is not None else 0
        if self._counted - last >= self.config.interval_steps:
            self.save(self._counted)

    def maybe_save(self) -> None:
        step = int(self._read_step())
        last = self._last_saved if self._last_saved is not None else 0
        if step - last >= self.config.interval_steps:
            self.save(step)

    def save(self, step: int | None = None, wait: bool = False) -> Future | None:
        """Take a checkpoint at ``step`` (default: the current global step)."""
        with self._lock:
            if step is None:
                step = int(self._read_step())
            if step == self._last_saved:
                return self._pending
            if self._pending is not None and not self._pending.done():
                if not wait:
                    return None  # the previous upload is still running: next time
                self._pending.exception()
            self.saver.snapshot(self.session, step)
            self._last_saved = step
            self._pending = self._committer.submit(self._commit, step)
            if wait:
                self._pending.exception()
            return self._pending

    def _commit(self, step: int) -> int:
        try:
            self.saver.commit_step(self.session, step)
        except Exception as e:
            _say(f"checkpoint step {step} to {self.config.uri} failed: {type(e).__name__}: {e}")
            raise
        from . import telemetry

        telemetry.report_checkpoint(step, self.config.uri)
        _say(f"checkpoint step {step} committed to {self.config.uri}")
        return step

    def close(self) -> None:
        """Stop saving by the clock, take the final checkpoint and wait for it."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=10)
        try:
            self.save(wait=True)
        finally:
            self._committer.shutdown(wait=True)


def _say(message: str) -> None:
    print(f"flowmill: {message}", file=sys.stderr, flush=True)
