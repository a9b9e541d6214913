"""Exports for inference (``flowmill.runtime.saved_model``): a model trained in a session is
saved, then loaded in a fresh process that imports no training code, and predicts what the
session predicted, bit for bit (the same kernels run the same step). Damaged exports and
bad inputs are refused naming the file, the variable or the input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save

import flowmill.runtime as fm
from flowmill.runtime import saved_model
from flowmill.runtime.graph_def import from_graph_def
from flowmill.runtime.ops.nn_ops import bias_add, relu
from flowmill.runtime.optimizers import Adam, create_global_step
from flowmill.runtime.saved_model import PredictionError, SavedModelError

from local_cluster import LocalCluster

FRESH_TIMEOUT_S = 120
# Modules a loaded export must not need: training, checkpoints, the job.
TRAINING_MODULES = ("optimizers", "saver", "distributed", "training_mode", "replicas",
                    "checkpoint_policy", "session_manager", "server")


def mlp(devices=("", "")):
    """A 2-layer MLP on 8 features with its loss, Adam and a global step; each layer's
    variables on the device given for it."""
    graph = fm.Graph(seed=7)
    with graph.as_default():
        x = fm.placeholder(fm.float32, (None, 8), name="x")
        labels = fm.placeholder(fm.float32, (None, 3), name="labels")
        h = x
        for i, (units, device) in enumerate(zip((16, 3), devices, strict=True)):
            with fm.device(device), fm.name_scope(f"layer{i}"):
                w = fm.Variable(fm.random_normal((h.shape[-1], units), stddev=0.3), name="kernel")
                b = fm.Variable(np.zeros(units, np.float32), name="bias")
            h = bias_add(fm.matmul(h, w), b)
            if i == 0:
                h = hidden = relu(h)
        loss = fm.reduce_mean(fm.square(h - labels))
        step = create_global_step()
        train = Adam(0.01).minimize(loss, global_step=step)
        init = fm.global_variables_initializer()
    return graph, {"x": x, "labels": labels, "hidden": hidden, "y": h, "loss": loss,
                   "train": train, "init": init}


def data(n=32):
    rng = np.random.default_rng(3)
    return (rng.standard_normal((n, 8)).astype(np.float32),
            rng.standard_normal((n, 3)).astype(np.float32))


def train(sess, t, steps=5):
    sess.run(t["init"])
    x, labels = data()
    for _ in range(steps):
        sess.run(t["train"], {t["x"]: x, t["labels"]: labels})


@pytest.fixture
def trained(tmp_path):
    """An MLP trained a few steps, exported; its session's predictions on ``data()``."""
    graph, t = mlp()
    with fm.Session(graph) as sess:
        train(sess, t)
        x, _ = data()
        want = sess.run(t["y"], {t["x"]: x})
        path = tmp_path / "export"
        saved_model.save(sess, path, {"x": t["x"]}, {"y": t["y"], "relu": t["hidden"]})
    return path, x, want


def in_fresh_process(code: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=FRESH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_a_fresh_process_predicts_exactly_what_the_session_did(trained, tmp_path):
    path, x, want = trained
    np.save(tmp_path / "x.npy", x)
    out = in_fresh_process(f"""
        import json, sys
        import numpy as np
        from flowmill.runtime import saved_model
        model = saved_model.load({str(path)!r})
        got = model(x=np.load("x.npy"))
        np.save("y.npy", got["y"])
        loaded = sorted(m.rsplit(".", 1)[-1] for m in sys.modules if m.startswith("flowmill."))
        print(json.dumps({{"signature": model.signature, "modules": loaded}}))
    """, tmp_path)
    report = json.loads(out)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), want)
    assert report["signature"] == {
        "format": "flowmill-saved-model", "version": 1,
        "inputs": {"x": {"name": "x:0", "dtype": "float32", "shape": [None, 8]}},
        "outputs": {"y": {"name": "BiasAdd_1:0", "dtype": "float32", "shape": [None, 3]},
                    "relu": {"name": "Relu:0", "dtype": "float32", "shape": [None, 16]}},
    }
    assert not set(TRAINING_MODULES) & set(report["modules"]), report["modules"]


