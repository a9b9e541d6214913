"""Faults of a job's data and checkpoints, met as a user meets them: the digits job under
``flowmill run --local`` (real PS and worker processes), with a damaged checkpoint in its
directory or a bad record in its data. Each test asserts the outcome (the step restored,
what was quarantined, the job's exit and the message naming the cause)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flowmill.kernels import checkpoint_store as checkpoint
from flowmill.kernels.checkpoint_store import open_store

ROOT = Path(__file__).resolve().parents[1]
INJECT = ROOT / "tests" / "inject.py"
RUN_TIMEOUT_S = 300
RESTORED = re.compile(r"\[worker-0\] .*restored checkpoint step (\d+)")

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _digits():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")


def digits_job(*, steps: int, uri: str | None = None, command: list[str] | None = None,
               policy: str = "OnFailure", backoff: int = 3, **training) -> dict:
    spec = {
        "replicaSpecs": {
            "ps": {"replicas": 1},
            "worker": {"replicas": 2, "restartPolicy": policy, "template": {"spec": {
                "containers": [{"name": "flowmill", "image": "flowmill:test",
                                "command": command or ["python", "examples/digits/train.py"]}]}}},
        },
        "training": {"mode": "sync", "maxSteps": steps, **training},
        "runPolicy": {"backoffLimit": backoff},
    }
    if uri is not None:
        spec["checkpoint"] = {"uri": uri, "intervalSteps": 20, "keep": 3}
    return {"apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "faults"}, "spec": spec}


def run_job(tmp_path: Path, manifest: dict, name: str = "job") -> tuple[int, str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    return proc.returncode, proc.stdout + proc.stderr


def flip_a_byte(root: Path, step: int) -> None:
    """Damage a committed shard in place: same size, so only its CRC32C tells."""
    for path in (root / f"ckpt-{step:012d}").glob("ps-0.*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def committed(uri: str) -> list[int]:
    return sorted(m.step for m in checkpoint.checkpoints(*open_store(uri)))


def quarantined(uri: str) -> list[int]:
    return sorted(int(d.rsplit("-", 1)[1]) for d, _ in checkpoint.quarantined(*open_store(uri)))


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, str]:
    """A checkpoint directory the digits job left at steps 20 and 40."""
    root = tmp_path / "ckpt"
    code, out = run_job(tmp_path, digits_job(steps=40, uri=root.as_uri()), "first")
    assert code == 0, out[-4000:]
    assert committed(root.as_uri()) == [20, 40]
    return root, root.as_uri()


def test_a_corrupt_newest_checkpoint_is_quarantined_and_the_job_resumes_before_it(
    tmp_path: Path, trained
):
    root, uri = trained
    flip_a_byte(root, 40)
    code, out = run_job(tmp_path, digits_job(steps=60, uri=uri), "again")
    assert code == 0, out[-4000:]
    restored = RESTORED.search(out)
    assert restored and restored.group(1) == "20", out[-4000:]
    # The damaged one was taken out of use with its reason on record, and its step was
    # free to be saved again as the job went on to its end.
    (record,) = (root / "ckpt-000000000040").glob("QUARANTINED.*.json")
    assert "CRC32C" in record.read_text()
    assert committed(uri) == [20, 40, 60] and quarantined(uri) == []
    assert "global step 60" in out


def test_every_checkpoint_corrupt_fails_the_job_naming_them_unless_it_may_start_fresh(
    tmp_path: Path, trained
):
    root, uri = trained
    for step in (20, 40):
        flip_a_byte(root, step)
    code, out = run_job(tmp_path, digits_job(steps=60, uri=uri, backoff=0), "corrupt")
    assert code == 1, out[-4000:]
    assert "ckpt-000000000020" in out and "ckpt-000000000040" in out, out[-4000:]
    assert "onCorrupt: StartFresh" in out
    assert "flowmill: job faults failed: spec.runPolicy.backoffLimit 0 reached" in out
    assert committed(uri) == [] and quarantined(uri) == [20, 40]

    manifest = digits_job(steps=30, uri=uri)
    manifest["spec"]["checkpoint"]["onCorrupt"] = "StartFresh"
    code, out = run_job(tmp_path, manifest, "fresh")
    assert code == 0, out[-4000:]
    assert RESTORED.search(out) is None
    assert "global step 30" in out and committed(uri) == [20, 30]


def test_a_nan_in_the_data_fails_the_job_naming_where_it_came_in(tmp_path: Path):
    """Every 40th image has a NaN pixel: with training.checkNumerics the first step that
    feeds one fails naming the feed, and under restartPolicy ExitCode the job fails
    at once; the parameters were never updated with it."""
    command = ["python", str(INJECT), "nan-digits", "40", "examples/digits/train.py"]
    manifest = digits_job(steps=60, command=command, policy="ExitCode", checkNumerics=True)
    code, out = run_job(tmp_path, manifest)
    assert code == 1, out[-4000:]
    assert re.search(r"\[worker-\d\] .*InvalidArgumentError: NaN found in the value fed to "
                     r"'features:0'", out), out[-4000:]
    assert re.search(r"flowmill: job faults failed: worker-\d exited with code 1; "
                     r"spec.replicaSpecs.worker.restartPolicy ExitCode treats code 1 as "
                     r"permanent", out), out[-4000:]
    assert "test_accuracy" not in out
