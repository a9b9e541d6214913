"""How a task reaches its peers: the peer cache and the rendezvous that pulls from them.

``Peers`` keeps a gRPC stub per task of the cluster and a bulk tensor client per task
pulled from. ``ServerRendezvous`` is what a task's partitions run against: a ``_Send``
leaves its value in the task's own rendezvous, and a ``_Recv`` takes a value produced on
this task from there and pulls one produced elsewhere from that task's tensor server. A
step that fails here is ended here (``abort_step``): its local waiters wake with the error
and its pending pulls give up, so no partition waits for a value that will never come.

A partition about to run says which values it will receive (``prefetch``): each peer
that produces two or more of them is asked once for all, on a thread of a ``DaemonPool``,
and the values stream in while the partition computes; each ``_Recv`` then takes its
value from the slot it landed in. Asked per value, each costs a round trip of Python on
both ends, one after another, and the partition waits out each. A slot whose value did
not come (the step ended, the peer went away) sends its ``_Recv`` to the per-value pull,
which knows what to make of that.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from flowmill.kernels.cancellation import Cancellation

from . import trace
from .cluster import TaskConfig, identity
from .daemons import DaemonPool
from .device_names import split_task, task_name
from .protos import task_service_pb2 as pb
from .protos import task_service_pb2_grpc as pb_grpc
from .rendezvous import PendingRecv, Rendezvous, StepCancelledError
from .tls import TaskCredentials, grpc_channel
from .transport import RemoteError, TensorClient

# GraphDefs carry constants and may be large: gRPC's 4 MiB default would refuse them. The
# bound stays finite (a message is held whole in memory before it is decoded), and a task
# may set its own with FLOWMILL_GRPC_MAX_MESSAGE_BYTES.
ENV_MAX_MESSAGE = "FLOWMILL_GRPC_MAX_MESSAGE_BYTES"
MAX_MESSAGE_BYTES = int(os.environ.get(ENV_MAX_MESSAGE, 1 << 30))
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# A pull waits this long per request, then looks whether its step was aborted meanwhile.
PULL_SLICE_S = 1.0
# Ended step ids remembered with why they ended, to tell late users of the step.
_ENDED_STEPS_KEPT = 4096
# Threads that ask peers for a partition's values, at most (more at once: asked per value,
# a busy pool is never waited for).
PREFETCH_THREADS = 8


# ---- step ids and incarnations
#
# A step id is the starting task's place in the cluster in the high bits, a counter in the
# low 40. A process's counter starts at the clock in microseconds, its incarnation: every
# step of a restarted task is numbered above every step of its earlier lives, which its
# peers may still remember as finished, or still be running for a client that is gone.
STEP_COUNTER_BITS = 40
STEP_COUNTER_MASK = (1 << STEP_COUNTER_BITS) - 1
_INCARNATION = re.compile(r"^(/job:[^/]+/task:\d+)/incarnation-(\d+)/")


def session_handle(task: str, incarnation: int, unique: str) -> str:
    """A session's handle on its peers, naming its task and the incarnation it runs in."""
    return f"{task}/incarnation-{incarnation}/session-{unique}"


def incarnation_of(handle: str) -> tuple[str, int] | None:
    """(task, incarnation) of a ``session_handle``; None for a handle without them."""
    m = _INCARNATION.match(handle)
    return (m.group(1), int(m.group(2))) if m else None


def step_origin(step_id: int) -> tuple[int, int]:
    """(the starting task's number, the step's counter)."""
    return step_id >> STEP_COUNTER_BITS, step_id & STEP_COUNTER_MASK


class StepAbortedError(StepCancelledError):
    """A step was abandoned on this task because one of its partitions or pulls failed."""


