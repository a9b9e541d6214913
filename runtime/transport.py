"""Tensors between tasks over plain TCP, beside gRPC.

Python gRPC moves tensors several times slower than a raw socket (protobuf ``bytes``
fields copy, messages are framed and buffered whole), so tensor payloads get a channel of
their own and gRPC keeps the control messages. The channel is pull-based, like
TensorFlow's ``RecvTensor``: the consumer's ``_Recv`` asks the producer's task for a key;
the producer's server waits on its rendezvous for that key and streams the value back.

The channel also carries the one control message of every step, ``OP_RUN``: run a
registered partition under a step id (what gRPC's ``RunGraph`` does). Python gRPC costs
about 0.5 ms per unary call on an idle loopback, where a round trip on this channel's
socket costs 0.06 ms; a step sends one per remote partition, and under load the gap
grows (gRPC hands each call through its poller and a thread pool). gRPC keeps the rest of
the control plane (registering graphs, cleanup, status), where a call is rare.

A request names one key (``OP_RECV``) or several (``OP_RECV_MANY``: newline-separated),
which the server answers one reply per key, in order, each as soon as its value is sent:
a step's partition asks a peer once for everything it will receive from it, and the
values stream back while it computes (TensorFlow's ``RecvTensor`` asks per tensor, but
in C++; here each request costs a round of Python on both ends). A reply that is not OK
ends a many-key request; the client asks again for the keys after it.

Design: one request in flight per connection, one server thread per connection. A client
keeps a small pool of idle connections and opens another whenever every pooled one is
busy, so concurrent receivers each get their own connection (and the kernel's flow
control per stream) without a multiplexing layer in Python. A value asked for before it
is sent is answered by the thread that sends it (``_Answer``), and a step's run request
is sent and its answer read by the step's own thread (``start_run``): on a busy machine
every thread woken to pass a message on costs a scheduling round. Payloads go from the array's
own buffer to the socket (``sendmsg`` of header and data, no ``tobytes``) and land with
``recv_into`` straight in the array that is returned. Large receive buffers are recycled
once nothing refers to them any more (see ``BufferPool``): a training step receives the
same shapes every step, and faulting in fresh pages would cost about a third of loopback
bandwidth.

Tasks in one network namespace of one host (a local job's, a laptop's) reach each other's
channel over a Unix socket as well: the server also listens on an abstract Unix address
with a random name, which its task advertises beside ``host:port`` (``GetStatus``), and a
client dials it first. Only a process in the same network namespace can reach an abstract
address, so a peer in another pod or on another host fails to connect at once and keeps
to TCP from then on; no path or port has to be shared or cleaned up. On a two-core
machine a 1 MiB message each way between two processes took 0.30-0.32 ms over a Unix
socket against 1.1-1.3 ms over loopback TCP, and a third of the CPU; the null step of a
100 MB model with one worker went from 71-81 ms to 53-57 ms (``bench/ps_null_step.py``).
The bytes and the protocol are the same on both; with a job's credentials both
authenticate in the same TLS handshake, and only TCP connections seal their bytes after
it (``tls``: a connected Unix socket has no wire to protect).
``FLOWMILL_TENSOR_LOCAL_SOCKET=0`` in a task's environment keeps it to TCP.

The file is long because the channel is one protocol: its wire format, client, server and
buffer pool change together, and split apart each would have to restate the format.

Wire format (little-endian)::

    request: magic "FMq1" | op u8 | 3 pad | timeout f64 (< 0: none) | key_len u32 | key
    reply:   magic "FMp1" | status u8 | flags u8 | ndim u8 | dtype_len u8 | msg_len u32
             | nbytes u64 | dtype (numpy dtype.str) | shape (ndim x u64) | message | payload

The payload is the array in C order. ``flags & 1`` marks the executor's DEAD value (no
payload). An ``OP_RUN`` request's key field is ``handle \n step_id \n cleanup ids``
(comma-separated, maybe none); its reply is OK with no payload once the partition ran, or
``FAILED`` with ``CODE details`` as the message, ``CODE`` a gRPC status code name, as the
task's ``RunGraph`` would have answered. A partition that receives nothing and sends only
to the task that runs it (``partition.answered_sends``; a PS task's reads in an
evaluation step) answers with its values first, one value reply each, in the order of
their keys, then the OK: no pulls follow (TensorFlow's ``RunGraphResponse`` carries
``recv_key`` tensors so). A reply with a non-zero status carries a UTF-8
message instead of data. A request the server cannot frame (bad magic, oversized key)
gets an error reply and the connection is closed; one it can frame but not serve
(unknown op, malformed key) gets an error reply and the connection stays usable.
"""

from __future__ import annotations

import enum
import math
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from flowmill.kernels.registry import DEAD

from . import tls
from .addresses import format_address, parse_address
from .daemons import DaemonPool
from .rendezvous import DuplicateKeyError, PendingRecv, Rendezvous, parse_key
from .tls import SecureStream, TaskCredentials

REQUEST = struct.Struct("<4sB3xdI")
REPLY = struct.Struct("<4sBBBBIQ")
REQUEST_MAGIC = b"FMq1"
REPLY_MAGIC = b"FMp1"
OP_RECV = 1
OP_RECV_MANY = 2  # the key field holds several keys, separated by KEY_SEPARATOR
OP_RUN = 3  # run a registered partition: the key field is "handle\nstep_id\ncleanups"
KEY_SEPARATOR = "\n"
FLAG_DEAD = 1
MAX_KEY_BYTES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 14  # an error reply's text, at most
MAX_CONNECTIONS = 512  # connections a tensor server serves at once
IDLE_TIMEOUT_S = 600.0  # a connection with no request for this long is closed
MAX_NDIM = 64
SENDABLE_KINDS = "biufc"  # bool, signed, unsigned, float, complex

