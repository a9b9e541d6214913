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
import ipaddress
import logging
import os
import re
import signal
import sys
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from .accumulators import CoordinationClosedError
from .checkpoint import CorruptCheckpointError
from .cluster import ENV_VAR, ClusterSpecError, TaskConfig, from_env
from .executor import Plan, compile_step, topological_order
from .graph import parse_device
from .graph_def import from_graph_def
from .placement import device_type
from .protos import task_service_pb2 as pb
from .protos import task_service_pb2_grpc as pb_grpc
from .prune import Node
from .queues import OutOfRangeError, QueueClosedError
from .rendezvous import Rendezvous, RendezvousError, StepCancelledError
from .resources import Resources, UninitializedError
from .transport import RemoteError, TensorClient, TensorServer, format_address, parse_address

log = logging.getLogger("flowmill.server")

# GraphDefs carry constants and may be large; gRPC's 4 MiB default would refuse them.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# gRPC servers set SO_REUSEPORT by default, so a second task would silently share a port.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]
# A pull waits this long per request, then looks whether its step was aborted meanwhile.
PULL_SLICE_S = 1.0
# Ended step ids remembered with why they ended, to tell late users of the step.
_ENDED_STEPS_KEPT = 4096


class StepAbortedError(StepCancelledError):
    """A step was abandoned on this task because one of its partitions or pulls failed."""


def task_name(role: str, index: int) -> str:
    return f"/job:{role}/task:{index}"


def split_task(device: str) -> tuple[str, int]:
    """``/job:ps/task:1[/device:CPU:0]`` -> ``("ps", 1)``."""
    fields = parse_device(device)
    if "job" not in fields or not fields.get("task", "").isdigit():
        raise ValueError(f"device {device!r} names no job and task")
    return fields["job"], int(fields["task"])


def _task_of(device: str) -> str | None:
    try:
        return task_name(*split_task(device))
    except ValueError:
        return None


