"""Tensor transport over real sockets on 127.0.0.1: values arrive bit for bit whatever
their dtype, shape or layout; bad requests, closing servers and dead peers end in clear
errors, never in a hang; and the other clients keep being served meanwhile.

Waiting is observed through the rendezvous' count of waiters, never through sleeps; every
blocking call has a timeout so that a regression fails instead of hanging."""

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from flowmill.kernels import DEAD
from flowmill.runtime import transport
from flowmill.runtime.rendezvous import Rendezvous, make_key
from flowmill.runtime.transport import (
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    BufferPool,
    RemoteError,
    RunFailed,
    Status,
    TensorClient,
    TensorServer,
    parse_address,
)

PS = "/job:ps/task:0/device:CPU:0"
WORKER = "/job:worker/task:0/device:CPU:0"
JOIN_TIMEOUT = 30.0


def key(name: str, step: int = 1) -> str:
    return make_key(PS, WORKER, name, step)


@pytest.fixture
def rdv():
    return Rendezvous()


@pytest.fixture
def server(rdv):
    with TensorServer(rdv) as s:
        yield s


@pytest.fixture(params=["tcp", "unix"])
def client(server, request):
    """A client of ``server`` over each transport: loopback TCP, and the server's local
    Unix socket (what tasks on one host use)."""
    local = server.local_address if request.param == "unix" else None
    with TensorClient(server.address, local_address=local) as c:
        yield c
    assert c.transport == request.param  # it never fell back


