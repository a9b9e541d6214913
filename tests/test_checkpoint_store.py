"""Checkpoints against real obstore stores: a local directory, memory, and S3 when given."""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
import warnings

import numpy as np
import pytest
import safetensors.numpy

from flowmill.kernels import checkpoint_store as C

# An S3 location to run the same tests against, e.g. s3://bucket/tests with the AWS_*
# variables (AWS_ENDPOINT_URL, AWS_ALLOW_HTTP, keys) describing the server.
S3_URI = os.environ.get("FLOWMILL_TEST_S3_URI")


@pytest.fixture(params=["file", "memory"] + (["s3"] if S3_URI else []))
def where(request, tmp_path):
    if request.param == "file":
        yield C.open_store(f"file://{tmp_path}/ckpts")
        return
    if request.param == "memory":
        yield C.open_store("memory://runs/job-1")
        return
    store, prefix = C.open_store(S3_URI)
    prefix = f"{prefix}/{uuid.uuid4().hex}".lstrip("/")
    yield store, prefix
    leftovers = [m["path"] for batch in store.list(prefix) for m in batch]
    if leftovers:
        store.delete(leftovers)


class Wrapped:
    """A store that forwards to a real one, with hooks to observe or stall calls."""

    def __init__(self, inner, before_put=None):
        self.inner = inner
        self.before_put = before_put
        self.puts: list[str] = []
        self.gets: list[str] = []
        self.deletes: list = []

    def put(self, path, file, **kw):
        if self.before_put is not None:
            self.before_put(path)
        self.puts.append(path)
        return self.inner.put(path, file, **kw)

    def get(self, path, **kw):
        self.gets.append(path)
        return self.inner.get(path, **kw)

    def head(self, path):
        return self.inner.head(path)

    def list(self, prefix=None, **kw):
        return self.inner.list(prefix, **kw)

    def delete(self, paths):
        self.deletes.append(paths)
        return self.inner.delete(paths)


def save(store, prefix, step, tensors, shard="shard-0", **kw):
    info = C.write_shard(store, prefix, step, shard, tensors, **kw)
    return C.commit(store, prefix, step, [info], {"job": "test"})


def flip_byte(store, path, index):
    data = bytearray(bytes(store.get(path).bytes()))
    data[index] ^= 0x40
    store.put(path, bytes(data))


def truncate(store, path, drop):
    data = bytes(store.get(path).bytes())
    store.put(path, data[:-drop])


def weights(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.full(3, seed, np.int64)}


# ---- round trip


def many_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for dtype in ["float64", "float32", "float16", "int64", "uint64", "int32", "uint32",
                  "int16", "uint16", "int8", "uint8", "bool", "complex64"]:  # fmt: skip
        for shape in [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4)]:
            values = rng.standard_normal(shape) * 100
            if dtype == "complex64":
                values = values + 1j * rng.standard_normal(shape)
            out[f"{dtype}/{len(shape)}d/{'x'.join(map(str, shape))}"] = values.astype(dtype)
    base = rng.standard_normal((6, 8))
    out["strided"] = base[::2, ::3]
    out["transposed"] = base.T
    out["fortran"] = np.asfortranarray(base.astype(np.float32))
    out["big_endian_i4"] = np.arange(10, dtype=">i4")
    out["big_endian_f8"] = base.astype(">f8")
    return out


def test_round_trip_many_dtypes_and_shapes(where):
    store, prefix = where
    tensors = many_tensors()
    manifest = save(store, prefix, 3, tensors)
    assert manifest.step == 3 and manifest.metadata == {"job": "test"}
    assert C.latest(store, prefix) == manifest
    back = C.read_shard(store, manifest, "shard-0")
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype.newbyteorder("="), name
        assert back[name].shape == value.shape, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    # The file is plain safetensors: its own reader agrees.
    raw = bytes(store.get(manifest.shards[0].path).bytes())
    theirs = safetensors.numpy.load(raw)
    for name, value in tensors.items():
        np.testing.assert_array_equal(theirs[name], value, err_msg=name)


