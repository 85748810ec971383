"""Processes a daemonizing command forks: adopted while it starts, so that this process, not init, reaps them.

A command that daemonizes (``nvidia-cuda-mps-control -d``) forks and exits; its forks are re-parented to the
nearest child subreaper, else to init. A container's first process may reap nobody, which leaves each of them a
zombie once it exits. Inside :func:`adopting_orphans` this process is that subreaper; it collects their exits with
:func:`reap_exited_children`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37  # prctl(2), Linux 3.4


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """While inside, this process is a child subreaper: a process its children orphan becomes its child. Where prctl
    cannot do it (not Linux), nothing changes; a process that already is one stays one."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.c_int(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) != 0 or before.value:
        yield
        return
    adopted = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        if adopted:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap(pid: int) -> None:
    """Collect ``pid``'s exit if it is a child of this process that has exited (else leave it)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def reap_exited_children(adopted: Callable[[int], bool]) -> None:
    """Collect the exit of each child of this process that has exited (a zombie) and that ``adopted(pid)`` says was
    adopted. Never the children :mod:`subprocess` started: their exit status is theirs to collect."""
    me = str(os.getpid())
    with contextlib.suppress(OSError):
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    state, parent = f.read().rpartition(")")[2].split()[:2]
                if parent == me and state == "Z" and adopted(int(entry)):
                    reap(int(entry))
