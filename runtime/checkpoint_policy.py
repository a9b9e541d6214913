"""A job's checkpoint policy: restore on start, save every N global steps and at the end.

``Checkpointer`` is the policy the job configures (``checkpoint`` in the manifest, given
to every task as ``FLOWMILL_CHECKPOINT_URI``, ``_INTERVAL``, ``_KEEP``, ``_ON_CORRUPT``);
the chief runs it and the model script never sees it. A job whose every checkpoint is
damaged fails naming them rather than quietly training again from step 0, unless
``onCorrupt: StartFresh`` says starting over is acceptable. Saves in sync mode happen in
the chief loop between two updates, so every shard holds the variables of one global
step: the checkpoint is consistent, which the paper's were not. In async and
bounded-staleness modes nothing stops the workers, so a save holds each variable as it
was when its own task read it, labelled with the global step read first (as in the
paper). The steps it runs are ``saver.Saver``'s.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from flowmill.kernels.checkpoint_store import NoUsableCheckpointError

from . import telemetry
from .cluster import (
    CHECKPOINT_ON_CORRUPT,
    ENV_CHECKPOINT_INTERVAL,
    ENV_CHECKPOINT_KEEP,
    ENV_CHECKPOINT_ON_CORRUPT,
    ENV_CHECKPOINT_URI,
)
from .ops.state_ops import Variable
from .saver import DEFAULT_KEEP, Saver

DEFAULT_INTERVAL = 100
POLL_S = 0.1
FAIL, START_FRESH = CHECKPOINT_ON_CORRUPT


@dataclass(frozen=True)
class CheckpointConfig:
    uri: str
    interval_steps: int = DEFAULT_INTERVAL
    keep: int = DEFAULT_KEEP
    on_corrupt: str = FAIL  # when every checkpoint is damaged: FAIL or START_FRESH

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
        on_corrupt = environ.get(ENV_CHECKPOINT_ON_CORRUPT) or FAIL
        if on_corrupt not in CHECKPOINT_ON_CORRUPT:
            raise ValueError(
                f"{ENV_CHECKPOINT_ON_CORRUPT} must be one of {', '.join(CHECKPOINT_ON_CORRUPT)}, "
                f"got {on_corrupt!r}"
            )
        return cls(uri, **values, on_corrupt=on_corrupt)


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
        """Restore the newest intact checkpoint; its step, or None for a fresh start."""
        try:
            fresh = self.config.on_corrupt == START_FRESH
            step = self.saver.restore(self.session, start_fresh=fresh)
        except NoUsableCheckpointError as e:
            hint = (
                f"Delete or repair them, or set spec.checkpoint.onCorrupt: {START_FRESH} "
                f"({ENV_CHECKPOINT_ON_CORRUPT}={START_FRESH}) to train from step 0 instead"
            )
            raise NoUsableCheckpointError(e.where, e.damaged, hint) from None
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