def test_multipart_upload_round_trip(where):
    store, prefix = where
    rng = np.random.default_rng(1)
    tensors = {f"layer{i}": rng.standard_normal((1200, 1201)).astype(np.float32) for i in range(3)}
    tensors["tiny"] = np.arange(3, dtype=np.int8)
    info = C.write_shard(store, prefix, 1, "shard-0", tensors, chunk_size=1 << 20)
    assert info.size > 3 * C.MIN_PART_SIZE  # several parts, each at least the S3 minimum
    assert info.size == len(bytes(store.get(info.path).bytes()))
    manifest = C.commit(store, prefix, 1, [info])
    back = C.read_shard(store, manifest, "shard-0")
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value)
    tensor_infos = {t.name: t for t in info.tensors}
    raw = bytes(store.get(info.path).bytes())
    begin, end = tensor_infos["layer2"].offsets
    np.testing.assert_array_equal(
        np.frombuffer(raw[begin:end], np.float32).reshape(1200, 1201), tensors["layer2"]
    )


def test_layout_and_manifest_contents(where):
    store, prefix = where
    manifest = save(store, prefix, 12, weights(0), shard="ps-1")
    directory = f"{prefix}/ckpt-000000000012".lstrip("/")
    assert manifest.path == f"{directory}/MANIFEST.json"
    file = manifest.shards[0].path.rsplit("/", 1)[1]
    assert manifest.shards[0].path == f"{directory}/{file}"
    assert re.fullmatch(r"ps-1\.[0-9a-f]{12}\.safetensors", file)  # one name per upload
    doc = json.loads(bytes(store.get(manifest.path).bytes()))
    assert doc["step"] == 12 and doc["metadata"] == {"job": "test"} and doc["created"]
    (shard,) = doc["shards"]
    assert shard["file"] == file
    assert shard["size"] == store.head(manifest.shards[0].path)["size"]
    assert {t["name"]: (t["dtype"], t["shape"]) for t in shard["tensors"]} == {
        "w": ("float32", [4, 3]),
        "b": ("int64", [3]),
    }


def test_bad_inputs_are_named():
    store, prefix = C.open_store("memory://")
    with pytest.raises(TypeError, match="'s'.*dtype <U3"):
        C.write_shard(store, prefix, 1, "shard-0", {"s": np.array(["abc"])})
    with pytest.raises(ValueError, match="shard name 'a/b'"):
        C.write_shard(store, prefix, 1, "a/b", {"x": np.zeros(1)})
    with pytest.raises(ValueError, match="non-negative integer"):
        C.write_shard(store, prefix, -1, "shard-0", {"x": np.zeros(1)})
    with pytest.raises(C.CheckpointError, match="lists no shards"):
        C.commit(store, prefix, 1, [])
    info = C.write_shard(store, prefix, 1, "shard-0", {"x": np.zeros(1)})
    with pytest.raises(TypeError, match="metadata is not JSON-serializable"):
        C.commit(store, prefix, 1, [info], {"when": object()})
    with pytest.raises(C.CheckpointError, match="lists a shard twice"):
        C.commit(store, prefix, 1, [info, info])
    assert C.latest(store, prefix) is None


def test_ranged_reads_split_at_tensor_boundaries(where, monkeypatch):
    store, prefix = where
    monkeypatch.setattr(C, "RANGE_SIZE", 1000)
    tensors = many_tensors()
    tensors["large"] = np.arange(5000, dtype=np.float64)  # one range alone, never split
    manifest = save(store, prefix, 1, tensors)
    info = manifest.shards[0]
    ranges = C._ranges(info)
    assert len(ranges) > 3 and ranges[0][0] == 0 and ranges[-1][1] == info.size
    starts = {t.offsets[0] for t in info.tensors}
    assert all(begin in starts for begin, _ in ranges[1:])
    back = C.read_shard(store, manifest, "shard-0")
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    flip_byte(store, info.path, info.size - 3)
    with pytest.raises(C.CorruptCheckpointError, match="CRC32C"):
        C.read_shard(store, manifest, "shard-0")
    truncate(store, info.path, 100)
    with pytest.raises(C.CorruptCheckpointError, match=f"size is {info.size - 100} bytes"):
        C.read_shard(store, manifest, "shard-0")
    store.delete(info.path)
    with pytest.raises(C.CorruptCheckpointError, match="missing"):
        C.read_shard(store, manifest, "shard-0")


