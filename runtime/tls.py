"""Authenticated, encrypted traffic between a job's tasks.

A task holds its job run's CA certificate and its own certificate and key (issued by
``flowmill.operator.certificates``), in the directory ``FLOWMILL_TLS_DIR`` names
(``ca.crt``, ``tls.crt``, ``tls.key``, the layout of a Kubernetes TLS Secret). With them:

- gRPC runs over mutual TLS: the server asks every client for a certificate of the job's
  CA, and a client checks that the server's certificate names the task it dialled.
- The bulk tensor channel opens each connection with the same mutual TLS 1.3 handshake,
  and the server sends two fresh random AES-128-GCM keys (one per direction) over it.
  Both ends then close the TLS session and seal every message in ``SecureStream`` frames
  with those keys. TLS's own record layer, as Python drives it, moves 16 KiB per call and
  two system calls per record: about half of loopback throughput for a 256 MiB tensor.
  Frames of up to 1 MiB cost one cipher call and one system call each, and a tensor is
  decrypted straight into the array it lands in (``bench/transport.py`` shows both).
  AES-128 rather than 256: TLS 1.3's mandatory suite, and here 15 GB/s a core against 9,
  which is what a CPU-bound step pays for sealing.
  A frame is ``length u32 | ciphertext | tag``: the length is authenticated as associated
  data, the nonce is the frame's number in its direction (never sent, never reused under
  a key), so a frame altered, replayed, reordered or dropped fails to open and the
  connection is closed. A connection through which either key has sealed
  ``KEY_LIMIT_BYTES`` is retired by both ends (the client dials a new one, with new
  keys), well inside AES-GCM's usage limits.

A peer without a certificate of this job run is refused in the handshake, before any
request of it is read.

A connection to a task's local socket (an abstract Unix address, which only a process in
the task's own network namespace can reach: the tasks of a local job, or of one pod) is
authenticated by the same handshake, both ends, and its bytes then travel as they are:
a connected Unix socket has no wire between its ends to read or write into (the kernel
hands the bytes from one process to the other), so sealing them protects them from no
one that could not read either process's memory, and gRPC's local credentials treat a
Unix socket as secure for the same reason. It cost a CPU-bound step dearly: a 1 PS + 2
worker sync step of ``bench/distributed_step.py``'s MLP took 9.7-10.7 ms sealed on the
local socket and 6.9-7.3 ms unsealed, in alternating runs, as it did in plain TCP.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID

from .cluster import ENV_TLS_DIR, TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
FRAME_BYTES = 1 << 20  # plaintext per frame, at most
KEY_LIMIT_BYTES = 1 << 36  # sealed under one key before the connection is retired
_HEADER = struct.Struct("<I")
_TAG = 16
_KEY = 16  # AES-128-GCM
# Payloads up to this size travel in one frame with the header that precedes them.
_INLINE_BYTES = 1 << 16
# The first read of a frame takes up to this much (a small frame, and its neighbours).
_GREEDY_BYTES = 1 << 16


class HandshakeError(ConnectionError):
    """The peer did not prove membership of this job run (or the handshake broke)."""


@dataclass(frozen=True)
class TaskCredentials:
    """A task's certificate, key and CA, as files in ``directory``."""

    directory: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TaskCredentials | None:
        """The credentials ``FLOWMILL_TLS_DIR`` names, or None when it is unset (the task
        serves and dials in plain TCP)."""
        directory = environ.get(ENV_TLS_DIR, "").strip()
        if not directory:
            return None
        creds = cls(directory)
        creds.check()
        return creds

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def read(self, name: str) -> bytes:
        with open(self.path(name), "rb") as f:
            return f.read()

    def check(self) -> None:
        """Raise naming the file that is missing or unreadable."""
        for name in (TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE):
            if not os.access(self.path(name), os.R_OK):
                raise FileNotFoundError(
                    f"{ENV_TLS_DIR}={self.directory}: {name} is missing or unreadable")

    @cached_property
    def name(self) -> str:
        """Whom the certificate names (``worker-1``, ``launcher``)."""
        return common_name(self.read(TLS_CERT_FILE))

    @cached_property
    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._common(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.num_tickets = 0  # no resumption: every connection shows its certificate
        return ctx

    @cached_property
    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer and its name
        self._common(ctx)
        return ctx

    def _common(self, ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.path(TLS_CERT_FILE), self.path(TLS_KEY_FILE))
        ctx.load_verify_locations(self.path(TLS_CA_FILE))

    def grpc_server_credentials(self):
        import grpc

        return grpc.ssl_server_credentials(
            [(self.read(TLS_KEY_FILE), self.read(TLS_CERT_FILE))],
            root_certificates=self.read(TLS_CA_FILE), require_client_auth=True)

    def grpc_channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.read(TLS_CA_FILE), private_key=self.read(TLS_KEY_FILE),
            certificate_chain=self.read(TLS_CERT_FILE))


