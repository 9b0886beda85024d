"""Polling until something in the cluster is true."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    """Calls predicate until it returns something truthy, and returns that; checks once more
    after the deadline so a slow last poll still counts."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.3)
