"""The ``nbbatch`` command: its console script (pyproject's ``[project.scripts]``) and ``python -m nbbatch``.

A light entry point: the command line (:mod:`nbbatch.ui.cli`) takes a moment to import, and a Ctrl-C while it loads
or parses its arguments comes before the command's own handling of Ctrl-C (which cancels what it started) is in
place. Nothing has started then, so one line and exit 130 say so, never a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

INTERRUPTED_WHILE_STARTING = b"nbbatch: interrupted while starting; nothing was done\n"


def main() -> int:
    """Run the ``nbbatch`` command line; Ctrl-C before it handles Ctrl-C itself is exit 130 with one line."""
    try:
        cli = importlib.import_module("nbbatch.ui.cli")  # here, not at the top: a Ctrl-C while it loads is caught
    except KeyboardInterrupt:
        os.write(2, INTERRUPTED_WHILE_STARTING)  # os.write: a print() may have been cut off mid-line
        # Ends at once (nothing has started: no exit handler to run): a Ctrl-C that landed inside an exec() of source
        # text (dataclasses and namedtuple build their methods so) stays marked unhandled in CPython once caught,
        # and a normal exit would end the process by SIGINT instead of 130.
        os._exit(128 + signal.SIGINT)
    try:
        return cli.main()
    except KeyboardInterrupt:
        os.write(2, INTERRUPTED_WHILE_STARTING)
        return 128 + signal.SIGINT

if __name__ == "__main__":
    sys.exit(main())