def test_the_export_holds_the_inference_graph_and_its_variables_only(trained):
    path, _, _ = trained
    step = from_graph_def((path / "graph.pb").read_bytes())
    types = {n.type for n in step.nodes}
    assert types == {"_Arg", "VarHandleOp", "ReadVariableOp", "MatMul", "BiasAdd", "Relu"}
    names = " ".join(n.name for n in step.nodes)
    for training in ("Adam", "global_step", "labels", "gradients", "Assign", "init"):
        assert training not in names, names
    variables = load_file(path / "variables.safetensors")
    assert sorted(variables) == ["layer0/bias", "layer0/kernel", "layer1/bias", "layer1/kernel"]
    assert variables["layer0/kernel"].shape == (8, 16)


def test_the_loaded_model_takes_lists_and_a_mapping_and_runs_again(trained):
    path, x, want = trained
    model = saved_model.load(path)
    assert model.input_names == ["x"] and model.output_names == ["y", "relu"]
    np.testing.assert_array_equal(model({"x": x.tolist()})["y"], want)
    first = model(x=x)["y"]
    first[:] = 0  # outputs are the caller's own
    np.testing.assert_array_equal(model(x=x)["y"], want)


@pytest.mark.parametrize("feeds, message", [
    ({}, r"missing input 'x' \(the model takes 'x'\)"),
    ({"x": np.zeros((2, 8), np.float32), "z": 1}, r"unknown input 'z'"),
    ({"x": np.zeros(8, np.float32)}, r"shape \(8,\) to 'x' \(input\), which has shape \(\?, 8\)"),
    ({"x": np.zeros((2, 7), np.float32)}, r"shape \(2, 7\) to 'x'"),
    ({"x": [["a"] * 8]}, r"input 'x' is float32; it was given strings"),
    ({"x": [[1e39] * 8]}, r"'x' \(float32\): 1e\+39 does not fit float32"),
    ({"x": [[1.0] * 8, [1.0] * 7]}, r"cannot feed list to input 'x'"),
])
def test_bad_inputs_are_refused_naming_the_input(trained, feeds, message):
    path, _, _ = trained
    model = saved_model.load(path)
    with pytest.raises(fm.FeedError, match=message):
        model(feeds)


def test_an_input_given_twice_is_refused(trained):
    model = saved_model.load(trained[0])
    with pytest.raises(fm.FeedError, match=r"\['x'\] given twice"):
        model({"x": trained[1]}, x=trained[1])


def test_a_model_error_names_the_node(tmp_path):
    graph = fm.Graph()
    with graph.as_default():
        a = fm.placeholder(fm.float32, (None,), name="a")
        b = fm.placeholder(fm.float32, (None,), name="b")
        total = fm.add(a, b, name="total")
    with fm.Session(graph) as sess:
        saved_model.save(sess, tmp_path / "e", {"a": a, "b": b}, {"total": total})
    model = saved_model.load(tmp_path / "e")
    assert model(a=[1, 2], b=[3, 4])["total"].tolist() == [4, 6]
    with pytest.raises(PredictionError, match=r"node 'total' \(Add\) failed") as e:
        model(a=[1, 2], b=[1, 2, 3])
    assert e.value.bad_input


# ---- what save refuses


