"""The null training step against parameter-server tasks (the TensorFlow paper's Figure 6).

Each worker fetches the model from the PS tasks and sends back an update of the same
shape, with no computation in between, so the step time is what the runtime costs to move
a model around: the control RPCs (one ``RunGraph`` per PS task per step), the tensor
pulls in both directions and the updates on the PS. The models:

- ``scalar``: one float32 variable;
- ``dense``: ``--dense-mb`` MB of float32 (default 100) in ``--dense-vars`` variables
  spread over the PS tasks; the worker reads every variable and adds ``value * 0.0``;
- ``sparse``: a ``ShardedEmbedding`` table of ``--sparse-gb`` GiB (float32, dim 64),
  one shard per PS task; a step looks up 32 random rows (gathered on the PS) and applies
  ``GradientDescent`` to a loss over them, which writes back just those rows.

Every PS task is ``python -m flowmill.runtime.server`` in a child process; each worker is
this script again (``--worker``) with its own ``FLOWMILL_CONFIG``, building the same graph
with ``replica_device_setter``. One set of PS tasks serves every worker count of a model:
the first worker initializes the variables, and all workers pass two barriers held by
this launcher (after setup, after warm-up), so the timed steps of all workers overlap.
Each worker reports its step times (it stops early after ``--max-seconds``, so a slow
configuration bounds the run instead of stretching it); the figure for a worker count is
the median over the steps of all its workers. The run ends with one JSON object on the
last line: ``{model}_ms`` maps each worker count to that median in milliseconds.

``--training async,sync`` (the default) runs each model in both modes. Async is the step
above: each worker's update is applied as it arrives. Sync sends the same bytes, but as
gradients into the PS tasks' accumulators (``SyncReplicasOptimizer`` aggregating every
worker's, with ``GradientDescent(0.0)``): the chief (the round's first worker, on a thread)
waits for all of them, applies the average and releases one token per worker, and a
worker's step ends when it has its token. The difference is what the sync machinery
costs per step. A sync round runs its steps to the end (its workers wait for each other,
so none may stop early at ``--max-seconds``). The sync figures are ``{model}_sync_ms``.

``--security plain,tls`` (the default) runs each model twice, on new PS tasks each time:
plain TCP, then with every task holding a job's TLS credentials (mutual TLS on gRPC, the
same handshake on the tensor channel, as ``spec.security.tls`` gives a job); the TLS
figures are ``{model}_tls_ms``. The tasks here share one network namespace, so the tensor
channel takes each task's local socket, whose bytes go unsealed after the handshake
(``runtime/tls.py``); sealed frames are what TCP between pods carries.

For the dense model the launcher also measures what one socket of the kind the tasks use
(``socket``: ``unix``, each task's local socket, where the platform has them, else
loopback ``tcp``) carries between two processes (``socket_mb_per_s``: a 256 MiB buffer,
``sendall`` into ``recv_into``, the best of three, before the rounds and again after
them, the better reading kept; ``socket_mb_per_s_readings`` has both) and reports each
round against the bound it sets:
``dense_100mb_bound_fraction`` is (the bytes of a round, the model out to every worker
and back, over that rate) / the median step.

Tables are initialized on their PS tasks, never sent from a worker: the zeros are a
broadcast of two thin ``Fill``s computed where the variable lives (a full-size ``Fill``
would be built once into the PS's plan and kept there, a second copy of the table). The
launcher stops a round when the machine's available memory falls under
``--min-free-gb``, and prints each PS task's peak resident memory per round, which shows
when a step copies a table instead of updating it in place.

    python bench/ps_null_step.py [--models scalar,dense,sparse] [--workers 1,2,4,8]
        [--ps 2] [--steps N] [--sparse-gb 1,4] [--dense-mb 100] [--training async,sync]
        [--security plain,tls] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Set before NumPy loads, in this process and (through the environment) every child: a
# null step does no BLAS work, and spinning pool threads would only steal the few cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import numpy as np  # noqa: E402

from flowmill.launcher.local import free_ports  # noqa: E402

PAPER_1_WORKER_MS = {"scalar": 1.8, "dense_100mb": 147, "sparse": "5-20"}
EMBEDDING_DIM = 64
IDS_PER_STEP = 32
FLOAT_BYTES = 4
# Default (timed steps, warm-up steps) per worker: a dense step moves the whole model twice.
DEFAULT_STEPS = {"scalar": (200, 20), "dense": (12, 3), "sparse": (200, 20)}
QUICK_STEPS = {"scalar": (40, 5), "dense": (4, 1), "sparse": (40, 5)}
START_ATTEMPTS = 3
PS_READY_TIMEOUT_S = 60.0
MIN_TIMED_STEPS = 3  # a worker stops at --max-seconds, but not before this many steps
PORT_TAKEN_EXIT = 3
# The launch line of a PS task: ``python -m flowmill.runtime.server``, which also ends
# when this launcher dies, however it dies (a PS holding a table must not outlive it).
PS_LAUNCH = (
    "import ctypes, os, runpy, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != {parent}:\n"
    "    sys.exit('the launcher is gone')\n"
    "sys.argv = ['python -m flowmill.runtime.server']\n"
    "runpy.run_module('flowmill.runtime.server', run_name='__main__', alter_sys=True)\n"
)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent exits (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid and os.getppid() != parent_pid:  # gone before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


# ---- the models


@dataclass(frozen=True)
class Model:
    kind: str  # scalar | dense | sparse
    nbytes: int

    @property
    def key(self) -> str:
        if self.kind == "dense":
            return f"dense_{self.nbytes / 1e6:g}mb"
        if self.kind == "sparse":
            return f"sparse_{self.nbytes / 2**30:g}gb"
        return self.kind

    @property
    def rows(self) -> int:
        """Rows of the embedding table (sparse only)."""
        return max(self.nbytes // (EMBEDDING_DIM * FLOAT_BYTES), 1)

    def spec(self) -> str:
        return f"{self.kind}:{self.nbytes}"

    @classmethod
    def parse(cls, spec: str) -> Model:
        kind, nbytes = spec.split(":")
        return cls(kind, int(nbytes))


def build(model: Model, cluster, worker_index: int, dense_vars: int, sync: Sync | None = None):
    """The graph every worker builds: (graph, init op, update op, ids placeholder or None,
    the sync optimizer or None)."""
    import flowmill.runtime as fm
    from flowmill.runtime.embedding import ShardedEmbedding
    from flowmill.runtime.placement import replica_device_setter
    from flowmill.runtime.replicas import SyncReplicasOptimizer

    num_ps = cluster.num_tasks("ps")
    graph = fm.Graph()
    worker_device = f"/job:worker/task:{worker_index}"
    setter = replica_device_setter(cluster, worker_device=worker_device)
    ids = opt = None
    with graph.as_default(), fm.device(setter):
        step = fm.train.get_or_create_global_step()
        if sync is not None:
            # A scope per round: its accumulators and token queues start afresh on the PS.
            opt = SyncReplicasOptimizer(
                fm.train.GradientDescent(0.0), sync.workers, name=f"sync_round_{sync.round}")
        if model.kind == "sparse":
            table = ShardedEmbedding(
                model.rows, EMBEDDING_DIM, num_ps, fm.initializers.zeros(), name="table"
            )
            variables = table.shards
            ids = fm.placeholder(fm.int32, (IDS_PER_STEP,), name="ids")
            loss = fm.reduce_sum(table.lookup(ids))
            # A zero rate keeps the step null; the looked-up rows' updates still travel.
            if opt is None:
                update = fm.train.GradientDescent(0.0).minimize(loss)
            else:
                update = opt.minimize(loss, step, worker_index=sync.index)
        else:
            variables = _dense_variables(model, dense_vars)
            zero = fm.constant(0.0, name="zero")
            # Read on the PS, multiplied on the worker, added on the PS: the bytes of the
            # model go to the worker and come back, as in the paper's null step.
            if opt is None:
                update = fm.group(*[v.assign_add(v.value() * zero) for v in variables])
            else:
                update = opt.apply_gradients([(v.value() * zero, v) for v in variables], step,
                                             worker_index=sync.index)
        init = fm.group(*[_zeros_on_ps(v) for v in variables], step.initializer, name="init")
    return graph, init, update, ids, opt


@dataclass(frozen=True)
class Sync:
    """A sync round as one of its workers sees it."""

    workers: int  # in the round, all aggregated
    index: int  # this worker's, in the round
    round: int  # the round's first task index: names its accumulators


def _dense_variables(model: Model, parts: int) -> list:
    import flowmill.runtime as fm

    if model.kind == "scalar":
        return [fm.Variable(fm.initializers.zeros(), shape=(), name="scalar")]
    total = max(model.nbytes // FLOAT_BYTES, parts)
    cols = 1000 if total >= 1000 * parts else 1
    rows = [total // cols // parts + (i < total // cols % parts) for i in range(parts)]
    return [
        fm.Variable(fm.initializers.zeros(), shape=(r, cols), name=f"dense_{i}")
        for i, r in enumerate(rows)
    ]


def _zeros_on_ps(v):
    """Assign zeros computed where ``v`` lives. A variable's own initializer would run
    on the worker under ``replica_device_setter`` and send the whole value over; a
    full-size ``Fill`` is kept by the plan that holds it. An outer sum of two thin ones is
    computed per run and dropped."""
    import flowmill.runtime as fm

    shape = tuple(v.shape)
    with fm.colocate_with(v.handle):
        if len(shape) < 2:
            value = fm.zeros(shape)
        else:
            value = fm.zeros(shape[:1] + (1,) * (len(shape) - 1)) + fm.zeros((1, *shape[1:]))
        return v.assign(value)


# ---- the socket's own rate

SOCKET_MIB = 256
SOCKET_SERVER = """
import os, socket, struct, sys
buf = bytearray({size})
if {unix}:
    address = "ps-null-step-socket-%d" % os.getpid()
    server = socket.socket(socket.AF_UNIX)
    server.bind("\\0" + address)
    server.listen()
