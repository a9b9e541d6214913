"""The job's checkpoints: shard ops, the sharded saver on PS tasks over gRPC, and the
policy a training task runs from its environment (restore on start, save by interval and
at the end) with no change to the model script."""

from __future__ import annotations

import itertools
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels import checkpoint_store as checkpoint
from flowmill.kernels.checkpoint import _overlap
from flowmill.kernels.checkpoint_store import CheckpointError, open_store
from flowmill.kernels.resources import UninitializedError
from flowmill.runtime.checkpoint_policy import CheckpointConfig
from flowmill.runtime.embedding import ShardedEmbedding, partitioned_table
from flowmill.runtime.job import steps_done
from flowmill.runtime.ops.checkpoint_ops import (
    commit_checkpoint,
    restore_shard,
    save_shard,
    shard_saved,
)
from flowmill.runtime.placement import replica_device_setter
from flowmill.runtime.saver import Saver, list_variables, shard_name
from flowmill.runtime.session_manager import initialize_or_wait

from local_cluster import LocalCluster
from opcheck import OpCase, case_tests


def _roundtrip(x):
    """Save ``x`` as a shard, wait for it, commit, read it back: one step, in order."""
    uri = "memory://ops-case"
    save = save_shard(uri, "s-0", 3, {"x": x})
    with fm.control_dependencies([save]):
        saved = shard_saved(uri, "s-0", 3)
    committed = commit_checkpoint(uri, 3, [saved], keep=1)
    with fm.control_dependencies([committed]):
        (back,) = restore_shard(uri, "s-0", 3, {"x": (x.dtype, x.shape)})
    return back


CASES = [
    OpCase("shard_roundtrip", _roundtrip, [np.arange(12.0).reshape(3, 4)], lambda x: x, grad=False),
]
test_forward, test_gradient = case_tests(CASES)


def test_shard_names():
    assert shard_name("/job:ps/task:1/device:CPU:0") == "ps-1"
    assert shard_name("/job:worker/task:0") == "worker-0"
    assert shard_name("/device:CPU:0") == "local"
    assert shard_name("") == "local"


def test_config_from_env():
    assert CheckpointConfig.from_env({}) is None
    c = CheckpointConfig.from_env({"FLOWMILL_CHECKPOINT_URI": "memory://x"})
    assert (c.uri, c.interval_steps, c.keep, c.on_corrupt) == ("memory://x", 100, 5, "Fail")
    env = {"FLOWMILL_CHECKPOINT_URI": "memory://x", "FLOWMILL_CHECKPOINT_ON_CORRUPT": "StartFresh"}
    assert CheckpointConfig.from_env(env).on_corrupt == "StartFresh"
    env["FLOWMILL_CHECKPOINT_ON_CORRUPT"] = "fresh"
    with pytest.raises(ValueError, match="ON_CORRUPT must be one of Fail, StartFresh, got 'fresh'"):
        CheckpointConfig.from_env(env)
    env = {"FLOWMILL_CHECKPOINT_URI": "file:///tmp/c", "FLOWMILL_CHECKPOINT_INTERVAL": "0"}
    with pytest.raises(ValueError, match="FLOWMILL_CHECKPOINT_INTERVAL"):
        CheckpointConfig.from_env(env)


def test_ops_refuse_bad_attrs():
    g = fm.Graph()
    with g.as_default():
        x = fm.constant(np.ones(2, np.float32))
        with pytest.raises(ValueError, match="unsupported scheme"):
            save_shard("ftp://host/dir", "ps-0", 1, {"x": x})
        with pytest.raises(Exception, match="shard name"):
            save_shard("memory://m", "../up", 1, {"x": x})
        with pytest.raises(Exception, match="integer scalar"):
            save_shard("memory://m", "ps-0", fm.constant(1.5), {"x": x})
        rows_1_3_5 = checkpoint.TensorSlice("t", (6,), 1, 2)
        with pytest.raises(Exception, match="slices names 'y', which is not one of attr names"):
            save_shard("memory://m", "ps-0", 1, {"x": x}, slices={"y": rows_1_3_5})
        with pytest.raises(Exception, match=r"'x' of shape \(2,\) is no slice of 't' \(3,\) at "
                           "offset 1, stride 2"):  # its second row would be row 3 of 3
            restore_shard("memory://m", "ps-0", 1, {"x": (fm.float32, (2,))},
                          slices={"x": checkpoint.TensorSlice("t", (3,), 1, 2)})
        save_shard("memory://m", "ps-0", 1, {"x": x}, slices={"x": rows_1_3_5})  # rows 1, 3


# ---- one process, as a model script runs alone


