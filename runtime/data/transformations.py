"""Transformations: a dataset made from another one (``shuffle``, ``repeat``, ``batch``,
``prefetch``, ``shard``, ``take``, ``skip``; ``map`` has ``mapping`` to itself).

Each keeps random access where its input has it and the mapping of indices is
arithmetic (``shard``, ``take``, ``skip``, ``repeat``, a sequential ``map``), so a chain
like ``from_tensor_slices(...).shard(n, i).shuffle(b).repeat().batch(k)`` reads each batch
with one gather and fast-forwards without reading. ``shuffle`` over such an input keeps
indices, not elements, in its buffer: its output is a gather of the drawn indices, and
skipping ``n`` elements costs ``n`` draws and nothing else.

Every random choice is made by a ``numpy.random.Generator`` seeded from the shuffle's
seed and the epoch (the iteration counts of the enclosing ``repeat``), and draws are
consumed one per element, so a stream is a function of its seed and its position: the
same seed gives the same elements, and a pipeline opened at position ``p`` yields what
an uninterrupted one yields from ``p`` on.
"""

from __future__ import annotations

import numpy as np

from .dataset import AUTOTUNE, Dataset, builds, check_count, known
from .streams import Context, Gather, PrefetchStream, Stream
from .structure import INFINITE, UNKNOWN, block_len, concat

DEFAULT_PREFETCH = 2
_DRAWS = 1024  # random numbers drawn at a time by a shuffle


@builds("shuffle")
class ShuffleDataset(Dataset):
    """TensorFlow's shuffle: a buffer filled with the first ``buffer_size`` elements; each
    output is a uniformly drawn buffer slot, refilled with the next input element."""

    def __init__(self, input: Dataset, buffer_size: int, seed=None,
                 reshuffle_each_iteration: bool = True):
        self._inputs = (input,)
        self._size = check_count(buffer_size, "shuffle: buffer_size")
        if self._size == 0:
            raise ValueError("shuffle: buffer_size must be positive")
        self.seed = None if seed is None else int(seed)
        self._reshuffle = bool(reshuffle_each_iteration)
        self.structure = input.structure
        self.label = f"{input.label}.shuffle({self._size})"

    def with_seed(self, seed: int) -> ShuffleDataset:
        clone = self._with_inputs(self._inputs)
        clone.seed = int(seed)
        return clone

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        if self.seed is None:
            raise RuntimeError(f"{self.label} has no seed yet (its iterator gives it one)")
        # Without reshuffling every epoch draws as the first one does.
        epochs = epoch if self._reshuffle else (0,) * len(epoch)
        entropy = [self.seed & (2**64 - 1), 0x5F, *epochs]
        return _ShuffleStream(self, np.random.default_rng(entropy), ctx, epoch)


