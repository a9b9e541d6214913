"""Starting training together: initialize or restore on the chief, wait elsewhere, then
start the training mode and the job's checkpoint policy (TensorFlow 1.x's
``SessionManager.prepare_session`` / ``wait_for_session``, for a script that does not
know whether it runs alone or as a task).

Where the job keeps checkpoints (``checkpoint`` in the manifest, ``FLOWMILL_CHECKPOINT_*``
in the environment), ``initialize_or_wait`` on the chief restores the newest complete
checkpoint instead of initializing, and saves every ``intervalSteps`` global steps and
when its session closes (``checkpoint_policy``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence

from flowmill.kernels.checkpoint_store import latest, open_store
from flowmill.kernels.resources import UninitializedError

from .checkpoint_policy import CheckpointConfig, Checkpointer
from .cluster import RESTART_JOB_EXIT_CODE
from .graph import Operation
from .hooks import resume_at_step
from .job import steps_are_shared
from .ops.array_ops import group
from .ops.state_ops import global_variables, local_variables
from .optimizers import get_global_step
from .replicas import ReplicatedTraining
from .task_errors import TaskError
from .task_exit import exit_code_for, print_short, say_restart
from .task_server import exiting
from .training_mode import REPLICAS_COLLECTION


def initialize_or_wait(
    session,
    init_op: Operation,
    var_list: Sequence | None = None,
    timeout: float = 300.0,
    poll_interval: float = 0.2,
) -> int:
    """Run ``init_op`` alone or on the chief; on any other training task, wait until the
    chief has initialized the shared variables, then initialize the variables that live
    on this task (a training mode's per-worker state), which no other task can reach.

    Where the job keeps checkpoints (``FLOWMILL_CHECKPOINT_URI``), the chief restores the
    newest complete one instead, if there is one, and from then on saves every interval
    and when the session closes. A chief that finds the shared variables initialized
    already (it was restarted; the PS tasks kept them) rejoins instead: it restores and
    initializes nothing but its own variables, and returns the job's current step.

    Then the training mode (``minimize``) gets going: each worker replica starts at the
    current global step, and the chief starts the mode's chief loop in a thread (it ends
    with the session or the process). ``var_list`` (default: the graph's global
    variables) are the variables to wait for.

    Returns the global step this task starts from (``steps_done`` turns it into the
    task's own step count): 0 on a fresh start, the restored step after a restart. In
    async and bounded-staleness modes the other workers may already be training when a
    task gets here, so it is the step of the checkpoint the job resumed from, not the
    current one. What the graph resumes by step (``hooks.RESUME_AT_STEP``: a one-shot
    iterator's position) is put at that step before this returns.
    """
    chief = session.is_chief
    variables = list(var_list) if var_list is not None else global_variables(session.graph)
    shared, local = _split_by_owner(session, variables)
    checkpointer = _checkpointer(session) if chief else None
    restored = None
    # A chief that comes back into a running job (its process restarted, the PS tasks
    # kept the variables) rejoins it: restoring or initializing would throw away every
    # update since, and the other workers' progress with them.
    rejoined = chief and bool(shared) and _all_initialized(session, shared)
    if chief and not rejoined:
        restored = checkpointer.restore() if checkpointer is not None else None
        if restored is None:
            session.run(init_op)
        elif checkpointer.saver.local:
            session.run(group(*[v.initializer for v in checkpointer.saver.local]))
    else:
        if shared and not chief:
            _wait_initialized(session, shared, timeout, poll_interval)
        if local:
            session.run(group(*[v.initializer for v in local], name="init_local"))
    start = _start_step(session, chief, restored)
    resume_at_step(session, start)  # e.g. this task's input pipeline, at its position then
    if rejoined:
        _say(f"{session.task} rejoins the job at global step {start}")
    chief_loop = False
    for replicated, index in session.graph.get_collection(REPLICAS_COLLECTION):
        ops = replicated.worker(index)
        joining = rejoined or (not chief and start > 0)
        session.run(ops.rejoin_op if joining and ops.rejoin_op is not None else ops.init_op)
        if chief and replicated.has_chief:
            after = checkpointer.after_update if checkpointer is not None else None
            start_chief_loop(replicated, session, after_update=after, rejoin=rejoined)
            chief_loop = True
    if checkpointer is not None:
        if not chief_loop:
            checkpointer.poll()
        session.on_close(checkpointer.close)
    return start


def _split_by_owner(session, variables: list) -> tuple[list, list]:
    """(variables other tasks hold, variables this task holds itself: one on its own
    device, or a local variable, such as a sync worker's local step, wherever it lives).
    In one process every other variable counts as shared."""
    here = session.task
    own = {id(v) for v in local_variables(session.graph)}
    shared, local = [], []
    for v in variables:
        device = session.variable_device(v.op)
        (local if id(v) in own or device.startswith(here + "/") else shared).append(v)
    return shared, local


def _all_initialized(session, variables: list) -> bool:
    """Whether every one of ``variables`` already holds a value (one small step)."""
    return all(session.run([v.is_initialized() for v in variables]))


def _say(message: str) -> None:
    print(f"flowmill: {message}", file=sys.stderr, flush=True)


def _start_step(session, chief: bool, restored: int | None) -> int:
    """The global step a task starts counting from, read before any training mode runs:
    the chief's is the one it restored or initialized (other workers may be stepping
    already); a sync worker's is the current one (it joins the step the others are at)."""
    if restored is not None:
        return restored
    global_step = get_global_step(session.graph)
    if global_step is None:
        return 0
    if chief or steps_are_shared(os.environ):
        return int(session.run(global_step.value()))
    config = CheckpointConfig.from_env()
    if config is None:
        return 0
    manifest = latest(*open_store(config.uri))
    return manifest.step if manifest is not None else 0


def _checkpointer(session):
    """The job's checkpoint policy for this session, or None where it keeps none."""
    config = CheckpointConfig.from_env()
    if config is None:
        return None
    global_step = get_global_step(session.graph)
    if global_step is None:
        raise ValueError(
            f"checkpoints ({config.uri}) are kept by global step, and the graph has none: "
            "create it with create_global_step() and pass it to minimize()"
        )
    return Checkpointer(session, config, global_step)


def start_chief_loop(
    replicated: ReplicatedTraining, session, after_update=None, rejoin: bool = False
) -> threading.Thread:
    """Run ``replicated.chief_loop`` in a daemon thread (``rejoin``: for a chief that comes
    back into a running job, after its per-job set-up was done). It ends quietly when the session
    closes or the process exits; failing otherwise, it ends the process (the workers
    would wait forever for the updates it applies), with ``RESTART_JOB_EXIT_CODE`` when
    it lost a PS task."""

    def loop() -> None:
        try:
            replicated.chief_loop(session, after_update=after_update, rejoin=rejoin)
        except BaseException as e:  # noqa: BLE001 - reported, then the process ends
            if exiting.is_set() or session.closed:
                return
            code = exit_code_for(e)
            if code == RESTART_JOB_EXIT_CODE:
                say_restart(e)
            else:
                print(
                    f"flowmill: the {replicated.mode} chief loop failed, ending this task: "
                    f"{type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                print_short(e)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    thread = threading.Thread(target=loop, name=f"{replicated.name}-chief", daemon=True)
    thread.start()
    return thread


def _wait_initialized(session, variables: list, timeout: float, poll_interval: float) -> None:
    read = session.make_callable([v.value() for v in variables])
    deadline = time.monotonic() + timeout
    while True:
        try:
            read()
            return
        except (TaskError, UninitializedError) as e:
            code = getattr(e, "code", None)
            if isinstance(e, TaskError) and (code is None or code.name != "FAILED_PRECONDITION"):
                raise
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{session.task}: the chief did not initialize the variables in "
                    f"{timeout:.0f}s (last: {e})"
                ) from None
            time.sleep(poll_interval)