# A value up to this size is answered by the thread that sends it; a larger one is handed
# to a thread of the server's pool (it may take a while to leave, and its sender computes
# on). More such threads at once than the limit: answered by the sender after all. At
# 1 MiB a layer's weights or gradients of a model like bench/distributed_step.py's MLP
# (its largest, 784 x 256 float32, is 0.8 MB) leave without a thread handoff: its 1 PS +
# 2 worker steps took 7.1-8.7 ms (sync) and 7.9-9.5 ms (async) where they took 7.5-9.8
# and 8.3-11.1 at 256 KiB, alternating runs.
INLINE_REPLY_BYTES = 1024 * 1024
REPLY_THREADS = 32
# Once a request's first byte is in, the rest must follow within this long.
_REQUEST_READ_TIMEOUT_S = 30.0
# A request's key is read with its header when it fits in this many bytes.
_INLINE_KEY_BYTES = 4096
# The client's first read of a reply: header, metadata and small payloads at once.
_FIRST_READ_BYTES = 16384
# A refused client's remaining bytes are drained this long (and this much) before closing.
_DRAIN_S = 1.0
_DRAIN_BYTES = 1 << 20
# Grace beyond the request's own timeout for the server's reply to arrive.
_REPLY_GRACE_S = 5.0


# A connection: a plain socket, or one whose bytes travel sealed (a job with TLS, over TCP).
Stream = socket.socket | SecureStream

# The local socket: on by default where abstract Unix addresses exist (Linux).
ENV_LOCAL_SOCKET = "FLOWMILL_TENSOR_LOCAL_SOCKET"
LOCAL_SCHEME = "unix-abstract:"
_AF_UNIX = getattr(socket, "AF_UNIX", None)  # None where the platform has no Unix sockets


