"""SeaweedFS as the S3 store: credentials file and bucket creation.

SeaweedFS (Apache-2.0) serves the S3 API from its filer. Buckets are made with a plain,
SigV4-signed ``PUT /<bucket>`` so the harness needs no S3 SDK (obstore cannot create
buckets).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from obstore.store import S3Store

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class S3Info:
    """Where and how to reach the test S3 store."""

    endpoint: str  # http://127.0.0.1:<port>
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The usual AWS variables, as a pod or a client library would read them."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def store(self, prefix: str | None = None) -> S3Store:
        """An obstore ``S3Store`` on the test bucket (plain HTTP: it is loopback)."""
        return S3Store(
            self.bucket, prefix=prefix,
            config={"endpoint": self.endpoint, "access_key_id": self.access_key,
                    "secret_access_key": self.secret_key, "region": self.region},
            client_options={"allow_http": True},
        )


def write_identities(path: Path, access_key: str, secret_key: str) -> None:
    """Write SeaweedFS's ``-s3.config`` file: one identity with every permission."""
    config = {
        "identities": [{
            "name": "flowmill",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _signed_request(info: S3Info, method: str, path: str) -> urllib.request.Request:
    """An AWS SigV4-signed request with an empty body."""
    url = info.endpoint.rstrip("/") + path
    host = urlsplit(url).netloc
    now = dt.datetime.now(dt.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([
        method, path, "",
        "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
        signed, EMPTY_SHA256,
    ])
    scope = f"{day}/{info.region}/s3/aws4_request"
    to_sign = "\n".join([
        "AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest(),
    ])
    key = _hmac(f"AWS4{info.secret_key}".encode(), day)
    for part in (info.region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    auth = (f"AWS4-HMAC-SHA256 Credential={info.access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}")
    req = urllib.request.Request(url, method=method)
    for k, v in headers.items():
        if k != "host":
            req.add_header(k, v)
    req.add_header("Authorization", auth)
    return req


def create_bucket(info: S3Info, bucket: str | None = None) -> None:
    """Create ``bucket`` (default: ``info.bucket``); an existing bucket is fine."""
    name = bucket or info.bucket
    try:
        with urllib.request.urlopen(_signed_request(info, "PUT", f"/{name}"), timeout=10):
            pass
    except urllib.error.HTTPError as err:
        body = err.read().decode(errors="replace")
        if "BucketAlreadyOwnedByYou" not in body and "BucketAlreadyExists" not in body:
            raise RuntimeError(f"creating bucket {name}: HTTP {err.code}: {body}") from err


def bucket_exists(info: S3Info, bucket: str | None = None) -> bool:
    """True once ``HEAD /<bucket>`` succeeds: the S3 gateway is up and authorizes us."""
    req = _signed_request(info, "HEAD", f"/{bucket or info.bucket}")
    try:
        with urllib.request.urlopen(req, timeout=5):
            return True
    except urllib.error.HTTPError:
        return False