def _model(seed: int = 0):
    x = fm.placeholder(fm.float32, (None, 3), name="x")
    w = fm.Variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2), name="w")
    b = fm.Variable(np.zeros(2, np.float32), name="b")
    loss = fm.reduce_mean(fm.square(fm.matmul(x, w) + b - 1.0))
    step = fm.train.create_global_step()
    train = fm.train.Adam(0.05).minimize(loss, global_step=step)
    return x, [w, b], step, train, fm.global_variables_initializer()


def _data(k: int) -> np.ndarray:
    return np.random.default_rng(k).normal(size=(4, 3)).astype(np.float32)


def _train(env_uri: str, monkeypatch, steps: int, interval: int = 4):
    """Run the script's loop for ``steps`` global steps from wherever the job stands."""
    monkeypatch.setenv("FLOWMILL_CHECKPOINT_URI", env_uri)
    monkeypatch.setenv("FLOWMILL_CHECKPOINT_INTERVAL", str(interval))
    monkeypatch.setenv("FLOWMILL_CHECKPOINT_KEEP", "2")
    g = fm.Graph(seed=1)
    with g.as_default():
        x, variables, step, train, init = _model()
    with fm.Session(g) as sess:
        initialize_or_wait(sess, init)
        first = int(sess.run(step.value()))
        for k in range(steps_done(first), steps):
            sess.run(train, {x: _data(k)})
        values = sess.run([v.value() for v in variables])
        final = int(sess.run(step.value()))
    return first, final, values


def test_alone_the_script_saves_restores_and_resumes(tmp_path: Path, monkeypatch):
    uri = (tmp_path / "ckpt").as_uri()
    _, _, straight = _train((tmp_path / "straight").as_uri(), monkeypatch, 20)
    first, final, _ = _train(uri, monkeypatch, 9)
    assert (first, final) == (0, 9)
    store, prefix = open_store(uri)
    steps = [m.step for m in checkpoint.checkpoints(store, prefix)]
    assert steps[0] == 9 and len(steps) <= 2  # the final save, and keep=2
    manifest = checkpoint.latest(store, prefix)
    assert [s.name for s in manifest.shards] == ["local"]
    assert {t.name for t in manifest.shards[0].tensors} >= {"w", "b", "global_step"}
    first, final, resumed = _train(uri, monkeypatch, 20)
    assert (first, final) == (9, 20)
    for a, b in zip(resumed, straight, strict=True):
        np.testing.assert_array_equal(a, b)  # Adam's slots came back too


