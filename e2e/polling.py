"""Waiting on a cluster that converges: poll until a check holds, bounded in time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def eventually(
    what: str, check: Callable[[], Any], timeout: float = 120, interval: float = 0.5
) -> Any:
    """Poll ``check`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
