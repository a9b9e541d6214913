"""The local launcher's one progress bar for a job: drawn from real task endpoints, and
shown by ``flowmill run --local`` while tiny task processes report through telemetry."""

from __future__ import annotations

import io
import os
import pathlib
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from flowmill.launcher.local import LocalLauncher
from flowmill.launcher.progress import JobProgress
from flowmill.operator.api import TrainingJob
from flowmill.runtime import telemetry as tm
from flowmill.runtime.cluster import ENV_METRICS_PORT, ENV_PROGRESS, PROGRESS_PATH

from threads import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 120.0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True




@pytest.fixture
def endpoints():
    """Two tasks' records, each served on its own loopback port."""
    records = [tm.Telemetry(), tm.Telemetry()]
    servers = [tm.TelemetryServer(r, "127.0.0.1", 0) for r in records]
    try:
        yield records, [(f"worker-{i}", s.url + PROGRESS_PATH)
                        for i, s in enumerate(servers)]
    finally:
        for s in servers:
            s.close()


def test_the_job_bar_on_a_terminal(endpoints):
    records, urls = endpoints
    records[0].report_step(30, 100, 0.25, 32)
    records[1].report_step(28, 100, 0.5, 32)
    records[0].report_checkpoint(20, "file:///ckpt/20")
    out, lock = Terminal(), threading.Lock()
    bar = JobProgress("mnist", "sync", 0, lambda: urls, out, lock, interval=0.02)
    bar.start()
    wait_until(lambda: "step  28/100" in out.getvalue(), "the bar", TIMEOUT_S, 0.02)
    line = out.getvalue().rsplit("\r", 1)[1]
    assert re.match(r"mnist  step  28/100  \[=+ +\]   28%  loss 0\.2500  checkpoint 20 *$", line)
    # A line written meanwhile takes the bar off the terminal first; it is drawn again.
    with lock:
        bar.erase()
        out.write("[worker-0] hello\n")
    records[1].report_step(31, 100, 0.5, 32)
    wait_until(lambda: "step  30/100" in out.getvalue().split("hello")[1], "the redrawn bar",
               TIMEOUT_S, 0.02)
    assert "\x1b[K[worker-0] hello\n" in out.getvalue()
    bar.stop()
    assert out.getvalue().endswith("\n") and not bar.running
    final = out.getvalue().rstrip("\n").rsplit("\r", 1)[1]
    assert final.startswith("mnist  step  30/100")


def test_the_job_bar_elsewhere_writes_a_line_now_and_then(endpoints):
    records, urls = endpoints
    out = io.StringIO()
    started: list[tuple[str, str]] = []  # the tasks started so far
    bar = JobProgress("mnist", "async", 0, lambda: started, out, threading.Lock(),
                      interval=0.02, line_interval=0.0)
    bar.start()
    time.sleep(0.2)  # rounds with no task to hear from: nothing to show
    assert out.getvalue() == ""
    started.extend(urls)
    records[0].report_step(3, 10, 1.0, 8)
    wait_until(lambda: "step 3" in out.getvalue(), "a line", TIMEOUT_S, 0.02)
    records[1].report_step(4, 10, 2.0, 8)
    wait_until(lambda: "step  7/20" in out.getvalue(), "the next line", TIMEOUT_S, 0.02)
    bar.stop()
    lines = out.getvalue().splitlines()
    assert all(line.startswith("flowmill: mnist  step ") for line in lines)
    assert "\r" not in out.getvalue()
    assert len(lines) == len(set(lines))  # the same line is not written again
    assert lines[-1].startswith("flowmill: mnist  step  7/20   35%  loss 1.0000")


def test_every_task_gets_its_own_metrics_port():
    job = TrainingJob.from_dict({
        "metadata": {"name": "t"},
        "spec": {"replicaSpecs": {
            "ps": {"replicas": 1},
            "chief": {"replicas": 1},
            "worker": {"replicas": 2, "template": {"spec": {"containers": [
                {"name": "flowmill", "image": "x", "command": ["python", "train.py"]}]}}}}}})
    launcher = LocalLauncher(job, python="/py", environ={})
    grpc_ports = [5001, 5002, 5003, 5004]
    tasks = launcher.plan(grpc_ports)
    trainers = [t for t in tasks if t.role != "ps"]
    ports = [int(t.env[ENV_METRICS_PORT]) for t in tasks]
    assert len(set(ports)) == 4 and not set(ports) & set(grpc_ports)
    assert all(t.env[ENV_PROGRESS] == "off" and t.env["POD_IP"] == "127.0.0.1"
               for t in trainers)
    ps = tasks[0]
    assert ps.role == "ps" and ENV_PROGRESS not in ps.env  # it draws no bar anyway
    launcher.tasks = tasks
    assert launcher._progress_endpoints() == [
        (t.name, f"http://127.0.0.1:{t.env[ENV_METRICS_PORT]}/progress") for t in trainers]
    assert [name for name, _ in launcher._progress_endpoints()] == [
        "chief-0", "worker-0", "worker-1"]