class _ShuffleStream(Stream):
    """The shuffle buffer. With random access it holds input indices (an int64 array):
    while refills last, a run of draws is applied at once with NumPy, making the same
    choices as one draw at a time (a slot drawn twice in a run gives, the second time, the
    index that refilled it), so a batch or a skip costs a few array operations, not a
    Python loop per element. Without random access it holds the elements, one at a time."""

    def __init__(self, ds: ShuffleDataset, rng: np.random.Generator, ctx, epoch):
        self.label, self.size, self.rng = ds.label, ds._size, rng
        self.gather = ds._input._gather()
        self.input = None if self.gather is not None else ds._input._stream(ctx, epoch)
        self.filled = self.exhausted = False
        self.buffer: list = []  # elements, without random access
        self.slots = np.empty(0, np.int64)  # input indices, with random access
        self.length = 0  # of them in use
        self._tail: list[int] | None = None  # the slots as a list, once refills are over
        self.ordinal = 0  # the next input index to refill from
        self._draws = np.empty(0, np.uint64)
        self._drawn = 0  # of _draws used

    # ---- random numbers: uint32s drawn _DRAWS at a time, used strictly in order

    def _refill_draws(self) -> None:
        if self._drawn == len(self._draws):
            self._draws = self.rng.integers(0, 1 << 32, _DRAWS, dtype=np.uint64)
            self._drawn = 0

    def _next_draws(self, m: int) -> np.ndarray:
        parts = []
        while m > 0:
            self._refill_draws()
            k = min(m, len(self._draws) - self._drawn)
            parts.append(self._draws[self._drawn:self._drawn + k])
            self._drawn, m = self._drawn + k, m - k
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _draw(self, n: int) -> int:
        """A uniform slot in [0, n)."""
        self._refill_draws()
        r = int(self._draws[self._drawn])
        self._drawn += 1
        return (r * n) >> 32

    # ---- without random access

    def _take_element(self):
        buffer = self.buffer
        if not self.filled:
            self.filled = True
            while len(buffer) < self.size and (item := self.input.next()) is not None:
                buffer.append(item)
            self.exhausted = len(buffer) < self.size
        if not buffer:
            return None
        i = self._draw(len(buffer))
        out = buffer[i]
        refill = None if self.exhausted else self.input.next()
        if refill is None:
            self.exhausted = True
            buffer[i] = buffer[-1]
            buffer.pop()
        else:
            buffer[i] = refill
        return out

    # ---- with random access

    def _refills(self) -> int | None:
        """Input indices left to refill from (None: without end)."""
        count = self.gather.count
        return None if count is None else count - self.ordinal

    def _fill_indices(self) -> None:
        self.filled = True
        left = self._refills()
        k = self.size if left is None else min(self.size, left)
        self.slots, self.length, self.ordinal = np.arange(k, dtype=np.int64), k, k

    def _take_indices(self, n: int) -> np.ndarray:
        """The next ``n`` input indices (fewer at the end)."""
        if not self.filled:
            self._fill_indices()
        parts, got = [], 0
        while got < n and self.length:
            left = self._refills()
            if left is None or left > 0:
                m = n - got if left is None else min(n - got, left)
                parts.append(self._run(m))
                got += m
            else:  # refills are over: the buffer shrinks by one with every draw
                k = min(n - got, self.length)
                parts.append(self._drain(k))
                got += k
        return np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else
                                                             np.empty(0, np.int64))

    def _drain(self, k: int) -> np.ndarray:
        """``k`` draws once refills are over: the slot drawn takes the last one's index."""
        if self._tail is None:
            self._tail = self.slots[:self.length].tolist()
        tail, length = self._tail, self.length
        sizes = np.arange(length, length - k, -1, dtype=np.uint64)
        out = []
        for i in ((self._next_draws(k) * sizes) >> np.uint64(32)).tolist():
            out.append(tail[i])
            length -= 1
            tail[i] = tail[length]
        del tail[length:]
        self.length = length
        return np.asarray(out, np.int64)

    def _run(self, m: int) -> np.ndarray:
        """``m`` draws from the full buffer, each slot refilled with the next index."""
        slots = ((self._next_draws(m) * np.uint64(self.length)) >> np.uint64(32)).astype(
            np.int64)
        refill = np.arange(self.ordinal, self.ordinal + m, dtype=np.int64)
        self.ordinal += m
        out = self.slots[slots]
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        again = ordered[1:] == ordered[:-1]  # a slot drawn before in this run
        out[order[1:][again]] = refill[order[:-1][again]]
        last = np.append(~again, True)  # a slot keeps the last index that refilled it
        self.slots[ordered[last]] = refill[order[last]]
        return out

    # ---- the stream

    def next(self) -> tuple | None:
        if self.gather is None:
            return self._take_element()
        taken = self._take_indices(1)
        return self.gather.get(int(taken[0])) if len(taken) else None

    def next_block(self, n: int, where: str | None = None) -> tuple | None:
        if self.gather is None:
            return super().next_block(n, where)
        taken = self._take_indices(n)
        return self.gather.take(taken) if len(taken) else None

    def skip(self, n: int) -> int:
        if self.gather is None:
            done = 0
            while done < n and self._take_element() is not None:
                done += 1
            return done
        done = 0
        while done < n:
            k = len(self._take_indices(min(n - done, 1 << 16)))
            done += k
            if k == 0:
                break
        return done


@builds("repeat")
class RepeatDataset(Dataset):
    def __init__(self, input: Dataset, count=None):
        self._inputs = (input,)
        self._count = None if count is None else check_count(count, "repeat: count", True)
        if self._count == -1:
            self._count = None
        self.structure = input.structure
        self.label = f"{input.label}.repeat({'' if self._count is None else self._count})"

    def _cardinality(self) -> int:
        c = self._input._cardinality()
        if c == 0 or self._count == 0:
            return 0
        if self._count is None or c == INFINITE:
            return INFINITE
        return c * self._count if known(c) else UNKNOWN

    def _gather(self) -> Gather | None:
        g = self._input._gather()
        if g is None or g.count is None:
            return g if g is not None and self._count != 0 else None
        c = g.count
        if c == 0 or self._count == 0:
            return Gather(0, g.get, g.take)
        total = None if self._count is None else c * self._count

        def take_range(lo: int, hi: int) -> tuple:
            if lo // c == (hi - 1) // c:
                return g.range_block(lo % c, (hi - 1) % c + 1)
            return g.take(np.arange(lo, hi, dtype=np.int64) % c)

        return Gather(total, lambda i: g.get(i % c), lambda idx: g.take(idx % c), take_range)

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _RepeatStream(self, ctx, epoch)


