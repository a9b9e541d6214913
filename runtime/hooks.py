"""Where a job reaches into what a model script builds, without the script's modules
importing the job's: ``Session()`` asks ``cluster_session`` for the session it stands for,
and ``Optimizer.minimize`` asks ``replicated_minimize`` for the job's training mode.
``flowmill.runtime`` (the package, above every module of it) sets both; each answers None
where the process runs alone, and the script's own objects are used.

The other way round, a script's graph lists in its ``RESUME_AT_STEP`` collection what
must be put back where the job stood when a task starts from a global step (an input
pipeline's position); ``Saver.restore`` and ``initialize_or_wait`` call ``resume_at_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (graph=None, optimize=True) -> a session for this task of a cluster, or None.
cluster_session: Callable[..., Any] | None = None
# (optimizer, loss, global_step, var_list) -> this worker's train op, or None.
replicated_minimize: Callable[..., Any] | None = None

# Graph collection of callables (session, global_step) -> None.
RESUME_AT_STEP = "resume_at_step"


def resume_at_step(session, global_step: int) -> None:
    """Put what the session's graph registered where the job stood at ``global_step``."""
    for resume in session.graph.get_collection(RESUME_AT_STEP):
        resume(session, int(global_step))
