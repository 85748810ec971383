"""Experiment files and sweeps: expansion, reproducibility, and one clear error per mistake."""

from __future__ import annotations

import pytest

from nbbatch.errors import SpecError
from nbbatch.spec.experiment import Experiment
from nbbatch.spec.sweep import expand_sweep


def test_grid_is_the_product():
    combos = expand_sweep({"grid": {"LR": [0.1, 0.01], "BATCHSIZE": [32, 64, 128]}})
    assert len(combos) == 6
    assert {"LR": 0.01, "BATCHSIZE": 128} in combos


def test_zip_pairs_values():
    assert expand_sweep({"zip": {"LR": [0.1, 0.2], "EPOCHS": [1, 2]}}) == [{"LR": 0.1, "EPOCHS": 1},
                                                                           {"LR": 0.2, "EPOCHS": 2}]


def test_random_is_reproducible_by_seed_and_in_range():
    spec = {"random": {"samples": 20, "seed": 7, "params": {
        "LR": {"loguniform": [1e-4, 1e-1]}, "M": {"uniform": [0.5, 0.9]}, "N": {"normal": [0, 1]},
        "B": {"randint": [16, 64]}, "OPT": {"choice": ["sgd", "adam"]}}}}
    first, again = expand_sweep(spec), expand_sweep(spec)
    assert first == again
    assert expand_sweep({**spec, "random": {**spec["random"], "seed": 8}}) != first
    assert all(1e-4 <= c["LR"] <= 1e-1 and 0.5 <= c["M"] <= 0.9 and 16 <= c["B"] <= 64 for c in first)
    assert all(isinstance(c["B"], int) and c["OPT"] in ("sgd", "adam") for c in first)


def test_kinds_are_crossed():
    combos = expand_sweep({"grid": {"A": [1, 2]}, "random": {"samples": 3, "seed": 0, "params": {"B": [5, 6]}}})
    assert len(combos) == 6


def test_fixed_parameters_then_sweep():
    exp = Experiment(name="e", notebooks=[], frameworks=["x"], parameters={"EPOCHS": 1, "LR": 0.5},
                     sweep={"grid": {"LR": [0.1, 0.2]}})
    assert exp.combinations() == [{"EPOCHS": 1, "LR": 0.1}, {"EPOCHS": 1, "LR": 0.2}]


MALFORMED = [  # (experiment, what the error says)
    ({"experiment": "e", "frameworks": ["x"], "swep": {}}, "did you mean `sweep`"),
    ({"experiment": "e"}, "runs nothing"),
    ({"experiment": "bad name!", "frameworks": ["x"]}, "experiment name"),
    ({"experiment": "e", "frameworks": ["x"], "timeout": -5}, "`timeout` must be a positive number"),
    ({"experiment": "e", "frameworks": ["x"], "timeout": {"run": 0}}, "`timeout` must be a positive number"),
    ({"experiment": "e", "frameworks": ["x"], "retries": -1}, "`retries` must be an integer"),
    ({"experiment": "e", "frameworks": ["x"], "resources": {"gpu": 1}}, "did you mean `gpus`"),
    ({"experiment": "e", "frameworks": ["x"], "resources": {"runs_per_gpu": 0}}, "runs_per_gpu"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"grid": {"LR": []}}}, "non-empty list"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"grdi": {"LR": [1]}}}, "did you mean `grid`"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"zip": {"A": [1, 2], "B": [1]}}}, "same length"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"random": {"samples": 0, "params": {"A": [1]}}}}, "samples"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"random": {"samples": 2, "params": {"A": {"gauss": [0, 1]}}}}},
     "unknown distribution"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"random": {"samples": 2, "params": {"A": {"loguniform": [0, 1]}}}}},
     "0 < low < high"),
    ({"experiment": "e", "frameworks": ["x"], "sweep": {"grid": {"A": [1]}, "zip": {"A": [2]}}}, "more than one"),
    ({"experiment": "e", "frameworks": ["x"], "parameters": {"not valid": 1}}, "identifier"),
    ("just a string", "YAML mapping"),
]


@pytest.mark.parametrize("data, message", MALFORMED)
def test_malformed_specs_name_the_mistake(data, message):
    with pytest.raises(SpecError, match=message):
        Experiment.from_dict(data)
