"""``flowmill serve`` as a user runs it: the command in a subprocess on a loopback port,
called over HTTP with TensorFlow Serving's REST requests. Its answers equal what the
loaded export computes in this process; every bad request gets a JSON error naming the
problem and the server keeps serving; SIGTERM and Ctrl-C stop it with exit 0."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.launcher.serve import BadRequest, ModelServer
from flowmill.runtime import saved_model

READY_TIMEOUT_S = 60
HTTP_TIMEOUT_S = 10
STOP_TIMEOUT_S = 5
READY = re.compile(r"flowmill serve: model '(\S+)' \(version 1, from .*\) ready at (http://\S+)")


def export_models(root: Path) -> dict[str, Path]:
    """Two exports: ``one`` takes ``x`` and gives ``scores``; ``two`` takes ``x`` and ``k``
    and gives ``scores`` and ``shifted`` (the best score's index plus ``k``)."""
    graph = fm.Graph(seed=11)
    with graph.as_default():
        x = fm.placeholder(fm.float32, (None, 4), name="x")
        k = fm.placeholder(fm.int32, (None,), name="k")
        w = fm.Variable(fm.random_normal((4, 3)), name="w")
        b = fm.Variable(fm.random_normal((3,)), name="b")
        scores = fm.matmul(x, w) + b
        shifted = fm.add(fm.cast(fm.argmax(scores, axis=1), fm.int32), k, name="shifted")
        init = fm.global_variables_initializer()
    with fm.Session(graph) as sess:
        sess.run(init)
        saved_model.save(sess, root / "one", {"x": x}, {"scores": scores})
        saved_model.save(sess, root / "two", {"x": x, "k": k},
                         {"scores": scores, "shifted": shifted})
    return {"one": root / "one", "two": root / "two"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    return export_models(tmp_path_factory.mktemp("exports"))


def start(path: Path | str, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flowmill.launcher.cli", "serve", str(path), "--port", "0", *args],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def ready(proc: subprocess.Popen) -> tuple[str, str]:
    """The model's name and URL from the server's ready line (bounded wait)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=READY_TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"no ready line in {READY_TIMEOUT_S}s") from None
    match = READY.match(line)
    if match is None:
        proc.kill()
        raise AssertionError(f"ready line {line!r}; stderr: {proc.communicate(timeout=10)[1]}")
    return match[1], match[2]


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        raise AssertionError(f"not stopped {STOP_TIMEOUT_S}s after {sig!r}") from None
    return proc.returncode, err


@pytest.fixture(scope="module")
def servers(exports, tmp_path_factory):
    """Both exports served, ``one`` with a body limit of 4096 bytes: name -> URL."""
    cwd = tmp_path_factory.mktemp("serve")
    procs = {"one": start(exports["one"], "--max-body-bytes", "4096", cwd=cwd),
             "two": start(exports["two"], "--name", "two-inputs", cwd=cwd)}
    try:
        urls = {}
        for key, proc in procs.items():
            name, urls[key] = ready(proc)
            assert name == {"one": "one", "two": "two-inputs"}[key]
        yield urls
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                code, err = stop(proc)
                assert code == 0 and "Traceback" not in err, err


def call(url: str, body=None, method: str | None = None) -> tuple[int, dict]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rows(n: int = 5) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)


# ---- status and metadata


def test_status_and_metadata(servers, exports):
    for url in (servers["one"], servers["one"] + "/versions/1"):
        assert call(url) == (200, {"model_version_status": [{
            "version": "1", "state": "AVAILABLE",
            "status": {"error_code": "OK", "error_message": ""}}]})
    code, meta = call(servers["two"] + "/metadata")
    assert code == 200
    assert meta["model_spec"] == {"name": "two-inputs", "signature_name": "", "version": "1"}
    signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature == saved_model.load(exports["two"]).signature
    assert signature["inputs"]["k"] == {"name": "k:0", "dtype": "int32", "shape": [None]}


# ---- predictions equal the loaded export's


def test_one_input_row_and_columnar_predictions(servers, exports):
    x = rows()
    want = saved_model.load(exports["one"])(x=x)["scores"]
    code, answer = call(servers["one"] + ":predict", {"instances": x.tolist()})
    assert code == 200, answer
    np.testing.assert_array_equal(np.asarray(answer["predictions"], np.float32), want)
    for inputs in (x.tolist(), {"x": x.tolist()}):
        code, answer = call(servers["one"] + ":predict", {"inputs": inputs})
        assert code == 200, answer
        np.testing.assert_array_equal(np.asarray(answer["outputs"], np.float32), want)
    code, answer = call(servers["one"] + ":predict",
                        {"instances": [{"x": r} for r in x.tolist()],
                         "signature_name": "serving_default"})
    np.testing.assert_array_equal(np.asarray(answer["predictions"], np.float32), want)


def test_two_inputs_row_and_columnar_predictions(servers, exports):
    x, k = rows(4), np.array([0, 10, 20, -5], np.int32)
    want = saved_model.load(exports["two"])(x=x, k=k)
    instances = [{"x": xi, "k": int(ki)} for xi, ki in zip(x.tolist(), k, strict=True)]
    code, answer = call(servers["two"] + ":predict", {"instances": instances})
    assert code == 200, answer
    assert [sorted(p) for p in answer["predictions"]] == [["scores", "shifted"]] * 4
    np.testing.assert_array_equal(
        np.asarray([p["scores"] for p in answer["predictions"]], np.float32), want["scores"])
    assert [p["shifted"] for p in answer["predictions"]] == want["shifted"].tolist()
    code, answer = call(servers["two"] + ":predict", {"inputs": {"x": x.tolist(), "k": k.tolist()}})
    assert code == 200, answer
    np.testing.assert_array_equal(np.asarray(answer["outputs"]["scores"], np.float32),
                                  want["scores"])
    assert answer["outputs"]["shifted"] == want["shifted"].tolist()


def test_requests_at_once_each_get_their_own_answer(servers, exports):
    """Predictions run side by side in the server's thread pool."""
    model = saved_model.load(exports["one"])
    batches = [rows(n) for n in range(1, 17)]
    answers: dict[int, tuple] = {}

    def ask(i: int) -> None:
        answers[i] = call(servers["one"] + ":predict", {"inputs": batches[i].tolist()})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HTTP_TIMEOUT_S * 2)
    for i, x in enumerate(batches):
        code, answer = answers[i]
        assert code == 200, answer
        np.testing.assert_array_equal(np.asarray(answer["outputs"], np.float32),
                                      model(x=x)["scores"])


# ---- bad requests: a JSON error naming the problem, and the server serves on


BAD_ONE = [
    (b"{not json", 400, "the request body is not JSON"),
    ([1, 2], 400, "must be a JSON object with 'instances'"),
    ({"instances": [[0] * 4], "inputs": [[0] * 4]}, 400, "exactly one of 'instances'"),
    ({}, 400, "exactly one of 'instances'"),
    ({"instance": [[0] * 4]}, 400, "unknown request field(s) 'instance'"),
    ({"instances": []}, 400, "'instances' must be a non-empty list"),
    ({"instances": [[0] * 3]}, 400, "shape (1, 3) to 'x' (input), which has shape (?, 4)"),
    ({"inputs": {"z": [[0] * 4]}}, 400, "unknown input 'z'; missing input 'x'"),
    ({"instances": [{"z": [0] * 4}]}, 400, "instance 0: unknown input 'z', missing input 'x'"),
    ({"instances": [["a", "b", "c", "d"]]}, 400, "input 'x' is float32; it was given strings"),
    ({"instances": [[0] * 4, [0] * 3]}, 400, "cannot feed list to input 'x'"),
    ({"instances": [[0] * 4], "signature_name": "other"}, 400, "no signature 'other'"),
    (b"[" + b"0," * 4000 + b"0]", 413, "over the limit of 4096 bytes"),
]


@pytest.mark.parametrize("body, status, message", BAD_ONE,
                         ids=[m.split("'")[0][:30] for _, _, m in BAD_ONE])
def test_a_bad_request_is_answered_with_its_problem(servers, body, status, message):
    code, answer = call(servers["one"] + ":predict", body, "POST")
    assert (code, list(answer)) == (status, ["error"]), answer
    assert message in answer["error"], answer["error"]
    assert call(servers["one"])[0] == 200  # still serving


BAD_TWO = [
    ({"instances": [{"x": [0] * 4, "k": 1.5}]}, "cannot feed float64 values to 'k' (int32): "
     "1.5 does not fit int32"),
    ({"instances": [{"x": [0] * 4}]}, "instance 0: missing input 'k'"),
    ({"instances": [[0] * 4]}, "instance 0 must be an object of the inputs 'x', 'k'"),
    ({"inputs": [[0] * 4]}, "'inputs' must be an object of the inputs 'x', 'k'"),
    ({"inputs": {"x": [[0] * 4] * 2, "k": [1, 2, 3]}},
     "node 'shifted' (Add) failed: operands could not be broadcast"),
]


@pytest.mark.parametrize("body, message", BAD_TWO, ids=[m[:30] for _, m in BAD_TWO])
def test_a_bad_request_for_two_inputs_names_the_input(servers, body, message):
    code, answer = call(servers["two"] + ":predict", body)
    assert code == 400 and message in answer["error"], answer
    code, answer = call(servers["two"] + ":predict", {"inputs": {"x": [[0] * 4], "k": [1]}})
    assert code == 200, answer


@pytest.mark.parametrize("path, method, message", [
    ("/v1/models/other", "GET", "no model 'other' here: this server serves 'one'"),
    ("/v1/models/one/versions/2", "GET", "model 'one' has no version '2'"),
    ("/v1/models/one/labels", "GET", "no resource '/labels' of model 'one'"),
    ("/v1/models/one:classify", "POST", "answers POST to :predict only"),
    ("/v2/anything", "GET", "no route GET /v2/anything"),
    ("/v1/models/one", "PUT", "no route PUT /v1/models/one"),
])
def test_an_unknown_path_is_404_naming_it(servers, path, method, message):
    base = servers["one"].split("/v1/")[0]
    code, answer = call(base + path, b"{}" if method != "GET" else None, method)
    assert code == 404 and message in answer["error"], answer


def test_an_output_without_a_row_per_instance_needs_the_columnar_format(tmp_path):
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, (None,), name="x")
        total = fm.reduce_sum(x)
    with fm.Session(graph) as sess:
        saved_model.save(sess, tmp_path / "sum", {"x": x}, {"total": total})
    server = ModelServer(saved_model.load(tmp_path / "sum"), "sum", 1 << 20)
    try:
        with pytest.raises(BadRequest, match=r"output 'total' has shape \(\), not one row per "
                           r"instance \(3\): ask in the columnar format"):
            server.predict(b'{"instances": [1, 2, 3]}')
        assert json.loads(server.predict(b'{"inputs": [1, 2, 3]}')) == {"outputs": 6.0}
    finally:
        server.pool.shutdown()


# ---- starting and stopping


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_stops_the_server_with_exit_0(exports, tmp_path, sig):
    proc = start(exports["one"], cwd=tmp_path)
    _, url = ready(proc)
    assert call(url + ":predict", {"instances": [[1, 2, 3, 4]]})[0] == 200
    code, err = stop(proc, sig)
    assert code == 0, err
    assert "model 'one' stopped" in err and "Traceback" not in err, err


def test_an_export_that_is_not_there_fails_naming_the_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "serve", str(tmp_path / "missing")],
        cwd=tmp_path, capture_output=True, text=True, timeout=READY_TIMEOUT_S,
    )
    assert proc.returncode == 1
    assert f"flowmill serve: {tmp_path / 'missing'}/signature.json is missing" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_port_in_use_fails_naming_it(servers, exports, tmp_path):
    port = servers["one"].split(":")[2].split("/")[0]
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "serve", str(exports["one"]),
         "--port", port], cwd=tmp_path, capture_output=True, text=True, timeout=READY_TIMEOUT_S,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"flowmill serve: cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
