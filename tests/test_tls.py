"""Task traffic under mutual TLS: who may talk to a task, and what reaches it sealed.

A task server started as a job's task starts it (its credentials from ``FLOWMILL_TLS_DIR``)
is dialled by a process with no credentials and by one with another job's: every gRPC
method (what reads and writes variables, writes checkpoints, and stops the task) and
the tensor channel refuse both before any request is read, and the task serves its own
job's peers as before. The sealed frames are checked for tampering, replay and key
retirement; a connection to a task's local socket is authenticated the same way and left
unsealed.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import stat
import threading
import time

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from flowmill.launcher.local import free_ports
from flowmill.operator import libcrypto
from flowmill.operator.certificates import Authority, write_run
from flowmill.runtime import tls
from flowmill.runtime.cluster import (
    ENV_TLS_DIR,
    LAUNCHER_IDENTITY,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    ClusterSpec,
    TaskConfig,
    identity,
)
from flowmill.runtime.protos import task_service_pb2 as pb
from flowmill.runtime.protos import task_service_pb2_grpc as pb_grpc
from flowmill.runtime.rendezvous import Rendezvous, make_key
from flowmill.runtime.server import Server
from flowmill.runtime.tls import SecureStream, TaskCredentials, common_name, grpc_channel
from flowmill.runtime.transport import TensorClient, TensorServer, _recv_exact_into

SRC, DST = "/job:ps/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:0"


def key(name: str, i: int = 0) -> str:
    return make_key(SRC, DST, name, i)


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> dict[str, TaskCredentials]:
    """ps-0, worker-0 and the launcher of one job run; ``intruder``: a worker-0 of
    another job's CA."""
    root = tmp_path_factory.mktemp("tls")
    out = {name: TaskCredentials(d) for name, d in write_run(
        str(root / "job"), "job", ["ps-0", "worker-0", LAUNCHER_IDENTITY]).items()}
    out["intruder"] = TaskCredentials(write_run(str(root / "other"), "other",
                                                ["worker-0"])["worker-0"])
    return out


# ---- certificates


