"""A task's server: the gRPC control plane every task of a cluster runs.

Each task (PS or worker) holds one ``Resources`` (its variables and queues), one
``Rendezvous`` and one ``TensorServer`` beside the gRPC server. A client registers each
partition of a step on the task that owns its device (``RegisterGraph``: rebuilt from its
GraphDef and compiled once), then runs every partition of a step under one step id
(``RunGraph``). Tensors never go through gRPC: a ``_Send`` leaves its value in the
producer's own rendezvous and the consumer's ``_Recv`` pulls it over the producer's bulk
tensor channel, whose address the producer's ``GetStatus`` gives.

A failure ends only its step, never the task: a partition that fails, or a pull from a
peer that is gone, cleans the step out of the local rendezvous with the error recorded,
which wakes every local waiter of that step and answers the step's pending pulls from
peers with ABORTED, so that their partitions fail too instead of waiting forever. The
server keeps serving the next step.

Run a task with ``python -m flowmill.runtime.server`` (cluster spec in ``FLOWMILL_CONFIG``);
it serves until a ``Shutdown`` call or SIGTERM, then exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import grpc

from flowmill.kernels.cancellation import CancelledError
from flowmill.kernels.checkpoint_store import CorruptCheckpointError
from flowmill.kernels.conditional_accumulator import CoordinationClosedError
from flowmill.kernels.fifo_queue import OutOfRangeError, QueueClosedError
from flowmill.kernels.resources import Resources, UninitializedError

from . import telemetry, trace
from .addresses import default_bind_host, format_address, is_wildcard, parse_address
from .cluster import (
    ENV_CHECKPOINT_URI,
    ENV_VAR,
    METRICS_PATH,
    ClusterSpecError,
    TaskConfig,
    from_env,
)
from .copies import insert_copies
from .daemons import DaemonExecutor
from .device_names import parse_device, split_task, task_name, task_of
from .executor import Frame, Plan, compile_step
from .fusion import fuse_elementwise
from .graph_def import from_graph_def
from .local_devices import local_devices
from .ops.training_ops import HYPERPARAMETERS
from .partition import answered_sends
from .protos import task_service_pb2 as pb
from .protos import task_service_pb2_grpc as pb_grpc
from .remote_rendezvous import (
    CHANNEL_OPTIONS,
    Peers,
    ServerRendezvous,
    StepAbortedError,
    incarnation_of,
    step_origin,
)
from .rendezvous import Rendezvous, RendezvousError
from .server_stats import server_source
from .step_graph import Node
from .tls import TaskCredentials
from .transport import RemoteError, TensorServer

log = logging.getLogger("flowmill.server")


class PortTakenError(OSError):
    """The task's address (from its cluster spec) is held by another process."""


# gRPC servers set SO_REUSEPORT by default, so a second task would silently share a port.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]


# Bounds on what requests may make a task hold: distinct partitions registered (a job
# registers a handful; each holds its compiled plan), step ids one call may clean up (a
# client defers 64 at most), the text of an error answer.
MAX_REGISTERED_GRAPHS = 4096
MAX_STEP_IDS_PER_CALL = 1024
MAX_ERROR_CHARS = 16384
# A step's client that does not take its CleanupStep within this long is not waited for.
CLEANUP_TIMEOUT_S = 10.0


class ResourceExhaustedError(RuntimeError):
    """A request would make this task hold more than its bounds allow."""


