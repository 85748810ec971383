"""Prove GPU pinning on a real multi-GPU machine: which device each run saw, and its telemetry.

    python benchmarks/gpu_pinning.py [--gpus 0,1] [--kernel python3]

Runs a notebook that trains a few hundred matmuls on whatever ``CUDA_VISIBLE_DEVICES`` gives it and
prints the device's PCI bus id, first with 2 runs (one per GPU), then 4 runs with ``runs_per_gpu: 2``.
Needs torch in the kernel. Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import nbformat

CELL = """import os, torch
visible = os.environ['CUDA_VISIBLE_DEVICES']
props = torch.cuda.get_device_properties(0)
bus = getattr(props, 'pci_bus_id', '') or str(getattr(props, 'uuid', ''))
x = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
for _ in range(400):
    y = x @ x
torch.cuda.synchronize()
print(f'VISIBLE={visible} NAME={props.name} BUS={bus}')
"""


def notebook(path: Path, kernel: str) -> None:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("RUN = 0")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(CELL),
                nbformat.v4.new_code_cell("import nbbatch; nbbatch.record(visible=visible, bus=bus)")]
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    nbformat.write(nb, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", default="0,1")
    parser.add_argument("--kernel", default="python3")
    args = parser.parse_args()
    os.environ["NBBATCH_GPUS"] = args.gpus
    import nbbatch
    from nbbatch.backends.local.gpus import detect_gpus

    print("GPUs:", ", ".join(f"{g.index}: {g.name}" for g in detect_gpus()))
    print("\n| case | run | CUDA_VISIBLE_DEVICES | device seen (PCI bus) | util mean / max % | memory max MB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        nb = Path(tmp) / "pin.ipynb"
        notebook(nb, args.kernel)
        for runs, per_gpu in ((2, 1), (4, 2)):
            spec = {"experiment": f"pin-{runs}x{per_gpu}", "notebooks": [{"path": str(nb), "kernel": args.kernel}],
                    "sweep": {"grid": {"RUN": list(range(runs))}}, "resources": {"gpus": 1, "runs_per_gpu": per_gpu},
                    "share": str(Path(tmp) / "share")}
            start = time.perf_counter()
            result = nbbatch.submit(spec, progress=False)
            wall = time.perf_counter() - start
            for r in sorted(result.records, key=lambda r: r.parameters["RUN"]):
                t, m = r.telemetry or {}, r.metrics
                print(f"| {runs} runs, runs_per_gpu {per_gpu} ({wall:.1f} s) | {r.parameters['RUN']} | {m.get('visible')} "
                      f"| {m.get('bus')} | {t.get('util_mean_pct')} / {t.get('util_max_pct')} | {t.get('memory_max_mb')} |")
            assert result.ok, [r.error for r in result.records]


if __name__ == "__main__":
    main()