def grpc_channel(address: str, credentials: TaskCredentials | None, peer: str,
                 options: list[tuple[str, object]] | tuple = ()):
    """A channel to the task named ``peer`` (``ps-0``) at ``address``: mutual TLS with its
    certificate checked for that name, or plain without credentials."""
    import grpc

    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials.grpc_channel_credentials(),
                               options=[*options, ("grpc.ssl_target_name_override", peer)])


def accept(sock: socket.socket, credentials: TaskCredentials,
           timeout: float = HANDSHAKE_TIMEOUT_S) -> SecureStream | socket.socket:
    """The server's end of a new bulk connection, once the peer proved its membership:
    sealed, or the socket itself where it is a local (Unix) one."""
    return _handshake(sock, credentials.server_context, True, None, timeout)


def connect(sock: socket.socket, credentials: TaskCredentials, peer: str,
            timeout: float = HANDSHAKE_TIMEOUT_S) -> SecureStream | socket.socket:
    """The client's end of a new bulk connection to the task named ``peer``: sealed, or
    the socket itself where it is a local (Unix) one."""
    return _handshake(sock, credentials.client_context, False, peer, timeout)


def _handshake(sock: socket.socket, ctx: ssl.SSLContext, server: bool, peer: str | None,
               timeout: float) -> SecureStream | socket.socket:
    saved = sock.gettimeout()
    sock.settimeout(timeout)
    sealed = sock.family != getattr(socket, "AF_UNIX", None)  # both ends see the same
    try:
        tls = ctx.wrap_socket(sock, server_side=server, server_hostname=peer)
        keys = b""  # a local socket's bytes go unsealed: it needs none
        if sealed and server:
            keys = os.urandom(2 * _KEY)
            tls.sendall(keys)
        elif sealed:
            while len(keys) < 2 * _KEY:
                got = tls.recv(2 * _KEY - len(keys))
                if not got:
                    raise HandshakeError("the peer closed the connection during the handshake")
                keys += got
        raw = tls.unwrap()  # both ends close the TLS session; frames follow on the socket
    except (ssl.SSLError, ssl.CertificateError) as e:
        raise HandshakeError(f"TLS handshake failed: {e}") from None
    except TimeoutError:
        raise HandshakeError(f"TLS handshake took more than {timeout}s") from None
    except OSError as e:
        raise HandshakeError(f"TLS handshake failed: {e}") from None
    finally:
        sock.close()  # the descriptor lives on in ``raw`` (or is gone with the error)
    # A plain socket object again: the unwrapped SSLSocket would route every call through
    # Python-level ssl methods.
    plain = socket.socket(raw.family, raw.type, raw.proto, fileno=raw.detach())
    plain.settimeout(saved)
    if not sealed:
        return plain
    first, second = keys[:_KEY], keys[_KEY:]
    return SecureStream(plain, send_key=first if server else second,
                        recv_key=second if server else first)


