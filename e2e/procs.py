"""Start and stop long-running child processes so that none outlives the test session.

Each child gets its own process group (so its helpers die with it), a log file, and a
parent-death signal: if the Python process is killed outright, the kernel still kills the
children. ``atexit`` covers ordinary interpreter exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_live: set[Proc] = set()
_live_lock = threading.Lock()


def die_with_parent() -> None:
    """``preexec_fn``: ask the kernel to SIGKILL this child when its parent thread exits.

    The signal fires when the *thread* that forked exits, so only call Popen with this from
    a thread that lives as long as the child should (the main thread, or a loop thread).
    """
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A supervised child process whose output goes to ``log``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str | os.PathLike[str]],
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        grace: float = 10.0,
    ) -> None:
        self.name = name
        self.grace = grace  # seconds between SIGTERM and SIGKILL
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                [str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=dict(env) if env is not None else None,
                cwd=cwd, start_new_session=True, preexec_fn=die_with_parent,
            )
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float | None = None) -> int | None:
        """SIGTERM the whole group, SIGKILL it after ``grace`` seconds; return the exit code."""
        grace = self.grace if grace is None else grace
        try:
            if self.alive():
                _killpg(self.pid, signal.SIGTERM)
                try:
                    self.popen.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            # Whatever the leader did, leave no member of its group behind.
            _killpg(self.pid, signal.SIGKILL)
            return self.popen.wait(10)
        finally:
            with _live_lock:
                _live.discard(self)


def stop_all(procs: Sequence[Proc]) -> None:
    """Stop several processes at once: SIGTERM to all, wait up to each one's grace, SIGKILL."""
    for p in procs:
        if p.alive():
            _killpg(p.pid, signal.SIGTERM)
    start = time.monotonic()
    for p in procs:
        try:
            p.popen.wait(max(0.0, start + p.grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        p.stop(grace=0.0)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    procs: Sequence[Proc] = (),
    interval: float = 0.2,
) -> None:
    """Poll ``check`` until true; fail early (with its log) if one of ``procs`` died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # not ready yet, whatever the reason
            pass
        for p in procs:
            if not p.alive():
                raise RuntimeError(
                    f"{p.name} exited ({p.popen.returncode}) while waiting for {what}; "
                    f"log {p.log}:\n{p.log_tail()}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        procs = list(_live)
    for p in procs:
        p.stop(grace=3.0)


def orphaned(prefix: str) -> Iterator[Path]:
    """State folders ``<tmp>/<prefix>*`` whose owner (the pid in ``owner.pid``) is gone: a
    session killed outright. A folder without a readable owner is not ours to judge."""
    for d in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            os.kill(int((d / "owner.pid").read_text()), 0)
        except ProcessLookupError:
            yield d
        except (OSError, ValueError):
            continue
