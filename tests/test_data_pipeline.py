"""``fm.data``: every source and transformation against the values it must give, read
through the graph (``get_next`` in a session step), determinism of seeded shuffles and
parallel maps, a seek landing exactly where an uninterrupted read stands, threads that end
with their session, and errors that name the dataset, the file or the element."""

from __future__ import annotations

import gzip
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels.cancellation import CancelledError
from flowmill.kernels.resources import UninitializedError
from flowmill.runtime.data.streams import THREAD_PREFIX
from flowmill.runtime.ops.iterator_ops import iterator_get_next, iterator_handle, iterator_seek

from opcheck import OpCase, case_tests
from threads import wait_until

Dataset = fm.data.Dataset


def read(ds, limit: int = 10_000, seed: int | None = None, one_shot: bool = True) -> list:
    """Every element ``ds`` gives through a one-shot iterator, as NumPy values."""
    graph = fm.Graph(seed=seed)
    with graph.as_default():
        it = ds.make_one_shot_iterator() if one_shot else ds.make_initializable_iterator()
        nxt = it.get_next()
    out = []
    with fm.Session(graph) as sess:
        if not one_shot:
            sess.run(it.initializer)
        while len(out) < limit:
            try:
                out.append(sess.run(nxt))
            except fm.OutOfRangeError:
                break
    return out


