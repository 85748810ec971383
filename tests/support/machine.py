"""The repository the tests run in, and what this machine has."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nbbatch.backends.local.gpus import detect_gpus

REPO = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    """How many NVIDIA GPUs NVML sees here (0 without a driver)."""
    return len(detect_gpus())


def chromium_path() -> str | None:
    """Debian's chromium, for the browser tests; None when it is not installed."""
    return shutil.which("chromium") or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium") or None