class _RepeatStream(Stream):
    def __init__(self, ds: RepeatDataset, ctx: Context, epoch: tuple[int, ...]):
        self.ds, self.ctx, self.epoch, self.label = ds, ctx, epoch, ds.label
        self.e = 0  # this repeat's epoch
        self.current: Stream | None = None
        self.produced = 0  # elements of the current epoch so far
        self.empty = False  # an epoch had no element: so will every other one

    def _open(self) -> Stream | None:
        if self.empty or (self.ds._count is not None and self.e >= self.ds._count):
            return None
        if self.current is None:
            self.current = self.ds._input._stream(self.ctx, (*self.epoch, self.e))
            self.produced = 0
        return self.current

    def _end_epoch(self) -> None:
        self.empty = self.produced == 0
        self.current = None
        self.e += 1

    def next(self) -> tuple | None:
        while (stream := self._open()) is not None:
            element = stream.next()
            if element is not None:
                self.produced += 1
                return element
            self._end_epoch()
        return None

    def next_block(self, n: int, where: str | None = None) -> tuple | None:
        blocks, have = [], 0
        while have < n and (stream := self._open()) is not None:
            block = stream.next_block(n - have, where)
            if block is None:
                self._end_epoch()
                continue
            k = block_len(block)
            self.produced += k
            blocks.append(block)
            have += k
        return concat(blocks) if blocks else None

    def skip(self, n: int) -> int:
        done = 0
        c = self.ds._input._cardinality()
        count = self.ds._count
        while done < n:
            if self.current is None and not self.empty and known(c) and c > 0:
                whole = (n - done) // c  # whole epochs: counted, not opened
                if count is not None:
                    whole = min(whole, count - self.e)
                if whole > 0:
                    self.e, done = self.e + whole, done + whole * c
                    continue
            stream = self._open()
            if stream is None:
                break
            k = stream.skip(n - done)
            self.produced += k
            done += k
            if done < n:
                self._end_epoch()
        return done


@builds("batch")
class BatchDataset(Dataset):
    def __init__(self, input: Dataset, batch_size: int, drop_remainder: bool = False):
        self._inputs = (input,)
        self._size = check_count(batch_size, "batch: batch_size")
        if self._size == 0:
            raise ValueError("batch: batch_size must be positive")
        self._drop = bool(drop_remainder)
        self.structure = input.structure.batched(self._size if self._drop else None)
        self.label = f"{input.label}.batch({self._size})"

    def _cardinality(self) -> int:
        c = self._input._cardinality()
        if not known(c):
            return c
        return c // self._size if self._drop else -(-c // self._size)

    def _probe(self) -> tuple | None:
        probe = self._input._probe()
        if probe is None:
            return None
        return tuple(np.broadcast_to(p, (self._size, *p.shape)) for p in probe)

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _BatchStream(self._input._stream(ctx, epoch), self._size, self._drop, self.label)


class _BatchStream(Stream):
    def __init__(self, input: Stream, size: int, drop: bool, label: str):
        self.input, self.size, self.drop, self.label = input, size, drop, label
        self.ended = False

    def next(self) -> tuple | None:
        if self.ended:
            return None
        block = self.input.next_block(self.size, self.label)
        if block is None or block_len(block) < self.size:
            self.ended = True
            if block is None or self.drop:
                return None
        return block

    def skip(self, n: int) -> int:
        if self.ended or n == 0:
            return 0
        got = self.input.skip(n * self.size)
        if got == n * self.size:
            return n
        self.ended = True
        return got // self.size + (0 if self.drop or got % self.size == 0 else 1)


@builds("prefetch")
class PrefetchDataset(Dataset):
    def __init__(self, input: Dataset, buffer_size: int):
        self._inputs = (input,)
        size = DEFAULT_PREFETCH if buffer_size == AUTOTUNE else buffer_size
        self._size = check_count(size, "prefetch: buffer_size")
        self.structure = input.structure
        self.label = f"{input.label}.prefetch({buffer_size})"

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        stream = self._input._stream(ctx, epoch)
        return stream if self._size == 0 else PrefetchStream(stream, self._size, ctx, self.label)


