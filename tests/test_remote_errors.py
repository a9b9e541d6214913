"""A step failing on another task reaches the script as one short error: a ``TaskError``
naming the task and the op and carrying the task's message, after the traceback of the
script's own call. What it was chained to (the local step's abort, gRPC's nested errors)
is printed only with ``FLOWMILL_DEBUG`` set. Across real processes: a PS task
(``python -m flowmill.runtime.server``) and a training task running a script, on
loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from flowmill.launcher.local import free_ports
from flowmill.runtime import task_exit
from flowmill.runtime.cluster import (
    ENV_POD_IP,
    ENV_VAR,
    RESTART_JOB_EXIT_CODE,
    ClusterSpec,
    TaskConfig,
)
from flowmill.runtime.protos import task_service_pb2 as pb
from flowmill.runtime.protos import task_service_pb2_grpc as pb_grpc
from flowmill.runtime.task_errors import TaskError

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60
RUN_TIMEOUT_S = 120
MAX_LINES = 15

# A script as a user writes it: an embedding table on the PS, looked up with an index out
# of its range. The first failure is caught (what a script can read off the error), the
# second one is not.
SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import flowmill.runtime as fm
    from flowmill.runtime.task_errors import TaskError

    g = fm.Graph()
    with g.as_default():
        ids = fm.placeholder(fm.int64, (None,), name="ids")
        with fm.device("/job:ps/task:0"):
            table = fm.Variable(np.arange(12, dtype=np.float32).reshape(4, 3), name="emb/table")
            rows = fm.gather(table.value(), ids, name="emb/lookup")
        init = fm.global_variables_initializer()


    def look_up(sess, which):
        return sess.run(rows, {ids: which})


    with fm.Session(g) as sess:
        sess.run(init)
        print("looked up", look_up(sess, [1]).tolist(), flush=True)
        try:
            look_up(sess, [1, 9])
        except TaskError as e:
            print(f"caught task={e.task} op={e.op} code={e.code.name}", flush=True)
        look_up(sess, [2, 7])
    """
)

GRPC_INTERNALS = (
    "debug_error_string",
    "_InactiveRpcError",
    "During handling of the above exception",
    "The above exception was the direct cause",
)


