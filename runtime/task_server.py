"""The session a model script gets in a training task of a cluster.

Where the process was started as a training task (``FLOWMILL_CONFIG`` names a worker or
the chief), ``Session(...)`` gives a ``DistributedSession`` for that task instead
(``cluster_session``, the hook ``flowmill.runtime`` gives ``Session``), and that session
sends every variable the script did not place to the PS tasks when it compiles a step
(``placement.VariablePlacer``). The process has one ``Server`` for its task
(``task_server``): the task's port can be bound once, and its state outlives any session.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Mapping

from .cluster import (
    ENV_VAR,
    PORT_TAKEN_EXIT_CODE,
    TRAINING_ROLES,
    ClusterSpecError,
    TaskConfig,
    bind_host,
    from_env,
)
from .distributed import DistributedSession
from .graph import Graph
from .job import numerics_checked, ps_strategy
from .server import PortTakenError, Server
from .server_stats import server_source
from .session_config import ConfigProto
from .task_exit import install_exit_hooks
from .telemetry import telemetry

_server: Server | None = None
_server_lock = threading.Lock()


def task_server(config: TaskConfig) -> Server:
    """This process's one ``Server``: its task's port can be bound once, and its state
    (this task's variables and queues) outlives any one session, as on a PS task."""
    global _server, _atexit_registered

    with _server_lock:
        if _server is None or _server.stopped:
            try:
                _server = Server(config, bind_host())
            except PortTakenError as e:
                # The launcher picked the port; another process took it since.
                print(f"flowmill: {e}: exiting with code {PORT_TAKEN_EXIT_CODE} so the job "
                      "starts again on new ports", file=sys.stderr, flush=True)
                raise SystemExit(PORT_TAKEN_EXIT_CODE) from None
            telemetry().set_source(server_source(_server))
            if not _atexit_registered:
                atexit.register(_at_exit)
                _atexit_registered = True
        elif _server.config != config:
            raise ClusterSpecError(
                f"this process already serves {_server.task} of another cluster; "
                f"{ENV_VAR} changed to {config.role}:{config.index}"
            )
        return _server


_atexit_registered = False
exiting = threading.Event()  # set when the process exits: background loops end quietly


def _at_exit() -> None:
    exiting.set()
    close_task_server()


def cluster_session(
    graph: Graph | None = None,
    optimize: bool = True,
    check_numerics: bool = False,
    environ: Mapping[str, str] = os.environ,
    config: ConfigProto | None = None,
    cuda_graphs: bool = False,
) -> DistributedSession | None:
    """The session ``Session(graph)`` stands for in a training task of a cluster, or None
    where the process runs alone (no ``FLOWMILL_CONFIG``) or is a PS task. It checks
    numerics where the script asks or the job does (``training.checkNumerics``); ``config``
    is the script's ``ConfigProto``, ``cuda_graphs`` its ``Session``'s."""
    task = from_env(environ)
    if task is None or task.role not in TRAINING_ROLES:
        return None
    install_exit_hooks(on_preempted=close_sessions)
    session = DistributedSession(
        graph,
        server=task_server(task),
        optimize=optimize,
        ps_strategy=ps_strategy(environ),
        check_numerics=check_numerics or numerics_checked(environ),
        config=config,
        cuda_graphs=cuda_graphs,
    )
    _sessions.append(weakref.ref(session))
    return session


# The sessions ``Session()`` gave this task: a preempted task closes those still open (a
# script without ``with`` gets its final checkpoint too).
_sessions: list[weakref.ref[DistributedSession]] = []


def close_sessions() -> None:
    """Close every session of this task still open, newest first; each closes even if
    another fails (the failure is reported, the task is ending anyway)."""
    for ref in reversed(_sessions):
        session = ref()
        if session is None or session.closed:
            continue
        try:
            session.close()
        except Exception as e:  # noqa: BLE001 - reported; the others still close
            print(f"flowmill: closing a session failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)


def close_task_server() -> None:
    """Stop this process's task server (tests; a task's process stops it at exit)."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.stop()