class SecureStream:
    """A connected socket whose every byte travels in sealed frames (see the module).

    It offers what the bulk channel uses of a socket: ``recv_into``, ``recv``,
    ``sendall``, ``send_parts``, timeouts, ``fileno`` (for ``poll``), ``shutdown`` and
    ``close``; ``buffered`` tells whether a read would find data without the socket.
    """

    def __init__(self, sock: socket.socket, *, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._seal, self._open = AESGCM(send_key), AESGCM(recv_key)
        self._sent_frames = self._recv_frames = 0
        self.sealed_bytes = self.opened_bytes = 0
        self._out = memoryview(bytearray(_HEADER.size + FRAME_BYTES + _TAG))
        # Ciphertext read ahead: [_start, _end) of _in.
        self._in = memoryview(bytearray(_HEADER.size + FRAME_BYTES + _TAG + _GREEDY_BYTES))
        self._start = self._end = 0
        # Plaintext of a frame larger than the read that opened it: [_pstart, _pend).
        self._plain = memoryview(bytearray(FRAME_BYTES))
        self._pstart = self._pend = 0

    # -- socket-like

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.sock.gettimeout()

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    @property
    def buffered(self) -> bool:
        return self._pend > self._pstart or self._end > self._start

    @property
    def retired(self) -> bool:
        """Whether either key of this connection has sealed enough for it to be closed;
        both ends see it once a message is through, so neither reuses the connection."""
        return max(self.sealed_bytes, self.opened_bytes) >= KEY_LIMIT_BYTES

    # -- sending

    def sendall(self, data) -> None:
        data = memoryview(data).cast("B")
        if len(data) <= FRAME_BYTES:
            self._send_frame(data)
        else:
            self._send_frames(data)

    def send_parts(self, head: bytes | memoryview, payload: memoryview | None) -> None:
        """``head`` then ``payload``: together in one frame when the payload is small,
        else the head alone and the payload in frames sealed straight from its memory."""
        if payload is None or len(payload) <= _INLINE_BYTES:
            self._send_frame(head if payload is None else bytes(head) + bytes(payload))
            return
        self._send_frame(head)
        self._send_frames(payload)

    def _send_frames(self, data: memoryview) -> None:
        for start in range(0, len(data), FRAME_BYTES):
            self._send_frame(data[start : start + FRAME_BYTES])

    def _send_frame(self, part: bytes | memoryview) -> None:
        n = len(part)
        header = _HEADER.pack(n)
        end = _HEADER.size + n + _TAG
        out = self._out
        out[: _HEADER.size] = header
        self._seal.encrypt_into(self._sent_frames.to_bytes(12, "big"), part, header,
                                out[_HEADER.size : end])
        self._sent_frames += 1
        self.sealed_bytes += n
        self.sock.sendall(out[:end])

    # -- receiving

    def recv(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        n = self.recv_into(memoryview(buf), nbytes)
        return bytes(buf[:n])

    def recv_into(self, view, nbytes: int = 0) -> int:
        """Up to ``nbytes`` (or the view's length) of plaintext into ``view``; 0 at the end
        of the stream. A frame that fits is opened straight into ``view``."""
        view = memoryview(view).cast("B")
        want = min(nbytes or len(view), len(view))
        if self._pend > self._pstart:
            return self._take_plain(view, want)
        while True:
            length = self._frame_length()
            if length is None:
                return 0
            if length == 0:  # an empty frame (an empty send): nothing to hand out
                self._open_frame(0, self._plain[:0])
                continue
            if length <= want:
                self._open_frame(length, view[:length])
                return length
            self._open_frame(length, self._plain[:length])
            self._pstart, self._pend = 0, length
            return self._take_plain(view, want)

    def _take_plain(self, view: memoryview, want: int) -> int:
        n = min(want, self._pend - self._pstart)
        view[:n] = self._plain[self._pstart : self._pstart + n]
        self._pstart += n
        return n

    def _frame_length(self) -> int | None:
        """The next frame's plaintext length once its header is in; None at a clean end
        of stream (between frames)."""
        while self._end - self._start < _HEADER.size:
            if self._start == self._end:
                self._start = self._end = 0
            elif self._start:
                tail = self._end - self._start  # a few bytes: a copy, not an overlap
                self._in[:tail] = bytes(self._in[self._start : self._end])
                self._start, self._end = 0, tail
            n = self.sock.recv_into(self._in[self._end : self._end + _GREEDY_BYTES])
            if n == 0:
                if self._end == self._start:
                    return None
                raise ConnectionResetError("the connection closed inside a frame")
            self._end += n
        (length,) = _HEADER.unpack_from(self._in, self._start)
        if length > FRAME_BYTES:
            raise ConnectionResetError(f"a frame of {length} bytes exceeds {FRAME_BYTES}")
        return length

    def _open_frame(self, length: int, dest: memoryview) -> None:
        """Read the rest of the frame whose header is at ``_start``, open it into
        ``dest``."""
        need = _HEADER.size + length + _TAG
        if self._start + need > len(self._in):  # move what is here to the front first
            tail = self._end - self._start  # at most one greedy read
            self._in[:tail] = bytes(self._in[self._start : self._end])
            self._start, self._end = 0, tail
        buf = self._in
        while self._end - self._start < need:
            n = self.sock.recv_into(buf[self._end : self._start + need])
            if n == 0:
                raise ConnectionResetError("the connection closed inside a frame")
            self._end += n
        frame = buf[self._start : self._start + need]
        try:
            self._open.decrypt_into(self._recv_frames.to_bytes(12, "big"),
                                    frame[_HEADER.size :], frame[: _HEADER.size], dest)
        except InvalidTag:
            raise ConnectionResetError("a frame failed authentication") from None
        self._recv_frames += 1
        self.opened_bytes += length
        if self.opened_bytes >= 2 * KEY_LIMIT_BYTES:  # a peer that never retires the key
            raise ConnectionResetError("the peer sealed past the key's limit")
        self._start += need
        if self._start == self._end:
            self._start = self._end = 0


def log_refused(peer: str, error: BaseException, _last: dict[str, float] = {}) -> None:  # noqa: B006
    """One line per refused peer address, at most every 10 s: a scan must not flood."""
    now = time.monotonic()
    if now - _last.get(peer, -1e9) >= 10.0:
        _last[peer] = now
        if len(_last) > 1024:
            _last.clear()
        log.warning("refused a connection from %s: %s", peer, error)



def common_name(cert_pem: bytes) -> str:
    """The CN of a PEM certificate (whom it names)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ValueError("the certificate names no task (no subject CN)")
    return str(names[0].value)
