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
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flowmill.runtime.cluster import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE

# How long a run's certificates are good for. A run that outlives it fails its handshakes;
# every restart of the job issues new ones.
VALIDITY = datetime.timedelta(days=365)
# Backdated this much: a node whose clock is slightly behind still accepts them at once.
CLOCK_SKEW = datetime.timedelta(minutes=5)


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
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "flowmill"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{job[:48]} CA"),
        ])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    def issue(self, name: str) -> Issued:
        """A certificate for the task (or launcher) called ``name``."""
        ca_cert = x509.load_pem_x509_certificate(self.cert)
        ca_key = serialization.load_pem_private_key(self.key, password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError("the job's CA key is not an EC key")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "flowmill"),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(min(now + VALIDITY, ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    def issue_all(self, names: Iterable[str]) -> dict[str, Issued]:
        return {name: self.issue(name) for name in names}


def write_run(directory: str, job: str, names: Iterable[str]) -> dict[str, str]:
    """A new CA for a run of ``job`` and a certificate for each of ``names``, each as the
    files a task reads (``FLOWMILL_TLS_DIR``) in ``directory/<name>``, private to this
    user; the CA's key is not kept. Returns each name's directory."""
    authority = Authority.create(job)
    out = {}
    for name, issued in authority.issue_all(names).items():
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


def _key_usage(ca: bool) -> x509.KeyUsage:
    """A CA signs certificates; a task's key signs its handshakes (ECDHE does the rest)."""
    return x509.KeyUsage(digital_signature=not ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                         decipher_only=False)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
