"""The daemon executor a task's gRPC server runs its handlers on, and why: a request that
reaches a task while its script exits is still served, and the process exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flowmill.launcher.local import free_ports
from flowmill.runtime.cluster import ENV_VAR, ClusterSpec, TaskConfig
from flowmill.runtime.daemons import DaemonExecutor

ROOT = Path(__file__).resolve().parents[1]
EXIT_TIMEOUT_S = 60


def test_jobs_run_and_their_futures_carry_results_and_errors():
    pool = DaemonExecutor(2, "t")
    try:
        assert pool.submit(pow, 2, 10).result(5) == 1024
        assert pool.submit(sorted, [3, 1], reverse=True).result(5) == [3, 1]
        failed = pool.submit(int, "x")
        with pytest.raises(ValueError, match="invalid literal"):
            failed.result(5)
        assert all(t.daemon for t in pool._threads)
    finally:
        pool.shutdown()


def test_past_its_limit_jobs_wait_in_order_for_a_thread():
    pool = DaemonExecutor(2, "t")
    gate = threading.Event()
    order: list[int] = []
    try:
        blocked = [pool.submit(gate.wait, 10) for _ in range(2)]
        queued = [pool.submit(order.append, i) for i in range(5)]
        time.sleep(0.1)
        assert order == [] and len(pool._threads) == 2
        gate.set()
        for f in blocked + queued:
            f.result(5)
        assert order == [0, 1, 2, 3, 4]
        assert len(pool._threads) == 2
    finally:
        pool.shutdown()


def test_shutdown_ends_its_threads_and_refuses_more_work():
    pool = DaemonExecutor(3, "t")
    gate = threading.Event()
    running = pool.submit(gate.wait, 10)
    waiting = [pool.submit(gate.wait, 10) for _ in range(5)]
    time.sleep(0.1)
    pool.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(RuntimeError, match="t: cannot take work after shutdown"):
        pool.submit(print)
    gate.set()
    pool.shutdown()  # a second call waits, and ends nothing twice
    assert running.result(5) is True
    assert sum(f.cancelled() for f in waiting) == 3  # two were running already
    assert not any(t.is_alive() for t in pool._threads)


def test_a_limit_under_one_is_refused():
    with pytest.raises(ValueError, match="max_workers must be at least 1, not 0"):
        DaemonExecutor(0, "t")


# A task's script that exits on an error while a request reaches its server: atexit runs
# its hooks last-registered first, so this request comes after Python began to exit and
# before the task server's own hook stops the server.
EXITING_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import grpc
    from flowmill.runtime.cluster import from_env
    from flowmill.runtime.protos import task_service_pb2 as pb
    from flowmill.runtime.protos import task_service_pb2_grpc as pb_grpc
    from flowmill.runtime.task_server import task_server

    server = task_server(from_env())

    def late_request():
        with grpc.insecure_channel(server.config.address) as channel:
            reply = pb_grpc.TaskServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        print("served", reply.task, flush=True)

    atexit.register(late_request)
    raise SystemExit(3)
    """
)


def test_a_request_reaching_a_task_while_its_script_exits_is_served_and_the_task_exits(
    tmp_path: Path,
):
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_SCRIPT)
    (port,) = free_ports(1)
    config = TaskConfig(ClusterSpec.from_dict({"worker": [f"127.0.0.1:{port}"]}), "worker", 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWMILL_")}
    done = subprocess.run(
        [sys.executable, str(script)], env={**env, ENV_VAR: config.to_json()}, cwd=ROOT,
        capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "served /job:worker/task:0\n", done.stdout + done.stderr
    assert "cannot schedule new futures" not in done.stderr, done.stderr
