"""A stalled job and the task holding it up: the accumulators that know who contributed,
the PS's report of them, the pure judgement (``flowmill.operator.stall``), and the local
launcher restarting a hung worker of the digits job until the job succeeds."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from flowmill.kernels.conditional_accumulator import (
    ConditionalAccumulatorState,
    StalenessClockState,
)
from flowmill.operator.stall import (
    DEFAULT_FLOOR_S,
    FIRST_STEP_S,
    Stalled,
    TaskProgress,
    holders,
    stall_timeout,
)
from flowmill.runtime.server_stats import coordination

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300

# ---- the accumulators and what a PS reports of them


def pending(acc) -> dict:
    """``acc.pending()`` without the time it has waited (a clock reading)."""
    out = acc.pending()
    assert out.pop("waitedSeconds") >= 0
    return out


def test_an_accumulator_knows_who_contributed_to_its_pending_step():
    acc = ConditionalAccumulatorState("w/grad_accum", np.float32, (2,))
    assert pending(acc) == {"step": 0, "count": 0, "workers": [], "waitingTakes": 0}
    acc.apply(0, np.ones(2, np.float32), worker=1)
    acc.apply(0, np.ones(2, np.float32))  # a sender that did not say who it is
    assert pending(acc)["workers"] == [1] and pending(acc)["count"] == 2
    acc._step_began -= 60  # as if the step had waited a minute: the take starts the next
    assert acc.pending()["waitedSeconds"] >= 60
    acc.take(2)
    assert acc.pending()["waitedSeconds"] < 60
    assert pending(acc) == {"step": 1, "count": 0, "workers": [], "waitingTakes": 0}
    acc.apply(0, np.ones(2, np.float32), worker=0)  # stale: dropped, not a contribution
    assert pending(acc)["workers"] == []
    acc.apply(1, np.ones(2, np.float32), worker=0)
    acc.reset(5)
    assert pending(acc) == {"step": 5, "count": 0, "workers": [], "waitingTakes": 0}


def test_the_ps_reports_the_workers_in_every_accumulator_of_the_lowest_pending_step():
    a = ConditionalAccumulatorState("a", np.float32, ())
    b = ConditionalAccumulatorState("b", np.float32, ())
    c = ConditionalAccumulatorState("c", np.float32, ())
    one = np.float32(1)
    for acc in (a, b, c):
        acc.apply(0, np.asarray(one), worker=0)
    a.apply(0, np.asarray(one), worker=2)
    b.apply(0, np.asarray(one), worker=2)  # worker 2 has not reached c yet
    c.apply(0, np.asarray(one), worker=1)
    c.take(2)  # c is at step 1: everyone it needed for step 0 was in
    clock = StalenessClockState("clock", 3, 1)
    clock.advance(0)
    clock.advance(2)
    report = coordination([("a", a), ("b", b), ("c", c), ("clock", clock), ("x", object())])
    assert 0 <= report["sync"].pop("waitedSeconds") < 60
    assert report == {
        "sync": {"step": 0, "accumulators": 3, "workers": [0, 2], "waitingTakes": 0},
        "staleness": {"finished": [1, 0, 1], "waiting": 0},
    }
    assert coordination([]) == {}


# ---- the judgement


REPLICAS = [("worker", 0), ("worker", 1), ("worker", 2)]


def tp(index: int, since: float | None, running: float = 1000.0, step_s: float = 0.1,
       step: int = 10) -> TaskProgress:
    snap = None if since is None else {"sinceStepSeconds": since, "stepSeconds": step_s,
                                       "step": step}
    return TaskProgress("worker", index, running, snap)


def ps(step: int, workers: list[int], waited: float = 30.0) -> dict:
    return {"task": {"role": "ps", "index": 0},
            "sync": {"step": step, "accumulators": 4, "waitedSeconds": waited,
                     "workers": workers, "waitingTakes": 1}}


def test_the_timeout_is_the_spec_s_or_twenty_median_steps_with_a_floor():
    assert stall_timeout(7, [tp(0, 1.0)]) == 7.0
    assert stall_timeout(None, [tp(0, 1.0, step_s=0.5)]) == DEFAULT_FLOOR_S
    assert stall_timeout(None, [tp(0, 1.0, step_s=0.5), tp(1, 1.0, step_s=30.0)]) == 600.0
    assert stall_timeout(None, [tp(0, None)]) == DEFAULT_FLOOR_S


def test_nothing_is_stalled_while_steps_are_made():
    tasks = [tp(0, 0.2), tp(1, 0.1), tp(2, 4.9)]
    assert holders("sync", REPLICAS, tasks, [ps(3, [0, 1])], 5.0) == []
    assert holders("async", REPLICAS, tasks, [], 5.0) == []


def test_sync_names_the_worker_that_sent_no_gradients_for_the_pending_step():
    tasks = [tp(0, 9.0), tp(1, 9.0), tp(2, 9.0)]
    found = holders("sync", REPLICAS, tasks, [ps(40, [0, 2]), ps(40, [0, 1, 2])], 5.0)
    assert [s.name for s in found] == ["worker-1"]
    assert "sent no gradients for step 40" in found[0].reason
    assert "2 of 3 needed are in" in found[0].reason


def test_sync_names_the_chief_when_every_gradient_is_in():
    tasks = [tp(0, 9.0), tp(1, 9.0), tp(2, 9.0)]
    found = holders("sync", REPLICAS, tasks, [ps(40, [0, 1, 2])], 5.0)
    assert found == [Stalled("worker", 0, found[0].reason)]
    assert "did not apply them" in found[0].reason
    # With a backup worker two gradients are enough.
    found = holders("sync", REPLICAS, tasks, [ps(40, [1, 2])], 5.0, backup_workers=1)
    assert [s.name for s in found] == ["worker-0"]


def test_sync_names_nobody_while_the_pending_step_is_younger_than_the_timeout():
    """The tasks' reports are up to a poll old: worker-0 said 9 s without a step, but the
    accumulators moved to step 41 a second ago, so it has just been given its token."""
    tasks = [tp(0, 9.0), tp(1, None, running=FIRST_STEP_S + 1), tp(2, 9.0)]
    assert holders("sync", REPLICAS, tasks, [ps(41, [], waited=1.0)], 5.0) == []
    assert [s.name for s in holders("sync", REPLICAS, tasks, [ps(41, [], waited=6.0)], 5.0)] \
        == ["worker-0", "worker-1", "worker-2"]


def test_sync_names_nobody_when_a_ps_cannot_be_read():
    tasks = [tp(0, 9.0), tp(1, 9.0), tp(2, 9.0)]
    assert holders("sync", REPLICAS, tasks, [ps(40, [0, 2]), None], 5.0) == []
    assert holders("sync", REPLICAS, tasks, [{"task": {"role": "ps"}}], 5.0) == []


def test_a_restarted_task_gets_time_for_its_first_step():
    # worker-1 was just restarted: the others still wait, but it is not named again,
    # nor are they (they sent their gradients).
    tasks = [tp(0, 9.0), tp(1, None, running=6.0), tp(2, 9.0)]
    assert holders("sync", REPLICAS, tasks, [ps(40, [0, 2])], 5.0) == []
    # Past the timeout but before FIRST_STEP_S it still is not.
    tasks[1] = tp(1, None, running=FIRST_STEP_S - 1)
    assert holders("sync", REPLICAS, tasks, [ps(40, [0, 2])], 5.0) == []
    tasks[1] = tp(1, None, running=FIRST_STEP_S + 1)
    assert [s.name for s in holders("sync", REPLICAS, tasks, [ps(40, [0, 2])], 5.0)] == \
        ["worker-1"]


def test_a_backup_worker_that_hangs_alone_is_named_while_the_others_go_on():
    tasks = [tp(0, 0.1), tp(1, 30.0), tp(2, 0.2)]
    found = holders("sync", REPLICAS, tasks, [ps(41, [0, 2])], 5.0, backup_workers=1)
    assert [s.name for s in found] == ["worker-1"] and "made no step for 30s" in found[0].reason


def test_async_names_each_quiet_task():
    tasks = [tp(0, 0.1), tp(1, 30.0), tp(2, 12.0)]
    assert [s.name for s in holders("async", REPLICAS, tasks, [], 10.0)] == \
        ["worker-1", "worker-2"]


def test_bounded_staleness_names_the_slowest_on_the_clock_not_those_waiting_for_it():
    tasks = [tp(0, 20.0, step=12), tp(1, 30.0, step=9), tp(2, 20.0, step=12)]
    clock = {"staleness": {"finished": [12, 9, 12], "waiting": 2}}
    found = holders("bounded-staleness", REPLICAS, tasks, [clock], 10.0)
    assert [s.name for s in found] == ["worker-1"] and "9 finished steps" in found[0].reason
    # Without the clock, the tasks' own counts.
    assert [s.name for s in holders("bounded-staleness", REPLICAS, tasks, [None], 10.0)] == \
        ["worker-1"]


# ---- the local launcher, with the digits job


INJECT = ROOT / "tests" / "inject.py"  # e.g. one task hangs after a step, in its first life


def digits_job(command: list[str], *, mode: str, timeout: int, steps: int = 60,
               policy: str = "OnFailure") -> dict:
    return {
        "apiVersion": "flowmill.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "stall"},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 1},
                "worker": {"replicas": 2, "restartPolicy": policy, "template": {"spec": {
                    "containers": [{"name": "flowmill", "image": "flowmill:test",
                                    "command": command}]}}},
            },
            "training": {"mode": mode, "maxSteps": steps},
            "runPolicy": {"stallTimeoutSeconds": timeout, "backoffLimit": 2},
        },
    }


def run_job(tmp_path: Path, manifest: dict) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("mode, hung", [("sync", 1), ("async", 0)])
def test_a_hung_worker_is_named_and_restarted_and_the_job_succeeds(tmp_path, mode, hung):
    """Sync: worker-1 hangs and the whole job waits for its gradients; async: nobody
    waits for anybody, so the hung task is the chief (which alone ends the job)."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")
    marker = tmp_path / "hung"
    command = ["python", str(INJECT), "hang", str(marker), str(hung), "10",
               "examples/digits/train.py"]
    code, out = run_job(tmp_path, digits_job(command, mode=mode, timeout=5, steps=100))
    assert code == 0, out[-4000:]
    assert marker.exists() and f"[worker-{hung}] hanging after step" in out
    if mode == "sync":
        # The step everyone waits for is the one worker-1 never sent gradients for.
        want = (r"flowmill: worker-1 is stalled: sent no gradients for step \d+ for \d+s "
                r"while the job waits for them \(1 of 2 needed are in\) "
                r"\(spec.runPolicy.stallTimeoutSeconds 5\): restarting it \(restart 1 of 2\)")
    else:
        want = (r"flowmill: worker-0 is stalled: made no step for \d+s "
                r"\(spec.runPolicy.stallTimeoutSeconds 5\): restarting it \(restart 1 of 2\)")
    assert re.search(want, out), out[-4000:]
    assert out.count("is stalled") == 1, out[-4000:]
    # The job went on to its last step: the chief's evaluation is the last word.
    assert re.search(r"\[worker-0\] trained \d+ steps .* global step 1\d\d", out), \
        out[-3000:]
    assert "[worker-0] test_accuracy:" in out
    assert "flowmill: job stall succeeded" in out