def plain(value):
    """An element as plain Python lists and numbers (tuples as lists), for comparing."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return np.asarray(value).tolist()


def flat(elements) -> list:
    return [plain(e) for e in elements]


def data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


# ---- the ops, as every op is checked


def _get_next_plus(p):
    it = Dataset.range(6).batch(6).make_one_shot_iterator()
    return it.get_next() + p


def _seek_then_read(p):
    it = Dataset.range(10).make_one_shot_iterator()
    seek = iterator_seek(it._handle, p)
    with fm.control_dependencies([seek]):
        element = fm.identity(it.get_next())
    with fm.control_dependencies([element.op]):
        return [element, it.position()]


CASES = [
    OpCase("iterator_get_next", _get_next_plus, [np.arange(6, dtype=np.int64) * 10],
           lambda p: p + np.arange(6), grad=False),
    OpCase("iterator_seek_position", _seek_then_read, [np.array(4, np.int64)],
           lambda p: [p, p + 1], grad=False),
]
test_forward, test_gradient = case_tests(CASES)


# ---- sources


def test_from_tensor_slices_gives_rows_in_their_structure():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6, dtype=np.int64)
    graph = fm.Graph()
    with graph.as_default():
        ds = Dataset.from_tensor_slices({"x": x, "y": y})
        assert ds.output_types == {"x": fm.float32, "y": fm.int64}
        assert ds.output_shapes == {"x": (2,), "y": ()}
        element = ds.make_one_shot_iterator().get_next()
        assert element["x"].shape == (2,) and element["y"].dtype == fm.int64
    with fm.Session(graph) as sess:
        got = [sess.run(element) for _ in range(6)]
    for i, e in enumerate(got):
        np.testing.assert_array_equal(e["x"], x[i])
        assert e["y"] == i
    assert flat(read(Dataset.from_tensor_slices((x, y)).batch(4)))[0] == [x[:4].tolist(),
                                                                          y[:4].tolist()]


def test_from_tensors_range_and_a_single_component():
    assert flat(read(Dataset.from_tensors(np.eye(2)).repeat(3))) == [np.eye(2).tolist()] * 3
    assert flat(read(Dataset.range(5))) == [0, 1, 2, 3, 4]
    assert flat(read(Dataset.range(2, 11, 3))) == [2, 5, 8]
    assert flat(read(Dataset.range(5, 0, -2))) == [5, 3, 1]
    assert Dataset.range(2, 11, 3).cardinality() == 3


def test_from_generator_checks_and_converts_what_it_yields():
    def gen():
        for i in range(4):
            yield np.full(2, i, np.float64), i  # float64 and Python ints: converted

    ds = Dataset.from_generator(gen, (fm.float32, fm.int32), ((2,), ()))
    got = read(ds)
    assert [g[0].dtype for g in got] == [np.float32] * 4 and got[3][1] == 3
    assert got[2][1].dtype == np.int32 and got[2][0].tolist() == [2.0, 2.0]
    assert read(Dataset.from_generator(lambda: iter(["a", "bc"]), fm.string)) == [b"a", b"bc"]


@pytest.mark.parametrize("yields, match", [
    ([(np.zeros(2), 1), (np.zeros(3), 2)], r"from_generator\(bad\): element 1, component 0 "
                                           r"has shape \(3,\), expected \(2,\)"),
    ([(np.zeros(2), "x")], r"element 0, component 1 has dtype <U1, expected int64"),
    ([(np.zeros(2), 1), np.zeros(2)], r"element 1 is a single ndarray, expected the "
                                      r"structure \(float32\(2,\), int64\(\)\)"),
    ([(np.zeros(2), 1, 2)], r"element 0 has the structure \(x, x, x\)"),
])
def test_a_generator_yielding_the_wrong_thing_fails_naming_the_element(yields, match):
    def bad():
        yield from yields

    ds = Dataset.from_generator(bad, (fm.float32, fm.int64), ((2,), ()))
    with pytest.raises(fm.InvalidArgumentError, match=match):
        read(ds.prefetch(1))


def test_text_lines_across_files_and_compressions(tmp_path: Path):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt.gz"
    a.write_bytes(b"first\nsecond\r\n\nlast without newline")
    b.write_bytes(b"")
    with gzip.open(c, "wb") as f:
        f.write(b"zipped\n")
    assert read(fm.data.TextLineDataset([a, b])) == [b"first", b"second", b"",
                                                     b"last without newline"]
    assert read(fm.data.TextLineDataset(str(c), compression_type="GZIP")) == [b"zipped"]
    parsed = fm.data.TextLineDataset(a).take(2).map(lambda line: np.int64(len(line)))
    assert flat(read(parsed)) == [5, 6]


def test_fixed_length_records_skip_headers_and_footers_across_files(tmp_path: Path):
    records = np.arange(5 * 3, dtype=np.uint8).reshape(5, 3)
    one, two = tmp_path / "one.bin", tmp_path / "two.bin"
    one.write_bytes(b"HH" + records[:2].tobytes() + b"F")
    two.write_bytes(b"HH" + records[2:].tobytes() + b"F")
    ds = fm.data.FixedLengthRecordDataset([one, two], 3, header_bytes=2, footer_bytes=1)
    assert ds.output_types == fm.uint8 and ds.output_shapes == (3,)
    assert ds.cardinality() == 5
    assert flat(read(ds)) == records.tolist()
    assert flat(read(ds.batch(4))) == [records[:4].tolist(), records[4:].tolist()]
    assert flat(read(ds.shard(2, 1))) == records[1::2].tolist()


def test_missing_and_misshapen_files_fail_naming_the_file(tmp_path: Path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"TextLineDataset: '.*nope.txt' does not exist"):
        fm.data.TextLineDataset([missing])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(10))
    with pytest.raises(fm.InvalidArgumentError,
                       match=r"'.*odd.bin' has 10 bytes; .* that is 9 bytes, not a whole "
                             r"number of 4-byte records"):
        fm.data.FixedLengthRecordDataset(odd, 4, header_bytes=1)
    later = tmp_path / "later.txt"
    later.write_text("x\n")
    ds = fm.data.TextLineDataset([later])
    later.unlink()  # gone by the time the step reads it
    with pytest.raises(FileNotFoundError, match=r"later.txt' does not exist"):
        read(ds)


def test_an_iterator_op_whose_pipeline_this_process_lacks_says_so():
    graph = fm.Graph()
    with graph.as_default():
        handle = iterator_handle([fm.int64], [()], "elsewhere", "dataset-from-another-process")
        (nxt,) = iterator_get_next(handle, [fm.int64], [()])
    with fm.Session(graph) as sess:
        with pytest.raises(RuntimeError, match="its dataset .* is not defined in this process"):
            sess.run(nxt)


def test_graph_tensors_are_not_data():
    with fm.Graph().as_default():
        with pytest.raises(TypeError, match="takes NumPy values, got the graph tensor"):
            Dataset.from_tensor_slices(fm.constant([1.0, 2.0]))


# ---- transformations


def test_batch_repeat_take_skip_and_shard_give_the_expected_elements():
    r = Dataset.range(10)
    assert flat(read(r.batch(4))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert flat(read(r.batch(4, drop_remainder=True))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert r.batch(4, drop_remainder=True).output_shapes == (4,)
    assert r.batch(4).output_shapes == (None,)
    assert flat(read(r.take(3).repeat(2))) == [0, 1, 2, 0, 1, 2]
    assert flat(read(r.repeat(2).batch(7))) == [list(range(7)), [7, 8, 9, 0, 1, 2, 3],
                                                [4, 5, 6, 7, 8, 9]]
    assert flat(read(r.skip(7))) == [7, 8, 9]
    assert flat(read(r.skip(-1))) == [] and flat(read(r.take(-1))) == list(range(10))
    assert flat(read(r.shard(3, 1))) == [1, 4, 7]
    assert flat(read(r.repeat().take(12).skip(9))) == [9, 0, 1]
    assert r.repeat().cardinality() == fm.data.INFINITE_CARDINALITY
    assert r.shard(3, 2).batch(2).cardinality() == 2
    # the same chains over a stream without random access (a generator)
    g = Dataset.from_generator(lambda: iter(range(10)), fm.int64)
    assert g.cardinality() == fm.data.UNKNOWN_CARDINALITY
    assert flat(read(g.shard(3, 1))) == [1, 4, 7]
    assert flat(read(g.skip(7))) == [7, 8, 9]
    assert flat(read(g.repeat(2).batch(7))) == flat(read(r.repeat(2).batch(7)))
    assert flat(read(Dataset.from_generator(lambda: iter(()), fm.int64).repeat())) == []


def test_batching_elements_of_different_shapes_fails_naming_the_batch():
    def ragged():
        yield np.zeros(2)
        yield np.zeros(3)

    ds = Dataset.from_generator(ragged, fm.float32, (None,)).batch(2)
    with pytest.raises(fm.InvalidArgumentError, match=r"batch\(2\): cannot batch elements .* "
                                                      r"different shapes \[\(2,\), \(3,\)\]"):
        read(ds)


def test_map_applies_a_python_function_and_infers_what_it_gives():
    x = np.arange(8, dtype=np.uint8).reshape(4, 2)
    y = np.arange(4)

    def normalize(image, label):
        return image.astype(np.float32) / 255, label * 2

    ds = Dataset.from_tensor_slices((x, y)).map(normalize)
    assert ds.output_types == (fm.float32, fm.int64) and ds.output_shapes == ((2,), ())
    got = read(ds)
    np.testing.assert_array_equal(got[3][0], x[3].astype(np.float32) / 255)
    assert [g[1] for g in got] == [0, 2, 4, 6]
    batched = Dataset.from_tensor_slices((x, y)).batch(3).map(normalize)
    assert batched.output_shapes == ((None, 2), (None,))  # the batch dim stays unknown
    assert [g[0].shape for g in read(batched)] == [(3, 2), (1, 2)]
    declared = Dataset.range(3).map(lambda i: {"i": i}, output_types={"i": fm.int32})
    assert [g["i"].dtype for g in read(declared)] == [np.int32] * 3


def test_a_map_that_fails_names_the_map_and_the_element():
    def explode(i):
        if i == 3:
            raise KeyError("no such thing")
        return i

    for workers in (None, 3):
        ds = Dataset.range(6).map(explode, num_parallel_calls=workers).prefetch(2)
        graph = fm.Graph()
        with graph.as_default():
            nxt = ds.make_one_shot_iterator().get_next()
        with fm.Session(graph) as sess:
            assert [sess.run(nxt) for _ in range(3)] == [0, 1, 2]
            with pytest.raises(KeyError) as info:
                sess.run(nxt)
            assert "raised by Dataset.range(6).map(explode) at element 3" in info.value.__notes__
            with pytest.raises(KeyError):  # an error ends the stream: it stays
                sess.run(nxt)
    wrong = Dataset.range(4).map(lambda i: np.zeros(int(i) % 2 + 1))
    with pytest.raises(fm.InvalidArgumentError, match=r"map\(<lambda>\): output for element 1 "
                                                      r"has shape \(2,\), expected \(1,\)"):
        read(wrong)


def test_a_parallel_map_keeps_the_order_unless_told_not_to():
    rng = np.random.default_rng(0)
    delays = rng.uniform(0, 0.004, 40)

    def slow(i):
        time.sleep(delays[int(i)])  # finishes out of order on the workers
        return i * i

    ordered = read(Dataset.range(40).map(slow, num_parallel_calls=4))
    assert flat(ordered) == [i * i for i in range(40)]
    loose = read(Dataset.range(40).map(slow, num_parallel_calls=4, deterministic=False))
    assert sorted(flat(loose)) == [i * i for i in range(40)]


def test_a_seeded_shuffle_is_a_permutation_the_same_in_every_run():
    ds = Dataset.range(50).shuffle(10, seed=7)
    first, again = flat(read(ds)), flat(read(ds))
    assert first == again and sorted(first) == list(range(50)) and first != list(range(50))
    assert flat(read(Dataset.range(50).shuffle(10, seed=8))) != first
    # each epoch in another order, unless told to reshuffle never
    epochs = flat(read(Dataset.range(20).shuffle(20, seed=1).repeat(2)))
    assert sorted(epochs[:20]) == sorted(epochs[20:]) and epochs[:20] != epochs[20:]
    same = flat(read(Dataset.range(20).shuffle(20, seed=1, reshuffle_each_iteration=False)
                     .repeat(2)))
    assert same[:20] == same[20:] == epochs[:20]
    # a buffer of one is no shuffle; without a seed the graph's decides
    assert flat(read(Dataset.range(5).shuffle(1, seed=3))) == list(range(5))
    unseeded = Dataset.range(30).shuffle(30)
    assert flat(read(unseeded, seed=4)) == flat(read(unseeded, seed=4))
    assert flat(read(unseeded, seed=4)) != flat(read(unseeded, seed=5))
    twice = Dataset.range(30).shuffle(4).map(lambda i: i + 100).shuffle(6)
    assert flat(read(twice, seed=4)) == flat(read(twice, seed=4))
    assert sorted(flat(read(twice, seed=4))) == list(range(100, 130))


@pytest.mark.parametrize("n, buffer, batch", [(40, 8, 5), (3000, 100, 97), (50, 80, 7)])
def test_a_shuffle_over_elements_without_random_access_is_the_same_shuffle(n, buffer, batch):
    """Indices drawn a run at a time (random access) make the choices elements drawn one
    at a time do, slots drawn twice in a run and the buffer's draining end included."""
    indexed = Dataset.range(n).shuffle(buffer, seed=2).repeat(2).batch(batch)
    streamed = (Dataset.from_generator(lambda: iter(range(n)), fm.int64)
                .shuffle(buffer, seed=2).repeat(2).batch(batch))
    got = flat(read(indexed))
    assert got == flat(read(streamed))
    assert sorted(sum(got, [])) == sorted(list(range(n)) * 2)


