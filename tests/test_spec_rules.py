"""The experiment's rules as pure functions: the schema's first error as nbbatch's sentence, and the rules across
resource fields, each checked without building an experiment."""

from __future__ import annotations

import pytest

from nbbatch.errors import SpecError
from nbbatch.spec.resources import Distribution, Resources, resources_problem
from nbbatch.spec.schema import shape_error


def test_a_well_formed_file_has_no_shape_error():
    assert shape_error({"experiment": "x", "frameworks": ["pytorch"], "resources": {"gpus": 1}}) is None


@pytest.mark.parametrize(("data", "expected"), [
    ({"experiment": "x", "frameworks": ["pytorch"], "resource": {"gpus": 1}}, "did you mean `resources`"),
    ({"experiment": "x", "frameworks": ["pytorch"], "resources": {"gpu": 1}}, "gpus"),
    ({"experiment": "x", "frameworks": ["pytorch"], "resources": {"gpus": -1}}, "resources.gpus"),
    ({"experiment": "x", "frameworks": ["pytorch"], "distribution": {"type": "torhc"}}, "torch"),
])
def test_the_first_schema_error_names_the_key_and_the_fix(data, expected):
    error = shape_error(data)
    assert isinstance(error, SpecError)
    assert expected in str(error)


def test_shape_error_does_not_change_what_it_reads():
    data = {"experiment": "x", "frameworks": ["pytorch"], "resources": {"gpus": "two"}}
    before = repr(data)
    assert shape_error(data) is not None
    assert repr(data) == before


def test_resources_of_fills_in_a_distributed_runs_defaults():
    torch = Resources.of("torch", nodes=2, gpus_per_node=4)
    assert torch.distribution == Distribution("torch", 2, 4, 4) and torch.gpus == 4
    assert Resources.of("jax", gpus=2).distribution == Distribution("jax", 1, 1, 2)
    assert Resources.of(None, gpus=1) == Resources(gpus=1)


def test_resources_of_refuses_processes_without_a_distribution():
    with pytest.raises(SpecError, match="no `distribution:`"):
        Resources.of(None, nodes=2)


@pytest.mark.parametrize(("resources", "expected"), [
    (Resources(mps=True), "ask for no GPU"),
    (Resources(gpus=2, distribution=Distribution("torch", 1, 1, 2)), "each rank drives one GPU"),
    (Resources(gpus=2, distribution=Distribution("jax", 1, 2, 2)), "one process per node"),
    (Resources(gpus=1, runs_per_gpu=2, distribution=Distribution("torch", 1, 1, 1)), "need their GPUs to themselves"),
    (Resources(gpus=1, distribution=Distribution("torch", 1, 1, 2)), "disagree"),
])
def test_rules_across_resource_fields(resources, expected):
    assert expected in (resources_problem(resources) or "")


def test_a_consistent_distributed_run_has_no_problem():
    assert resources_problem(Resources(gpus=4, distribution=Distribution("torch", 2, 4, 4))) is None
    assert resources_problem(Resources(gpus=1, runs_per_gpu=3, mps=True)) is None