def status_code(e: BaseException) -> grpc.StatusCode:
    """The gRPC status a task answers an error with, after TensorFlow's error codes."""
    if isinstance(e, UninitializedError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, CorruptCheckpointError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(e, (CoordinationClosedError, QueueClosedError)):
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


class Frame:
    """What frame kernels (``_Send``/``_Recv``) read: the step id and the rendezvous."""

    __slots__ = ("step_id", "rendezvous")

    def __init__(self, step_id: int, rendezvous: Any):
        self.step_id = step_id
        self.rendezvous = rendezvous


class Peers:
    """gRPC stubs for the cluster's tasks, and a tensor client for each task pulled from.

    A peer's bulk address is asked once (``GetStatus``) and kept; a client whose peer went
    away is dropped, so a restarted peer is found at its new address on the next pull.
    """

    def __init__(self, config: TaskConfig, connect_timeout: float = 10.0):
        self.config = config
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.TaskServiceStub] = {}
        self._clients: dict[str, TensorClient] = {}
        self._discovering: dict[str, threading.Lock] = {}
        self._closed = False

    def address(self, task: str) -> str:
        role, index = split_task(task)
        return self.config.cluster.address(role, index)

    def stub(self, task: str) -> pb_grpc.TaskServiceStub:
        stub = self._stubs.get(task)
        if stub is not None:
            return stub
        address = self.address(task)
        with self._lock:
            if self._closed:
                raise ConnectionError(f"connections of {self.config.device} are closed")
            if task not in self._stubs:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._channels[task] = channel
                self._stubs[task] = pb_grpc.TaskServiceStub(channel)
            return self._stubs[task]

    def tensor_client(self, task: str) -> TensorClient:
        client = self._clients.get(task)
        if client is not None:
            return client
        with self._lock:
            lock = self._discovering.setdefault(task, threading.Lock())
        with lock:
            client = self._clients.get(task)
            if client is not None:
                return client
            try:
                status = self.stub(task).GetStatus(
                    pb.GetStatusRequest(), timeout=self.connect_timeout
                )
            except grpc.RpcError as e:
                self._redial(task)
                raise ConnectionError(
                    f"task {task} at {self.address(task)} is unreachable: "
                    f"{e.code().name}: {e.details()}"
                ) from None
            client = TensorClient(status.tensor_address, connect_timeout=self.connect_timeout)
            with self._lock:
                if self._closed:
                    client.close()
                    raise ConnectionError(f"connections of {self.config.device} are closed")
                self._clients[task] = client
            return client

    def forget(self, task: str, client: TensorClient) -> None:
        with self._lock:
            if self._clients.get(task) is client:
                del self._clients[task]
        client.close()
        self._redial(task)

    def _redial(self, task: str) -> None:
        """Dial ``task`` anew on next use: a peer that went away may come back in a new pod
        at a new address, which a channel resolved before would never reach (gRPC
        re-resolves a name at most every 30 s). The old channel is not closed under calls
        other threads may still be making on it; it goes with its last stub."""
        with self._lock:
            self._channels.pop(task, None)
            self._stubs.pop(task, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
            channels, self._channels = list(self._channels.values()), {}
            self._stubs.clear()
        for client in clients:
            client.close()
        for channel in channels:
            channel.close()


_UNROUTED = object()


class ServerRendezvous:
    """The rendezvous a task's partitions run against (the frame's ``rendezvous``).

    ``send`` leaves the value in the task's own rendezvous, where the consumer pulls it.
    ``recv`` takes a value produced on this task from that rendezvous, and pulls one
    produced elsewhere from its task's tensor server. A pull waits in slices of
    ``PULL_SLICE_S`` so that it notices when its step is aborted here meanwhile (by
    another partition's failure) instead of waiting for a value that will never come.
    """

    def __init__(
        self,
        local: Rendezvous,
        task: str,
        peers: Peers,
        recv_timeout: float | None = None,
    ):
        self.local = local
        self.task = task
        self.peers = peers
        self.recv_timeout = recv_timeout
        self.send = local.send  # the hot path: no wrapper call
        self._route: dict[str, Any] = {}  # source device -> its task, None for this task
        self._lock = threading.Lock()
        self._ended: OrderedDict[int, BaseException] = OrderedDict()

    def recv(self, key: str) -> Any:
        src = key[: key.find(";")]
        peer = self._route.get(src, _UNROUTED)
        if peer is _UNROUTED:
            peer = self._route_of(src)
        if peer is None:
            try:
                return self.local.recv(key, self.recv_timeout)
            except StepCancelledError as e:
                raise self._why_cancelled(key) or e from None
        return self._pull(peer, key)

    def _route_of(self, src: str) -> str | None:
        try:
            peer = task_name(*split_task(src))
        except ValueError as e:
            raise ValueError(f"rendezvous key source {src!r}: {e}") from None
        peer = None if peer == self.task else peer
        self._route[src] = peer
        return peer

    def _pull(self, peer: str, key: str) -> Any:
        step_id = int(key[key.rfind(";") + 1 :])
        deadline = None if self.recv_timeout is None else time.monotonic() + self.recv_timeout
        rediscovered = False
        while True:
            if step_id in self._ended:  # aborted here meanwhile, or before the pull began
                raise self._why_cancelled(key)
            client = None
            try:
                client = self.peers.tensor_client(peer)
                wait = PULL_SLICE_S
                if deadline is not None:
                    wait = min(wait, max(deadline - time.monotonic(), 0.0))
                return client.recv(key, wait)
            except TimeoutError as e:
                aborted = self._why_cancelled(key)
                if aborted is not None:
                    raise aborted from None
                if deadline is None or time.monotonic() < deadline:
                    continue
                error: Exception = TimeoutError(
                    f"{self.task}: no value from {peer} in {self.recv_timeout}s: {e}"
                )
            except ConnectionError as e:
                if client is not None:
                    self.peers.forget(peer, client)
                    if not rediscovered:  # a restarted peer serves tensors elsewhere now
                        rediscovered = True
                        continue
                error = ConnectionError(f"{self.task}: lost {peer}: {e}")
            except RemoteError as e:
                error = RemoteError(f"{self.task}: {peer} aborted: {e}", e.status, e.peer, e.key)
            except Exception as e:
                error = _renamed(e, f"{self.task}: pulling from {peer}: {e}")
            self.abort_step(step_id, error)
            raise error

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """End a step on this task: its waiters wake with an error naming ``error``, its
        pending pulls from peers are answered ABORTED, and later use of it is refused."""
        self.end_step(step_id, error)

    def end_step(self, step_id: int, error: BaseException | None = None) -> int:
        """Clean a step out of the local rendezvous and remember that it ended (with
        ``error``, or as cleaned up), so that a pull of it still waiting on a peer gives
        up. Returns how many rendezvous entries were dropped."""
        with self._lock:
            if error is not None or step_id not in self._ended:
                self._ended[step_id] = error or StepCancelledError(
                    f"step {step_id} was cleaned up on {self.task}"
                )
                self._ended.move_to_end(step_id)
                if len(self._ended) > _ENDED_STEPS_KEPT:
                    self._ended.popitem(last=False)
        return self.local.cleanup(step_id)

    def step_error(self, step_id: int) -> BaseException | None:
        """Why a step ended here (an error, or its cleanup), or None while it may run."""
        return self._ended.get(step_id)

    def _why_cancelled(self, key: str) -> StepAbortedError | None:
        step_id = int(key[key.rfind(";") + 1 :])
        error = self._ended.get(step_id)
        if error is None:
            return None
        return StepAbortedError(
            f"{self.task}: step {step_id} ended while {key!r} waited: "
            f"{type(error).__name__}: {error}"
        )


@dataclass
class RegisteredGraph:
    handle: str
    plan: Plan
    order: list[Node]  # the plan's node order, to name a failing op
    session_handle: str


_KERNEL_CALL = re.compile(r"\bk(\d+)\(")


def failing_node(graph: RegisteredGraph, e: BaseException) -> Node | None:
    """The node whose kernel raised ``e`` inside the compiled step, if it was one."""
    line = None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<flowmill step>":
            line = tb.tb_lineno
        tb = tb.tb_next
    lines = graph.plan.source.splitlines()
    if line is None or not 0 < line <= len(lines):
        return None
    m = _KERNEL_CALL.search(lines[line - 1])
    if m is None or int(m.group(1)) >= len(graph.order):
        return None
    return graph.order[int(m.group(1))]


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
    ):
        self.config = config
        self.task = task_name(config.role, config.index)
        self.resources = Resources()
        self.rendezvous = Rendezvous()
        self.peers = Peers(config, connect_timeout)
        self.frame_rendezvous = ServerRendezvous(
            self.rendezvous, self.task, self.peers, recv_timeout
        )
        self._graphs: dict[str, RegisteredGraph] = {}
        self._graph_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()
        host, port = parse_address(config.address)
        self.tensor_server = TensorServer(self.rendezvous, bind_host, 0)
        advertised = host if _is_wildcard(bind_host) else bind_host
        self.tensor_address = format_address(advertised, self.tensor_server.port)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"task{self.task}"),
            options=SERVER_OPTIONS,
        )
        pb_grpc.add_TaskServiceServicer_to_server(_Servicer(self), self._grpc)
        where = format_address(bind_host, port)
        try:
            bound = self._grpc.add_insecure_port(where)
        except RuntimeError as e:
            bound, why = 0, str(e)
        else:
            why = "the port is taken"
        if not bound:
            self.tensor_server.close()
            raise OSError(f"task {self.task} cannot listen on {where}: {why}")
        self._grpc.start()
        log.info("%s serving on %s, tensors on %s", self.task, where, self.tensor_address)

    # ---- graphs and steps

    def register_graph(self, graph_def: bytes, session_handle: str = "") -> str:
        """Compile a partition once; equal GraphDef bytes get the same handle."""
        handle = "graph-" + hashlib.sha256(graph_def).hexdigest()[:32]
        with self._graph_lock:
            if handle in self._graphs:
                return handle
            step = from_graph_def(graph_def)
            if step.feeds:
                raise ValueError(f"the graph takes {len(step.feeds)} feeds; a task's takes none")
            devices = sorted({n.device for n in step.nodes})
            for n in step.nodes:
                if _task_of(n.device) != self.task:
                    raise ValueError(
                        f"node {n.name!r} ({n.type}) is placed on {n.device or 'no device'!r}, "
                        f"not on this task"
                    )
            if len(devices) > 1:
                raise ValueError(f"the graph spans devices {devices}; register one per device")
            kind = device_type(devices[0]) if devices else "CPU"
            plan = compile_step(step, self.resources, kind)
            self._graphs[handle] = RegisteredGraph(
                handle, plan, topological_order(step.nodes), session_handle
            )
            log.info(
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
        try:
            graph.plan.run((), Frame(step_id, rdv))
        except Exception as e:
            rdv.abort_step(step_id, e)
            raise

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
        self.tensor_server.close()
        done.wait()
        self.peers.close()
        self.resources.close()
        log.info("%s stopped", self.task)
        self._stopped.set()


def _renamed(e: Exception, message: str) -> Exception:
    """``e``'s kind of error with a message that says where it happened."""
    try:
        return type(e)(message)
    except Exception:
        return RuntimeError(message)


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def default_bind_host(address: str) -> str:
    """Loopback for a task addressed on this machine only, every interface otherwise."""
    host, _ = parse_address(address)
    if host == "localhost":
        return "127.0.0.1"
    try:
        return "127.0.0.1" if ipaddress.ip_address(host).is_loopback else "0.0.0.0"
    except ValueError:  # a host name: a pod's service name resolves to a non-loopback address
        return "0.0.0.0"


class _Servicer(pb_grpc.TaskServiceServicer):
    def __init__(self, server: Server):
        self.server = server

    def _fail(self, context, what: str, e: BaseException, node: Node | None = None):
        op = f"op {node.name!r} ({node.type}): " if node is not None else ""
        message = f"{self.server.task}: {what}: {op}{type(e).__name__}: {e}"
        code = status_code(e)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s", message, exc_info=e)
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
        graph = self.server.graph(request.graph_handle)
        if graph is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"{self.server.task}: RunGraph: no graph is registered under "
                f"{request.graph_handle!r} (a restarted task must be registered with again)",
            )
        for step_id in request.cleanup_step_ids:
            self.server.cleanup_step(step_id)
        try:
            self.server.run_graph(graph, request.step_id)
        except Exception as e:
            error = e
        else:
            return pb.RunGraphResponse()
        self._fail(context, f"step {request.step_id}", error, failing_node(graph, error))

    def CleanupStep(self, request, context):
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
    print(f"{server.task} ready on {config.address}", flush=True)
    while not server.join(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
