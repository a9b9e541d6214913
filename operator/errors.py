"""What a reconcile raises when it cannot finish, and how an API error is told in one line."""

from __future__ import annotations

from .apiclient import ApiError


class Conflict(Exception):
    """An object changed between reading it and writing it: decide again."""


class Blocked(Exception):
    """The action could not be completed yet (already reported as an Event)."""


def api_error(e: BaseException) -> str:
    """An error in one line: the API's status and message, never a request or body dump."""
    if isinstance(e, ApiError):
        message = e.message
        return f"{e.status} {e.reason}" + (f": {message}" if message else "")
    return f"{type(e).__name__}: {e}"