class Call(threading.Thread):
    """Runs ``fn`` in a daemon thread and keeps its result or exception."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value = self.error = None
        self.start()

    def run(self):
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # inspected by the test
            self.error = e

    def finish(self):
        self.join(JOIN_TIMEOUT)
        assert not self.is_alive(), "call still blocked"
        return self


def wait_until(predicate, what):
    deadline = time.monotonic() + JOIN_TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def assert_same(got, want):
    want = np.asarray(want)
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.c_contiguous and got.flags.writeable
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", ">i4", ">f8", "<c8",
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_dtypes(rdv, client, dtype):
    value = (np.arange(24) * 7 - 50).reshape(2, 3, 4).astype(dtype)
    rdv.send(key("v"), value)
    assert_same(client.recv(key("v"), timeout=10), value)


SHAPES = {
    "scalar": np.array(3.5),
    "numpy_scalar": np.float32(2.25),
    "python_int": 7,
    "empty": np.zeros((0,), np.float32),
    "empty_inner": np.zeros((3, 0, 2), np.int64),
    "vector": np.arange(5, dtype=np.int16),
    "rank5": np.arange(2 * 3 * 1 * 2 * 2, dtype=np.float64).reshape(2, 3, 1, 2, 2),
    "strided": np.arange(40)[::3],
    "transposed": np.arange(12.0).reshape(3, 4).T,
    "fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
    "negative_stride": np.arange(10)[::-2],
    "column": np.arange(20.0).reshape(4, 5)[:, 1:2],
    "bool_mask": np.arange(9).reshape(3, 3) > 4,
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_round_trip_shapes_and_layouts(rdv, client, name):
    rdv.send(key(name), SHAPES[name])
    assert_same(client.recv(key(name), timeout=10), SHAPES[name])


def test_large_array(rdv, client):
    value = np.arange(25_000_000, dtype=np.float64)  # 200 MB
    value[::4096] = np.pi
    rdv.send(key("big"), value)
    got = client.recv(key("big"), timeout=60)
    assert got.shape == value.shape and np.array_equal(got, value)


def test_dead_passes_through(rdv, client):
    rdv.send(key("branch"), DEAD)
    assert client.recv(key("branch"), timeout=10) is DEAD
    rdv.send(key("after"), np.ones(2))  # the connection is still in step
    assert_same(client.recv(key("after"), timeout=10), np.ones(2))


def test_recv_before_send(rdv, client):
    call = Call(client.recv, key("late"), timeout=JOIN_TIMEOUT)
    wait_until(lambda: rdv.num_waiting() == 1, "the server to wait on the key")
    rdv.send(key("late"), np.arange(3))
    assert_same(call.finish().value, np.arange(3))


def test_a_waiting_pull_is_answered_by_the_sending_thread_and_a_large_one_by_the_pool(
        rdv, client, monkeypatch):
    """No server thread is woken to pass a small value on: the thread that sends it writes
    the reply. A large one is handed to the server's pool, so its sender goes on."""
    writers = []
    real = transport._send_parts

    def recording(sock, head, payload):
        writers.append((threading.current_thread().name, 0 if payload is None else len(payload)))
        real(sock, head, payload)

    monkeypatch.setattr(transport, "_send_parts", recording)
    big = np.ones(transport.INLINE_REPLY_BYTES // 4 + 1, np.float32)
    for name, value in (("small", np.arange(3)), ("big", big)):
        call = Call(client.recv, key(name), timeout=JOIN_TIMEOUT)
        wait_until(lambda: rdv.num_waiting() == 1, "the server to wait on the key")
        rdv.send(key(name), value)
        assert_same(call.finish().value, value)
    assert writers[0] == (threading.current_thread().name, 3 * np.arange(3).itemsize)
    assert writers[1][0].startswith("tensor-reply") and writers[1][1] == big.nbytes


def test_a_client_that_hangs_up_while_waiting_frees_the_key(rdv, server):
    """The connection's thread waits for its client while the key's sender would answer:
    a client gone before the value was sent gives the key up, and the value, sent later,
    waits for the next receiver."""
    raw = key("left").encode()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(REQUEST.pack(REQUEST_MAGIC, 1, -1.0, len(raw)) + raw)
        wait_until(lambda: rdv.num_waiting() == 1, "the server to wait on the key")
    wait_until(lambda: rdv.num_waiting() == 0, "the server to give the key up")
    rdv.send(key("left"), np.ones(2))
    with TensorClient(server.address) as again:
        assert_same(again.recv(key("left"), timeout=10), np.ones(2))


def test_timeout_names_key_and_peer(rdv, server, client):
    with pytest.raises(TimeoutError) as info:
        client.recv(key("never"), timeout=0.2)
    assert "never" in str(info.value) and server.address in str(info.value)
    assert rdv.num_waiting() == 0
    rdv.send(key("never"), np.ones(1))  # a later receiver still gets the value
    assert_same(client.recv(key("never"), timeout=10), np.ones(1))


def test_concurrent_receivers(rdv, server, client):
    n = 12
    calls = [Call(client.recv, key(f"c{i}"), timeout=JOIN_TIMEOUT) for i in range(n)]
    wait_until(lambda: rdv.num_waiting() == n, "every receiver to wait")
    assert server.num_connections() >= n  # one request in flight per connection
    for i in reversed(range(n)):
        rdv.send(key(f"c{i}"), np.full((100, i + 1), i, np.int32))
    for i, call in enumerate(calls):
        assert_same(call.finish().value, np.full((100, i + 1), i, np.int32))
    # the pool keeps a few idle connections and reuses them
    before = server.num_connections()
    rdv.send(key("again"), np.zeros(1))
    client.recv(key("again"), timeout=10)
    assert server.num_connections() <= before


def test_many_threads_many_keys(rdv, client):
    keys = [key(f"m{i}", step=i % 5) for i in range(200)]
    values = {k: np.arange(i % 17 + 1) * i for i, k in enumerate(keys)}
    results = {}

    def pull(ks):
        for k in ks:
            results[k] = client.recv(k, timeout=JOIN_TIMEOUT)

    calls = [Call(pull, keys[i::6]) for i in range(6)]
    for k in reversed(keys):
        rdv.send(k, values[k])
    for c in calls:
        assert c.finish().error is None
    for k in keys:
        assert_same(results[k], values[k])


def test_object_arrays_refused(rdv, client):
    rdv.send(key("obj"), np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(TypeError, match="dtype object cannot be sent"):
        client.recv(key("obj"), timeout=10)
    rdv.send(key("str"), np.array(["x", "y"]))
    with pytest.raises(TypeError, match="numeric and bool dtypes only"):
        client.recv(key("str"), timeout=10)
    rdv.send(key("ok"), np.ones(2))
    assert_same(client.recv(key("ok"), timeout=10), np.ones(2))


def test_malformed_key_from_client(client):
    with pytest.raises(ValueError, match="BAD_REQUEST.*has 1 fields"):
        client.recv("not-a-key", timeout=10)


def test_aborted_rendezvous_is_a_remote_error(rdv, server, client):
    call = Call(client.recv, key("a"), timeout=JOIN_TIMEOUT)
    wait_until(lambda: rdv.num_waiting() == 1, "the server to wait")
    rdv.abort(RuntimeError("partition on /job:ps/task:0 failed"))
    err = call.finish().error
    assert isinstance(err, RemoteError) and err.status == Status.ABORTED
    assert "partition on /job:ps/task:0 failed" in str(err) and server.address in str(err)
    with pytest.raises(RemoteError, match="failed"):
        client.recv(key("b"), timeout=10)


def test_recv_into_out(rdv, client):
    out = np.empty((3, 4), np.float32)
    rdv.send(key("o"), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert client.recv(key("o"), timeout=10, out=out) is out
    assert np.array_equal(out, np.arange(12).reshape(3, 4))
    rdv.send(key("o2"), np.arange(12, dtype=np.float64))
    with pytest.raises(ValueError, match="out is float32"):
        client.recv(key("o2"), timeout=10, out=out)


def test_buffer_pool_reuses_only_unreferenced_buffers():
    mib = 1 << 20
    pool = BufferPool(capacity=8 * mib, min_bytes=mib)

    def address(a):
        return a.__array_interface__["data"][0]

    a = pool.take(2 * mib).view(np.float64).reshape(512, 512)
    first = address(a)
    row = a[3]
    del a
    b = pool.take(2 * mib)
    assert address(b) != first  # a slice keeps the buffer in use
    mv = memoryview(row)
    del row
    c = pool.take(2 * mib)
    assert address(c) not in (first, address(b))  # so does a memoryview
    del mv
    d = pool.take(2 * mib)
    assert address(d) == first  # now nothing refers to it
    assert pool.held_bytes == 6 * mib
    del b, c, d
    big = pool.take(6 * mib)  # free buffers of another size make room
    assert big.nbytes == 6 * mib and pool.held_bytes <= 8 * mib
    other = pool.take(6 * mib)  # no room left: served fresh, not kept
    assert address(other) != address(big) and pool.held_bytes <= 8 * mib
    assert pool.take(100).nbytes == 100  # small requests are not pooled


def test_pooled_receive_buffers_are_not_shared_while_alive(rdv, client):
    n = (4 << 20) // 8
    rdv.send(key("p1"), np.full(n, 1.0))
    first = client.recv(key("p1"), timeout=10)
    rdv.send(key("p2"), np.full(n, 2.0))
    second = client.recv(key("p2"), timeout=10)
    assert (first == 1.0).all() and (second == 2.0).all()


def raw_request(sock, payload: bytes):
    sock.sendall(payload)
    return read_reply(sock)


def read_reply(sock):
    """(status, message) of one error reply, or None when the server closed the stream."""
    head = b""
    while len(head) < REPLY.size:
        try:
            chunk = sock.recv(REPLY.size - len(head))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        head += chunk
    magic, status, _, ndim, dtype_len, msg_len, _ = REPLY.unpack(head)
    assert magic == REPLY_MAGIC
    rest = b""
    while len(rest) < dtype_len + 8 * ndim + msg_len:
        rest += sock.recv(dtype_len + 8 * ndim + msg_len - len(rest))
    return Status(status), rest[dtype_len + 8 * ndim :].decode()


def request(k: bytes, op: int = 1, timeout: float = 5.0, key_len: int | None = None) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, op, timeout, len(k) if key_len is None else key_len) + k


def connect(server) -> socket.socket:
    s = socket.create_connection(parse_address(server.address), timeout=JOIN_TIMEOUT)
    return s


def test_malformed_requests_while_a_good_client_works(rdv, server, client):
    waiting = Call(client.recv, key("good"), timeout=JOIN_TIMEOUT)
    wait_until(lambda: rdv.num_waiting() == 1, "the good request to wait")

    with connect(server) as s:  # garbage: error reply naming the magic, then closed
        status, msg = raw_request(s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == Status.BAD_REQUEST and "magic" in msg
        assert read_reply(s) is None
    with connect(server) as s:  # a key length beyond the limit
        status, msg = raw_request(s, request(b"", key_len=1 << 30))
        assert status == Status.BAD_REQUEST and "key length" in msg
        assert read_reply(s) is None
    with connect(server) as s:  # framed but unservable: the connection stays usable
        status, msg = raw_request(s, request(b"\xff\xfe;;;1"))
        assert status == Status.BAD_REQUEST and "malformed key" in msg
        status, msg = raw_request(s, request(key("x").encode(), op=9))
        assert status == Status.BAD_REQUEST and "unknown op 9" in msg
        status, msg = raw_request(s, request(key("x").encode(), timeout=float("nan")))
        assert status == Status.BAD_REQUEST and "NaN" in msg
        rdv.send(key("raw"), np.arange(3, dtype=np.int8))
        s.sendall(request(key("raw").encode()))
        head = s.recv(REPLY.size, socket.MSG_WAITALL)
        assert REPLY.unpack(head)[1] == Status.OK
    with connect(server) as s:  # key shorter than announced, then the client vanishes
        s.sendall(request(b"/job:ps", key_len=200))
    with connect(server) as s:  # half a header
        s.sendall(REQUEST_MAGIC + b"\x01")
    with connect(server) as s:  # a request for a key nobody sends, then gone
        s.sendall(request(key("abandoned").encode(), timeout=-1))
        wait_until(lambda: rdv.num_waiting() == 2, "the abandoned request to wait")
    # the server notices the client is gone and withdraws its receiver
    wait_until(lambda: rdv.num_waiting() == 1, "the abandoned receiver to be withdrawn")

    rdv.send(key("good"), np.arange(4.0))
    assert_same(waiting.finish().value, np.arange(4.0))
    rdv.send(key("abandoned"), np.ones(1))  # still deliverable to a new receiver
    assert_same(client.recv(key("abandoned"), timeout=10), np.ones(1))


def test_run_requests_reach_the_runner_and_bring_back_its_verdict(rdv):
    """OP_RUN: the server's runner gets the handle, the step id and the steps to clean up,
    on the connection's thread; the client returns once it ran, or raises with the code
    and message the runner gave. Pulls on other connections go on meanwhile."""
    calls, release = [], threading.Event()

    def runner(handle, step_id, cleanups):
        calls.append((handle, step_id, cleanups))
        if handle == "slow":
            release.wait(JOIN_TIMEOUT)
        if handle == "missing":
            return ("NOT_FOUND", "no graph is registered under 'missing'")
        if handle == "buggy":
            raise RuntimeError("the runner itself broke")
        return None

    with TensorServer(rdv, runner=runner) as server, TensorClient(server.address) as client:
        assert client.run("g1", 7, []) is None
        client.run("g1", 8, [6, 7])
        assert calls == [("g1", 7, []), ("g1", 8, [6, 7])]
        assert (client.runs, client.requests) == (2, 0)

        slow = Call(client.run, "slow", 9, [])  # a running partition holds its connection
        wait_until(lambda: len(calls) == 3, "the slow run to start")
        rdv.send(key("meanwhile"), np.arange(2.0))
        assert_same(client.recv(key("meanwhile"), timeout=10), np.arange(2.0))
        assert slow.is_alive()
        release.set()
        assert slow.finish().error is None

        with pytest.raises(RunFailed) as e:
            client.run("missing", 10, [])
        assert (e.value.code, e.value.details) == (
            "NOT_FOUND", "no graph is registered under 'missing'")
        with pytest.raises(RunFailed) as e:
            client.run("buggy", 11, [])
        assert e.value.code == "INTERNAL" and "the runner itself broke" in e.value.details
        with connect(server) as s:  # malformed: the connection stays usable
            status, msg = raw_request(s, request(b"g1\nseven\n", op=3))
            assert status == Status.BAD_REQUEST and "malformed run request" in msg
            status, msg = raw_request(s, request(b"\n1\n", op=3))
            assert status == Status.BAD_REQUEST and "no graph handle" in msg
        client.run("g1", 12, [])  # the client's pooled connections still work


def test_a_run_answer_carries_the_values_the_runner_names(rdv):
    """A runner that returns keys: the run's answer brings their values (taken out of the
    rendezvous, a dead one too) before its own OK, and no pull is made; a key with no
    value fails the answer and the connection serves on; an answer without the values
    the client expects fails at once."""
    sent = {"a": np.arange(3.0), "b": DEAD}

    def runner(handle, step_id, cleanups):
        if handle == "plain":
            return None
        for name, value in sent.items():
            rdv.send(key(name, step_id), value)
        names = [*sent, "never"] if handle == "broken" else list(sent)
        return [key(name, step_id) for name in names]

    with TensorServer(rdv, runner=runner) as server, TensorClient(server.address) as client:
        run = client.start_run("g", 1, [], 10, carried=(key("a", 1), key("b", 1)))
        assert run.ready(10)
        values = run.wait()
        assert_same(values[key("a", 1)], np.arange(3.0))
        assert values[key("b", 1)] is DEAD
        assert run.wait() is values  # read once
        assert (client.runs, client.requests, server.values_sent) == (1, 0, 1)
        assert len(rdv) == 0  # nothing left behind for a pull
        run = client.start_run("broken", 2, [], 10,
                               carried=(key("a", 2), key("b", 2), key("never", 2)))
        with pytest.raises(RemoteError, match="never"):
            run.wait()
        with pytest.raises(RemoteError):
            run.wait()  # the same error again
        rdv.cleanup(2)
        client.run("plain", 3, [])  # the pooled connection still works
        run = client.start_run("plain", 4, [], 10, carried=(key("a", 4),))
        with pytest.raises(RemoteError, match="without the values"):
            run.wait()  # a server that carries nothing: said so, not waited on
        client.run("plain", 5, [])


def test_a_server_without_a_runner_refuses_run_requests(rdv, server, client):
    with pytest.raises(ValueError, match="unknown op 3"):
        client.run("g1", 1, [])


def test_close_wakes_waiting_receivers(rdv):
    server = TensorServer(rdv)
    client = TensorClient(server.address)
    rdv.send(key("warm"), np.ones(1))
    client.recv(key("warm"), timeout=10)  # leaves an idle pooled connection
    calls = [Call(client.recv, key(f"w{i}")) for i in range(3)]  # no timeout at all
    wait_until(lambda: rdv.num_waiting() == 3, "receivers to wait")
    server.close()
    for call in calls:
        err = call.finish().error
        assert isinstance(err, ConnectionError) and server.address in str(err)
    assert rdv.num_waiting() == 0
    with pytest.raises(ConnectionError, match=server.address):
        client.recv(key("after"), timeout=5)
    client.close()


def test_unreachable_peer_is_a_connection_error():
    probe = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nothing listens there any more
    with pytest.raises(ConnectionError, match=address):
        TensorClient(address).recv(key("x"), timeout=5)


# --- two processes ---------------------------------------------------------------------

SERVER_CHILD = textwrap.dedent(
    """
    import select, sys, numpy as np
    from flowmill.kernels import DEAD
    from flowmill.runtime.rendezvous import Rendezvous, make_key
    from flowmill.runtime.transport import TensorServer
    rdv = Rendezvous()
    k = lambda name: make_key("{ps}", "{worker}", name, 1)
    rdv.send(k("weights"), np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(1024, -1))
    rdv.send(k("flag"), np.array([True, False]))
    rdv.send(k("dead"), DEAD)
    rdv.send(k("view"), np.arange(60, dtype=np.int64).reshape(6, 10)[::2, 1::3])
    server = TensorServer(rdv)
    print(server.address, flush=True)
    while rdv.num_waiting() == 0 and not sys.stdin.closed:
        if select.select([sys.stdin], [], [], 0.005)[0]:
            break  # the parent is done (end of stdin) without a waiting request
    print("waiting", flush=True)
    sys.stdin.read()
    server.close()
    """
).format(ps=PS, worker=WORKER)


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    assert line, f"child exited early with {proc.poll()}"
    return line


def test_across_processes():
    proc = spawn(SERVER_CHILD)
    try:
        with TensorClient(read_line(proc)) as client:
            calls = [Call(client.recv, key(n), timeout=JOIN_TIMEOUT) for n in ("weights", "flag")]
            w, f = (c.finish().value for c in calls)
            assert_same(w, np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(1024, -1))
            assert_same(f, np.array([True, False]))
            assert client.recv(key("dead"), timeout=JOIN_TIMEOUT) is DEAD
            want = np.arange(60, dtype=np.int64).reshape(6, 10)[::2, 1::3]
            assert_same(client.recv(key("view"), timeout=JOIN_TIMEOUT), want)
            with pytest.raises(TimeoutError, match="never"):
                client.recv(key("never"), timeout=0.2)
    finally:
        proc.stdin.close()
        assert proc.wait(JOIN_TIMEOUT) == 0


def test_server_process_killed_while_receiver_waits():
    proc = spawn(SERVER_CHILD)
    try:
        address = read_line(proc)
        client = TensorClient(address)
        call = Call(client.recv, key("never-sent"))  # no timeout: only the peer's death ends it
        assert read_line(proc) == "waiting"
        proc.send_signal(signal.SIGKILL)
        err = call.finish().error
        assert isinstance(err, ConnectionError) and address in str(err)
    finally:
        proc.kill()
        proc.wait(JOIN_TIMEOUT)


PARTIAL_CHILD = textwrap.dedent(
    """
    import socket, struct, sys, time
    from flowmill.runtime.transport import REQUEST, REPLY, REPLY_MAGIC
    listener = socket.create_server(("127.0.0.1", 0))
    print("127.0.0.1:%d" % listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    head = conn.recv(REQUEST.size, socket.MSG_WAITALL)
    conn.recv(REQUEST.unpack(head)[3], socket.MSG_WAITALL)
    n = 64 << 20
    dtype = b"<f4"
    conn.sendall(REPLY.pack(REPLY_MAGIC, 0, 0, 1, len(dtype), 0, n) + dtype
                 + struct.pack("<Q", n // 4) + bytes(1 << 20))
    print("partial", flush=True)
    time.sleep(60)
    """
)


def test_peer_killed_mid_transfer():
    proc = spawn(PARTIAL_CHILD)
    try:
        address = read_line(proc)
        client = TensorClient(address, buffer_pool=BufferPool(capacity=0))
        call = Call(client.recv, key("w"), timeout=JOIN_TIMEOUT)
        assert read_line(proc) == "partial"
        proc.send_signal(signal.SIGKILL)
        err = call.finish().error
        assert isinstance(err, ConnectionError), err
        assert address in str(err) and "w;1" in str(err)
    finally:
        proc.kill()
        proc.wait(JOIN_TIMEOUT)


# ---- many keys in one request


def test_recv_many_delivers_each_value_in_order_as_it_is_sent(rdv, client):
    keys = [key(f"t{i}") for i in range(4)]
    got: list[tuple[int, float]] = []
    call = Call(client.recv_many, keys, 10.0, lambda i, v: got.append((i, float(v[0]))))
    for i in reversed(range(4)):  # produced last to first: the reply still keeps order
        rdv.send(keys[i], np.full(1000, i, np.float32))
    assert call.finish().error is None
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert client.requests == 1


def test_recv_many_stops_at_the_first_key_without_a_value_and_the_connection_stays(rdv, client):
    keys = [key(f"u{i}", step=2) for i in range(3)]
    rdv.send(keys[0], np.arange(3.0))
    got = []
    with pytest.raises(TimeoutError, match=r"u1;2.*TIMEOUT"):
        client.recv_many(keys, 0.2, lambda i, v: got.append(i))
    assert got == [0]
    rdv.send(keys[1], np.ones(2))
    rdv.send(keys[2], DEAD)
    client.recv_many(keys[1:], 5.0, lambda i, v: got.append((i, v if v is DEAD else v.tolist())))
    assert got == [0, (0, [1.0, 1.0]), (1, DEAD)]


def test_recv_many_refuses_malformed_keys_and_keys_it_cannot_join(client):
    with pytest.raises(ValueError, match="malformed key"):
        client.recv_many([key("ok"), "not;a key"], 1.0, lambda i, v: None)
    with pytest.raises(ValueError, match="ask for it alone"):
        client.recv_many([key("a\nb")], 1.0, lambda i, v: None)


def test_keys_longer_than_the_inline_buffer_are_served_and_the_server_lives(rdv, server, client):
    """A key past the 4 KiB read with the header (up to the 64 KiB limit) is read in full:
    the server's request buffer grows instead of failing while a view of it is held."""
    for length in (5000, 60000):
        k = key("x" * length)
        rdv.send(k, np.arange(4.0))
        np.testing.assert_array_equal(client.recv(k, 5.0), np.arange(4.0))
    rdv.send(key("after"), np.ones(2))
    np.testing.assert_array_equal(client.recv(key("after"), 5.0), np.ones(2))


def test_an_error_reply_is_capped_and_read_whole_past_the_first_read(rdv, client):
    """An error message longer than the client's first read arrives whole (its buffer
    grows), and the server cuts any message to MAX_MESSAGE_BYTES."""
    from flowmill.runtime.transport import MAX_MESSAGE_BYTES

    k = key("doomed")
    rdv.abort(RuntimeError("x" * 100_000))
    with pytest.raises(RemoteError) as e:
        client.recv(k, 5.0)
    assert str(e.value).endswith("...") and len(str(e.value)) < MAX_MESSAGE_BYTES + 500


def test_connections_beyond_the_cap_are_turned_away_and_the_server_keeps_serving(rdv):
    with TensorServer(rdv, max_connections=2) as server:
        host, port = parse_address(server.address)
        held = [socket.create_connection((host, port), timeout=5) for _ in range(2)]
        wait_until(lambda: server.num_connections() == 2, "two connections served")
        extra = socket.create_connection((host, port), timeout=5)
        head = extra.recv(REPLY.size)
        magic, status, *_ = REPLY.unpack_from(head)
        assert magic == REPLY_MAGIC and status == Status.UNAVAILABLE
        assert extra.recv(1 << 16)  # the reason follows, then the end of the stream
        extra.close()
        held.pop().close()
        wait_until(lambda: server.num_connections() == 1, "one connection left")
        with TensorClient(server.address) as client:
            rdv.send(key("served"), np.ones(3))
            np.testing.assert_array_equal(client.recv(key("served"), 5.0), np.ones(3))
        for conn in held:
            conn.close()


def test_an_idle_connection_is_closed_and_the_client_dials_again(rdv):
    with TensorServer(rdv, idle_timeout=0.2) as server, TensorClient(server.address) as client:
        rdv.send(key("first"), np.ones(2))
        client.recv(key("first"), 5.0)
        wait_until(lambda: server.num_connections() == 0, "the idle connection closed")
        rdv.send(key("second"), np.zeros(2))
        np.testing.assert_array_equal(client.recv(key("second"), 5.0), np.zeros(2))


# ---- the local socket


def test_a_server_listens_on_a_local_socket_of_a_random_name_unless_told_not_to(rdv):
    with TensorServer(rdv) as a, TensorServer(rdv) as b:
        assert a.local_address.startswith(transport.LOCAL_SCHEME)
        assert a.local_address != b.local_address
    with TensorServer(rdv, local=False) as plain:
        assert plain.local_address is None
    assert transport.local_socket_default({})
    for off in ("0", "false", "off"):
        assert not transport.local_socket_default({transport.ENV_LOCAL_SOCKET: off})


def test_a_client_that_cannot_reach_the_local_socket_keeps_to_tcp(rdv, server):
    """A peer in another network namespace (another pod, another host) finds no socket
    of that name: the first connection goes over TCP and so does every later one."""
    rdv.send(key("a"), np.arange(3.0))
    rdv.send(key("b"), np.arange(4.0))
    gone = transport.LOCAL_SCHEME + "flowmill-tensors-nobody-listens-here"
    with TensorClient(server.address, local_address=gone) as c:
        assert c.transport == "unix"
        assert_same(c.recv(key("a"), timeout=10), np.arange(3.0))
        assert c.transport == "tcp"
        assert_same(c.recv(key("b"), timeout=10), np.arange(4.0))


def test_a_local_connection_is_served_as_a_tcp_one_and_closed_with_the_server(rdv):
    server = TensorServer(rdv)
    rdv.send(key("x"), np.ones(2))
    client = TensorClient(server.address, local_address=server.local_address)
    assert_same(client.recv(key("x"), timeout=10), np.ones(2))
    assert client.transport == "unix" and server.num_connections() == 1
    waiting = Call(client.recv, key("never"), timeout=JOIN_TIMEOUT)
    wait_until(lambda: rdv.num_waiting() == 1, "the server to wait on the key")
    server.close()
    waiting.join(JOIN_TIMEOUT)
    assert isinstance(waiting.error, (RemoteError, ConnectionError)), waiting.error
    with pytest.raises(ConnectionError):
        client.recv(key("x"), timeout=2)
    client.close()


def test_a_malformed_local_address_is_refused_naming_it():
    with pytest.raises(ValueError, match="not a local tensor address: 'unix:/tmp/x'"):
        TensorClient("127.0.0.1:1", local_address="unix:/tmp/x")
