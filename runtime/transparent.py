"""One model script, unchanged, in one process or as a task of a cluster.

A script builds its graph and opens ``Session(graph)`` as it always does. Where the
process was started as a training task of a cluster (``FLOWMILL_CONFIG`` names a worker or
chief), ``Session(...)`` gives a ``DistributedSession`` for that task instead
(``cluster_session``; the dispatch is the one check in ``Session.__new__``), and that
session sends every variable the script did not place to the PS tasks when it compiles a
step (``VariablePlacer``). Without the variable nothing changes.

The little a script still needs to know about the cluster it asks here, and the same call
answers sensibly in one process: ``task()`` says which slice of the data this task trains
on (``(0, 1)`` alone) and whether it is the chief; ``initialize_or_wait`` initializes the
variables on the chief (or alone) and makes every other task wait until they are.

The job's training mode (``FLOWMILL_TRAINING``) is built by ``minimize``: in sync mode the
optimizer is wrapped in a ``SyncReplicasOptimizer`` aggregating ``workers - backupWorkers``
gradients per step, in bounded-staleness mode in ``BoundedStaleness``; this task's worker
replica is built, with its own state on this task. Once the chief has initialized the
variables, ``initialize_or_wait`` starts the mode's chief loop in a thread of the chief.
Alone, or in async mode, ``minimize`` is the optimizer's own.

Checkpoints are the job's too (``checkpoint`` in the manifest, ``FLOWMILL_CHECKPOINT_*``
in the environment): ``initialize_or_wait`` on the chief restores the newest complete
checkpoint instead of initializing, and saves every ``intervalSteps`` global steps and when
its session closes (``checkpointer``). A script that counts its steps from the global step
(``steps_done``, ``own_steps``) resumes where the job left off, with no change.

A training task that loses a PS task (it stops answering) exits with
``RESTART_JOB_EXIT_CODE`` (75): the launcher and the operator then restart the whole job,
which resumes from its last checkpoint.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .cluster import (
    ENV_TRAINING,
    ENV_VAR,
    RESTART_JOB_EXIT_CODE,
    ClusterSpecError,
    TaskConfig,
    from_env,
)
from .graph import Graph, Operation, Tensor, merge_device, parse_device
from .placement import PS_OPS, complete_device, replica_device_setter
from .prune import StepGraph

if TYPE_CHECKING:
    from .distributed import DistributedSession
    from .optimizers import Optimizer
    from .replicas import ReplicatedTraining
    from .server import Server

PS_STRATEGY_ENV = "FLOWMILL_PS_STRATEGY"  # round_robin (default) or bytes
TRAINING_ROLES = ("chief", "worker")  # the tasks that run the model script
PS_STRATEGIES = ("round_robin", "bytes")
# Graph collection of (ReplicatedTraining, worker index) built by ``minimize``.
REPLICAS_COLLECTION = "replicated_training"
# A chief loop failing while training goes on leaves the workers waiting for updates that
# never come: the chief's process exits with this code instead, failing the job.
CHIEF_LOOP_FAILED_EXIT_CODE = 1


# ---- which task this is


class TaskInfo(NamedTuple):
    """This process's place among the training tasks: ``index`` of ``count`` (the chief,
    if the job has one, first). Unpacks as ``index, count = task()``."""

    index: int
    count: int

    @property
    def is_chief(self) -> bool:
        """Index 0 initializes the variables, evaluates and reports."""
        return self.index == 0


def training_tasks(config: TaskConfig) -> list[tuple[str, int]]:
    """The tasks that run the model script, in shard order: the chief, then the workers."""
    return [(role, i) for role in TRAINING_ROLES for i in range(config.cluster.num_tasks(role))]


def task(environ: Mapping[str, str] = os.environ) -> TaskInfo:
    """Which shard of the data this process trains on: ``(0, 1)`` in one process."""
    config = from_env(environ)
    if config is None:
        return TaskInfo(0, 1)
    tasks = training_tasks(config)
    if (config.role, config.index) not in tasks:
        raise ClusterSpecError(
            f"{ENV_VAR} names task {config.role}:{config.index}, which runs no model script "
            f"(training tasks are {', '.join(TRAINING_ROLES)})"
        )
    return TaskInfo(tasks.index((config.role, config.index)), len(tasks))


def _steps_are_shared(environ: Mapping[str, str]) -> bool:
    """Whether each global step is one step of every worker (alone, or sync mode), not
    one step of one worker (async, bounded staleness)."""
    if from_env(environ) is None:
        return True
    return str(training_config(environ).get("mode") or "async") == "sync"


def own_steps(total: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many steps this task takes while the job takes ``total`` global steps: all of
    them alone or in sync mode, its share of them in async and bounded-staleness modes."""
    if _steps_are_shared(environ):
        return total
    index, count = task(environ)
    return total // count + (index < total % count)