def test_save_refuses_what_inference_cannot_run(tmp_path):
    graph, t = mlp()
    with fm.Session(graph) as sess:
        train(sess, t, steps=1)
        with pytest.raises(SavedModelError, match=r"placeholder 'labels' \(shape \(\?, 3\), "
                           r"float32\), which is not an input \(inputs: 'x'\)"):
            saved_model.save(sess, tmp_path / "a", {"x": t["x"]}, {"loss": t["loss"]})
        with graph.as_default(), fm.control_dependencies([t["train"]]):
            trains = fm.identity(t["y"])
        with pytest.raises(SavedModelError, match=r"need node 'Adam/.*, which changes state: "
                           r"training does that, an export only reads its variables"):
            saved_model.save(sess, tmp_path / "b", {"x": t["x"], "labels": t["labels"]},
                             {"y": trains})
        with pytest.raises(SavedModelError, match=r"output 't' is operation"):
            saved_model.save(sess, tmp_path / "c", {"x": t["x"]}, {"t": t["train"]})
        with pytest.raises(SavedModelError, match="at least one output"):
            saved_model.save(sess, tmp_path / "d", {"x": t["x"]}, {})
        saved_model.save(sess, tmp_path / "e", {"x": t["x"]}, {"y": t["y"]})
        with pytest.raises(SavedModelError, match=r"e is not empty"):
            saved_model.save(sess, tmp_path / "e", {"x": t["x"]}, {"y": t["y"]})
        for where in ("memory://models/a", "ftp://host/a", "file://host/a"):
            with pytest.raises(SavedModelError, match="is not a directory, an absolute file://"):
                saved_model.save(sess, where, {"x": t["x"]}, {"y": t["y"]})
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_a_model_trained_from_a_queue_exports_with_the_dequeued_tensor_as_its_input(tmp_path):
    """The queue feeding training is cut off where its tensor becomes the input."""
    graph = fm.Graph(seed=5)
    with graph.as_default():
        queue = fm.FIFOQueue(64, [fm.float32], shapes=[(8,)])
        fill = queue.enqueue_many([fm.placeholder(fm.float32, (None, 8), name="examples")])
        x = queue.dequeue_many(4)
        w = fm.Variable(fm.random_normal((8, 2)), name="w")
        y = fm.matmul(x, w)
        train = Adam(0.1).minimize(fm.reduce_mean(fm.square(y)))
        init = fm.global_variables_initializer()
    with fm.Session(graph) as sess:
        sess.run(init)
        sess.run(fill, {"examples:0": data(8)[0]})
        sess.run(train)
        with pytest.raises(SavedModelError, match=r"need node 'fifo_queue/FIFOQueueV2' "
                           r"\(FIFOQueueV2\), which reads input from a queue or iterator: "
                           r"make the tensor it yields an input"):
            saved_model.save(sess, tmp_path / "queue", {}, {"y": y})
        saved_model.save(sess, tmp_path / "export", {"x": x}, {"y": y})
        x4 = data(4)[0]
        want = sess.run(y, {x: x4})
    step = from_graph_def((tmp_path / "export" / "graph.pb").read_bytes())
    assert {n.type for n in step.nodes} == {"_Arg", "VarHandleOp", "ReadVariableOp", "MatMul"}
    model = saved_model.load(tmp_path / "export")
    assert model.signature["inputs"]["x"]["shape"] == [4, 8]
    np.testing.assert_array_equal(model(x=x4)["y"], want)


def test_a_file_uri_and_a_path_name_the_same_export(trained):
    path, x, want = trained
    np.testing.assert_array_equal(saved_model.load(path.as_uri())(x=x)["y"], want)


# ---- what load refuses


def damaged(path: Path, file: str, change) -> Path:
    target = path / file
    if change is None:
        target.unlink()
    else:
        target.write_bytes(change(target.read_bytes()))
    return path


def other_variables(values: dict) -> bytes:
    return save(values)