def status_code(e: BaseException) -> grpc.StatusCode:
    """The gRPC status a task answers an error with, after TensorFlow's error codes."""
    if isinstance(e, (ResourceExhaustedError, MemoryError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, UninitializedError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, CorruptCheckpointError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(e, (CoordinationClosedError, QueueClosedError, CancelledError)):
        return grpc.StatusCode.CANCELLED  # the state went away (a session or task closing)
    if isinstance(e, OutOfRangeError):
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(e, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(e, (ConnectionError, RemoteError, RendezvousError)):
        return grpc.StatusCode.ABORTED
    if isinstance(e, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(e, (ValueError, TypeError, KeyError, IndexError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def failure(task: str, what: str, e: BaseException, node: Node | None = None):
    """The status code and message a task answers a failed call with (an internal error is
    logged here with its traceback)."""
    op = f"op {node.name!r} ({node.type}): " if node is not None else ""
    message = f"{task}: {what}: {op}{type(e).__name__}: {e}"
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    code = status_code(e)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s", message, exc_info=e)
    return code, message


# Ops that change a variable in place: a step running one here is an update applied here.
UPDATE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                        "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate",
                        *HYPERPARAMETERS})


@dataclass
class RegisteredGraph:
    handle: str
    plan: Plan
    session_handle: str
    updates: bool = False  # it changes variables held here
    # A run by this task answers with these values (``partition.answered_sends``).
    answers_to: str | None = None
    answers: tuple[str, ...] = ()


class Server:
    """One task's gRPC server, state, rendezvous and bulk tensor channel.

    ``bind_host`` is where both listen: ``127.0.0.1`` for a job on one machine, ``0.0.0.0``
    in a pod. The gRPC port is the task's own from the cluster spec; the tensor channel
    takes a free port that peers learn from ``GetStatus``.
    """

    def __init__(
        self,
        config: TaskConfig,
        bind_host: str = "127.0.0.1",
        *,
        max_workers: int = 64,
        recv_timeout: float | None = None,
        connect_timeout: float = 10.0,
        credentials: TaskCredentials | None | bool = True,
    ):
        self.config = config
        # True: the task's own, if FLOWMILL_TLS_DIR names them; None or False: plain TCP.
        if credentials is True:
            credentials = TaskCredentials.from_env()
        self.credentials = credentials or None
        self.task = task_name(config.role, config.index)
        # A task of a job with checkpoints writes them there only (FLOWMILL_CHECKPOINT_URI).
        self.resources = Resources(os.environ.get(ENV_CHECKPOINT_URI) or None)
        self.rendezvous = Rendezvous()
        self.peers = Peers(config, connect_timeout, self.credentials)
        self._telling: set[grpc.Future] = set()  # CleanupSteps sent to failed steps' clients
        self._telling_lock = threading.Lock()
        self.frame_rendezvous = ServerRendezvous(
            self.rendezvous, self.task, self.peers, recv_timeout
        )
        self._graphs: dict[str, RegisteredGraph] = {}
        self._graph_lock = threading.Lock()
        self._running: dict[int, int] = {}  # step id -> partitions of it running here
        self._incarnations: dict[str, int] = {}  # task -> the newest incarnation seen
        self._running_lock = threading.Lock()
        # For /metrics: steps that changed variables here, restarts of peers seen.
        self.updates_applied = 0
        self.peer_restarts_seen = 0
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()
        host, port = parse_address(config.address)
        self.tensor_server = TensorServer(self.rendezvous, bind_host, 0,
                                          credentials=self.credentials, runner=self.run_request)
        advertised = host if is_wildcard(bind_host) else bind_host
        self.tensor_address = format_address(advertised, self.tensor_server.port)
        # Daemon threads that keep serving while the process exits (see daemons.py).
        self._handlers = DaemonExecutor(max_workers, thread_name_prefix=f"task{self.task}")
        self._grpc = grpc.server(self._handlers, options=SERVER_OPTIONS)
        pb_grpc.add_TaskServiceServicer_to_server(_Servicer(self), self._grpc)
        where = format_address(bind_host, port)
        try:
            if self.credentials is None:
                bound = self._grpc.add_insecure_port(where)
            else:
                bound = self._grpc.add_secure_port(
                    where, self.credentials.grpc_server_credentials())
        except RuntimeError as e:
            bound, why = 0, str(e)
        else:
            why = "the port is taken"
        if not bound:
            self.tensor_server.close()
            raise PortTakenError(f"task {self.task} cannot listen on {where}: {why}")
        self._grpc.start()
        local = self.tensor_server.local_address
        log.info("%s serving on %s, tensors on %s%s%s", self.task, where, self.tensor_address,
                 f" and {local}" if local else "",
                 "" if self.credentials is None else " (mutual TLS)")

    # ---- graphs and steps

    def register_graph(self, graph_def: bytes, session_handle: str = "") -> str:
        """Compile a partition once; equal GraphDef bytes get the same handle."""
        self._end_earlier_lives(session_handle)
        handle = "graph-" + hashlib.sha256(graph_def).hexdigest()[:32]
        with self._graph_lock:
            if handle in self._graphs:
                return handle
            if len(self._graphs) >= MAX_REGISTERED_GRAPHS:
                raise ResourceExhaustedError(
                    f"{MAX_REGISTERED_GRAPHS} distinct graphs are registered here already"
                )
            step = from_graph_def(graph_def)
            if step.feeds:
                raise ValueError(f"the graph takes {len(step.feeds)} feeds; a task's takes none")
            have = local_devices()
            for n in step.nodes:
                if task_of(n.device) != self.task:
                    raise ValueError(
                        f"node {n.name!r} ({n.type}) is placed on {n.device or 'no device'!r}, "
                        f"not on this task"
                    )
                if parse_device(n.device).get("device", "CPU:0") not in have:
                    raise ValueError(
                        f"node {n.name!r} ({n.type}) is placed on {n.device}; this task has "
                        f"{', '.join(have)}"
                    )
            answered = answered_sends(step)
            insert_copies(step)
            fuse_elementwise(step)
            plan = compile_step(step, self.resources)
            updates = any(n.type in UPDATE_OPS for n in step.nodes)
            graph = RegisteredGraph(handle, plan, session_handle, updates)
            if answered is not None:
                graph.answers_to, graph.answers = answered[0], tuple(answered[1])
            self._graphs[handle] = graph
            log.debug(
                "%s registered %s (%d nodes) for %s",
                self.task,
                handle,
                len(step.nodes),
                session_handle or "a client",
            )
            return handle

    def graph(self, handle: str) -> RegisteredGraph | None:
        return self._graphs.get(handle)

    def run_graph(self, graph: RegisteredGraph, step_id: int) -> None:
        """Run one step of a registered partition; on failure the step is aborted here."""
        rdv = self.frame_rendezvous
        earlier = rdv.step_error(step_id)
        if earlier is not None:
            raise StepAbortedError(
                f"step {step_id} already ended here: {type(earlier).__name__}: {earlier}"
            )
        with self._running_lock:
            self._running[step_id] = self._running.get(step_id, 0) + 1
        ok = False
        try:
            if trace.TRACER is not None:
                with trace.TRACER.span("RunGraph", "task", graph=graph.handle, step=step_id):
                    graph.plan.run((), Frame(step_id, rdv, rdv.cancellation))
            else:
                graph.plan.run((), Frame(step_id, rdv, rdv.cancellation))
            ok = True
        except Exception as e:
            rdv.abort_step(step_id, e)
            raise
        finally:
            with self._running_lock:
                left = self._running.pop(step_id) - 1
                if left:
                    self._running[step_id] = left
                if ok and graph.updates:
                    self.updates_applied += 1

    def run_request(self, handle: str, step_id: int, cleanups: list[int]):
        """A ``RunGraph`` request, from gRPC or the tensor channel (``transport.OP_RUN``):
        None once the partition ran, or the keys of the values its answer carries (run
        by the task they go to), else the status code name and the message."""
        graph = self.graph(handle)
        if graph is None:
            return self._refused(step_id, "NOT_FOUND", (
                f"{self.task}: RunGraph: no graph is registered under {handle!r} "
                "(a restarted task must be registered with again)"))
        if len(cleanups) > MAX_STEP_IDS_PER_CALL:
            return self._refused(step_id, "INVALID_ARGUMENT", (
                f"{self.task}: {len(cleanups)} step ids in one call; "
                f"at most {MAX_STEP_IDS_PER_CALL}"))
        for done in cleanups:
            self.cleanup_step(done)
        try:
            self.run_graph(graph, step_id)
        except Exception as e:
            code, message = failure(self.task, f"step {step_id}", e, graph.plan.failing_node(e))
            self._end_at_client(step_id)
            return code.name, message
        if graph.answers and self._client_of(step_id) == graph.answers_to:
            return [f"{prefix}{step_id}" for prefix in graph.answers]
        return None

    def _client_of(self, step_id: int) -> str | None:
        """The task that started a step (its number is in the step id's high bits)."""
        number, _ = step_origin(step_id)
        tasks = self.config.cluster.tasks()
        return task_name(*tasks[number]) if number < len(tasks) else None

    def _refused(self, step_id: int, code: str, message: str) -> tuple[str, str]:
        """A step not run here ends here too: a partition elsewhere that pulls from this
        task for it hears so instead of waiting for a value that will never be sent."""
        self.frame_rendezvous.abort_step(step_id, StepAbortedError(message))
        self._end_at_client(step_id)
        return code, message

    def _end_at_client(self, step_id: int) -> None:
        """A step that failed here ends at once on the task that started it (a
        ``CleanupStep``, not waited for). Its partition there may be waiting for a value
        from a third task that now never comes (a partition blocked on a queue whose
        round this failure broke): its pulls look for the step's end between slices of
        ``PULL_SLICE_S``. Why the step failed it reads in this task's answer."""
        client = self._client_of(step_id)
        if client is None or client == self.task:
            return
        try:
            call = self.peers.stub(client).CleanupStep.future(
                pb.CleanupStepRequest(step_id=step_id), timeout=CLEANUP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - closing, or a peer with no address: nothing to tell
            return
        with self._telling_lock:
            self._telling.add(call)
        call.add_done_callback(self._told)

    def _told(self, call: grpc.Future) -> None:
        with self._telling_lock:
            self._telling.discard(call)

    def _end_earlier_lives(self, session_handle: str) -> None:
        """A session of a task in a newer incarnation than seen before: the task restarted,
        and what its earlier lives left running here (a partition waiting on a queue or an
        accumulator for a client that is gone) is aborted, before it takes what the new
        incarnation waits for."""
        origin = incarnation_of(session_handle)
        if origin is None:
            return
        task, incarnation = origin
        try:
            number = self.config.cluster.tasks().index(split_task(task))
        except ValueError:
            return  # a task this cluster does not have: nothing of it runs here
        with self._running_lock:
            if incarnation <= self._incarnations.get(task, -1):
                return
            known = task in self._incarnations
            self._incarnations[task] = incarnation
            self.peer_restarts_seen += known
            stale = [s for s in self._running if step_origin(s)[0] == number
                     and step_origin(s)[1] < incarnation]
        if known or stale:
            log.info("%s: %s restarted; ending %d step(s) of its earlier life",
                     self.task, task, len(stale))
        for step_id in stale:
            self.frame_rendezvous.abort_step(
                step_id, StepAbortedError(f"{task} restarted: its step {step_id} is void")
            )

    def cleanup_step(self, step_id: int) -> int:
        return self.frame_rendezvous.end_step(step_id)

    # ---- life cycle

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the server has stopped; False if ``timeout`` passed first."""
        return self._stopped.wait(timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: running steps fail, connections close, state is released."""
        with self._stop_lock:
            if self._stopping:
                stopping_elsewhere = True
            else:
                self._stopping, stopping_elsewhere = True, False
        if stopping_elsewhere:
            self._stopped.wait()
            return
        done = self._grpc.stop(grace)
        self.rendezvous.abort(ConnectionAbortedError(f"task {self.task} is shutting down"))
        # Partitions run on the tensor channel's threads: state closed first wakes those
        # blocked on a queue or an accumulator, so the channel's threads can end.
        self.resources.close()
        self.tensor_server.close()
        done.wait()
        self._handlers.shutdown(wait=False)
        self.peers.close()
        log.info("%s stopped", self.task)
        self._stopped.set()


class _Servicer(pb_grpc.TaskServiceServicer):
    def __init__(self, server: Server):
        self.server = server

    def _fail(self, context, what: str, e: BaseException, node: Node | None = None):
        code, message = failure(self.server.task, what, e, node)
        if what == "RegisterGraph":  # a graph that does not decode: one line, no traceback
            log.warning("%s (from %s)", message[:1000], context.peer())
        context.abort(code, message)

    def RegisterGraph(self, request, context):
        try:
            handle = self.server.register_graph(request.graph_def, request.session_handle)
        except Exception as e:
            error = e
        else:
            return pb.RegisterGraphResponse(graph_handle=handle)
        self._fail(context, "RegisterGraph", error)

    def RunGraph(self, request, context):
        outcome = self.server.run_request(request.graph_handle, request.step_id,
                                          list(request.cleanup_step_ids))
        if isinstance(outcome, tuple):
            code, message = outcome
            context.abort(getattr(grpc.StatusCode, code), message)
        return pb.RunGraphResponse()  # values it would carry stay for pulls

    def _check_ids(self, context, ids) -> None:
        if len(ids) > MAX_STEP_IDS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self.server.task}: {len(ids)} step ids in one call; at most "
                          f"{MAX_STEP_IDS_PER_CALL}")

    def CleanupStep(self, request, context):
        self._check_ids(context, request.more_step_ids)
        dropped = self.server.cleanup_step(request.step_id)
        for step_id in request.more_step_ids:
            dropped += self.server.cleanup_step(step_id)
        return pb.CleanupStepResponse(dropped=dropped)

    def GetStatus(self, request, context):
        s = self.server
        return pb.GetStatusResponse(
            role=s.config.role,
            index=s.config.index,
            task=s.task,
            tensor_address=s.tensor_address,
            tensor_local_address=s.tensor_server.local_address or "",
            num_graphs=len(s._graphs),
            pid=os.getpid(),
            unreceived_values=len(s.rendezvous),
        )

    def Shutdown(self, request, context):
        log.info("%s: shutdown requested", self.server.task)
        threading.Thread(target=self.server.stop, name="shutdown", daemon=True).start()
        return pb.ShutdownResponse()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flowmill.runtime.server",
        description=f"Serve one task of a cluster (the task and cluster come from {ENV_VAR}).",
    )
    parser.add_argument(
        "--bind-host",
        help="where to listen (default: 127.0.0.1 for a loopback address, else 0.0.0.0)",
    )
    parser.add_argument(
        "--recv-timeout",
        type=float,
        default=None,
        help="fail a step whose tensor from a peer takes longer than this many seconds",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = from_env()
    except ClusterSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config is None:
        print(f"error: {ENV_VAR} is not set; it names the cluster and this task", file=sys.stderr)
        return 2
    try:
        server = Server(
            config,
            args.bind_host or default_bind_host(config.address),
            recv_timeout=args.recv_timeout,
        )
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    def on_signal(signum, _frame):
        log.info("%s: %s received", server.task, signal.Signals(signum).name)
        threading.Thread(target=server.stop, name="shutdown", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    endpoint = telemetry.serve_now(server_source(server))
    metrics = f", metrics on {endpoint.url}{METRICS_PATH}" if endpoint is not None else ""
    print(f"{server.task} ready on {config.address}{metrics}", flush=True)
    while not server.join(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
