"""What every benchmark prints first: the machine, the versions, and the kernel it used.

Imported by the scripts in this folder (run them as ``python benchmarks/<name>.py``); no dependency
beyond the standard library, so the GPU scripts run with only the repo, torch and Jupyter's wheels.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PACKAGES = ("nbbatch", "papermill", "nbclient", "nbformat", "jupyter_client", "ipykernel", "pyzmq", "tornado")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def versions(extra: tuple[str, ...] = ()) -> str:
    found = []
    for name in (*PACKAGES, *extra):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            module = sys.modules.get(name)
            version = getattr(module, "__version__", None)
            found.append(f"{name} {version}" if version else f"{name} (source tree)" if name == "nbbatch" else
                         f"{name} (not installed)")
    return ", ".join(found)


def describe(title: str, extra: tuple[str, ...] = ()) -> str:
    """Markdown lines naming the machine, Python and the packages measured."""
    return (f"**{title}**\n\n"
            f"- machine: {cpu_model()}, {usable_cores()} usable cores ({os.cpu_count()} online), "
            f"load average at start {load_average()} (1/5/15 min)\n"
            f"- Python {platform.python_version()} ({platform.system()} {platform.release()})\n"
            f"- {versions(extra)}\n")


def bench_kernel(python: str = sys.executable) -> tuple[str, str]:
    """A kernelspec ``nbbatch-bench`` running ipykernel in ``python``, on JUPYTER_PATH for this process
    and its children (so every runner measured starts the very same kernel); returns (name, folder)."""
    folder = Path(tempfile.mkdtemp(prefix="nbbatch-bench-kernels-"))
    spec = folder / "kernels" / "nbbatch-bench"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbbatch bench", "language": "python",
    }))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(folder), os.environ.get("JUPYTER_PATH", "")) if p)
    return "nbbatch-bench", str(folder)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def scratch_project(prefix: str) -> tuple[Path, Path]:
    """A throwaway temp folder and an empty nbbatch project in it (its frameworks/ and .nbbatch/), made the working
    directory: where a benchmark writes its notebooks and shares. Returns (the folder, the project)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    project = root / "project"
    (project / "frameworks").mkdir(parents=True)
    (project / ".nbbatch").mkdir()
    os.chdir(project)
    os.environ.pop("NBBATCH_PROJECT", None)
    return root, project