def test_a_task_certificate_names_its_task_and_chains_to_its_runs_ca(creds):
    files = creds["worker-0"]
    cert = x509.load_pem_x509_certificate(files.read(TLS_CERT_FILE))
    ca = x509.load_pem_x509_certificate(files.read(TLS_CA_FILE))
    cert.verify_directly_issued_by(ca)
    assert files.name == common_name(files.read(TLS_CERT_FILE)) == "worker-0"
    assert cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == ["worker-0"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc <= ca.not_valid_after_utc
    assert identity("ps", 3) == "ps-3"
    for name in (TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE):  # private to this user
        assert stat.S_IMODE(os.stat(files.path(name)).st_mode) == 0o600


def test_credentials_from_the_environment_name_a_missing_file(tmp_path, creds):
    assert TaskCredentials.from_env({}) is None
    assert TaskCredentials.from_env({ENV_TLS_DIR: creds["ps-0"].directory}).name == "ps-0"
    (tmp_path / "ca.crt").write_bytes(creds["ps-0"].read(TLS_CA_FILE))
    with pytest.raises(FileNotFoundError, match="tls.crt is missing"):
        TaskCredentials.from_env({ENV_TLS_DIR: str(tmp_path)})


def test_certificates_carry_what_a_verifier_checks():
    """Read back by an independent X.509 reader (the ``cryptography`` package)."""
    authority = Authority.create("mnist" * 20)
    issued = authority.issue("worker-1")
    ca = x509.load_pem_x509_certificate(authority.cert)
    cert = x509.load_pem_x509_certificate(issued.cert)
    assert ca.version == cert.version == x509.Version.v3
    assert ca.subject.rfc4514_string() == f"CN={('mnist' * 20)[:48]} CA,O=flowmill"
    assert cert.subject.rfc4514_string() == "CN=worker-1,O=flowmill"
    assert cert.issuer == ca.subject == ca.issuer
    ext = {e.oid: e for e in cert.extensions}
    assert ext[x509.oid.ExtensionOID.KEY_USAGE].critical
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    ca_usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_usage.key_cert_sign and not ca_usage.digital_signature
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    assert (cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
            .key_identifier == ca.extensions.get_extension_for_class(
                x509.SubjectKeyIdentifier).value.digest)
    assert cert.serial_number > 2**64 and cert.serial_number != ca.serial_number
    now = dt.datetime.now(dt.UTC)
    assert now - dt.timedelta(minutes=6) < cert.not_valid_before_utc < now
    assert cert.not_valid_after_utc - now > dt.timedelta(days=364)
    key = serialization.load_pem_private_key(issued.key, password=None)
    assert issued.key.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert key.public_key() == cert.public_key()


def test_a_task_certificate_ends_no_later_than_its_ca():
    with libcrypto.new_key() as key:
        now = int(time.time())
        short = libcrypto.certificate(
            {"CN": "short CA"}, key, now - 60, now + 3600,
            [("basicConstraints", "critical,CA:TRUE"), ("subjectKeyIdentifier", "hash")])
        authority = Authority(short, libcrypto.key_pem(key))
    cert = x509.load_pem_x509_certificate(authority.issue("ps-0").cert)
    assert cert.not_valid_after_utc == x509.load_pem_x509_certificate(short).not_valid_after_utc


def test_a_ca_issues_nothing_without_an_ec_key():
    bad = Authority(Authority.create("j").cert, b"not a key")
    with pytest.raises(ValueError, match="reading the private key failed: .*unsupported"):
        bad.issue("worker-0")
    with pytest.raises(ValueError, match="must be a DNS name"):
        Authority.create("j").issue("worker-0,DNS:evil.example")


# ---- the tensor channel


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_values_of_every_size_arrive_whole_sealed_or_over_the_local_socket(creds, over):
    sizes = [0, 1, 3, (1 << 16) - 8, 1 << 16, (1 << 16) + 1, (1 << 20) - 5, 1 << 20,
             (1 << 20) + 3, 5 * (1 << 20) + 7]
    rdv = Rendezvous()
    values = [np.arange(n, dtype=np.uint8) * 7 for n in sizes]
    values.append(np.float64(2.5))
    for i, v in enumerate(values):
        rdv.send(key("v", i), v)
    with TensorServer(rdv, credentials=creds["ps-0"]) as server, \
            TensorClient(server.address, credentials=creds["worker-0"], peer_name="ps-0",
                         local_address=server.local_address if over == "unix" else None
                         ) as client:
        for i, v in enumerate(values[:4]):
            np.testing.assert_array_equal(client.recv(key("v", i), timeout=5), v)
        got: dict[int, np.ndarray] = {}
        client.recv_many([key("v", i) for i in range(4, len(values))], 5,
                         lambda j, value: got.__setitem__(j + 4, value))
        for i in range(4, len(values)):
            np.testing.assert_array_equal(got[i], values[i])
        assert server.values_sent == len(values)
        assert client.transport == over


@pytest.mark.parametrize("who", ["plain", "plain-local", "intruder", "intruder-local",
                                 "wrong-name"])
def test_a_pull_without_the_jobs_credentials_is_refused_before_it_is_read(creds, who):
    rdv = Rendezvous()
    rdv.send(key("w"), np.ones(4, np.float32))
    with TensorServer(rdv, credentials=creds["ps-0"]) as server:
        if who == "plain":
            client = TensorClient(server.address)
        elif who == "plain-local":  # the local socket asks for the same handshake
            client = TensorClient(server.address, local_address=server.local_address)
        elif who.startswith("intruder"):
            local = server.local_address if who == "intruder-local" else None
            client = TensorClient(server.address, credentials=creds["intruder"],
                                  peer_name="ps-0", local_address=local)
        else:  # our own credentials, but a server that is not the task we meant
            client = TensorClient(server.address, credentials=creds["worker-0"],
                                  peer_name="ps-1")
        with client, pytest.raises(ConnectionError):
            client.recv(key("w"), timeout=2)
        assert server.values_sent == 0
        # The value is still there for the job's own worker.
        with TensorClient(server.address, credentials=creds["worker-0"],
                          peer_name="ps-0") as own:
            np.testing.assert_array_equal(own.recv(key("w"), timeout=5), np.ones(4))


def test_a_plain_request_on_a_sealed_server_gets_no_reply(creds):
    """The bytes of a well-formed plain request are taken as a TLS hello and refused: the
    server answers with nothing that is a reply, and closes."""
    rdv = Rendezvous()
    rdv.send(key("w"), np.ones(4, np.float32))
    with TensorServer(rdv, credentials=creds["ps-0"]) as server:
        k = key("w").encode()
        from flowmill.runtime.transport import OP_RECV, REQUEST, REQUEST_MAGIC
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_RECV, 1.0, len(k)) + k)
            data = b""
            try:
                while chunk := s.recv(4096):
                    data += chunk
            except ConnectionResetError:
                pass
        assert b"FMp1" not in data
        assert server.values_sent == 0


