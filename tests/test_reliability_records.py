"""Damaged records and the commands that read every record (issue 45): one damaged ``run.json`` never stops the
others, and each is named with its file."""

from __future__ import annotations

import getpass
import json
import signal
import socket
import subprocess
import sys
import threading

import pytest
from support.notebooks import make_notebook
from support.records import two_runs, write_records
from support.waiting import wait_running

import nbbatch
from nbbatch.api import submit
from nbbatch.store.layout import RUN_RECORD, experiment_paths
from nbbatch.store.runjson import RunRecord
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)


def test_cancel_goes_on_past_a_damaged_record_and_names_its_file(project, capsys):
    running, _final = two_runs()
    write_records(project / "results", running)
    damaged = project / "results" / "w" / running[1].run_id / RUN_RECORD
    damaged.write_text("{broken")

    assert main(["cancel", "w"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("asked 2 run(s) to stop") and running[0].run_id in out
    assert err.startswith(f"nbbatch: warning: {damaged} is not valid JSON") and err.count("\n") == 1
    assert f"run {running[1].run_id} was asked to stop all the same" in err
    markers = project / "results" / experiment_paths("w").cancel_folder
    assert {p.name for p in markers.iterdir()} == {r.run_id for r in running}  # the damaged one may be running
    assert json.loads((markers / running[0].run_id).read_text())["status"] == "cancelled"
    assert damaged.read_text() == "{broken"  # left as it is, for the user to see

    assert main(["cancel", "w", running[1].run_id]) == 0  # named alone, too
    assert f"{damaged} is not valid JSON" in capsys.readouterr().err


def test_status_json_has_a_row_for_each_damaged_record_and_shows_a_record_under_its_folders_id(project, capsys):
    _running, final = two_runs()
    copied = RunRecord.from_dict({**final[0].to_dict(), "run_id": "toy-7a2b3c4d5e"})  # its folder is toy-8…
    copied.run_id = "toy-8a2b3c4d5e"
    write_records(project / "results", [*final, copied])
    folder = project / "results" / "w"
    (folder / copied.run_id / RUN_RECORD).write_text(json.dumps({**copied.to_dict(), "run_id": "toy-7a2b3c4d5e"}))
    damaged = {folder / final[1].run_id / RUN_RECORD: "{not json", folder / "toy-9a2b3c4d5e" / RUN_RECORD: "[1, 2]"}
    for path, text in damaged.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)

    assert main(["status", "w", "--json", "--no-refresh"]) == 0
    out, err = capsys.readouterr()
    rows = {row["run_id"]: row for row in json.loads(out)}
    assert sorted(rows) == [final[0].run_id, final[1].run_id, "toy-8a2b3c4d5e", "toy-9a2b3c4d5e"]  # none left out
    for path in damaged:
        row = rows[path.parent.name]
        assert row["status"] == "unreadable" and row["record"] == str(path) and str(path) in row["problem"]
        assert str(path) in err
    shown = rows["toy-8a2b3c4d5e"]  # under its folder's id, not the id its record names, and says so
    assert shown["status"] == "succeeded" and "names run `toy-7a2b3c4d5e`" in shown["problem"]
    assert "toy-7a2b3c4d5e" not in rows and "problem" not in rows[final[0].run_id]
    assert main(["status", "w", "--check", "--no-refresh"]) == 1
    capsys.readouterr()

    assert main(["compare", "w"]) == 0  # compare shows it under its folder's id too
    assert "toy-8a2b3c4d5e" in capsys.readouterr().out




@pytest.mark.kernel
def test_a_cancelled_run_says_cancelled_by_whom_and_when_not_that_its_kernel_died(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["print(A)", "import time; time.sleep(120)"])
    exp = write_experiment("experiment: stop\nnotebooks: [nb.ipynb]\nparameters: {A: 1}\n")
    thread = threading.Thread(target=lambda: submit(exp, progress=False))
    thread.start()
    wait_running("stop", 1)
    assert nbbatch.cancel("stop")
    thread.join(60)
    [record] = nbbatch.status("stop")
    error = record.error
    assert record.status == "cancelled" and error.ename == "cancelled" and error.cell_index is not None
    assert "DeadKernelError" not in error.summary() and "died" not in error.summary()
    assert error.reason.startswith(f"cancelled by `nbbatch cancel` from {getpass.getuser()}@{socket.gethostname()}")
    assert error.reason.endswith(" UTC") and "time.sleep" in error.cell_source

    # the driver stopped by a signal: the record says which, and of which process
    (project / "exp.yaml").write_text("experiment: term\nnotebooks: [nb.ipynb]\nparameters: {A: 2}\n")
    proc = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", "exp.yaml", "-q"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_running("term", 1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    [record] = nbbatch.status("term")
    assert record.status == "cancelled" and record.error.ename == "cancelled"
    assert record.error.reason.startswith(f"cancelled by SIGTERM to its driver, {getpass.getuser()}@"
                                          f"{socket.gethostname()} (pid {proc.pid})"), record.error


def test_commands_given_a_path_or_value_they_cannot_use_say_so_in_one_line(project, capsys):
    assert main(["schema", "-o", str(project / "missing" / "schema.json")]) == 2
    err = capsys.readouterr().err
    assert err == (f"nbbatch: error: cannot write the schema to {project / 'missing' / 'schema.json'}: No such file or "
                   f"directory; its folder {project / 'missing'} does not exist: create it first "
                   f"(mkdir -p {project / 'missing'})\n")
    assert main(["schema", "-o", str(project)]) == 2 and "choose another path" in capsys.readouterr().err

    make_notebook(project / "nb.ipynb", ["print(1)"])
    for value in ("-1", "0", "soon"):
        with pytest.raises(SystemExit) as stopped:
            main(["run", "nb.ipynb", "out.ipynb", "-k", "python3", "--cell-timeout", value])
        assert stopped.value.code == 2
        assert capsys.readouterr().err.endswith(f"argument --cell-timeout: expected a positive number of seconds, "
                                                f"got {value!r}\n")
    assert not (project / "out.ipynb").exists()

    for launch, said in (("missing.json", "cannot read the launch file"), ("empty.json", "is not JSON")):
        (project / "empty.json").write_text("")
        assert main(["run-one", launch]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nbbatch: error: run-one: ") and said in err and err.count("\n") == 1