# ---- commit protocol


def test_manifest_is_written_last_and_alone_makes_the_checkpoint(where):
    inner, prefix = where
    store = Wrapped(inner)
    first = save(store, prefix, 1, weights(1))
    assert store.puts[-1] == first.path
    # Crash before commit: the shards of step 2 are there, the checkpoint is not.
    C.write_shard(store, prefix, 2, "shard-0", weights(2))
    C.write_shard(store, prefix, 2, "shard-1", weights(3))
    assert C.latest(store, prefix) == first
    manifest, shards = C.restore_latest(store, prefix)
    assert manifest.step == 1
    np.testing.assert_array_equal(shards["shard-0"]["w"], weights(1)["w"])


def test_failed_upload_leaves_previous_checkpoint(where):
    inner, prefix = where

    def fail(path):
        if path.endswith(".safetensors") and "000000000002" in path:
            raise OSError("connection reset during upload")

    store = Wrapped(inner, before_put=fail)
    save(store, prefix, 1, weights(1))
    with pytest.raises(OSError, match="connection reset"):
        save(store, prefix, 2, weights(2))
    assert C.latest(store, prefix).step == 1


def test_commit_checks_every_shard_exists(where):
    store, prefix = where
    info = C.write_shard(store, prefix, 4, "shard-0", weights(0))
    other = C.write_shard(store, prefix, 4, "shard-1", weights(1))
    store.delete(other.path)
    with pytest.raises(C.CheckpointError, match="shard 'shard-1'.*does not exist"):
        C.commit(store, prefix, 4, [info, other])
    elsewhere = C.write_shard(store, prefix, 5, "shard-1", weights(1))
    with pytest.raises(C.CheckpointError, match="another step or prefix"):
        C.commit(store, prefix, 4, [info, elsewhere])
    assert C.latest(store, prefix) is None


def test_two_shards_committed_together(where):
    store, prefix = where
    infos = [C.write_shard(store, prefix, 8, f"ps-{i}", weights(i)) for i in range(2)]
    C.commit(store, prefix, 8, infos, {"mode": "sync"})
    manifest, shards = C.restore_latest(store, prefix, ["ps-1"])
    assert list(shards) == ["ps-1"] and manifest.metadata == {"mode": "sync"}
    np.testing.assert_array_equal(shards["ps-1"]["w"], weights(1)["w"])
    with pytest.raises(C.CheckpointError, match="no shard 'ps-7'.*ps-0, ps-1"):
        C.restore_latest(store, prefix, ["ps-7"])


