"""The shared data loaders: real CIFAR-10 pickle batches (written by the test) and the bundled digits."""

from __future__ import annotations

import numpy as np
import pytest

from nbbatch.data import load_cifar10, load_dataset, load_digits, write_cifar10_batches


def test_cifar10_reads_the_python_pickle_format(tmp_path):
    write_cifar10_batches(tmp_path, n_train_per_batch=7, n_test=5)
    x_train, y_train, x_test, y_test = load_cifar10(tmp_path)
    assert x_train.shape == (35, 3, 32, 32) and x_test.shape == (5, 3, 32, 32)
    assert x_train.dtype == np.float32 and 0.0 <= x_train.min() and x_train.max() <= 1.0
    assert y_train.dtype == np.int64 and set(np.unique(y_train)) <= set(range(10))
    last, *_ = load_cifar10(tmp_path, channels_last=True, max_samples=4)
    assert last.shape == (4, 32, 32, 3)


def test_cifar10_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="make data"):
        load_cifar10(tmp_path)


def test_digits_have_the_cifar_layout_and_a_fixed_split():
    x_train, y_train, x_test, y_test = load_digits()
    assert x_train.shape == (1438, 3, 32, 32) and x_test.shape == (359, 3, 32, 32)
    assert x_train.max() <= 1.0 and x_train.dtype == np.float32
    again = load_digits()
    assert np.array_equal(again[1], y_train)
    assert load_dataset("digits", channels_last=True, max_samples=100)[0].shape == (100, 32, 32, 3)
    with pytest.raises(ValueError, match="digits"):
        load_dataset("mnist")
