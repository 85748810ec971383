"""The processes a test's runs leave behind."""

from __future__ import annotations

import os
import time

# Set by tests/conftest.py to this test process's own temp dir and inherited by every kernel it starts, so that
# parallel test processes (pytest-xdist) running experiments of the same name do not see each other's kernels.
TEST_SESSION_VAR = "NBBATCH_TEST_SESSION"


def kernels_of(experiment: str, wait: float = 15.0) -> list[int]:
    """Processes of this test session still running for runs of ``experiment`` (kernels carry NBBATCH_EXPERIMENT),
    after waiting up to ``wait`` seconds for them to go."""
    import psutil  # the test extra, not nbbatch's

    session = os.environ.get(TEST_SESSION_VAR)
    deadline = time.monotonic() + wait
    while True:
        found = []
        for process in psutil.process_iter():
            try:
                environ = process.environ() if process.pid != os.getpid() else {}
                if (environ.get("NBBATCH_EXPERIMENT") == experiment and process.status() != psutil.STATUS_ZOMBIE
                        and environ.get(TEST_SESSION_VAR, session) == session):  # a container's kernel has none
                    found.append(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting for its parent counts as ended)."""
    import psutil  # the test extra, not nbbatch's

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