@builds("shard")
class ShardDataset(Dataset):
    is_shard = True

    def __init__(self, input: Dataset, num_shards: int, index: int):
        self._inputs = (input,)
        self._n = check_count(num_shards, "shard: num_shards")
        self._i = check_count(index, "shard: index")
        if not self._i < self._n:
            raise ValueError(f"shard: index must be in [0, {self._n}), got {self._i}")
        self.structure = input.structure
        self.label = f"{input.label}.shard({self._n}, {self._i})"

    def _count(self, c: int) -> int:
        return max(0, -(-(c - self._i) // self._n))

    def _cardinality(self) -> int:
        c = self._input._cardinality()
        return self._count(c) if known(c) else c

    def _gather(self) -> Gather | None:
        g = self._input._gather()
        if g is None:
            return None
        n, i = self._n, self._i
        return Gather(None if g.count is None else self._count(g.count),
                      lambda j: g.get(i + j * n), lambda idx: g.take(i + idx * n))

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _ShardStream(self._input._stream(ctx, epoch), self._n, self._i)


class _ShardStream(Stream):
    def __init__(self, input: Stream, n: int, i: int):
        self.input, self.n, self.gap = input, n, i  # gap: input elements before the next

    def next(self) -> tuple | None:
        if self.input.skip(self.gap) < self.gap:
            self.gap = 0
            return None
        self.gap = self.n - 1
        return self.input.next()

    def skip(self, m: int) -> int:
        if m == 0:
            return 0
        gap = self.gap
        want = gap + 1 + (m - 1) * self.n
        got = self.input.skip(want)
        if got == want:
            self.gap = self.n - 1
            return m
        self.gap = 0  # the input has ended
        return 0 if got <= gap else 1 + (got - gap - 1) // self.n


@builds("take")
class TakeDataset(Dataset):
    def __init__(self, input: Dataset, count: int):
        self._inputs = (input,)
        self._limit = check_count(count, "take: count", allow_all=True)
        self.structure = input.structure
        self.label = f"{input.label}.take({count})"

    def _cardinality(self) -> int:
        c = self._input._cardinality()
        if self._limit == -1:
            return c
        return min(c, self._limit) if known(c) else (self._limit if c == INFINITE else c)

    def _gather(self) -> Gather | None:
        g = self._input._gather()
        if g is None or self._limit == -1:
            return g
        count = self._limit if g.count is None else min(g.count, self._limit)
        return Gather(count, g.get, g.take, g.take_range)

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _TakeStream(self._input._stream(ctx, epoch), self._limit)


class _TakeStream(Stream):
    def __init__(self, input: Stream, limit: int):
        self.input, self.left = input, limit  # -1: no limit

    def next(self) -> tuple | None:
        if self.left == 0:
            return None
        element = self.input.next()
        if element is not None and self.left > 0:
            self.left -= 1
        return element

    def skip(self, n: int) -> int:
        done = self.input.skip(n if self.left < 0 else min(n, self.left))
        if self.left > 0:
            self.left -= done
        return done


@builds("skip")
class SkipDataset(Dataset):
    def __init__(self, input: Dataset, count: int):
        self._inputs = (input,)
        self._skip = check_count(count, "skip: count", allow_all=True)
        self.structure = input.structure
        self.label = f"{input.label}.skip({count})"

    def _cardinality(self) -> int:
        c = self._input._cardinality()
        if self._skip == -1:
            return 0 if c != INFINITE else INFINITE
        return max(0, c - self._skip) if known(c) else c

    def _gather(self) -> Gather | None:
        g = self._input._gather()
        if g is None:
            return None
        k = self._skip if self._skip >= 0 else (g.count if g.count is not None else 0)
        count = None if g.count is None else max(0, g.count - k)
        take_range = None if g.take_range is None else (lambda lo, hi: g.take_range(lo + k,
                                                                                    hi + k))
        return Gather(count, lambda i: g.get(i + k), lambda idx: g.take(idx + k), take_range)

    def _sequential(self, ctx: Context, epoch: tuple[int, ...]) -> Stream:
        return _SkipStream(self._input._stream(ctx, epoch), self._skip)


class _SkipStream(Stream):
    def __init__(self, input: Stream, pending: int):
        self.input, self.pending = input, pending  # -1: everything

    def _drop(self) -> None:
        if self.pending == -1:
            while self.input.skip(1 << 20) == 1 << 20:
                pass
        elif self.pending:
            self.input.skip(self.pending)
        self.pending = 0

    def next(self) -> tuple | None:
        self._drop()
        return self.input.next()

    def skip(self, n: int) -> int:
        self._drop()
        return self.input.skip(n)
