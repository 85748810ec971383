"""benchmarks/search.py writes experiments nbbatch accepts, for every schedule it compares (issue 48's measurement)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from nbbatch.spec.experiment import load_experiment

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # search.py imports its neighbour machine.py
    try:
        spec = importlib.util.spec_from_file_location("bench_search", BENCHMARKS / "search.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("pruner", ["none", "hyperband", "asha", "median", "hyperband+promote", "asha+promote"])
def test_each_schedule_compared_is_a_valid_experiment(bench, tmp_path, pruner):
    args = argparse.Namespace(epochs=9, momentum=True, kernel="python3", max_samples=0, data_dir=str(tmp_path),
                              gpus=1, parallel=4, metric="loss", trials=64)
    name = bench.experiment_name(pruner, 0)
    experiment = load_experiment(bench.experiment(tmp_path, name, args, pruner, seed=0))
    assert experiment.name == name
