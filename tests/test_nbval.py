"""nbval over framework notebooks, on a quick copy (slow: needs the framework environments).

Two notebooks show that nbval runs ours in their kernels; what nbval checks in every notebook (the cells tagged
``nbval-check-output`` print nothing) is asserted on each notebook's executed copy by tests/test_notebooks.py, which
trains all of them anyway: nine more executions here would add minutes of CI for nothing new.

How CI passes a small ``MAX_SAMPLES`` to nbval: it doesn't go through the notebook. The parameters
cell must stay literal, so this test writes a copy of each notebook parameterized the way papermill
would (``papermill.parameterize.parameterize_notebook`` adds an ``injected-parameters`` cell with
``MAX_SAMPLES=200, EPOCHS=1``) and runs ``pytest --nbval-lax`` on that copy in the framework's kernel.
Under ``--nbval-lax`` every cell must run without error, and the cells tagged ``nbval-check-output``
(silent sanity checks of the data and the results) must produce exactly their stored output — none,
since notebooks are committed without outputs. By hand, for one notebook:

    python -m pytest tests/test_nbval.py -m slow -k pytorch
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook
from support.frameworks import one_thread_each, selected_frameworks

FRAMEWORKS = selected_frameworks(["pytorch", "tensorflow"])  # a torch and a TensorFlow kernel
QUICK = {"MAX_SAMPLES": 200, "EPOCHS": 1}


def quick_copy(notebook: Path, folder: Path) -> Path:
    """``notebook`` with QUICK injected after its parameters cell, as papermill would run it."""
    nb = parameterize_notebook(load_notebook_node(str(notebook)), QUICK)  # papermill's own reader and injector
    out = folder / notebook.name
    nbformat.write(nb, out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_nbval_lax_passes_on_a_quick_copy(framework, framework_envs, tmp_path):
    fw = framework_envs.framework(framework)
    copy = quick_copy(fw.notebook, tmp_path)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's configuration
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", str(copy), "--nbval-kernel-name", fw.kernel_name,
         "-p", "no:cacheprovider", "-q", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, **one_thread_each()},
    )
    assert done.returncode == 0, f"nbval failed on {fw.notebook.name}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout
