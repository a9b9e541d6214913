"""A task's progress record, its HTTP endpoint (served by real processes and threads, read
over loopback), the job-wide aggregation, and the progress bar that reports into it."""

from __future__ import annotations

import io
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

from flowmill.runtime import telemetry as tm
from flowmill.runtime.cluster import (
    ENV_METRICS_PORT,
    ENV_PROGRESS,
    ENV_VAR,
    ClusterSpec,
    TaskConfig,
    bind_host,
    fetch_progress,
)
from flowmill.runtime.progress import ProgressBar

TIMEOUT_S = 60.0


class Clock:
    """A clock the test moves (the rate is a function of time)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def config(role: str = "worker", index: int = 1, host: str = "127.0.0.1") -> str:
    cluster = ClusterSpec.from_dict({"ps": [f"{host}:2000"],
                                     "worker": [f"{host}:2001", f"{host}:2002"]})
    return TaskConfig(cluster, role, index).to_json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()




# ---- the record


def test_snapshot_holds_step_total_loss_and_checkpoint():
    clock, wall = Clock(), Clock(1_740_830_400.0)  # 2025-03-01T12:00:00Z
    t = tm.Telemetry(clock, wall, environ={ENV_VAR: config("worker", 1)})
    assert t.snapshot() == {"task": {"role": "worker", "index": 1}, "step": 0, "total": None,
                            "loss": None, "examples": 0, "examplesPerSecond": 0.0,
                            "updated": None, "uptimeSeconds": 0.0}
    t.report_step(1, 100, 2.5, 32)
    clock.t += 1
    wall.t += 1
    t.report_step(2, 100, None, 32)  # no loss this step: the last one stays
    t.report_checkpoint(2, "s3://bucket/job/ckpt-2")
    snap = t.snapshot()
    assert snap["step"] == 2 and snap["total"] == 100 and snap["loss"] == 2.5
    assert snap["examples"] == 64 and snap["examplesPerSecond"] == 32.0
    assert snap["updated"] == "2025-03-01T12:00:01Z"
    assert snap["lastCheckpoint"] == {"step": 2, "uri": "s3://bucket/job/ckpt-2",
                                      "time": "2025-03-01T12:00:01Z"}
    # Step times on this process's clock: the median, the time since the last step ended,
    # and how long the process has reported.
    clock.t += 0.5
    later = t.snapshot()
    assert later["stepSeconds"] == 1.0 and later["sinceStepSeconds"] == 0.5
    assert later["uptimeSeconds"] == 1.5
    # Always valid JSON: a loss that is not finite is left out.
    t.report_step(3, 100, float("nan"), 32)
    assert t.snapshot()["loss"] is None
    json.dumps(t.snapshot(), allow_nan=False)
    # Without a cluster spec (or with a broken one) there is no task to name.
    for environ in ({}, {ENV_VAR: "{not json"}, {ENV_VAR: '{"cluster": 1, "task": 2}'}):
        assert "task" not in tm.Telemetry(environ=environ).snapshot()


def test_train_op_runs_count_as_steps_until_the_script_reports_its_own():
    """No ProgressBar: each run of the train op is a step (its duration observed); the
    script's first own report takes over and what counting recorded is dropped."""
    clock = Clock()
    t = tm.Telemetry(clock, clock, environ={})
    for _ in range(3):
        clock.t += 0.5
        t.count_step()
    assert t.snapshot()["step"] == 3
    assert "flowmill_step_seconds_count 2" in t.prometheus().splitlines()
    t.report_step(1, 10, 0.5, 8)
    clock.t += 0.5
    t.count_step()  # ignored from now on
    t.report_step(2, 10, 0.4, 8)
    snap = t.snapshot()
    assert (snap["step"], snap["total"]) == (2, 10)
    assert "flowmill_step_seconds_count 1" in t.prometheus().splitlines()


