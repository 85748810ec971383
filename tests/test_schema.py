"""The experiment file's published JSON Schema: valid itself, met by every shipped experiment, and
refusing what the experiment's own validation refuses (where a schema can say it)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from test_spec_sweep import MALFORMED

from nbbatch.errors import SpecError
from nbbatch.spec.experiment import Experiment
from nbbatch.spec.pipeline import is_pipeline_file, load_pipeline, placeholder_values
from nbbatch.spec.schema import experiment_schema
from nbbatch.ui import cli

ROOT = Path(__file__).resolve().parents[1]
VALIDATOR = jsonschema.Draft202012Validator(experiment_schema())
# What only the experiment's own validation can see (relations between values, not their shapes).
BEYOND_A_SCHEMA = ("same length", "0 < low < high", "more than one")


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(experiment_schema())


SHIPPED = sorted((ROOT / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in SHIPPED if not is_pipeline_file(p)], ids=lambda p: p.name)
def test_every_shipped_experiment_meets_the_schema(path):
    data = yaml.safe_load(path.read_text())
    assert [e.message for e in VALIDATOR.iter_errors(data)] == []
    Experiment.from_dict(data, base_dir=path.parent, default_name=path.stem)


@pytest.mark.parametrize("path", [p for p in SHIPPED if is_pipeline_file(p)], ids=lambda p: p.name)
def test_every_shipped_pipeline_reads_with_every_stage(path):
    pipeline = load_pipeline(path)  # each stage's experiment is built, through the schema, with its references
    assert [pipeline.experiment(stage, placeholder_values(pipeline, stage)).name for stage in pipeline.order()] == [
        f"{pipeline.name}.{stage}" for stage in pipeline.stages]


@pytest.mark.parametrize("data", [
    {"experiment": "e", "notebooks": "nb.ipynb"},
    {"experiment": "e", "notebooks": [{"path": "nb.ipynb", "kernel": "python3", "label": "mine"}],
     "parameters": {"EPOCHS": 1}, "sweep": {"zip": {"LR": [0.1, 0.2], "EPOCHS": [1, 2]},
                                             "random": {"samples": 2, "seed": 1, "params": {"M": {"uniform": [0, 1]},
                                                                                            "OPT": ["sgd", "adam"]}}},
     "resources": {"gpus": 1, "runs_per_gpu": 2, "max_parallel": 4}, "timeout": 60, "cell_timeout": 30, "retries": 2,
     "backend": {"name": "ray", "address": "auto"}, "share": "azfiles://acct/share", "env": {"SEED": 2, "DEBUG": True}},
    {"experiment": "e", "frameworks": "all", "backend": "local", "timeout": {"run": 3600, "cell": 600}},
])
def test_what_the_experiment_accepts_the_schema_accepts(data, tmp_path):
    Experiment.from_dict(data, base_dir=tmp_path)
    assert [e.message for e in VALIDATOR.iter_errors(data)] == []


@pytest.mark.parametrize("data, message", [(d, m) for d, m in MALFORMED if not any(b in m for b in BEYOND_A_SCHEMA)])
def test_what_the_experiment_refuses_the_schema_refuses(data, message):
    with pytest.raises(SpecError, match=message):
        Experiment.from_dict(data)
    assert list(VALIDATOR.iter_errors(data)), f"the schema accepts {data!r}, which the experiment refuses ({message})"


def test_schema_command_prints_and_writes_it(tmp_path, capsys):
    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == experiment_schema()
    target = tmp_path / "experiment.schema.json"
    assert cli.main(["schema", "-o", str(target)]) == 0
    assert json.loads(target.read_text()) == experiment_schema()
