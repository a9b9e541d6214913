"""A stalled job, and the tasks that hold it up: decided by pure functions, which the
operator and the local launcher both call with what the tasks serve on ``/progress``.

Every training task reports how long ago its last step ended (``sinceStepSeconds``, on
its own clock) and its median step time (``stepSeconds``); every PS task reports the
state of the sync accumulators and the staleness clock it keeps
(``flowmill.runtime.server_stats``). A task is *quiet* once it has made no step for the
stall timeout: ``spec.runPolicy.stallTimeoutSeconds``, or by default ``DEFAULT_FACTOR``
times the slowest task's median step, at least ``DEFAULT_FLOOR_S`` (a checkpoint save or
a restore is no step either: the floor leaves them time). Who holds a job up:

- **sync**, when every task is quiet (each waits for the step's update) and the PS tasks'
  accumulators have waited for the pending step for the timeout too (a task's report is
  up to a poll old; the accumulators say when the job last moved): the workers missing
  from the pending step's contributors; when enough of them contributed, the chief, whose
  loop did not apply the update. Where the PS tasks cannot be read, nobody is named: a
  guess would restart a healthy task.
- **bounded-staleness**: the quiet tasks with the fewest finished steps on the staleness
  clock (the others wait for them at the clock, quiet too, but not the cause).
- **async**, and any quiet task while others still step: the quiet task itself; nothing
  else waits for it.

Before its first step a task is given at least ``FIRST_STEP_S`` (and at least the
timeout), as a startup probe would be: it imports, builds its graph and may restore a
checkpoint, which a short stall timeout meant for steps would cut short, restarting it
again and again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_FACTOR = 20
DEFAULT_FLOOR_S = 120.0
FIRST_STEP_S = 120.0


@dataclass(frozen=True)
class TaskProgress:
    """One running training task as far as stalls go."""

    role: str
    index: int
    running_s: float  # how long its current process (pod) has run
    snapshot: Mapping[str, Any] | None  # its /progress, None when it could not be read
    age_s: float = 0.0  # seconds since the snapshot was read

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def _since(self) -> float | None:
        """Seconds from its last step to the reading, as it said (None: no step yet)."""
        return _seconds((self.snapshot or {}).get("sinceStepSeconds"))

    @property
    def quiet_s(self) -> float:
        """Seconds since its last step; before its first (or unread), since it started."""
        since = self._since
        return self.running_s if since is None else since + self.age_s

    @property
    def stepped(self) -> bool:
        return self._since is not None

    def is_quiet(self, timeout: float) -> bool:
        """No step for ``timeout`` seconds (before its first: for ``FIRST_STEP_S`` or the
        timeout, whichever is longer)."""
        allowance = timeout if self.stepped else max(timeout, FIRST_STEP_S)
        return self.quiet_s >= allowance

    def stepped_within(self, seconds: float) -> bool:
        """Whether it has made a step in the last ``seconds`` (a task that just started
        and made none yet has not)."""
        since = self._since
        return since is not None and since + self.age_s < seconds


@dataclass(frozen=True)
class Stalled:
    """A task to restart: its role, index and why (for the Event and the log line)."""

    role: str
    index: int
    reason: str

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def stall_timeout(configured: int | None, tasks: Sequence[TaskProgress]) -> float:
    """The seconds without a step that make a task quiet."""
    if configured is not None:
        return float(configured)
    medians = [_seconds((t.snapshot or {}).get("stepSeconds")) for t in tasks]
    slowest = max((m for m in medians if m is not None), default=0.0)
    return max(DEFAULT_FLOOR_S, DEFAULT_FACTOR * slowest)


def describe_timeout(configured: int | None, timeout: float) -> str:
    if configured is not None:
        return f"spec.runPolicy.stallTimeoutSeconds {configured}"
    return (f"the default stall timeout of {timeout:.0f}s ({DEFAULT_FACTOR}x the median step, "
            f"at least {DEFAULT_FLOOR_S:.0f}s)")


def quiet_tasks(tasks: Sequence[TaskProgress], timeout: float) -> list[TaskProgress]:
    return [t for t in tasks if t.is_quiet(timeout)]


def holders(mode: str, replicas: Sequence[tuple[str, int]], tasks: Sequence[TaskProgress],
            coordination: Sequence[Mapping[str, Any] | None], timeout: float,
            backup_workers: int = 0) -> list[Stalled]:
    """The tasks holding the job up, to restart.

    ``replicas`` are the training tasks in worker-replica order (the chief first; the
    accumulators and the clock count workers by it); ``tasks`` those running now;
    ``coordination`` the PS tasks' snapshots (None for one not read), needed only when
    the job is sync or bounded-staleness and something is quiet.
    """
    quiet = quiet_tasks(tasks, timeout)
    if not quiet:
        return []
    stepping = any(t.stepped_within(timeout) for t in tasks)
    if mode == "sync" and not stepping:
        return _sync_holders(replicas, tasks, coordination, timeout, backup_workers)
    if mode == "bounded-staleness":
        return _staleness_holders(replicas, quiet, coordination, timeout)
    return [Stalled(t.role, t.index, f"made no step for {t.quiet_s:.0f}s") for t in quiet]


def _sync_holders(replicas, tasks, coordination, timeout, backup_workers) -> list[Stalled]:
    states = [c["sync"] for c in coordination
              if isinstance(c, Mapping) and isinstance(c.get("sync"), Mapping)]
    if not states or len(states) < len(coordination):
        return []
    step = min(s.get("step", 0) for s in states)
    # The PS tasks say when the job last moved: a step that became the pending one less
    # than the timeout ago is no stall, whatever a task's older report says.
    waited = [_seconds(s.get("waitedSeconds")) for s in states if s.get("step") == step]
    if any(w is not None and w < timeout for w in waited):
        return []
    contributed: set[int] | None = None
    for s in states:
        if s.get("step") == step:
            workers = {w for w in s.get("workers") or () if isinstance(w, int)}
            contributed = workers if contributed is None else contributed & workers
    contributed = contributed or set()
    needed = max(1, len(replicas) - max(0, backup_workers))
    running = {(t.role, t.index): t for t in tasks}
    if len(contributed) >= needed:
        chief = running.get(replicas[0])
        if chief is None or not chief.is_quiet(timeout):
            return []
        return [Stalled(chief.role, chief.index,
                        f"the gradients of step {step} are in ({len(contributed)} of "
                        f"{needed} needed) but the chief did not apply them for "
                        f"{chief.quiet_s:.0f}s")]
    out = []
    for i, key in enumerate(replicas):
        t = running.get(key)
        if i in contributed or t is None or not t.is_quiet(timeout):
            continue
        out.append(Stalled(t.role, t.index,
                           f"sent no gradients for step {step} for {t.quiet_s:.0f}s while "
                           f"the job waits for them ({len(contributed)} of {needed} needed "
                           f"are in)"))
    return out


def _staleness_holders(replicas, quiet, coordination, timeout) -> list[Stalled]:
    clocks = next((c["staleness"].get("finished") for c in coordination
                   if isinstance(c, Mapping) and isinstance(c.get("staleness"), Mapping)),
                  None)
    order = {key: i for i, key in enumerate(replicas)}
    if isinstance(clocks, list) and len(clocks) == len(replicas):
        finished = {t.name: clocks[order[(t.role, t.index)]] for t in quiet
                    if (t.role, t.index) in order}
        lowest = min(clocks)
        what = "finished steps on the staleness clock"
    else:  # the clock could not be read: the tasks' own counts
        finished = {t.name: (t.snapshot or {}).get("step", 0) for t in quiet}
        lowest = min(finished.values(), default=0)
        what = "steps"
    return [Stalled(t.role, t.index,
                    f"made no step for {t.quiet_s:.0f}s with {lowest} {what}, the fewest: "
                    f"the other workers wait for it")
            for t in quiet if finished.get(t.name) == lowest]


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return float(value)
