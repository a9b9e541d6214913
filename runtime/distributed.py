"""A session whose steps run across the tasks of a cluster.

``DistributedSession`` is a ``BaseSession`` (``run``, ``make_callable``, one plan per step
signature, as ``Session``) whose steps are compiled for the cluster: pruned and optimized
as in one process, then placed and partitioned per device. Placement sends every variable
the graph does not place to the PS tasks (``VariablePlacer``: least bytes first, or round
robin, the same in every task), and whatever else is unplaced to this task's device. The
chief says once, when its session first runs, how many bytes and variables each PS task
got.
Each remote partition is registered once on the task that owns its device; the local one
is compiled against this task's own ``Server``, whose tensor channel the other tasks pull
this task's values from. A step then costs one ``RunGraph`` per remote partition, over
the task's tensor channel (``transport.OP_RUN``) rather than gRPC, whose unary call costs
several times a socket round trip in Python: the calling thread sends them all, runs the
local partition, then reads their answers.

A failure anywhere ends the step everywhere instead of leaving a partition waiting: a
failed remote partition aborts the step on its task (answering pulls of its values with
ABORTED, so a partition waiting on one ends), a failed local one aborts it here, and the
step is cleaned up on every task. With a ``step_timeout`` a step that outlives it is
aborted here. The error raised names the task where it started.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from flowmill.kernels import ARRAY_MODULES, pinned_allocator

from . import cuda_graphs, telemetry, trace
from .cluster import PS_STRATEGIES, TaskConfig, from_env
from .copies import insert_copies
from .device_names import complete_device, task_of
from .executor import Frame, Plan, compile_step
from .fusion import fuse_elementwise
from .graph import Graph, GraphKeys, Operation
from .graph_def import to_graph_def
from .local_devices import gpu_count, local_devices
from .partition import answered_sends, partition
from .passes import add_numerics_checks
from .placement import (
    PS_OPS,
    VariablePlacer,
    format_loads,
    log_placement,
    place,
    ps_loads,
)
from .protos import task_service_pb2 as pb
from .protos import task_service_pb2_grpc as pb_grpc
from .remote_rendezvous import (
    PULL_SLICE_S,
    STEP_COUNTER_BITS,
    STEP_COUNTER_MASK,
    ServerRendezvous,
    StepAbortedError,
    session_handle,
)
from .server import Server
from .session import BaseSession, _Fetches
from .session_config import ConfigProto, usable_gpus
from .step_graph import StepGraph
from .task_errors import RunError, TaskError
from .transport import DEFAULT_BUFFER_POOL, PendingRun, RemoteError, RunFailed

# Step ids (remote_rendezvous): this process's counter per task, from its incarnation.
_counters: dict[int, tuple[itertools.count, int]] = {}
_counters_lock = threading.Lock()
# Finished steps are cleaned up on a task with the next RunGraph sent there; a task not run
# again gets a CleanupStep once this many have gathered (or when the session closes).
_MAX_DEFERRED_CLEANUPS = 64
# A peer that does not answer a cleanup within this long is not waited for.
_CLEANUP_TIMEOUT_S = 10.0
# How sending a remote partition's step, or reading its answer, fails: its task said it
# failed, no answer came in time, the connection broke, the answer made no sense.
_RUN_FAILURES = (RunFailed, TimeoutError, ConnectionError, RemoteError, ValueError)
# The tasks of this process that have said where the variables went: once in a task's life.
_placement_told: set[str] = set()
_devices_told: set[str] = set()
_placement_told_lock = threading.Lock()


class _Deadlines:
    """Ends a step that outlives the session's ``step_timeout`` here: its local waiters
    wake with a TimeoutError, and the step fails. A step reads its remote partitions'
    answers only after its own partition, so their timeouts alone would not bound a local
    partition stuck on a value that never comes.

    One daemon thread per session, started by the first step; it sleeps until the
    earliest deadline (or a whole ``timeout``), so a step costs it no wake-up."""

    def __init__(self, timeout: float, abort):
        self.timeout, self._abort = timeout, abort
        self._cond = threading.Condition()
        self._steps: dict[int, float] = {}  # step id -> its deadline
        self._thread: threading.Thread | None = None

    def start(self, step_id: int) -> float:
        """Watch ``step_id``; returns its deadline (``time.monotonic``)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._steps[step_id] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="step-deadlines",
                                                daemon=True)
                self._thread.start()
        return deadline

    def end(self, step_id: int) -> None:
        with self._cond:
            self._steps.pop(step_id, None)

    def _watch(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                late = [s for s, d in self._steps.items() if d <= now]
                for step_id in late:
                    del self._steps[step_id]
                if not late:
                    first = min(self._steps.values(), default=now + self.timeout)
                    self._cond.wait(first - now)
                    continue
            for step_id in late:
                self._abort(step_id, TimeoutError(
                    f"step {step_id} ran longer than the session's step timeout "
                    f"({self.timeout}s)"))


def _taker(run: PendingRun, part: _RemotePartition, rdv: ServerRendezvous, step_id: int,
           deadline: float | None) -> Callable[[str], Any]:
    """How a ``_Recv`` here takes a value a remote run's answer carries: by reading the
    answer (once; the step's thread reads it, here or after its own partition), within
    what is left of the step's time. It waits in slices, as a pull does, and gives up
    when the step ends here meanwhile (a failure elsewhere, its timeout)."""

    def take(key: str) -> Any:
        while not run.ready(PULL_SLICE_S):
            why = rdv.step_error(step_id)
            if why is not None:
                raise StepAbortedError(
                    f"step {step_id} ended while {key!r} waited for {part.task}'s answer: "
                    f"{type(why).__name__}: {why}")
            if deadline is not None and time.monotonic() >= deadline:
                break
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return run.wait(left)[key]

    return take


def _step_counter(task_number: int) -> tuple[itertools.count, int]:
    """This process's step counter for a task, and its incarnation (the first count)."""
    with _counters_lock:
        counter = _counters.get(task_number)
        if counter is None:
            start = time.time_ns() // 1000
            counter = _counters[task_number] = (itertools.count(start), start)
        return counter


@dataclass
class _RemotePartition:
    task: str
    device: str
    address: str
    stub: pb_grpc.TaskServiceStub
    handle: str
    # The keys (less the step id) of the values its run's answer carries here.
    answers: tuple[str, ...] = ()


@dataclass
class _ClusterPlan:
    plan: Plan  # this task's partition: takes the feeds, returns the fetches
    remote: list[_RemotePartition]
    mapper: _Fetches
    trains: bool = False  # runs an op minimize returned: a step of this task's progress


class DistributedSession(BaseSession):
    """Runs steps of a graph on the cluster of ``task_config`` (default: ``FLOWMILL_CONFIG``)
    as this task. Its own ``Server`` (started here unless ``server`` is given) holds this
    task's state and serves its tensors to the other tasks. ``ps_strategy`` (``bytes``, the
    default, or ``round_robin``; None leaves them here) is how unplaced variables go to the
    PS tasks.
    ``check_numerics`` is ``Session``'s: the checks are put in before the step is
    partitioned, so each partition checks what it computes, on its own task. So is
    ``config`` (how much of each GPU this task may use, and placement options), and
    ``cuda_graphs``: this task's partition of each step has its GPU segments captured and
    replayed as CUDA graphs (``cuda_graphs.py``; its ``_Recv``s and ``_Send``s stay
    outside them)."""

    def __init__(
        self,
        graph: Graph | None = None,
        task_config: TaskConfig | None = None,
        *,
        server: Server | None = None,
        bind_host: str = "127.0.0.1",
        optimize: bool = True,
        step_timeout: float | None = None,
        register_timeout: float = 60.0,
        ps_strategy: str | None = PS_STRATEGIES[0],
        check_numerics: bool = False,
        config: ConfigProto | None = None,
        cuda_graphs: bool = False,
    ):
        session_config = config
        self.cuda_graphs = cuda_graphs
        config = task_config or (server.config if server is not None else from_env())
        if config is None:
            raise ValueError("no cluster: pass task_config or set FLOWMILL_CONFIG")
        self.config = config
        self.server = server or Server(config, bind_host)
        super().__init__(graph, self.server.resources, optimize, check_numerics, session_config)
        self._owns_server = server is None
        self.task = self.server.task
        self.device = config.device
        self.step_timeout = step_timeout
        self.register_timeout = register_timeout
        num_ps = config.cluster.num_tasks("ps")
        self._variables = VariablePlacer(num_ps, ps_strategy) if ps_strategy and num_ps else None
        task_number = config.cluster.tasks().index((config.role, config.index))
        self._step_base = task_number << STEP_COUNTER_BITS
        self._counter, incarnation = _step_counter(task_number)
        # Its peers learn this task's incarnation from the handle, and end what an
        # earlier life of the task left running there.
        self.handle = session_handle(self.task, incarnation, uuid.uuid4().hex[:12])
        self._deferred: dict[str, list[int]] = {}  # task -> steps to clean up there
        self._cleanups: set[grpc.Future] = set()
        self._cleanups_lock = threading.Lock()
        self._deadlines = (None if step_timeout is None else
                           _Deadlines(step_timeout, self.server.frame_rendezvous.abort_step))
        if gpu_count():  # values pulled from the PS tasks land where a GPU copies from fast
            DEFAULT_BUFFER_POOL.allocate = pinned_allocator()

    @property
    def is_chief(self) -> bool:
        return self.config.is_chief

    def _release(self) -> None:
        """With its own server, stop that too (the other tasks keep their state: they
        belong to the cluster, not to one session)."""
        self._flush_cleanups(timeout=2.0)
        if self._owns_server:
            self.server.stop()

    def variable_device(self, op: Operation) -> str:
        """The full device a variable's op (or an op colocated with one) runs on here."""
        if self._variables is not None:
            return self._variables.device_of(op, self.device)
        if op.colocation:
            op = self.graph.get_operation_by_name(op.colocation[0])
        return complete_device(op.device, self.device)

    # ---- one step
    def _run_step(self, cp: _ClusterPlan, args: tuple, plan_key) -> tuple:
        if trace.TRACER is not None:
            with trace.TRACER.span("step", "session", remote=[p.task for p in cp.remote]):
                return self._run_step_on_tasks(cp, args, plan_key)
        return self._run_step_on_tasks(cp, args, plan_key)

    def _run_step_on_tasks(self, cp: _ClusterPlan, args: tuple, plan_key) -> tuple:
        """Ask every other task to run its partition, run this task's, then read their
        answers: all on this thread (a thread per call would be woken twice per remote
        partition, at the start and at the end of every step). A remote partition that
        fails ends the step on its task, so this task's partition, if it waits for a
        value from there (or from a task that does), ends too."""
        step_id = self._step_base | (next(self._counter) & STEP_COUNTER_MASK)
        rdv = self.server.frame_rendezvous
        deadline = None if self._deadlines is None else self._deadlines.start(step_id)
        runs: list[tuple[_RemotePartition, list[int], PendingRun | None]] = []
        remote_errors: list[tuple[_RemotePartition, grpc.RpcError]] = []
        local_error: BaseException | None = None
        values: tuple = ()
        try:
            for part in cp.remote:
                cleanup = self._take_deferred(part.task)
                run = None
                try:
                    run = self._start_remote(part, step_id, cleanup)
                except RunError as e:  # not sent: nothing of the step runs there
                    remote_errors.append((part, e))
                    rdv.abort_step(step_id, e)
                else:
                    if run.carried:
                        rdv.expect(step_id, run.carried,
                                   _taker(run, part, rdv, step_id, deadline))
                runs.append((part, cleanup, run))
            try:
                values = cp.plan.run(args, Frame(step_id, rdv, rdv.cancellation))
            except Exception as e:
                local_error = e
                rdv.abort_step(step_id, e)
                for part, cleanup, run in runs:  # a partition there may wait on state
                    if run is not None:
                        self._send_cleanup(part.task, part.stub, [step_id, *cleanup])
            for i, (part, cleanup, run) in enumerate(runs):
                if run is None:
                    continue
                runs[i] = (part, cleanup, None)
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    self._finish_remote(part, run, left)
                except RunError as e:
                    remote_errors.append((part, e))
                    rdv.abort_step(step_id, e)
        except BaseException as e:  # interrupted (SIGTERM, Ctrl-C): end the step everywhere
            rdv.abort_step(step_id, StepAbortedError(f"step {step_id} was interrupted: {e!r}"))
            for part, cleanup, run in runs:
                if run is not None:
                    run.abandon()
                self._send_cleanup(part.task, part.stub, [step_id, *cleanup])
            raise
        finally:
            if self._deadlines is not None:
                self._deadlines.end(step_id)
        self.server.cleanup_step(step_id)
        if local_error is None and not remote_errors:
            self._defer_cleanup(step_id, cp.remote)
            if cp.trains:
                telemetry.count_step()
            return values
        for part, cleanup, _ in runs:  # now, and again what the failed calls carried
            self._send_cleanup(part.task, part.stub, [step_id, *cleanup])
        if plan_key is not None and any(
            e.code() == grpc.StatusCode.NOT_FOUND for _, e in remote_errors
        ):
            self._plans.pop(plan_key, None)  # a restarted task: register again next time
        raise self._failure(step_id, local_error, remote_errors)

    def _start_remote(self, part: _RemotePartition, step_id: int,
                      cleanup: list[int]) -> PendingRun:
        """Send one remote partition's step on the task's tensor channel (``OP_RUN``: a
        fraction of a gRPC call's cost); a failure raises as gRPC's ``RunGraph`` would."""
        client = None
        try:
            client = self.server.peers.tensor_client(part.task)
            carried = tuple(f"{prefix}{step_id}" for prefix in part.answers)
            return client.start_run(part.handle, step_id, cleanup, self.step_timeout, carried)
        except _RUN_FAILURES as e:
            raise self._run_error(part, client, e) from None

    def _finish_remote(self, part: _RemotePartition, run: PendingRun,
                       timeout: float | None) -> None:
        """Read a remote partition's answer; a failure raises as ``RunGraph`` would."""
        try:
            run.wait(timeout)
        except _RUN_FAILURES as e:
            raise self._run_error(part, run.client, e) from None

    def _run_error(self, part: _RemotePartition, client, e: Exception) -> RunError:
        """One of ``_RUN_FAILURES`` as the ``RunError`` gRPC's ``RunGraph`` would give."""
        if isinstance(e, RunFailed):
            return RunError(getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN),
                            e.details)
        if isinstance(e, TimeoutError):
            return RunError(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        if isinstance(e, ConnectionError):
            if client is not None:
                self.server.peers.forget(part.task, client)  # a restarted task listens elsewhere
            return RunError(grpc.StatusCode.UNAVAILABLE, f"{part.task}: {e}")
        return RunError(grpc.StatusCode.INTERNAL, f"{part.task}: {e}")  # RemoteError, ValueError

    def _failure(self, step_id: int, local_error, remote_errors) -> Exception:
        """The error to raise: where the step failed first, not where it was aborted."""
        consequences = (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)
        causes = [(p, e) for p, e in remote_errors if e.code() not in consequences]
        if not causes and local_error is not None:
            if not isinstance(local_error, StepAbortedError) or not remote_errors:
                return local_error
        part, e = (causes or remote_errors)[0]
        details = e.details() or ""  # the task's message; str(e) would add gRPC's internals
        error = TaskError(
            f"step {step_id} failed on {part.task} ({part.address}): "
            f"{e.code().name}: {details}",
            part.task,
            e.code(),
            TaskError.op_named_in(details),
        )
        error.__cause__ = local_error
        return error

    def _take_deferred(self, task: str) -> list[int]:
        with self._cleanups_lock:
            return self._deferred.pop(task, [])

    def _defer_cleanup(self, step_id: int, remote: list[_RemotePartition]) -> None:
        """A step finished everywhere: clean it up on each task along with the next step
        sent there (every partition is done, so no peer still pulls its values)."""
        full = []
        with self._cleanups_lock:
            for part in remote:
                pending = self._deferred.setdefault(part.task, [])
                if not pending or pending[-1] != step_id:
                    pending.append(step_id)
                if len(pending) >= _MAX_DEFERRED_CLEANUPS:
                    full.append((part.task, part.stub, self._deferred.pop(part.task)))
        for task, stub, steps in full:
            self._send_cleanup(task, stub, steps)

    def _send_cleanup(self, task: str, stub: pb_grpc.TaskServiceStub, steps: list[int]) -> None:
        """CleanupStep without waiting for it (a peer that is gone has nothing to clean)."""
        steps = list(dict.fromkeys(steps)) + self._take_deferred(task)
        call = stub.CleanupStep.future(
            pb.CleanupStepRequest(step_id=steps[0], more_step_ids=steps[1:]),
            timeout=_CLEANUP_TIMEOUT_S,
        )
        with self._cleanups_lock:
            self._cleanups.add(call)
        call.add_done_callback(self._cleanup_done)

    def _cleanup_done(self, call: grpc.Future) -> None:
        with self._cleanups_lock:
            self._cleanups.discard(call)

    def _flush_cleanups(self, timeout: float) -> None:
        """Send every deferred cleanup and wait (up to ``timeout``) for all of them."""
        with self._cleanups_lock:
            deferred, self._deferred = self._deferred, {}
        for task, steps in deferred.items():
            if steps:
                self._send_cleanup(task, self.server.peers.stub(task), steps)
        with self._cleanups_lock:
            calls = list(self._cleanups)
        deadline = time.monotonic() + timeout
        for call in calls:
            try:
                call.result(timeout=max(deadline - time.monotonic(), 0.0))
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass  # the peer is gone or slow; its leftovers go with it

    # ---- compiling a signature for the cluster
    def _compile_step(self, step: StepGraph, mapper: _Fetches) -> _ClusterPlan:
        """Place the step (variables to the PS tasks, the rest here: on this task's GPU
        where it has one), partition it per task, put in this task's host/device copies,
        compile its partition here and register the others on their tasks (which put in
        their own copies)."""
        if self._variables is not None:
            self._variables.apply(step, self.graph)
        config = self.session_config
        gpus = usable_gpus(config, gpu_count())
        place(step, self.device, gpus, soft=config.allow_soft_placement)
        log_placement(step, config)
        if self.check_numerics:
            add_numerics_checks(step)
        parts = partition(step, self.device)
        remote = [(device, part) for device, part in parts.items() if device != self.device]
        mine = parts[self.device]
        insert_copies(mine)
        fuse_elementwise(mine)
        train_ops = set(self.graph.get_collection(GraphKeys.TRAIN_OP))
        local = compile_step(mine, self.resources)
        if self.cuda_graphs and gpus:
            local = cuda_graphs.graphed(mine, local, self.resources, ARRAY_MODULES["GPU"])
        plan = _ClusterPlan(
            local,
            self._register(remote),
            mapper,
            trains=any(n.op in train_ops for n in step.targets),
        )
        self._tell_placement()
        self._tell_devices()
        return plan

    def _tell_devices(self) -> None:
        """Where it has GPUs, say once on stderr which devices this task computes on."""
        if gpu_count() == 0:
            return
        with _placement_told_lock:
            if self.task in _devices_told:
                return
            _devices_told.add(self.task)
        print(f"flowmill: {self.task} computes on {', '.join(local_devices())}",
              file=sys.stderr, flush=True)

    def _tell_placement(self) -> None:
        """As the chief, say on stderr once in this task's life, at its first step, the
        bytes and count of the variables each PS task holds: a split that loads one task
        far more than the others shows before it shows as a slow or failing task."""
        if not self.is_chief:
            return
        with _placement_told_lock:
            if self.task in _placement_told:
                return
            _placement_told.add(self.task)
        variables = [op for op in self.graph.get_operations() if op.type in PS_OPS]
        loads = ps_loads((self.variable_device(op), op.attrs) for op in variables)
        if loads:
            print(f"flowmill: {format_loads(loads)}", file=sys.stderr, flush=True)

    def _register(self, remote) -> list[_RemotePartition]:
        """Register every remote partition on its task, all at once."""
        calls = []
        answers = {}
        for device, part in remote:
            answered = answered_sends(part)
            if answered is not None and answered[0] == self.task:
                answers[device] = tuple(answered[1])
            task = task_of(device)
            stub = self.server.peers.stub(task)
            request = pb.RegisterGraphRequest(
                graph_def=to_graph_def(part).SerializeToString(deterministic=True),
                session_handle=self.handle,
            )
            call = stub.RegisterGraph.future(
                request, timeout=self.register_timeout, wait_for_ready=True
            )
            calls.append((task, device, stub, call))
        registered = []
        for task, device, stub, call in calls:
            address = self.server.peers.address(task)
            try:
                handle = call.result().graph_handle
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # It waited for the task to be ready that long: the task is unreachable.
                    code = grpc.StatusCode.UNAVAILABLE
                raise TaskError(
                    f"registering the partition for {device} on {task} ({address}) failed: "
                    f"{e.code().name}: {e.details()}",
                    task,
                    code,
                ) from None
            registered.append(_RemotePartition(task, device, address, stub, handle,
                                               answers.get(device, ())))
        return registered
