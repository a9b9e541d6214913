"""The few OpenSSL 3 calls that issue a job's certificates, through ``ctypes``.

Why not the ``cryptography`` package: importing its X.509 layer puts about 10 MB into
the operator (its compiled module alone keeps 8 MB resident), a sixth of the process,
for a few signatures per new job. The OpenSSL that does the signing underneath is already
loaded, since Python's ``ssl`` module (every HTTPS request the operator makes) is built
on it; these bindings call that library, the one ``ssl`` uses, and nothing else. No
cryptography is done here: keys are made, certificates built, signed and encoded by
OpenSSL, and every call's result is checked, a failure raising ``OpenSSLError`` with
OpenSSL's own reason.

Objects OpenSSL allocates are freed in ``finally`` blocks by their owner functions
(``_key``, ``_cert``, ``_bio``), so an error half-way through leaks nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import secrets
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

P = ctypes.c_void_p
BIO_CTRL_INFO = 3
MBSTRING_UTF8 = 0x1000
SERIAL_BYTES = 16  # 127 random bits: positive, well over the 64 that RFC 5280 advises


class OpenSSLError(ValueError):
    """OpenSSL refused a call; the message has its reasons."""


def _library_path() -> str:
    """The libcrypto that the ``ssl`` module is linked against (imported above, so it
    is mapped already)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcrypto.so" in path:
                    return path
    except OSError:
        pass
    found = ctypes.util.find_library("crypto")
    if not found:
        raise OpenSSLError("libcrypto (OpenSSL) was not found")
    return found


_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "OpenSSL_version_num": (ctypes.c_ulong, []),
    "ERR_get_error": (ctypes.c_ulong, []),
    "ERR_error_string_n": (None, [ctypes.c_ulong, ctypes.c_char_p, ctypes.c_size_t]),
    "ERR_clear_error": (None, []),
    "EVP_PKEY_CTX_new_from_name": (P, [P, ctypes.c_char_p, ctypes.c_char_p]),
    "EVP_PKEY_keygen_init": (ctypes.c_int, [P]),
    "EVP_PKEY_CTX_set_group_name": (ctypes.c_int, [P, ctypes.c_char_p]),
    "EVP_PKEY_keygen": (ctypes.c_int, [P, ctypes.POINTER(P)]),
    "EVP_PKEY_CTX_free": (None, [P]),
    "EVP_PKEY_free": (None, [P]),
    "EVP_PKEY_is_a": (ctypes.c_int, [P, ctypes.c_char_p]),
    "EVP_sha256": (P, []),
    "X509_new": (P, []),
    "X509_free": (None, [P]),
    "X509_set_version": (ctypes.c_int, [P, ctypes.c_long]),
    "X509_get_serialNumber": (P, [P]),
    "BN_bin2bn": (P, [ctypes.c_char_p, ctypes.c_int, P]),
    "BN_to_ASN1_INTEGER": (P, [P, P]),
    "BN_free": (None, [P]),
    "X509_getm_notBefore": (P, [P]),
    "X509_getm_notAfter": (P, [P]),
    "X509_get0_notAfter": (P, [P]),
    "X509_set1_notAfter": (ctypes.c_int, [P, P]),
    "ASN1_TIME_set": (P, [P, ctypes.c_int64]),
    "ASN1_TIME_cmp_time_t": (ctypes.c_int, [P, ctypes.c_int64]),
    "X509_get_subject_name": (P, [P]),
    "X509_NAME_add_entry_by_txt": (ctypes.c_int, [P, ctypes.c_char_p, ctypes.c_int,
                                                  ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                                  ctypes.c_int]),
    "X509_set_issuer_name": (ctypes.c_int, [P, P]),
    "X509_set_pubkey": (ctypes.c_int, [P, P]),
    "X509V3_set_ctx": (None, [P, P, P, P, P, ctypes.c_int]),
    "X509V3_EXT_nconf_nid": (P, [P, P, ctypes.c_int, ctypes.c_char_p]),
    "OBJ_txt2nid": (ctypes.c_int, [ctypes.c_char_p]),
    "X509_add_ext": (ctypes.c_int, [P, P, ctypes.c_int]),
    "X509_EXTENSION_free": (None, [P]),
    "X509_sign": (ctypes.c_int, [P, P, P]),
    "BIO_s_mem": (P, []),
    "BIO_new": (P, [P]),
    "BIO_new_mem_buf": (P, [ctypes.c_char_p, ctypes.c_int]),
    "BIO_free": (ctypes.c_int, [P]),
    "BIO_ctrl": (ctypes.c_long, [P, ctypes.c_int, ctypes.c_long, P]),
    "PEM_write_bio_X509": (ctypes.c_int, [P, P]),
    "PEM_write_bio_PrivateKey": (ctypes.c_int, [P, P, P, P, ctypes.c_int, P, P]),
    "PEM_read_bio_X509": (P, [P, P, P, P]),
    "PEM_read_bio_PrivateKey": (P, [P, P, P, P]),
}


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.OpenSSL_version_num() < 0x30000000:
        raise OpenSSLError("OpenSSL 3.0 or later is needed to issue certificates, found "
                           f"{ssl.OPENSSL_VERSION}")
    return lib


_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib


def _check(ok: object, what: str) -> None:
    """Raise with OpenSSL's reason when a call returned NULL or a non-positive status."""
    if ok:
        if not isinstance(ok, int) or ok > 0:
            return
    c = lib()
    reasons = []
    while code := c.ERR_get_error():
        buf = ctypes.create_string_buffer(256)
        c.ERR_error_string_n(code, buf, len(buf))
        reasons.append(buf.value.decode(errors="replace"))
    raise OpenSSLError(f"{what} failed" + (f": {'; '.join(reasons)}" if reasons else ""))