def _connected(family: str) -> tuple[socket.socket, socket.socket]:
    if family == "unix":
        return socket.socketpair(socket.AF_UNIX)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        server, _ = listener.accept()
    return client, server


def _read(stream, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(stream, memoryview(buf))  # raises on a stream closed early
    return bytes(buf)


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_both_ends_prove_membership_and_only_tcp_is_sealed(creds, family):
    """A local (Unix) socket is authenticated by the same handshake as TCP, then carries
    its bytes as they are: it has no wire. A peer of another job is refused on either."""
    for client_creds, ok in ((creds["worker-0"], True), (creds["intruder"], False)):
        a, b = _connected(family)
        ends: dict = {}

        def serve(b=b, ends=ends):
            try:
                ends["server"] = tls.accept(b, creds["ps-0"], timeout=5)
            except tls.HandshakeError as e:
                ends["error"] = e

        t = threading.Thread(target=serve)
        t.start()
        try:
            client = tls.connect(a, client_creds, "ps-0", timeout=5)
        except tls.HandshakeError:
            client = None
        t.join(10)
        if not ok:
            assert client is None or "error" in ends
            assert "server" not in ends
            if client is not None:
                client.close()
            continue
        server = ends["server"]
        try:
            sealed = family == "tcp"
            assert isinstance(client, SecureStream) is sealed
            assert isinstance(server, SecureStream) is sealed
            client.sendall(b"hello, ps-0")
            assert _read(server, 11) == b"hello, ps-0"
            server.sendall(b"hi")
            assert _read(client, 2) == b"hi"
        finally:
            client.close()
            server.close()


def _stream_pair(send_key: bytes, recv_key: bytes) -> tuple[SecureStream, SecureStream]:
    a, b = socket.socketpair()
    return (SecureStream(a, send_key=send_key, recv_key=recv_key),
            SecureStream(b, send_key=recv_key, recv_key=send_key))


def test_a_frame_altered_or_replayed_in_flight_fails_to_open():
    k1, k2 = os.urandom(16), os.urandom(16)
    # Altered: one ciphertext bit flipped between the two ends.
    a, b = _stream_pair(k1, k2)
    raw_a, raw_b = socket.socketpair()
    sealer = SecureStream(raw_a, send_key=k1, recv_key=k2)
    sealer.sendall(b"request: model/w")
    frame = bytearray(raw_b.recv(1 << 16))
    frame[6] ^= 1
    a.sock.sendall(frame)
    with pytest.raises(ConnectionResetError, match="authentication"):
        b.recv(64)
    # Replayed: a frame that opened once does not open again (its nonce has moved on).
    c, d = _stream_pair(k1, k2)
    raw_c, raw_d = socket.socketpair()
    sealer = SecureStream(raw_c, send_key=k1, recv_key=k2)
    sealer.sendall(b"overwrite model/w")
    frame = raw_d.recv(1 << 16)
    c.sock.sendall(frame + frame)
    assert d.recv(64) == b"overwrite model/w"
    with pytest.raises(ConnectionResetError, match="authentication"):
        d.recv(64)
    # A length beyond a frame's is refused before anything is read into memory.
    e, f = _stream_pair(k1, k2)
    e.sock.sendall((1 << 31).to_bytes(4, "little") + b"x" * 32)
    with pytest.raises(ConnectionResetError, match="exceeds"):
        f.recv(64)
    for s in (a, b, c, d, e, f, sealer):
        s.close()
    for s in (raw_a, raw_b, raw_d):
        s.close()


def test_a_connection_is_retired_once_its_key_has_sealed_its_share(creds, monkeypatch):
    monkeypatch.setattr(tls, "KEY_LIMIT_BYTES", 1 << 20)
    rdv = Rendezvous()
    value = np.ones(300_000, np.float32)  # 1.2 MB: past the limit in one reply
    for i in range(3):
        rdv.send(key("big", i), value)
    handshakes = []
    real = tls.connect
    monkeypatch.setattr(tls, "connect", lambda *a, **k: handshakes.append(1) or real(*a, **k))
    with TensorServer(rdv, credentials=creds["ps-0"]) as server, \
            TensorClient(server.address, credentials=creds["worker-0"],
                         peer_name="ps-0") as client:
        for i in range(3):
            np.testing.assert_array_equal(client.recv(key("big", i), timeout=5), value)
    assert len(handshakes) == 3  # a new connection, with new keys, for each


# ---- gRPC: every method


def _ps_server(creds) -> Server:
    ps, worker = free_ports(2)
    spec = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]})
    return Server(TaskConfig(spec, "ps", 0), credentials=creds["ps-0"])


