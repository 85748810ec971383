"""Six runs of a realistic training notebook packed on one GPU against the same six one after another.

    python benchmarks/gpu_pack_resnet.py                          # 6 runs, modes 1,auto,auto+mps
    python benchmarks/gpu_pack_resnet.py --images 50000 --epochs 30   # runs that train for minutes each
    python benchmarks/gpu_pack_resnet.py --cpu --kernel nbbatch-pytorch --images 256 --epochs 1 --modes 1,auto
                                                           # no GPU: checks the script in the project's env

The notebook, given by path from a folder of its own (as a user keeps it) in the ``python3`` kernel, trains a
ResNet-18 for CIFAR (3×3 stem, four stages of two basic blocks, 64 to 512 channels, 11.2 M weights) on
``--images`` CIFAR-shaped synthetic images held on the GPU, ``--epochs`` epochs of batch ``--batchsize``, bf16
autocast, channels-last, SGD with momentum; it records its images per second (after the first epoch) and its
training seconds. A run uses well under half of an H100/H200 at batch 128: its small 32×32 convolutions
leave most of the GPU idle between kernel launches, which is what packing several runs on one GPU reclaims.

Each mode of ``--modes`` submits the six runs (a sweep over ``SEED``), in order: ``1`` (``runs_per_gpu: 1``,
one after another: the baseline), ``auto`` (packed by memory; the first ``auto`` finds the notebook recognised
as PyTorch, later ones start from what it measured), ``+mps`` under CUDA MPS. Prints one markdown table: wall
time, throughput against the sequential batch of the same call, the median images per second of a run, and
the peak GPU memory of a run. Needs torch, papermill and ipykernel in this Python, and this repo's src (found
on its own).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from gpu_notebooks import find_gpus, isolate, submit_all, use_gpus
from machine import describe, median

PARAMETERS = "EPOCHS = 3\nIMAGES = 10000\nBATCHSIZE = 128\nSEED = 0\nGPU = True"
CELLS = [
    "import time\nimport nbbatch\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F",
    "torch.manual_seed(SEED)\n"
    "device = torch.device('cuda' if GPU else 'cpu')\n"
    "x = torch.randn(IMAGES, 3, 32, 32, device=device).contiguous(memory_format=torch.channels_last)\n"
    "y = torch.randint(0, 10, (IMAGES,), device=device)",
    "class Block(nn.Module):\n"
    "    def __init__(self, cin, cout, stride):\n"
    "        super().__init__()\n"
    "        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)\n"
    "        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)\n"
    "        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(\n"
    "            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))\n"
    "\n"
    "    def forward(self, x):\n"
    "        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.short(x))\n"
    "\n"
    "\n"
    "def resnet18(classes=10):\n"
    "    layers, cin = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()], 64\n"
    "    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):\n"
    "        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]\n"
    "        cin = cout\n"
    "    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))\n"
    "\n"
    "\n"
    "model = resnet18().to(device, memory_format=torch.channels_last)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)",
    "epoch_seconds = []\n"
    "for epoch in range(EPOCHS):\n"
    "    if GPU:\n"
    "        torch.cuda.synchronize()\n"
    "    start = time.perf_counter()\n"
    "    order = torch.randperm(IMAGES, device=device)\n"
    "    for i in range(0, IMAGES - BATCHSIZE + 1, BATCHSIZE):\n"
    "        batch = order[i:i + BATCHSIZE]\n"
    "        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=GPU):\n"
    "            loss = F.cross_entropy(model(x[batch]), y[batch])\n"
    "        optimizer.zero_grad(set_to_none=True)\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "    if GPU:\n"
    "        torch.cuda.synchronize()\n"
    "    epoch_seconds.append(time.perf_counter() - start)\n"
    "steady = epoch_seconds[1:] or epoch_seconds\n"
    "images_per_second = (IMAGES // BATCHSIZE) * BATCHSIZE * len(steady) / sum(steady)\n"
    "nbbatch.record(images_per_second=images_per_second, train_seconds=sum(epoch_seconds), loss=float(loss))\n"
    "print(f'{sum(epoch_seconds):.1f} s, {images_per_second:.0f} images/s, loss {float(loss):.3f}')",
]


def write_notebook(path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "python3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in CELLS]
    nbformat.write(nb, str(path))
    return path


def submit_mode(mode: str, args: argparse.Namespace, notebook: Path, share: Path, backend: str) -> dict:
    per_gpu, mps = mode.removesuffix("+mps"), mode.endswith("+mps")
    spec = {"experiment": f"resnet-{'seq' if per_gpu == '1' else 'packed'}",
            "notebooks": [{"path": str(notebook), "kernel": args.kernel}],
            "parameters": {"EPOCHS": args.epochs, "IMAGES": args.images, "BATCHSIZE": args.batchsize, "GPU": not args.cpu},
            "sweep": {"grid": {"SEED": list(range(args.runs))}},
            "resources": {"gpus": 0 if args.cpu else 1, "mps": mps,
                          "runs_per_gpu": int(per_gpu) if per_gpu.isdigit() else per_gpu},
            "backend": {"name": backend}, "share": str(share)}
    result, wall = submit_all(spec, f"resnet {mode}")
    speeds = [r.metrics["images_per_second"] for r in result.records]
    peaks = [r.telemetry.get("memory_run_max_mb") for r in result.records if isinstance(r.telemetry, dict)]
    needs = sorted({f"{r.gpu_share.need_mb:.0f} MiB ({r.gpu_share.need_from})" for r in result.records
                    if r.gpu_share is not None and r.gpu_share.need_mb})
    return {"wall": wall, "speed": median(speeds), "train": median([r.metrics["train_seconds"] for r in result.records]),
            "peak": max((p for p in peaks if isinstance(p, (int, float))), default=None), "needs": ", ".join(needs) or "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="1,auto,auto+mps", help="1, k, auto, each optionally +mps")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batchsize", type=int, default=128)
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to use (NVML index)")
    parser.add_argument("--kernel", default="python3", help="python3 (this Python; default) or a project kernel")
    parser.add_argument("--cpu", action="store_true", help="no GPU: runs on the CPU (checks the script only)")
    args = parser.parse_args()
    gpus = [] if args.cpu else [g for g in find_gpus() if g.index == args.gpu]
    if not gpus and not args.cpu:
        raise SystemExit(f"no GPU {args.gpu} here; --cpu checks the script without one")
    where = f"GPU {gpus[0].index}: {gpus[0].name}, {gpus[0].memory_mb} MiB" if gpus else "CPU only (a check, not a measurement)"
    print(describe(f"{args.runs} ResNet-18 runs packed on one GPU against one after another"), end="")
    print(f"- {where}; {args.images} images × {args.epochs} epochs, batch {args.batchsize}\n", flush=True)
    if args.kernel != "python3":
        from gpu_notebooks import ROOT

        from nbbatch.spec.project import Project
        Project(ROOT).activate_kernels()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        isolate(root)
        (root / "my-notebooks").mkdir()
        notebook = write_notebook(root / "my-notebooks" / "resnet18.ipynb")
        backend = use_gpus(gpus)
        base = None
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            result = submit_mode(mode, args, notebook, root / "share", backend)
            base = base or result["wall"]
            rows.append((mode, result, base))
            print(f"{mode}: {result['wall']:.1f} s", file=sys.stderr, flush=True)
    print("| mode | wall (all runs) | throughput vs sequential | median images/s of a run | median training | "
          "peak GPU memory of a run | reserved / run |")
    print("|---|---|---|---|---|---|---|")
    for mode, r, base in rows:
        peak = f"{r['peak']:.0f} MiB" if r["peak"] else "-"
        print(f"| {mode} | {r['wall']:.1f} s | {base / r['wall']:.2f}× | {r['speed']:.0f} | {r['train']:.1f} s | {peak} | "
              f"{r['needs']} |")
    print(json.dumps({"rows": [{"mode": m, **r} for m, r, _ in rows]}), file=sys.stderr)


if __name__ == "__main__":
    main()