def _env(**extra: str) -> dict[str, str]:
    """This environment without anything of a task's (a debug flag, a pod's address)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLOWMILL_") and k != ENV_POD_IP}
    return {**env, **extra}


def _wait_ready(ps: subprocess.Popen, address: str, log: Path) -> None:
    channel = grpc.insecure_channel(address)
    try:
        stub = pb_grpc.TaskServiceStub(channel)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if ps.poll() is not None:
                raise AssertionError(f"the PS exited at start:\n{log.read_text()}")
            try:
                stub.GetStatus(pb.GetStatusRequest(), timeout=1.0)
                return
            except grpc.RpcError:
                time.sleep(0.05)
        raise AssertionError(f"the PS not ready in {READY_TIMEOUT_S}s:\n{log.read_text()}")
    finally:
        channel.close()


def run_failing_script(tmp_path: Path, **extra: str) -> tuple[int, str, str]:
    """Run ``SCRIPT`` as worker 0 of a cluster with one PS task: (its exit code, its
    stdout, its stderr)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ps_port, worker_port = free_ports(2)
    spec = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ps_port}"],
                                  "worker": [f"127.0.0.1:{worker_port}"]})
    ps_log = tmp_path / "ps.log"
    with open(ps_log, "w") as log:
        ps = subprocess.Popen(
            [sys.executable, "-m", "flowmill.runtime.server"],
            env=_env(**{ENV_VAR: TaskConfig(spec, "ps", 0).to_json()}),
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
    worker = None
    try:
        _wait_ready(ps, spec.address("ps", 0), ps_log)
        worker = subprocess.Popen(
            [sys.executable, str(script)],
            env=_env(**{ENV_VAR: TaskConfig(spec, "worker", 0).to_json()}, **extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        out, err = worker.communicate(timeout=RUN_TIMEOUT_S)
        return worker.returncode, out, err
    finally:
        for proc in (worker, ps):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(timeout=30)


def test_a_step_failing_on_a_ps_ends_the_script_with_one_short_error(tmp_path: Path):
    code, out, err = run_failing_script(tmp_path)
    assert code == 1, err
    assert "caught task=/job:ps/task:0 op=emb/lookup code=INVALID_ARGUMENT" in out, out + err
    # The chief's line on what each PS task holds, said at its first step, is no part of it.
    lines = [x for x in err.splitlines() if not x.startswith("flowmill: variables on ")]
    assert len(lines) <= MAX_LINES, err
    # The script's own call, as Python shows it, then the error in one line.
    assert lines[0] == "Traceback (most recent call last):", err
    assert "in look_up" in err and "sess.run(rows, {ids: which})" in err, err
    last = lines[-1]
    assert last.startswith("flowmill.runtime.task_errors.TaskError: "), err
    assert "failed on /job:ps/task:0 " in last, err
    assert "op 'emb/lookup' (Gather)" in last, err
    assert "index 7 is out of bounds" in last, err  # the remote message
    for internal in GRPC_INTERNALS:
        assert internal not in err, err
    assert err.count("Traceback") == 1, err


def test_with_flowmill_debug_the_chained_errors_are_printed_too(tmp_path: Path):
    code, out, err = run_failing_script(tmp_path, FLOWMILL_DEBUG="1")
    assert code == 1, err
    assert "The above exception was the direct cause" in err, err
    assert err.count("Traceback") >= 2, err
    last = err.splitlines()[-1]
    assert last.startswith("flowmill.runtime.task_errors.TaskError: "), err
    assert "op 'emb/lookup' (Gather)" in last, err


# ---- without processes: the op a TaskError names, and what the hook prints


@pytest.mark.parametrize(
    ("details", "op"),
    [
        ("/job:ps/task:0: step 5: op 'emb/lookup' (Gather): IndexError: Gather "
         "'emb/lookup': index 9 is out of bounds", "emb/lookup"),
        ("/job:ps/task:1: step 5: op 'late/v' (ReadVariableOp): FailedPreconditionError: "
         "uninitialized", "late/v"),
        ("""/job:ps/task:0: step 5: op "it's" (Identity): ValueError: x""", "it's"),
        ("RegisterGraph: op 'a' (MatMul) with inputs [b, c]: no kernel", "a"),
        ("/job:ps/task:0: RunGraph: no graph is registered under 'h'", None),
        ("Gather 'emb/lookup': index 9 is out of bounds", None),  # no "op '...' (TYPE)"
        ("", None),
        (None, None),
    ],
)
def test_the_op_is_read_off_the_remote_message(details, op):
    assert TaskError.op_named_in(details) == op
    error = TaskError(f"step 5 failed on /job:ps/task:0 (127.0.0.1:1): INVALID_ARGUMENT: "
                      f"{details}", "/job:ps/task:0", grpc.StatusCode.INVALID_ARGUMENT)
    assert error.op == op
    assert (error.task, error.code) == ("/job:ps/task:0", grpc.StatusCode.INVALID_ARGUMENT)


def test_an_op_given_is_kept():
    assert TaskError("x: op 'a' (Add): bad", "/job:ps/task:0", op="b").op == "b"
    assert TaskError("nothing named", "/job:ps/task:0").op is None


def _raised(make):
    try:
        make()
    except BaseException as e:  # noqa: BLE001 - what a hook gets
        return type(e), e, e.__traceback__
    raise AssertionError("nothing raised")


def _remote_failure():
    try:
        raise RuntimeError("debug_error_string = '{grpc internals}'")
    except RuntimeError as local:
        raise TaskError(
            "step 5 failed on /job:ps/task:0 (127.0.0.1:1): INVALID_ARGUMENT: "
            "op 'emb/lookup' (Gather): IndexError: out of bounds",
            "/job:ps/task:0",
            grpc.StatusCode.INVALID_ARGUMENT,
        ) from local


def _wrapped_by_the_script():
    try:
        _remote_failure()
    except TaskError as e:
        raise ValueError("the script's own error") from e


def _printed(hook, error, capsys) -> str:
    hook(*error)
    return capsys.readouterr().err


def test_the_hook_prints_a_task_error_without_its_causes_and_puts_them_back(
    capsys, monkeypatch
):
    monkeypatch.delenv(task_exit.DEBUG_ENV, raising=False)
    hook = task_exit._exit_hook(None, lambda: None)
    kind, value, tb = error = _raised(_remote_failure)
    cause = value.__cause__
    err = _printed(hook, error, capsys)
    assert err.count("Traceback") == 1 and "_remote_failure" in err, err
    assert err.splitlines()[-1].startswith("flowmill.runtime.task_errors.TaskError: step 5"), err
    assert "debug_error_string" not in err and "direct cause" not in err, err
    assert value.__cause__ is cause and value.__suppress_context__  # as it was

    # A script's own error raised from one: its traceback and the TaskError's, no further.
    err = _printed(hook, _raised(_wrapped_by_the_script), capsys)
    assert err.count("The above exception was the direct cause") == 1, err
    assert "ValueError: the script's own error" in err and "TaskError: step 5" in err, err
    assert "debug_error_string" not in err, err

    # Other errors are printed as ever, chain and all.
    def plain():
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("outer")  # noqa: B904 - the implicit chain is the point

    err = _printed(hook, _raised(plain), capsys)
    assert "During handling of the above exception" in err and "KeyError" in err, err


def test_with_flowmill_debug_the_hook_prints_everything(capsys, monkeypatch):
    monkeypatch.setenv(task_exit.DEBUG_ENV, "1")
    hook = task_exit._exit_hook(None, lambda: None)
    err = _printed(hook, _raised(_remote_failure), capsys)
    assert "debug_error_string" in err and "The above exception was the direct cause" in err


def test_a_lost_ps_still_ends_the_task_in_two_lines(capsys, monkeypatch):
    monkeypatch.delenv(task_exit.DEBUG_ENV, raising=False)
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(task_exit.os, "_exit", fake_exit)
    hook = task_exit._exit_hook(None, lambda: None)

    def lost():
        raise TaskError("step 5 failed on /job:ps/task:0 (127.0.0.1:1): UNAVAILABLE: gone",
                        "/job:ps/task:0", grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(SystemExit):
        hook(*_raised(lost))
    err = capsys.readouterr().err
    assert exits == [RESTART_JOB_EXIT_CODE]
    assert len(err.splitlines()) == 2 and "lost /job:ps/task:0" in err, err


def test_a_failed_chief_loop_prints_its_task_error_short(capsys, monkeypatch):
    """The sync chief loop's end (``session_manager``) prints as a task's end does."""
    monkeypatch.delenv(task_exit.DEBUG_ENV, raising=False)
    cause = RuntimeError("debug_error_string = grpc internals")
    error = TaskError("step 9 failed on /job:ps/task:1 (h:1): INTERNAL: op 'w/take' (Take)",
                      "/job:ps/task:1", grpc.StatusCode.INTERNAL)
    error.__cause__ = cause
    task_exit.print_short(error)
    err = capsys.readouterr().err
    assert "op 'w/take' (Take)" in err and "debug_error_string" not in err
    assert error.__cause__ is cause  # put back after printing
    monkeypatch.setenv(task_exit.DEBUG_ENV, "1")
    task_exit.print_short(error)
    assert "debug_error_string" in capsys.readouterr().err
