"""Summaries and TensorBoard event files: what each summary op writes, read back with
TensorBoard's own readers (its event accumulator, its record reader), and a local job's
summaries and loss plot."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import uuid

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.debug import InvalidArgumentError
from flowmill.kernels.summary import BUCKET_LIMITS
from flowmill.launcher import plot

from opcheck import OpCase, case_tests

summary_pb2 = pytest.importorskip("tensorboard.compat.proto.summary_pb2")
ROOT = pathlib.Path(__file__).resolve().parents[1]
# An S3 location for the s3:// writer test (the e2e suite sets it, with the AWS_* variables).
S3_URI = os.environ.get("FLOWMILL_TEST_S3_URI")


def _serialized(*values) -> np.ndarray:
    return np.frombuffer(summary_pb2.Summary(value=list(values)).SerializeToString(), np.uint8)


def _scalar_value(tag, x):
    return summary_pb2.Summary.Value(tag=tag, simple_value=float(x))


CASES = [
    OpCase("scalar_summary", lambda x: fm.summary.scalar("s", x), [np.float32(1.5)],
           lambda x: _serialized(_scalar_value("s", x)), grad=False),
    OpCase("merge_summary",
           lambda x, y: fm.summary.merge([fm.summary.scalar("a", x), fm.summary.scalar("b", y)]),
           [np.float32(2.0), np.float32(-3.0)],
           lambda x, y: _serialized(_scalar_value("a", x), _scalar_value("b", y)), grad=False),
    OpCase("histogram_summary", lambda x: fm.summary.histogram("h", x),
           [np.array([0.0, 1.0, 1.0, -2.0], np.float32)],
           lambda x: np.frombuffer(_histogram_by_tensorflows_rule("h", x), np.uint8),
           grad=False),
    OpCase("image_summary", lambda x: fm.summary.image("i", x, max_outputs=1),
           [np.arange(12, dtype=np.uint8).reshape(1, 2, 2, 3)],
           lambda x: _serialized(summary_pb2.Summary.Value(tag="i/image", image=_png(x[0]))),
           grad=False),
    OpCase("text_summary", lambda x: fm.summary.text("t", x),
           [np.array([b"**bold**", b"plain"])],
           lambda x: _serialized(_text_value("t", x)), grad=False),
]

test_forward, _ = case_tests(CASES)


def _png(image: np.ndarray):
    from flowmill.kernels.summary import encode_png

    return summary_pb2.Summary.Image(height=image.shape[0], width=image.shape[1],
                                     colorspace=image.shape[2],
                                     encoded_image_string=encode_png(image))


def _text_value(tag, x):
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in x.shape])
    return summary_pb2.Summary.Value(
        tag=tag,
        metadata=summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")),
        tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=shape,
                                      string_val=list(x.ravel())))


def _histogram_by_tensorflows_rule(tag, values) -> bytes:
    """TensorFlow's ``Histogram::Add`` and ``EncodeToProto`` written out as loops: each
    value in the bucket ``upper_bound(limits, v)``; runs of empty buckets collapsed into
    their last one."""
    limits = list(BUCKET_LIMITS)
    counts = [0.0] * len(limits)
    for v in np.asarray(values, np.float64).ravel():
        counts[int(np.searchsorted(limits, v, side="right"))] += 1
    histo = summary_pb2.HistogramProto(
        min=float(np.min(values)), max=float(np.max(values)), num=float(np.size(values)),
        sum=float(np.sum(np.asarray(values, np.float64))),
        sum_squares=float(np.sum(np.asarray(values, np.float64) ** 2)))
    i = 0
    while i < len(counts):
        end, count, j = limits[i], counts[i], i + 1
        while count == 0 and j < len(counts) and counts[j] == 0:
            end, count, j = limits[j], counts[j], j + 1
        histo.bucket_limit.append(end)
        histo.bucket.append(count)
        i = j
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, histo=histo)]) \
        .SerializeToString()


def test_histogram_buckets_match_tensorflows_rule_on_wide_data():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(0, 1, 500), rng.normal(0, 1e-6, 50),
                             [0.0, 0.0, 1e15, -3e-13]]).astype(np.float32)
    g = fm.Graph()
    with g.as_default():
        h = fm.summary.histogram("wide", fm.constant(values))
    with fm.Session(g) as s:
        got = s.run(h).tobytes()
    assert got == _histogram_by_tensorflows_rule("wide", values)
    histo = summary_pb2.Summary.FromString(got).value[0].histo
    assert histo.num == values.size and sum(histo.bucket) == values.size


def test_bucket_index_is_tensorflows_upper_bound_at_and_around_every_limit():
    from flowmill.kernels.summary import bucket_index

    finite = BUCKET_LIMITS[1:-1]
    probes = np.concatenate([finite, np.nextafter(finite, np.inf), np.nextafter(finite, -np.inf),
                             [0.0, 5e-324, -5e-324, 1e-300, -1e-300, 1e30, -1e30,
                              np.finfo(np.float64).max, -np.finfo(np.float64).max]])
    want = np.minimum(np.searchsorted(BUCKET_LIMITS, probes, side="right"),
                      len(BUCKET_LIMITS) - 1)
    np.testing.assert_array_equal(bucket_index(probes), want)


def test_tags_follow_name_scopes_families_and_uniqueness():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, [], name="x")
        with fm.name_scope("train"):
            a = fm.summary.scalar("loss", x)
        b = fm.summary.scalar("loss", x)
        c = fm.summary.scalar("loss", x)
        d = fm.summary.scalar("rate", x, family="opt")
        merged = fm.summary.merge_all()
        assert fm.get_collection(fm.GraphKeys.SUMMARIES) == [a, b, c, d]
    with fm.Session(g) as s:
        value = s.run(merged, {x: 1.0})
    tags = [v.tag for v in fm.summary.Summary.FromString(value.tobytes()).value]
    assert tags == ["train/loss", "loss", "loss_1", "opt/rate"]


def test_merge_all_without_summaries_is_none_and_custom_collections_stay_apart():
    g = fm.Graph()
    with g.as_default():
        assert fm.summary.merge_all() is None
        fm.summary.scalar("eval_only", fm.constant(1.0), collections=["eval"])
        assert fm.summary.merge_all() is None
        assert fm.summary.merge_all("eval") is not None


def test_bad_summaries_fail_naming_the_tag():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, [None], name="x")
        scalar = fm.summary.scalar("not_scalar", x)
        hist = fm.summary.histogram("weights", x)
        image = fm.summary.image("pic", fm.reshape(x, [1, -1, 1, 2]))
        same = fm.summary.scalar("same", x[0], family="f")
        dup = fm.summary.merge([same, same])
        with pytest.raises(fm.GraphError, match="cannot summarize a bool"):
            fm.summary.histogram("flags", fm.constant(np.array([True])))
    with fm.Session(g) as s:
        with pytest.raises(InvalidArgumentError, match="'not_scalar' needs a scalar"):
            s.run(scalar, {x: [1.0, 2.0]})
        with pytest.raises(InvalidArgumentError, match="NaN in summary histogram for 'weights'"):
            s.run(hist, {x: [1.0, np.nan]})
        with pytest.raises(InvalidArgumentError, match=r"'pic' needs images shaped"):
            s.run(image, {x: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
        with pytest.raises(InvalidArgumentError, match="duplicate tag 'f/same'"):
            s.run(dup, {x: [1.0, 2.0]})
    with pytest.raises(ValueError, match="max_outputs"):
        fm.summary.image("pic", fm.zeros([1, 2, 2, 1]), max_outputs=0)


def test_float_images_are_scaled_as_tensorflow_1_scales_them():
    from PIL import Image

    images = np.array([[[[0.0], [0.5]], [[1.0], [0.25]]],      # >= 0: max -> 255
                       [[[-1.0], [0.0]], [[0.5], [1.0]]]], np.float32)  # else around 128
    g = fm.Graph()
    with g.as_default():
        out = fm.summary.image("pic", fm.constant(images), max_outputs=2)
    with fm.Session(g) as s:
        values = fm.summary.Summary.FromString(s.run(out).tobytes()).value
    assert [v.tag for v in values] == ["pic/image/0", "pic/image/1"]
    decoded = [np.asarray(Image.open(io.BytesIO(v.image.encoded_image_string)))
               for v in values]
    np.testing.assert_array_equal(decoded[0], [[0, 128], [255, 64]])
    np.testing.assert_array_equal(decoded[1], [[1, 128], [192, 255]])


def _train_with_summaries(logdir, steps=30, every=5):
    g = fm.Graph(seed=3)
    with g.as_default():
        x = fm.placeholder(fm.float32, [None, 3], name="x")
        y = fm.placeholder(fm.float32, [None], name="y")
        w = fm.Variable(np.zeros(3, np.float32), name="w")
        loss = fm.reduce_mean(fm.square(fm.reduce_sum(x * w, axis=1) - y))
        fm.summary.scalar("loss", loss)
        fm.summary.histogram("w", w.value())
        fm.summary.text("notes", fm.constant(np.array([b"linear regression"])))
        merged = fm.summary.merge_all()
        train = fm.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = fm.global_variables_initializer()
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(64, 3)).astype(np.float32)
    ys = xs @ np.array([1.0, -2.0, 0.5], np.float32)
    losses = {}
    with fm.Session(g) as s, fm.summary.FileWriter(logdir, g) as writer:
        s.run(init)
        for step in range(steps):
            if step % every == 0:
                value, summary, _ = s.run([loss, merged, train], {x: xs, y: ys})
                writer.add_summary(summary, step)
                losses[step] = float(value)
            else:
                s.run(train, {x: xs, y: ys})
    return losses


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_scalars_read_back_with_tensorboards_event_accumulator(tmp_path, as_uri):
    from tensorboard.backend.event_processing import event_accumulator

    logdir = tmp_path / "run"
    losses = _train_with_summaries(logdir.as_uri() if as_uri else str(logdir))
    files = list(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    series = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [step for step, _ in series] == sorted(losses)
    np.testing.assert_allclose([v for _, v in series], [losses[k] for k in sorted(losses)],
                               rtol=1e-6)
    assert series[-1][1] < series[0][1] / 10  # it trained
    # "w" names the variable already, so the summary's scope (and tag) is made unique,
    # as TensorFlow makes it.
    assert acc.Tags()["graph"] and acc.Tags()["histograms"] == ["w_1"]
    assert acc.Histograms("w_1")[0].histogram_value.num == 3
    graph = acc.Graph()
    assert {"w/VarHandleOp", "loss/ScalarSummary"} <= {n.name for n in graph.node}
    # The launcher's reader (TensorBoard's TensorFlow-free one) sees the same points.
    assert plot.read_scalars(str(logdir))["loss"] == [(s, v) for s, v in series]


def test_writer_rejects_what_is_not_a_summary_and_writes_nothing_after_close(tmp_path):
    writer = fm.summary.FileWriter(tmp_path)
    with pytest.raises(TypeError, match="add_summary takes a summary op's value"):
        writer.add_summary(np.zeros(3, np.float32), 1)
    writer.close()
    with pytest.raises(ValueError, match="is closed"):
        writer.add_summary(b"", 2)
    writer.reopen()
    writer.add_summary(summary_pb2.Summary(value=[_scalar_value("after", 2.0)]), 3)
    writer.close()
    assert plot.read_scalars(str(tmp_path)) == {"after": [(3, 2.0)]}


@pytest.mark.skipif(not S3_URI, reason="needs an S3 server (FLOWMILL_TEST_S3_URI; e2e runs it)")
def test_an_s3_logdir_gets_the_whole_file_on_flush_and_close(tmp_path):
    from flowmill.kernels.checkpoint_store import open_store

    uri = f"{S3_URI.rstrip('/')}/summaries-{uuid.uuid4().hex}"
    store, prefix = open_store(uri)
    writer = fm.summary.FileWriter(uri, flush_secs=3600)
    writer.add_summary(summary_pb2.Summary(value=[_scalar_value("loss", 1.0)]), 1)
    assert not list(store.list(prefix))  # not due yet: nothing uploaded
    writer.flush()
    writer.add_summary(summary_pb2.Summary(value=[_scalar_value("loss", 0.5)]), 2)
    writer.close()
    assert not os.path.exists(writer.path)  # the local staging file is gone
    objects = [m["path"] for batch in store.list(prefix) for m in batch]
    try:
        assert len(objects) == 1 and "/events.out.tfevents." in objects[0]
        (tmp_path / os.path.basename(objects[0])).write_bytes(
            bytes(store.get(objects[0]).bytes()))
        assert plot.read_scalars(str(tmp_path)) == {"loss": [(1, 1.0), (2, 0.5)]}
    finally:
        store.delete(objects)


def test_job_logdir_is_the_jobs_summary_directory(monkeypatch):
    monkeypatch.setenv("FLOWMILL_SUMMARY_URI", "s3://bucket/job/summaries")
    assert fm.summary.job_logdir("local") == "s3://bucket/job/summaries"
    monkeypatch.delenv("FLOWMILL_SUMMARY_URI")
    assert fm.summary.job_logdir("local") == "local"
    assert fm.summary.job_logdir() is None


@pytest.mark.slow
def test_the_digits_script_writes_summaries_and_a_run_plot(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    logdir = tmp_path / "digits"
    env = {k: v for k, v in os.environ.items() if k != "FLOWMILL_SUMMARY_URI"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits" / "train.py"), "--epochs", "2",
         "--logdir", str(logdir), "--summary-steps", "5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = plot.read_scalars(str(logdir))
    assert {"loss", "accuracy", "learning_rate", "test_accuracy"} <= set(scalars)
    assert [s for s, _ in scalars["loss"]] == list(range(0, 90, 5))
    accuracy = float(result.stdout.strip().splitlines()[-1].split()[-1])
    assert scalars["test_accuracy"][0][1] == pytest.approx(accuracy, abs=1e-4)
    png = plot.write_loss_plot(str(tmp_path / "loss.png"), plot.loss_curves(scalars), "t")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
