"""How a training task ends when the job goes on without it, and the code it ends with.

- A task that loses a PS task ends with ``RESTART_JOB_EXIT_CODE`` (75): the launcher and
  the operator restart the whole job, which resumes from its last checkpoint.
- A task asked to stop (SIGTERM) raises ``Preempted`` in its main thread: the step under
  way is abandoned, the script's ``with Session()`` closes the session (on the chief that
  commits a checkpoint of the step reached), and the task exits ``PREEMPTED_EXIT_CODE``
  (143), which restarts it without counting against the job's backoff limit.
- Any other failure of the chief loop ends the task with ``CHIEF_LOOP_FAILED_EXIT_CODE``,
  failing the job rather than leaving workers waiting.

Either way the task says so in a line or two; the traceback of a lost PS (gRPC's nested
errors) is printed only with ``FLOWMILL_DEBUG`` set. Any other step failing on another task
ends the script as Python ends it (code 1) with a short error: the traceback of the
script's own call and the ``TaskError`` naming the task, the op and the remote message,
without the errors chained under it (the local step's abort, gRPC's nested errors), which
only ``FLOWMILL_DEBUG`` prints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from .cluster import PREEMPTED_EXIT_CODE, RESTART_JOB_EXIT_CODE
from .device_names import split_task
from .task_errors import TaskError

# A chief loop failing while training goes on leaves the workers waiting for updates that
# never come: the chief's process exits with this code instead, failing the job.
CHIEF_LOOP_FAILED_EXIT_CODE = 1

# What a step on a PS task fails with when the task is gone. (One that came back without
# its variables answers FAILED_PRECONDITION, as does a script that never initialized
# them: that is not taken for a loss, or a bug would restart the job over and over; the
# launcher and the operator restart the whole job when a PS task fails anyway.)
_LOST_TASK_CODES = ("UNAVAILABLE",)
DEBUG_ENV = "FLOWMILL_DEBUG"  # set: print the tracebacks of a task's end in full


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


class Preempted(BaseException):
    """This task was asked to stop (SIGTERM). A ``BaseException``, as ``KeyboardInterrupt``
    is, so that a script's ``except Exception`` does not swallow it."""


def _exit_hook(previous, on_preempted: Callable[[], None]):
    """A ``sys.excepthook`` for training tasks: an uncaught lost PS or ``Preempted`` ends
    the process with its code, after ``on_preempted`` closed what is still open; any
    other ``TaskError`` is printed without its causes unless ``FLOWMILL_DEBUG`` is set."""

    def hook(kind, value, tb) -> None:
        if isinstance(value, Preempted):
            try:
                on_preempted()
            finally:
                print(f"flowmill: {value}; exiting with code {PREEMPTED_EXIT_CODE}",
                      file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(PREEMPTED_EXIT_CODE)
        if value is not None and lost_ps(value) is not None:
            if os.environ.get(DEBUG_ENV):
                (previous or sys.__excepthook__)(kind, value, tb)
            say_restart(value)
            sys.stdout.flush()
            os._exit(RESTART_JOB_EXIT_CODE)
        if os.environ.get(DEBUG_ENV):
            (previous or sys.__excepthook__)(kind, value, tb)
        else:
            with _task_errors_cut_short(value):
                (previous or sys.__excepthook__)(kind, value, tb)

    hook.flowmill = True
    return hook


def print_short(e: BaseException) -> None:
    """Print ``e``'s traceback as a task's end shows it: a ``TaskError`` in its chain
    without what it was chained to (gRPC's nested errors), unless ``FLOWMILL_DEBUG``."""
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(e, file=sys.stderr)
        return
    with _task_errors_cut_short(e):
        traceback.print_exception(e, file=sys.stderr)


@contextlib.contextmanager
def _task_errors_cut_short(e: BaseException | None):
    """While in it, the ``TaskError`` in the chain of ``e`` that Python prints (``e`` itself,
    or an error ``e`` was raised from) has no causes, so that a hook shows it as one line
    after the traceback of the call that raised it: its message already
    says what failed where, and what it was chained to (the local step aborted because of
    it, whose own causes hold gRPC's nested errors) says nothing more to the user. A
    script's own error raised from a ``TaskError`` keeps its traceback and the
    ``TaskError``'s. The chain is cut only while the hooks print it (a script's earlier
    hook too gets it so) and put back after."""
    seen = set()
    while e is not None and id(e) not in seen:  # the chain Python prints
        seen.add(id(e))
        if isinstance(e, TaskError):
            break
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    else:
        yield
        return
    cause, context, suppress = e.__cause__, e.__context__, e.__suppress_context__
    e.__cause__, e.__context__, e.__suppress_context__ = None, None, True
    try:
        yield
    finally:
        e.__cause__, e.__context__ = cause, context
        e.__suppress_context__ = suppress  # after: setting __cause__ sets it


def install_exit_hooks(on_preempted: Callable[[], None] = lambda: None) -> None:
    """Make a lost PS end this training task with ``RESTART_JOB_EXIT_CODE``, and SIGTERM
    with ``PREEMPTED_EXIT_CODE`` once ``on_preempted`` (closing the task's sessions, which
    takes the chief's checkpoint) has run. SIGTERM is only taken over where the process
    left it at its default: a script with a handler of its own keeps it."""
    if not getattr(sys.excepthook, "flowmill", False):
        sys.excepthook = _exit_hook(sys.excepthook, on_preempted)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    """Once: later SIGTERMs must not cut the checkpoint the first one started short."""
    signal.signal(signal.SIGTERM, _ignore_again)
    raise Preempted(f"{signal.Signals(signum).name} received: stopping this task")


def _ignore_again(signum, frame) -> None:
    print(f"flowmill: {signal.Signals(signum).name} again: still stopping", file=sys.stderr,
          flush=True)


def _is_ps(task: str) -> bool:
    try:
        return split_task(task)[0] == "ps"
    except ValueError:
        return False
