"""Many short GPU batches under CUDA MPS in a row: does every one start, succeed and leave no MPS process behind?

    python benchmarks/mps_cycles.py [--batches 20] [--gpu 0]
    python benchmarks/mps_cycles.py --simulate     # no GPU: CPU notebooks on a fake GPU (checks the script only)

Each batch submits 3 tiny notebooks in the ``python3`` kernel (this interpreter: it must import torch and
ipykernel) with ``resources: {gpus: 1, runs_per_gpu: auto, mps: true}`` on GPU ``--gpu``; each notebook
does ``torch.ones(1000, device="cuda").sum()``, so that every run is a client of the batch's MPS daemon.
After each batch it lists the MPS processes still running (``/proc/<pid>/comm`` starting with
``nvidia-cuda-mps``: pid, parent, state, ``CUDA_MPS_PIPE_DIRECTORY``) and what nbbatch's MPS code warned
about; for a failed batch, the daemon's control.log (saved just before its folder is removed). Ends with
one markdown line. ``--simulate`` runs without MPS where ``nvidia-cuda-mps-control`` is missing, and says so.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from gpu_notebooks import find_gpus, isolate, use_gpus
from machine import describe

GPU_CELL = 'import torch\nx = torch.ones(1000, device="cuda")\nprint(float(x.sum()))'
CPU_CELL = "x = [1.0] * 1000\nprint(float(sum(x)))"  # --simulate: no torch, no GPU


def write_notebooks(folder: Path, cell: str, count: int = 3) -> list[Path]:
    import nbformat

    paths = []
    for i in range(count):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)], metadata={
            "kernelspec": {"name": "python3", "display_name": "python3", "language": "python"}})
        paths.append(folder / f"tiny{i}.ipynb")
        nbformat.write(nb, str(paths[-1]))
    return paths


def mps_processes() -> list[dict]:
    """Every MPS daemon or server on this machine, read from /proc: running, or exited and never reaped (a zombie:
    it holds nothing, but whoever should reap it did not)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            if not comm.startswith("nvidia-cuda-mps"):
                continue
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[:2]
            environ = {} if state in ("Z", "X") else dict(  # a zombie's environment cannot be read
                item.partition("=")[::2] for item in
                Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace").split("\0") if item)
        except OSError:  # gone meanwhile, or another user's
            continue
        found.append({"pid": int(entry), "ppid": int(ppid), "state": state,
                      "pipe": environ.get("CUDA_MPS_PIPE_DIRECTORY", "?")})
    return found


class Warnings(logging.Handler):
    """What nbbatch's MPS code warned about (a kill, a leftover stopped by the next batch), batch by batch."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def keep_control_logs(folder: Path) -> None:
    """Save each daemon's control.log once it is stopped, before its folder is removed."""
    from nbbatch.backends.local.mps import MpsDaemon

    stop = MpsDaemon._stop

    def stop_and_keep(daemon: MpsDaemon) -> None:
        stop(daemon)
        log = Path(daemon.log_dir or "", "control.log")
        if log.is_file():
            shutil.copy(log, folder / "control.log")

    MpsDaemon._stop = stop_and_keep  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20, help="batches in a row (default 20)")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to use (NVML index)")
    parser.add_argument("--simulate", action="store_true", help="no GPU: CPU notebooks on a fake GPU")
    args = parser.parse_args()
    gpus = [g for g in find_gpus(simulate=1 if args.simulate else 0) if g.index == (0 if args.simulate else args.gpu)]
    if not gpus:
        raise SystemExit(f"no GPU {args.gpu} here (NVML and nvidia-smi found none); --simulate runs without one")
    mps = shutil.which("nvidia-cuda-mps-control") is not None
    if not mps and not args.simulate:
        raise SystemExit("no nvidia-cuda-mps-control on PATH: it comes with the NVIDIA driver")
    print(describe(f"{args.batches} batches of 3 tiny notebooks in a row, runs_per_gpu auto, MPS"
                   + (" (SIMULATED: CPU notebooks on a fake GPU)" if args.simulate else "")), end="")
    print(f"- GPU {gpus[0].index}: {gpus[0].name}; MPS: "
          + ("on" if mps else "SKIPPED, no nvidia-cuda-mps-control on PATH (the batches run without MPS)") + "\n")
    import nbbatch

    warned = Warnings()
    logging.getLogger("nbbatch.backends.local.mps").addHandler(warned)
    succeeded, leftovers = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        isolate(root)
        keep_control_logs(root)
        notebooks = write_notebooks(root, CPU_CELL if args.simulate else GPU_CELL)
        backend = use_gpus(gpus)
        for cycle in range(1, args.batches + 1):
            spec = {"experiment": "mpscycles", "notebooks": [{"path": str(p), "kernel": "python3"} for p in notebooks],
                    "resources": {"gpus": 1, "runs_per_gpu": "auto", "mps": mps}, "backend": backend,
                    "share": str(root / "share")}
            warned.lines.clear()
            (root / "control.log").unlink(missing_ok=True)
            start = time.perf_counter()
            try:
                records = nbbatch.submit(spec, progress=False, force=True).records
                outcome = ", ".join(f"{r.run_id} {r.status}" + (f" ({r.error.summary()})" if r.error else "")
                                    for r in records)
                ok = all(r.status == "succeeded" for r in records)
            except Exception as exc:  # a refused or broken batch is a result too: go on with the next
                outcome, ok = f"{type(exc).__name__}: {exc}", False
            wall = time.perf_counter() - start
            left = mps_processes()
            leftovers.append(len(left))
            succeeded += ok
            print(f"batch {cycle}: {wall:.1f} s, {'ok' if ok else 'FAILED'}: {outcome}")
            for p in left:
                print(f"  left {'a zombie' if p['state'] == 'Z' else 'running'}: pid {p['pid']}, ppid {p['ppid']}, "
                      f"state {p['state']}, "
                      f"CUDA_MPS_PIPE_DIRECTORY={p['pipe']}")
            for line in warned.lines:
                print(f"  warned: {line}")
            saved = root / "control.log"
            if (not ok or left) and saved.is_file():
                print("  control.log:\n    " + saved.read_text(errors="replace")[-3000:].replace("\n", "\n    "))
    print(f"\nbatches {args.batches}, all succeeded {succeeded}, MPS processes left (running or zombie) after each "
          f"batch: {leftovers}")


if __name__ == "__main__":
    main()
