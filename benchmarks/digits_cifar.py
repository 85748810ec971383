"""scikit-learn's digits as CIFAR-10 python batches, for a machine without scikit-learn (the GPU machine).

    python benchmarks/digits_cifar.py --save-npz digits.npz                     # here, with scikit-learn (~100 KB)
    python benchmarks/digits_cifar.py --from digits.npz --out DIR [--train-images 30000] [--seed 0]

The second form writes ``DIR/cifar-10-batches-py/data_batch_1..5`` and ``test_batch``, which the notebooks read with
``DATASET='cifar10', DATA_DIR=DIR``. The split is ``nbbatch.data.load_digits``'s (1438 training, 359 test images,
upscaled 8→32 and copied to 3 channels). ``--train-images N`` pads the training set to N images with copies of the
training digits shifted by up to ±2 pixels and with a little noise, so that an epoch on a fast GPU is long enough for
training, not the kernel's start, to dominate a run; the test set stays the real held-out digits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from nbbatch.data import write_cifar10_arrays

SHIFT = 2  # pixels, either way, of the 32×32 image
NOISE = 0.05  # standard deviation, on [0, 1] intensities


def read_digits(npz: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Digits' (1797, 8, 8) images (0..16) and labels, from ``npz`` or from scikit-learn."""
    if npz:
        with np.load(npz) as saved:
            return saved["images"], saved["labels"]
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images.astype(np.uint8), digits.target.astype(np.int64)


def split(images: np.ndarray, labels: np.ndarray, seed: int = 0, test_fraction: float = 0.2):
    """The split of ``nbbatch.data.load_digits``: 32×32×3 float images in [0, 1]."""
    x = (images.astype(np.float32) / np.float32(16.0)).repeat(4, axis=1).repeat(4, axis=2)
    x = np.repeat(x[:, None, :, :], 3, axis=1)
    order = np.random.RandomState(seed).permutation(len(labels))
    x, y = x[order], labels[order].astype(np.int64)
    n_test = int(round(len(y) * test_fraction))
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def augment(x: np.ndarray, y: np.ndarray, total: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` followed by shifted, noisy copies of its images, ``total`` images in all."""
    rng = np.random.default_rng(seed)
    extra = max(0, total - len(y))
    picks = rng.integers(0, len(y), size=extra)
    padded = np.pad(x, ((0, 0), (0, 0), (SHIFT, SHIFT), (SHIFT, SHIFT)))
    copies = np.empty((extra, *x.shape[1:]), dtype=np.float32)
    size = x.shape[-1]
    for i, (pick, dy, dx) in enumerate(zip(picks, *rng.integers(0, 2 * SHIFT + 1, size=(2, extra)), strict=True)):
        copies[i] = padded[pick, :, dy:dy + size, dx:dx + size]
    copies += rng.normal(0.0, NOISE, size=copies.shape).astype(np.float32)
    np.clip(copies, 0.0, 1.0, out=copies)
    return np.concatenate([x, copies]), np.concatenate([y, y[picks]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", help="digits saved by --save-npz (else scikit-learn's)")
    parser.add_argument("--save-npz", help="write digits' images and labels here and stop")
    parser.add_argument("--out", help="write the CIFAR-10 batches under this folder")
    parser.add_argument("--train-images", type=int, default=0, help="pad the training set to this many images")
    parser.add_argument("--seed", type=int, default=0, help="the augmentation's random seed")
    args = parser.parse_args()
    images, labels = read_digits(args.source)
    if args.save_npz:
        np.savez_compressed(args.save_npz, images=images.astype(np.uint8), labels=labels.astype(np.int64))
        print(f"{len(labels)} digits saved to {args.save_npz}")
        return
    if not args.out:
        parser.error("name --out DIR (where to write the batches) or --save-npz FILE")
    x_train, y_train, x_test, y_test = split(images, labels)
    x_train, y_train = augment(x_train, y_train, args.train_images, args.seed)
    folder = write_cifar10_arrays(Path(args.out), x_train, y_train, x_test, y_test)
    print(f"{len(y_train)} training and {len(y_test)} test images written to {folder}")


if __name__ == "__main__":
    main()
