"""The command line: every mistake is one paragraph and a non-zero exit, no traceback, nothing started."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from support.notebooks import make_notebook

from nbbatch.errors import NbbatchError
from nbbatch.spec.project import find_project
from nbbatch.ui.cli import build_parser

pytestmark = pytest.mark.timeout(120)


def nbbatch(*args, cwd, check=False):
    done = subprocess.run([sys.executable, "-m", "nbbatch", *args], cwd=cwd, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def tiny(project):
    make_notebook(project / "nb.ipynb", ["nbbatch_value = A * 2", "import nbbatch; nbbatch.record(value=nbbatch_value)"],
                  parameters="EPOCHS = 1\nA = 1\nLR = 0.1\nNAME = 'x'\nUSE = False")
    fw = project / "frameworks" / "toy"
    fw.mkdir()
    (fw / "framework.yaml").write_text("title: Toy\nnotebook: nb.ipynb\n")
    (fw / "requirements.txt").write_text("ipykernel\n")
    return project


@pytest.mark.parametrize("spec, message", [
    ("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {EPCHS: 3}\n", "did you mean `EPOCHS`"),
    ("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {EPOCHS: 'three'}\n", "`EPOCHS` of nb.ipynb expects int"),
    ("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {USE: 1}\n", "expects bool"),
    ("experiment: e\nnotebooks: [missing.ipynb]\n", "does not exist"),
    ("experiment: e\nnotebooks: [{path: nb.ipynb, kernel: pyhton3}]\n", "does not exist (did you mean `python3`?)"),
    ("experiment: e\nframeworks: [pytorhc]\n", "unknown framework `pytorhc`"),
    ("experiment: e\nframeworks: [toy]\n", "nbbatch envs create toy"),
    ("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: []}}\n", "non-empty list"),
    ("experiment: e\nnotebooks: [nb.ipynb]\ntimeout: -1\n", "positive number"),
    ("experiment: e\nnotebooks: [nb.ipynb]\nbackend: lcoal\n", "did you mean `local`"),
    ("experiment: e\nnotebooks: [nb.ipynb]\nresources: {gpus: 1}\n", "GPU"),
    ("experiment: [unclosed\n", "not valid YAML"),
    ("- a\n- b\n", "YAML mapping"),
])
def test_bad_input_is_one_clear_error_and_nothing_starts(tiny, spec, message):
    (tiny / "exp.yaml").write_text(spec)
    done = nbbatch("submit", "exp.yaml", cwd=tiny)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr.replace("\n", " ")
    assert "Traceback" not in done.stderr and done.stderr.startswith("nbbatch: error:")
    assert not (tiny / "results" / "e").exists()


def test_not_a_notebook_and_two_parameters_cells(tiny):
    (tiny / "bad.ipynb").write_text("this is not json")
    make_notebook(tiny / "two.ipynb", ["pass"], extra_parameter_cells=1)
    for name, message in (("bad.ipynb", "is not a notebook"), ("two.ipynb", "2 cells tagged `parameters`")):
        (tiny / "exp.yaml").write_text(f"experiment: e\nnotebooks: [{name}]\n")
        done = nbbatch("submit", "exp.yaml", cwd=tiny)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.kernel
def test_submit_status_logs_and_plan(tiny):
    (tiny / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {zip: {A: [1, 2]}}\n")
    plan = nbbatch("plan", "exp.yaml", "--json", cwd=tiny, check=True)
    runs = json.loads(plan.stdout)
    assert [r["parameters"]["A"] for r in runs] == [1, 2]
    assert not (tiny / "results" / "e").exists()
    done = nbbatch("submit", "exp.yaml", "-q", cwd=tiny, check=True)
    assert "2 succeeded" in done.stdout
    status = json.loads(nbbatch("status", "e", "--json", cwd=tiny, check=True).stdout)
    assert sorted(r["metrics"]["value"] for r in status) == [2, 4]
    ambiguous = nbbatch("logs", "e", "nb", cwd=tiny)
    assert ambiguous.returncode == 2 and "matches 2 runs" in ambiguous.stderr
    assert "=== succeeded" in nbbatch("logs", "e", runs[0]["run_id"][:8], cwd=tiny, check=True).stdout
    full = nbbatch("logs", "e", runs[0]["run_id"], "-f", cwd=tiny, check=True)
    assert "=== succeeded" in full.stdout
    again = nbbatch("submit", "exp.yaml", "-q", cwd=tiny, check=True)
    assert "skipped 2 run(s)" in again.stdout


@pytest.mark.kernel
def test_run_is_papermill_style(tiny):
    (tiny / "params.yaml").write_text("LR: 0.5\n")
    done = nbbatch("run", "nb.ipynb", "out.ipynb", "-p", "A", "21", "-y", "USE: true", "-f", "params.yaml",
                   "-r", "NAME", "7", "-k", "python3", cwd=tiny)
    assert done.returncode == 0, done.stderr
    out = json.loads((tiny / "out.ipynb").read_text())
    assert out["metadata"]["papermill"]["parameters"] == {"A": 21, "USE": True, "LR": 0.5, "NAME": "7"}
    make_notebook(tiny / "fail.ipynb", ["1/0"])
    failed = nbbatch("run", "fail.ipynb", "fail-out.ipynb", cwd=tiny)
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr
    assert "papermill-error-cell-tag" in (tiny / "fail-out.ipynb").read_text()


def test_envs_list_shows_missing(tiny):
    done = nbbatch("envs", "list", cwd=tiny, check=True)
    assert "toy" in done.stdout and "missing" in done.stdout


def test_envs_list_fits_80_columns_with_every_kernel_name_whole(tiny, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    (tiny / "frameworks" / "tensorflow").mkdir()  # the longest kernel name of the bundled frameworks
    (tiny / "frameworks" / "tensorflow" / "framework.yaml").write_text("title: TF\nnotebook: nb.ipynb\n")
    (tiny / "frameworks" / "tensorflow" / "requirements.txt").write_text("ipykernel\n")
    lines = nbbatch("envs", "list", cwd=tiny, check=True).stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert any("nbbatch-tensorflow" in line for line in lines) and any(line.split()[:1] == ["in"] for line in lines)


def test_the_command_does_not_build_jsonschemas_iri_grammar_and_still_validates_notebooks():
    """`rfc3987_syntax` (installed with JupyterLab) builds a grammar for a second at import; the command skips it."""
    probe = ("import sys\nfrom nbbatch.ui import cli\nimport nbformat\n"
             "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('1')])\nnbformat.validate(nb)\n"
             "print(sys.modules.get('rfc3987_syntax') is None)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


OPTIONAL_EXTRAS = ("pandas", "matplotlib", "nbdime", "jinja2", "ipywidgets", "azure", "ray")


def test_the_command_line_loads_without_the_optional_extras():
    """Only the core dependencies: every command's parser (``nbbatch --help``) loads with none of the extras installed."""
    probe = (f"import sys\nfor name in {OPTIONAL_EXTRAS!r}:\n    sys.modules[name] = None  # an import of it fails\n"
             "from nbbatch.ui import cli\ncli.build_parser()\nprint('loaded')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"


def test_the_command_line_starts_without_the_notebook_runtime():
    """`nbbatch --help`, `status`, `logs` start fast: papermill and jupyter_client (a second to import) load only when
    a command runs a notebook, the extras only when a command needs them."""
    heavy = ("papermill", "jupyter_client", "nbclient", *OPTIONAL_EXTRAS)
    probe = f"import sys\nfrom nbbatch.ui import cli\ncli.build_parser()\nprint(sorted(set({heavy!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["nbbatch.api", "nbbatch.widgets"])
def test_the_python_api_and_the_widgets_import_without_what_is_slow_to_import(module):
    """`import nbbatch.api` (status, logs from a notebook) and `import nbbatch.widgets` stay quick: the notebook
    runtime loads when a notebook runs, jsonschema and nbformat's validator (rfc3987_syntax builds a grammar for a
    second) when an experiment or a notebook is validated."""
    slow = ("papermill", "jupyter_client", "nbclient", "jsonschema", "nbformat", *OPTIONAL_EXTRAS)
    probe = f"import sys\nimport {module}\nprint(sorted(set({slow!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_an_experiment_file_outside_any_project_belongs_to_the_working_directorys(project, tmp_path):
    elsewhere = tmp_path / "experiments"  # no frameworks/ or .nbbatch/ on its way up
    elsewhere.mkdir()
    assert find_project(elsewhere).root == project
    assert find_project(project / "sub").root == project


def test_cluster_asks_the_backends_capabilities(tiny):
    """`nbbatch cluster` knows no backend by name: one without a managed cluster is one clear line."""
    (tiny / "slurm.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nbackend: slurm\n")
    for args in (["cluster", "status", "--backend", "local"], ["cluster", "--experiment", "slurm.yaml", "status"],
                 ["cluster", "status", "--experiment", "slurm.yaml"]):
        done = nbbatch(*args, cwd=tiny)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("nbbatch: error:") and "has no cluster that nbbatch manages" in done.stderr


@pytest.mark.kernel
def test_run_one_executes_the_launch_its_backend_wrote(tiny):
    """`nbbatch run-one LAUNCH`: a launch file, or the launch JSON itself, as every backend hands it."""
    from nbbatch.execute.launch import LaunchSpec, launch_command, nbbatch_launcher
    from nbbatch.plan.runs import Run

    (tiny / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {zip: {A: [1, 2]}}\n")
    planned = json.loads(nbbatch("plan", "exp.yaml", "--json", cwd=tiny, check=True).stdout)
    share = tiny / "results"
    first, second = (LaunchSpec(Run.from_dict({k: v for k, v in r.items() if k != "skip"}), str(share), project=str(tiny))
                     for r in planned)  # plan --json adds whether submit would skip it
    (tiny / "launch.json").write_text(first.to_json())
    for launch in (tiny / "launch.json", second.to_json()):
        done = subprocess.run(launch_command(nbbatch_launcher(sys.executable), launch), cwd=tiny,
                              capture_output=True, text=True)
        assert done.returncode == 0 and ": succeeded" in done.stdout, done.stderr
    values = [json.loads((share / "e" / r["run_id"] / "run.json").read_text())["metrics"]["value"] for r in planned]
    assert values == [2, 4]


@pytest.mark.parametrize("launch, message", [
    ("missing.json", "cannot read the launch file missing.json"),
    ('{"run_id": "r1"}', "is not an nbbatch launch (no launch_version)"),  # a Run alone: an older nbbatch's spec
    ('{"launch_version": 99}', "is launch version 99, newer than this nbbatch reads"),
    ('{"launch_version": 1, "share": "s"}', "is not a valid launch (KeyError: 'run')"),
    ("{not json", "is not JSON"),
])
def test_run_one_says_what_is_wrong_with_its_launch(tiny, launch, message):
    done = nbbatch("run-one", launch, cwd=tiny)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_plan_and_submit_take_papermills_parameter_options(tiny):
    (tiny / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {A: 1}\nsweep: {grid: {LR: [0.1, 0.2]}}\n")
    (tiny / "more.yaml").write_text("NAME: from-file\n")
    plan = nbbatch("plan", "exp.yaml", "--json", "-p", "A", "5", "-p", "EPOCHS", "-2", "-r", "NAME", "7",
                   "-y", "USE: true", cwd=tiny, check=True)
    runs = json.loads(plan.stdout)
    assert [(r["parameters"]["A"], r["parameters"]["EPOCHS"], r["parameters"]["NAME"], r["parameters"]["USE"],
             r["parameters"]["LR"]) for r in runs] == [(5, -2, "7", True, 0.1), (5, -2, "7", True, 0.2)]
    plain = json.loads(nbbatch("plan", "exp.yaml", "--json", cwd=tiny, check=True).stdout)
    assert {r["run_id"] for r in plain}.isdisjoint(r["run_id"] for r in runs)  # other parameters: other runs
    from_file = json.loads(nbbatch("plan", "exp.yaml", "--json", "-f", "more.yaml", cwd=tiny, check=True).stdout)
    assert {r["parameters"]["NAME"] for r in from_file} == {"from-file"}


@pytest.mark.parametrize("args, message", [
    (["-p", "EPCHS", "3"], "did you mean `EPOCHS`"),
    (["-p", "EPOCHS", "three"], "`EPOCHS` of nb.ipynb expects int"),
    (["-p", "LR", "0.5"], "-p LR: `LR` is varied by sweep.grid of experiment `e`"),
    (["-p", "class", "1"], "parameter 'class'"),
])
@pytest.mark.parametrize("command", ["plan", "submit"])
def test_a_wrong_parameter_option_is_one_line_before_anything_runs(tiny, command, args, message):
    (tiny / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {grid: {LR: [0.1, 0.2]}}\n")
    done = nbbatch(command, "exp.yaml", *args, cwd=tiny)
    assert done.returncode == 2 and message in done.stderr.replace("\n", " "), done.stderr
    assert "Traceback" not in done.stderr and not (tiny / "results" / "e").exists()


def test_parameter_options_are_refused_for_a_pipeline(tiny):
    (tiny / "study.yaml").write_text("pipeline: s\nstages:\n  one: {notebooks: [nb.ipynb]}\n")
    done = nbbatch("submit", "study.yaml", "-p", "A", "2", cwd=tiny)
    assert done.returncode == 2 and "study.yaml is a pipeline; set a stage's parameters in the file" in done.stderr


@pytest.mark.kernel
def test_submit_with_a_parameter_option_runs_with_it(tiny):
    (tiny / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {A: 1}\n")
    done = nbbatch("submit", "exp.yaml", "-q", "-p", "A", "21", cwd=tiny, check=True)
    assert "1 succeeded" in done.stdout
    [record] = json.loads(nbbatch("status", "e", "--json", cwd=tiny, check=True).stdout)
    assert record["parameters"]["A"] == 21 and record["metrics"]["value"] == 42


def _arguments(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {where}", helped) for where, helped in _arguments(sub))
        elif not isinstance(action, argparse._HelpAction):
            yield "/".join(action.option_strings) or action.dest, action.help


def test_every_argument_of_every_command_says_what_it_is():
    undocumented = [where for where, helped in _arguments(build_parser())
                    if not helped and not where.startswith("run-one")]
    assert undocumented == []


def test_the_top_level_help_hides_run_one_and_ends_with_examples():
    text = build_parser().format_help()
    assert "run-one" not in text
    assert text.rstrip().splitlines()[-1].startswith("`nbbatch COMMAND --help`")
    assert "examples:\n  nbbatch submit" in text and " -p EPOCHS 1 " in text


def test_building_envs_piped_says_a_line_as_each_starts_and_ends_and_one_summary(tiny, monkeypatch, capsys):
    from nbbatch.execute import envs

    def build_env(framework, project, force=False, gpu=None, on_step=None):
        if framework.name == "bad":
            raise NbbatchError("bad: pip failed (see .nbbatch/envs/bad.log)")

    for name in ("bad", "good"):
        (tiny / "frameworks" / name).mkdir()
        (tiny / "frameworks" / name / "framework.yaml").write_text("title: X\nnotebook: nb.ipynb\n")
        (tiny / "frameworks" / name / "requirements.txt").write_text("ipykernel\n")
    monkeypatch.setattr(envs, "build_env", build_env)
    with pytest.raises(NbbatchError, match="bad: pip failed"):
        envs.build_envs(["good", "bad"], find_project(tiny), parallel=1)
    out, err = capsys.readouterr()
    lines = [re.sub(r"\d+ s$", "N s", line) for line in err.splitlines()]
    assert out == "" and lines == [
        "good: building its environment", "good: built in N s", "bad: building its environment", "bad: failed after N s"]


def test_output_piped_into_a_reader_that_stops_early_is_no_traceback(tiny):
    (tiny / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {random: {samples: 3000, seed: 1, "
                                   "params: {LR: {uniform: [0, 1]}}}}\n")  # megabytes of JSON: more than a pipe holds
    reader = subprocess.Popen([sys.executable, "-m", "nbbatch", "plan", "exp.yaml", "--json"], cwd=tiny,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.read(10)
    reader.stdout.close()  # as `| head -c 10` does
    err = reader.stderr.read().decode()
    assert reader.wait() in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err
