"""``flowmill run JOB.yaml --local`` as a user runs it: the command in a subprocess, its
tasks in theirs. Every process a test starts carries a marker in its environment (tasks
inherit the launcher's), so a test can tell that none is left, and kills any that is."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from flowmill.launcher import plot
from flowmill.launcher.local import LocalLauncher, expand_vars, run_manifest
from flowmill.runtime.cluster import ENV_VAR, TaskConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARK = "FLOWMILL_TEST_MARK"
RUN_TIMEOUT_S = 120


def marked_pids(mark: str) -> list[int]:
    """Processes whose environment holds ``MARK=mark`` (Linux's /proc)."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.fixture
def flowmill_run(tmp_path):
    """Runs ``flowmill run <manifest> --local``; afterwards no process of it may be left
    (any that is gets killed, and the test fails)."""
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc to find the job's processes")
    mark = uuid.uuid4().hex
    launched: list[subprocess.Popen] = []

    def start(manifest: dict | str, *extra: str) -> subprocess.Popen:
        if isinstance(manifest, dict):
            path = tmp_path / f"job-{len(launched)}.yaml"
            path.write_text(yaml.safe_dump(manifest))
            manifest = str(path)
        # Each run's summaries (and loss plot) in the test's own directory.
        env = {**os.environ, MARK: mark, "FLOWMILL_SUMMARY_URI": str(tmp_path / "logs")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowmill.launcher.cli", "run", manifest, "--local", *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        launched.append(proc)
        return proc

    yield start
    for proc in launched:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while marked_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked_pids(mark)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job left running: {left}"


def job(worker_command: list[str], *, workers: int = 2, ps: int = 1, **spec) -> dict:
    replica_specs = {
        "worker": {
            "replicas": workers,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "flowmill", "image": "flowmill:test", "command": worker_command}
                    ]
                }
            },
        }
    }
    if ps:
        replica_specs["ps"] = {"replicas": ps}
    replica_specs.update(spec.pop("replica_specs", {}))
    return {
        "apiVersion": "flowmill.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
        "spec": {"replicaSpecs": replica_specs, "training": {"mode": "async"}, **spec},
    }


def script(body: str) -> list[str]:
    """A worker command: Python code with the task's index as ``i``."""
    prelude = (
        "import os, sys, time\n"
        "from flowmill.runtime.job import task\n"
        "i = task().index\n"
    )
    return ["python", "-c", prelude + body]


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# ---- the digits example, distributed


