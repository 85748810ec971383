"""Ctrl-C while the ``nbbatch`` command starts (issue 45, item 24): one line and exit 130, never a traceback.

The command line takes about a second to import; a Ctrl-C meanwhile comes before its own signal handling. Each case
runs a real ``nbbatch submit`` through an entry point (``python -m nbbatch``, and what pip's console script runs) and
sends SIGINT while it imports, at points Python's ``-X importtime`` reports. See docs/reliability.md.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)

REPO = Path(__file__).resolve().parents[1]
# Points while the command line loads (`-X importtime` prints each module as its import ends), from the first
# third-party module to the last of nbbatch's layers; then the arguments are parsed.
WHILE_IMPORTING = ("argparse", "yaml", "rich.console", "nbbatch.store.share", "nbbatch.backends", "nbbatch.drivers",
                   "nbbatch.api")


def _console_script() -> list[str]:
    """What pip's `nbbatch` script runs: pyproject's [project.scripts] entry, called as the script calls it."""
    scripts = (REPO / "pyproject.toml").read_text().partition("[project.scripts]")[2]
    module, function = re.search(r'^nbbatch = "([\w.]+):(\w+)"', scripts, re.MULTILINE).groups()
    return ["-c", f"import sys\nfrom {module} import {function}\nsys.exit({function}())"]


@pytest.mark.parametrize("entry", [["-m", "nbbatch"], _console_script()], ids=["python -m nbbatch", "console script"])
def test_ctrl_c_while_submit_starts_is_one_line_and_exit_130(project, entry):
    for module in WHILE_IMPORTING:
        # SIGINT back to default: a test runner started in the background passes it on ignored
        process = subprocess.Popen([sys.executable, "-X", "importtime", *entry, "submit", "exp.yaml"], text=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for line in process.stderr:
            if line.rpartition("|")[2].strip() == module:
                process.send_signal(signal.SIGINT)  # the import goes on meanwhile: the Ctrl-C lands a little later
                break
        else:
            pytest.fail(f"{module} was never imported")
        said = "".join(line for line in process.stderr if not line.startswith("import time:"))
        assert process.wait(60) == 130, (module, said)
        assert "Traceback" not in said and "KeyboardInterrupt" not in said, (module, said)
        assert said.startswith("nbbatch: interrupted"), (module, said)
