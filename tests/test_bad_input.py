"""Bad input: every malformed experiment, notebook or parameter is one clear error before anything runs.

Most cases are property-based (hypothesis) at the Python API level (``Experiment.from_dict`` + ``plan``);
a sample goes through the command line in-process (``nbbatch.ui.cli.main``) and two through a real
``nbbatch`` process. Huge outputs are run for real and measured."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.errors import NbbatchError, ValidationError
from nbbatch.plan.runs import plan
from nbbatch.spec.experiment import Experiment, NotebookEntry
from nbbatch.spec.project import Project
from nbbatch.ui import cli

pytestmark = pytest.mark.timeout(180)

PARAMETERS = "A = 1\nB = 'x'\nC = 0.5\nD = [1]"
NAMES = ["A", "B", "C", "D"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A project with one valid notebook (its parameters: A int, B str, C float, D list)."""
    root = tmp_path_factory.mktemp("badinput")
    (root / "frameworks").mkdir()
    (root / ".nbbatch").mkdir()
    make_notebook(root / "nb.ipynb", ["print(A, B, C, D)"], parameters=PARAMETERS)
    return root


def _plan_or_error(data, root: Path) -> str | None:
    """None when ``data`` plans, else the one error message. Any other exception fails the test."""
    try:
        plan(Experiment.from_dict(data, base_dir=root), Project(root))
    except NbbatchError as exc:
        message = str(exc)
        assert message.strip() and "Traceback" not in message
        return message
    return None


# --- experiment files, property-based ------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
                    st.sampled_from(["nb.ipynb", "python3", "local", "A", "uniform", "all", "choice", "", "../x"]))
KEYS = st.one_of(SCALARS, st.sampled_from(["A", "B", "path", "kernel", "label", "name", "run", "cell", "samples",
                                           "seed", "params", "choice", "uniform", "loguniform", "normal", "randint"]))
ANY = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(KEYS, c, max_size=3), max_leaves=6)
PARAM = st.sampled_from([*NAMES, "E", "a b", "1x"])
DISTRIBUTION = ANY | st.dictionaries(
    st.sampled_from(["uniform", "loguniform", "normal", "randint", "choice", "bogus"]),
    ANY | st.lists(st.integers(-3, 3) | st.floats(-3, 3), max_size=3), min_size=1, max_size=2)
SWEEP = ANY | st.fixed_dictionaries({}, optional={
    "grid": ANY | st.dictionaries(PARAM, st.lists(ANY, max_size=3), max_size=2),
    "zip": ANY | st.dictionaries(PARAM, st.lists(ANY, max_size=3), max_size=2),
    "random": ANY | st.fixed_dictionaries({}, optional={
        "samples": st.integers(-2, 4) | ANY, "seed": st.integers() | ANY,
        "params": ANY | st.dictionaries(PARAM, DISTRIBUTION, max_size=2), "bogus": ANY}),
    "bogus": ANY})
EXPERIMENTS = st.fixed_dictionaries(
    {"notebooks": st.just(["nb.ipynb"]) | ANY | st.lists(st.fixed_dictionaries(
        {"path": st.just("nb.ipynb") | ANY}, optional={"kernel": st.just("python3") | ANY, "label": ANY}), max_size=2)},
    optional={
        "experiment": st.just("e") | ANY, "parameters": ANY | st.dictionaries(PARAM, ANY, max_size=3), "sweep": SWEEP,
        "resources": ANY | st.dictionaries(st.sampled_from(["gpus", "runs_per_gpu", "max_parallel", "x"]), ANY, max_size=2),
        "timeout": ANY | st.dictionaries(st.sampled_from(["run", "cell", "x"]), ANY, max_size=2),
        "cell_timeout": ANY, "retries": ANY, "share": ANY, "env": ANY, "frameworks": ANY, "bogus": ANY,
        "backend": ANY | st.dictionaries(st.sampled_from(["name", "max_parallel", "x"]), ANY, max_size=2),
    })


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=EXPERIMENTS)
def test_any_experiment_structure_plans_or_is_one_nbbatch_error(workdir, data):
    _plan_or_error(data, workdir)