def test_examples_per_second_is_over_the_recent_window():
    clock = Clock()
    t = tm.Telemetry(clock)
    t.report_step(1, None, None, 100)
    assert t.examples_per_second() == 0.0  # one report: no duration yet
    for step in range(2, 42):  # 100 examples every 0.5 s for 20 s
        clock.t += 0.5
        t.report_step(step, None, None, 100)
    assert t.examples_per_second() == pytest.approx(200.0)
    # Twice as fast for the last 10 s: the rate is the new one, not the run's average.
    for step in range(42, 82):
        clock.t += 0.25
        t.report_step(step, None, None, 100)
    assert t.examples_per_second() == pytest.approx(400.0)
    # A pause: the rate falls as the window moves past the last step, to 0.
    clock.t += 5
    assert t.examples_per_second() == pytest.approx(400.0 * 5 / 10)
    clock.t += 10
    assert t.examples_per_second() == 0.0
    # Training resumes after a long pause: the pause does not count in the new rate.
    for step in range(82, 102):
        clock.t += 0.5
        t.report_step(step, None, None, 50)
    assert t.examples_per_second() == pytest.approx(100.0, rel=0.06)


def test_the_record_stays_small_however_fast_steps_come():
    clock = Clock()
    t = tm.Telemetry(clock)
    for step in range(100_000):  # 100 s of steps a millisecond apart
        clock.t += 0.001
        t.report_step(step, None, None, 1)
    assert len(t._marks) <= 2 * tm.RATE_WINDOW_S / tm.RATE_RESOLUTION_S + 2
    assert t.examples_per_second() == pytest.approx(1000.0, rel=0.02)


def test_prometheus_text():
    clock, wall = Clock(), Clock(1_740_830_400.0)
    t = tm.Telemetry(clock, wall, environ={ENV_VAR: config("worker", 0)})
    t.report_step(7, 10, 0.125, 8)
    text = t.prometheus()
    assert "# TYPE flowmill_step gauge" in text
    assert 'flowmill_step{role="worker",index="0"} 7' in text
    assert 'flowmill_total_steps{role="worker",index="0"} 10' in text
    assert 'flowmill_loss{role="worker",index="0"} 0.125' in text
    assert "# TYPE flowmill_examples_total counter" in text
    assert 'flowmill_examples_per_second{role="worker",index="0"} 0.0' in text
    assert "flowmill_last_checkpoint_step" not in text  # none yet
    t.report_checkpoint(5, "file:///tmp/ckpt")
    t.report_step(8, 10, float("nan"), 8)
    text = t.prometheus()
    assert 'flowmill_last_checkpoint_step{role="worker",index="0"} 5' in text
    assert ('flowmill_last_checkpoint_timestamp_seconds{role="worker",index="0"} '
            "1740830400.0") in text
    assert 'flowmill_loss{role="worker",index="0"} NaN' in text
    # Every sample line is "name{labels} value" with a value Prometheus parses.
    for line in text.splitlines():
        if not line.startswith("#"):
            value = line.rsplit(" ", 1)[1]
            assert value == "NaN" or math.isfinite(float(value)), line


# ---- where the endpoint listens


def test_bind_host_is_the_pods_own_loopback_address():
    assert bind_host({"POD_IP": "127.12.0.5"}) == "127.12.0.5"
    assert bind_host({"POD_IP": "10.4.0.17"}) == "0.0.0.0"
    assert bind_host({"POD_IP": "localhost"}) == "127.0.0.1"
    assert bind_host({ENV_VAR: config(host="127.0.0.1")}) == "127.0.0.1"
    assert bind_host({ENV_VAR: config(host="job-worker-1.ns.svc")}) == "0.0.0.0"
    assert bind_host({}) == "127.0.0.1"


# ---- the endpoint