@pytest.mark.parametrize("file, change, message", [
    ("signature.json", None, r"signature.json is missing: .* is not a complete export"),
    ("signature.json", lambda b: b[:20], r"signature.json is not valid JSON"),
    ("signature.json", lambda b: b.replace(b'"version": 1', b'"version": 9'),
     r"signature.json: version 9; this reader knows 1"),
    ("signature.json", lambda b: b.replace(b'"float32"', b'"int32"', 1),
     r"graph.pb does not match the signature's input 'x' \(x:0, int32"),
    ("graph.pb", None, r"graph.pb is missing"),
    ("graph.pb", lambda b: b"\xff\xff\xff\xff not a graph", r"graph.pb: not a serialized GraphDef"),
    ("variables.safetensors", None, r"variables.safetensors is missing"),
    ("variables.safetensors", lambda b: b[: len(b) // 2],
     r"variables.safetensors is not a valid safetensors file"),
    ("variables.safetensors", lambda b: other_variables({
        "layer0/kernel": np.zeros((8, 16), np.float32),
        "layer0/bias": np.zeros(16, np.float32),
        "layer1/kernel": np.zeros((8, 3), np.float32),
        "layer1/bias": np.zeros(3, np.float32)}),
     r"variable 'layer1/kernel': .*variables.safetensors holds a float32 value of shape "
     r"\(8, 3\), the graph's variable is float32 of shape \(16, 3\)"),
    ("variables.safetensors", lambda b: other_variables({
        "layer0/kernel": np.zeros((8, 16), np.float32)}),
     r"variables.safetensors holds no variable 'layer0/bias', which the graph reads"),
    ("variables.safetensors", lambda b: other_variables({
        "layer0/kernel": np.zeros((8, 16), np.float32),
        "layer0/bias": np.zeros(16, np.float64),
        "layer1/kernel": np.zeros((16, 3), np.float32),
        "layer1/bias": np.zeros(3, np.float32)}),
     r"variable 'layer0/bias': .* holds a float64 value of shape \(16,\)"),
], ids=["no-signature", "signature-not-json", "signature-version", "signature-dtype",
        "no-graph", "graph-corrupt", "no-variables", "variables-truncated",
        "variable-wrong-shape", "variable-missing", "variable-wrong-dtype"])
def test_load_names_the_damaged_file_and_variable(trained, file, change, message):
    path = damaged(trained[0], file, change)
    with pytest.raises(SavedModelError, match=message):
        saved_model.load(path)


def test_load_refuses_a_variable_the_graph_does_not_read(trained):
    path = trained[0]
    values = load_file(path / "variables.safetensors") | {"Adam/m": np.zeros(2, np.float32)}
    (path / "variables.safetensors").write_bytes(other_variables(values))
    with pytest.raises(SavedModelError, match=r"holds 'Adam/m', which the graph does not read"):
        saved_model.load(path)


def test_load_of_a_directory_that_is_not_there_names_it(tmp_path):
    with pytest.raises(SavedModelError, match=r"nowhere/signature.json is missing"):
        saved_model.load(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()


# ---- from a distributed session: variables on two PS tasks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


def test_a_model_trained_on_two_ps_tasks_exports_for_one_process(cluster, tmp_path):
    graph, t = mlp(devices=("/job:ps/task:0", "/job:ps/task:1"))
    sess = cluster.session(graph, step_timeout=60)
    try:
        train(sess, t)
        x, _ = data()
        want = sess.run(t["y"], {t["x"]: x})
        saved_model.save(sess, tmp_path / "export", {"x": t["x"]}, {"y": t["y"]})
    finally:
        sess.close()
    step = from_graph_def((tmp_path / "export" / "graph.pb").read_bytes())
    assert {n.device for n in step.nodes} == {""}
    np.save(tmp_path / "x.npy", x)
    in_fresh_process(f"""
        import numpy as np
        from flowmill.runtime import saved_model
        np.save("y.npy", saved_model.load({str(tmp_path / "export")!r})(x=np.load("x.npy"))["y"])
    """, tmp_path)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), want)


# ---- an object store


S3_URI = os.environ.get("FLOWMILL_TEST_S3_URI")


@pytest.mark.skipif(not S3_URI, reason="FLOWMILL_TEST_S3_URI names no S3 location")
def test_an_export_to_s3_loads_back(trained, tmp_path):
    path, x, want = trained
    graph, t = mlp()
    with fm.Session(graph) as sess:
        train(sess, t)
        uri = f"{S3_URI.rstrip('/')}/{os.urandom(8).hex()}/export"
        saved_model.save(sess, uri, {"x": t["x"]}, {"y": t["y"]})
    np.testing.assert_array_equal(saved_model.load(uri)(x=x)["y"], want)


