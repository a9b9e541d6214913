"""How many threads a task's math libraries get: a share of the cores, never all of them
in every task.

OpenBLAS and OpenMP start one thread per core of the machine by default. Three tasks of a
local job on two cores then spin six BLAS threads against each other, and a container
limited to 2 CPUs on a 64-core node starts 64: a step costs many times the work (a sync
MLP step of ``bench/distributed_step.py`` took 49.5 ms against 8.5 ms with one thread
each, on two cores).

The local launcher divides the cores it may use among the tasks it starts (``divide``);
a task on a cluster takes its container's CPU limit, read from its cgroup
(``cpu_limit``), not the node's core count (``apply_in_task``). Either way the count goes
into ``THREAD_VARS`` for the libraries that load later and, for BLAS libraries already
loaded, through ``threadpoolctl``. Where the manifest or the environment sets any of
``THREAD_VARS``, that is what the task gets.

Nothing here imports NumPy: a task applies its count before the libraries load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def explicit(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """The first of ``THREAD_VARS`` set to a positive count: (name, count); else None."""
    for name in THREAD_VARS:
        value = environ.get(name, "").strip()
        if value:
            try:
                count = int(value)
            except ValueError:
                continue
            if count > 0:
                return name, count
    return None


def cpu_limit(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
              ) -> float | None:
    """The CPU limit of this process's cgroup and its ancestors (the smallest), in cores;
    None when there is none. cgroup v2's ``cpu.max``, or v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``."""
    limits = [q for d in _cgroup_dirs(root, proc_cgroup) if (q := _quota(d)) is not None]
    return min(limits) if limits else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """Every cgroup directory whose CPU limit applies to this process, innermost first."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    dirs = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: one hierarchy
            bases = [root]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            names = dict.fromkeys((controllers, "cpu,cpuacct", "cpu"))
            bases = [root / name for name in names if (root / name).is_dir()]
        else:
            continue
        for base in bases:
            here = base / path.lstrip("/")
            while True:
                dirs.append(here)
                if here == base or base not in here.parents:
                    break
                here = here.parent
    dirs.append(root)  # inside a container's cgroup namespace its cgroup is the root
    return dirs


def _quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores(limit: float | None = None) -> int:
    """The cores this process may run on, capped by its CPU limit (rounded up): at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    if limit is None:
        limit = cpu_limit()
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def divide(cores: int, tasks: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Threads per task of a job sharing ``cores``: the cores go to the tasks that compute
    (workers, a chief, an evaluator), evenly; a PS task gets one, as its work is applying
    updates (elementwise, not BLAS) and answering pulls."""
    compute = [t for t in tasks if t[0] != "ps"]
    each = max(1, cores // max(1, len(compute)))
    return {t: (1 if t[0] == "ps" else each) for t in tasks}


def set_count(environ: MutableMapping[str, str], count: int) -> None:
    for name in THREAD_VARS:
        environ[name] = str(count)


def apply_in_task(environ: MutableMapping[str, str] = os.environ) -> int:
    """In a task: the count the environment sets, else the cores its CPU limit allows,
    into ``THREAD_VARS`` and every BLAS/OpenMP pool already loaded. Returns the count."""
    given = explicit(environ)
    count = given[1] if given is not None else usable_cores()
    if given is None:
        set_count(environ, count)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency; libraries not loaded yet obey the env
        return count
    threadpool_limits(count)
    return count
