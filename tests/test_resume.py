"""Faults across processes, as a job meets them: every task killed mid-run and the job run
again resumes from its checkpoint and ends with the parameters of an uninterrupted run
(sync mode, data a function of the step); a worker killed in sync mode with a backup
worker does not stop training; a training task that loses its PS exits 75 and says so in
two lines; a chief sent SIGTERM checkpoints the step it reached and the job resumes there,
uncounted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from flowmill.kernels import checkpoint_store as checkpoint
from flowmill.kernels.checkpoint_store import open_store
from flowmill.launcher.local import free_ports
from flowmill.runtime.cluster import ENV_VAR, RESTART_JOB_EXIT_CODE, ClusterSpec, TaskConfig

from threads import wait_until

ROOT = Path(__file__).resolve().parents[1]
STEPS = 150
RUN_TIMEOUT_S = 240

# A model script as a user writes it: nothing about tasks or checkpoints but what the
# job gives it. Each step's batch is a function of the step and the task's shard.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import flowmill.runtime as fm
    from flowmill.runtime.job import max_steps, steps_done, task, training_done
    from flowmill.runtime.session_manager import initialize_or_wait

    me = task()
    if os.environ.get("PID_DIR"):
        with open(os.path.join(os.environ["PID_DIR"], f"task-{me.index}.pid"), "w") as f:
            f.write(str(os.getpid()))
    g = fm.Graph(seed=3)
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, 8), name="x")
        y = fm.placeholder(fm.float32, (None, 1), name="y")
        w1 = fm.Variable(np.linspace(-0.5, 0.5, 64, dtype=np.float32).reshape(8, 8), name="w1")
        w2 = fm.Variable(np.linspace(0.5, -0.5, 8, dtype=np.float32).reshape(8, 1), name="w2")
        loss = fm.reduce_mean(fm.square(fm.matmul(fm.nn.relu(fm.matmul(x, w1)), w2) - y))
        step = fm.train.create_global_step()
        train = fm.train.Adam(0.01).minimize(loss, global_step=step)
        init = fm.global_variables_initializer()
    total = max_steps(100)
    with fm.Session(g) as sess:
        start = initialize_or_wait(sess, init)
        print(f"starting at global step {start}", flush=True)
        k = steps_done(start)
        while True:
            rng = np.random.default_rng((me.index, k))
            bx = rng.normal(size=(16, 8)).astype(np.float32)
            _, seen = sess.run([train, step.value()], {x: bx, y: bx.sum(axis=1, keepdims=True)})
            k += 1
            if k == steps_done(start) + 1:
                print("first step done", flush=True)
            if os.environ.get("SAY_STEPS"):
                print(f"at global step {int(seen)}", flush=True)
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
            if training_done(sess, step, seen, total):
                break
        print(f"done at global step {int(sess.run(step.value()))}", flush=True)
    """
)


def job(script: Path, uri: str, workers: int = 2, backup: int = 0, sleep: float = 0.0,
        mode: str = "sync") -> dict:
    env = [{"name": "STEP_SLEEP", "value": str(sleep)}]
    return {
        "apiVersion": "flowmill.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "resume"},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 2},
                "worker": {
                    "replicas": workers,
                    "template": {"spec": {"containers": [
                        {"name": "flowmill", "image": "flowmill:test", "env": env,
                         "command": ["python", str(script)]}
                    ]}},
                },
            },
            "training": {"mode": mode, "maxSteps": STEPS}
            | ({"backupWorkers": backup} if backup else {}),
            "checkpoint": {"uri": uri, "intervalSteps": 20, "keep": 3},
        },
    }


def launch(tmp_path: Path, manifest: dict, name: str, **env) -> subprocess.Popen:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, tmp_path: Path, name: str) -> str:
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return (tmp_path / f"{name}.log").read_text()


def final_params(uri: str) -> tuple[int, dict[str, np.ndarray]]:
    store, prefix = open_store(uri)
    manifest = checkpoint.latest(store, prefix)
    assert manifest is not None, f"no checkpoint under {uri}"
    values = {}
    for shard in manifest.shards:
        values.update(checkpoint.read_shard(store, manifest, shard.name))
    return manifest.step, values