WORKER = textwrap.dedent("""
    import os, sys, time
    from flowmill.runtime.progress import ProgressBar
    from flowmill.runtime.telemetry import report_checkpoint
    from flowmill.runtime.job import task
    i = task().index
    bar = ProgressBar(10, desc="train")
    for step in range(3 + i):
        bar.update(loss=0.5 + i, examples=16)
        time.sleep(0.05)
    if i == 0:
        report_checkpoint(3, "file:///tmp/ckpt-3")
    print("reported", i, flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
""")


def _job_file(tmp_path, name: str, mode: str, command: list[str],
              success_policy: str = "ChiefWorker") -> pathlib.Path:
    """A 1 PS + 2 worker job whose workers run ``command``, written to a YAML file."""
    manifest = {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"training": {"mode": mode}, "successPolicy": success_policy,
                 "replicaSpecs": {
            "ps": {"replicas": 1},
            "worker": {"replicas": 2, "template": {"spec": {"containers": [
                {"name": "flowmill", "image": "flowmill:test", "command": command}]}}}}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _launch(path: pathlib.Path, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local",
         "--grace", "5"], cwd=ROOT, env={**os.environ}, stdout=stdout,
        stderr=subprocess.PIPE, text=True)


def _stderr_lines(proc: subprocess.Popen) -> queue.Queue:
    """The launcher's stderr, a line at a time, then None, read on a thread of its own."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _read_until(lines: queue.Queue, err: list[str], prefix: str) -> str:
    """Append lines to ``err`` until one starts with ``prefix``; that line."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line {prefix!r}:\n" + "".join(err)) from None
        assert line is not None, "".join(err)
        err.append(line)
        if line.startswith(prefix):
            return line


def test_flowmill_run_shows_one_bar_for_the_job(tmp_path):
    go = tmp_path / "go"
    proc = _launch(_job_file(tmp_path, "bar", "sync", ["python", "-c", WORKER, str(go)]))
    lines = _stderr_lines(proc)
    err: list[str] = []
    try:
        # Worker 0 is at step 3, worker 1 at 4: a sync job is at 3 of 10, with worker 0's
        # loss, both workers' examples per second, and worker 0's checkpoint.
        bar = _read_until(lines, err, "flowmill: bar  step  3/10")
        assert re.match(r"flowmill: bar  step  3/10   30%  loss 0\.5000  .*checkpoint 3$",
                        bar.rstrip("\n")), bar
        go.touch()
        out = proc.stdout.read()  # to its end: the launcher has exited
        proc.wait(timeout=TIMEOUT_S)
        while (line := lines.get(timeout=TIMEOUT_S)) is not None:
            err.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = "".join(err)
    assert proc.returncode == 0, text
    assert "job bar succeeded" in text
    # The tasks drew no bars of their own.
    assert not [line for line in text.splitlines() if line.startswith("[worker-")
                and "step" in line]
    assert "[worker-0] reported 0" in out and "[worker-1] reported 1" in out


NO_BAR_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import flowmill.runtime as fm
    from flowmill.runtime.session_manager import initialize_or_wait
    w = fm.Variable(np.ones(3, np.float32), name="w")
    train = fm.train.GradientDescent(0.1).minimize(fm.reduce_sum(w * w))
    init = fm.global_variables_initializer()
    with fm.Session() as sess:
        initialize_or_wait(sess, init)
        for _ in range(5):
            sess.run(train)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
    """
)


def test_a_script_without_a_progress_bar_still_moves_the_job_s(tmp_path):
    """No ProgressBar in the script: each run of the op minimize returned counts as a
    step of its task, so the job's bar shows 10 steps for 2 async workers of 5 each."""
    go = tmp_path / "go"
    path = _job_file(tmp_path, "nobar", "async", ["python", "-c", NO_BAR_WORKER, str(go)])
    proc = _launch(path, stdout=subprocess.DEVNULL)
    lines = _stderr_lines(proc)
    err: list[str] = []
    try:
        _read_until(lines, err, "flowmill: nobar  step 10")
        go.touch()
        assert proc.wait(timeout=TIMEOUT_S) == 0, "".join(err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


QUICK_WORKER = textwrap.dedent(
    """
    from flowmill.runtime.progress import ProgressBar
    with ProgressBar(10) as bar:
        for k in range(10):
            bar.update(k + 1, loss=0.25)
    """
)


def test_the_job_s_last_line_shows_the_steps_done_after_the_last_poll(tmp_path):
    """Workers that finish between two polls: each leaves its last snapshot at exit, and
    the launcher's last line reads it (10 of 10, not where the last poll found them). Both
    run to their end (AllWorkers): under ChiefWorker worker 0's exit would stop a worker
    that had not started stepping yet, and the line would rightly show its 0."""
    path = _job_file(tmp_path, "quick", "sync", ["python", "-c", QUICK_WORKER],
                     success_policy="AllWorkers")
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    bars = [line for line in proc.stderr.splitlines() if line.startswith("flowmill: quick  step")]
    assert bars and bars[-1].startswith("flowmill: quick  step 10/10  100%"), proc.stderr
