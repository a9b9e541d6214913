"""Where a job reaches into what a model script builds, without the script's modules
importing the job's: ``Session()`` asks ``cluster_session`` for the session it stands for,
and ``Optimizer.minimize`` asks ``replicated_minimize`` for the job's training mode.
``flowmill.runtime`` (the package, above every module of it) sets both; each answers None
where the process runs alone, and the script's own objects are used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (graph=None, optimize=True) -> a session for this task of a cluster, or None.
cluster_session: Callable[..., Any] | None = None
# (optimizer, loss, global_step, var_list) -> this worker's train op, or None.
replicated_minimize: Callable[..., Any] | None = None