def test_racing_committers_one_wins(where):
    store, prefix = where
    info = C.write_shard(store, prefix, 6, "shard-0", weights(6))
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def committer(name):
        barrier.wait()
        try:
            results[name] = C.commit(store, prefix, 6, [info], {"committer": name})
        except C.CheckpointExistsError as e:
            results[name] = e

    threads = [threading.Thread(target=committer, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [n for n, r in results.items() if isinstance(r, C.Manifest)]
    lost = [r for r in results.values() if isinstance(r, C.CheckpointExistsError)]
    assert len(won) == 1 and len(lost) == 1
    assert "already committed" in str(lost[0]) and "MANIFEST.json" in str(lost[0])
    assert C.latest(store, prefix).metadata == {"committer": won[0]}
    with pytest.raises(C.CheckpointExistsError, match="refusing to overwrite"):
        C.write_shard(store, prefix, 6, "shard-0", weights(7))


# ---- damage


def test_bit_flip_is_detected_and_restore_falls_back(where):
    store, prefix = where
    save(store, prefix, 1, weights(1))
    newest = save(store, prefix, 2, weights(2))
    flip_byte(store, newest.shards[0].path, newest.shards[0].size - 5)
    assert C.latest(store, prefix).step == 2  # same size: only reading can tell
    with pytest.raises(C.CorruptCheckpointError) as caught:
        C.read_shard(store, newest, "shard-0")
    err = caught.value
    assert err.path == newest.shards[0].path and err.expected == newest.shards[0].crc32c
    assert err.actual != err.expected
    assert f"{err.expected:#010x}" in str(err) and f"{err.actual:#010x}" in str(err)
    assert newest.shards[0].path in str(err)
    with pytest.warns(C.CheckpointWarning, match="corrupt checkpoint .*000000000002.*CRC32C"):
        manifest, shards = C.restore_latest(store, prefix)
    assert manifest.step == 1
    np.testing.assert_array_equal(shards["shard-0"]["w"], weights(1)["w"])


def test_flipped_header_byte_is_detected(where):
    store, prefix = where
    save(store, prefix, 1, weights(1))
    newest = save(store, prefix, 2, weights(2))
    flip_byte(store, newest.shards[0].path, 12)
    with pytest.warns(C.CheckpointWarning, match="000000000002"):
        manifest, _ = C.restore_latest(store, prefix)
    assert manifest.step == 1


def test_truncated_shard_is_skipped(where):
    store, prefix = where
    save(store, prefix, 1, weights(1))
    newest = save(store, prefix, 2, weights(2))
    truncate(store, newest.shards[0].path, 7)
    with pytest.warns(C.CheckpointWarning, match="incomplete checkpoint .*000000000002.*bytes"):
        assert C.latest(store, prefix).step == 1
    with pytest.raises(C.CorruptCheckpointError, match="size is .* bytes, manifest expects"):
        C.read_shard(store, newest, "shard-0")
    with pytest.warns(C.CheckpointWarning):
        manifest, shards = C.restore_latest(store, prefix)
    assert manifest.step == 1


def test_missing_shard_and_unreadable_manifest_are_skipped(where):
    store, prefix = where
    save(store, prefix, 1, weights(1))
    two = save(store, prefix, 2, weights(2))
    three = save(store, prefix, 3, weights(3))
    store.delete(two.shards[0].path)
    store.put(three.path, b'{"format": "flowmill-checkpoint", "vers')
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert C.latest(store, prefix).step == 1
    messages = [str(w.message) for w in seen if issubclass(w.category, C.CheckpointWarning)]
    assert any("000000000003" in m and "unreadable manifest" in m for m in messages)
    assert any("000000000002" in m and "missing" in m for m in messages)


def test_no_checkpoint():
    store, prefix = C.open_store("memory://")
    assert C.latest(store, prefix) is None
    assert C.restore_latest(store, prefix) is None
    assert C.prune(store, prefix, 1) == C.Pruned([], {})


# ---- pruning


def steps_present(store, prefix):
    return sorted(C._scan(store, prefix))


def test_prune_keeps_newest_and_in_progress(where):
    store, prefix = where
    for step in (10, 20, 30, 40, 50):
        save(store, prefix, step, weights(step))
    for step in (5, 35, 60):  # stale uncommitted (5, 35) and an in-progress save (60)
        C.write_shard(store, prefix, step, "shard-0", weights(step))
    broken = save(store, prefix, 70, weights(70))  # committed, then lost a shard
    store.delete(broken.shards[0].path)
    pruned = C.prune(store, prefix, keep=2)
    assert pruned.deleted == [5, 10, 20, 30, 35]
    assert list(pruned.quarantined) == [70] and "missing" in pruned.quarantined[70]
    assert steps_present(store, prefix) == [40, 50, 60, 70]
    assert [m.step for m in C.checkpoints(store, prefix)] == [50, 40]  # 70: quarantined
    assert C.prune(store, prefix, keep=1).deleted == [40]
    assert C.latest(store, prefix).step == 50
    assert steps_present(store, prefix) == [50, 60, 70]
    with pytest.raises(ValueError, match="at least 1"):
        C.prune(store, prefix, keep=0)


def test_prune_deletes_manifest_before_shards(where):
    inner, prefix = where
    store = Wrapped(inner)
    for step in (1, 2):
        infos = [C.write_shard(store, prefix, step, f"ps-{i}", weights(i)) for i in range(2)]
        C.commit(store, prefix, step, infos)
    assert C.prune(store, prefix, keep=1).deleted == [1]
    first, rest = store.deletes
    assert first.endswith("ckpt-000000000001/MANIFEST.json")
    assert sorted(p.rsplit("/", 1)[1].split(".")[0] for p in rest) == ["ps-0", "ps-1"]


def test_prune_with_nothing_committed_deletes_nothing(where):
    store, prefix = where
    C.write_shard(store, prefix, 1, "shard-0", weights(1))
    assert C.prune(store, prefix, keep=1).deleted == []
    assert steps_present(store, prefix) == [1]


# ---- verification, quarantine and retention


def corrupt_in_place(store, manifest):
    """Flip a byte of the first shard: same size, so only reading it can tell."""
    flip_byte(store, manifest.shards[0].path, manifest.shards[0].size - 5)


def restored_values(store, prefix):
    manifest, shards = C.restore_latest(store, prefix)
    return manifest.step, shards["shard-0"]


def test_keep_1_with_a_corrupt_newest_keeps_the_good_ones(where):
    store, prefix = where
    for step in (10, 20, 30):
        save(store, prefix, step, weights(step))
    corrupt_in_place(store, C.latest(store, prefix))
    with pytest.warns(C.CheckpointWarning, match="corrupt checkpoint .*000000000030.*CRC32C"):
        step, values = restored_values(store, prefix)
    assert step == 20  # the newest good one
    np.testing.assert_array_equal(values["w"], weights(20)["w"])
    (directory, reason), = C.quarantined(store, prefix)
    assert directory.endswith("ckpt-000000000030") and "CRC32C" in reason
    save(store, prefix, 25, weights(25))
    pruned = C.prune(store, prefix, keep=1, protect=(25, 20))
    assert pruned.deleted == [10] and pruned.quarantined == {}
    assert [m.step for m in C.checkpoints(store, prefix)] == [25, 20]
    save(store, prefix, 30, weights(31))  # the quarantined step is free again
    assert C.prune(store, prefix, keep=1, protect=(30, 20)).deleted == [25]
    assert [m.step for m in C.checkpoints(store, prefix)] == [30, 20]
    assert C.quarantined(store, prefix) == []  # step 30 holds a checkpoint again
    step, values = restored_values(store, prefix)
    assert step == 30
    np.testing.assert_array_equal(values["w"], weights(31)["w"])


def test_retention_never_counts_an_unverified_corrupt_checkpoint(where):
    store, prefix = where
    for step in (10, 20, 30):
        save(store, prefix, step, weights(step))
    corrupt_in_place(store, C.latest(store, prefix))
    save(store, prefix, 25, weights(25))
    pruned = C.prune(store, prefix, keep=2, protect=(25,))
    assert list(pruned.quarantined) == [30] and "CRC32C" in pruned.quarantined[30]
    assert pruned.deleted == [10]
    assert [m.step for m in C.checkpoints(store, prefix)] == [25, 20]
    assert all(C.is_verified(store, m) for m in C.checkpoints(store, prefix))
    (record,) = [f for f in C._scan(store, prefix)[30] if f.startswith(C.QUARANTINED)]
    doc = json.loads(bytes(store.get(f"{C.checkpoint_dir(prefix, 30)}/{record}").bytes()))
    assert "CRC32C" in doc["reason"] and json.loads(doc["manifest"])["step"] == 30
    assert C.prune(store, prefix, keep=1, protect=(25,)).deleted == [20]
    save(store, prefix, 30, weights(30))
    assert restored_values(store, prefix)[0] == 30


def test_a_checkpoint_is_read_back_once(where):
    inner, prefix = where
    store = Wrapped(inner)
    for step in (1, 2):
        save(store, prefix, step, weights(step))
    C.prune(store, prefix, keep=2)
    shard_reads = [p for p in store.gets if p.endswith(C.SUFFIX)]
    assert len(shard_reads) == 2  # each checkpoint's one shard, once
    store.gets.clear()
    save(store, prefix, 3, weights(3))
    assert C.prune(store, prefix, keep=2).deleted == [1]
    assert [p for p in store.gets if p.endswith(C.SUFFIX)] == [
        C.latest(store, prefix).shards[0].path  # only the new one
    ]


def test_a_damaged_checkpoint_committed_again_loses_its_verification(where):
    store, prefix = where
    first = save(store, prefix, 5, weights(5))
    C.prune(store, prefix, keep=1)
    assert C.is_verified(store, first)
    corrupt_in_place(store, first)
    with pytest.warns(C.CheckpointWarning), pytest.raises(C.NoUsableCheckpointError):
        C.restore_latest(store, prefix)
    second = save(store, prefix, 5, weights(6))
    assert second.digest != first.digest and not C.is_verified(store, second)
    assert restored_values(store, prefix)[0] == 5
    assert C.is_verified(store, second)


def test_concurrent_writers_of_one_step_exactly_one_wins(where):
    store, prefix = where
    for step in range(1, 21):
        barrier = threading.Barrier(2, timeout=30)
        results: dict[int, object] = {}

        def writer(seed, step=step, barrier=barrier, results=results):
            barrier.wait()
            try:
                results[seed] = save(store, prefix, step, weights(seed))
            except C.CheckpointExistsError as e:
                results[seed] = e

        threads = [threading.Thread(target=writer, args=(step * 10 + i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        won = [seed for seed, r in results.items() if isinstance(r, C.Manifest)]
        lost = [r for r in results.values() if isinstance(r, C.CheckpointExistsError)]
        assert len(won) == 1 and len(lost) == 1, results
        assert f"checkpoint step {step} " in str(lost[0]), lost[0]
        assert C.checkpoint_dir(prefix, step) in str(lost[0])
        restored, values = restored_values(store, prefix)
        assert restored == step
        for name, value in weights(won[0]).items():
            np.testing.assert_array_equal(values[name], value)
        files = C._scan(store, prefix)[step]
        shards = [f for f in files if f.endswith(C.SUFFIX)]
        assert shards == [results[won[0]].shards[0].path.rsplit("/", 1)[1]]  # loser's gone


def test_every_checkpoint_corrupt_fails_naming_them(where):
    store, prefix = where
    for step in (1, 2):
        corrupt_in_place(store, save(store, prefix, step, weights(step)))
    with warnings.catch_warnings(record=True) as seen, pytest.raises(
        C.NoUsableCheckpointError
    ) as caught:
        warnings.simplefilter("always")
        C.restore_latest(store, prefix)
    assert sum("quarantined" in str(w.message) for w in seen) == 2
    text = str(caught.value)
    assert "all 2 are damaged" in text and text.count("CRC32C") == 2
    assert [d.rsplit("/", 1)[-1] for d, _ in caught.value.damaged] == [
        "ckpt-000000000002", "ckpt-000000000001"
    ]
    with pytest.raises(C.NoUsableCheckpointError, match="quarantined earlier.*CRC32C"):
        C.restore_latest(store, prefix)  # a restarted job fails again: nothing is forgotten


def test_every_checkpoint_corrupt_may_start_fresh(where):
    store, prefix = where
    corrupt_in_place(store, save(store, prefix, 4, weights(4)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert C.restore_latest(store, prefix, start_fresh=True) is None
    last = str(seen[-1].message)
    assert "every checkpoint" in last and "starting fresh" in last and "CRC32C" in last
    save(store, prefix, 4, weights(5))
    assert restored_values(store, prefix)[0] == 4


# ---- stores


def test_open_store_uris(tmp_path, monkeypatch):
    store, prefix = C.open_store(f"file://{tmp_path}/a/b")
    assert prefix == "" and (tmp_path / "a" / "b").is_dir()
    with pytest.raises(ValueError, match="local path"):
        C.open_store("file://relative/dir")
    with pytest.raises(ValueError, match="unsupported scheme 'ftp'"):
        C.open_store("ftp://host/x")
    assert C.open_store("memory://x/y/")[1] == "x/y"
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    store, prefix = C.open_store("s3://bucket/runs/job-1/", {"region": "eu-west-3"})
    assert prefix == "runs/job-1"
    assert store.config["endpoint"] == "http://127.0.0.1:8333"
    assert store.config["region"] == "eu-west-3" and store.config["bucket"] == "bucket"
    assert store.client_options["allow_http"] in (True, "true")
    store, _ = C.open_store(
        "s3://other",
        {"endpoint": "http://10.0.0.1:9000", "access_key": "k", "secret": "s", "allow_http": True},
    )
    assert store.config["endpoint"] == "http://10.0.0.1:9000"
    assert store.config["access_key_id"] == "k" and store.config["secret_access_key"] == "s"
