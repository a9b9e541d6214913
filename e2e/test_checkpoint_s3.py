"""Checkpoints and summaries against the real S3 server: the checkpoint store's and the
summary writer's test suites, run on their s3 legs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import Cluster

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def test_checkpoint_suite_on_seaweedfs(cluster: Cluster) -> None:
    env = {
        **os.environ,
        **cluster.s3.env(),
        "FLOWMILL_TEST_S3_URI": f"s3://{cluster.s3.bucket}/ckpt",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "test_checkpoint_store.py"),
            str(ROOT / "tests" / "test_summary.py"),
            "-k",
            "s3",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