# ---- seeking: a pipeline opened at a position yields what an uninterrupted one yields


def _pipelines(tmp_path: Path) -> dict:
    x = np.arange(60, dtype=np.float32).reshape(30, 2)
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"{i}\n" for i in range(30)))
    records = tmp_path / "records.bin"
    records.write_bytes(np.arange(30 * 4, dtype=np.uint8).tobytes())
    slices = Dataset.from_tensor_slices((x, np.arange(30)))
    return {
        "slices": slices.shuffle(7, seed=1).repeat().batch(4).map(lambda a, b: (a * 2, b)),
        "map-before-shuffle": slices.map(lambda a, b: (a + 1, b)).shuffle(9, seed=5).repeat(3)
        .batch(5).prefetch(2),
        "repeat-then-shuffle": Dataset.range(11).repeat().shuffle(6, seed=2).batch(3),
        "parallel-map": Dataset.range(30).map(lambda i: i * 3, num_parallel_calls=3)
        .shuffle(5, seed=9).repeat(2).batch(4).prefetch(1),
        "generator": Dataset.from_generator(lambda: iter(range(30)), fm.int64)
        .shuffle(6, seed=4).repeat(2).batch(4),
        "text": fm.data.TextLineDataset(lines).map(lambda s: np.int64(s)).shard(2, 1)
        .repeat(3).batch(3),
        "records": fm.data.FixedLengthRecordDataset(records, 4).skip(2).take(25)
        .shuffle(4, seed=3).repeat(2).batch(6),
    }


