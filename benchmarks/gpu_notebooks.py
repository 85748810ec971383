"""What gpu_share.py and makespan.py run: a tiny PyTorch CNN trained on synthetic data, the GPUs to run
it on, and a local backend placed on exactly those GPUs.

Needs only the standard library and nbbatch (plus, in the kernel, torch). ``--simulate`` swaps the
CNN for ``time.sleep`` and the GPUs for fake ones, so the scheduling can be run on a machine without
a GPU (kernels are pinned through ``CUDA_VISIBLE_DEVICES`` whether or not a GPU is there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

try:
    import nbbatch  # noqa: F401
except ImportError:  # a bare checkout: use its src/ (the kernels need only torch and ipykernel)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CNN_CELLS = [
    # the training setup: a small CNN (two conv blocks, two dense layers) on one synthetic CIFAR-sized batch
    "import os\nimport time\n\nimport torch\nimport torch.nn as nn\n\n"
    "torch.manual_seed(SEED)\n"
    "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    "model = nn.Sequential(\n"
    "    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),\n"
    "    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),\n"
    "    nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, N_CLASSES),\n"
    ").to(device)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)\n"
    "loss_fn = nn.CrossEntropyLoss()\n"
    "x = torch.randn(BATCHSIZE, 3, 32, 32, device=device)\n"
    "y = torch.randint(0, N_CLASSES, (BATCHSIZE,), device=device)",
    # the training loop: STEPS steps, or (STEPS = 0) as many as fit in SECONDS
    "start = time.time()\nstep = 0\n"
    "while (step < STEPS) if STEPS else (time.time() - start < SECONDS):\n"
    "    optimizer.zero_grad(set_to_none=True)\n"
    "    loss = loss_fn(model(x), y)\n"
    "    loss.backward()\n"
    "    optimizer.step()\n"
    "    step += 1\n"
    "if device == 'cuda':\n"
    "    torch.cuda.synchronize()\n"
    "train_seconds = time.time() - start\n"
    "print(device, torch.cuda.get_device_name(0) if device == 'cuda' else '', "
    "'CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''), "
    "f'{step} steps in {train_seconds:.2f} s, loss {loss.item():.3f}')",
]
CNN_PARAMETERS = "STEPS = 500\nSECONDS = 0.0\nBATCHSIZE = 128\nLR = 0.01\nN_CLASSES = 10\nSEED = 0\nID = 0"
SLEEP_CELLS = ["import os, time\ntime.sleep(SECONDS if SECONDS else STEPS / 1000)\n"
               "print('slept', SECONDS, 'CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''))"]


def write_notebook(path: Path, simulate: bool, kernel: str = "python3") -> Path:
    """The benchmark notebook (the CNN, or a sleep with ``simulate``), written with nbformat's JSON layout."""
    cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": CNN_PARAMETERS,
              "outputs": [], "execution_count": None}]
    cells += [{"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
              for src in (SLEEP_CELLS if simulate else CNN_CELLS)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": kernel, "display_name": kernel, "language": "python"},
                                       "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i}"
    path.write_text(json.dumps(nb, indent=1))
    return path


def find_gpus(simulate: int = 0) -> list:
    """This machine's GPUs: NVML (nvidia-ml-py) if installed, else ``nvidia-smi``; ``simulate`` fake ones."""
    from nbbatch.gpus import GpuInfo, detect_gpus

    if simulate:
        return [GpuInfo(i, "simulated GPU", 0) for i in range(simulate)]
    gpus = detect_gpus()
    if gpus:
        return gpus
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    found = []
    for line in out.strip().splitlines():
        index, name, memory = (part.strip() for part in line.split(","))
        found.append(GpuInfo(int(index), name, int(float(memory))))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        keep = {int(v) for v in visible.split(",")}
        found = [g for g in found if g.index in keep]
    return found


def use_gpus(gpus: list, name: str = "bench-local") -> str:
    """Register a local backend placed on exactly ``gpus`` (NVML may be absent); returns its name."""
    from nbbatch.backends import register_backend
    from nbbatch.backends.local import LocalBackend

    register_backend(name, lambda **settings: LocalBackend(gpus=list(gpus), **settings))
    return name


def isolate(folder: Path) -> None:
    """Keep the benchmark's experiment registry out of the user's project."""
    os.environ["NBBATCH_PROJECT"] = str(folder)
    (folder / ".nbbatch").mkdir(parents=True, exist_ok=True)


def torch_version() -> str:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "not importable"
