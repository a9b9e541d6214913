"""A training task that loses a PS task ends with ``RESTART_JOB_EXIT_CODE`` (75): the
launcher and the operator then restart the whole job, which resumes from its last
checkpoint. Any other failure of the chief loop ends the task with
``CHIEF_LOOP_FAILED_EXIT_CODE``, failing the job rather than leaving workers waiting."""

from __future__ import annotations

import os
import sys

from .cluster import RESTART_JOB_EXIT_CODE
from .device_names import split_task
from .distributed import TaskError

# A chief loop failing while training goes on leaves the workers waiting for updates that
# never come: the chief's process exits with this code instead, failing the job.
CHIEF_LOOP_FAILED_EXIT_CODE = 1

# What a step on a PS task fails with when the task is gone. (One that came back without
# its variables answers FAILED_PRECONDITION, as does a script that never initialized
# them: that is not taken for a loss, or a bug would restart the job over and over; the
# launcher and the operator restart the whole job when a PS task fails anyway.)
_LOST_TASK_CODES = ("UNAVAILABLE",)


def lost_ps(e: BaseException | None):
    """The ``TaskError`` saying a PS task was lost, in ``e`` or its causes, else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TaskError) and _is_ps(e.task):
            if getattr(e.code, "name", None) in _LOST_TASK_CODES:
                return e
        e = e.__cause__ or e.__context__
    return None


def exit_code_for(e: BaseException) -> int:
    return RESTART_JOB_EXIT_CODE if lost_ps(e) is not None else CHIEF_LOOP_FAILED_EXIT_CODE


def say_restart(e: BaseException) -> None:
    lost = lost_ps(e)
    print(
        f"flowmill: lost {lost.task} ({lost.code.name}): {lost}\n"
        f"flowmill: exiting with code {RESTART_JOB_EXIT_CODE} so the whole job restarts from "
        "its last checkpoint",
        file=sys.stderr,
        flush=True,
    )


def _restart_on_lost_ps(previous=None):
    """A ``sys.excepthook`` for training tasks: an uncaught error that is a lost PS ends
    the process with ``RESTART_JOB_EXIT_CODE`` (after the usual traceback)."""

    def hook(kind, value, tb) -> None:
        (previous or sys.__excepthook__)(kind, value, tb)
        if value is not None and lost_ps(value) is not None:
            say_restart(value)
            sys.stdout.flush()
            os._exit(RESTART_JOB_EXIT_CODE)

    hook.flowmill = True
    return hook


def install_restart_hook() -> None:
    """Make a lost PS end this training task with ``RESTART_JOB_EXIT_CODE``."""
    if not getattr(sys.excepthook, "flowmill", False):
        sys.excepthook = _restart_on_lost_ps(sys.excepthook)


def _is_ps(task: str) -> bool:
    try:
        return split_task(task)[0] == "ps"
    except ValueError:
        return False
