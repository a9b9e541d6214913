"""A bench's model as a local job (``flowmill run --local``), timed across its workers.

The bench script is also each worker's command (``--worker DIR``). Workers warm up, meet
at a barrier (``ready-<i>`` files in DIR), take their timed steps and each leave a
``result-<i>.json`` with at least ``start`` and ``end`` (wall clock); the chief exits
only once every worker has reported, since its exit ends the job. The launcher side
writes the manifest, runs the job and reads the reports back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def wait_for(paths: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"{what}: still waiting for {missing} after {timeout:.0f} s")
        time.sleep(0.02)


# ---- in a worker


def barrier(out: Path, me, timeout: float) -> None:
    """Wait until every worker of the job (``me``: ``flowmill.runtime.job.task()``) is
    here."""
    (out / f"ready-{me.index}").touch()
    wait_for([out / f"ready-{i}" for i in range(me.count)], timeout, "barrier")


def report(out: Path, me, result: dict, timeout: float) -> None:
    """Leave this worker's result; the chief returns once every worker has left one."""
    tmp = out / f"result-{me.index}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"result-{me.index}.json")
    if me.is_chief:  # the chief's exit ends the job: not before every worker reported
        wait_for([out / f"result-{i}.json" for i in range(me.count)], timeout, "results")


# ---- around the job


def manifest(name: str, command: list[str], ps: int, workers: int, mode: str,
             job_timeout: float, tls: bool = True) -> dict:
    container = {"name": "flowmill", "image": "flowmill:bench", "command": command}
    return {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": ps},
                "worker": {"replicas": workers, "restartPolicy": "Never",
                           "template": {"spec": {"containers": [container]}}},
            },
            "training": {"mode": mode},
            # Workers wait at the barrier without stepping: not a stall.
            "runPolicy": {"backoffLimit": 0, "stallTimeoutSeconds": int(job_timeout)},
            "security": {"tls": tls},
        },
    }


def run(name: str, command: Callable[[Path], list[str]], ps: int, workers: int, mode: str,
        job_timeout: float, env: dict[str, str] | None = None,
        tls: bool = True) -> tuple[list[dict], str]:
    """Run the job (``command(DIR)`` is the workers' command line); every worker's report
    and the launcher's stderr. Raises naming the job when it fails or a report is
    missing."""
    with tempfile.TemporaryDirectory(prefix="bench-job-") as tmp:
        out = Path(tmp)
        path = out / "job.yaml"
        path.write_text(yaml.safe_dump(manifest(name, command(out), ps, workers, mode,
                                                job_timeout, tls)))
        proc = subprocess.run(
            [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=job_timeout + 60,
        )
        results = [out / f"result-{i}.json" for i in range(workers)]
        if proc.returncode != 0 or not all(p.exists() for p in results):
            raise RuntimeError(f"the job {name} failed (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return [json.loads(p.read_text()) for p in results], proc.stderr


def window(reports: list[dict]) -> tuple[float, float]:
    """From the first timed step's start to the last one's end, over every worker."""
    return min(r["start"] for r in reports), max(r["end"] for r in reports)