class Peers:
    """gRPC stubs for the cluster's tasks, and a tensor client for each task pulled from.

    A peer's bulk address is asked once (``GetStatus``) and kept; a client whose peer went
    away is dropped, so a restarted peer is found at its new address on the next pull.
    """

    def __init__(self, config: TaskConfig, connect_timeout: float = 10.0,
                 credentials: TaskCredentials | None = None):
        self.config = config
        self.credentials = credentials
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
                channel = grpc_channel(address, self.credentials, identity(*split_task(task)),
                                       CHANNEL_OPTIONS)
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
            client = TensorClient(status.tensor_address,
                                  local_address=status.tensor_local_address or None,
                                  connect_timeout=self.connect_timeout,
                                  credentials=self.credentials,
                                  peer_name=identity(*split_task(task)))
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
_PULL_ALONE = object()  # a prefetch slot whose value its _Recv pulls itself


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
        self._cancellations: dict[int, Cancellation] = {}
        # step id -> key -> the slot a prefetched value lands in
        self._prefetched: dict[int, dict[str, PendingRecv]] = {}
        # step id -> key -> where it comes from instead of a pull (``expect``)
        self._answered: dict[int, dict[str, Callable[[str], Any]]] = {}
        self._prefetcher = DaemonPool("flowmill-prefetch", PREFETCH_THREADS)

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
        if self._answered:
            answers = self._answered.get(int(key[key.rfind(";") + 1 :]))
            take = answers.pop(key, None) if answers is not None else None
            if take is not None:
                return take(key)
        if self._prefetched:
            slots = self._prefetched.get(int(key[key.rfind(";") + 1 :]))
            slot = slots.pop(key, None) if slots is not None else None
            if slot is not None:
                while not slot.wait(PULL_SLICE_S):
                    aborted = self._why_cancelled(key)
                    if aborted is not None:
                        raise aborted
                value = slot.result()
                if value is not _PULL_ALONE:
                    return value
        return self._pull(peer, key)

    def expect(self, step_id: int, keys: Sequence[str], take: Callable[[str], Any]) -> None:
        """Values of step ``step_id`` that reach this task another way than a pull (a
        remote run's answer carries them): their ``_Recv``s call ``take(key)``, on the
        step's own thread, and nothing pulls or prefetches them."""
        with self._lock:
            self._answered.setdefault(step_id, {}).update(dict.fromkeys(keys, take))

    def prefetch(self, step_id: int, prefixes: Sequence[str]) -> None:
        """Ask each peer once for every value of step ``step_id`` it produces for this
        task (``prefixes``: ``_Recv`` keys without the step id, in the order they are
        needed), where it produces two or more. Without a ``recv_timeout`` only: a pull
        with a deadline is left to ``_pull``."""
        if self.recv_timeout is not None:
            return
        answered = self._answered.get(step_id, ())
        by_peer: dict[str, list[str]] = {}
        for prefix in prefixes:
            if f"{prefix}{step_id}" in answered:
                continue
            src = prefix[: prefix.find(";")]
            peer = self._route.get(src, _UNROUTED)
            if peer is _UNROUTED:
                peer = self._route_of(src)
            if peer is not None:
                by_peer.setdefault(peer, []).append(f"{prefix}{step_id}")
        for peer, keys in by_peer.items():
            if len(keys) < 2:
                continue
            slots = [PendingRecv(k) for k in keys]
            with self._lock:
                if step_id in self._ended:
                    return
                table = self._prefetched.setdefault(step_id, {})
                for slot in slots:
                    table[slot.key] = slot
            if not self._prefetcher.submit(self._pull_many, peer, step_id, slots):
                with self._lock:
                    for slot in slots:
                        table.pop(slot.key, None)

    def _pull_many(self, peer: str, step_id: int, slots: list[PendingRecv]) -> None:
        """Fill ``slots`` from one request to ``peer`` (asked again, for the rest, after
        each slice without a value); the slots left over go to ``_pull``."""
        if trace.TRACER is None:
            return self._fill(peer, step_id, slots)
        with trace.TRACER.span(f"pull {len(slots)} from {peer}", "prefetch", step=step_id):
            return self._fill(peer, step_id, slots)

    def _fill(self, peer: str, step_id: int, slots: list[PendingRecv]) -> None:
        done = 0

        def deliver(i: int, value: Any) -> None:
            nonlocal done
            slots[done]._complete(value, None)
            done += 1

        try:
            while done < len(slots) and step_id not in self._ended:
                try:
                    self.peers.tensor_client(peer).recv_many(
                        [s.key for s in slots[done:]], PULL_SLICE_S, deliver)
                except TimeoutError:
                    continue
        except Exception:  # noqa: BLE001 - each _Recv left meets the error in _pull
            pass
        finally:
            for slot in slots[done:]:
                slot._complete(_PULL_ALONE, None)

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
            cancellation = self._cancellations.pop(step_id, None)
            self._prefetched.pop(step_id, None)
            self._answered.pop(step_id, None)
            why = self._ended[step_id]
        if cancellation is not None:  # kernels of the step still waiting on state wake
            cancellation.cancel(why)
        return self.local.cleanup(step_id)

    def cancellation(self, step_id: int) -> Cancellation:
        """The step's cancellation, for kernels that wait on state (already cancelled for
        a step that has ended here)."""
        ended = None
        with self._lock:
            cancellation = self._cancellations.get(step_id)
            if cancellation is None:
                cancellation = Cancellation(f"step {step_id} on {self.task}")
                ended = self._ended.get(step_id)
                if ended is None:
                    self._cancellations[step_id] = cancellation
        if ended is not None:
            cancellation.cancel(ended)
        return cancellation

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


def _renamed(e: Exception, message: str) -> Exception:
    """``e``'s kind of error with a message that says where it happened."""
    try:
        return type(e)(message)
    except Exception:
        return RuntimeError(message)
