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


def wait_running(name: str, cells_done: int = 0, timeout: float = 90) -> None:
    """Wait until a run of experiment ``name`` is running and has executed ``cells_done`` cells."""
    import nbbatch  # here: the waiting helpers import nothing of nbbatch otherwise

    def running() -> bool:
        try:
            return any(r.status == "running" and r.cells_done >= cells_done for r in nbbatch.status(name))
        except nbbatch.NbbatchError:  # its records are not written yet
            return False

    wait_until(running, timeout, f"a run of {name} running with {cells_done} cell(s) done", interval=0.2)