# Values papermill would not inject as given, or that YAML gives but are not plain literals.
NOT_LITERAL = st.one_of(
    st.builds(object), st.tuples(st.integers()), st.frozensets(st.integers(), min_size=1), st.binary(max_size=3),
    st.sampled_from([math.nan, math.inf, -math.inf, 10 ** 5000, datetime.date(2024, 1, 1), 1j]),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
)
LITERAL = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                       | st.text(max_size=5), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                             max_size=3), max_leaves=5)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(bad=NOT_LITERAL, where=st.sampled_from(["value", "in a list", "in a dict", "in a sweep"]))
def test_parameter_values_that_are_not_literals_are_refused_by_name(workdir, bad, where):
    value = {"value": bad, "in a list": [1, bad], "in a dict": {"k": bad}, "in a sweep": bad}[where]
    if where == "in a sweep":
        data = {"notebooks": ["nb.ipynb"], "sweep": {"grid": {"D": [[1], value]}}}
    else:
        data = {"notebooks": ["nb.ipynb"], "parameters": {"D" if where != "value" else "B": value}}
    message = _plan_or_error(data, workdir)
    assert message and "is not a literal value" in message, message


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(value=LITERAL)
def test_literal_parameter_values_plan(workdir, value):
    data = {"notebooks": ["nb.ipynb"], "parameters": {"D": [value]}}
    assert _plan_or_error(data, workdir) is None


