"""The convnet example (examples/convnet/train.py) as a user runs it: alone to 98% on the
digits, its batch normalization trained and then used at inference, its Fashion-MNIST
files read (or the missing one named), and as a sync job with a backup worker through
``flowmill run --local``, where a worker that never finishes a step does not hold it up."""

from __future__ import annotations

import gzip
import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

import flowmill.runtime as fm

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "convnet" / "train.py"
LAST_LINE = re.compile(r"^test_accuracy: (\d\.\d{4})$")
FASHION = pathlib.Path("/usr/share/datasets/fashion-mnist")

pytest.importorskip("sklearn", reason="the convnet example needs scikit-learn's bundled digits")


def load_example():
    spec = importlib.util.spec_from_file_location("convnet_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


@pytest.mark.slow
def test_digits_trains_to_98_percent_in_one_process():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.rstrip("\n").splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, f"last stdout line is {lines[-1]!r}, expected 'test_accuracy: <value>'"
    assert float(match.group(1)) >= 0.98, proc.stdout
    assert lines[-2].startswith("train_accuracy: ")
    assert any(line.startswith("step times: 535 steps") for line in lines), proc.stdout


# ---- batch normalization: moving averages trained, then used at inference


def digits_graph(seed: int = 3):
    g = fm.Graph(seed=seed)
    with g.as_default():
        x = fm.placeholder(fm.float32, (None, 8, 8, 1), name="features")
        y = fm.placeholder(fm.int64, (None,), name="labels")
        train_model = example.build_model(x, y, training=True, seed=seed)
        train_op, _ = example.build_train_op(train_model["loss"], 0.005, 100, 0.05)
        eval_model = example.build_model(x, y, training=False, reuse=True, seed=seed)
        init = fm.global_variables_initializer()
    return g, x, y, train_model, train_op, eval_model, init


def test_batch_norm_moving_averages_follow_the_batches_and_serve_inference():
    x_train, x_test, y_train, _ = example.load_digits()
    g, x, y, train_model, train_op, eval_model, init = digits_graph()
    variables = {v.name: v for v in fm.global_variables(g)}
    mean_var = variables["block0/bn/moving_mean"]
    variance_var = variables["block0/bn/moving_variance"]
    conv = g.get_operation_by_name("block0/conv/Conv2D").outputs[0]
    # Two BN layers, two averages each: the training tower's UPDATE_OPS, and only its.
    assert len(g.get_collection(fm.GraphKeys.UPDATE_OPS)) == 4
    with fm.Session(g) as sess:
        sess.run(init)
        batch = {x: x_train[:32], y: y_train[:32]}
        before = sess.run([mean_var.value(), variance_var.value()])
        np.testing.assert_array_equal(before[0], 0.0)
        np.testing.assert_array_equal(before[1], 1.0)
        # One step: each average moves a tenth (momentum 0.9) of the way to the batch's
        # moments of the convolution's output, computed on that same batch.
        features, _ = sess.run([conv, train_op], batch)
        mean, variance = sess.run([mean_var.value(), variance_var.value()])
        axes = (0, 1, 2)
        np.testing.assert_allclose(mean, 0.1 * features.mean(axis=axes), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(variance, 0.9 + 0.1 * features.var(axis=axes),
                                   rtol=1e-4, atol=1e-6)
        for k in range(1, 40):
            sess.run(train_op, {x: x_train[32 * k : 32 * (k + 1)],
                                y: y_train[32 * k : 32 * (k + 1)]})
        # Inference normalizes with the averages: an image's logits do not depend on the
        # rest of its batch, and move when the averages do. Training uses the batch's own
        # moments, so there the batch matters and the averages do not.
        alone = sess.run(eval_model["logits"], {x: x_test[:1]})
        among = sess.run(eval_model["logits"], {x: x_test[:50]})[:1]
        np.testing.assert_allclose(alone, among, rtol=1e-5, atol=1e-5)
        trained_alone = sess.run(train_model["logits"], {x: x_test[:2]})[:1]
        trained_among = sess.run(train_model["logits"], {x: x_test[:50]})[:1]
        assert not np.allclose(trained_alone, trained_among, atol=1e-3)
        sess.run(mean_var.assign_add(np.ones(32, np.float32)))
        shifted = sess.run(eval_model["logits"], {x: x_test[:1]})
        assert not np.allclose(shifted, alone, atol=1e-3)
        # The dropout of the training tower is random per step, but never at inference.
        np.testing.assert_array_equal(shifted, sess.run(eval_model["logits"], {x: x_test[:1]}))


# ---- Fashion-MNIST's files


def write_idx(path: pathlib.Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_files_are_read_from_their_folder(tmp_path):
    rng = np.random.default_rng(0)
    data = {}
    for part, (images, labels) in example.FASHION_FILES.items():
        count = 12 if part == "train" else 5
        data[part] = (rng.integers(0, 256, (count, 28, 28)), rng.integers(0, 10, count))
        write_idx(tmp_path / images, data[part][0])
        write_idx(tmp_path / labels, data[part][1])
    x_train, x_test, y_train, y_test = example.load_fashion_mnist(tmp_path)
    assert x_train.shape == (12, 28, 28, 1) and x_train.dtype == np.float32
    np.testing.assert_allclose(x_train[..., 0], data["train"][0] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y_test, data["test"][1])
    assert x_test.shape == (5, 28, 28, 1) and y_train.dtype == np.int64


def test_fashion_mnist_missing_names_the_file_and_the_package(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dataset", "fashion-mnist", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in proc.stderr
    assert "dataset-fashion-mnist" in proc.stderr


def test_a_truncated_idx_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "t.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (10).to_bytes(4, "big") + bytes(7))
    with pytest.raises(ValueError, match=r"t\.gz: header says \[10\]"):
        example.read_idx(path)


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"{FASHION} (dataset-fashion-mnist) absent")
def test_the_installed_fashion_mnist():
    x_train, x_test, y_train, y_test = example.load_fashion_mnist(FASHION)
    assert x_train.shape == (60000, 28, 28, 1) and x_test.shape == (10000, 28, 28, 1)
    assert sorted(np.unique(y_train)) == list(range(10)) and len(y_test) == 10000


# ---- as a sync job with a backup worker


@pytest.mark.slow
def test_sync_job_with_a_backup_worker_finishes_past_a_worker_that_never_steps(tmp_path):
    """1 PS and 3 workers aggregating 2 gradients per update; worker 2 sleeps an hour before
    each step, so without the backup the first update would never come."""
    container = {"name": "flowmill", "image": "flowmill:test",
                 "command": ["python", "examples/convnet/train.py"],
                 "args": ["--straggler-delay", "3600", "--straggler-index", "2"]}
    manifest = {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "convnet-backup"},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 1},
                             "worker": {"replicas": 3, "restartPolicy": "Never",
                                        "template": {"spec": {"containers": [container]}}}},
            "training": {"mode": "sync", "backupWorkers": 1, "maxSteps": 40},
            "runPolicy": {"backoffLimit": 0},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "flowmill: job convnet-backup succeeded: worker 0 exited 0" in out
    assert "[worker-2] convnet digits: worker 2 of 3, 479 train" in out
    assert "sleeps 3600 s per step (straggler)" in out
    assert "[worker-0] trained 40 steps" in out and "global step 40" in out
    assert "[worker-2] trained" not in out  # it never finished a step
    accuracy = re.search(r"^\[worker-0\] test_accuracy: (\d\.\d{4})$", proc.stdout, re.M)
    assert accuracy, proc.stdout[-2000:]
    # 40 updates of 2 x 32 images, from 10% at chance.
    assert float(accuracy.group(1)) >= 0.8