@pytest.mark.parametrize("name", ["slices", "map-before-shuffle", "repeat-then-shuffle",
                                  "parallel-map", "generator", "text", "records"])
def test_a_seek_lands_where_an_uninterrupted_read_stands(tmp_path: Path, name: str):
    ds = _pipelines(tmp_path)[name]
    straight = flat(read(ds, limit=18))
    graph = fm.Graph()
    with graph.as_default():
        it = ds.make_one_shot_iterator()
        nxt, position = it.get_next(), it.position()
    with fm.Session(graph) as sess:
        for p in (0, 1, 5, 13, 17):
            it.seek(sess, p)
            assert sess.run(position) == p
            got = [plain(sess.run(nxt)) for _ in range(min(3, len(straight) - p))]
            assert got == straight[p:p + len(got)], f"{name} at {p}"
        it.seek(sess, 10_000)  # past the end of a finite stream, or far into an endless one
        if ds.cardinality() == fm.data.INFINITE_CARDINALITY:
            sess.run(nxt)
        else:
            with pytest.raises(fm.OutOfRangeError):
                sess.run(nxt)


def test_the_end_of_the_data_raises_out_of_range_every_time():
    graph = fm.Graph()
    with graph.as_default():
        nxt = Dataset.range(2).prefetch(1).make_one_shot_iterator().get_next()
    with fm.Session(graph) as sess:
        assert [sess.run(nxt), sess.run(nxt)] == [0, 1]
        for _ in range(2):
            with pytest.raises(fm.OutOfRangeError, match="has no elements after the first 2"):
                sess.run(nxt)