else:
    server = socket.create_server(("127.0.0.1", 0))
    address = str(server.getsockname()[1])
with server:
    print(address, flush=True)
    conn, _ = server.accept()
    with conn:
        while conn.recv(1):
            conn.sendall(buf)
"""


def socket_kind() -> str:
    """What the tasks' tensor channels use between processes of this machine: ``unix``
    (each task's local socket, the default on Linux) or ``tcp`` (loopback)."""
    from flowmill.runtime.transport import local_socket_default

    return "unix" if local_socket_default() else "tcp"


def socket_mb_per_s(kind: str, reps: int = 3) -> float:
    """MB/s of ``SOCKET_MIB`` MiB through one socket of ``kind`` (``unix``, ``tcp``: on
    loopback) between two processes, the best of ``reps`` transfers: the rate the tasks'
    own transfers are bounded by."""
    size = SOCKET_MIB << 20
    unix = kind == "unix"
    server = subprocess.Popen(
        [sys.executable, "-c", SOCKET_SERVER.format(size=size, unix=unix)],
        stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        buf = bytearray(size)
        view = memoryview(buf)
        best = 0.0
        if unix:
            conn = socket.socket(socket.AF_UNIX)
            conn.connect("\0" + address)
        else:
            conn = socket.create_connection(("127.0.0.1", int(address)))
        with conn:
            for _ in range(reps):
                t = time.perf_counter()
                conn.sendall(b"x")
                got = 0
                while got < size:
                    n = conn.recv_into(view[got:], size - got)
                    if not n:
                        raise ConnectionError("the socket server went away")
                    got += n
                best = max(best, size / (time.perf_counter() - t) / 1e6)
        return round(best)
    finally:
        server.kill()
        server.wait()


# ---- worker mode


def _say(tag: str, payload: str = "") -> None:
    print(f"@{tag} {payload}".rstrip(), flush=True)


def _wait_go() -> None:
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("launcher went away")


def worker_main(args: argparse.Namespace) -> int:
    die_with_parent(args.parent_pid)
    from flowmill.runtime.cluster import from_env
    from flowmill.runtime.distributed import DistributedSession
    from flowmill.runtime.server import Server
    from flowmill.runtime.trace import TRACER

    config = from_env()
    if config is None:
        print("error: --worker needs FLOWMILL_CONFIG", file=sys.stderr)
        return 2
    model = Model.parse(args.model)
    try:
        server = Server(config)
    except OSError as e:
        _say("port-taken", str(e))
        return PORT_TAKEN_EXIT
    sync = None
    if args.sync_workers:
        sync = Sync(args.sync_workers, config.index - args.sync_round, args.sync_round)
    chief = stop = None
    try:
        graph, init, update, ids, opt = build(model, config.cluster, config.index,
                                              args.dense_vars, sync)
        sess = DistributedSession(graph, server=server, step_timeout=args.step_timeout)
        feeds = [ids] if ids is not None else []
        step = sess.make_callable([], feeds, targets=[update])
        if args.init:
            t = time.perf_counter()
            sess.run(init)
            print(f"initialized in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
        if opt is not None:  # every worker set up (the variables initialized), then start
            _say("ready")
            _wait_go()
            sess.run(opt.worker(sync.index).init_op)
            if sync.index == 0:
                sess.run(opt.chief_init_op)
                stop = threading.Event()
                chief = threading.Thread(target=opt.chief_loop, args=(sess, stop),
                                         kwargs={"initialize": False}, daemon=True)
                chief.start()
        total = args.warmup + args.steps
        rng = np.random.default_rng(config.index)
        if ids is not None:
            batches = [(b,) for b in rng.integers(0, model.rows, (total, IDS_PER_STEP), np.int32)]
        else:
            batches = [()] * total
        _say("ready")
        _wait_go()
        clock = time.perf_counter
        start = clock()
        for feed in batches[: args.warmup]:
            step(*feed)
            if sync is None and clock() - start > args.max_seconds / 4:
                break
        _say("warm")
        _wait_go()
        times = []
        start = clock()
        for i, feed in enumerate(batches[args.warmup :]):
            t = clock()
            step(*feed)
            times.append((clock() - t) * 1e3)
            if sync is None and i + 1 >= MIN_TIMED_STEPS and clock() - start > args.max_seconds:
                break
        wall = clock() - start
        if TRACER is not None:  # FLOWMILL_TRACE: the launcher may stop this task after this
            TRACER.flush()
        _say("result", json.dumps({"index": config.index, "ms": times, "wall_s": wall}))
        if stop is not None:  # the chief waits for a next step's gradients: closing ends it
            stop.set()
        sess.close()
        if chief is not None:
            chief.join(timeout=args.step_timeout)
    finally:
        server.stop()
    return 0


# ---- the launcher


class TaskFailed(RuntimeError):
    pass


class PortTaken(RuntimeError):
    pass


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join("    " + line for line in text[-lines:])


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path


def stop(children: list[Child], grace: float = 5.0) -> None:
    """SIGTERM every child still running, then SIGKILL whatever has not exited."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
        if c.proc.stdin is not None:  # stdout is closed by its reader at the end
            try:
                c.proc.stdin.close()
            except OSError:  # a broken pipe flushing to a worker that is gone
                pass


class Cluster:
    """PS tasks for one model, with worker slots for every round of worker counts."""

    def __init__(self, model: Model, args: argparse.Namespace, rounds: list[int], log_dir: Path,
                 secure: bool = False, sync: bool = False):
        from flowmill.runtime.cluster import ClusterSpec

        self.model, self.args, self.log_dir = model, args, log_dir
        self.secure, self.sync = secure, sync
        self.credentials: dict = {}
        self.ps: list[Child] = []
        self.workers: list[Child] = []
        self.initialized = False
        self.next_worker = 0
        for attempt in range(START_ATTEMPTS):
            ports = free_ports(args.ps + sum(rounds))
            self.spec = ClusterSpec.from_dict(
                {
                    "ps": [f"127.0.0.1:{p}" for p in ports[: args.ps]],
                    "worker": [f"127.0.0.1:{p}" for p in ports[args.ps :]],
                }
            )
            if secure:
                from flowmill.operator.certificates import write_run
                from flowmill.runtime.cluster import LAUNCHER_IDENTITY, identity

                names = [identity(role, i) for role, n in (("ps", args.ps),
                                                          ("worker", sum(rounds)))
                         for i in range(n)]
                self.credentials = write_run(
                    str(log_dir / f"tls-{model.key}-{attempt}"), "bench",
                    [*names, LAUNCHER_IDENTITY])
            try:
                for i in range(args.ps):
                    self.ps.append(self._spawn_ps(i, attempt))
                for i in range(args.ps):
                    self._wait_ps(i)
                return
            except TaskFailed:
                self.close()
                if attempt == START_ATTEMPTS - 1:
                    raise
            except BaseException:  # Ctrl-C while starting: no task outlives the launcher
                self.close()
                raise

    def _env(self, role: str, index: int) -> dict[str, str]:
        from flowmill.runtime.cluster import ENV_TLS_DIR, ENV_VAR, TaskConfig

        env = dict(os.environ)
        env[ENV_VAR] = TaskConfig(self.spec, role, index).to_json()
        if self.secure:
            env[ENV_TLS_DIR] = self.credentials[f"{role}-{index}"]
        return env

    def _spawn_ps(self, index: int, attempt: int) -> Child:
        log = self.log_dir / f"{self.model.key}-ps{index}-{attempt}.log"
        launch = PS_LAUNCH.format(parent=os.getpid())
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", launch],
                env=self._env("ps", index),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return Child(f"ps {index}", proc, log)

    def _wait_ps(self, index: int) -> None:
        import grpc

        from flowmill.runtime.cluster import LAUNCHER_IDENTITY
        from flowmill.runtime.protos import task_service_pb2 as pb
        from flowmill.runtime.protos import task_service_pb2_grpc as pb_grpc
        from flowmill.runtime.remote_rendezvous import CHANNEL_OPTIONS
        from flowmill.runtime.tls import TaskCredentials, grpc_channel

        child = self.ps[index]
        address = self.spec.address("ps", index)
        launcher = self.credentials.get(LAUNCHER_IDENTITY)
        with grpc_channel(address, launcher and TaskCredentials(launcher), f"ps-{index}",
                          CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.TaskServiceStub(channel)
            deadline = time.monotonic() + PS_READY_TIMEOUT_S
            while time.monotonic() < deadline:
                if child.proc.poll() is not None:
                    raise TaskFailed(f"{child.name} exited at start:\n{tail(child.log)}")
                try:
                    stub.GetStatus(pb.GetStatusRequest(), timeout=1.0)
                    return
                except grpc.RpcError:
                    time.sleep(0.05)
        raise TaskFailed(f"{child.name} not ready in {PS_READY_TIMEOUT_S:.0f}s:\n{tail(child.log)}")

    def run_round(self, num_workers: int) -> list[dict]:
        """Start ``num_workers`` new workers, take them through the barriers, and return
        each one's report."""
        args, model = self.args, self.model
        first = self.next_worker
        self.next_worker += num_workers
        steps, warmup = args.steps_for[model.kind]
        messages: queue.Queue = queue.Queue()
        workers = []
        for k in range(num_workers):
            index = first + k
            log = self.log_dir / f"{model.key}-w{num_workers}-worker{index}.log"
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--model", model.spec(),
                "--steps", str(steps),
                "--warmup", str(warmup),
                "--dense-vars", str(args.dense_vars),
                "--step-timeout", str(args.step_timeout),
                "--max-seconds", str(args.max_seconds),
                "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            if k == 0 and not self.initialized:
                cmd.append("--init")
            if self.sync:
                cmd += ["--sync-workers", str(num_workers), "--sync-round", str(first)]
            with open(log, "w") as err:
                proc = subprocess.Popen(
                    cmd,
                    env=self._env("worker", index),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            child = Child(f"worker {index}", proc, log)
            workers.append(child)
            self.workers.append(child)
            threading.Thread(target=_read_lines, args=(k, proc, messages), daemon=True).start()
        try:
            self._expect(workers, messages, "ready", args.setup_timeout)
            self.initialized = True
            self._release(workers)
            if self.sync:  # then each has started at the global step, the chief its loop
                self._expect(workers, messages, "ready", args.setup_timeout)
                self._release(workers)
            self._expect(workers, messages, "warm", args.max_seconds / 4 + args.step_timeout)
            self._release(workers)
            timed = args.max_seconds + MIN_TIMED_STEPS * args.step_timeout
            reports = self._expect(workers, messages, "result", timed)
        finally:
            stop(workers)
        return [json.loads(r) for r in reports]

    def _release(self, workers: list[Child]) -> None:
        for w in workers:
            try:
                w.proc.stdin.write("go\n")
                w.proc.stdin.flush()
            except OSError as e:
                raise TaskFailed(f"{w.name} went away ({e}):\n{self._logs([w])}") from None

    def _expect(self, workers: list[Child], messages: queue.Queue, tag: str, timeout: float):
        """Wait until every worker has said ``tag``; a worker that exits first, says it
        could not bind, or a PS that dies fails the round with the logs."""
        got: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(workers):
            if time.monotonic() > deadline:
                missing = [workers[k] for k in range(len(workers)) if k not in got]
                raise TaskFailed(
                    f"no @{tag} from {', '.join(w.name for w in missing)} in {timeout:.0f}s:\n"
                    + self._logs(missing[:1])
                )
            self._check_ps()
            try:
                k, line = messages.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                if k not in got:
                    w = workers[k]
                    w.proc.wait()
                    raise TaskFailed(
                        f"{w.name} exited with {w.proc.returncode} before @{tag}:\n"
                        + self._logs([w])
                    )
                continue
            if line.startswith("@port-taken"):
                raise PortTaken(line)
            if line.startswith(f"@{tag}"):
                got[k] = line[len(tag) + 1 :].strip()
        return [got[k] for k in range(len(workers))]

    def _check_ps(self) -> None:
        for c in self.ps:
            if c.proc.poll() is not None:
                raise TaskFailed(f"{c.name} exited with {c.proc.returncode}:\n{tail(c.log)}")
        free = available_bytes()
        if free is not None and free < self.args.min_free_gb * 2**30:
            peaks = ", ".join(f"{c.name} {peak_rss(c.proc.pid) / 2**30:.1f} GiB" for c in self.ps)
            raise TaskFailed(
                f"stopped: {free / 2**30:.1f} GiB of memory left, under --min-free-gb "
                f"{self.args.min_free_gb:g} (PS peak resident: {peaks})"
            )

    def ps_peak_gib(self) -> list[float]:
        return [peak_rss(c.proc.pid) / 2**30 for c in self.ps]

    def _logs(self, workers: list[Child]) -> str:
        parts = [f"  {w.name} ({w.log}):\n{tail(w.log)}" for w in workers]
        parts += [f"  {c.name} ({c.log}):\n{tail(c.log, 10)}" for c in self.ps]
        return "\n".join(parts)

    def close(self) -> None:
        stop(self.workers + self.ps)
        self.workers, self.ps = [], []


def _read_lines(k: int, proc: subprocess.Popen, messages: queue.Queue) -> None:
    with proc.stdout:
        for line in proc.stdout:
            messages.put((k, line.rstrip("\n")))
    messages.put((k, None))


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss(pid: int) -> int:
    """The most memory a process has held resident (VmHWM), in bytes; 0 where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_model(
    model: Model, args: argparse.Namespace, log_dir: Path, secure: bool = False,
    sync: bool = False,
) -> tuple[dict[str, float | None], bool]:
    """Median step time (ms) per worker count for one model, on one set of PS tasks, and
    whether every round ran (a failed round leaves it and the rounds after it None)."""
    results: dict[str, float | None] = {str(w): None for w in args.workers}
    # A table lives once on its PS tasks, twice while it is initialized.
    need = 2 * model.nbytes
    free = available_bytes()
    if model.kind == "sparse" and free is not None and need > free:
        print(
            f"{model.key}: skipped, needs about {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB available"
        )
        return results, True
    pending = list(args.workers)
    try:
        for attempt in range(START_ATTEMPTS):
            t = time.perf_counter()
            cluster = Cluster(model, args, pending, log_dir, secure, sync)
            mode = ("sync, " if sync else "async, ") + ("mutual TLS" if secure else "plain TCP")
            print(f"{model.key}: {args.ps} PS tasks up in {time.perf_counter() - t:.1f}s "
                  f"({mode})")
            try:
                while pending:
                    w = pending[0]
                    t = time.perf_counter()
                    reports = cluster.run_round(w)
                    elapsed = time.perf_counter() - t
                    results[str(w)] = report_round(model, w, args, reports, elapsed, cluster)
                    pending.pop(0)
                return results, True
            except PortTaken as e:
                if attempt == START_ATTEMPTS - 1:
                    raise TaskFailed(f"a worker could not bind its port 3 times: {e}") from None
                print(f"{model.key}: a worker port was taken ({e}); starting over on new ports")
            finally:
                cluster.close()
    except TaskFailed as e:
        where = f" with {pending[0]} workers" if pending else ""
        print(f"{model.key}: failed{where}: {e}", file=sys.stderr, flush=True)
    return results, False


def bound_fractions(model: Model, step_ms: dict, rate_mb_per_s: float) -> dict:
    """Per worker count: the time the socket's rate allows for a round (the model to
    every worker and back) over the median step; 1.0 is the bound."""
    out = {}
    for workers, ms in step_ms.items():
        if ms:
            bound_ms = 2 * model.nbytes * int(workers) / (rate_mb_per_s * 1e6) * 1e3
            out[workers] = round(bound_ms / ms, 3)
    return out


def report_round(
    model: Model,
    workers: int,
    args: argparse.Namespace,
    reports: list[dict],
    elapsed: float,
    cluster: Cluster,
) -> float:
    ms = [t for r in reports for t in r["ms"]]
    median = statistics.median(ms)
    q = np.percentile(ms, [10, 90])
    steps_per_s = sum(len(r["ms"]) / r["wall_s"] for r in reports)
    moved = ""
    if model.kind == "dense":  # the model out and its update back, every step
        moved = f", {2 * model.nbytes * steps_per_s / 1e6:,.0f} MB/s through the PS"
    peaks = "/".join(f"{g:.2f}" for g in cluster.ps_peak_gib())
    processes = args.ps + workers
    cores = os.cpu_count() or 1
    crowded = f"  [{processes} processes on {cores} cores]" if processes > cores else ""
    print(
        f"  {model.key:>12} {workers} worker{'s' if workers > 1 else ' '}: "
        f"median {median:8.2f} ms  p10 {q[0]:8.2f}  p90 {q[1]:8.2f}  "
        f"({len(ms)} steps, {steps_per_s:,.1f} steps/s in all{moved}; round {elapsed:.1f}s; "
        f"PS peak resident {peaks} GiB)"
        f"{crowded}",
        flush=True,
    )
    return round(median, 3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="scalar,dense,sparse", help="scalar, dense, sparse")
    p.add_argument("--workers", default="1,2,4,8", help="worker counts, one round each")
    p.add_argument("--ps", type=int, default=2, help="PS tasks")
    p.add_argument("--steps", type=int, help="timed steps per worker (default per model)")
    p.add_argument("--warmup", type=int, help="untimed steps per worker (default per model)")
    p.add_argument("--dense-mb", type=float, default=100.0, help="dense model size, MB")
    p.add_argument("--dense-vars", type=int, default=4, help="variables of the dense model")
    p.add_argument("--sparse-gb", default="1,4", help="embedding table sizes, GiB")
    p.add_argument("--quick", action="store_true", help="workers 1,2, few steps, 1 GiB table")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=20.0,
        help="a worker's timed steps stop after this long (warm-up: a quarter of it)",
    )
    p.add_argument("--step-timeout", type=float, default=120.0, help="seconds one step may take")
    p.add_argument("--setup-timeout", type=float, default=300.0, help="start, compile, init")
    p.add_argument(
        "--min-free-gb", type=float, default=3.0, help="stop a round when less memory is left"
    )
    p.add_argument("--security", default="plain,tls",
                   help="plain, tls: each model runs once per mode")
    p.add_argument("--training", default="async,sync",
                   help="async, sync: each model runs once per mode (and security mode)")
    p.add_argument("--keep-logs", action="store_true", help="keep the task logs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--init", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sync-round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        if args.workers == p.get_default("workers"):
            args.workers = "1,2"
        if args.sparse_gb == p.get_default("sparse_gb"):
            args.sparse_gb = "1"
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
        sparse_gb = [float(g) for g in args.sparse_gb.split(",")]
    except ValueError:
        p.error("--workers and --sparse-gb take comma-separated numbers")
    if any(w < 1 for w in args.workers) or args.ps < 1 or args.dense_vars < 1:
        p.error("--workers, --ps and --dense-vars must be at least 1")
    models = []
    for kind in args.models.split(","):
        if kind == "scalar":
            models.append(Model("scalar", FLOAT_BYTES))
        elif kind == "dense":
            models.append(Model("dense", int(args.dense_mb * 1e6)))
        elif kind == "sparse":
            models += [Model("sparse", int(g * 2**30)) for g in sparse_gb]
        else:
            p.error(f"unknown model {kind!r} (scalar, dense, sparse)")
    args.model_list = models
    args.modes = args.security.split(",")
    if not args.modes or set(args.modes) - {"plain", "tls"}:
        p.error("--security takes plain, tls or both")
    args.trainings = args.training.split(",")
    if not args.trainings or set(args.trainings) - {"async", "sync"}:
        p.error("--training takes async, sync or both")
    defaults = QUICK_STEPS if args.quick else DEFAULT_STEPS
    args.steps_for = {
        kind: (
            args.steps if args.steps is not None else steps,
            args.warmup if args.warmup is not None else warmup,
        )
        for kind, (steps, warmup) in defaults.items()
    }
    return args


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    signal.signal(signal.SIGTERM, _raise_exit)  # so that the finally blocks stop the tasks
    cores = os.cpu_count() or 1
    print(
        f"null step: {args.ps} PS tasks, workers {args.workers}, {cores} CPU cores "
        f"(a step is RPCs and copies: with more processes than cores, the figures at "
        f"higher worker counts include waiting for a core)",
        flush=True,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="ps_null_step-"))
    out: dict = {"bench": "ps_null_step", "ps_tasks": args.ps}
    failed = False
    try:
        dense = {}  # a dense round's key: its model
        rates = []
        if any(m.kind == "dense" for m in args.model_list):
            out["socket"] = socket_kind()
            rates.append(socket_mb_per_s(out["socket"]))
            print(f"one {out['socket']} socket between two processes (what the tasks use): "
                  f"{rates[0]:,} MB/s")
        for model in args.model_list:
            steps, warmup = args.steps_for[model.kind]
            print(f"{model.key}: {steps} timed steps per worker after {warmup} warm-up steps")
            for training in args.trainings:
                for mode in args.modes:
                    key = model.key + "_sync" * (training == "sync") + "_tls" * (mode == "tls")
                    out[key + "_ms"], ok = run_model(model, args, log_dir, secure=mode == "tls",
                                                     sync=training == "sync")
                    failed |= not ok
                    if model.kind == "dense":
                        dense[key] = model
        if rates:
            # Measured again after the rounds, the better rate taken: one reading is a
            # fraction of a second, and a neighbour's burst in it would lower the bound
            # (a 256 MiB transfer read 1,026 MB/s once where it reads 3,400-4,500).
            rates.append(socket_mb_per_s(out["socket"]))
            print(f"the same socket after the rounds: {rates[1]:,} MB/s")
            out["socket_mb_per_s"], out["socket_mb_per_s_readings"] = max(rates), rates
            for key, model in dense.items():
                out[key + "_bound_fraction"] = bound_fractions(
                    model, out[key + "_ms"], out["socket_mb_per_s"])
    finally:
        if args.keep_logs or failed:
            print(f"task logs in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    out["paper_1_worker_ms"] = PAPER_1_WORKER_MS
    print(
        "paper, 1 worker: scalar 1.8 ms, dense 100 MB 147 ms, sparse 5-20 ms "
        "(a real network between machines; here every task shares this machine's loopback)"
    )
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
