"""Data loaders every framework notebook shares, so they all see the same arrays.

Both loaders return ``(x_train, y_train, x_test, y_test)`` with images as float32 in [0, 1],
``(N, 3, 32, 32)`` (channel-first) or ``(N, 32, 32, 3)`` with ``channels_last=True``, and labels
as int64. Only numpy is needed (plus scikit-learn for the digits).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tarfile
import urllib.request
from pathlib import Path

import numpy as np

from nbbatch.artifacts import atomic_path

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
_TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
_TEST_BATCH = "test_batch"

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _layout(x: np.ndarray, channels_last: bool) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if channels_last else x


def _limit(arrays: Arrays, max_samples: int | None) -> Arrays:
    if not max_samples:
        return arrays
    x_train, y_train, x_test, y_test = arrays
    n_test = max(1, max_samples // 4)
    return x_train[:max_samples], y_train[:max_samples], x_test[:n_test], y_test[:n_test]


def _find_cifar_folder(data_dir: str | os.PathLike[str]) -> Path:
    root = Path(data_dir).expanduser()
    for candidate in (root / CIFAR10_FOLDER, root):
        if (candidate / _TEST_BATCH).exists():
            return candidate
    archive = root / "cifar-10-python.tar.gz"
    if archive.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        return root / CIFAR10_FOLDER
    raise FileNotFoundError(
        f"no CIFAR-10 data under {root}: expected {root / CIFAR10_FOLDER}/data_batch_1…5 and test_batch "
        "(python pickle format). Run `make data` to download it, or use DATASET='digits'."
    )


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path} is not a CIFAR-10 python batch (no data/labels)")
    x = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32)
    return x, np.asarray(labels, dtype=np.int64)


def load_cifar10(
    data_dir: str | os.PathLike[str], channels_last: bool = False, max_samples: int | None = None
) -> Arrays:
    """Load real CIFAR-10 from its python pickle batches (or the downloaded archive) in ``data_dir``."""
    folder = _find_cifar_folder(data_dir)
    parts = [_read_batch(folder / name) for name in _TRAIN_BATCHES if (folder / name).exists()]
    if not parts:
        raise FileNotFoundError(f"no data_batch_* files in {folder}")
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    x_test, y_test = _read_batch(folder / _TEST_BATCH)
    arrays = (x_train / np.float32(255), y_train, x_test / np.float32(255), y_test)
    x_train, y_train, x_test, y_test = _limit(arrays, max_samples)
    return _layout(x_train, channels_last), y_train, _layout(x_test, channels_last), y_test


def load_digits(
    channels_last: bool = False, max_samples: int | None = None, test_fraction: float = 0.2, seed: int = 0
) -> Arrays:
    """scikit-learn's bundled 8×8 digits, upscaled to 32×32 and copied to 3 channels.

    The split is a fixed shuffle by ``seed`` (1438 train / 359 test by default), so every
    framework trains and tests on the same images.
    """
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    images = digits.images.astype(np.float32) / np.float32(16.0)  # (N, 8, 8) in [0, 1]
    images = images.repeat(4, axis=1).repeat(4, axis=2)  # nearest-neighbour 8→32
    x = np.repeat(images[:, None, :, :], 3, axis=1)
    y = digits.target.astype(np.int64)
    order = np.random.RandomState(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_test = int(round(len(y) * test_fraction))
    arrays = (x[n_test:], y[n_test:], x[:n_test], y[:n_test])
    x_train, y_train, x_test, y_test = _limit(arrays, max_samples)
    return _layout(x_train, channels_last), y_train, _layout(x_test, channels_last), y_test


def load_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, channels_last: bool = False,
    max_samples: int | None = None,
) -> Arrays:
    """Load ``digits`` or ``cifar10`` by name: what the notebooks' ``DATASET`` parameter selects."""
    if name == "digits":
        return load_digits(channels_last=channels_last, max_samples=max_samples)
    if name == "cifar10":
        return load_cifar10(data_dir or "data", channels_last=channels_last, max_samples=max_samples)
    raise ValueError(f"unknown DATASET {name!r}: use 'digits' (bundled) or 'cifar10' (after `make data`)")


def write_cifar10_batches(folder: str | os.PathLike[str], n_train_per_batch: int = 20, n_test: int = 20,
                          seed: int = 0) -> Path:
    """Write small random files in CIFAR-10's exact python pickle format (for tests and demos)."""
    rng = np.random.RandomState(seed)
    n_train = n_train_per_batch * len(_TRAIN_BATCHES)
    images = rng.randint(0, 256, size=(n_train + n_test, 3, 32, 32), dtype=np.uint8)
    labels = rng.randint(0, 10, size=n_train + n_test)
    return write_cifar10_arrays(folder, images[:n_train], labels[:n_train], images[n_train:], labels[n_train:])


def write_cifar10_arrays(folder: str | os.PathLike[str], x_train: np.ndarray, y_train: np.ndarray,
                         x_test: np.ndarray, y_test: np.ndarray) -> Path:
    """Write images (N, 3, 32, 32: uint8, or floats in [0, 1]) in CIFAR-10's python pickle format, the training
    images over the five batches, so that ``load_dataset('cifar10', folder)`` reads them back: how a preparation
    notebook hands its data to the framework notebooks."""
    out = Path(folder) / CIFAR10_FOLDER
    out.mkdir(parents=True, exist_ok=True)

    def as_bytes(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.dtype != np.uint8:
            x = np.clip(np.rint(x * 255), 0, 255).astype(np.uint8)
        return x.reshape(len(x), 3072)

    parts = np.array_split(np.arange(len(y_train)), len(_TRAIN_BATCHES))
    batches = [(name, as_bytes(np.asarray(x_train)[part]), np.asarray(y_train)[part])
               for name, part in zip(_TRAIN_BATCHES, parts, strict=True)]
    for name, data, labels in [*batches, (_TEST_BATCH, as_bytes(x_test), np.asarray(y_test))]:
        batch = {b"batch_label": name.encode(), b"labels": [int(v) for v in labels], b"data": data,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(len(labels))]}
        with open(out / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)
    return out


def download_cifar10(data_dir: str | os.PathLike[str] = "data") -> Path:
    """Download the CIFAR-10 python archive into ``data_dir``, check its MD5 and unpack it (``make data``)."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "cifar-10-python.tar.gz"
    if not archive.exists():
        with atomic_path(archive) as partial, urllib.request.urlopen(CIFAR10_URL, timeout=60) as response, \
                open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
    digest = hashlib.md5(archive.read_bytes()).hexdigest()  # noqa: S324 - the published checksum is MD5
    if digest != CIFAR10_MD5:
        archive.unlink()
        raise ValueError(f"{archive} has MD5 {digest}, expected {CIFAR10_MD5}; it was removed, run `make data` again")
    return _find_cifar_folder(root)


if __name__ == "__main__":  # python -m nbbatch.data [DIR]
    print(f"CIFAR-10 ready in {download_cifar10(sys.argv[1] if len(sys.argv) > 1 else 'data')}")