@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow
def test_killed_job_resumes_to_the_uninterrupted_parameters(tmp_path: Path, script: Path):
    straight_uri = (tmp_path / "straight").as_uri()
    proc = launch(tmp_path, job(script, straight_uri), "straight")
    out = finish(proc, tmp_path, "straight")
    assert proc.returncode == 0, out
    step, straight = final_params(straight_uri)
    assert step == STEPS, out

    uri = (tmp_path / "resumed").as_uri()
    store, prefix = open_store(uri)
    proc = launch(tmp_path, job(script, uri, sleep=0.03), "killed")
    try:
        wait_until(lambda: (m := checkpoint.latest(store, prefix)) and m.step >= 40,
                   "a checkpoint at step 40", RUN_TIMEOUT_S, 0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every task: nothing saves
        proc.wait()
    killed_at = checkpoint.latest(store, prefix).step
    assert killed_at < STEPS, (tmp_path / "killed.log").read_text()

    proc = launch(tmp_path, job(script, uri), "resumed")
    out = finish(proc, tmp_path, "resumed")
    assert proc.returncode == 0, out
    restored = int(out.split("restored checkpoint step ")[1].split()[0])
    assert killed_at <= restored < STEPS, out
    assert f"starting at global step {restored}" in out, out
    step, resumed = final_params(uri)
    assert step == STEPS
    assert resumed.keys() == straight.keys()
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, backup",
    [("sync", 1), ("sync", 0), ("async", 0)],
    ids=["sync-with-a-backup-worker", "sync", "async"],
)
def test_training_goes_on_when_a_worker_is_killed(tmp_path: Path, script: Path, mode: str,
                                                  backup: int):
    """With a backup worker sync training goes on without the killed one; without one it
    waits for its replacement; async training never waits. Every way the job finishes."""
    uri = (tmp_path / "ckpt").as_uri()
    pids = tmp_path / "pids"
    pids.mkdir()
    manifest = job(script, uri, workers=2, backup=backup, sleep=0.03, mode=mode)
    proc = launch(tmp_path, manifest, "backup", PID_DIR=str(pids))
    store, prefix = open_store(uri)
    try:
        wait_until(lambda: (m := checkpoint.latest(store, prefix)) and m.step >= 20,
                   "a checkpoint at step 20", RUN_TIMEOUT_S, 0.1)
        victim = int((pids / "task-1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    out = finish(proc, tmp_path, "backup")
    assert proc.returncode == 0, out
    assert "worker-1" in out and "SIGKILL" in out, out
    step, _ = final_params(uri)
    assert step >= STEPS, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, backup",
    [("sync", 0), ("sync", 1), ("async", 0), ("bounded-staleness", 0)],
    ids=["sync", "sync-with-a-backup-worker", "async", "bounded-staleness"],
)
def test_a_killed_chief_is_restarted_and_rejoins_the_running_job(
    tmp_path: Path, script: Path, mode: str, backup: int
):
    """SIGKILL of the chief mid-run: it comes back alone, finds the variables on the PS
    tasks and rejoins at the job's global step (never restoring or initializing them
    again), and the job finishes. In sync mode without backup workers it ends with exactly
    the parameters of an uninterrupted run: the gradients the other workers sent stay, and
    the chief's own worker sends its step again (a duplicate where it had, dropped).

    The chief's update runs wholly on the PS tasks, so a kill rarely leaves it half done:
    only when the dead chief's update is still running as the restarted chief registers
    (its registration ends the earlier life's steps wherever they stand; a clean-clone run
    hit it once in several). Then it cannot be exact: the chief says so and that step's
    gradients are computed again. The job must finish then too; exactness is checked on a
    run whose kill missed that window (the kill is tried again, up to five times)."""
    for attempt in range(5):
        run = tmp_path / f"attempt{attempt}"
        run.mkdir()
        out, params = _kill_the_chief_and_finish(run, script, mode, backup)
        if params is None:  # started over on new ports first: not the case under test
            continue
        if mode != "sync" or backup or "was half done when the chief stopped" not in out:
            break
    assert params is not None, out
    if mode == "sync" and not backup:
        assert "was half done when the chief stopped" not in out, out
        manifest = job(script, (run / "straight").as_uri(), workers=2, sleep=0.03, mode=mode)
        manifest["spec"]["checkpoint"]["intervalSteps"] = 1000
        proc = launch(run, manifest, "straight")
        out = finish(proc, run, "straight")
        assert proc.returncode == 0, out
        step, straight = final_params((run / "straight").as_uri())
        assert step == STEPS and params.keys() == straight.keys()
        for name in straight:
            np.testing.assert_array_equal(params[name], straight[name], err_msg=name)


def _kill_the_chief_and_finish(tmp_path: Path, script: Path, mode: str, backup: int):
    """One run of a job whose chief is SIGKILLed at step 40: its output and final params
    (None when the launcher had to start the job over because another process took a port
    it picked: that run restores its first checkpoint, as it should)."""
    uri = (tmp_path / "ckpt").as_uri()
    pids = tmp_path / "pids"
    pids.mkdir()
    manifest = job(script, uri, workers=3 if backup else 2, backup=backup, sleep=0.03,
                   mode=mode)
    if mode == "bounded-staleness":
        manifest["spec"]["training"]["staleness"] = 2
    manifest["spec"]["checkpoint"]["intervalSteps"] = 1000
    proc = launch(tmp_path, manifest, "chief", PID_DIR=str(pids), SAY_STEPS="1")
    before = signal_when_the_job_reaches(proc, tmp_path / "chief.log", pids / "task-0.pid",
                                         signal.SIGKILL)
    out = finish(proc, tmp_path, "chief")
    assert proc.returncode == 0, out
    if "found its port taken by another process" in out:
        return out, None
    assert "worker-0 exited with code -9 (SIGKILL): restarting it" in out, out
    rejoined = int(out.split("rejoins the job at global step ")[1].split()[0])
    assert rejoined >= before - 1, out  # never back to a checkpoint or to 0
    assert "restored checkpoint" not in out, out
    step, params = final_params(uri)
    assert step >= STEPS, out
    return out, params


@pytest.mark.slow
def test_a_chief_sent_sigterm_commits_its_step_and_the_job_resumes_there_uncounted(
    tmp_path: Path, script: Path
):
    """SIGTERM (eviction, preemption, drain) of the chief between two checkpoint intervals:
    it abandons its step, commits a checkpoint of the step it reached and exits 143; the
    launcher restarts the job from there without spending backoffLimit (0 here)."""
    uri = (tmp_path / "ckpt").as_uri()
    pids = tmp_path / "pids"
    pids.mkdir()
    manifest = job(script, uri, sleep=0.03)
    manifest["spec"]["checkpoint"]["intervalSteps"] = 1000  # no save but the one asked for
    manifest["spec"]["runPolicy"] = {"backoffLimit": 0}
    proc = launch(tmp_path, manifest, "preempted", PID_DIR=str(pids), SAY_STEPS="1")
    signal_when_the_job_reaches(proc, tmp_path / "preempted.log", pids / "task-0.pid",
                                signal.SIGTERM, worker="0")
    out = finish(proc, tmp_path, "preempted")
    assert proc.returncode == 0, out
    assert "exiting with code 143" in out and "not counted against backoffLimit" in out, out
    saved = int(out.split("checkpoint step ")[1].split()[0])
    assert 40 <= saved < STEPS, out
    assert f"restored checkpoint step {saved} " in out, out
    assert f"starting at global step {saved}" in out, out
    step, _ = final_params(uri)
    assert step == STEPS, out


def signal_when_the_job_reaches(proc, log: Path, pid: Path, sig: int, step: int = 40,
                                worker: str = r"\d") -> int:
    """Wait until a worker (the script's ``at global step`` lines; ``worker`` a pattern of
    its index) reports ``step``, then send ``sig`` to the process in ``pid``; returns the
    step last seen. Kills the launcher's whole session if that fails."""
    seen = re.compile(rf"\[worker-{worker}\] at global step (\d+)\n")

    def reached() -> int:
        return max(map(int, seen.findall(log.read_text())), default=0)

    def there() -> bool:
        if reached() >= step:
            return True
        if proc.poll() is not None:  # the job ended first: waiting on would only time out
            raise AssertionError(f"the job ended (code {proc.returncode}) before step {step}:"
                                 f"\n{log.read_text()[-4000:]}")
        return False

    try:
        wait_until(there, f"the job at step {step}", RUN_TIMEOUT_S, 0.05)
        before = reached()
        os.kill(int(pid.read_text()), sig)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return before


def test_a_training_task_that_loses_its_ps_exits_75(tmp_path: Path, script: Path):
    ps_port, worker_port = free_ports(2)
    spec = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ps_port}"],
                                  "worker": [f"127.0.0.1:{worker_port}"]})
    procs = []

    def start(role: str, argv: list[str], **extra) -> subprocess.Popen:
        env = {**os.environ, ENV_VAR: TaskConfig(spec, role, 0).to_json(), **extra}
        log = open(tmp_path / f"{role}.log", "w")
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=ROOT))
        return procs[-1]

    try:
        ps = start("ps", [sys.executable, "-m", "flowmill.runtime.server"])
        worker = start("worker", [sys.executable, str(script)], STEP_SLEEP="0.01",
                       FLOWMILL_TRAINING='{"mode": "async", "maxSteps": 100000}')
        wait_until(lambda: "first step done" in (tmp_path / "worker.log").read_text(),
                   "the worker to train", 120, 0.1)
        ps.kill()
        code = worker.wait(timeout=120)
        out = (tmp_path / "worker.log").read_text()
        assert code == RESTART_JOB_EXIT_CODE, out
        assert "lost /job:ps/task:0" in out, out
        # A few lines say so; gRPC's nested errors and tracebacks only under FLOWMILL_DEBUG.
        said = out.split("first step done\n", 1)[1]
        assert len(said.splitlines()) <= 3 and "Traceback" not in said, out
        assert "debug_error_string" not in said, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
