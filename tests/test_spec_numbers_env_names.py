"""What users write in YAML is read as they mean it: ``1e-4`` is a number (YAML 1.2, not PyYAML's 1.1), an ``env:``
value is the text written, and a name papermill cannot make a Python variable (``class``) is refused before
anything runs — in experiment files, framework.yaml and ``nbbatch run -p/-y/-f``."""

from __future__ import annotations

import argparse
import json
import keyword
import math

import pytest
from support.notebooks import make_notebook

from nbbatch import api
from nbbatch.errors import NbbatchError, SpecError
from nbbatch.spec.experiment import Experiment, load_experiment
from nbbatch.spec.frameworks import get_framework
from nbbatch.spec.schema import experiment_schema, parameter_name_problem
from nbbatch.ui import cli, parameter_options


@pytest.fixture
def notebook(project):
    return make_notebook(project / "nb.ipynb", ["pass"], parameters="LR = None\nA = 1")


@pytest.mark.parametrize(("written", "value"), [
    ("1e-4", 1e-4), ("1e4", 1e4), ("-1E+3", -1000.0), ("1.0e-3", 1e-3), ("-.5", -0.5), ("0.1", 0.1), ("3", 3),
    ("'1e-4'", "1e-4"), ('"1e4"', "1e4"), ("1e", "1e"), ("1.2.3", "1.2.3"),
])
def test_exponents_are_numbers_and_quoted_ones_stay_strings(notebook, write_experiment, written, value):
    spec = load_experiment(write_experiment(f"notebooks: [nb.ipynb]\nparameters: {{LR: {written}}}\n"))
    assert spec.parameters["LR"] == value and type(spec.parameters["LR"]) is type(value)


@pytest.mark.parametrize(("written", "value"), [
    ("010", 10), ("-007", -7), ("0o10", 8), ("0x1F", 31), ("1_000", 1000), ("+5", 5), ("0", 0),
    ("true", True), ("FALSE", False), ("~", None), ("null", None),
    ("yes", "yes"), ("on", "on"), ("NO", "NO"), ("Off", "Off"), ("1:20", "1:20"), ("0b101", "0b101"),
])
def test_other_scalars_are_read_as_yaml_1_2_reads_them(notebook, write_experiment, written, value):
    """YAML 1.1 (PyYAML's) read 010 as 8, 1:20 as 80, and yes/on/NO as booleans: a country code NO became False."""
    spec = load_experiment(write_experiment(f"notebooks: [nb.ipynb]\nparameters: {{LR: {written}}}\n"))
    assert spec.parameters["LR"] == value and type(spec.parameters["LR"]) is type(value)


def test_the_readmes_loguniform_sweep_is_accepted(notebook, write_experiment):
    path = write_experiment("notebooks: [nb.ipynb]\n"
                            "sweep: {random: {samples: 8, seed: 0, params: {LR: {loguniform: [1e-4, 1e-1]}}}}\n")
    values = [combo["LR"] for combo in load_experiment(path).combinations()]
    assert len(values) == 8 and all(1e-4 <= v <= 1e-1 for v in values)


def test_run_parameters_from_yaml_and_a_file_read_exponents_as_numbers(tmp_path):
    (tmp_path / "params.yaml").write_text("LR: 1e-4\nNAME: '1e-4'\n")
    args = argparse.Namespace(parameters_file=[str(tmp_path / "params.yaml")], parameters_yaml=["WD: 5e-2"],
                              parameters=None, parameters_raw=None)
    assert parameter_options.parameters_of(args) == {"LR": 1e-4, "NAME": "1e-4", "WD": 0.05}


def test_env_values_are_the_text_written(notebook, write_experiment):
    path = write_experiment("notebooks: [nb.ipynb]\nparameters: {LR: &lr 1e-4}\n"
                            "env: {LR: *lr, FLAG: true, OFF: false, N: 010, F: 1.50, S: 'x y', E: ''}\n")
    spec = load_experiment(path)
    assert spec.env == {"LR": "1e-4", "FLAG": "true", "OFF": "false", "N": "010", "F": "1.50", "S": "x y", "E": ""}
    assert spec.parameters == {"LR": 1e-4}  # the anchored value is still a number where it is a parameter


def test_env_numbers_and_booleans_given_in_python_become_text(notebook):
    spec = Experiment(name="e", notebooks=[notebook], env={"FLAG": True, "N": 3, "F": 0.5})
    assert spec.env == {"FLAG": "true", "N": "3", "F": "0.5"}


@pytest.mark.parametrize(("env", "expected"), [
    ("{A: null}", "`env.A` must be text, a number or true/false"),
    ("{A: [1, 2]}", "`env.A` must be text"),
    ("{A: {B: 1}}", "`env.A` must be text"),
    ("{'A=B': x}", "name must be text without `=`"),
    ("{'': x}", "name must be text without `=`"),
    ('{A: "x\\0y"}', "`env.A` holds a NUL character"),
    ('{"A\\0": x}', "name must be text without `=` or a NUL"),
])
def test_env_a_kernel_cannot_take_is_refused_naming_the_key(notebook, write_experiment, env, expected):
    with pytest.raises(SpecError, match="env") as refused:
        load_experiment(write_experiment(f"notebooks: [nb.ipynb]\nenv: {env}\n"))
    assert expected in str(refused.value)


