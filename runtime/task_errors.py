"""The errors a step across tasks raises: ``TaskError``, what the user meets when a step
fails on another task, and ``RunError``, a remote partition's failure in the shape of the
``grpc.RpcError`` that gRPC's ``RunGraph`` raises, whichever way the run went. Apart from
the session that raises them (``distributed``) because the task's exit path
(``task_exit``) and its session setup (``session_manager``) catch them too."""

from __future__ import annotations

import re

import grpc


class TaskError(RuntimeError):
    """A step (or registering one) failed on another task: the one error a remote failure
    reaches the user as, whatever went wrong there. Its message is one line built from the
    task's answer (its status and ``details()``, never gRPC's ``debug_error_string``), so
    that it says what failed where without gRPC's internals; those stay in ``__cause__``,
    which a training task prints only with ``FLOWMILL_DEBUG`` set (``task_exit``).

    ``task`` names the task, ``code`` is the status it answered (None where it did not
    answer: a cancelled call), and ``op`` the node that failed there where the remote
    message names one (``op 'NAME' (TYPE)``, as a task's servicer says it), else None: a
    script or a test can tell which op failed, and a restart policy which task, without
    parsing the message."""

    # How a task names the op that failed (``Server``'s servicer, the executor: ``{name!r}``).
    _OP = re.compile(r"""\bop (?:'([^']+)'|"([^"]+)") \((\w+)\)""")

    def __init__(
        self,
        message: str,
        task: str,
        code: grpc.StatusCode | None = None,
        op: str | None = None,
    ):
        super().__init__(message)
        self.task, self.code = task, code
        self.op = op if op is not None else self.op_named_in(message)

    @classmethod
    def op_named_in(cls, message: str | None) -> str | None:
        """The name of the first op ``message`` names as ``op 'NAME' (TYPE)``, or None."""
        found = cls._OP.search(message or "")
        return None if found is None else found.group(1) or found.group(2)


class RunError(grpc.RpcError):
    """A remote partition's failure, shaped as the ``grpc.RpcError`` its gRPC ``RunGraph``
    raises: ``code()`` and ``details()``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