def test_a_worker_restarted_after_a_crash_gets_time_for_its_first_step(tmp_path):
    """worker-1 crashes at step 150 (seconds into the run: its progress was read) and its
    next life takes longer to start than the stall
    timeout: the others wait for its gradients, quiet, but nobody is named stalled (what
    its earlier life reported does not count for the new one)."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")
    command = ["python", str(INJECT), "crash", str(tmp_path / "crashed"), "1", "150", "8",
               "examples/digits/train.py"]
    code, out = run_job(tmp_path, digits_job(command, mode="sync", timeout=3, steps=200))
    assert code == 0, out[-4000:]
    assert "[worker-1] crashing after step" in out and "[worker-1] starting again in 8s" in out
    assert "worker-1 exited with code 1: restarting it (restart 1 of 2)" in out, out[-4000:]
    assert "is stalled" not in out, out[-4000:]
    assert re.search(r"\[worker-0\] trained \d+ steps .* global step 200", out), out[-3000:]


def test_a_hung_worker_under_never_fails_the_job_naming_it(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")
    command = ["python", str(INJECT), "hang", str(tmp_path / "hung"), "1", "5",
               "examples/digits/train.py"]
    code, out = run_job(tmp_path, digits_job(command, mode="sync", timeout=4, policy="Never"))
    assert code == 1, out[-4000:]
    assert re.search(r"flowmill: job stall failed: worker-1 is stalled: sent no gradients for "
                     r"step \d+ .*; spec.replicaSpecs.worker.restartPolicy is Never", out), \
        out[-4000:]


def test_every_task_serves_metrics_and_the_launcher_says_where(tmp_path):
    """PS tasks serve what they hold and their sync state; training tasks their step
    times and the job's global step; the launcher's start line says where."""
    import json
    import time
    import urllib.request

    trained, release = tmp_path / "trained", tmp_path / "release"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, time
        import numpy as np
        import flowmill.runtime as fm
        from flowmill.runtime.progress import ProgressBar
        from flowmill.runtime.session_manager import initialize_or_wait
        g = fm.Graph(seed=1)
        with g.as_default():
            w = fm.Variable(np.zeros((64, 4), np.float32), name="w")
            x = fm.placeholder(fm.float32, (None, 64))
            loss = fm.reduce_mean(fm.square(fm.matmul(x, w) - 1.0))
            step = fm.train.create_global_step()
            train = fm.train.GradientDescent(0.1).minimize(loss, global_step=step)
            init = fm.global_variables_initializer()
        with fm.Session(g) as sess, ProgressBar(5) as bar:
            initialize_or_wait(sess, init)
            for k in range(5):
                sess.run(train, {{x: np.ones((8, 64), np.float32)}})
                # read on its own: a read in the step may run before the update it waits for
                bar.update(k + 1, global_step=int(sess.run(step.value())))
            open({str(trained)!r}, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
        """
    ))
    manifest = digits_job(["python", str(script)], mode="sync", timeout=60)
    manifest["spec"]["replicaSpecs"]["worker"]["replicas"] = 1
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = ""
        for line in proc.stderr:
            if line.startswith("flowmill: task metrics: "):
                break
        where = dict(re.findall(r"(ps-0|worker-0) (http://\S+)/metrics", line))
        assert set(where) == {"ps-0", "worker-0"}, line
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not trained.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the job never trained"
            time.sleep(0.05)

        def get(url: str) -> str:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read().decode()

        ps = json.loads(get(where["ps-0"] + "/progress"))
        assert ps["task"] == {"role": "ps", "index": 0}
        assert ps["variables"] >= 2 and ps["variableBytes"] >= 64 * 4 * 4
        assert ps["updatesApplied"] >= 5 and ps["bytesServed"] > 0 and ps["valuesServed"] > 0
        assert ps["sync"]["step"] == 5 and ps["sync"]["accumulators"] == 1
        assert ps["peerRestartsSeen"] == 0
        ps_metrics = get(where["ps-0"] + "/metrics")
        for name in ("flowmill_variables", "flowmill_variable_bytes",
                     "flowmill_bytes_served_total", "flowmill_updates_applied_total",
                     "flowmill_peer_restarts_seen_total", "flowmill_sync_pending_step"):
            assert re.search(rf'^{name}{{role="ps",index="0"}} \d', ps_metrics, re.M), name
        mine = get(where["worker-0"] + "/metrics")
        assert 'flowmill_global_step{role="worker",index="0"} 5' in mine
        assert 'flowmill_step_seconds_count{role="worker",index="0"} 4' in mine
        assert 'flowmill_step_seconds_bucket{role="worker",index="0",le="+Inf"} 4' in mine
        snap = json.loads(get(where["worker-0"] + "/progress"))
        assert snap["stepSeconds"] > 0 and snap["sinceStepSeconds"] >= 0
    finally:
        release.touch()
        try:
            proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0