@pytest.mark.parametrize(("section", "where"), [
    ("parameters: {class: 1}", "`parameters`"),
    ("inputs: {if: ./data}", "`inputs`"),
    ("sweep: {grid: {class: [1, 2]}}", "`sweep.grid`"),
    ("sweep: {zip: {None: [1]}}", "`sweep.zip`"),
    ("sweep: {random: {samples: 2, params: {lambda: {uniform: [0, 1]}}}}", "`sweep.random.params`"),
    ("parameters: {__debug__: 1}", "`parameters`"),
])
def test_a_python_keyword_as_a_parameter_name_is_refused(notebook, write_experiment, section, where):
    with pytest.raises(SpecError, match="Python keyword") as refused:
        load_experiment(write_experiment(f"notebooks: [nb.ipynb]\n{section}\n"))
    assert str(refused.value).startswith(where)


def test_soft_keywords_are_names_a_notebook_may_use(notebook):
    for name in ("match", "case", "type", "_", "class_"):
        assert parameter_name_problem(name) is None
    Experiment(name="e", notebooks=[notebook], parameters={"match": 1, "type": 2})


def test_the_schemas_keywords_are_pythons():
    """Kept as data so editors flag them too; a Python that adds a keyword fails here, not in someone's run."""
    assert experiment_schema()["$defs"]["identifier"]["not"]["enum"] == [*keyword.kwlist, "__debug__"]


@pytest.mark.parametrize(("option", "expected"), [
    (["-p", "class", "1"], "Python keyword"), (["-r", "def", "x"], "Python keyword"),
    (["-y", "lambda: 1"], "Python keyword"), (["-f", "params.yaml"], "Python keyword"),
    (["-y", "1: 2"], "Python identifier"),
])
def test_nbbatch_run_refuses_a_name_that_cannot_be_a_variable(project, capsys, option, expected):
    """A notebook without a `parameters` cell: papermill injects any name, and `class = 1` was a SyntaxError."""
    notebook = make_notebook(project / "nb.ipynb", ["pass"], parameters=None)
    (project / "params.yaml").write_text("if: 1\n")
    out = project / "out.ipynb"
    assert cli.main(["run", str(notebook), str(out), *option]) == 2
    error = capsys.readouterr().err
    assert error.startswith("nbbatch: error: parameter ") and expected in error and "Traceback" not in error
    assert not out.exists()


def test_framework_variables_are_the_text_written(project):
    folder = project / "frameworks" / "toy"
    folder.mkdir()
    (folder / "requirements.txt").write_text("ipykernel\n")
    (folder / "framework.yaml").write_text("notebook: nb.ipynb\nkernel_env: {LEVEL: 2, EPS: 1e-4}\n"
                                           "shared_gpu_env: {GROWTH: true}\n")
    framework = get_framework("toy")
    assert framework.kernel_env == {"LEVEL": "2", "EPS": "1e-4"} and framework.shared_gpu_env == {"GROWTH": "true"}


@pytest.mark.kernel
def test_an_exponent_reaches_the_kernel_as_a_float_and_env_as_written(project, write_experiment):
    seen = project / "seen.json"
    make_notebook(project / "nb.ipynb", [f"import json, os; open({str(seen)!r}, 'w').write(json.dumps("
                                         "[type(LR).__name__, LR, os.environ['EPS'], os.environ['FLAG']]))"],
                  parameters="LR = None")
    path = write_experiment("experiment: typed\nnotebooks: [nb.ipynb]\nparameters: {LR: 1e-4}\n"
                            "env: {EPS: 1e-4, FLAG: true}\n")
    assert api.submit(path, progress=False).ok
    kind, value, eps, flag = json.loads(seen.read_text())
    assert (kind, eps, flag) == ("float", "1e-4", "true") and math.isclose(value, 1e-4)


def test_a_parameters_file_that_is_not_text_is_one_error(tmp_path):
    (tmp_path / "params.yaml").write_bytes(b"\xff\xfe not text")
    args = argparse.Namespace(parameters_file=[str(tmp_path / "params.yaml")], parameters_yaml=None,
                              parameters=None, parameters_raw=None)
    with pytest.raises(NbbatchError, match="cannot read parameters file"):
        parameter_options.parameters_of(args)


def test_the_backends_variables_are_the_text_written_too(notebook, write_experiment):
    path = write_experiment("notebooks: [nb.ipynb]\nbackend: {name: ray, env: {FLAG: true},"
                            " runtime_env: {env_vars: {EPS: 1e-4}}}\n")
    settings = load_experiment(path).backend_settings
    assert settings["env"] == {"FLAG": "true"} and settings["runtime_env"] == {"env_vars": {"EPS": "1e-4"}}
