"""Distributed runs through nbbatch's launcher, beside the same notebook started by hand, in the same call.

    python benchmarks/distributed.py --gpus 1,2,4 --rounds 3 --json results.jsonl   # the four notebooks
    python benchmarks/distributed.py --frameworks lightning --gpus 1,2 --rounds 1
    python benchmarks/distributed.py --cpu-ranks 2 --frameworks pytorch              # CPU ranks over gloo (digits)

Each round runs, for every framework and GPU count N, the framework's notebook twice with the same parameters:

- **raw**: the notebook's code as a plain Python script (papermill's parameters injected, the code cells joined)
  started the way one starts such a script by hand: ``torchrun --standalone --nproc_per_node N`` for the torch
  notebooks (plain ``python`` at N = 1), plain ``python`` over N visible GPUs for the JAX ones. No kernel, no
  checkpoints (outside nbbatch the notebooks write none), torchrun's defaults (``OMP_NUM_THREADS=1``, no pinning);
- **nbbatch**: the notebook submitted with ``nbbatch.api.submit`` to the local backend: an ordinary run at N = 1,
  else N ranks of one GPU each (torch, DDP over NCCL) or one process over N GPUs (JAX). It writes a checkpoint
  every epoch, as any run under nbbatch does.

``--variant LABEL:NAME=VALUE`` adds a distributed run through nbbatch with that variable in the
experiment's ``env:`` (``unpinned:NBBATCH_CPUS=``: ranks not pinned; ``omp1:OMP_NUM_THREADS=1``: as torchrun).

The speed is ``images_per_second`` as rank 0 measures it: every rank's images, leaving out the first epoch.
Every N trains about as long: ``--epochs`` at one GPU, N times as many at N GPUs (``--same-epochs``: not so).
The data is ``--train-images`` CIFAR-shaped synthetic images, ``BATCHSIZE`` 512 per GPU, ``GPU=True``.

Made for a GPU machine without nbbatch's framework venvs, like gpu_notebooks.py: each notebook runs in this
Python (it needs torch, lightning, jax, flax, optax, keras, papermill and ipykernel). With ``--cpu-ranks`` it
uses the project's framework environments on digits instead (nbbatch only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from machine import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
KIND = {"pytorch": "torch", "lightning": "torch", "jax-flax": "jax", "keras-jax": "jax",
        "tensorflow": "tensorflow", "keras-tf": "tensorflow"}
MARK = "NBBATCH_BENCH "
# Appended to the raw script: what rank 0 (and every rank) measured, as one line on stdout.
FOOTER = f"""
import json as _json, os as _os
_timers = [globals().get('epoch_seconds'), getattr(globals().get('epoch_end'), 'seconds', None),
           getattr(globals().get('timer'), 'seconds', None)]
print({MARK!r} + _json.dumps({{
    'rank': int(_os.environ.get('RANK', '0')), 'images_per_second': float(images_per_second),
    'epoch_seconds': [float(s) for s in next((t for t in _timers if t), [])],
    'weights_checksum': float(weights_checksum(model)) if 'weights_checksum' in globals() else None}}), flush=True)
"""
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+: .*?([\d.]+) s$", re.MULTILINE)


def experiment_for(name: str, gpus: int, cpu_ranks: int, parameters: dict, folder: Path, backend: str,
                   env: dict[str, str]):
    from nbbatch.spec.experiment import Experiment, NotebookEntry, Resources
    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    framework = get_framework(name, Project(ROOT))
    kind = KIND[name]
    ranks = cpu_ranks or gpus
    resources = Resources(gpus=gpus)
    if ranks > 1:
        per_node = ranks if kind == "torch" else 1
        resources = Resources.of(kind, gpus_per_node=gpus, processes_per_node=per_node)
    label = re.sub(r"[^a-z0-9]+", "-", f"{name}-{gpus}gpu-{cpu_ranks}cpu-{env}".lower()).strip("-")
    return Experiment(name=label, base_dir=folder, share=str(folder / "results"),
                      notebooks=[NotebookEntry(framework.notebook, framework.kernel_name, name)],
                      parameters=parameters, backend=backend, resources=resources, env=env)


def nbbatch_run(name: str, gpus: int, parameters: dict, folder: Path, backend: str, cpu_ranks: int = 0,
                env: dict[str, str] | None = None) -> dict:
    """One run of framework ``name``'s notebook through nbbatch over ``gpus`` GPUs (1: an ordinary run) or
    ``cpu_ranks`` CPU ranks: rank 0's metrics, its epoch times, whether every rank ended with the same weights."""
    import nbformat

    from nbbatch.api import submit
    from nbbatch.metrics import metrics_from_notebook

    experiment = experiment_for(name, gpus, cpu_ranks, parameters, folder, backend, env or {})
    start = time.perf_counter()
    (record,) = submit(experiment, force=True, progress=False).records
    wall = time.perf_counter() - start
    run_dir = folder / "results" / experiment.name / record.run_id
    if record.status != "succeeded":
        raise SystemExit(f"{name} on {gpus} GPU(s): {record.status}: {record.error.summary() if record.error else ''}"
                         f"\nlog: {run_dir / 'log.txt'}")
    checksums = {record.metrics.get("weights_checksum")}
    for rank in range(1, record.world_size):
        notebook = nbformat.read(run_dir / "ranks" / str(rank) / "output.ipynb", as_version=4)
        checksums.add(metrics_from_notebook(notebook).get("weights_checksum"))
    printed = (run_dir / "log.txt").read_text(errors="replace") if (run_dir / "log.txt").exists() else ""
    epochs = [float(s) for _, s in EPOCH_LINE.findall(printed)]
    return {"images_per_second": float(record.metrics["images_per_second"]), "world_size": record.world_size,
            "same_weights": len(checksums) == 1, "epoch_seconds": epochs, "wall_s": wall,
            "run_s": record.duration_s}


