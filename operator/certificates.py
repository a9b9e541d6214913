"""A job's certificate authority and its tasks' certificates (``flowmill.runtime.tls``
uses them).

Every run of a job gets a CA of its own: the operator keeps its certificates in the job's
Secret, the local launcher in a private directory. Each task's certificate names the task
(``worker-1``: subject CN and DNS subjectAltName) and is good for both ends of a TLS
connection, so a task proves to any peer that it belongs to this run of this job, and a
client checks that it reached the task it dialled. Nothing signed by another job's CA (or
by the previous run's, after a restart) is accepted.

Keys are ECDSA P-256: short certificates (a job's fit in one Secret) and handshakes that
cost a fraction of RSA's.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from flowmill.runtime.cluster import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE

from . import libcrypto

# How long a run's certificates are good for. A run that outlives it fails its handshakes;
# every restart of the job issues new ones.
VALIDITY = datetime.timedelta(days=365)
# Backdated this much: a node whose clock is slightly behind still accepts them at once.
CLOCK_SKEW = datetime.timedelta(minutes=5)
# A task's name is its certificate's DNS name: a DNS label, or labels joined by dots.
TASK_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
ORGANIZATION = "flowmill"


@dataclass(frozen=True)
class Issued:
    """PEM certificate and private key."""

    cert: bytes
    key: bytes


@dataclass(frozen=True)
class Authority:
    """A job run's CA: its certificate (which every task trusts) and its key (which only
    the operator or launcher holds, to issue task certificates)."""

    cert: bytes
    key: bytes

    @classmethod
    def create(cls, job: str) -> Authority:
        return new_run(job, ())[0]

    def issue(self, name: str) -> Issued:
        """A certificate for the task (or launcher) called ``name``."""
        return self.issue_all([name])[name]

    def issue_all(self, names: Iterable[str]) -> dict[str, Issued]:
        with libcrypto.load_cert(self.cert) as ca_cert, libcrypto.load_key(self.key) as ca_key:
            return {name: _issue(name, ca_cert, ca_key) for name in names}


def new_run(job: str, names: Iterable[str]) -> tuple[Authority, dict[str, Issued]]:
    """A new CA for a run of ``job`` and a certificate for each of ``names``, signed with
    the CA's key as it was made (reading a key back from PEM is most of a certificate's
    cost in OpenSSL 3)."""
    now = int(time.time())
    with libcrypto.new_key() as key:
        cert = libcrypto.certificate(
            {"O": ORGANIZATION, "CN": f"{job[:48]} CA"}, key,
            not_before=now - int(CLOCK_SKEW.total_seconds()),
            not_after=now + int(VALIDITY.total_seconds()),
            extensions=[("basicConstraints", "critical,CA:TRUE,pathlen:0"),
                        # A CA signs certificates (and nothing else).
                        ("keyUsage", "critical,keyCertSign,cRLSign"),
                        ("subjectKeyIdentifier", "hash")])
        with libcrypto.load_cert(cert) as ca_cert:
            issued = {name: _issue(name, ca_cert, key) for name in names}
        return Authority(cert, libcrypto.key_pem(key)), issued


def _issue(name: str, ca_cert: int, ca_key: int) -> Issued:
    if not TASK_NAME.fullmatch(name):
        raise ValueError(f"a task's name must be a DNS name to be certified, got {name!r}")
    now = int(time.time())
    with libcrypto.new_key() as key:
        cert = libcrypto.certificate(
            {"O": ORGANIZATION, "CN": name}, key,
            not_before=now - int(CLOCK_SKEW.total_seconds()),
            not_after=now + int(VALIDITY.total_seconds()),
            extensions=[("basicConstraints", "critical,CA:FALSE"),
                        # A task's key signs its handshakes (ECDHE does the rest) ...
                        ("keyUsage", "critical,digitalSignature"),
                        # ... at either end of a connection.
                        ("extendedKeyUsage", "serverAuth,clientAuth"),
                        ("subjectAltName", f"DNS:{name}"),
                        ("authorityKeyIdentifier", "keyid:always")],
            issuer=ca_cert, issuer_key=ca_key)
        return Issued(cert, libcrypto.key_pem(key))


def write_run(directory: str, job: str, names: Iterable[str]) -> dict[str, str]:
    """A new CA for a run of ``job`` and a certificate for each of ``names``, each as the
    files a task reads (``FLOWMILL_TLS_DIR``) in ``directory/<name>``, private to this
    user; the CA's key is not kept. Returns each name's directory."""
    authority, certificates = new_run(job, names)
    out = {}
    for name, issued in certificates.items():
        where = os.path.join(directory, name)
        os.makedirs(where, mode=0o700, exist_ok=True)
        for file, data in ((TLS_CA_FILE, authority.cert), (TLS_CERT_FILE, issued.cert),
                           (TLS_KEY_FILE, issued.key)):
            fd = os.open(os.path.join(where, file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                         0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        out[name] = where
    return out