def test_server_serves_progress_and_metrics():
    t = tm.Telemetry(Clock(), environ={ENV_VAR: config("worker", 0)})
    t.report_step(3, 9, 0.5, 4)
    t.report_checkpoint(3, "memory://ckpt/3")
    server = tm.TelemetryServer(t, "127.0.0.1", 0)
    try:
        kind, body = get(server.url + "/progress")
        assert kind == "application/json"
        assert json.loads(body) == t.snapshot()
        assert fetch_progress(server.url + "/progress", 5) == t.snapshot()
        kind, body = get(server.url + "/metrics?x=1")
        assert kind.startswith("text/plain; version=0.0.4")
        assert 'flowmill_step{role="worker",index="0"} 3' in body
        with pytest.raises(urllib.error.HTTPError) as e:
            get(server.url + "/")
        assert e.value.code == 404
        # What is not a snapshot is not taken for one.
        assert fetch_progress(server.url + "/metrics", 5) is None
        assert fetch_progress(server.url + "/nothing", 5) is None
    finally:
        server.close()
    assert fetch_progress(server.url + "/progress", 5) is None  # nobody serves


def test_the_progress_reader_follows_no_redirect():
    """A task's endpoint that answers with a redirect (to a snapshot served elsewhere) is
    not followed: the reader gets nothing, as from a task that is not serving."""
    import http.server
    import threading

    t = tm.Telemetry(Clock(), environ={ENV_VAR: config("worker", 0)})
    t.report_step(3, 9, 0.5, 4)
    target = tm.TelemetryServer(t, "127.0.0.1", 0)

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            self.send_response(302)
            self.send_header("Location", target.url + "/progress")
            self.end_headers()

        def log_message(self, *args):
            pass

    redirect = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=redirect.serve_forever, daemon=True)
    thread.start()
    try:
        assert fetch_progress(target.url + "/progress", 5) == t.snapshot()
        url = f"http://127.0.0.1:{redirect.server_address[1]}/progress"
        assert fetch_progress(url, 5) is None
    finally:
        redirect.shutdown()
        redirect.server_close()
        target.close()


TASK = textwrap.dedent("""
    import sys
    from flowmill.runtime import telemetry
    for step in range(1, 6):
        telemetry.report_step(step, 5, 1.0 / step, 16)
    telemetry.report_checkpoint(4, "file:///tmp/ckpt-4")
    server = telemetry.server(timeout=60)
    print("serving" if server else "not serving", server and server.host, flush=True)
    sys.stdin.readline()
    print("trained on", flush=True)
""")


