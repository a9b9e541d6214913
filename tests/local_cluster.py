"""PS tasks as real child processes (``python -m flowmill.runtime.server``) and the worker's
server in the test process: the cluster the distributed tests run steps on."""

import os
import subprocess
import sys
import time

import grpc

from flowmill.launcher.local import free_ports
from flowmill.runtime.cluster import ENV_VAR, ClusterSpec, TaskConfig
from flowmill.runtime.distributed import DistributedSession
from flowmill.runtime.protos import task_service_pb2 as pb
from flowmill.runtime.protos import task_service_pb2_grpc as pb_grpc
from flowmill.runtime.remote_rendezvous import CHANNEL_OPTIONS
from flowmill.runtime.server import Server

START_ATTEMPTS = 3
READY_TIMEOUT_S = 60.0


class LocalCluster:
    """PS tasks as child processes and the worker's Server in this process. Ports are
    picked free and may be taken before a task binds them: then it starts over."""

    def __init__(self, num_ps: int, log_dir):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.worker: Server | None = None
        self.channels: list[grpc.Channel] = []
        for attempt in range(START_ATTEMPTS):
            *ps_ports, worker_port = free_ports(num_ps + 1)
            self.spec = ClusterSpec.from_dict(
                {
                    "ps": [f"127.0.0.1:{p}" for p in ps_ports],
                    "worker": [f"127.0.0.1:{worker_port}"],
                }
            )
            try:
                self.procs = [self._spawn(i, attempt) for i in range(num_ps)]
                self.worker = Server(TaskConfig(self.spec, "worker", 0))
                for i in range(num_ps):
                    self._wait_ready(i)
                return
            except OSError:
                self.close()
                if attempt == START_ATTEMPTS - 1:
                    raise

    def _spawn(self, index: int, attempt: int) -> subprocess.Popen:
        log = open(self.log_dir / f"ps{index}-{attempt}.log", "w+")
        self.logs.append(log)
        env = dict(os.environ)
        env[ENV_VAR] = TaskConfig(self.spec, "ps", index).to_json()
        return subprocess.Popen(
            [sys.executable, "-m", "flowmill.runtime.server"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def stub(self, index: int) -> pb_grpc.TaskServiceStub:
        channel = grpc.insecure_channel(self.spec.address("ps", index), options=CHANNEL_OPTIONS)
        self.channels.append(channel)
        return pb_grpc.TaskServiceStub(channel)

    def log_text(self, index: int) -> str:
        log = self.logs[index]
        log.flush()
        log.seek(0)
        return log.read()

    def _wait_ready(self, index: int) -> None:
        stub = self.stub(index)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.procs[index].poll() is not None:
                raise OSError(f"ps {index} exited at start:\n{self.log_text(index)}")
            try:
                status = stub.GetStatus(pb.GetStatusRequest(), timeout=1.0)
            except grpc.RpcError:
                time.sleep(0.05)
                continue
            assert (status.role, status.index) == ("ps", index)
            return
        raise AssertionError(f"ps {index} not ready in {READY_TIMEOUT_S}s:\n{self.log_text(index)}")

    def session(self, graph, **kwargs) -> DistributedSession:
        return DistributedSession(graph, server=self.worker, **kwargs)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        for log in self.logs:
            log.close()
        self.logs = []


