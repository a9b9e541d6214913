"""The operator's API client: its identity from a kubeconfig or a ServiceAccount, and its
requests over real HTTPS to a server on loopback (the e2e tests run it against
kube-apiserver)."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import ssl
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from flowmill.operator import apiclient
from flowmill.operator.apiclient import ApiError, Credentials, Kube, RateLimit, path


def _pem_pair(subject: str, issuer=None, ca: bool = False, san_ip: str | None = None):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (name, key)
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=1))
               .not_valid_after(now + dt.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san_ip:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address(san_ip))]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    return cert, key


def _write(path: Path, cert, key) -> tuple[Path, Path]:
    crt, pem = path.with_suffix(".crt"), path.with_suffix(".key")
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return crt, pem


class Server:
    """An HTTPS server on 127.0.0.1 that records requests and answers from a script."""

    def __init__(self, tmp: Path) -> None:
        ca = _pem_pair("test-ca", ca=True)
        self.ca_file, _ = _write(tmp / "ca", *ca)
        server_crt, server_key = _write(tmp / "server",
                                        *_pem_pair("apiserver", ca, san_ip="127.0.0.1"))
        self.requests: list[tuple[str, str, dict, bytes]] = []
        self.replies: list[tuple[int, dict]] = []
        self.close_after_reply = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                outer.requests.append((self.command, self.path, dict(self.headers), body))
                status, reply = outer.replies.pop(0) if outer.replies else (200, {})
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if outer.close_after_reply:
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _serve  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(server_crt, server_key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path: Path):
    s = Server(tmp_path)
    yield s
    s.close()


def test_paths_of_core_group_cluster_scoped_and_subresources():
    assert path("v1", "pods", "ml") == "/api/v1/namespaces/ml/pods"
    assert path("v1", "pods", "ml", "mnist-worker-0") == "/api/v1/namespaces/ml/pods/mnist-worker-0"
    assert path("flowmill.dev/v1alpha1", "trainingjobs", "ml", "mnist", "status") == \
        "/apis/flowmill.dev/v1alpha1/namespaces/ml/trainingjobs/mnist/status"
    assert path("scheduling.k8s.io/v1", "priorityclasses", name="high") == \
        "/apis/scheduling.k8s.io/v1/priorityclasses/high"
    assert path("v1", "pods", "ml", "a/b") == "/api/v1/namespaces/ml/pods/a%2Fb"


def test_requests_are_json_with_the_token_on_one_kept_alive_connection(server):
    server.replies = [(200, {"kind": "Pod", "metadata": {"name": "p"}}),
                      (201, {"kind": "Pod", "metadata": {"name": "q"}}),
                      (409, {"kind": "Status", "message": "pods \"q\" already exists"})]
    waits = []
    limit = RateLimit(0.001, 1, sleep=waits.append)  # asleep for ever, but not here
    kube = Kube(Credentials(server.url, ca_file=str(server.ca_file), token="t0k"), limit)
    assert kube.get(path("v1", "pods", "ml", "p"))["metadata"]["name"] == "p"
    made = kube.create(path("v1", "pods", "ml"), {"metadata": {"name": "q"}})
    assert made["metadata"]["name"] == "q"
    with pytest.raises(ApiError) as refused:
        kube.create(path("v1", "pods", "ml"), {"metadata": {"name": "q"}})
    assert (refused.value.status, refused.value.message) == (409, 'pods "q" already exists')
    (m1, p1, h1, _), (m2, _, h2, b2), _ = server.requests
    assert (m1, p1) == ("GET", "/api/v1/namespaces/ml/pods/p")
    assert h1["Authorization"] == "Bearer t0k" and "Content-Type" not in h1
    assert m2 == "POST" and h2["Content-Type"] == "application/json"
    assert json.loads(b2) == {"metadata": {"name": "q"}}
    assert len(waits) == 2  # a burst of 1: the second and third request waited their turn
    kube.get(path("v1", "pods", "ml"), labelSelector="flowmill.dev/job-name=mnist")
    assert server.requests[-1][1] == \
        "/api/v1/namespaces/ml/pods?labelSelector=flowmill.dev%2Fjob-name%3Dmnist"
    kube.close()


def test_a_connection_the_server_closed_is_dialled_again(server):
    server.close_after_reply = True
    kube = Kube(Credentials(server.url, ca_file=str(server.ca_file)))
    for _ in range(3):
        assert kube.get("/api/v1/namespaces") == {}
    assert len(server.requests) == 3


def test_an_untrusted_server_is_refused(server, tmp_path):
    other, _ = _write(tmp_path / "other", *_pem_pair("other-ca", ca=True))
    kube = Kube(Credentials(server.url, ca_file=str(other)))
    with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):
        kube.get("/api/v1/namespaces")
    assert server.requests == []


def _kubeconfig(tmp: Path, user: dict, cluster: dict | None = None) -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "e2e",
           "contexts": [{"name": "e2e", "context": {"cluster": "c", "user": "u"}}],
           "clusters": [{"name": "c", "cluster": cluster or {
               "server": "https://127.0.0.1:6443", "certificate-authority": "pki/ca.crt"}}],
           "users": [{"name": "u", "user": user}]}
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_kubeconfig_paths_embedded_data_and_tokens(tmp_path):
    creds = apiclient.from_kubeconfig(_kubeconfig(tmp_path, {
        "client-certificate": "pki/admin.crt", "client-key": "/abs/admin.key"}))
    assert creds.server == "https://127.0.0.1:6443"
    assert creds.ca_file == str(tmp_path / "pki" / "ca.crt")  # relative to the file
    assert (creds.cert_file, creds.key_file) == (str(tmp_path / "pki" / "admin.crt"),
                                                 "/abs/admin.key")
    creds = apiclient.from_kubeconfig(_kubeconfig(tmp_path, {
        "client-certificate-data": base64.b64encode(b"CERT").decode(),
        "client-key-data": base64.b64encode(b"KEY").decode()}, {
        "server": "https://k8s:6443/", "certificate-authority-data":
            base64.b64encode(b"CA").decode(), "insecure-skip-tls-verify": False}))
    assert creds.server == "https://k8s:6443"
    for file, data in ((creds.ca_file, b"CA"), (creds.cert_file, b"CERT"),
                       (creds.key_file, b"KEY")):
        assert Path(file).read_bytes() == data
        assert stat.S_IMODE(Path(file).stat().st_mode) == 0o600
        Path(file).unlink()
    creds = apiclient.from_kubeconfig(_kubeconfig(tmp_path, {"token": "abc"}))
    assert creds.token == "abc" and creds.cert_file is None


def test_kubeconfig_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="logs in with exec, which the operator does not"):
        apiclient.from_kubeconfig(_kubeconfig(tmp_path, {"exec": {"command": "aws"}}))
    with pytest.raises(ValueError, match="cluster 'c' has no server"):
        apiclient.from_kubeconfig(_kubeconfig(tmp_path, {"token": "x"}, {"x": 1}))
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({"current-context": "nowhere"}))
    with pytest.raises(ValueError, match="no context named 'nowhere'"):
        apiclient.from_kubeconfig(path)
    with pytest.raises(ValueError, match="cannot read the kubeconfig"):
        apiclient.from_kubeconfig(tmp_path / "missing")


def test_in_a_pod_the_service_account_and_its_rotated_token(tmp_path, server):
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("first\n")
    (account / "ca.crt").write_bytes(server.ca_file.read_bytes())
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": server.url.rsplit(":", 1)[1]}
    creds = apiclient.load_credentials(env, account)
    assert creds.server == server.url and creds.token_file == str(account / "token")
    assert apiclient.load_credentials({**env, "KUBERNETES_SERVICE_HOST": "fd00::1"},
                                      account).server.startswith("https://[fd00::1]:")
    kube = Kube(creds)
    kube.get("/api")
    (account / "token").write_text("second\n")  # the kubelet rotated it
    kube._token = (kube._token[0] - apiclient.TOKEN_REREAD_SECONDS, kube._token[1])
    kube.get("/api")
    assert [h["Authorization"] for _, _, h, _ in server.requests] == [
        "Bearer first", "Bearer second"]


def test_a_list_is_read_a_page_at_a_time_and_each_object_passed_on(server):
    server.replies = [
        (200, {"metadata": {"resourceVersion": "41", "continue": "t1"},
               "items": [{"n": 1}, {"n": 2}]}),
        (200, {"metadata": {"resourceVersion": "41"}, "items": [{"n": 3}]})]
    kube = Kube(Credentials(server.url, ca_file=str(server.ca_file), token="t"))
    listing = kube.list(path("v1", "pods", "ml"), lambda o: {"seen": o["n"]}, limit=2,
                        labelSelector="flowmill.dev/job-name")
    assert listing == {"metadata": {"resourceVersion": "41"},
                       "items": [{"seen": 1}, {"seen": 2}, {"seen": 3}]}
    first, second = (where for _, where, _, _ in server.requests)
    assert first == "/api/v1/namespaces/ml/pods?labelSelector=flowmill.dev%2Fjob-name&limit=2"
    assert second.endswith("&limit=2&continue=t1")
    kube.close()