def run_task(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TASK], env={**os.environ, **env},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_task_serves_its_progress_on_its_pods_address():
    port = free_port()
    # A pod of the test cluster: its own loopback address, a port its neighbours use too.
    proc = run_task({ENV_METRICS_PORT: str(port), "POD_IP": "127.43.0.7",
                     ENV_VAR: config("worker", 1)})
    try:
        assert proc.stdout.readline().split() == ["serving", "127.43.0.7"]
        snap = fetch_progress(f"http://127.43.0.7:{port}/progress", 10)
        assert snap is not None
        assert snap["task"] == {"role": "worker", "index": 1}
        assert (snap["step"], snap["total"], snap["loss"], snap["examples"]) == (5, 5, 0.2, 80)
        assert snap["lastCheckpoint"]["step"] == 4
        _, text = get(f"http://127.43.0.7:{port}/metrics")
        assert 'flowmill_last_checkpoint_step{role="worker",index="1"} 4' in text
        # Not on another address.
        assert fetch_progress(f"http://127.0.0.1:{port}/progress", 2) is None
        out, err = proc.communicate("\n", timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out == "trained on\n" and err == ""


def test_a_port_that_cannot_be_had_does_not_stop_training():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = run_task({ENV_METRICS_PORT: str(port), "POD_IP": "127.0.0.1"})
        out, err = proc.communicate("\n", timeout=TIMEOUT_S)
    assert proc.returncode == 0
    assert out.splitlines() == ["not serving None", "trained on"]
    assert f"flowmill: not serving training progress on 127.0.0.1:{port}" in err
    proc = run_task({ENV_METRICS_PORT: "ninety"})
    out, err = proc.communicate("\n", timeout=TIMEOUT_S)
    assert proc.returncode == 0 and "FLOWMILL_METRICS_PORT must be a port number" in err
    # Without the variable nothing is served and nothing said.
    env = {k: v for k, v in os.environ.items() if k != ENV_METRICS_PORT}
    proc = subprocess.run([sys.executable, "-c", TASK], env=env, input="\n",
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.splitlines()[0] == "not serving None"


# ---- the job's progress from its tasks'


def snap(step, total=None, loss=None, rate=0.0, ckpt=None):
    out = {"step": step, "total": total, "loss": loss, "examplesPerSecond": rate}
    if ckpt is not None:
        out["lastCheckpoint"] = {"step": ckpt, "uri": f"s3://b/ckpt-{ckpt}",
                                 "time": "2025-03-01T12:00:00Z"}
    return out


def test_aggregate_by_training_mode():
    tasks = [snap(40, 100, 0.5, 100.0, ckpt=30), snap(42, 100, 0.7, 110.0),
             snap(38, 100, 0.9, 90.5, ckpt=20)]
    sync = tm.aggregate(tasks, "sync")
    # Every step needs all three: the job is where the slowest is.
    assert sync == {"step": 38, "total": 100, "loss": 0.5, "examplesPerSecond": 300.5,
                    "lastCheckpoint": {"step": 30, "uri": "s3://b/ckpt-30",
                                       "time": "2025-03-01T12:00:00Z"}}
    # One backup worker: a step needs two of the three.
    assert tm.aggregate(tasks, "sync", backup_workers=1)["step"] == 40
    for mode in ("async", "bounded-staleness"):
        got = tm.aggregate(tasks, mode)
        assert (got["step"], got["total"]) == (120, 300)
        assert got["loss"] == 0.5 and got["examplesPerSecond"] == 300.5


def test_aggregate_takes_the_global_step_where_tasks_report_it():
    tasks = [{**snap(40, 100, 0.5, 100.0), "globalStep": 81},
             {**snap(42, 100, 0.7, 110.0), "globalStep": 83}, snap(38, 100, 0.9, 90.5)]
    for mode in ("sync", "async", "bounded-staleness"):
        assert tm.aggregate(tasks, mode)["step"] == 83  # the newest any task has seen
    t = tm.Telemetry(environ={})
    t.report_step(3, 10, 0.5, 8)
    assert "globalStep" not in t.snapshot()
    t.report_step(4, 10, 0.5, 8, global_step=9)
    assert t.snapshot()["globalStep"] == 9


def test_aggregate_with_tasks_not_heard_from():
    assert tm.aggregate([], "sync") == {"step": 0, "total": None, "loss": None,
                                        "examplesPerSecond": 0, "lastCheckpoint": None}
    partial = [None, snap(10, 50, 0.3, 64.0)]
    got = tm.aggregate(partial, "sync")
    assert (got["step"], got["total"], got["loss"]) == (0, 50, None)  # the chief: not yet
    got = tm.aggregate(partial, "async")
    assert (got["step"], got["total"], got["examplesPerSecond"]) == (10, None, 64.0)
    # Malformed values count as unknown.
    odd = [{"step": "7", "total": True, "loss": float("inf"), "examplesPerSecond": "x",
            "lastCheckpoint": {"step": None}}, snap(5, 10)]
    assert tm.aggregate(odd, "async") == {"step": 5, "total": None, "loss": None,
                                          "examplesPerSecond": 0.0, "lastCheckpoint": None}


# ---- the progress bar reports into the record


def test_progress_bar_reports_every_step(monkeypatch):
    monkeypatch.delenv(ENV_PROGRESS, raising=False)
    out = io.StringIO()
    with ProgressBar(20, stream=out, desc="train") as bar:
        for _ in range(20):
            bar.update(loss=0.5, examples=4)
    record = tm.snapshot()
    assert (record["step"], record["total"], record["loss"]) == (20, 20, 0.5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("train  step 20/20  100%  loss 0.5000")


def test_progress_bar_off_draws_nothing_but_reports(monkeypatch):
    monkeypatch.setenv(ENV_PROGRESS, "off")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream in (io.StringIO(), Terminal()):
        with ProgressBar(5, stream=stream) as bar:
            for step in range(1, 6):
                bar.update(step=step, loss=1.0 / step, examples=2)
                assert tm.snapshot()["step"] == step
        assert stream.getvalue() == ""
    assert tm.snapshot()["loss"] == 0.2
