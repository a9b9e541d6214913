"""Checkpoint save and restore throughput beside the store's raw put/get of the same bytes.

A model of ``--size-mb`` (default 1 GiB) of float32 weights is split over ``--shards``
shards (default 2), each two large matrices and their biases, as parameter-server tasks
would hold them. Save is ``write_shard`` per shard plus ``commit``; restore is
``restore_latest`` (listing, manifest, fetch, size and CRC32C checks, arrays). The peer is
the same obstore client putting and getting one bytes blob per shard of the same size with
its defaults (one ``put``, one ``get`` per blob), so the ratio is what the checkpoint format
and its checks cost, less what restore gains by fetching tensor-aligned ranges
concurrently. After an untimed warm-up, rounds alternate which side goes first and the
median round is reported; on ``file://`` both sides read back through the page cache alike.

Then the same model as variables on ``--shards`` parameter-server processes (``python -m
flowmill.runtime.server``), saved the way a job saves (``Saver``: each PS uploads
its own shard, the worker commits) and restored the way a job restores (each PS reads
its own shard and assigns it): ``ps_save_mb_per_s`` and ``ps_restore_mb_per_s`` end to
end, and ``ps_stall_ms``, how long the save step holds training up, beside
``host_copy_ms``, what copying the model to host memory once costs in this process.

    python bench/checkpoint.py [--uri file:///dir | memory:// | s3://bucket/prefix]
                               [--size-mb 1024] [--shards 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from functools import partial

import numpy as np

from flowmill.kernels import checkpoint_store as C


def make_shards(total_bytes: int, shards: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Two (rows x 1024) float32 kernels and a bias each per shard, filling total_bytes."""
    rng = np.random.default_rng(seed)
    cols = 1024
    rows = max(1, total_bytes // (shards * 2 * cols * 4))
    out = []
    for s in range(shards):
        tensors = {}
        for k in range(2):
            layer = 2 * s + k
            tensors[f"layer{layer}/kernel"] = rng.standard_normal((rows, cols), np.float32)
            tensors[f"layer{layer}/bias"] = rng.standard_normal(cols, np.float32)
        out.append(tensors)
    return out


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", help="checkpoint location (default: file:// under a temp dir)")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    tmp = None
    uri = args.uri
    if uri is None:
        tmp = tempfile.mkdtemp(prefix="flowmill-ckpt-bench-")
        uri = f"file://{tmp}"
    store, prefix = C.open_store(uri)
    prefix = "/".join(p for p in (prefix, f"bench-{int(time.time())}") if p)
    try:
        result = run(store, prefix, uri, args)
        if not uri.startswith("memory:"):  # each process opens its own memory store
            result.update(run_on_ps(f"{uri.rstrip('/')}/{prefix.rsplit('/', 1)[-1]}-ps", args))
    finally:
        leftovers = [m["path"] for batch in store.list(prefix) for m in batch]
        if leftovers:
            store.delete(leftovers)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


def run(store, prefix: str, uri: str, args) -> dict:
    shards = make_shards(args.size_mb << 20, args.shards)
    kernels = [f"{n} {t.shape}" for n, t in shards[0].items() if t.ndim == 2]
    print(f"store {uri}: {len(shards)} shards, each {', '.join(kernels)} and biases")
    raw_paths = [f"{prefix}/raw/blob-{i}" for i in range(len(shards))]

    def save(step: int) -> list[int]:
        infos = [
            C.write_shard(store, prefix, step, f"ps-{i}", tensors)
            for i, tensors in enumerate(shards)
        ]
        C.commit(store, prefix, step, infos, {"bench": "checkpoint"})
        return [info.size for info in infos]

    # Warm-up round, untimed: it also gives the shard sizes the raw blobs must match.
    sizes = save(0)
    total = sum(sizes)
    blob = np.random.default_rng(1).bytes(max(sizes))
    views = [blob if n == len(blob) else memoryview(blob)[:n] for n in sizes]

    def raw_put() -> None:
        # The same client moving the same number of bytes, one blob per shard.
        for path, view in zip(raw_paths, views, strict=True):
            store.put(path, view)

    def restore(step: int) -> dict:
        manifest, arrays = C.restore_latest(store, prefix)
        assert manifest.step == step
        return arrays

    arrays = restore(0)
    for i, tensors in enumerate(shards):
        for name, value in tensors.items():
            assert np.array_equal(arrays[f"ps-{i}"][name], value), name
    del arrays

    def raw_get() -> None:
        assert [len(store.get(p).bytes()) for p in raw_paths] == sizes

    raw_put()
    times: dict[str, list[float]] = {"save": [], "raw_put": [], "restore": [], "raw_get": []}
    for step in range(1, args.rounds + 1):
        C.prune(store, prefix, keep=1)
        store.delete(raw_paths)
        writes = [("save", partial(save, step)), ("raw_put", raw_put)]
        reads = [("restore", partial(restore, step)), ("raw_get", raw_get)]
        if step % 2 == 0:  # alternate who goes first
            writes.reverse()
            reads.reverse()
        for name, fn in writes + reads:
            times[name].append(timed(fn)[0])
        line = ", ".join(f"{k} {total / v[-1] / 1e6:6.0f} MB/s" for k, v in times.items())
        print(f"round {step}: {line}")

    rate = {k: round(total / statistics.median(v) / 1e6, 1) for k, v in times.items()}
    print(
        f"save    {rate['save']:8.1f} MB/s   vs raw put {rate['raw_put']:8.1f} MB/s "
        f"({rate['save'] / rate['raw_put']:.2f}x)"
    )
    print(
        f"restore {rate['restore']:8.1f} MB/s   vs raw get {rate['raw_get']:8.1f} MB/s "
        f"({rate['restore'] / rate['raw_get']:.2f}x)"
    )
    return {
        "bench": "checkpoint",
        "uri": uri,
        "bytes": total,
        "shards": len(shards),
        "rounds": args.rounds,
        "save_mb_per_s": rate["save"],
        "restore_mb_per_s": rate["restore"],
        "raw_put_mb_per_s": rate["raw_put"],
        "raw_get_mb_per_s": rate["raw_get"],
    }


def run_on_ps(uri: str, args) -> dict:
    """The model's variables on PS processes (the shapes ``make_shards`` gives), saved and
    restored as a job does it."""
    import os
    import subprocess
    import sys

    import flowmill.runtime as fm
    from flowmill.launcher.local import free_ports
    from flowmill.runtime.cluster import ENV_VAR, ClusterSpec, TaskConfig
    from flowmill.runtime.distributed import DistributedSession
    from flowmill.runtime.initializers import random_normal
    from flowmill.runtime.saver import Saver

    *ps_ports, worker_port = free_ports(args.shards + 1)
    spec = ClusterSpec.from_dict(
        {"ps": [f"127.0.0.1:{p}" for p in ps_ports], "worker": [f"127.0.0.1:{worker_port}"]}
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flowmill.runtime.server"],
            env={**os.environ, ENV_VAR: TaskConfig(spec, "ps", i).to_json()},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(args.shards)
    ]
    try:
        rows = max(1, (args.size_mb << 20) // (args.shards * 2 * 1024 * 4))
        g = fm.Graph(seed=0)
        with g.as_default():
            variables = []
            for s in range(args.shards):
                with fm.device(f"/job:ps/task:{s}"):
                    for k in range(2):
                        layer = 2 * s + k
                        for part, shape in (("kernel", (rows, 1024)), ("bias", (1024,))):
                            initializer = random_normal(seed=layer)
                            name = f"layer{layer}/{part}"
                            variables.append(fm.Variable(initializer, shape=shape, name=name))
            init = fm.global_variables_initializer()
        sess = DistributedSession(g, TaskConfig(spec, "worker", 0), step_timeout=600)
        deadline = time.monotonic() + 60
        while True:
            try:
                sess.run(init)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        saver = Saver(sess, uri, keep=1)
        total = sum(int(np.prod(v.shape)) * 4 for v in variables)
        host = {v.name: np.ones(v.shape, np.float32) for v in variables}
        times: dict[str, list[float]] = {"stall": [], "save": [], "restore": [], "copy": []}
        for step in range(args.rounds + 1):
            start = time.perf_counter()
            saver.snapshot(sess, step)
            stalled = time.perf_counter() - start
            saver.commit_step(sess, step)
            saved = time.perf_counter() - start
            restore_s, restored = timed(lambda: saver.restore(sess))
            assert restored == step
            copy_s, _ = timed(lambda: [a.copy() for a in host.values()])
            if step:  # the first round warms up
                for k, v in zip(times, (stalled, saved, restore_s, copy_s), strict=True):
                    times[k].append(v)
            print(
                f"ps round {step}: stall {stalled * 1e3:.1f} ms, save {total / saved / 1e6:.0f} "
                f"MB/s, restore {total / restore_s / 1e6:.0f} MB/s, host copy "
                f"{copy_s * 1e3:.0f} ms"
            )
        sess.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ps_save_mb_per_s": round(total / med["save"] / 1e6, 1),
        "ps_restore_mb_per_s": round(total / med["restore"] / 1e6, 1),
        "ps_stall_ms": round(med["stall"] * 1e3, 2),
        "host_copy_ms": round(med["copy"] * 1e3, 1),
    }


if __name__ == "__main__":
    main()