def test_a_corrupt_newest_checkpoint_falls_back(tmp_path: Path, monkeypatch):
    uri = (tmp_path / "ckpt").as_uri()
    _train(uri, monkeypatch, 10, interval=100)  # only the final save: step 10
    _train(uri, monkeypatch, 12, interval=100)  # resumes at 10, saves 12
    _flip_last_byte(tmp_path / "ckpt", 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, _, _ = _train(uri, monkeypatch, 12, interval=100)
    assert first == 10
    assert any("corrupt" in str(w.message) for w in caught)


def _flip_last_byte(root: Path, step: int, shard: str = "local") -> None:
    """Damage a committed shard in place: same size, so only its CRC32C tells."""
    (path,) = (root / f"ckpt-{step:012d}").glob(f"{shard}.*.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _committed_steps(uri: str) -> list[int]:
    return [m.step for m in checkpoint.checkpoints(*open_store(uri))]


def _quarantined_steps(uri: str) -> list[int]:
    return [int(d.rsplit("-", 1)[1]) for d, _ in checkpoint.quarantined(*open_store(uri))]


def test_every_checkpoint_corrupt_fails_the_job_naming_them(tmp_path: Path, monkeypatch):
    uri = (tmp_path / "ckpt").as_uri()
    _train(uri, monkeypatch, 4, interval=100)  # only the final save: step 4
    _train(uri, monkeypatch, 8, interval=100)  # resumes at 4, saves 8
    assert _committed_steps(uri) == [8, 4]
    for step in (4, 8):
        _flip_last_byte(tmp_path / "ckpt", step)
    for attempt in ("first start", "restart"):  # a restarted job does not forget them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
            with pytest.raises(checkpoint.NoUsableCheckpointError) as caught:
                _train(uri, monkeypatch, 12)
        text = str(caught.value)
        assert "ckpt-000000000008" in text and "ckpt-000000000004" in text, attempt
        assert text.count("CRC32C") == 2 and "onCorrupt: StartFresh" in text, attempt
    assert _quarantined_steps(uri) == [8, 4] and _committed_steps(uri) == []


def test_every_checkpoint_corrupt_starts_fresh_when_the_spec_says_so(
    tmp_path: Path, monkeypatch
):
    uri = (tmp_path / "ckpt").as_uri()
    _train(uri, monkeypatch, 4, interval=100)  # only the final save: step 4
    _flip_last_byte(tmp_path / "ckpt", 4)
    monkeypatch.setenv("FLOWMILL_CHECKPOINT_ON_CORRUPT", "StartFresh")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, final, _ = _train(uri, monkeypatch, 6, interval=100)
    assert (first, final) == (0, 6)
    messages = [str(w.message) for w in caught]
    assert any("ckpt-000000000004" in m and "starting fresh" in m for m in messages)
    assert _committed_steps(uri) == [6]


def test_keep_1_with_a_corrupt_newest_restores_the_newest_good_one(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    graph, train, init = _adam_model()
    with fm.Session(graph) as sess:
        sess.run(init)
        saver = Saver(sess, uri, keep=5)
        for step in (10, 20, 30):
            sess.run(train)
            saver.save(sess, step)
            if step == 20:
                good = _values(sess)
    _flip_last_byte(tmp_path / "ckpt", 30)
    with fm.Session(graph) as sess:
        saver = Saver(sess, uri, keep=1)
        with pytest.warns(checkpoint.CheckpointWarning, match="000000000030.*CRC32C"):
            assert saver.restore(sess) == 20
        for name, value in _values(sess).items():
            np.testing.assert_array_equal(value, good[name], err_msg=name)
        assert _quarantined_steps(uri) == [30]
        saver.save(sess, 25)
        assert _committed_steps(uri) == [25, 20]  # 20 was restored from: never pruned
        assert saver.save(sess, 30) == 30  # the quarantined step is free again
        assert _committed_steps(uri) == [30, 20] and _quarantined_steps(uri) == []
    with fm.Session(graph) as fresh:
        assert Saver(fresh, uri).restore(fresh) == 30


def _two_writers(uri: str) -> tuple[list, list[Saver]]:
    """Two sessions (as two jobs on one URI) whose variable ``w`` holds 1s and 2s."""
    sessions, savers = [], []
    for fill in (1.0, 2.0):
        graph = fm.Graph()
        with graph.as_default():
            fm.Variable(np.full((64, 8), fill, np.float32), name="w")
            init = fm.global_variables_initializer()
        sess = fm.Session(graph)
        sess.run(init)
        sessions.append(sess)
        savers.append(Saver(sess, uri, keep=2))
    return sessions, savers


def test_a_second_writer_of_a_committed_step_is_refused(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    (first, second), (saver, late) = _two_writers(uri)
    try:
        assert saver.save(first, 3) == 3
        with pytest.raises(checkpoint.CheckpointExistsError, match=f"step 3 to {uri}: .*refus"):
            late.save(second, 3)
    finally:
        first.close()
        second.close()
    assert _committed_steps(uri) == [3]


def test_two_savers_of_one_step_exactly_one_wins(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    sessions, savers = _two_writers(uri)
    try:
        for step in range(1, 21):
            results = _race(savers, sessions, step)
            won = [i for i, r in enumerate(results) if r == step]
            lost = [r for r in results if isinstance(r, checkpoint.CheckpointExistsError)]
            assert len(won) == 1 and len(lost) == 1, results
            assert f"step {step} to {uri}" in str(lost[0]), lost[0]
            with fm.Session(sessions[won[0]].graph) as reader:
                assert Saver(reader, uri).restore(reader) == step
                (w,) = fm.global_variables(reader.graph)
                np.testing.assert_array_equal(reader.run(w.value()), np.full((64, 8), won[0] + 1.0))
    finally:
        for sess in sessions:
            sess.close()


def _race(savers, sessions, step: int) -> list:
    """Both savers save ``step`` at once; each one's step, or the error it got."""
    barrier = threading.Barrier(len(savers), timeout=30)
    results: list = [None] * len(savers)

    def save(i: int) -> None:
        barrier.wait()
        try:
            results[i] = savers[i].save(sessions[i], step)
        except checkpoint.CheckpointExistsError as e:
            results[i] = e

    threads = [threading.Thread(target=save, args=(i,)) for i in range(len(savers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), f"a save of step {step} hung"
    return results


def test_a_checkpoint_of_another_model_is_refused_naming_what_it_lacks(
    tmp_path: Path, monkeypatch
):
    uri = (tmp_path / "ckpt").as_uri()
    store, prefix = open_store(uri)
    info = checkpoint.write_shard(store, prefix, 5, "ps-0", {"v": np.zeros((3, 2), np.float32)})
    checkpoint.commit(store, prefix, 5, [info])
    with pytest.raises(CheckpointError, match=r"holds no variable 'w'.*it holds v\)"):
        _train(uri, monkeypatch, 6)


# ---- the Saver in one process


def _adam_model(shape=(3, 2)):
    graph = fm.Graph()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, shape[0])).astype(np.float32)
    y = rng.standard_normal((16, shape[1])).astype(np.float32)
    with graph.as_default():
        w = fm.Variable(np.ones(shape, np.float32), name="w")
        b = fm.Variable(np.zeros(shape[1], np.float32), name="b")
        loss = fm.reduce_mean(fm.square(fm.matmul(fm.constant(x), w) + b - fm.constant(y)))
        step = fm.train.create_global_step()
        train = fm.train.Adam(0.05).minimize(loss, global_step=step)
        init = fm.global_variables_initializer()
    return graph, train, init


def _values(sess):
    return {v.name: sess.run(v.value()) for v in fm.global_variables(sess.graph)}


def test_saver_round_trip(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    graph, train, init = _adam_model()
    with fm.Session(graph) as sess:
        saver = Saver(sess, uri, keep=2, metadata={"job": "j"})
        assert saver.restore(sess) is None
        sess.run(init)
        for step in range(1, 4):
            sess.run(train)
            assert saver.save(sess, step) == step
        saved = _values(sess)
        assert any("Adam" in name for name in saved)  # optimizer slots too
        assert saved["global_step"] == 3
        for _ in range(3):
            sess.run(train)
        assert not np.array_equal(_values(sess)["w"], saved["w"])
        assert saver.restore(sess) == 3
        for name, value in _values(sess).items():
            np.testing.assert_array_equal(value, saved[name], err_msg=name)
        sess.run(train)  # restored buffers are writable, private copies
    store, prefix = open_store(uri)
    assert [m.step for m in checkpoint.checkpoints(store, prefix)] == [3, 2]
    assert checkpoint.latest(store, prefix).metadata["job"] == "j"
    with fm.Session(graph) as fresh:  # no initializer run: restoring creates the state
        assert Saver(fresh, uri).restore(fresh) == 3
        for name, value in _values(fresh).items():
            np.testing.assert_array_equal(value, saved[name], err_msg=name)


def test_a_local_variable_is_initialized_never_saved(tmp_path: Path):
    """A task's own state (``LOCAL_VARIABLES``, a sync worker's local step) is left out of
    the checkpoint even when it is a global variable too, and is set by its initializer."""
    uri = (tmp_path / "ckpt").as_uri()
    g = fm.Graph()
    with g.as_default():
        fm.Variable(np.arange(3, dtype=np.float32), name="w")
        own = fm.Variable(0, name="own", dtype=fm.int64,
                          collections=[fm.GraphKeys.GLOBAL_VARIABLES,
                                       fm.GraphKeys.LOCAL_VARIABLES])
        bump = own.assign_add(5)
        init = fm.global_variables_initializer()
    assert fm.local_variables(g) == [own]
    with fm.Session(g) as sess:
        saver = Saver(sess, uri)
        assert saver.local == [own] and own not in saver.variables
        sess.run(init)
        sess.run(bump)
        saver.save(sess, 1)
    assert list_variables(uri) == [("w", (3,))]


def test_saver_var_list(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    graph, train, init = _adam_model()
    w = next(v for v in fm.global_variables(graph) if v.name == "w")
    with fm.Session(graph) as sess:
        sess.run(init)
        saver = Saver(sess, uri, var_list=[w])
        saver.save(sess, 1)
        store, prefix = open_store(uri)
        manifest = checkpoint.latest(store, prefix)
        assert [t.name for t in manifest.shards[0].tensors] == ["w"]
        sess.run(train)
        assert saver.restore(sess) == 1
        np.testing.assert_array_equal(sess.run(w.value()), np.ones((3, 2), np.float32))


def test_saver_shape_mismatch_names_variable_and_shapes(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    graph, _, init = _adam_model((3, 2))
    with fm.Session(graph) as sess:
        sess.run(init)
        Saver(sess, uri).save(sess, 1)
    other, _, init = _adam_model((2, 3))
    with fm.Session(other) as sess:
        sess.run(init)
        before = _values(sess)
        with pytest.raises(CheckpointError, match=r"'w' is \(2, 3\) float32.*holds \(3, 2\)"):
            Saver(sess, uri).restore(sess)
        for name, value in _values(sess).items():  # nothing was assigned
            np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_saver_refuses_uninitialized_and_bad_uris(tmp_path: Path):
    graph, _, _ = _adam_model()
    with fm.Session(graph) as sess:
        saver = Saver(sess, (tmp_path / "ckpt").as_uri())
        with pytest.raises(UninitializedError, match="'w'.*before it is initialized"):
            saver.save(sess, 1)
        with pytest.raises(ValueError, match="unsupported scheme 'ftp'"):
            Saver(sess, "ftp://host/dir")
    store, prefix = open_store((tmp_path / "ckpt").as_uri())
    assert checkpoint.latest(store, prefix) is None  # nothing half-written counts


def test_a_failed_upload_is_reported_and_commits_nothing(tmp_path: Path):
    import shutil

    where = tmp_path / "ckpt"
    graph, _, init = _adam_model()
    with fm.Session(graph) as sess:
        sess.run(init)
        saver = Saver(sess, where.as_uri())
        saver.save(sess, 1)
        shutil.rmtree(where)
        where.write_text("a file where the checkpoint directory was")
        saver.snapshot(sess, 2)  # the values are taken; the upload fails behind it
        with pytest.raises(Exception, match="Not a directory"):
            saver.commit_step(sess, 2)
    where.unlink()
    store, prefix = open_store(where.as_uri())
    assert checkpoint.latest(store, prefix) is None


# ---- shards on PS tasks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


def test_each_ps_writes_and_reads_its_own_shard(cluster, tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            a = fm.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="a")
        with fm.device("/job:ps/task:1"):
            b = fm.Variable(np.arange(4, dtype=np.int64), name="b")
        init = fm.global_variables_initializer()
        change = [a.assign_add(np.ones((2, 3), np.float32)), b.assign(np.zeros(4, np.int64))]
    sess = cluster.session(g, step_timeout=60)
    try:
        sess.run(init)
        saver = Saver(sess, uri, keep=3)
        assert sorted(saver.shards) == ["ps-0", "ps-1"]
        saver.snapshot(sess, 7)
        sess.run(change)
        assert saver.commit_step(sess, 7) == 7  # the upload holds the values as read
        store, prefix = open_store(uri)
        manifest = checkpoint.latest(store, prefix)
        assert manifest.step == 7 and [s.name for s in manifest.shards] == ["ps-0", "ps-1"]
        assert saver.restore(sess) == 7
        va, vb = sess.run([a.value(), b.value()])
        np.testing.assert_array_equal(va, np.arange(6, dtype=np.float32).reshape(2, 3))
        np.testing.assert_array_equal(vb, np.arange(4))
    finally:
        sess.close()


def _two_variables(layout: dict[str, str]):
    """Variables ``a`` and ``b``, each on the device ``layout`` names ("" for none)."""
    g = fm.Graph()
    with g.as_default():
        with fm.device(layout["a"]):
            a = fm.Variable(np.zeros((2, 3), np.float32), name="a")
        with fm.device(layout["b"]):
            b = fm.Variable(np.zeros(4, np.int64), name="b")
        init = fm.global_variables_initializer()
        set_values = [a.assign(np.arange(6, dtype=np.float32).reshape(2, 3)),
                      b.assign(np.arange(4, dtype=np.int64) * 7)]
    return g, a, b, init, set_values


def _session(cluster, g, distributed: bool):
    return cluster.session(g, step_timeout=60) if distributed else fm.Session(g)


PS0, PS1 = "/job:ps/task:0", "/job:ps/task:1"


@pytest.mark.parametrize("written, read", [
    ({"a": PS0, "b": PS1}, {"a": "", "b": ""}),
    ({"a": "", "b": ""}, {"a": PS0, "b": PS1}),
    ({"a": PS0, "b": PS1}, {"a": PS1, "b": PS1}),
], ids=["two-ps-into-one-process", "one-process-into-two-ps", "two-ps-into-one-ps"])
def test_a_checkpoint_restores_into_another_layout_by_name(cluster, tmp_path, written, read):
    uri = (tmp_path / "ckpt").as_uri()
    g, a, b, init, set_values = _two_variables(written)
    sess = _session(cluster, g, bool(written["a"]))
    try:
        sess.run(init)
        sess.run(set_values)
        Saver(sess, uri).save(sess, 3)
    finally:
        sess.close()
    g, a, b, init, _ = _two_variables(read)
    sess = _session(cluster, g, bool(read["a"]))
    try:
        sess.run(init)
        saver = Saver(sess, uri)
        assert saver.restore(sess) == 3
        va, vb = sess.run([a.value(), b.value()])
    finally:
        sess.close()
    np.testing.assert_array_equal(va, np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(vb, np.arange(4) * 7)
    # Read without a graph, whichever shard holds each (TensorFlow's names).
    assert fm.train.list_variables(uri) == [("a", (2, 3)), ("b", (4,))]
    np.testing.assert_array_equal(fm.train.load_variable(uri, "b"), np.arange(4) * 7)
    with pytest.raises(CheckpointError, match="holds no variable 'c'"):
        fm.train.load_variable(uri, "c")


def test_a_shard_a_ps_finds_corrupt_is_quarantined(cluster, tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    g = fm.Graph()
    with g.as_default():
        with fm.device("/job:ps/task:0"):
            a = fm.Variable(np.zeros(3, np.float32), name="qa")
        with fm.device("/job:ps/task:1"):
            b = fm.Variable(np.zeros(2, np.int64), name="qb")
        init = fm.global_variables_initializer()
        bump = [a.assign_add(np.ones(3, np.float32)), b.assign_add(np.ones(2, np.int64))]
    sess = cluster.session(g, step_timeout=60)
    try:
        sess.run(init)
        saver = Saver(sess, uri, keep=2)
        sess.run(bump)
        saver.save(sess, 7)
        sess.run(bump)
        saver.save(sess, 8)
        _flip_last_byte(tmp_path / "ckpt", 8, shard="ps-1")
        with pytest.warns(checkpoint.CheckpointWarning, match="000000000008.*CRC32C"):
            assert saver.restore(sess) == 7  # ps-1 found it, over gRPC
        va, vb = sess.run([a.value(), b.value()])
        np.testing.assert_array_equal(va, np.ones(3, np.float32))
        np.testing.assert_array_equal(vb, np.ones(2, np.int64))
        assert _quarantined_steps(uri) == [8] and _committed_steps(uri) == [7]
        assert saver.save(sess, 8) == 8
        assert _committed_steps(uri) == [8, 7]
    finally:
        sess.close()


# ---- a sharded table between splits (TensorFlow's partitioned variables)

VOCAB, DIM = 11, 4
IDS_SEEN = np.array([1, 3, 3, 8, 10, 0, 5], np.int32)


def _table_model(split, vocab: int = VOCAB, dim: int = DIM, device_fn=None, name: str = "emb"):
    """An embedding table ``name`` trained with Adagrad: ``split`` shards of a
    ``ShardedEmbedding``, or ``"whole"``, one variable named ``name``. Returns the graph,
    the ids placeholder, the looked-up rows, the train op, the table's variables and
    their Adagrad accumulators, in shard order."""
    graph = fm.Graph()
    with graph.as_default(), fm.device(device_fn):
        ids = fm.placeholder(fm.int32, (None,), name="ids")
        if split == "whole":
            w = fm.Variable(np.zeros((vocab, dim), np.float32), name=name)
            shards, rows = [w], fm.nn.embedding_lookup(w, ids)
        else:
            emb = ShardedEmbedding(vocab, dim, split, fm.initializers.zeros(), name=name)
            shards, rows = emb.shards, emb.lookup(ids)
        weights = fm.constant(np.linspace(-1, 1, dim, dtype=np.float32))
        loss = fm.reduce_sum(fm.square(rows - weights))
        opt = fm.train.Adagrad(0.3)
        train = opt.minimize(loss)
        accumulators = [opt.get_slot(s, "accumulator") for s in shards]
        fill = np.arange(vocab * dim, dtype=np.float32).reshape(vocab, dim) / 10.0
        n = len(shards)
        load = fm.group(*[s.assign(fill[p::n]) for p, s in enumerate(shards)])
        init = fm.global_variables_initializer()
    return graph, ids, rows, train, shards, accumulators, load, init


def _rows_of(parts: list[np.ndarray]) -> np.ndarray:
    """The full table from its mod shards (shard p holds rows p, p + n, ...)."""
    n = len(parts)
    full = np.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].dtype)
    for p, part in enumerate(parts):
        full[p::n] = part
    return full


@pytest.fixture(scope="module")
def two_shard_checkpoint(cluster, tmp_path_factory):
    """A checkpoint of ``emb`` in 2 shards on 2 PS tasks after a few Adagrad steps, with
    the table and accumulators it holds (and the step after it, for comparing)."""
    uri = tmp_path_factory.mktemp("two-shards").as_uri()
    setter = replica_device_setter(cluster.spec, worker_device="/job:worker/task:0")
    graph, ids, rows, train, shards, accs, load, init = _table_model(2, device_fn=setter)
    assert [s.device for s in shards] == ["/job:ps/task:0", "/job:ps/task:1"]
    sess = cluster.session(graph, step_timeout=60)
    try:
        sess.run(init)
        sess.run(load)
        for k in range(3):
            sess.run(train, {ids: IDS_SEEN[k:]})
        saver = Saver(sess, uri)
        assert sorted(saver.shards) == ["ps-0", "ps-1"]
        saver.save(sess, 5)
        table = _rows_of(sess.run([s.value() for s in shards]))
        accumulators = _rows_of(sess.run([a.value() for a in accs]))
        sess.run(train, {ids: IDS_SEEN})
        after = _rows_of(sess.run([s.value() for s in shards]))
    finally:
        sess.close()
    assert not np.all(accumulators == accumulators.flat[0])  # the steps left their mark
    return uri, table, accumulators, after


@pytest.mark.parametrize("split", [3, 1, "whole"])
def test_a_sharded_table_restores_into_another_split(two_shard_checkpoint, split):
    uri, table, accumulators, after = two_shard_checkpoint
    graph, ids, rows, train, shards, accs, _, _ = _table_model(split)
    with fm.Session(graph) as sess:
        assert Saver(sess, uri).restore(sess) == 5
        np.testing.assert_array_equal(sess.run(rows, {ids: np.arange(VOCAB)}), table)
        n = len(shards)
        for p, (shard, acc) in enumerate(zip(shards, accs, strict=True)):
            value, accumulator = sess.run([shard.value(), acc.value()])
            np.testing.assert_array_equal(value, table[p::n], err_msg=shard.name)
            np.testing.assert_array_equal(accumulator, accumulators[p::n], err_msg=acc.name)
        # The accumulators moved with their rows: the next step is the one the 2-shard job took.
        sess.run(train, {ids: IDS_SEEN})
        np.testing.assert_allclose(sess.run(rows, {ids: np.arange(VOCAB)}), after, rtol=1e-6)


def test_a_table_lists_whole_and_loads_whole(two_shard_checkpoint):
    uri, table, accumulators, _ = two_shard_checkpoint
    assert fm.train.list_variables(uri) == [("emb", (VOCAB, DIM)), ("emb/Adagrad", (VOCAB, DIM))]
    assert fm.train.list_variables(uri, slices=True) == [
        ("emb/shard_0", (6, DIM)),
        ("emb/shard_0/Adagrad", (6, DIM)),
        ("emb/shard_1", (5, DIM)),
        ("emb/shard_1/Adagrad", (5, DIM)),
    ]
    np.testing.assert_array_equal(fm.train.load_variable(uri, "emb"), table)
    np.testing.assert_array_equal(fm.train.load_variable(uri, "emb/Adagrad"), accumulators)
    np.testing.assert_array_equal(fm.train.load_variable(uri, "emb/shard_1"), table[1::2])
    store, prefix = open_store(uri)
    held = {t.name: t.slice for s in checkpoint.latest(store, prefix).shards for t in s.tensors}
    assert held["emb/shard_1"] == checkpoint.TensorSlice("emb", (VOCAB, DIM), 1, 2)
    assert held["emb/shard_0/Adagrad"] == checkpoint.TensorSlice("emb/Adagrad", (VOCAB, DIM), 0, 2)


@pytest.mark.parametrize("split", [2, 3])
def test_a_whole_table_restores_into_shards_on_ps_tasks(cluster, tmp_path, split):
    """The other way, and the rows are put together on the PS tasks that hold the shards
    (a table of its own name: the PS tasks keep the other tests' variables)."""
    uri = (tmp_path / "ckpt").as_uri()
    name = f"whole_into_{split}"
    graph, ids, rows, train, shards, accs, load, init = _table_model("whole", name=name)
    with fm.Session(graph) as sess:
        sess.run(init)
        sess.run(load)
        sess.run(train, {ids: IDS_SEEN})
        table, accumulator = sess.run([shards[0].value(), accs[0].value()])
        Saver(sess, uri).save(sess, 2)
    setter = replica_device_setter(cluster.spec, worker_device="/job:worker/task:0")
    graph, ids, rows, _, shards, accs, _, _ = _table_model(split, device_fn=setter, name=name)
    sess = cluster.session(graph, step_timeout=60)
    try:
        saver = Saver(sess, uri)
        assert sorted(saver.shards) == ["ps-0", "ps-1"]
        assert saver.restore(sess) == 2
        np.testing.assert_array_equal(sess.run(rows, {ids: np.arange(VOCAB)}), table)
        for p, acc in enumerate(accs):
            np.testing.assert_array_equal(sess.run(acc.value()), accumulator[p::split])
    finally:
        sess.close()


def test_a_table_of_another_shape_is_refused_naming_both_shapes(two_shard_checkpoint):
    uri = two_shard_checkpoint[0]
    for vocab, dim, split in [(VOCAB + 1, DIM, 3), (VOCAB, DIM + 1, 2), (VOCAB + 1, DIM, "whole")]:
        graph, *_ = _table_model(split, vocab, dim)
        with fm.Session(graph) as sess:
            with pytest.raises(CheckpointError) as caught:
                Saver(sess, uri).restore(sess)
        text = str(caught.value)
        wanted = f"({vocab}, {dim}) float32"
        if split != "whole":
            wanted = f"'emb/shard_0' is rows 0::{split} of 'emb', {wanted}"
        assert wanted in text, text
        assert f"holds 'emb' as ({VOCAB}, {DIM}) float32 (2 slices, in shards ps-0, ps-1)" in text


def test_a_table_a_checkpoint_lacks_or_holds_in_part_is_refused(tmp_path: Path):
    uri = (tmp_path / "ckpt").as_uri()
    graph, _, _, _, shards, _, _, init = _table_model(2)
    with fm.Session(graph) as sess:
        sess.run(init)
        Saver(sess, uri, var_list=[shards[0]]).save(sess, 1)  # only half the table
    graph, *_ = _table_model(3)
    with fm.Session(graph) as sess:
        with pytest.raises(CheckpointError, match=r"holds 6 rows of the 11-row table 'emb' \(1 "
                           r"slice, in shard local\): .*not hold the whole table"):
            Saver(sess, uri).restore(sess)
    other = (tmp_path / "other").as_uri()
    store, prefix = open_store(other)
    info = checkpoint.write_shard(store, prefix, 5, "ps-0", {"v": np.zeros((3, 2), np.float32)})
    checkpoint.commit(store, prefix, 5, [info])
    with fm.Session(graph) as sess:
        with pytest.raises(CheckpointError, match=r"holds no variable 'emb', 'emb/Adagrad' "
                           r"\(it holds v\)"):
            Saver(sess, other).restore(sess)


def test_a_checkpoint_without_slices_restores_by_name_as_before(tmp_path: Path):
    """Shards saved before slices were recorded: the same split restores by name; another
    split finds a shard of the wrong shape, and says so."""
    uri = (tmp_path / "ckpt").as_uri()
    table = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM)
    store, prefix = open_store(uri)
    tensors = {"emb/shard_0": table[0::2], "emb/shard_1": table[1::2],
               "emb/shard_0/Adagrad": table[0::2] + 1, "emb/shard_1/Adagrad": table[1::2] + 1}
    checkpoint.commit(store, prefix, 4, [checkpoint.write_shard(store, prefix, 4, "ps-0", tensors)])
    graph, ids, rows, _, _, accs, _, _ = _table_model(2)
    with fm.Session(graph) as sess:
        assert Saver(sess, uri).restore(sess) == 4
        np.testing.assert_array_equal(sess.run(rows, {ids: np.arange(VOCAB)}), table)
        np.testing.assert_array_equal(sess.run(accs[1].value()), table[1::2] + 1)
    graph, *_ = _table_model(3)
    with fm.Session(graph) as sess:
        with pytest.raises(CheckpointError, match=r"'emb/shard_0' is \(4, 4\) float32.*holds "
                           r"\(6, 4\)"):
            Saver(sess, uri).restore(sess)


def test_hand_made_div_shards_restore_into_a_mod_split(tmp_path: Path):
    """Shards of consecutive rows (``div``) and shards of every n-th row (``mod``) are the
    same table to a checkpoint."""
    uri = (tmp_path / "ckpt").as_uri()
    table = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM)
    graph = fm.Graph()
    with graph.as_default():
        with fm.name_scope("emb"):
            parts = [fm.Variable(table[a:b], name=f"part_{p}")
                     for p, (a, b) in enumerate([(0, 4), (4, 8), (8, 11)])]
        partitioned_table(parts, "emb", "div")
        ids = fm.placeholder(fm.int32, (None,))
        rows = fm.nn.embedding_lookup(parts, ids, partition_strategy="div")
        init = fm.global_variables_initializer()
    with fm.Session(graph) as sess:
        sess.run(init)
        np.testing.assert_array_equal(sess.run(rows, {ids: np.arange(VOCAB)}), table)
        Saver(sess, uri).save(sess, 1)
    graph, ids, rows, _, shards, *_ = _table_model(2)
    with fm.Session(graph) as sess:
        Saver(sess, uri, var_list=shards).restore(sess)  # the table: it was saved without slots
        np.testing.assert_array_equal(sess.run(rows, {ids: np.arange(VOCAB)}), table)


def test_a_variable_named_as_a_table_is_refused():
    graph, *_ = _table_model(2)
    with graph.as_default():
        fm.Variable(np.zeros(3, np.float32), name="emb/Adagrad")
    with fm.Session(graph) as sess:
        with pytest.raises(CheckpointError, match="'emb/Adagrad' has the name of a table"):
            Saver(sess, "memory://clash")


def test_row_overlaps_of_two_strided_slices():
    """Which rows two slices (first row, stride, count) share, as the slices of each that
    hold them: every small case against counting them out."""
    for a in itertools.product(range(4), range(1, 5), range(6)):
        for b in itertools.product(range(4), range(1, 5), range(6)):
            rows_a = {a[0] + a[1] * i: i for i in range(a[2])}
            rows_b = {b[0] + b[1] * j: j for j in range(b[2])}
            common = sorted(rows_a.keys() & rows_b.keys())
            found = _overlap(a, b)
            if not common:
                assert found is None, (a, b, found)
                continue
            index = list(range(64))
            assert index[found[0]] == [rows_a[r] for r in common], (a, b)
            assert index[found[1]] == [rows_b[r] for r in common], (a, b)
