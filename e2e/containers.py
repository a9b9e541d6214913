"""Container processes and the kubelet-style status of one pod, for the node stand-in.

A "container" here is a host process group running the container's command. This module
owns their life cycle (start, exit, restart with back-off, termination) and renders the
pod status a kubelet would report. It talks to no API: ``e2e.node`` does that.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from .podspec import Obj
from .procs import die_with_parent


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Container:
    """One container of a pod: its current process, state and restart history."""

    def __init__(self, spec: Obj, init: bool, log_dir: Path, pod_uid: str) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.log_dir = log_dir / self.name
        self.pod_uid = pod_uid
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.started_at: str | None = None
        self.terminated: Obj | None = None  # current terminated state, if exited
        self.last_terminated: Obj | None = None
        self.waiting: tuple[str, str] = ("ContainerCreating", "")
        self.not_before = 0.0  # monotonic time before which no (re)start happens

    @property
    def container_id(self) -> str:
        return f"flowmill://{self.pod_uid}/{self.name}/{self.restarts}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.restarts}.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def succeeded(self) -> bool:
        return self.terminated is not None and self.terminated["exitCode"] == 0

    def start(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        """Start the process (from the stand-in's main thread: see ``die_with_parent``)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = now_iso()
        self.terminated = None
        with open(self.log_path, "ab") as log:
            try:
                if not argv:
                    raise ValueError("no command: set `command` (there is no image entrypoint)")
                self.proc = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            except (OSError, ValueError) as err:
                # What a container runtime reports when the command cannot be executed.
                log.write(f"failed to start container: {err}\n".encode())
                self.proc = None
                self._terminate(128, "StartError", str(err))
                return
        self.waiting = ("", "")

    def poll(self) -> bool:
        """Record the exit if the process ended; True when it did just now."""
        if self.proc is None or self.proc.poll() is None:
            return False
        rc = self.proc.returncode
        self.proc = None
        if rc < 0:
            self._terminate(128 - rc, "Error", f"killed by signal {-rc}", sig=-rc)
        else:
            self._terminate(rc, "Completed" if rc == 0 else "Error", "")
        return True

    def _terminate(self, code: int, reason: str, message: str, sig: int = 0) -> None:
        self.terminated = {
            "exitCode": code, "reason": reason, "startedAt": self.started_at,
            "finishedAt": now_iso(), "containerID": self.container_id,
        }
        if message:
            self.terminated["message"] = message
        if sig:
            self.terminated["signal"] = sig

    def signal(self, sig: int) -> None:
        """Signal the container's whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def prepare_restart(self, delay: float, crashed: bool) -> None:
        """Move the exit into ``lastState`` and wait ``delay`` seconds before the restart."""
        self.last_terminated = self.terminated
        self.terminated = None
        self.restarts += 1
        self.not_before = time.monotonic() + delay
        self.waiting = ("CrashLoopBackOff", f"back-off {delay:.0f}s restarting failed "
                        f"container={self.name}") if crashed else ("", "")

    def status(self, ready: bool) -> Obj:
        """The ``containerStatuses`` entry."""
        if self.running():
            state: Obj = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None:
            state = {"terminated": self.terminated}
        else:
            reason, message = self.waiting
            state = {"waiting": {"reason": reason or "ContainerCreating"}}
            if message:
                state["waiting"]["message"] = message
        out: Obj = {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": "",
            "ready": ready and self.running(), "started": self.running(),
            "restartCount": self.restarts, "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.running() or self.terminated is not None:
            out["containerID"] = self.container_id
        return out


Launch = Callable[[Container], None]


class PodRuntime:
    """The containers of one pod and the rules that advance them, kubelet-style."""

    def __init__(self, pod: Obj, ip: str, work_dir: Path, log_root: Path,
                 backoff: tuple[float, float]) -> None:
        meta = pod["metadata"]
        self.pod = pod
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.ip = ip
        self.work_dir = work_dir
        self.log_dir = log_root / f"{self.namespace}_{self.name}_{self.uid}"
        self.backoff = backoff
        spec = pod["spec"]
        self.init = [Container(c, True, self.log_dir, self.uid)
                     for c in spec.get("initContainers") or []]
        self.main = [Container(c, False, self.log_dir, self.uid) for c in spec["containers"]]
        self.start_time = now_iso()
        self.kill_at: float | None = None  # set once deletion began: SIGKILL deadline
        self.gpus: list[int] = []
        self._conditions: dict[str, tuple[str, str]] = {}

    @property
    def policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    @property
    def containers(self) -> list[Container]:
        return self.init + self.main

    def _delay(self, c: Container) -> float:
        base, cap = self.backoff
        return min(cap, base * 2 ** max(0, c.restarts))

    def _restarts(self, c: Container) -> bool:
        if c.terminated is None:
            return False
        return self.policy == "Always" or (self.policy == "OnFailure" and not c.succeeded())

    def inits_done(self) -> bool:
        return all(c.succeeded() for c in self.init)

    def init_failed(self) -> bool:
        return self.policy == "Never" and any(
            c.terminated is not None and not c.succeeded() for c in self.init)

    def advance(self, launch: Launch) -> bool:
        """Reap exits, restart or start what the restart policy asks; True if changed."""
        changed = False
        for c in self.containers:
            changed |= c.poll()
        if self.kill_at is not None or self.init_failed():
            return changed
        now = time.monotonic()
        for c in self.init:
            if c.succeeded():
                continue
            if c.running():
                return changed
            if c.terminated is not None:  # failed; policy is Always or OnFailure
                c.prepare_restart(self._delay(c), crashed=True)
                changed = True
            if now >= c.not_before:
                launch(c)
                changed = True
            return changed
        for c in self.main:
            if c.running():
                continue
            if c.terminated is not None:
                if not self._restarts(c):
                    continue
                c.prepare_restart(self._delay(c), crashed=not c.succeeded())
                changed = True
            if now >= c.not_before:
                launch(c)
                changed = True
        return changed

    def phase(self) -> str:
        if self.init_failed():
            return "Failed"
        running = any(c.running() for c in self.containers)
        if self.kill_at is not None:  # being deleted: Running until every process is gone
            return "Running" if running else self._final_phase()
        if not self.inits_done():
            return "Pending"
        if any(c.running() or self._restarts(c) or (c.restarts and c.terminated is None)
               for c in self.main):
            return "Running"
        if all(c.terminated is not None for c in self.main):
            return self._final_phase()
        return "Pending"

    def _final_phase(self) -> str:
        done = all(c.terminated is not None for c in self.main)
        return "Succeeded" if done and all(c.succeeded() for c in self.main) else "Failed"

    def terminal(self) -> bool:
        return self.phase() in ("Succeeded", "Failed") and not any(
            c.running() for c in self.containers)

    def begin_termination(self, grace: float) -> None:
        """SIGTERM every container; SIGKILL follows at the deadline (see ``finish``)."""
        if self.kill_at is None:
            self.kill_at = time.monotonic() + grace
            for c in self.containers:
                c.signal(signal.SIGTERM)

    def overdue(self) -> bool:
        return self.kill_at is not None and time.monotonic() >= self.kill_at

    def kill(self) -> None:
        """SIGKILL whatever still runs and reap it."""
        for c in self.containers:
            c.signal(signal.SIGKILL)
        for c in self.containers:
            if c.proc is not None:
                try:
                    c.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                c.poll()

    def _condition(self, kind: str, ok: bool) -> Obj:
        status = "True" if ok else "False"
        prev = self._conditions.get(kind)
        if prev is None or prev[0] != status:
            self._conditions[kind] = (status, now_iso())
        return {"type": kind, "status": status, "lastProbeTime": None,
                "lastTransitionTime": self._conditions[kind][1]}

    def status(self) -> Obj:
        """The pod ``status`` a kubelet would write (readiness = running: no probes)."""
        ready = self.kill_at is None and all(c.running() for c in self.main)
        started = any(c.started_at for c in self.containers)
        status: Obj = {
            "phase": self.phase(),
            "conditions": [
                self._condition("PodReadyToStartContainers", True),
                self._condition("Initialized", self.inits_done()),
                self._condition("Ready", ready),
                self._condition("ContainersReady", ready),
                self._condition("PodScheduled", True),
            ],
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "containerStatuses": [c.status(ready) for c in self.main],
        }
        if self.init:
            status["initContainerStatuses"] = [c.status(False) for c in self.init]
        if not started:
            status["containerStatuses"] = [c.status(False) for c in self.main]
        return status