def test_an_initializable_iterator_starts_over_when_initialized():
    graph = fm.Graph()
    with graph.as_default():
        it = Dataset.range(3).make_initializable_iterator()
        nxt = it.get_next()
        with pytest.raises(ValueError, match="one-shot iterator: it has no initializer"):
            _ = Dataset.range(3).make_one_shot_iterator().initializer
    with fm.Session(graph) as sess:
        with pytest.raises(UninitializedError, match="run its initializer"):
            sess.run(nxt)
        sess.run(it.initializer)
        assert [sess.run(nxt) for _ in range(2)] == [0, 1]
        sess.run(it.initializer)
        assert [sess.run(nxt) for _ in range(3)] == [0, 1, 2]


# ---- threads


def test_prefetch_and_map_threads_end_with_their_session_or_a_seek():
    before = set(data_threads())
    graph = fm.Graph()
    with graph.as_default():
        it = (Dataset.range(1_000_000).map(lambda i: i + 1, num_parallel_calls=2)
              .prefetch(3).make_one_shot_iterator())
        nxt = it.get_next()
    sess = fm.Session(graph)
    assert sess.run(nxt) == 1
    first = set(data_threads()) - before
    assert len(first) == 3  # the prefetch producer and two map workers
    it.seek(sess, 100)  # the old pipeline's threads stop; the new one starts on reading
    assert sess.run(nxt) == 101
    assert not any(t.is_alive() for t in first)
    second = set(data_threads()) - before
    assert len(second) == 3 and not second & first
    sess.close()
    wait_until(lambda: not any(t.is_alive() for t in second), "the pipeline's threads end", 10)
    assert set(data_threads()) <= before


def test_closing_the_session_wakes_a_step_waiting_for_data():
    release = threading.Event()

    def stalled():
        yield 0
        release.wait(30)  # a source that has nothing more for a while
        yield 1

    graph = fm.Graph()
    with graph.as_default():
        nxt = (Dataset.from_generator(stalled, fm.int64).prefetch(1)
               .make_one_shot_iterator().get_next())
    sess = fm.Session(graph)
    assert sess.run(nxt) == 0
    errors = []

    def wait_for_one():
        try:
            sess.run(nxt)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    waiter = threading.Thread(target=wait_for_one, daemon=True)
    waiter.start()
    time.sleep(0.1)  # the step is waiting on the prefetch buffer now (or soon)
    closer = threading.Thread(target=sess.close, daemon=True)
    closer.start()
    waiter.join(10)
    assert not waiter.is_alive() and len(errors) == 1
    assert isinstance(errors[0], (CancelledError, fm.SessionClosedError)), errors
    release.set()
    closer.join(15)
    assert not closer.is_alive()
    wait_until(lambda: not data_threads(), "the prefetch thread ends", 10)
