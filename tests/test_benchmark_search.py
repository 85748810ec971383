"""benchmarks/search.py writes experiments nbbatch accepts, for every schedule it compares (issue 48's measurement)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from nbbatch.data import load_dataset, load_digits, write_cifar10_arrays
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


def test_digits_written_as_cifar_batches_keep_the_held_out_digits(tmp_path):
    """The GPU machine's data (benchmarks/digits_cifar.py): digits' own test images, the training set padded to N."""
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("digits_cifar", BENCHMARKS / "digits_cifar.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    images, labels = module.read_digits(None)
    np.savez_compressed(tmp_path / "digits.npz", images=images, labels=labels)
    x_train, y_train, x_test, y_test = module.split(*module.read_digits(str(tmp_path / "digits.npz")))
    x_train, y_train = module.augment(x_train, y_train, 2000, seed=0)
    write_cifar10_arrays(tmp_path / "out", x_train, y_train, x_test, y_test)
    written, digits = load_dataset("cifar10", tmp_path / "out"), load_digits()
    assert len(written[1]) == 2000 and np.array_equal(written[3], digits[3])
    assert np.abs(written[2] - digits[2]).max() <= 1 / 255  # stored as bytes
    assert np.array_equal(written[1][:len(digits[1])], digits[1])
