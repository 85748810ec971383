"""`nbbatch run` (one notebook, papermill-style) when things go wrong: a dead kernel, a cell timeout, an output path
that cannot be written, notebooks of another nbformat, papermill's `-p` typing, and a SIGKILL of the command."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from papermill.cli import _resolve_type
from support.notebooks import make_notebook
from support.processes import gone
from support.waiting import wait_until

from nbbatch.api import submit
from nbbatch.errors import ValidationError
from nbbatch.ui import cli, parameter_options

pytestmark = pytest.mark.timeout(120)


def _outputs(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return ["".join(o.get("text", "") for o in cell.get("outputs", [])) for cell in nb.cells]


@pytest.mark.kernel
def test_a_dead_kernel_and_a_cell_timeout_are_one_line_with_the_partial_notebook_written(project, capsys):
    make_notebook(project / "dies.ipynb", ["print('before')", "import os; os._exit(3)", "print('after')"])
    make_notebook(project / "hangs.ipynb", ["print('before')", "import time; time.sleep(600)"])

    assert cli.main(["run", "dies.ipynb", "dies-out.ipynb", "-q"]) == 1
    assert cli.main(["run", "hangs.ipynb", "hangs-out.ipynb", "-q", "--cell-timeout", "1"]) == 1

    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "dies.ipynb stopped in cell 3 of 4: its kernel died (it crashed, exited, or was killed, e.g. out of memory) "
        "(executed notebook with its outputs up to there: dies-out.ipynb)",
        "hangs.ipynb stopped in cell 3 of 3: the cell ran longer than the cell timeout (1 s) "
        "(executed notebook with its outputs up to there: hangs-out.ipynb)",
    ]
    assert _outputs(project / "dies-out.ipynb") == ["", "before\n", "", ""]
    assert _outputs(project / "hangs-out.ipynb") == ["", "before\n", ""]


@pytest.mark.parametrize("output, message", [
    ("missing/out.ipynb", "its folder missing does not exist; create it first (mkdir -p missing)"),
    ("folder", "the output notebook folder is a folder; name a file, e.g. folder/out.ipynb"),
    ("file.txt/out.ipynb", "file.txt is a file, not a folder"),
    ("file.txt/deeper/out.ipynb", "file.txt is a file, not a folder"),
    ("read-only/out.ipynb", "its folder read-only is not writable (permissions or a read-only file system)"),
], ids=["folder-missing", "a-folder", "under-a-file", "deep-under-a-file", "read-only"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_notebook_runs(project, capsys, monkeypatch,
                                                                                  output, message):
    """No kernel starts (this test is not marked `kernel`: the conftest guard fails it if one does)."""
    make_notebook(project / "nb.ipynb", ["open('ran', 'w').close()"])
    (project / "folder").mkdir()
    (project / "file.txt").write_text("x")
    (project / "read-only").mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes through permissions: make the folder refuse as a read-only mount would
        real_mkstemp = tempfile.mkstemp

        def read_only_mount(*args, **kwargs):
            if Path(kwargs.get("dir") or ".").resolve() == project / "read-only":
                raise PermissionError(13, "Permission denied")
            return real_mkstemp(*args, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", read_only_mount)

    assert cli.main(["run", "nb.ipynb", output, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nbbatch: error: cannot write the output notebook {output}: ") or \
        err.startswith(f"nbbatch: error: the output notebook {output} ")
    assert message in err and "Traceback" not in err
    assert not (project / "ran").exists()
    assert sorted(p.name for p in project.iterdir()) == [".nbbatch", "file.txt", "folder", "frameworks", "nb.ipynb",
                                                         "read-only"]


def _notebook_of_version(path: Path, major: int) -> Path:
    if major == 3:  # its cells are in `worksheets`
        data = {"nbformat": 3, "nbformat_minor": 0, "metadata": {"name": ""},
                "worksheets": [{"metadata": {}, "cells": [{"cell_type": "code", "input": "print(1)",
                                                           "language": "python", "outputs": [], "metadata": {}}]}]}
    else:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "python3", "language": "python"}
        data = {**nb, "nbformat": major}
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("major, message", [
    (3, "old.ipynb is nbformat 3; convert it to nbformat 4, the notebook format nbbatch reads: "
        "`jupyter nbconvert --to notebook --nbformat 4 --inplace "),
    (5, "old.ipynb is nbformat 5, a notebook format newer than nbbatch knows; nbbatch reads nbformat 4: "
        "save it as nbformat 4 with the tool that wrote it"),
], ids=["nbformat-3", "nbformat-5"])
def test_a_notebook_of_another_nbformat_says_which_it_is_and_what_nbbatch_reads(project, capsys, major, message):
    _notebook_of_version(project / "old.ipynb", major)
    assert cli.main(["run", "old.ipynb", "out.ipynb", "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    with pytest.raises(ValidationError, match="old.ipynb is nbformat") as caught:
        submit({"experiment": "old", "notebooks": ["old.ipynb"]}, progress=False)
    assert message in str(caught.value)
    assert not (project / "out.ipynb").exists() and not (project / "results").exists()


P_VALUES = ["True", "False", "None", "true", "TRUE", "none", "NULL", "null", "1", "-1", " 7 ", "1_000", "0x10", "1.5",
            "-0.5", "1e-4", "-1e-4", "1E4", "nan", "NaN", "inf", "-inf", "Infinity", "-infinity", "1e999", "abc", "",
            "-x", "٣"]


def test_dash_p_types_values_exactly_as_papermill_does():
    for value in P_VALUES:
        ours, papermills = parameter_options.typed_value(value), _resolve_type(value)
        assert type(ours) is type(papermills) and repr(ours) == repr(papermills), value


def test_dash_p_takes_negative_numbers_nan_and_inf_as_values():
    args = cli.build_parser().parse_args(["run", "in.ipynb", "out.ipynb", "-p", "lr", "-inf", "-p", "decay", "-1e-4",
                                          "-p", "shift", "-2", "-r", "label", "-5", "-p", "x", "-NaN", "-q"])
    params = parameter_options.parameters_of(args)
    assert params["lr"] == -math.inf and params["decay"] == -1e-4 and params["shift"] == -2
    assert params["label"] == "-5" and math.isnan(params["x"]) and args.quiet


@pytest.mark.kernel
def test_dash_p_values_reach_the_notebook_as_papermill_types_them(project, capsys):
    make_notebook(project / "nb.ipynb", ["print(repr(A), repr(B), repr(C), repr(D), repr(E))"],
                  parameters="A = 0.1\nB = 'x'\nC = 'x'\nD = 0.0\nE = 0.0")
    assert cli.main(["run", "nb.ipynb", "out.ipynb", "-q", "-p", "A", "-inf", "-p", "B", "none", "-p", "C", "NULL",
                     "-p", "D", "nan", "-p", "E", "-1e-4"]) == 0, capsys.readouterr().err
    assert _outputs(project / "out.ipynb")[-1] == "-inf 'none' 'NULL' nan -0.0001\n"


@pytest.mark.kernel
def test_a_sigkilled_nbbatch_run_leaves_no_process_of_its_notebook(project):
    make_notebook(project / "nb.ipynb", [
        "import os, pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "pathlib.Path('pids').write_text(f'{os.getpid()} {child.pid}')\n"
        "time.sleep(300)"])
    driver = subprocess.Popen([sys.executable, "-m", "nbbatch", "run", "nb.ipynb", "out.ipynb", "-q"], cwd=project,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        text = wait_until(lambda: (project / "pids").exists() and (project / "pids").read_text(), 60,
                          "the notebook to start its child process")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
    kernel, child = (int(p) for p in text.split())
    wait_until(lambda: gone(kernel) and gone(child), 30, "the kernel and its child process to die")