# ---- the digits example: trained as a distributed job, exported from its checkpoint


ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
JOB_TIMEOUT_S = 300
EPOCHS = "3"


def digits_job(uri: str) -> dict:
    """2 PS tasks hold the variables, 2 workers train in sync mode (no update after the
    last step, so the final checkpoint holds what the chief evaluated)."""
    worker = {"name": "flowmill", "image": "flowmill:test",
              "command": ["python", "examples/digits/train.py", "--epochs", EPOCHS]}
    return {
        "apiVersion": "flowmill.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "digits-export"},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 2},
                             "worker": {"replicas": 2, "template": {"spec": {
                                 "containers": [worker]}}}},
            "training": {"mode": "sync"},
            "checkpoint": {"uri": uri, "intervalSteps": 1000, "keep": 2},
        },
    }


@pytest.mark.slow
def test_the_digits_job_exports_from_its_checkpoint_and_predicts_its_accuracy(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")

    uri = (tmp_path / "ckpt").as_uri()
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(digits_job(uri)))
    job = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(tmp_path / "job.yaml"),
         "--local"], cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0, job.stderr[-4000:]
    printed = re.findall(r"^\[worker-0\] test_accuracy: (\d\.\d{4})$", job.stdout, re.M)
    assert len(printed) == 1, job.stdout[-2000:]

    # A fresh process builds the script's graph, restores the job's final checkpoint
    # (written by 2 PS tasks, restored into one process by variable name) and exports it.
    restored = json.loads(in_fresh_process(f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {str(DIGITS)!r})
        import train as digits
        import flowmill.runtime as fm
        from flowmill.runtime import saved_model
        from flowmill.runtime.saver import Saver

        args = digits.parse_args(["--epochs", {EPOCHS!r}])
        _, x_test, _, y_test = digits.load_data()
        graph = fm.Graph(seed=args.seed)
        with graph.as_default():
            features = fm.placeholder(fm.float32, (None, 64), name="features")
            labels = fm.placeholder(fm.int64, (None,), name="labels")
            model = digits.build_model(features, labels, tuple(args.hidden), args.seed)
            digits.build_train_op(model["loss"], args.learning_rate, 1, args.final_lr_fraction)
            classes = fm.argmax(model["logits"], axis=1)
        with fm.Session(graph) as sess:
            step = Saver(sess, {uri!r}).restore(sess)
            logits, accuracy = sess.run([model["logits"], model["accuracy"]],
                                        {{features: x_test, labels: y_test}})
            saved_model.save(sess, "export", {{"features": features}},
                             {{"logits": model["logits"], "classes": classes}})
        np.save("x_test.npy", x_test)
        np.save("y_test.npy", y_test)
        np.save("session_logits.npy", logits)
        print(json.dumps({{"step": step, "accuracy": float(accuracy)}}))
    """, tmp_path))
    assert restored["step"] > 0
    assert f"{restored['accuracy']:.4f}" == printed[0]

    # Another fresh process loads the export alone and predicts the test images.
    in_fresh_process("""
        import numpy as np
        from flowmill.runtime import saved_model
        out = saved_model.load("export")(features=np.load("x_test.npy"))
        np.save("logits.npy", out["logits"])
        np.save("classes.npy", out["classes"])
    """, tmp_path)
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"),
                                  np.load(tmp_path / "session_logits.npy"))
    accuracy = float(np.mean(np.load(tmp_path / "classes.npy") == np.load(tmp_path / "y_test.npy")))
    assert f"{accuracy:.4f}" == printed[0]
    variables = load_file(tmp_path / "export" / "variables.safetensors")
    assert sorted(variables) == [f"layer{i}/{v}" for i in range(3) for v in ("bias", "kernel")]