# Mutations that make a valid experiment file invalid, each in one known way.
MALFORMED = st.one_of(
    st.builds(lambda k, v: {k: v}, st.from_regex(r"[a-z]{3,8}", fullmatch=True).filter(
        lambda k: k not in ("experiment", "frameworks", "notebooks", "parameters", "sweep", "resources", "timeout",
                            "retries", "backend", "share", "env")), st.integers()),
    st.sampled_from([
        {"experiment": "a b"}, {"experiment": "../up"}, {"experiment": 7}, {"notebooks": ["missing.ipynb"]},
        {"notebooks": 3}, {"notebooks": [{"path": "nb.ipynb", "kernal": "python3"}]}, {"parameters": [1, 2]},
        {"parameters": {"EPCHS": 1}}, {"parameters": {"A": "one"}}, {"parameters": {"a b": 1}},
        {"sweep": {"grid": {"A": []}}}, {"sweep": {"zip": {"A": [1], "C": [1.0, 2.0]}}}, {"sweep": {"gird": {}}},
        {"sweep": {"random": {"samples": 0, "params": {"C": {"uniform": [0, 1]}}}}},
        {"sweep": {"random": {"samples": 2, "params": {"C": {"uniform": [1, 0]}}}}}, {"sweep": [1]},
        {"resources": {"gpus": -1}}, {"resources": {"gpu": 1}}, {"timeout": 0}, {"timeout": {"run": "x"}},
        {"retries": 1.5}, {"backend": "lcoal"}, {"backend": {"name": "local", "secret_key": "x"}}, {"share": 5},
        {"env": "X=1"}, {"frameworks": ["nope"]}, {"parameters": {"A": 10 ** 30, "B": None, "C": "0.5"}},
    ]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(change=MALFORMED)
def test_malformed_experiment_files_through_the_cli_are_one_message_and_start_nothing(workdir, change, capsys,
                                                                                       monkeypatch):
    monkeypatch.chdir(workdir)
    (workdir / "bad.yaml").write_text(yaml.safe_dump({"experiment": "bad", "notebooks": ["nb.ipynb"], **change}))
    code = cli.main(["submit", "bad.yaml", "-q"])
    out, err = capsys.readouterr()
    assert code == 2, (change, out, err)
    assert err.startswith("nbbatch: error: ") and err.count("nbbatch: error:") == 1 and "Traceback" not in err
    assert not (workdir / "results").exists()


@pytest.mark.parametrize("text, message", [
    ("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {B: 2024-01-01}\n", "quote it in YAML"),
    ("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {D: &x [*x]}\n", "it contains itself"),
])
def test_malformed_values_in_a_real_process(workdir, text, message):
    (workdir / "bad.yaml").write_text(text)
    done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", "bad.yaml"], cwd=workdir, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("nbbatch: error:") and message in done.stderr
    assert "Traceback" not in done.stderr and not (workdir / "results").exists()


def test_experiment_files_that_cannot_be_read(workdir):
    (workdir / "folder.yaml").mkdir(exist_ok=True)
    (workdir / "long.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {A: " + "9" * 5000 + "}\n")
    (workdir / "deep.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {D: " + "[" * 5000 + "]" * 5000 + "}\n")
    (workdir / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    for name in ("folder.yaml", "long.yaml", "deep.yaml", "binary.yaml"):
        with pytest.raises(NbbatchError):
            submit(workdir / name, progress=False)
    assert not (workdir / "results").exists()


# --- notebooks that are not (good) notebooks ------------------------------------------------------

def _notebook_json(**changes) -> bytes:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "python3", "language": "python"}
    return json.dumps({**nb, **changes}).encode()


@pytest.mark.parametrize("content, message", [
    (b"", "is not a notebook: it is not JSON"),
    (bytes(range(256)), "is not a notebook: it is not JSON"),
    (b"[]", "has no `cells`/`nbformat`"),
    (json.dumps({"nbformat": 3, "cells": []}).encode(), "is nbformat 3; convert it"),
    (_notebook_json(nbformat="4"), "its `nbformat` is '4'"),
    (_notebook_json(cells=[1, 2]), "is not a valid notebook"),
    (_notebook_json(cells=[{"cell_type": "code", "metadata": {}}]), "'source' is a required property"),
    (_notebook_json(cells=[{"cell_type": "weird", "source": "x", "metadata": {}}]), "is not a valid notebook"),
    (_notebook_json(metadata={"kernelspec": "python3"}), "is not a valid notebook"),
    (_notebook_json(cells=[{"cell_type": "code", "source": "A = 1", "metadata": {"tags": "parameters"},
                            "outputs": [], "execution_count": None}]), "is not of type 'array'"),
    (None, "is not a notebook file"),
], ids=["empty", "binary", "json-list", "nbformat-3", "nbformat-string", "cells-numbers", "cell-without-source",
        "unknown-cell-type", "kernelspec-string", "tags-string", "a-folder"])
def test_notebooks_that_are_not_notebooks_are_refused_before_anything_runs(project, content, message):
    path = project / "odd.ipynb"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ValidationError, match="odd.ipynb") as caught:
        submit({"experiment": "odd", "notebooks": ["odd.ipynb"]}, progress=False)
    assert message in str(caught.value)
    assert not (project / "results").exists()


def test_two_parameters_cells_and_a_missing_kernel_are_refused(project):
    make_notebook(project / "two.ipynb", ["pass"], extra_parameter_cells=1)
    make_notebook(project / "nokernel.ipynb", ["pass"], kernel="no-such-kernel")
    with pytest.raises(ValidationError, match="has 2 cells tagged `parameters`"):
        submit({"experiment": "two", "notebooks": ["two.ipynb"]}, progress=False)
    with pytest.raises(ValidationError, match=r"kernel `no-such-kernel` \(for nokernel.ipynb\) does not exist"):
        submit({"experiment": "nok", "notebooks": ["nokernel.ipynb"]}, progress=False)
    assert cli.main(["run", "nokernel.ipynb", "out.ipynb"]) == 2
    assert not (project / "results").exists() and not (project / "out.ipynb").exists()


# --- parameter values through the Python API ------------------------------------------------------

class Opaque:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("value", [object(), Opaque(), (1, 2), {1, 2}, b"raw", math.nan, 10 ** 5000, [1, object()],
                                   {"k": (1,)}, {3: "int key"}],
                         ids=["object", "bad-repr", "tuple", "set", "bytes", "nan", "huge-int", "nested-object",
                              "nested-tuple", "int-key"])
def test_python_api_parameters_that_are_not_literals_are_refused(project, value):
    make_notebook(project / "nb.ipynb", ["print(A)"], parameters="A = None")
    experiment = Experiment(name="objects", notebooks=[NotebookEntry(project / "nb.ipynb")], parameters={"A": value},
                            base_dir=project, share=str(project / "results"))
    with pytest.raises(ValidationError, match=r"parameter `A` = .* is not a literal value"):
        submit(experiment, progress=False)
    assert not (project / "results").exists()


@pytest.mark.kernel
def test_literal_parameters_reach_the_notebook_exactly(project):
    value = {"list": [1, 2.5, None, True, "s"], "nested": {"deep": [[], {}]}, "text": "quote ' and \" and \\n"}
    make_notebook(project / "nb.ipynb", ["import json\nprint(json.dumps(A, sort_keys=True))"], parameters="A = None")
    result = submit({"experiment": "exact", "notebooks": ["nb.ipynb"], "parameters": {"A": value}}, progress=False)
    (record,) = result.records
    assert record.status == "succeeded" and record.parameters == {"A": value}
    nb = nbformat.read(project / "results/exact" / record.run_id / "output.ipynb", as_version=4)
    printed = next(c for c in nb.cells if "json.dumps" in c.source).outputs[0].text
    assert json.loads(printed) == value


# --- huge outputs --------------------------------------------------------------------------------

def _loud_run(project, experiment: str, size: int, flush_each_line: bool = False, **keys):
    """Print ``size`` MiB from one cell in 1-MiB lines; return the output notebook and the driver's peak RSS growth (MiB).

    Without ``flush_each_line`` ipykernel gathers the lines into few large messages (one of tens of MiB);
    with it each line is its own message, as a long training loop's prints are."""
    flush = "    sys.stdout.flush(); time.sleep(0.01)\n" if flush_each_line else ""
    make_notebook(project / f"{experiment}.ipynb", [
        "import sys, time\nfor i in range(SIZE):\n    sys.stdout.write(str(i % 10) * (2**20 - 1) + '\\n')\n"
        + flush + "print('end')"], parameters="SIZE = 1")
    me = psutil.Process()
    baseline, peak, stop = me.memory_info().rss, [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = submit({"experiment": experiment, "notebooks": [f"{experiment}.ipynb"], "parameters": {"SIZE": size},
                         **keys},
                        progress=False)
    finally:
        stop.set()
        sampler.join()
    (record,) = result.records
    assert record.status == "succeeded"
    folder = project / "results" / experiment / record.run_id
    log = (folder / "log.txt").read_bytes()
    assert log.count(b"\n") >= size and b"9" * (2**20 - 1) in log and b"end\n" in log  # the log keeps it all
    nb = nbformat.read(folder / "output.ipynb", as_version=4)
    return nb, (peak[0] - baseline) / 2**20


def _printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.kernel
def test_tens_of_megabytes_of_stdout_are_kept_in_log_and_notebook(project):
    """20 MiB printed by one cell, under the default max_output_mb (32): log.txt and the notebook keep all of it."""
    size = 20
    nb, grew = _loud_run(project, "loud", size)
    assert len(_printed(nb)) == size * 2**20 + len("end\n")
    assert grew < 8 * size, f"the driver grew by {grew:.0f} MiB for {size} MiB of output"


@pytest.mark.kernel
def test_a_cell_printing_more_than_max_output_mb_keeps_the_driver_memory_bounded(project):
    """max_output_mb: 2, one cell printing 1-MiB lines: the notebook keeps the first 2 MiB and a note, log.txt keeps
    everything, and the driver's memory no longer grows with the output. Measured: +53 MiB for 40 MiB and +52 MiB
    for 80 MiB printed; without the limit +156 and +276 MiB."""
    small, _ = _loud_run(project, "lines20", 20, flush_each_line=True, max_output_mb=2)
    _, grew_small = _loud_run(project, "lines20b", 20, flush_each_line=True, max_output_mb=2)
    nb, grew = _loud_run(project, "lines80", 80, flush_each_line=True, max_output_mb=2)
    for notebook in (small, nb):
        printed = _printed(notebook)
        assert printed.startswith("0" * 1000) and len(printed) < 2 * 2**20 + 1000
        assert "the rest of its printed output is only in log.txt" in printed
    assert grew - grew_small < 30, f"the driver grew by {grew_small:.0f} MiB for 20 MiB and {grew:.0f} MiB for 80 MiB"
