"""Waiting on a cluster that converges: poll until a check holds, bounded in time; and
telling a refused API request in a log."""

from __future__ import annotations

import re
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


# A refused API request in a log: an HTTP 403 (not a quoted value such as a resourceVersion
# of "403", nor the milliseconds of a timestamp such as 13:22:45,403), "Forbidden", or a
# missing permission.
REFUSED = re.compile(r"(?<![,.:'\"])\b403\b(?!['\"])|forbidden|permission", re.IGNORECASE)
