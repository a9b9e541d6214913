"""Tensor transport throughput across two processes on loopback.

A server process holds float32 tensors of each size: sent into a Rendezvous behind a
TensorServer, behind a second TensorServer with a job's TLS credentials
(``transport_tls``: the handshake of ``flowmill.runtime.tls``, then sealed frames), behind
a raw TCP socket (``sendall`` of the same buffer) and behind a Python gRPC unary method
(identity serializers, message limits off, the reply bytes prebuilt outside the timing).
This process pulls each one with ``TensorClient.recv`` (plain, and sealed with the
worker's credentials), with ``recv_into`` a preallocated buffer on the raw socket, and
through a gRPC stub; the methods are timed interleaved, in rotating order, and each figure
is the median of the repetitions. Small-tensor latency is timed too: a float32 scalar
pulled with ``TensorClient.recv`` (plain and sealed) and a 4-byte gRPC unary call, in
microseconds per call (median of blocks). ``transport_fresh`` is the same client with its
buffer pool off (every receive faults in new pages), shown for context. MB is 10^6 bytes.

    python bench/transport.py [--sizes 4,64,256] [--reps 7] [--no-grpc]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from flowmill.operator.certificates import write_run
from flowmill.runtime.rendezvous import Rendezvous, make_key
from flowmill.runtime.tls import TaskCredentials
from flowmill.runtime.transport import BufferPool, TensorClient, TensorServer

SRC = "/job:ps/task:0/device:CPU:0"
DST = "/job:worker/task:0/device:CPU:0"
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
WARMUP = 2
SCALAR_BLOCK = 500  # calls per timed block of the latency figure
SCALAR_BLOCKS = 7


def tensor_key(mib: int, method: str, i: int) -> str:
    return make_key(SRC, DST, f"t{mib}_{method}", i)


def serve(sizes: list[int], rounds: int, with_grpc: bool, tls_dir: str) -> None:
    """The producer: announces its ports on stdout, serves until stdin closes."""
    arrays = {m: np.arange((m << 20) // 4, dtype=np.float32) for m in sizes}
    rdv = Rendezvous()
    scalar = np.float32(1.5)
    for method in ("scalar", "scalar_tls"):
        for i in range(SCALAR_BLOCK * (SCALAR_BLOCKS + 1)):
            rdv.send(tensor_key(0, method, i), scalar)
    for m, arr in arrays.items():
        for method in ("transport", "transport_fresh", "transport_tls"):
            for i in range(rounds):
                rdv.send(tensor_key(m, method, i), arr)  # the same buffer, never copied
    server = TensorServer(rdv)
    sealed = TensorServer(rdv, credentials=TaskCredentials(os.path.join(tls_dir, "ps-0")))

    raw = socket.create_server(("127.0.0.1", 0))

    def raw_loop() -> None:
        conn, _ = raw.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while req := conn.recv(8):
                conn.sendall(memoryview(arrays[struct.unpack("<Q", req)[0]].view(np.uint8)))

    threading.Thread(target=raw_loop, daemon=True).start()
    grpc_port = None
    if with_grpc:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        payloads = {m: arr.tobytes() for m, arr in arrays.items()}
        payloads[0] = scalar.tobytes()
        handler = grpc.method_handlers_generic_handler(
            "bench",
            {
                "Get": grpc.unary_unary_rpc_method_handler(
                    lambda req, ctx: payloads[struct.unpack("<Q", req)[0]]
                )
            },
        )
        gserver = grpc.server(ThreadPoolExecutor(2), options=GRPC_OPTIONS)
        gserver.add_generic_rpc_handlers((handler,))
        grpc_port = gserver.add_insecure_port("127.0.0.1:0")
        gserver.start()
    ports = {"transport": server.address, "transport_tls": sealed.address,
             "raw": raw.getsockname()[1], "grpc": grpc_port}
    print(json.dumps(ports), flush=True)
    sys.stdin.read()
    server.close()
    sealed.close()


class Pullers:
    """One callable per method, each pulling ``mib`` MiB and returning the array."""

    def __init__(self, ports: dict, with_grpc: bool, tls_dir: str):
        self.client = TensorClient(ports["transport"])
        self.sealed = TensorClient(
            ports["transport_tls"], credentials=TaskCredentials(os.path.join(tls_dir, "worker-0")),
            peer_name="ps-0")
        self.fresh = TensorClient(ports["transport"], buffer_pool=BufferPool(capacity=0))
        self.raw = socket.create_connection(("127.0.0.1", ports["raw"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw_buffers: dict[int, np.ndarray] = {}
        self.counters: dict[tuple[int, str], int] = {}
        self.stub = None
        if with_grpc:
            import grpc

            self.channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}", options=GRPC_OPTIONS)
            self.stub = self.channel.unary_unary("/bench/Get")

    def methods(self) -> list[str]:
        return (["transport", "transport_tls", "raw_socket", "transport_fresh"]
                + (["grpc"] if self.stub else []))

    def pull(self, method: str, mib: int) -> np.ndarray:
        if method in ("transport", "transport_fresh", "transport_tls"):
            i = self.counters.get((mib, method), 0)
            self.counters[(mib, method)] = i + 1
            client = {"transport": self.client, "transport_fresh": self.fresh,
                      "transport_tls": self.sealed}[method]
            return client.recv(tensor_key(mib, method, i), timeout=60)
        if method == "raw_socket":
            buf = self.raw_buffers.get(mib)
            if buf is None:
                buf = self.raw_buffers[mib] = np.ones((mib << 20) // 4, np.float32)
            self.raw.sendall(struct.pack("<Q", mib))
            view, got = memoryview(buf.view(np.uint8)), 0
            while got < len(view):
                n = self.raw.recv_into(view[got:], len(view) - got)
                if n == 0:
                    raise ConnectionError("raw server closed")
                got += n
            return buf
        reply = self.stub(struct.pack("<Q", mib), timeout=120)
        return np.frombuffer(reply, np.float32)


def measure(pullers: Pullers, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    results: dict[int, dict[str, float]] = {}
    methods = pullers.methods()
    for mib in sizes:
        expected = np.arange((mib << 20) // 4, dtype=np.float32)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(WARMUP + reps):
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            for method in order:
                t = time.perf_counter()
                arr = pullers.pull(method, mib)
                elapsed = time.perf_counter() - t
                if rep == 0 and not np.array_equal(arr, expected):
                    raise AssertionError(f"{method} delivered wrong bytes for {mib} MiB")
                del arr
                if rep >= WARMUP:
                    times[method].append(elapsed)
        nbytes = mib << 20
        results[mib] = {m: nbytes / statistics.median(ts) / 1e6 for m, ts in times.items()}
        line = "  ".join(f"{m} {v:8.0f}" for m, v in results[mib].items())
        print(f"{mib:5d} MiB  MB/s: {line}", flush=True)
    return results


def measure_latency(pullers: Pullers) -> dict[str, float]:
    """Microseconds per call for a scalar: TensorClient.recv (plain and sealed) and a gRPC
    unary call."""
    n = SCALAR_BLOCK * (SCALAR_BLOCKS + 1)
    keys = {"transport": iter([tensor_key(0, "scalar", i) for i in range(n)]),
            "transport_tls": iter([tensor_key(0, "scalar_tls", i) for i in range(n)])}
    clients = {"transport": pullers.client, "transport_tls": pullers.sealed}
    request = struct.pack("<Q", 0)
    blocks: dict[str, list[float]] = {"transport": [], "transport_tls": [], "grpc": []}
    for block in range(SCALAR_BLOCKS + 1):  # the first block warms up
        for method, client in clients.items():
            t = time.perf_counter()
            for _ in range(SCALAR_BLOCK):
                client.recv(next(keys[method]), timeout=60)
            if block:
                blocks[method].append((time.perf_counter() - t) / SCALAR_BLOCK * 1e6)
        if pullers.stub is not None:
            t = time.perf_counter()
            for _ in range(SCALAR_BLOCK):
                pullers.stub(request, timeout=60)
            if block:
                blocks["grpc"].append((time.perf_counter() - t) / SCALAR_BLOCK * 1e6)
    result = {m: statistics.median(v) for m, v in blocks.items() if v}
    print("scalar     us/call: " + "  ".join(f"{m} {v:6.0f}" for m, v in result.items()))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,64,256", help="MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-grpc", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tls-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with_grpc = not args.no_grpc
    if with_grpc:
        try:
            import grpc  # noqa: F401
        except ImportError:
            with_grpc = False
    if args.serve:
        serve(sizes, WARMUP + args.reps, with_grpc, args.tls_dir)
        return
    tls_dir = tempfile.mkdtemp(prefix="bench-tls-")
    write_run(tls_dir, "bench", ["ps-0", "worker-0"])
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--sizes", args.sizes]
    cmd += ["--reps", str(args.reps), "--tls-dir", tls_dir]
    cmd += [] if with_grpc else ["--no-grpc"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(child.stdout.readline())
        print(f"server pid {child.pid}, client pid {os.getpid()}; {os.cpu_count()} CPUs")
        pullers = Pullers(ports, with_grpc, tls_dir)
        latency = measure_latency(pullers)
        results = measure(pullers, sizes, args.reps)
    finally:
        child.stdin.close()
        child.wait(30)
        shutil.rmtree(tls_dir, ignore_errors=True)
    top = results[max(sizes)]
    print(
        json.dumps(
            {
                "bench": "transport",
                "size_mib": max(sizes),
                "transport_mb_per_s": round(top["transport"]),
                "raw_socket_mb_per_s": round(top["raw_socket"]),
                "grpc_mb_per_s": round(top["grpc"]) if "grpc" in top else None,
                "transport_fresh_mb_per_s": round(top["transport_fresh"]),
                "transport_tls_mb_per_s": round(top["transport_tls"]),
                "ratio_vs_raw": round(top["transport"] / top["raw_socket"], 3),
                "tls_vs_plain": round(top["transport_tls"] / top["transport"], 3),
                "transport_scalar_us": round(latency["transport"], 1),
                "transport_tls_scalar_us": round(latency["transport_tls"], 1),
                "grpc_scalar_us": round(latency["grpc"], 1) if "grpc" in latency else None,
                "by_size_mib": {
                    str(m): {k: round(v) for k, v in r.items()} for m, r in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
