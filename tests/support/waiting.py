"""Wait on a condition, not a fixed time: fast when the machine is idle, patient when it is loaded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, message: str = "condition",
               interval: float = 0.02) -> T:
    """Call ``condition`` until it returns something truthy and return that; fail the test with ``message`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message}")
        time.sleep(interval)
