"""BLAS/OpenMP threads per task (``runtime.threads``): the launcher shares its cores among
the tasks it starts, a task on a cluster takes its cgroup's CPU limit, and a count set in
the manifest or the environment wins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from test_launcher import ROOT, job

from flowmill.launcher.local import LocalLauncher
from flowmill.operator.api import TrainingJob
from flowmill.runtime.cluster import ENV_VAR, ClusterSpec, TaskConfig
from flowmill.runtime.threads import THREAD_VARS, cpu_limit, divide, explicit

# ---- the CPU limit from a cgroup tree


def _tree(tmp_path: Path, files: dict[str, str], proc_cgroup: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_cgroup)
    return root, proc


def test_cgroup_v2_limit_is_the_smallest_along_the_path(tmp_path):
    root, proc = _tree(tmp_path, {
        "cpu.max": "max 100000\n",
        "kubepods/cpu.max": "400000 100000\n",
        "kubepods/pod1/cpu.max": "max 100000\n",
        "kubepods/pod1/ctr/cpu.max": "150000 100000\n",
    }, "0::/kubepods/pod1/ctr\n")
    assert cpu_limit(root, proc) == 1.5


def test_cgroup_v1_quota_over_period(tmp_path):
    root, proc = _tree(tmp_path, {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    }, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cpu_limit(root, proc) == 2.0


def test_no_limit_anywhere_is_none(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "max 100000\n"}, "0::/\n")
    assert cpu_limit(root, proc) is None
    assert cpu_limit(tmp_path / "missing", tmp_path / "missing-proc") is None


# ---- dividing a launcher's cores


def test_workers_share_the_cores_and_a_ps_task_gets_one():
    tasks = [("ps", 0), ("worker", 0), ("worker", 1)]
    assert divide(2, tasks) == {("ps", 0): 1, ("worker", 0): 1, ("worker", 1): 1}
    tasks = [("ps", 0), ("ps", 1), ("chief", 0), ("worker", 0), ("worker", 1)]
    assert divide(16, tasks) == {("ps", 0): 1, ("ps", 1): 1, ("chief", 0): 5,
                                 ("worker", 0): 5, ("worker", 1): 5}
    assert divide(1, [("worker", 0), ("worker", 1)]) == {("worker", 0): 1, ("worker", 1): 1}


def test_a_count_set_by_hand_is_found():
    assert explicit({"OPENBLAS_NUM_THREADS": "3"}) == ("OPENBLAS_NUM_THREADS", 3)
    assert explicit({"OMP_NUM_THREADS": "x", "MKL_NUM_THREADS": "2"}) == ("MKL_NUM_THREADS", 2)
    assert explicit({"OMP_NUM_THREADS": "0"}) is None


def test_the_launcher_gives_each_task_its_share_unless_the_manifest_sets_it():
    manifest = job(["python", "train.py"], workers=2, ps=1)
    launcher = LocalLauncher(TrainingJob.from_dict(manifest), environ={}, cores=8)
    launcher.tasks = launcher.plan([5001, 5002, 5003])
    got = {t.name: {v: t.env[v] for v in THREAD_VARS} for t in launcher.tasks}
    assert got["ps-0"] == dict.fromkeys(THREAD_VARS, "1")
    assert got["worker-0"] == got["worker-1"] == dict.fromkeys(THREAD_VARS, "4")
    assert launcher.describe_threads().startswith(
        "BLAS/OpenMP threads on 8 core(s): ps-0 1, worker-0 4, worker-1 4 (set ")

    container = manifest["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "OMP_NUM_THREADS", "value": "3"}]
    launcher = LocalLauncher(TrainingJob.from_dict(manifest), environ={}, cores=8)
    launcher.tasks = launcher.plan([5001, 5002, 5003])
    worker = launcher.tasks[1]
    assert worker.env["OMP_NUM_THREADS"] == "3" and "OPENBLAS_NUM_THREADS" not in worker.env
    assert "worker-0 3 (OMP_NUM_THREADS)" in launcher.describe_threads()


# ---- in the processes themselves

REPORT = textwrap.dedent(
    """
    import os
    import numpy  # loaded before flowmill, as a model script does
    from threadpoolctl import threadpool_info
    def blas():
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"][0]
    print("blas threads at load", blas())
    if os.environ.get("ONE_CORE"):  # as a CPU limit of 1 would, after NumPy loaded
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import flowmill.runtime
    print("blas threads", blas())
    """
)


def _task_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    spec = ClusterSpec.from_dict({"worker": ["127.0.0.1:1"]})
    env[ENV_VAR] = TaskConfig(spec, "worker", 0).to_json()
    return {**env, **extra}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_task_takes_the_cores_it_may_run_on_even_after_numpy_loaded():
    """NumPy loaded with the machine's count; the task may then run on one core only:
    flowmill sets its BLAS pool to one thread."""
    out = subprocess.run([sys.executable, "-c", REPORT], env=_task_env(ONE_CORE="1"),
                         capture_output=True, text=True, check=True, cwd="/").stdout
    assert "blas threads 1" in out, out
    # A count the environment sets is kept.
    out = subprocess.run([sys.executable, "-c", REPORT],
                         env=_task_env(ONE_CORE="1", OPENBLAS_NUM_THREADS="2"),
                         capture_output=True, text=True, check=True, cwd="/").stdout
    assert "blas threads 2" in out, out


def test_a_local_job_s_tasks_see_the_threads_the_launcher_gave_them(tmp_path):
    # Every worker reports before the job ends (under ChiefWorker, worker 0's exit would
    # stop a worker that had not printed yet).
    manifest = job(["python", "-c", REPORT], workers=2, ps=1, successPolicy="AllWorkers")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [s for s in proc.stderr.splitlines() if "BLAS/OpenMP threads on" in s]
    shares = dict(part.rsplit(" ", 1) for part in
                  line.split(": ", 2)[-1].split(" (set ")[0].split(", "))
    assert shares["ps-0"] == "1"
    for i in range(2):
        assert f"[worker-{i}] blas threads {shares[f'worker-{i}']}" in proc.stdout, proc.stdout