def local_socket_default(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a tensor server listens on a local socket unless told: on Linux, unless
    ``FLOWMILL_TENSOR_LOCAL_SOCKET`` is ``0``/``false``/``no``/``off``."""
    if not sys.platform.startswith("linux"):
        return False
    return environ.get(ENV_LOCAL_SOCKET, "1").strip().lower() not in ("0", "false", "no", "off")


def _local_name(address: str) -> str:
    """The abstract socket name (leading NUL) of a ``unix-abstract:NAME`` address."""
    if not address.startswith(LOCAL_SCHEME) or len(address) == len(LOCAL_SCHEME):
        raise ValueError(f"not a local tensor address: {address!r} (want {LOCAL_SCHEME}NAME)")
    return "\0" + address[len(LOCAL_SCHEME):]


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # malformed request or key
    TIMEOUT = 2  # no value was sent within the request's timeout
    ABORTED = 3  # the producer's rendezvous was aborted or the step cleaned up
    UNSUPPORTED = 4  # the value cannot travel (object dtype, ...)
    UNAVAILABLE = 5  # the server is shutting down
    INTERNAL = 6
    FAILED = 7  # OP_RUN: the partition failed; the message is "CODE details"


class RemoteError(RuntimeError):
    """The producer could not deliver a key (its rendezvous aborted, or an internal error)."""

    def __init__(self, message: str, status: Status, peer: str, key: str):
        super().__init__(message)
        self.status, self.peer, self.key = status, peer, key


class RunFailed(RuntimeError):
    """A partition run with ``OP_RUN`` failed on its task: ``code`` is the gRPC status code
    name the task gave, ``details`` its message."""

    def __init__(self, code: str, details: str, peer: str):
        super().__init__(f"{code}: {details}")
        self.code, self.details, self.peer = code, details, peer


# What a tensor server runs for OP_RUN: (graph handle, step id, step ids to clean up first)
# -> None when the partition ran, the keys of the values its answer carries when it ran
# and carries values (``partition.answered_sends``), or (gRPC status code name, message)
# when it did not.
Runner = Callable[[str, int, list[int]], "tuple[str, str] | list[str] | None"]


def _run_key(handle: str, step_id: int, cleanups: list[int]) -> str:
    return f"{handle}\n{step_id}\n{','.join(map(str, cleanups))}"


def _parse_run_key(text: str) -> tuple[str, int, list[int]]:
    handle, step, cleanups = text.split("\n")
    if not handle:
        raise ValueError("no graph handle")
    return handle, int(step), [int(c) for c in cleanups.split(",") if c]


def _peer_name(conn: socket.socket, peer) -> str:
    """``host:port`` of a TCP peer; a Unix socket's peer is a process on this host."""
    if conn.family == _AF_UNIX:
        return "local"
    return format_address(*peer[:2])


def _tune(sock: socket.socket) -> None:
    """No Nagle delay for small replies; keepalive so a vanished host ends a wait (TCP
    only: a Unix socket has neither, and its peer is on this host)."""
    if sock.family == _AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class _Closed(Exception):
    """The peer closed the stream; ``got`` of ``wanted`` bytes had arrived."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"connection closed after {got} of {wanted} bytes")
        self.got, self.wanted = got, wanted


def _set_timeout(sock: Stream, timeout: float | None) -> None:
    """``settimeout`` costs system calls even when nothing changes: skip it then."""
    if sock.gettimeout() != timeout:
        sock.settimeout(timeout)


def _readable(sock: Stream) -> bool:
    """Whether a read would not block (data or end of stream), without waiting; ``poll``
    rather than ``select``, which fails for descriptors above FD_SETSIZE."""
    if isinstance(sock, SecureStream) and sock.buffered:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _recv_exact_into(sock: Stream, view: memoryview) -> None:
    got, wanted = 0, len(view)
    while got < wanted:
        n = sock.recv_into(view[got:], wanted - got)
        if n == 0:
            raise _Closed(got, wanted)
        got += n


def _send_parts(sock: Stream, head: bytes, payload: memoryview | None) -> None:
    """Header and payload in one system call when they fit, with no copy of the payload."""
    if isinstance(sock, SecureStream):
        sock.send_parts(head, payload)
        return
    if payload is None or not len(payload):
        sock.sendall(head)
        return
    sent = sock.sendmsg([head, payload])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < len(payload):
        sock.sendall(payload[sent - len(head) :])


def _reply_head(
    status: Status,
    message: str = "",
    *,
    dead: bool = False,
    dtype: str = "",
    shape: tuple = (),
    nbytes: int = 0,
) -> bytes:
    msg = message.encode("utf-8", "replace")
    if len(msg) > MAX_MESSAGE_BYTES:  # an error names what failed; it need not be a book
        msg = msg[: MAX_MESSAGE_BYTES - 3] + b"..."
    dt = dtype.encode("ascii")
    flags = FLAG_DEAD if dead else 0
    return b"".join(
        (
            REPLY.pack(REPLY_MAGIC, status, flags, len(shape), len(dt), len(msg), nbytes),
            dt,
            struct.pack(f"<{len(shape)}Q", *shape),
            msg,
        )
    )


def _as_sendable(value: Any) -> np.ndarray:
    """A C-contiguous NumPy array of a numeric/bool dtype, or TypeError saying why not."""
    if not isinstance(value, np.ndarray):
        if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
            value = value.get()  # a CuPy array: the wire carries host bytes
        else:
            try:
                value = np.asarray(value)
            except (ValueError, TypeError) as e:
                raise TypeError(f"{type(value).__name__} is not an array: {e}") from None
    if value.dtype.kind not in SENDABLE_KINDS or value.dtype.fields is not None:
        raise TypeError(f"dtype {value.dtype} cannot be sent (numeric and bool dtypes only)")
    if value.ndim > MAX_NDIM:
        raise TypeError(f"rank {value.ndim} exceeds {MAX_NDIM}")
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


def _byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (works for every dtype and rank)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


def _value_reply(value: Any) -> tuple[bytes, memoryview | None, int]:
    """A value's reply: its header, its payload and its byte count; for a value that
    cannot travel, a header saying why, no payload and -1."""
    if value is DEAD:
        return _reply_head(Status.OK, dead=True), None, 0
    try:
        arr = _as_sendable(value)
    except TypeError as e:
        return _reply_head(Status.UNSUPPORTED, str(e)), None, -1
    except Exception as e:  # e.g. no memory for a contiguous copy
        return _reply_head(Status.INTERNAL, f"{type(e).__name__}: {e}"), None, -1
    head = _reply_head(Status.OK, dtype=arr.dtype.str, shape=arr.shape, nbytes=arr.nbytes)
    return head, _byte_view(arr), arr.nbytes


class _Answer:
    """The replies to one pull request, each sent by whichever thread has its value first.

    A value already in the rendezvous when it is asked for goes out from the connection's
    thread. One not sent yet is answered by the thread that sends it, from the
    rendezvous's completion callback (``PendingRecv.on_done``; TensorFlow's worker answers
    ``RecvTensor`` from ``RecvLocalAsync``'s callback the same way): waking the
    connection's thread to do it would cost a scheduling round on every hop of a step,
    which on a busy machine is most of the hop. A large value is handed to a thread of the
    server's pool instead, so its sender does not stall on a slow reader. Keys are
    answered in order; a reply that is not a value ends the request. ``lock`` orders the
    threads that write.
    """

    __slots__ = ("server", "conn", "keys", "next", "pending", "lock", "done", "close")

    def __init__(self, server: TensorServer, conn: Stream, keys: list[str]):
        self.server, self.conn, self.keys = server, conn, keys
        self.next = 0  # the key answered next
        self.pending: PendingRecv | None = None  # its registered receiver, while it waits
        self.lock = threading.Lock()
        self.done = False  # every reply is out, or the request was given up
        self.close = False  # the connection must be closed once done

    def advance(self) -> None:
        """Answer keys in order while their values are here, and register for the first
        that is not (lock held)."""
        server, rdv = self.server, self.server.rendezvous
        while self.next < len(self.keys):
            try:
                pending = rdv.start_recv(self.keys[self.next], self._completed)
            except Exception as e:  # aborted rendezvous, duplicate receiver, finished step
                self.write(*server._exception_reply(e))
                self.done = True
                return
            if not pending.done:
                with server._lock:
                    closed = server._closed
                    if not closed:
                        server._pending.add(pending)
                self.pending = pending
                if closed and rdv.cancel_recv(pending):
                    self.pending = None
                    self.write(_reply_head(Status.UNAVAILABLE, "tensor server is closing"), True)
                    self.done = True
                return  # (closed and not withdrawn: its sender answers once this returns)
            if not self.reply(pending):
                return
            self.next += 1
        self.done = True

    def withdraw(self, drop: bool = False) -> bool:
        """Stop waiting for the key (lock held): True when it was withdrawn before a
        sender completed it. When it was not, its sender answers it once the lock is
        free, unless ``drop`` (the client is gone): then nothing more is sent."""
        pending = self.pending
        if pending is None:
            return False
        withdrawn = self.server.rendezvous.cancel_recv(pending)
        if withdrawn or drop:
            self.pending = None  # a sender that completed it finds it gone
            self.server._forget(pending)
            self.done = True
        return withdrawn

    def _completed(self, pending: PendingRecv) -> None:
        """``on_done`` of the key waited for, on the thread that completed it."""
        try:
            if pending._error is None and \
                    getattr(pending._value, "nbytes", 0) > INLINE_REPLY_BYTES and \
                    self.server._repliers.submit(self._resume, pending):
                return
            self._resume(pending)
        except Exception:  # noqa: BLE001 - never into the sender; the client sees a close
            self._abandon()

    def _resume(self, pending: PendingRecv) -> None:
        try:
            with self.lock:
                if self.pending is not pending:  # withdrawn meanwhile
                    return
                self.pending = None
                self.server._forget(pending)
                if self.reply(pending):
                    self.next += 1
                    self.advance()
        except Exception:  # noqa: BLE001 - a pool thread's job must not raise either
            self._abandon()

    def reply(self, pending: PendingRecv) -> bool:
        """Send the outcome of a completed key (lock held): True when it was a value."""
        try:
            value = pending.result()
        except Exception as e:
            self.write(*self.server._exception_reply(e))
            self.done = True
            return False
        head, payload, nbytes = _value_reply(value)
        self.write(head, False, payload)
        if self.done:  # the write failed
            return False
        if nbytes < 0:
            self.done = True
            return False
        if payload is not None:  # a value, not a dead one
            self.server._count_sent(nbytes)
        return True

    def write(self, head: bytes, close: bool = False,
              payload: memoryview | None = None) -> None:
        """One reply (lock held); ``close``: the connection ends after it. A failed write
        ends the request and the connection."""
        self.close = self.close or close
        try:
            _send_parts(self.conn, head, payload)
        except (OSError, ValueError):
            self.done = self.close = True
        if self.close:
            self._wake_reader()

    def _abandon(self) -> None:
        self.done = self.close = True
        self._wake_reader()

    def _wake_reader(self) -> None:
        """End the connection's reading side, so its thread (waiting for the client)
        sees the end of stream and closes the connection."""
        try:
            self.conn.shutdown(socket.SHUT_RD)
        except OSError:
            pass


class TensorServer:
    """Serves the values of one rendezvous to remote receivers (a thread per connection).

    At most ``max_connections`` are served at once (one more is answered UNAVAILABLE and
    closed: a flood of connections costs a thread each), and a connection idle for
    ``idle_timeout`` seconds between requests is closed (a client finds that out when it
    next takes the connection from its pool, and dials again). The accept loop outlives
    any failure to serve one connection.

    ``close()`` stops accepting, fails requests that are waiting for a value with an
    UNAVAILABLE reply, and shuts every connection down, so no thread is left blocked.

    With ``credentials``, a connection is served only once its peer has shown a
    certificate of the same job run (``tls``); every byte after that travels sealed, but
    on the local socket, which has no wire to protect.

    With ``local`` (the default where ``local_socket_default()``), it also listens on an
    abstract Unix address of a random name, ``local_address``, for peers in its network
    namespace; connections from either listener are served alike.
    """

    def __init__(self, rendezvous: Rendezvous, host: str = "127.0.0.1", port: int = 0, *,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout: float = IDLE_TIMEOUT_S,
                 credentials: TaskCredentials | None = None, runner: Runner | None = None,
                 local: bool | None = None):
        self.rendezvous = rendezvous
        self.runner = runner  # OP_RUN, where the task runs partitions (None: refused)
        self.credentials = credentials
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        tcp = socket.create_server((host, port), family=family, backlog=128)
        self.host, self.port = host, tcp.getsockname()[1]
        self._listeners = [tcp]
        self.local_address: str | None = None
        if local_socket_default() if local is None else local:
            name = f"flowmill-tensors-{os.getpid()}-{secrets.token_hex(8)}"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                unix.bind("\0" + name)
                unix.listen(128)
            except OSError:
                unix.close()
                tcp.close()
                raise
            self._listeners.append(unix)
            self.local_address = LOCAL_SCHEME + name
        self._lock = threading.Lock()
        self._closed = False
        self._conns: set[Stream] = set()
        self._pending: set[PendingRecv] = set()
        self._threads: set[threading.Thread] = set()
        self._repliers = DaemonPool(f"tensor-reply:{port}", REPLY_THREADS)
        self.values_sent = 0  # tensors served to peers, and their bytes (for /metrics)
        self.bytes_sent = 0
        self._accepters = [
            threading.Thread(target=self._accept_loop, args=(listener,),
                             name=f"tensor-server:{where}", daemon=True)
            for listener, where in zip(self._listeners, (self.port, "local"), strict=False)
        ]
        for accepter in self._accepters:
            accepter.start()

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def __enter__(self) -> TensorServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _forget(self, pending: PendingRecv) -> None:
        with self._lock:
            self._pending.discard(pending)

    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
            listener.close()
        closing = ConnectionAbortedError(f"tensor server {self.address} is shutting down")
        for p in pending:
            self.rendezvous.cancel_recv(p, closing)
        deadline = time.monotonic() + timeout
        for accepter in self._accepters:
            accepter.join(max(0.0, deadline - time.monotonic()))
        # Reading ends first: idle connections see end of stream while woken waiters can
        # still write their UNAVAILABLE reply; whatever is left after the deadline is cut.
        self._shutdown_connections(socket.SHUT_RD)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._shutdown_connections(socket.SHUT_RDWR):
            for t in threads:
                t.join(0.5)

    def _shutdown_connections(self, how: int) -> int:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(how)
            except OSError:
                pass
        return len(conns)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of descriptors or similar: keep serving the others
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
                    t = threading.Thread(
                        target=self._serve,
                        args=(conn,),
                        name=f"tensor-conn:{_peer_name(conn, peer)}",
                        daemon=True,
                    )
                    self._threads.add(t)
            if full:
                self._turn_away(conn, f"{self.max_connections} connections are open already")
                continue
            try:
                t.start()
            except RuntimeError as e:  # no thread to be had: this connection goes, not the loop
                with self._lock:
                    self._conns.discard(conn)
                    self._threads.discard(t)
                self._turn_away(conn, f"cannot serve a connection now: {e}")

    @staticmethod
    def _turn_away(conn: socket.socket, why: str) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(_reply_head(Status.UNAVAILABLE, why))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: Stream) -> None:
        buf = bytearray(REQUEST.size + _INLINE_KEY_BYTES)
        view = memoryview(buf)
        try:
            _tune(conn)
            if self.credentials is not None:
                sealed = self._secure(conn)
                if sealed is None:
                    return
                conn = sealed
            while not self._closed:
                _set_timeout(conn, self.idle_timeout)  # a pooled connection, at rest
                try:
                    n = conn.recv_into(view)  # header and key usually arrive together
                except TimeoutError:
                    return  # idle too long: the client dials again when it needs to
                if n == 0:
                    return
                if n < REQUEST.size:
                    _set_timeout(conn, _REQUEST_READ_TIMEOUT_S)
                    _recv_exact_into(conn, view[n : REQUEST.size])
                    n = REQUEST.size
                magic, op, timeout, key_len = REQUEST.unpack_from(buf)
                if magic != REQUEST_MAGIC:
                    self._refuse(conn, f"bad request magic {magic!r}")
                    return
                if key_len > MAX_KEY_BYTES:
                    self._refuse(conn, f"key length {key_len} exceeds {MAX_KEY_BYTES}")
                    return
                end = REQUEST.size + key_len
                if n > end:
                    self._refuse(conn, "bytes beyond the request: one request at a time")
                    return
                if end > len(buf):  # a new buffer: a bytearray with a view cannot grow
                    buf = bytearray(buf) + bytes(end - len(buf))
                    view = memoryview(buf)
                if n < end:
                    _set_timeout(conn, _REQUEST_READ_TIMEOUT_S)
                    _recv_exact_into(conn, view[n:end])
                raw_key = bytes(view[REQUEST.size : end])
                if op == OP_RUN and self.runner is not None:
                    self._serve_run(conn, raw_key)
                    continue
                if op not in (OP_RECV, OP_RECV_MANY):
                    self._reply(conn, Status.BAD_REQUEST, f"unknown op {op}")
                    continue
                try:
                    text = raw_key.decode("utf-8")
                    keys = text.split(KEY_SEPARATOR) if op == OP_RECV_MANY else [text]
                    for key in keys:
                        parse_key(key)
                except (UnicodeDecodeError, ValueError) as e:
                    self._reply(conn, Status.BAD_REQUEST, f"malformed key: {e}")
                    continue
                if math.isnan(timeout):
                    self._reply(conn, Status.BAD_REQUEST, "timeout is NaN")
                    continue
                if not self._answer(conn, keys, None if timeout < 0 else timeout):
                    return
                if getattr(conn, "retired", False):
                    return
        except (OSError, _Closed):
            return  # the client went away or sent a truncated request: drop only this one
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _serve_run(self, conn: Stream, raw: bytes) -> None:
        """Run a partition on this connection's thread and say how it went."""
        try:
            handle, step_id, cleanups = _parse_run_key(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            self._reply(conn, Status.BAD_REQUEST, f"malformed run request: {e}")
            return
        try:
            outcome = self.runner(handle, step_id, cleanups)
        except Exception as e:  # noqa: BLE001 - the runner's own bug: the client hears it
            outcome = ("INTERNAL", f"{type(e).__name__}: {e}")
        if isinstance(outcome, tuple):
            self._reply(conn, Status.FAILED, f"{outcome[0]} {outcome[1]}")
            return
        for key in outcome or ():
            if not self._carry(conn, key):
                return  # the reply said why; the run's own is not sent
        self._reply(conn, Status.OK, "")

    def _carry(self, conn: Stream, key: str) -> bool:
        """Reply with a value the partition just sent, taking it out of the rendezvous
        (the run's answer carries it: no pull follows); False when it could not go."""
        try:
            value = self.rendezvous.recv(key, 0.0)
        except Exception as e:  # noqa: BLE001 - not sent after all, or its step was aborted
            self._reply_raw(conn, self._exception_reply(e)[0])
            return False
        head, payload, nbytes = _value_reply(value)
        _set_timeout(conn, self.idle_timeout)  # a value's bytes leave at the reader's pace
        _send_parts(conn, head, payload)
        if nbytes < 0:
            return False
        if payload is not None:  # a value, not a dead one
            self._count_sent(nbytes)
        return True

    def _count_sent(self, nbytes: int) -> None:
        with self._lock:
            self.values_sent += 1
            self.bytes_sent += nbytes

    def _secure(self, conn: socket.socket) -> Stream | None:
        """The stream over ``conn`` once its peer proved membership (sealed, unless it is
        the local socket), or None (the refusal is logged, the connection closed)."""
        try:
            peer = _peer_name(conn, conn.getpeername())
        except OSError:
            peer = "a peer that left"
        try:
            stream = tls.accept(conn, self.credentials)
        except tls.HandshakeError as e:
            tls.log_refused(peer, e)
            return None
        with self._lock:  # ``close()`` must reach the stream, not the detached socket
            self._conns.discard(conn)
            self._conns.add(stream)
        return stream

    def _answer(self, conn: Stream, keys: list[str], timeout: float | None) -> bool:
        """Answer a pull of ``keys``: True to serve the connection's next request, False
        to close it. Values already here go out from this thread; the rest from the
        threads that send them (``_Answer``) while this one waits for its client, who may
        hang up, or for ``timeout`` (a key not sent by then is answered TIMEOUT)."""
        _set_timeout(conn, None)  # a value's bytes leave at the reader's pace
        answer = _Answer(self, conn, keys)
        with answer.lock:
            answer.advance()
            if answer.done:
                return not answer.close
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        while True:
            if deadline is None:  # no deadline: wake once in a while to close when idle
                wait_ms = self.idle_timeout * 1000
            else:
                wait_ms = max(deadline - time.monotonic(), 0.0) * 1000
            # Readable before every reply is out: end of stream (the client is gone, or
            # this server is closing), or bytes it may not send yet. Either way, close.
            ready = bool(poller.poll(wait_ms)) or (isinstance(conn, SecureStream)
                                                   and conn.buffered)
            with answer.lock:
                if answer.done:
                    return not answer.close
                if ready:
                    answer.withdraw(drop=True)
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    if answer.withdraw():
                        answer.write(_reply_head(Status.TIMEOUT,
                                                 f"no value was sent in {timeout}s"))
                        return not answer.close
                    deadline = None  # being answered right now, by its sender

    @staticmethod
    def _exception_reply(e: BaseException) -> tuple[bytes, bool]:
        """Why the rendezvous did not deliver, as a reply, and whether the connection must
        close: the server closing, a key received twice, or an abort (with the error it
        was aborted with, or the step's cleanup)."""
        if isinstance(e, ConnectionAbortedError):
            status = Status.UNAVAILABLE
        elif isinstance(e, DuplicateKeyError):
            status = Status.BAD_REQUEST
        else:
            status = Status.ABORTED
        return (_reply_head(status, f"{type(e).__name__}: {e}"),
                isinstance(e, ConnectionAbortedError))

    @classmethod
    def _refuse(cls, conn: Stream, message: str) -> None:
        """Reply BAD_REQUEST to a request that cannot be framed, then end the stream. The
        rest of the client's bytes are drained for a moment first: closing with unread
        input would reset the connection and could destroy the reply before it is read."""
        cls._reply(conn, Status.BAD_REQUEST, message)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(_DRAIN_S)
        drained = 0
        while drained < _DRAIN_BYTES and (n := len(conn.recv(1 << 16))):
            drained += n

    @staticmethod
    def _reply(conn: Stream, status: Status, message: str) -> None:
        TensorServer._reply_raw(conn, _reply_head(status, message))

    @staticmethod
    def _reply_raw(conn: Stream, head: bytes) -> None:
        _set_timeout(conn, _REQUEST_READ_TIMEOUT_S)
        conn.sendall(head)


class BufferPool:
    """Receive buffers for large tensors, handed out again once nothing refers to them.

    Each hand-out is a fresh array over a pooled buffer, made with ``np.frombuffer`` so
    that it is the ``base`` of every view derived from it (NumPy collapses view chains to
    the first array that does not own its memory). A weak reference to it tells when the
    tensor, its slices and any memoryviews of them are all gone. Buffers are kept per
    byte size, up to ``capacity`` bytes in all; beyond that, free buffers of other sizes
    are dropped, and if that is not enough the request is served by a fresh allocation
    that is not kept. One pool is shared by every client of a process by default.
    """

    def __init__(self, capacity: int = 1 << 30, min_bytes: int = 1 << 20):
        self.capacity, self.min_bytes = capacity, min_bytes
        # ``allocate(nbytes)`` for tensors of at least ``min_bytes``, from a pool of its own
        # (pinned host memory in a task with a GPU: CuPy's pool, which also keeps a buffer
        # alive until an asynchronous copy from it ends); None: this pool's own buffers.
        self.allocate: Callable[[int], np.ndarray] | None = None
        self._lock = threading.Lock()
        # nbytes -> [[buffer, weak reference to its current hand-out or None], ...]
        self._slots: dict[int, list[list]] = {}
        self._held = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A 1-d uint8 array of ``nbytes`` whose memory nothing else uses."""
        if nbytes < self.min_bytes or nbytes > self.capacity:
            return np.empty(nbytes, np.uint8)
        if self.allocate is not None:
            return self.allocate(nbytes)
        with self._lock:
            bucket = self._slots.setdefault(nbytes, [])
            for slot in bucket:
                if slot[1] is None or slot[1]() is None:
                    return self._hand_out(slot)
            if self._held + nbytes > self.capacity:
                self._evict(self._held + nbytes - self.capacity)
            if self._held + nbytes > self.capacity:
                return np.empty(nbytes, np.uint8)
            slot = [np.empty(nbytes, np.uint8), None]
            bucket.append(slot)
            self._held += nbytes
            return self._hand_out(slot)

    @staticmethod
    def _hand_out(slot: list) -> np.ndarray:
        out = np.frombuffer(memoryview(slot[0]), np.uint8)
        slot[1] = weakref.ref(out)
        return out

    def _evict(self, need: int) -> None:
        for size, bucket in list(self._slots.items()):
            free = [s for s in bucket if s[1] is None or s[1]() is None]
            for slot in free[: -(-need // size)]:
                bucket.remove(slot)
                self._held -= size
                need -= size
            if not bucket:
                del self._slots[size]
            if need <= 0:
                return

    def clear(self) -> None:
        """Forget every buffer (those in use stay alive through their tensors)."""
        with self._lock:
            self._slots.clear()
            self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held


DEFAULT_BUFFER_POOL = BufferPool()


class PendingRun:
    """A partition run requested with ``TensorClient.start_run``, its answer not read yet.

    ``wait`` reads it (and raises as ``TensorClient.run`` does), with the values it carries
    (``carried``: their keys, in the order the server sends them); asked again, it gives
    what it gave (or raises what it raised) the first time. ``abandon`` gives the answer
    up, closing the connection it would have come on."""

    __slots__ = ("client", "conn", "key", "timeout", "carried", "_values", "_error")

    def __init__(self, client: TensorClient, conn: Stream, key: str, timeout: float | None,
                 carried: tuple[str, ...] = ()):
        self.client, self.conn, self.key, self.timeout = client, conn, key, timeout
        self.carried = carried
        self._values: dict[str, Any] | None = None
        self._error: Exception | None = None

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """The answer: the carried values by key; ``timeout`` (else the request's) bounds
        the wait from now."""
        if self._values is None and self._error is None:
            got: list[Any] = []

            def deliver(i: int, value: Any) -> None:
                if value is None and i < len(self.carried):  # the run's own OK came first
                    raise RemoteError(f"run step {self.key!r} at tensor server "
                                      f"{self.client.peer} answered without the values "
                                      f"it was to carry ({self.carried[i]!r})",
                                      Status.INTERNAL, self.client.peer, self.carried[i])
                got.append(value)

            try:
                self.client._answers(self.conn, OP_RUN, [*self.carried, self.key],
                                     self.timeout if timeout is None else timeout, deliver,
                                     None)
            except Exception as e:
                self._error = e
                raise
            self._values = dict(zip(self.carried, got, strict=False))
        if self._error is not None:
            raise self._error
        return self._values

    def ready(self, timeout: float) -> bool:
        """Whether the answer is here (or was read), waiting up to ``timeout`` seconds: a
        caller that must also watch for something else waits in slices."""
        if self._values is not None or self._error is not None:
            return True
        if isinstance(self.conn, SecureStream) and self.conn.buffered:
            return True
        poller = select.poll()
        poller.register(self.conn, select.POLLIN)
        return bool(poller.poll(timeout * 1000))

    def abandon(self) -> None:
        self.conn.close()


class TensorClient:
    """Pulls tensors from one TensorServer. Thread-safe; concurrent ``recv`` calls each use
    their own connection, idle ones are pooled (up to ``max_idle``).

    With ``credentials``, every connection opens with a TLS handshake that shows them and
    checks that the server's certificate names ``peer_name`` (``ps-0``), and then travels
    sealed (``tls``), but to the server's local socket.

    With ``local_address`` (the server's ``local_address``), connections are dialed there
    first; once that fails (the server is in another network namespace or on another
    host) the client keeps to ``address`` over TCP. ``transport`` says which it uses."""

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        local_address: str | None = None,
        max_idle: int = 16,
        connect_timeout: float = 10.0,
        io_timeout: float = 60.0,
        buffer_pool: BufferPool | None = None,
        credentials: TaskCredentials | None = None,
        peer_name: str | None = None,
    ):
        if credentials is not None and not peer_name:
            raise ValueError("a client with credentials must name the task it dials")
        self.host, self.port = parse_address(address)
        self.peer = format_address(self.host, self.port)
        self._local_name = None if local_address is None else _local_name(local_address)
        self.credentials, self.peer_name = credentials, peer_name
        self.max_idle, self.connect_timeout, self.io_timeout = max_idle, connect_timeout, io_timeout
        self.buffers = buffer_pool if buffer_pool is not None else DEFAULT_BUFFER_POOL
        self._lock = threading.Lock()
        self._idle: list[Stream] = []
        self._closed = False
        self.requests = 0  # pull requests sent (a many-key request counts once)
        self.runs = 0  # partitions run (OP_RUN)

    def __enter__(self) -> TensorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _checkout(self) -> Stream:
        with self._lock:
            if self._closed:
                raise ConnectionError(f"tensor client for {self.peer} is closed")
            while self._idle:
                conn = self._idle.pop()
                if not _readable(conn):  # neither closed by the server nor holding stray bytes
                    return conn
                conn.close()
        conn = self._dial()
        if self.credentials is None:
            return conn
        try:
            return tls.connect(conn, self.credentials, self.peer_name,
                               timeout=self.connect_timeout)
        except tls.HandshakeError as e:
            raise ConnectionError(
                f"tensor server {self.peer} ({self.peer_name}): {e}") from None

    @property
    def transport(self) -> str:
        """``unix`` while connections go to the server's local socket, else ``tcp``."""
        return "tcp" if self._local_name is None else "unix"

    def _dial(self) -> socket.socket:
        name = self._local_name
        if name is not None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(self.connect_timeout)
            try:
                conn.connect(name)
                return conn
            except OSError:  # not in the server's network namespace: TCP from now on
                conn.close()
                self._local_name = None
        try:
            conn = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"connecting to tensor server {self.peer} timed out after {self.connect_timeout}s"
            ) from None
        except OSError as e:
            raise ConnectionError(f"cannot connect to tensor server {self.peer}: {e}") from e
        _tune(conn)
        return conn

    def _checkin(self, conn: Stream) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def recv(self, key: str, timeout: float | None = None, out: np.ndarray | None = None) -> Any:
        """The value sent under ``key`` at the server's rendezvous: an ndarray, or DEAD.

        Waits up to ``timeout`` seconds for the producer to send it (None: forever).
        ``out``, a C-contiguous writable array of the value's dtype and shape, receives the
        bytes in place. Raises TimeoutError or ConnectionError naming the key and the peer,
        RemoteError when the producer's rendezvous was aborted, ValueError for a malformed
        key, TypeError for a value that cannot travel.
        """
        got: list[Any] = []
        self._ask(OP_RECV, [key], timeout, lambda _, value: got.append(value), out)
        return got[0]

    def run(self, handle: str, step_id: int, cleanups: list[int],
            timeout: float | None = None) -> None:
        """Run the partition registered under ``handle`` on the server's task for step
        ``step_id``, after cleaning up the steps ``cleanups``; returns once it ran.

        Raises RunFailed with the task's status code and message when the partition
        failed there, TimeoutError after ``timeout`` seconds without an answer, and
        ConnectionError when the task went away."""
        self.start_run(handle, step_id, cleanups, timeout).wait()

    def start_run(self, handle: str, step_id: int, cleanups: list[int],
                  timeout: float | None = None, carried: tuple[str, ...] = ()) -> PendingRun:
        """Send ``run``'s request and return without waiting for the answer: the caller
        goes on (runs its own partition) and reads it with ``PendingRun.wait``, on the
        same thread, so no other thread is woken to send or to receive it. ``carried``:
        the keys of the values the answer carries (the server's ``Runner`` says which)."""
        key = _run_key(handle, step_id, cleanups)
        return PendingRun(self, self._request(OP_RUN, [key], timeout), key, timeout, carried)

    def recv_many(self, keys: list[str], timeout: float | None,
                  deliver: Callable[[int, Any], None]) -> None:
        """Ask for every key of ``keys`` in one request; ``deliver(i, value)`` is called
        with each value, in order, as it arrives. ``timeout`` bounds the wait for each.
        Raises as ``recv`` does at the first key not answered with a value; the keys
        before it were delivered."""
        if any(KEY_SEPARATOR in k for k in keys):
            raise ValueError(f"a key holds {KEY_SEPARATOR!r}: ask for it alone")
        self._ask(OP_RECV_MANY, keys, timeout, deliver, None)

    def _ask(self, op: int, keys: list[str], timeout: float | None,
             deliver: Callable[[int, Any], None], out: np.ndarray | None) -> None:
        self._answers(self._request(op, keys, timeout), op, keys, timeout, deliver, out)

    def _request(self, op: int, keys: list[str], timeout: float | None) -> Stream:
        """A connection with the request for ``keys`` sent on it."""
        raw = KEY_SEPARATOR.join(keys).encode("utf-8")
        if len(raw) > MAX_KEY_BYTES:
            raise ValueError(f"rendezvous key of {len(raw)} bytes exceeds {MAX_KEY_BYTES}")
        conn = self._checkout()
        if op == OP_RUN:
            self.runs += 1
        else:
            self.requests += 1
        try:
            _set_timeout(conn, None if timeout is None else timeout + _REPLY_GRACE_S)
            conn.sendall(REQUEST.pack(REQUEST_MAGIC, op, -1.0 if timeout is None else timeout,
                                      len(raw)) + raw)
        except (OSError, _Closed) as e:
            conn.close()
            raise self._failed(e, op, keys[0], timeout) from None
        return conn

    def _answers(self, conn: Stream, op: int, keys: list[str], timeout: float | None,
                 deliver: Callable[[int, Any], None], out: np.ndarray | None) -> None:
        """Read the replies to the request on ``conn``, one per key, until one is not a
        value; the connection goes back to the pool when it can be used again."""
        reusable = False
        key = keys[0]
        what = "run step" if op == OP_RUN else "recv"
        try:
            for i, key in enumerate(keys):
                status, message, value, reusable = self._reply(
                    conn, key, timeout, out, op != OP_RECV_MANY and len(keys) == 1)
                if status != Status.OK:
                    break
                deliver(i, value)
            else:
                return
        except (OSError, _Closed) as e:
            reusable = False
            raise self._failed(e, op, key, timeout) from None
        finally:
            if reusable and not getattr(conn, "retired", False):
                self._checkin(conn)
            else:
                conn.close()
        if status == Status.FAILED:
            code, _, details = message.partition(" ")
            raise RunFailed(code, details, self.peer)
        text = f"{what} {key!r} at tensor server {self.peer}: {status.name}: {message}"
        if status == Status.TIMEOUT:
            raise TimeoutError(text)
        if status == Status.UNAVAILABLE:
            raise ConnectionError(text)
        if status == Status.BAD_REQUEST:
            raise ValueError(text)
        if status == Status.UNSUPPORTED:
            raise TypeError(text)
        raise RemoteError(text, status, self.peer, key)

    def _failed(self, e: OSError | _Closed, op: int, key: str,
                timeout: float | None) -> Exception:
        """What a failed exchange with the server raises: TimeoutError or ConnectionError,
        naming the request and the server."""
        what = "run step" if op == OP_RUN else "recv"
        if isinstance(e, _Closed):
            return ConnectionError(
                f"tensor server {self.peer} closed the connection while answering {what} "
                f"{key!r} ({e.got} of {e.wanted} bytes of a message had arrived)")
        if isinstance(e, TimeoutError):
            waited = "no reply" if timeout is None else f"no reply within {timeout}s"
            return TimeoutError(f"{what} {key!r} at tensor server {self.peer}: {waited} "
                                f"(or the transfer stalled for {self.io_timeout}s)")
        return ConnectionError(f"{what} {key!r} at tensor server {self.peer}: {e}")

    def _reply(
        self, conn: Stream, key: str, timeout: float | None, out: np.ndarray | None,
        alone: bool,
    ) -> tuple[Status, str, Any, bool]:
        """One reply: (status, message, value, connection reusable).

        The reply ``alone`` on its connection is read greedily: the first read takes
        whatever has arrived (header, metadata and, for a small tensor, the whole payload:
        one system call). A reply to a many-key request may be followed by the next one,
        so its header is read alone and the rest to the exact length it gives."""
        _set_timeout(conn, None if timeout is None else timeout + _REPLY_GRACE_S)
        buf = bytearray(_FIRST_READ_BYTES)
        view = memoryview(buf)
        first = view if alone else view[: REPLY.size]
        n = 0
        while n < REPLY.size:
            got = conn.recv_into(first[n:])
            if not got:
                raise _Closed(n, REPLY.size)
            n += got
        magic, status, flags, ndim, dtype_len, msg_len, nbytes = REPLY.unpack_from(buf)
        if magic != REPLY_MAGIC:
            return Status.INTERNAL, f"bad reply magic {magic!r} (not a tensor server?)", None, False
        meta_end = REPLY.size + dtype_len + 8 * ndim + msg_len
        if n < meta_end:
            if meta_end > len(buf):  # a new buffer: a bytearray with a view cannot grow
                buf = bytearray(buf) + bytes(meta_end - len(buf))
                view = memoryview(buf)
            _set_timeout(conn, self.io_timeout)
            _recv_exact_into(conn, view[n:meta_end])
            n = meta_end
        try:
            status = Status(status)
        except ValueError:
            return Status.INTERNAL, f"unknown status {status}", None, False
        if n > meta_end + (nbytes if status == Status.OK and not flags & FLAG_DEAD else 0):
            return Status.INTERNAL, "bytes beyond the reply", None, False
        if status != Status.OK:
            message = bytes(view[meta_end - msg_len : meta_end]).decode("utf-8", "replace")
            return status, message, None, True
        if flags & FLAG_DEAD:
            return status, "", DEAD, True
        if not dtype_len:  # OP_RUN's answer: done, no value
            return status, "", None, True
        start = REPLY.size + dtype_len
        try:
            dtype = np.dtype(bytes(view[REPLY.size : start]).decode("ascii"))
        except (TypeError, ValueError, UnicodeDecodeError):
            return Status.INTERNAL, f"bad dtype {bytes(view[REPLY.size : start])!r}", None, False
        shape = struct.unpack_from(f"<{ndim}Q", buf, start)
        if dtype.kind not in SENDABLE_KINDS or math.prod(shape) * dtype.itemsize != nbytes:
            message = f"inconsistent reply {dtype}{list(shape)}/{nbytes}B"
            return Status.INTERNAL, message, None, False
        arr = self._destination(key, dtype, shape, nbytes, out)
        if nbytes:
            dest = _byte_view(arr)
            early = n - meta_end
            dest[:early] = view[meta_end:n]
            if early < nbytes:
                if nbytes - early > _INLINE_KEY_BYTES:
                    _set_timeout(conn, self.io_timeout)
                _recv_exact_into(conn, dest[early:])
        return status, "", arr, True

    def _destination(
        self, key: str, dtype: np.dtype, shape: tuple, nbytes: int, out: np.ndarray | None
    ) -> np.ndarray:
        if out is None:
            return self.buffers.take(nbytes).view(dtype).reshape(shape)
        if out.dtype != dtype or out.shape != shape:
            raise ValueError(
                f"recv {key!r}: out is {out.dtype}{list(out.shape)}, "
                f"the value is {dtype}{list(shape)}"
            )
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError(f"recv {key!r}: out must be C-contiguous and writable")
        return out
