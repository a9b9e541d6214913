"""A distributed job whose workers have a GPU: 2 PS tasks and 2 sync workers, each worker
with one strict GPU stand-in device (``FLOWMILL_STANDIN_GPUS``), run by the local launcher
as a user runs it. The manifest's ``nvidia.com/gpu`` limit is what gives each worker its
GPU; the PS tasks get none. Each task reports the stand-in's copy counts when it exits."""

from __future__ import annotations

import json
import re

import pytest
from test_launcher import ROOT, finish, flowmill_run  # noqa: F401  (the fixture)


@pytest.mark.slow
def test_digits_sync_on_two_ps_and_two_gpu_workers(flowmill_run, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")
    counts = tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv("FLOWMILL_STANDIN_GPUS", "1")
    monkeypatch.setenv("FLOWMILL_STANDIN_COUNTS", str(counts))
    container = {
        "name": "flowmill",
        "image": "flowmill:test",
        "command": ["python", "examples/digits/train.py", "--epochs", "8"],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    manifest = {
        "apiVersion": "flowmill.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "digits-gpu"},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 2},
                "worker": {"replicas": 2, "template": {"spec": {"containers": [container]}}},
            },
            "training": {"mode": "sync"},
        },
    }
    code, out, err = finish(flowmill_run(manifest), timeout=300)
    assert code == 0, err[-4000:]
    last = [line for line in out.splitlines() if line.startswith("[worker-0] ")][-1]
    match = re.fullmatch(r"\[worker-0\] test_accuracy: (\d\.\d{4})", last)
    assert match and float(match.group(1)) >= 0.9, last
    for i in range(2):
        assert f"flowmill: /job:worker/task:{i} computes on CPU:0, GPU:0" in err
    assert "/job:ps/task:0 computes on" not in err
    reports = [json.loads(p.read_text()) for p in counts.glob("*.json")]
    workers = [r["counts"] for r in reports if "examples/digits/train.py" in " ".join(r["argv"])]
    ps = [r["counts"] for r in reports if r["argv"][0].endswith("runtime/server.py")]
    assert len(workers) == 2 and len(ps) == 2, reports
    for c in workers:  # pulled variables went to the GPU, gradients came back to be sent
        assert c["h2d"] > 0 and c["d2h"] == c["pinned"] > 0 and c["syncs"] == 0, c
    for c in ps:  # the PS tasks kept everything in host memory
        assert c["h2d"] == 0 and c["d2h"] == 0, c