CALLS = {
    "GetStatus": pb.GetStatusRequest(),
    "RegisterGraph": pb.RegisterGraphRequest(),
    "RunGraph": pb.RunGraphRequest(),
    "CleanupStep": pb.CleanupStepRequest(),
    "Shutdown": pb.ShutdownRequest(),
}


def test_no_method_answers_a_caller_without_the_jobs_certificate(creds):
    server = _ps_server(creds)
    address = server.config.address
    try:
        for who, channel in (
            ("plain", grpc.insecure_channel(address)),
            ("intruder", grpc_channel(address, creds["intruder"], "ps-0")),
            ("no client certificate", grpc.secure_channel(address, grpc.ssl_channel_credentials(
                creds["ps-0"].read(TLS_CA_FILE)), options=[("grpc.ssl_target_name_override",
                                                              "ps-0")])),
        ):
            stub = pb_grpc.TaskServiceStub(channel)
            for method, request in CALLS.items():
                with pytest.raises(grpc.RpcError) as e:
                    getattr(stub, method)(request, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (who, method)
            channel.close()
        assert not server._stopped.is_set()  # Shutdown never reached it
        for own in ("worker-0", LAUNCHER_IDENTITY):
            with grpc_channel(address, creds[own], "ps-0") as channel:
                status = pb_grpc.TaskServiceStub(channel).GetStatus(pb.GetStatusRequest(),
                                                                    timeout=5)
                assert status.task == "/job:ps/task:0"
        # A client checks the server's name: our credentials, the wrong task.
        with grpc_channel(address, creds["worker-0"], "ps-1") as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.TaskServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_the_jobs_own_task_may_stop_it(creds):
    server = _ps_server(creds)
    with grpc_channel(server.config.address, creds["worker-0"], "ps-0") as channel:
        pb_grpc.TaskServiceStub(channel).Shutdown(pb.ShutdownRequest(), timeout=5)
    assert server._stopped.wait(10)


def test_many_refused_handshakes_log_a_line_each_at_most(creds, caplog):
    rdv = Rendezvous()
    with TensorServer(rdv, credentials=creds["ps-0"]) as server:
        threads = [threading.Thread(target=lambda: _plain_hello(server)) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    refused = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(refused) <= 20
    assert all(r.exc_info is None for r in refused)  # a line, not a traceback


def _plain_hello(server: TensorServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x00\x05hello")
        try:
            s.recv(64)
        except OSError:
            pass