@pytest.mark.slow
def test_digits_async_on_two_ps_and_two_workers(flowmill_run):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")
    code, out, err = finish(flowmill_run(str(ROOT / "examples" / "digits.yaml")), timeout=400)
    assert code == 0, err[-4000:]
    chief = [line for line in out.splitlines() if line.startswith("[worker-0] ")]
    last = chief[-1]
    match = re.fullmatch(r"\[worker-0\] test_accuracy: (\d\.\d{4})", last)
    assert match, f"the chief's last line is {last!r}"
    assert float(match.group(1)) >= 0.95, last
    # Both workers trained on their half; the ps tasks held the variables and were stopped.
    assert "[worker-1] digits: worker 1 of 2, 718 train" in out
    assert "[worker-0] digits: worker 0 of 2, 718 train" in out
    for i in range(2):
        assert f"[ps-{i}] /job:ps/task:{i} ready on 127.0.0.1:" in out
        assert re.search(rf"\[ps-{i}\] .*/job:ps/task:{i} stopped", err)
    # Worker 0 is the chief here: its exit ends the job (spec.successPolicy ChiefWorker).
    assert "flowmill: job digits succeeded: worker 0 exited 0 (spec.successPolicy ChiefWorker)" \
        in err
    # The chief wrote the job's summaries where the launcher said; the launcher drew them.
    logdir = re.search(r"flowmill: summaries: (\S+) \(tensorboard --logdir \1\)", err).group(1)
    scalars = plot.read_scalars(logdir)
    steps = [step for step, _ in scalars["loss"]]
    assert len(steps) > 10 and steps == sorted(steps)
    assert scalars["test_accuracy"][-1][1] == pytest.approx(float(match.group(1)), abs=1e-4)
    if importlib.util.find_spec("matplotlib") is not None:
        assert f"flowmill: loss plot: {logdir}/loss.png" in err
        with open(f"{logdir}/loss.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- failures


IGNORE_SIGTERM = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"


def with_policy(manifest: dict, role: str, policy: str) -> dict:
    manifest["spec"]["replicaSpecs"].setdefault(role, {})["restartPolicy"] = policy
    return manifest


def test_a_failing_worker_under_never_stops_the_job_and_is_named(flowmill_run):
    # worker-0 would run for an hour and ignores SIGTERM: after the grace period the
    # launcher kills it, and stops the ps.
    # It sleeps far longer than the test waits: finishing at all means it was killed.
    body = IGNORE_SIGTERM + "time.sleep(3600 if i == 0 else 0.2)\nsys.exit(3 if i else 0)"
    proc = flowmill_run(with_policy(job(script(body)), "worker", "Never"), "--grace", "1")
    code, _, err = finish(proc)
    assert code == 1
    assert ("flowmill: job t failed: worker-1 exited with code 3; "
            "spec.replicaSpecs.worker.restartPolicy is Never") in err
    assert "restarting" not in err


@pytest.mark.parametrize("body,how,container_code", [
    ("sys.exit(2)", "exited with code 2", 2),
    ("import signal\nos.kill(os.getpid(), signal.SIGSEGV)", "exited with code -11 (SIGSEGV)", 139),
])
def test_a_permanent_exit_code_under_exit_code_fails_the_job(flowmill_run, body, how,
                                                            container_code):
    manifest = with_policy(job(script(body), workers=1, ps=0), "worker", "ExitCode")
    code, _, err = finish(flowmill_run(manifest))
    assert code == 1
    assert (f"job t failed: worker-0 {how}; spec.replicaSpecs.worker.restartPolicy "
            f"ExitCode treats code {container_code} as permanent") in err
    assert "restarting" not in err


def _lines_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    """The job's stdout lines up to the first that starts with ``prefix`` (all of them if
    the job ends first)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            break
    return seen


def test_a_killed_worker_is_restarted_alone_and_the_job_succeeds(flowmill_run, tmp_path):
    # worker-1 sleeps until killed; its second run tells worker 0 (the chief) to finish.
    mark = tmp_path / "worker-1"
    body = (
        "from flowmill.runtime.cluster import from_env\n"
        f"mark = {str(mark)!r}\n"
        "again = i == 1 and os.path.exists(mark + '.first')\n"
        "if i == 1:\n"
        "    open(mark + '.first', 'w').close()  # before 'up': the test kills it then\n"
        "print('up', i, os.getpid(), from_env().address, flush=True)\n"
        "if i == 1:\n"
        "    if not again:\n"
        "        time.sleep(3600)  # until killed\n"
        "    open(mark + '.again', 'w').close()\n"
        "else:\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not os.path.exists(mark + '.again') and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "print('done', i, flush=True)\n"
    )
    proc = flowmill_run(job(script(body)))
    first = _lines_until(proc, "[worker-1] up 1 ")
    assert first and first[-1].startswith("[worker-1] up 1 "), first
    _, _, pid, address = first[-1].split()[1:]
    os.kill(int(pid), signal.SIGKILL)
    code, out, err = finish(proc)
    out = "".join(first) + out
    assert code == 0, err
    assert "flowmill: worker-1 exited with code -9 (SIGKILL): restarting it (restart 1 of 3)" \
        in err
    # A new process with the same environment and port; nothing else restarted.
    ups = [line.split() for line in out.splitlines() if line.startswith("[worker-1] up 1 ")]
    assert len(ups) == 2 and ups[1][3] != pid and ups[1][4] == address
    assert out.count("[worker-0] up 0 ") == 1 and err.count("/job:ps/task:0 serving") == 1
    assert "[worker-0] done 0" in out
    assert "job t succeeded: worker 0 exited 0 (spec.successPolicy ChiefWorker)" in err


def test_a_ps_that_stops_early_restarts_the_job_until_the_budget_is_spent(flowmill_run):
    manifest = job(script("time.sleep(60)"), workers=1, runPolicy={"backoffLimit": 1})
    manifest["spec"]["replicaSpecs"]["ps"]["template"] = {
        "spec": {
            "containers": [
                {
                    "name": "flowmill",
                    "image": "flowmill:test",
                    "command": ["python", "-m", "flowmill.runtime.server"],
                }
            ]
        }
    }
    manifest["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]["command"] = (
        script(
            "from flowmill.runtime.cluster import from_env\n"
            "from flowmill.runtime.protos import task_service_pb2 as pb\n"
            "from flowmill.runtime.protos import task_service_pb2_grpc as g\n"
            "from flowmill.runtime.tls import TaskCredentials, grpc_channel\n"
            "creds = TaskCredentials.from_env()\n"
            "print('ca', hash(creds.read('ca.crt')), 'me', creds.name, flush=True)\n"
            "c = grpc_channel(from_env().cluster.address('ps', 0), creds, 'ps-0')\n"
            "g.TaskServiceStub(c).Shutdown(pb.ShutdownRequest(), timeout=10)\n"
            "time.sleep(60)"
        )
    )
    code, out, err = finish(flowmill_run(manifest))
    assert code == 1
    # Each run has a CA of its own: the first run's certificates open nothing in the second.
    cas = [line.split()[2] for line in out.splitlines() if " ca " in line]
    assert len(cas) == 2 and cas[0] != cas[1], out
    assert out.count(" me worker-0") == 2
    # Its variables are gone: the whole job restarts (once), as the operator would do it.
    assert ("flowmill: ps-0 exited with code 0 before the job finished: restarting job t from "
            "its last checkpoint (restart 1 of 1)") in err
    assert ("flowmill: job t failed: spec.runPolicy.backoffLimit 1 reached after 1 restart(s); "
            "last failure: ps-0 exited with code 0 before the job finished") in err


def test_an_invalid_manifest_names_the_field(flowmill_run, tmp_path):
    bad = job(["python", "-c", "pass"], workers=0)
    code, out, err = finish(flowmill_run(bad))
    assert code == 2 and out == ""
    assert "spec.replicaSpecs.worker.replicas: must be >= 1, got 0" in err
    bad = job(["python", "-c", "pass"])
    bad["spec"]["training"] = {"mode": "async", "backupWorkers": 1}
    err_stream = io.StringIO()
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert run_manifest(str(path), err=err_stream) == 2
    assert "spec.training.backupWorkers: applies to mode sync only" in err_stream.getvalue()
    no_command = job([])
    del no_command["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0][
        "command"
    ]
    code, _, err = finish(flowmill_run(no_command))
    assert code == 2
    assert "spec.replicaSpecs.worker.template.spec.containers[0].command: required" in err


# ---- success, restarts, interruption


def test_the_chief_decides_success_and_the_workers_still_running_are_stopped(flowmill_run):
    manifest = job(
        script(
            "from flowmill.runtime.cluster import from_env\n"
            "role = from_env().role\n"
            "print(role, i, flush=True)\n"
            "time.sleep(0.2 if role == 'chief' else 3600)"
        ),
        workers=1,
        replica_specs={},
    )
    manifest["spec"]["replicaSpecs"]["chief"] = {"replicas": 1}
    code, out, err = finish(flowmill_run(manifest))
    assert code == 0, err
    assert "[chief-0] chief 0" in out and "[worker-0] worker 1" in out
    assert ("job t succeeded: the chief exited 0 (spec.successPolicy ChiefWorker); "
            "stopped worker-0") in err


def test_without_a_chief_worker_0_decides_success_and_stops_the_others(flowmill_run):
    body = "print('up', i, flush=True)\ntime.sleep(0.2 if i == 0 else 3600)"
    code, _, err = finish(flowmill_run(job(script(body), workers=3)))
    assert code == 0, err
    assert ("flowmill: job t succeeded: worker 0 exited 0 (spec.successPolicy ChiefWorker); "
            "stopped worker-1, worker-2") in err


def test_all_workers_waits_for_every_worker(flowmill_run, tmp_path):
    # worker-1 finishes only once worker 0's process has ended (a zombie or gone): the job
    # must still be waiting for it then.
    pid0 = tmp_path / "worker-0-pid"
    body = (
        f"pid0 = {str(pid0)!r}\n"
        "if i == 0:\n"
        "    with open(pid0 + '.tmp', 'w') as f:\n"
        "        f.write(str(os.getpid()))\n"
        "    os.rename(pid0 + '.tmp', pid0)\n"
        "    sys.exit(0)\n"
        "def ended():\n"
        "    if not os.path.exists(pid0):\n"
        "        return False\n"
        "    try:\n"
        "        stat = open(f'/proc/{open(pid0).read()}/stat').read()\n"
        "    except FileNotFoundError:\n"
        "        return True\n"
        "    return stat.rpartition(')')[2].split()[0] == 'Z'\n"
        "deadline = time.monotonic() + 120\n"
        "while not ended() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('done', i, flush=True)"
    )
    code, out, err = finish(flowmill_run(job(script(body), successPolicy="AllWorkers")))
    assert code == 0, err
    assert "[worker-1] done 1" in out
    assert ("flowmill: job t succeeded: all 2 workers exited 0 (spec.successPolicy AllWorkers)\n"
            in err)


def test_task_and_job_restarts_share_one_budget(flowmill_run, tmp_path):
    # worker-1 exits 75 (the job restarts: restart 1), then 1 (it restarts alone: restart 2),
    # then 1 again: backoffLimit 2 is spent, although the job restarted in between.
    runs = tmp_path / "runs"
    body = (
        f"runs = {str(runs)!r}\n"
        "if i == 0:\n"
        "    time.sleep(3600)\n"
        "with open(runs, 'a') as f:\n"
        "    f.write('x')\n"
        "sys.exit(75 if os.path.getsize(runs) == 1 else 1)"
    )
    manifest = job(script(body), runPolicy={"backoffLimit": 2})
    code, _, err = finish(flowmill_run(manifest))
    assert code == 1
    assert ("flowmill: worker-1 exited with code 75: restarting job t from its last checkpoint "
            "(restart 1 of 2)") in err
    assert "flowmill: worker-1 exited with code 1: restarting it (restart 2 of 2)" in err
    assert ("flowmill: job t failed: spec.runPolicy.backoffLimit 2 reached after 2 restart(s); "
            "last failure: worker-1 exited with code 1") in err
    assert runs.read_text() == "xxx"


@pytest.mark.slow
def test_exit_code_75_restarts_the_whole_job(flowmill_run, tmp_path):
    flag = tmp_path / "restarted"
    body = (
        f"flag = {str(flag)!r}\n"
        "if i == 1 and not os.path.exists(flag):\n"
        "    open(flag, 'w').close()\n"
        "    sys.exit(75)\n"
        "print('done', i)"
    )
    manifest = job(script(body), runPolicy={"backoffLimit": 1}, successPolicy="AllWorkers")
    code, out, err = finish(flowmill_run(manifest))
    assert code == 0, err
    assert "worker-1 exited with code 75: restarting job t from its last checkpoint" in err
    assert "[worker-1] done 1" in out
    # A second 75 is over the budget.
    flag.unlink()
    manifest = job(script(body.replace("not os.path.exists(flag)", "True")),
                   runPolicy={"backoffLimit": 1}, successPolicy="AllWorkers")
    code, _, err = finish(flowmill_run(manifest))
    assert code == 1
    assert ("job t failed: spec.runPolicy.backoffLimit 1 reached after 1 restart(s); last "
            "failure: worker-1 exited with code 75") in err


def _wait_until_up(proc: subprocess.Popen, workers: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    up = 0
    for line in proc.stdout:  # the workers start once every ps serves
        up += "] up" in line
        if up == workers or time.monotonic() > deadline:
            return


def test_ctrl_c_stops_every_task(flowmill_run):
    proc = flowmill_run(job(script("print('up', flush=True)\ntime.sleep(60)")))
    _wait_until_up(proc, 2)
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)
    assert code == 130
    assert "job t stopped (SIGINT)" in err


def test_a_second_ctrl_c_skips_the_grace_period(flowmill_run):
    # Workers that ignore SIGTERM and a grace period longer than the test waits: only the
    # second Ctrl-C's immediate kill lets the launcher finish within ``finish``'s bound.
    body = IGNORE_SIGTERM + "print('up', flush=True)\ntime.sleep(3600)"
    proc = flowmill_run(job(script(body)), "--grace", "3600")
    _wait_until_up(proc, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # the workers ignore the SIGTERM they were sent
    proc.send_signal(signal.SIGINT)
    code, _, _ = finish(proc)
    assert code == 130


# ---- what a task is given


def test_a_local_run_needs_no_image(flowmill_run):
    """The operator requires each container's image; a local run starts commands."""
    manifest = job(script("print('ran', i)"), workers=1, ps=0)
    container = manifest["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]
    del container["image"]
    code, out, err = finish(flowmill_run(manifest))
    assert code == 0, err
    assert "[worker-0] ran 0" in out


def test_a_relative_command_is_found_from_the_manifests_directory(flowmill_run, tmp_path):
    """Run from elsewhere (the repository), a manifest whose command names a script
    relative to its project (as the image's working directory gives it) finds it."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    (project / "jobs").mkdir()
    (project / "scripts" / "train.py").write_text("import os\nprint('cwd', os.getcwd())\n")
    manifest = job(["python", "scripts/train.py"], workers=1, ps=0)
    path = project / "jobs" / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code, out, err = finish(flowmill_run(str(path)))
    assert code == 0, err
    assert f"[worker-0] cwd {project}" in out
    assert f"flowmill: tasks run in {project} (where the manifest's command is)" in err


@pytest.mark.parametrize("command,script", [
    (["python", "examples/digits/train.py", "--epochs", "3"], "examples/digits/train.py"),
    (["python3.11", "-u", "train/run.py"], "train/run.py"),
    (["python", "-m", "pkg.train"], None),
    (["python", "-c", "print(1)"], None),
    (["/usr/bin/python", "/abs/train.py"], None),
    (["bin/train"], "bin/train"),
    (["train"], None),
])
def test_the_script_a_command_runs(command, script):
    from flowmill.launcher.local import script_path

    assert script_path(command) == script


def test_a_task_gets_its_runs_credentials_or_none_whatever_the_shell_had(tmp_path):
    from flowmill.operator.api import TrainingJob

    shell = {"FLOWMILL_TLS_DIR": "/somewhere/else"}
    manifest = job(["python3", "train.py"])
    plain = job(["python3", "train.py"], security={"tls": False})
    tasks = LocalLauncher(TrainingJob.from_dict(plain), environ=shell).plan([5001, 5002, 5003])
    assert all("FLOWMILL_TLS_DIR" not in t.env for t in tasks)
    launcher = LocalLauncher(TrainingJob.from_dict(manifest), environ=shell)
    launcher._tls_dir = str(tmp_path)
    launcher._issue_credentials()
    tasks = launcher.plan([5001, 5002, 5003])
    dirs = [t.env["FLOWMILL_TLS_DIR"] for t in tasks]
    assert [os.path.basename(d) for d in dirs] == ["ps-0", "worker-0", "worker-1"]
    assert all(d.startswith(str(tmp_path)) for d in dirs)


def test_each_task_gets_its_cluster_config_training_and_checkpoint_env():
    from flowmill.operator.api import TrainingJob

    manifest = job(["python3", "train.py", "--out", "$(OUT_DIR)/run", "$$(KEEP)"], ps=2)
    container = manifest["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "OUT_DIR", "value": "/tmp/out"}]
    manifest["spec"]["checkpoint"] = {"uri": "file:///tmp/ckpt", "intervalSteps": 7}
    launcher = LocalLauncher(TrainingJob.from_dict(manifest), python="/py", environ={"A": "1"})
    tasks = launcher.plan([5001, 5002, 5003, 5004])
    assert [t.name for t in tasks] == ["ps-0", "ps-1", "worker-0", "worker-1"]
    worker = tasks[3]
    config = TaskConfig.from_json(worker.env[ENV_VAR])
    assert (config.role, config.index, config.address) == ("worker", 1, "127.0.0.1:5004")
    assert config.cluster.as_dict() == {
        "ps": ["127.0.0.1:5001", "127.0.0.1:5002"],
        "worker": ["127.0.0.1:5003", "127.0.0.1:5004"],
    }
    assert worker.argv == ["/py", "train.py", "--out", "/tmp/out/run", "$(KEEP)"]
    assert json.loads(worker.env["FLOWMILL_TRAINING"])["mode"] == "async"
    assert worker.env["FLOWMILL_CHECKPOINT_URI"] == "file:///tmp/ckpt"
    assert worker.env["FLOWMILL_CHECKPOINT_INTERVAL"] == "7"
    assert worker.env["FLOWMILL_CHECKPOINT_KEEP"] == "5"
    assert worker.env["A"] == "1" and worker.env["OUT_DIR"] == "/tmp/out"
    # ps tasks run the server (the worker template's command is not theirs).
    assert tasks[0].argv[:3] == ["/py", "-m", "flowmill.runtime.server"]
    assert "127.0.0.1" in tasks[0].argv  # the pod IP is loopback here
    assert expand_vars("$(A)-$(NOPE)-$$", {"A": "x"}) == "x-$(NOPE)-$"


# ---- sync mode: the same parameters as one process on the whole batch


def sync_model():
    """The model both the job's workers and the one-process reference build."""
    import numpy as np

    import flowmill.runtime as fm

    x = fm.placeholder(fm.float32, (None, 4), name="x")
    y = fm.placeholder(fm.int64, (None,), name="y")
    w1 = fm.Variable(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), name="w1")
    b1 = fm.Variable(np.zeros(8, np.float32), name="b1")
    w2 = fm.Variable(np.linspace(1, -1, 24, dtype=np.float32).reshape(8, 3), name="w2")
    logits = fm.matmul(fm.nn.relu(fm.matmul(x, w1) + b1), w2)
    loss = fm.reduce_mean(fm.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(5)]
    return x, y, [w1, b1, w2], loss, data


SYNC_STEPS = 50
SYNC_SCRIPT = f"""
import sys

import numpy as np

import flowmill.runtime as fm
from flowmill.runtime.job import task
from flowmill.runtime.session_manager import initialize_or_wait

{__import__("inspect").getsource(sync_model)}

me = task()
g = fm.Graph(seed=1)
with g.as_default():
    x, y, variables, loss, data = sync_model()
    step = fm.train.create_global_step()
    train = fm.train.Momentum(0.1, 0.9).minimize(loss, global_step=step)
    init = fm.global_variables_initializer()
with fm.Session(g) as sess:
    initialize_or_wait(sess, init)
    for i in range({SYNC_STEPS}):
        bx, by = data[i % len(data)]
        sess.run(train, {{x: bx[me.index :: me.count], y: by[me.index :: me.count]}})
    if me.is_chief:
        np.savez(sys.argv[1], *sess.run([v.value() for v in variables]),
                 step=sess.run(step.value()))
print("done", me.index)
"""


def test_sync_mode_two_workers_end_where_one_process_on_the_whole_batch_does(
    flowmill_run, tmp_path
):
    import numpy as np

    import flowmill.runtime as fm

    (tmp_path / "sync_train.py").write_text(SYNC_SCRIPT)
    out = tmp_path / "params.npz"
    manifest = job(["python", str(tmp_path / "sync_train.py"), str(out)], ps=2)
    manifest["spec"]["training"] = {"mode": "sync"}
    code, stdout, err = finish(flowmill_run(manifest))
    assert code == 0, err[-4000:]
    assert "[worker-0] done 0" in stdout and "[worker-1] done 1" in stdout

    g = fm.Graph(seed=1)
    with g.as_default():
        x, y, variables, loss, data = sync_model()
        train = fm.train.Momentum(0.1, 0.9).minimize(loss)
        init = fm.global_variables_initializer()
    with fm.Session(g) as sess:
        sess.run(init)
        for i in range(SYNC_STEPS):
            bx, by = data[i % len(data)]
            sess.run(train, {x: bx, y: by})
        expected = sess.run([v.value() for v in variables])
    got = np.load(out)
    assert int(got["step"]) == SYNC_STEPS  # one update per step of both workers
    for i, want in enumerate(expected):
        np.testing.assert_allclose(got[f"arr_{i}"], want, rtol=0, atol=1e-5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_no_task_outlives_a_killed_launcher(flowmill_run):
    proc = flowmill_run(job(script(IGNORE_SIGTERM + "print('up', flush=True)\ntime.sleep(60)")))
    _wait_until_up(proc, 2)
    proc.kill()  # no chance to stop anything: the fixture finds whatever is left
    proc.wait(timeout=30)


def test_a_task_whose_port_was_taken_restarts_the_job_uncounted(tmp_path):
    """Between the launcher picking a port and the task binding it, another process can
    take it: the task exits PORT_TAKEN_EXIT_CODE and the job starts again on new ports,
    without spending backoffLimit."""
    import socket

    from flowmill.operator.api import TrainingJob
    from flowmill.runtime.cluster import PORT_TAKEN_EXIT_CODE, ClusterSpec

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        spec = ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{port}"]})
        env = {**os.environ, ENV_VAR: TaskConfig(spec, "worker", 0).to_json()}
        code = "import flowmill.runtime as fm\nfm.Session()\n"
        task = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S, cwd="/")
    finally:
        holder.close()
    assert task.returncode == PORT_TAKEN_EXIT_CODE, task.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in task.stderr
    assert "Traceback" not in task.stderr, task.stderr

    launcher = LocalLauncher(TrainingJob.from_dict(job(["python", "train.py"], ps=1)),
                             environ={}, cores=2)
    launcher.tasks = launcher.plan([5001, 5002, 5003])
    outcome = launcher._on_exit(launcher.tasks[1], PORT_TAKEN_EXIT_CODE)
    assert outcome.restart and not outcome.counted
    assert "worker-0 found its port taken" in outcome.message