@contextmanager
def _bio(data: bytes | None = None) -> Iterator[int]:
    c = lib()
    bio = c.BIO_new_mem_buf(data, len(data)) if data is not None else c.BIO_new(c.BIO_s_mem())
    _check(bio, "BIO_new")
    try:
        yield bio
    finally:
        c.BIO_free(bio)


def _bio_bytes(bio: int) -> bytes:
    data = P()
    size = lib().BIO_ctrl(bio, BIO_CTRL_INFO, 0, ctypes.byref(data))
    return ctypes.string_at(data.value, size) if size > 0 and data.value else b""


@contextmanager
def new_key() -> Iterator[int]:
    """A fresh ECDSA P-256 key."""
    c = lib()
    c.ERR_clear_error()
    ctx = c.EVP_PKEY_CTX_new_from_name(None, b"EC", None)
    _check(ctx, "EVP_PKEY_CTX_new_from_name(EC)")
    key = P()
    try:
        _check(c.EVP_PKEY_keygen_init(ctx), "EVP_PKEY_keygen_init")
        _check(c.EVP_PKEY_CTX_set_group_name(ctx, b"P-256"), "set_group_name(P-256)")
        _check(c.EVP_PKEY_keygen(ctx, ctypes.byref(key)), "EVP_PKEY_keygen")
    finally:
        c.EVP_PKEY_CTX_free(ctx)
    try:
        yield key.value
    finally:
        c.EVP_PKEY_free(key)


@contextmanager
def load_key(pem: bytes) -> Iterator[int]:
    """An EC private key from PEM."""
    c = lib()
    with _bio(pem) as bio:
        key = c.PEM_read_bio_PrivateKey(bio, None, None, None)
    _check(key, "reading the private key")
    try:
        if not c.EVP_PKEY_is_a(key, b"EC"):
            raise OpenSSLError("the private key is not an EC key")
        yield key
    finally:
        c.EVP_PKEY_free(key)


@contextmanager
def load_cert(pem: bytes) -> Iterator[int]:
    c = lib()
    with _bio(pem) as bio:
        cert = c.PEM_read_bio_X509(bio, None, None, None)
    _check(cert, "reading the certificate")
    try:
        yield cert
    finally:
        c.X509_free(cert)


def key_pem(key: int) -> bytes:
    """The key as PKCS#8 PEM, unencrypted."""
    with _bio() as bio:
        _check(lib().PEM_write_bio_PrivateKey(bio, key, None, None, 0, None, None),
               "PEM_write_bio_PrivateKey")
        return _bio_bytes(bio)


def certificate(subject: dict[str, str], key: int, not_before: int, not_after: int,
                extensions: list[tuple[str, str]], issuer: int | None = None,
                issuer_key: int | None = None) -> bytes:
    """A v3 certificate for ``key`` (PEM), with a random serial, the subject's
    attributes in order (``{"O": ..., "CN": ...}``), valid between the two times (Unix
    seconds; never past the issuer's own end), with ``extensions`` as OpenSSL's
    configuration syntax writes them (``("basicConstraints", "critical,CA:FALSE")``),
    signed with SHA-256 by ``issuer_key`` (self-signed when no issuer is given)."""
    c = lib()
    c.ERR_clear_error()
    cert = c.X509_new()
    _check(cert, "X509_new")
    try:
        _check(c.X509_set_version(cert, 2), "X509_set_version")
        serial = secrets.token_bytes(SERIAL_BYTES)
        serial = bytes([serial[0] & 0x7F | 0x40]) + serial[1:]  # positive, full length
        bn = c.BN_bin2bn(serial, len(serial), None)
        _check(bn, "BN_bin2bn")
        try:
            _check(c.BN_to_ASN1_INTEGER(bn, c.X509_get_serialNumber(cert)), "serial number")
        finally:
            c.BN_free(bn)
        _check(c.ASN1_TIME_set(c.X509_getm_notBefore(cert), not_before), "notBefore")
        if issuer is not None and c.ASN1_TIME_cmp_time_t(
                c.X509_get0_notAfter(issuer), not_after) < 0:
            _check(c.X509_set1_notAfter(cert, c.X509_get0_notAfter(issuer)), "notAfter")
        else:
            _check(c.ASN1_TIME_set(c.X509_getm_notAfter(cert), not_after), "notAfter")
        name = c.X509_get_subject_name(cert)
        for field, value in subject.items():
            text = value.encode()
            _check(c.X509_NAME_add_entry_by_txt(name, field.encode(), MBSTRING_UTF8, text,
                                                len(text), -1, 0), f"subject {field}")
        _check(c.X509_set_issuer_name(
            cert, c.X509_get_subject_name(issuer if issuer is not None else cert)),
            "X509_set_issuer_name")
        _check(c.X509_set_pubkey(cert, key), "X509_set_pubkey")
        ctx = ctypes.create_string_buffer(256)  # X509V3_CTX (64 bytes in OpenSSL 3)
        c.X509V3_set_ctx(ctx, issuer if issuer is not None else cert, cert, None, None, 0)
        for ext_name, value in extensions:
            ext = c.X509V3_EXT_nconf_nid(None, ctx, c.OBJ_txt2nid(ext_name.encode()),
                                         value.encode())
            _check(ext, f"extension {ext_name}={value}")
            try:
                _check(c.X509_add_ext(cert, ext, -1), f"adding {ext_name}")
            finally:
                c.X509_EXTENSION_free(ext)
        _check(c.X509_sign(cert, issuer_key if issuer_key is not None else key,
                           c.EVP_sha256()), "X509_sign")
        with _bio() as bio:
            _check(c.PEM_write_bio_X509(bio, cert), "PEM_write_bio_X509")
            return _bio_bytes(bio)
    finally:
        c.X509_free(cert)