def raw_script(name: str, parameters: dict, folder: Path) -> Path:
    """The notebook's code with ``parameters`` injected as papermill does, as one script."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    framework = get_framework(name, Project(ROOT))
    notebook = parameterize_notebook(load_notebook_node(str(framework.notebook)), parameters)
    code = ["\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
            for cell in notebook.cells if cell.cell_type == "code"]
    script = folder / f"{name}.py"
    script.write_text("\n\n".join(code) + "\n" + FOOTER)
    return script


def raw_run(name: str, gpus: list[int], parameters: dict, folder: Path) -> dict:
    """The notebook as a script under torchrun (torch, N > 1) or plain python, on the GPUs ``gpus``."""
    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    work = folder / "raw" / f"{name}-{len(gpus)}"
    work.mkdir(parents=True, exist_ok=True)
    script = raw_script(name, parameters, work)
    env = {**os.environ, **get_framework(name, Project(ROOT)).kernel_env,
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    command = [sys.executable, str(script)]
    if KIND[name] == "torch" and len(gpus) > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(gpus)}",
                   str(script)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (work / "stdout.txt").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    lines = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"raw {name} on {len(gpus)} GPU(s) failed (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    rank0 = next(line for line in lines if line["rank"] == 0)
    return {"images_per_second": rank0["images_per_second"], "epoch_seconds": rank0["epoch_seconds"],
            "same_weights": len({line["weights_checksum"] for line in lines}) == 1, "wall_s": wall,
            "world_size": len(lines)}


def epochs_text(seconds: list[float]) -> str:
    return " ".join(f"{s:.3f}" for s in seconds[1:]) if seconds else "–"


def summary(results: list[dict], counts: list[int]) -> str:
    """Per framework and N: nbbatch ÷ raw in every round, and the speed-ups over the raw run on one GPU."""
    lines = ["| framework | GPUs | nbbatch ÷ raw, each round | lowest | speed-up raw | speed-up nbbatch |",
             "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["framework"] for r in results):
        for count in counts:
            rounds = sorted({r["round"] for r in results if r["framework"] == name and r["gpus"] == count})
            ratios, ups_raw, ups_nb = [], [], []
            for rnd in rounds:
                got = {r["launcher"]: r["images_per_second"] for r in results
                       if r["framework"] == name and r["round"] == rnd and r["gpus"] == count}
                base = next((r["images_per_second"] for r in results if r["framework"] == name and r["round"] == rnd
                             and r["gpus"] == counts[0] and r["launcher"] == "raw"), None)
                if "raw" in got and "nbbatch" in got:
                    ratios.append(got["nbbatch"] / got["raw"])
                if base and "raw" in got:
                    ups_raw.append(got["raw"] / base * counts[0])
                if base and "nbbatch" in got:
                    ups_nb.append(got["nbbatch"] / base * counts[0])
            if ratios:
                lines.append(f"| {name} | {count} | {', '.join(f'{x:.3f}' for x in ratios)} | {min(ratios):.3f} | "
                             f"{', '.join(f'{x:.2f}' for x in ups_raw)} | {', '.join(f'{x:.2f}' for x in ups_nb)} |")
    lines += ["", "| framework | GPUs | launcher | runs | images/s: mean (lowest–highest) | mean ÷ raw's mean |",
              "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["framework"] for r in results):
        for count in counts:
            speeds: dict[str, list[float]] = {}
            for r in results:
                if r["framework"] == name and r["gpus"] == count:
                    speeds.setdefault(r["launcher"], []).append(r["images_per_second"])
            raw_mean = statistics.mean(speeds["raw"]) if "raw" in speeds else None
            for launcher, got in speeds.items():
                mean = statistics.mean(got)
                ratio = f"{mean / raw_mean:.3f}" if raw_mean else "–"
                lines.append(f"| {name} | {count} | {launcher} | {len(got)} | {mean:,.0f} ({min(got):,.0f}–"
                             f"{max(got):,.0f}) | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="pytorch,lightning,jax-flax,keras-jax")
    parser.add_argument("--gpus", default="1,2", help="GPU counts to compare (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=6, help="at the first GPU count; N times as many at N GPUs")
    parser.add_argument("--same-epochs", action="store_true", help="--epochs at every GPU count")
    parser.add_argument("--train-images", type=int, default=50_000)
    parser.add_argument("--batchsize", type=int, default=512, help="per GPU")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:NAME=VALUE",
                        help="one more distributed run through nbbatch, with this variable in the experiment's "
                             "env: (e.g. unpinned:NBBATCH_CPUS= or omp1:OMP_NUM_THREADS=1)")
    parser.add_argument("--no-raw", action="store_true", help="nbbatch only")
    parser.add_argument("--alternate", action="store_true",
                        help="nbbatch before raw in odd rounds (raw first in every round otherwise): is a slow run "
                             "the launcher's or the first of its kind on the machine?")
    parser.add_argument("--raw-only-at-baseline", action="store_true",
                        help="at the first GPU count only the raw run (the speed-ups' baseline)")
    parser.add_argument("--json", help="append one JSON line per run here")
    parser.add_argument("--cpu-ranks", type=int, default=0, help="CPU ranks over gloo on digits instead of GPUs")
    args = parser.parse_args()
    names = args.frameworks.split(",")
    variants = {label: dict([setting.split("=", 1)]) for label, _, setting in (v.partition(":") for v in args.variant)}
    folder = Path(tempfile.mkdtemp(prefix="nbbatch-bench-distributed-"))
    os.environ["NBBATCH_PROJECT"] = str(folder)
    (folder / ".nbbatch").mkdir()
    if args.cpu_ranks:
        from nbbatch.spec.project import Project

        Project(ROOT).activate_kernels()
        counts, backend, gpus, args.no_raw = [1, args.cpu_ranks], "local", [], True
        print(describe(f"distributed framework notebooks: {args.cpu_ranks} CPU ranks against 1 (digits)"))
    else:
        from gpu_notebooks import find_gpus, register_kernels, use_gpus, write_data

        register_kernels(folder / "jupyter", names)
        data = write_data(folder / "data", args.train_images, 10_000)
        gpus = find_gpus()
        counts = [int(n) for n in args.gpus.split(",") if int(n) <= len(gpus)]
        backend = use_gpus(gpus)
        print(describe(f"distributed framework notebooks on {', '.join(g.name for g in gpus)}: "
                       f"{args.train_images} CIFAR-shaped images, batch {args.batchsize} per GPU, "
                       f"{args.epochs} epochs at {counts[0]} GPU(s)" + ("" if args.same_epochs else ", N× at N")))
    unit = "CPU ranks" if args.cpu_ranks else "GPUs"
    print(f"\n| round | framework | {unit} | launcher | images/s (after epoch 1) | nbbatch ÷ raw | same weights | "
          "epoch seconds after the first | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    results: list[dict] = []
    for rnd in range(1, args.rounds + 1):
        for name in names:
            for count in counts:
                epochs = args.epochs if args.same_epochs else args.epochs * count // counts[0]
                if args.cpu_ranks:
                    parameters = {"EPOCHS": epochs}
                else:
                    parameters = {"GPU": True, "DATASET": "cifar10", "DATA_DIR": str(data),
                                  "BATCHSIZE": args.batchsize, "EPOCHS": epochs}
                ranks = dict(gpus=0, cpu_ranks=count) if args.cpu_ranks else dict(gpus=count, cpu_ranks=0)
                runs = [] if args.no_raw else [("raw", partial(raw_run, name, [g.index for g in gpus[:count]],
                                                               parameters, folder))]
                if count != counts[0] or not args.raw_only_at_baseline:
                    runs.append(("nbbatch", partial(nbbatch_run, name, parameters=parameters, folder=folder,
                                                    backend=backend, **ranks)))
                for label, env in variants.items():
                    if count > 1:
                        runs.append((f"nbbatch-{label}", partial(nbbatch_run, name, parameters=parameters,
                                                                  folder=folder, backend=backend, env=env, **ranks)))
                if args.alternate and rnd % 2 and runs and runs[0][0] == "raw":
                    runs.append(runs.pop(0))
                raw_speed = None
                for launcher, go in runs:
                    got = go()
                    speed = got["images_per_second"]
                    raw_speed = speed if launcher == "raw" else raw_speed
                    row = {"round": rnd, "framework": name, "gpus": count, "launcher": launcher, "epochs": epochs,
                           **got}
                    results.append(row)
                    if args.json:
                        with open(args.json, "a") as out:
                            out.write(json.dumps(row) + "\n")
                    ratio = f"{speed / raw_speed:.3f}" if raw_speed and launcher != "raw" else "–"
                    same = "–" if got["world_size"] == 1 else ("yes" if got["same_weights"] else "NO")
                    print(f"| {rnd} | {name} | {count} | {launcher} | {speed:,.0f} | {ratio} | {same} | "
                          f"{epochs_text(got['epoch_seconds'])} | {got['wall_s']:.1f} |", flush=True)
    print("\n" + summary(results, counts))


if __name__ == "__main__":
    main()