def steps_done(global_step: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many of its steps this task had taken when the job stood at ``global_step``:
    where a resumed task starts counting (0 on a fresh start)."""
    if _steps_are_shared(environ):
        return global_step
    index, count = task(environ)
    return global_step // count + (index < global_step % count)


def training_done(session, global_step, seen: int, total: int) -> bool:
    """Whether the job has taken its ``total`` global steps, after a step that fetched
    ``seen`` from ``global_step``.

    A read inside a step may run before or after the update that step waits for (in sync
    mode the chief applies it), so after the step the global step is ``seen`` or more.
    Only when that could already be ``total`` is it read again, in a step of its own: the
    last step costs one more round trip, the others nothing. Other workers may still be
    mid-step, so in async modes the job may end up to ``workers - 1`` steps past ``total``.
    """
    return seen + 1 >= total and int(session.run(global_step.value())) >= total


def max_steps(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """The job's ``training.maxSteps`` (global steps), else ``default``."""
    value = training_config(environ).get("maxSteps")
    return default if value is None else int(value)


def training_config(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The job's training section (mode, backupWorkers, staleness, maxSteps), or ``{}``
    when the process runs alone."""
    text = environ.get(ENV_TRAINING)
    if not text:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_TRAINING} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ENV_TRAINING} must be a JSON object, got {text!r}")
    return config


# ---- where variables go


class VariablePlacer:
    """Sends the variables a script did not place to the PS tasks, the same way in every
    task of the job.

    A variable counts as unplaced when its ``VarHandleOp`` names no job and was not built
    under ``colocate_with``; it gets ``/job:ps/task:k`` (a device type it asked for is
    kept). ``k`` is chosen over the graph's variables in creation order, round robin or
    least bytes first, so every worker running the same script agrees without talking.
    Whatever is colocated with a variable (its initializer, updates, optimizer slots,
    accumulators of a training mode) follows it: ``place`` joins resource users with their
    owner, and ops built under ``colocate_with`` are given the owner's device here, even
    when the owner itself is not part of the step.
    """

    def __init__(self, num_ps: int, strategy: str = "round_robin"):
        if strategy not in PS_STRATEGIES:
            raise ValueError(
                f"variable placement strategy must be one of {', '.join(PS_STRATEGIES)}, "
                f"got {strategy!r}"
            )
        if num_ps < 1:
            raise ValueError(f"VariablePlacer needs at least one ps task, got {num_ps}")
        self.num_ps = num_ps
        self.strategy = strategy
        self._choose = replica_device_setter(num_ps, strategy=strategy)
        self._devices: dict[str, str] = {}  # VarHandleOp name -> its ps device
        self._graph: Graph | None = None
        self._scanned = 0
        self._lock = threading.Lock()

    def assignments(self, graph: Graph) -> dict[str, str]:
        """Variable op name -> ps device for every unplaced variable ``graph`` has so far.
        Ops added later extend the assignment; earlier ones never move."""
        with self._lock:
            if self._graph is None:
                self._graph = graph
            elif graph is not self._graph:
                raise ValueError("a VariablePlacer serves one graph")
            ops = graph.get_operations()
            for op in ops[self._scanned :]:
                if op.type in PS_OPS and not op.colocation and "job" not in parse_device(op.device):
                    self._devices[op.name] = merge_device(op.device, self._choose(op))
            self._scanned = len(ops)
            return self._devices

    def apply(self, step: StepGraph, graph: Graph) -> None:
        """Give the step's variables and everything colocated with them their ps device."""
        devices = self.assignments(graph)
        for node in step.nodes:
            op = node.op
            if op is None:
                continue
            owner = op.colocation[0] if op.colocation else op.name
            device = devices.get(owner)
            if device is not None:
                node.device = device

    def device_of(self, op: Operation, default_device: str) -> str:
        """The full device ``op`` (a variable, or an op colocated with one) runs on."""
        devices = self.assignments(op.graph)
        owner = op.colocation[0] if op.colocation else op.name
        device = devices.get(owner)
        if device is None and op.colocation:
            device = op.graph.get_operation_by_name(owner).device
        return complete_device(device if device is not None else op.device, default_device)


def ps_strategy(environ: Mapping[str, str] = os.environ) -> str:
    strategy = environ.get(PS_STRATEGY_ENV) or "round_robin"
    if strategy not in PS_STRATEGIES:
        raise ValueError(
            f"{PS_STRATEGY_ENV} must be one of {', '.join(PS_STRATEGIES)}, got {strategy!r}"
        )
    return strategy


# ---- the session a script gets


_server: Server | None = None
_server_lock = threading.Lock()


def task_server(config: TaskConfig) -> Server:
    """This process's one ``Server``: its task's port can be bound once, and its state
    (this task's variables and queues) outlives any one session, as on a PS task."""
    global _server, _atexit_registered
    from .server import Server
    from .telemetry import bind_host

    with _server_lock:
        if _server is None or _server.stopped:
            _server = Server(config, bind_host())
            if not _atexit_registered:
                atexit.register(_at_exit)
                _atexit_registered = True
        elif _server.config != config:
            raise ClusterSpecError(
                f"this process already serves {_server.task} of another cluster; "
                f"{ENV_VAR} changed to {config.role}:{config.index}"
            )
        return _server


_atexit_registered = False
_exiting = threading.Event()  # set when the process exits: background loops end quietly


def _at_exit() -> None:
    _exiting.set()
    close_task_server()


def cluster_session(
    graph: Graph | None = None,
    optimize: bool = True,
    environ: Mapping[str, str] = os.environ,
) -> DistributedSession | None:
    """The session ``Session(graph)`` stands for in a training task of a cluster, or None
    where the process runs alone (no ``FLOWMILL_CONFIG``) or is a PS task."""
    config = from_env(environ)
    if config is None or config.role not in TRAINING_ROLES:
        return None
    from .distributed import DistributedSession

    install_restart_hook()
    return DistributedSession(
        graph,
        server=task_server(config),
        optimize=optimize,
        ps_strategy=ps_strategy(environ),
    )


# ---- the training mode


def replicated_training(
    optimizer: Optimizer,
    config: TaskConfig | None = None,
    training: Mapping[str, Any] | None = None,
) -> ReplicatedTraining | None:
    """The training mode this task's optimizer runs under, or None where it applies its
    own updates (alone, on a PS task, or in async mode, where nothing coordinates the
    workers). ``config`` and ``training`` default to the process environment."""
    from .replicas import make_training

    config = from_env() if config is None else config
    if config is None or config.role not in TRAINING_ROLES:
        return None
    training = training_config() if training is None else training
    mode = str(training.get("mode") or "async").replace("-", "_")
    if mode == "async":
        return None
    count = len(training_tasks(config))
    return make_training(
        mode,
        optimizer,
        count,
        backup_workers=int(training.get("backupWorkers") or 0),
        staleness=int(training.get("staleness") or 0),
    )


def replicated_minimize(
    optimizer: Optimizer,
    loss: Tensor,
    global_step=None,
    var_list: Sequence | None = None,
    *,
    config: TaskConfig | None = None,
    training: Mapping[str, Any] | None = None,
) -> Operation | None:
    """This worker's replica of the job's training mode built over ``optimizer`` (its
    per-worker state placed on this task), or None where the optimizer applies its own
    updates (see ``replicated_training``): the hook for ``Optimizer.minimize``."""
    config = from_env() if config is None else config
    replicated = replicated_training(optimizer, config, training)
    if replicated is None:
        return None
    index = training_tasks(config).index((config.role, config.index))
    train_op = replicated.minimize(
        loss, global_step, var_list, worker_index=index, worker_device=config.device
    )
    loss.graph.add_to_collection(REPLICAS_COLLECTION, (replicated, index))
    return train_op


def minimize(
    optimizer: Optimizer,
    loss: Tensor,
    global_step=None,
    var_list: Sequence | None = None,
    *,
    config: TaskConfig | None = None,
    training: Mapping[str, Any] | None = None,
) -> Operation:
    """This task's train op: in sync or bounded-staleness mode this worker's replica of
    the mode (``replicated_minimize``), else (alone, async) ``optimizer.minimize``."""
    train_op = replicated_minimize(
        optimizer, loss, global_step, var_list, config=config, training=training
    )
    if train_op is None:
        train_op = optimizer.minimize(loss, global_step=global_step, var_list=var_list)
    return train_op


# ---- starting training together


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
    and when the session closes.

    Then the training mode (``minimize``) gets going: each worker replica starts at the
    current global step, and the chief starts the mode's chief loop in a thread (it ends
    with the session or the process). ``var_list`` (default: the graph's global
    variables) are the variables to wait for.

    Returns the global step this task starts from (``steps_done`` turns it into the
    task's own step count): 0 on a fresh start, the restored step after a restart. In
    async and bounded-staleness modes the other workers may already be training when a
    task gets here, so it is the step of the checkpoint the job resumed from, not the
    current one.
    """
    from .distributed import DistributedSession
    from .ops.array_ops import group
    from .ops.state_ops import global_variables

    chief = not isinstance(session, DistributedSession) or session.config.is_chief
    checkpointer = _checkpointer(session) if chief else None
    restored = None
    if chief:
        restored = checkpointer.restore() if checkpointer is not None else None
        if restored is None:
            session.run(init_op)
        elif checkpointer.saver.local:
            session.run(group(*[v.initializer for v in checkpointer.saver.local]))
    else:
        variables = list(var_list) if var_list is not None else global_variables(session.graph)
        here = session.task
        shared, local = [], []
        for v in variables:
            device = session.variable_device(v.op)
            (local if device.startswith(here + "/") else shared).append(v)
        if shared:
            _wait_initialized(session, shared, timeout, poll_interval)
        if local:
            session.run(group(*[v.initializer for v in local], name="init_local"))
    start = _start_step(session, chief, restored)
    chief_loop = False
    for replicated, index in session.graph.get_collection(REPLICAS_COLLECTION):
        session.run(replicated.worker(index).init_op)
        if chief and replicated.has_chief:
            after = checkpointer.after_update if checkpointer is not None else None
            start_chief_loop(replicated, session, after_update=after)
            chief_loop = True
    if checkpointer is not None:
        if not chief_loop:
            checkpointer.poll()
        session.on_close(checkpointer.close)
    return start


def _start_step(session, chief: bool, restored: int | None) -> int:
    """The global step a task starts counting from, read before any training mode runs:
    the chief's is the one it restored or initialized (other workers may be stepping
    already); a sync worker's is the current one (it joins the step the others are at)."""
    from .checkpoint import latest, open_store
    from .checkpointer import CheckpointConfig
    from .optimizers import get_global_step

    if restored is not None:
        return restored
    global_step = get_global_step(session.graph)
    if global_step is None:
        return 0
    if chief or _steps_are_shared(os.environ):
        return int(session.run(global_step.value()))
    config = CheckpointConfig.from_env()
    if config is None:
        return 0
    manifest = latest(*open_store(config.uri))
    return manifest.step if manifest is not None else 0


def _checkpointer(session):
    """The job's checkpoint policy for this session, or None where it keeps none."""
    from .checkpointer import CheckpointConfig, Checkpointer
    from .optimizers import get_global_step

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
    replicated: ReplicatedTraining, session, after_update=None
) -> threading.Thread:
    """Run ``replicated.chief_loop`` in a daemon thread. It ends quietly when the session
    closes or the process exits; failing otherwise, it ends the process (the workers
    would wait forever for the updates it applies), with ``RESTART_JOB_EXIT_CODE`` when
    it lost a PS task."""

    def loop() -> None:
        try:
            replicated.chief_loop(session, after_update=after_update)
        except BaseException as e:  # noqa: BLE001 - reported, then the process ends
            if _exiting.is_set() or getattr(session, "closed", False):
                return
            code = _exit_code_for(e)
            if code == RESTART_JOB_EXIT_CODE:
                _say_restart(e)
            else:
                import traceback

                print(
                    f"flowmill: the {replicated.mode} chief loop failed, ending this task: "
                    f"{type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                traceback.print_exception(e, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    thread = threading.Thread(target=loop, name=f"{replicated.name}-chief", daemon=True)
    thread.start()
    return thread


# ---- losing a PS task


# What a step on a PS task fails with when the task is gone. (One that came back without
# its variables answers FAILED_PRECONDITION, as does a script that never initialized
# them: that is not taken for a loss, or a bug would restart the job over and over; the
# launcher and the operator restart the whole job when a PS task fails anyway.)
_LOST_TASK_CODES = ("UNAVAILABLE",)


def lost_ps(e: BaseException | None):
    """The ``TaskError`` saying a PS task was lost, in ``e`` or its causes, else None."""
    from .distributed import TaskError

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TaskError) and e.task.startswith("/job:ps/"):
            if getattr(e.code, "name", None) in _LOST_TASK_CODES:
                return e
        e = e.__cause__ or e.__context__
    return None


def _exit_code_for(e: BaseException) -> int:
    return RESTART_JOB_EXIT_CODE if lost_ps(e) is not None else CHIEF_LOOP_FAILED_EXIT_CODE


def _say_restart(e: BaseException) -> None:
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
            _say_restart(value)
            sys.stdout.flush()
            os._exit(RESTART_JOB_EXIT_CODE)

    hook.flowmill = True
    return hook


def install_restart_hook() -> None:
    """Make a lost PS end this training task with ``RESTART_JOB_EXIT_CODE``."""
    if not getattr(sys.excepthook, "flowmill", False):
        sys.excepthook = _restart_on_lost_ps(sys.excepthook)


def _wait_initialized(session, variables: list, timeout: float, poll_interval: float) -> None:
    from .distributed import TaskError
    from .resources import UninitializedError

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


def close_task_server() -> None:
    """Stop this process's task server (tests; a task's process stops it at exit)."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.stop()
