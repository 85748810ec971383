"""What a container costs a run: the same digits notebooks from the venv and from the framework's image.

    python benchmarks/containers.py [--framework chainer] [--runs 4] [--rounds 3] [--engine podman]
                                    [--base IMAGE] [--cpu]

Needs the framework's venv (``nbbatch envs create``) and image (``nbbatch images build``, with the
same ``--base``/``--cpu``). Each round submits the same experiment (``--runs`` runs of the framework's
notebook on digits, small MAX_SAMPLES) twice with ``nbbatch submit --force`` in a new process, once
with ``backend: local`` and once with ``container: true``, in alternating order, and reads the runs'
durations from run.json. Prints a markdown table: medians over rounds of the batch's wall time and of
a run's duration (kernel start to end, as run.json has it), and the container/venv ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe, median

ROOT = Path(__file__).resolve().parents[1]


def experiment(folder: Path, name: str, framework: str, runs: int, container: bool, engine: str, base: str | None,
               cpu: bool) -> Path:
    backend = "{name: local"
    if container:
        backend += f", container: true, engine: {engine}, cpu_image: {str(cpu).lower()}"
        backend += f", base_image: '{base}'" if base else ""
    path = folder / f"{name}.yaml"
    lrs = ", ".join(str(0.01 * (i + 1)) for i in range(runs))
    path.write_text(f"experiment: {name}\nframeworks: [{framework}]\n"
                    "parameters: {DATASET: digits, EPOCHS: 1, MAX_SAMPLES: 300}\n"
                    f"sweep: {{grid: {{LR: [{lrs}]}}}}\nbackend: {backend}}}\nshare: {folder / 'share'}\n")
    return path


def submit(path: Path, name: str, share: Path) -> tuple[float, list[float]]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", str(path), "-q", "--force"],
                          capture_output=True, text=True, env={**os.environ, "NBBATCH_PROJECT": str(ROOT)})
    wall = time.perf_counter() - started
    records = [json.loads(p.read_text()) for p in (share / name).glob("*/run.json")]
    if done.returncode != 0:
        errors = "\n".join(f"{r['run_id']}: {r.get('error')}" for r in records if r.get("error"))
        raise SystemExit(f"{name} failed:\n{done.stdout}{done.stderr}\n{errors}")
    return wall, [r["duration_s"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", default="chainer")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", default="podman")
    parser.add_argument("--base")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    print(describe("containers vs venv"))
    results: dict[str, dict[str, list[float]]] = {"venv": {"wall": [], "run": []}, "container": {"wall": [], "run": []}}
    with tempfile.TemporaryDirectory(prefix="nbbatch-bench-containers-") as tmp:
        folder = Path(tmp)
        paths = {kind: experiment(folder, f"bench-{kind}", args.framework, args.runs, kind == "container",
                                  args.engine, args.base, args.cpu) for kind in results}
        for round_ in range(args.rounds):
            for kind in (("venv", "container") if round_ % 2 == 0 else ("container", "venv")):
                wall, runs = submit(paths[kind], f"bench-{kind}", folder / "share")
                results[kind]["wall"].append(wall)
                results[kind]["run"].extend(runs)
                print(f"round {round_ + 1} {kind}: batch {wall:.1f} s, runs {', '.join(f'{r:.1f}' for r in runs)} s")
    print(f"\n{args.runs} runs of {args.framework} on digits (MAX_SAMPLES 300, 1 epoch), {args.rounds} rounds, "
          f"engine {args.engine}\n")
    print("| | venv | container | container / venv |\n|---|---|---|---|")
    for what, label in (("wall", "batch wall time (nbbatch submit, new process)"), ("run", "one run (run.json duration)")):
        venv, container = median(results["venv"][what]), median(results["container"][what])
        print(f"| {label} | {venv:.1f} s | {container:.1f} s | {container / venv:.2f}× |")


if __name__ == "__main__":
    main()
