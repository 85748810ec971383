"""Errors a user can act on.

Every error nbbatch raises on purpose is an :class:`NbbatchError`: the CLI prints its message
(one paragraph naming the mistake and the fix) and exits non-zero, without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class NbbatchError(Exception):
    """A problem the user can fix; its message says what and how."""

    exit_code = 2


class SpecError(NbbatchError):
    """The experiment (file or Python) is malformed."""


class ValidationError(NbbatchError):
    """A planned run cannot start: bad parameter, missing notebook, kernel or environment."""


class EnvironmentNotReady(ValidationError):
    """A framework environment is missing or stale."""


class LockedError(NbbatchError):
    """Another process already drives this experiment."""


class ShareError(NbbatchError):
    """The share cannot be read or written (no space, corrupt record, unreachable)."""


class BackendError(NbbatchError):
    """A backend cannot do what was asked."""


class ContainerError(NbbatchError):
    """No usable container engine, image or GPU passthrough."""


class NotebookStopped(NbbatchError):
    """``nbbatch run``: the notebook stopped before its end without a cell error (its kernel died, or a cell ran
    past the cell timeout); the output notebook holds its outputs up to there."""

    exit_code = 1


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return `` (did you mean `x`?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == name.lower()]
    return f" (did you mean `{close[0]}`?)" if close else ""
