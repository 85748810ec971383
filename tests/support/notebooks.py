"""Notebooks for tests: :func:`make_notebook` writes a tiny one for the ``python3`` kernel; the rest are
small training-like notebooks executed for real with papermill.

The training notebooks call ``nbbatch.record(...)`` like the framework notebooks do; :func:`make_run`
executes one into a share layout (``<share>/<experiment>/<run id>/output.ipynb``) and writes its
``run.json`` from :class:`nbbatch.store.runjson.RunRecord`, the way the executor records a run.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import nbformat
import papermill
from papermill.exceptions import PapermillExecutionError

from nbbatch.metrics import metrics_from_notebook
from nbbatch.plan.runs import run_id_for
from nbbatch.store.layout import OUTPUT_NOTEBOOK, RUN_RECORD
from nbbatch.store.notebook_io import cell_number
from nbbatch.store.runjson import RunError, RunRecord, utc_now

KERNEL = "python3"


def make_notebook(path: Path, cells: list[str], parameters: str | None = "A = 1\nB = 'x'", kernel: str = KERNEL,
                  extra_parameter_cells: int = 0) -> Path:
    """Write a notebook whose first cell (tagged `parameters`) is ``parameters``, then ``cells``."""
    nb = nbformat.v4.new_notebook()
    if parameters is not None:
        for _ in range(1 + extra_parameter_cells):
            cell = nbformat.v4.new_code_cell(parameters)
            cell.metadata["tags"] = ["parameters"]
            nb.cells.append(cell)
    nb.cells.extend(nbformat.v4.new_code_cell(src) for src in cells)
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path

# A notebook fragment: rank 0 listens on MASTER_ADDR:MASTER_PORT (holding the port HOLD seconds after) and every
# other rank says hello to it, so the ranks of one run must agree on the master's address, as
# init_process_group(init_method="env://") does; `hellos` is the ranks rank 0 heard.
RANK_HELLOS = """\
host, port = os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT'])
hellos = []
if rank == 0:
    with socket.create_server((host, port)) as server:
        server.settimeout(120)
        for _ in range(world - 1):
            conn, _ = server.accept()
            hellos.append(int(conn.recv(16)))
            conn.close()
        time.sleep(HOLD)
else:
    for _ in range(600):
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            time.sleep(0.1)
    conn.sendall(str(rank).encode())
    conn.close()
"""


# A notebook cell for searches: the loss falls with the step and is the higher the further LR is from 0.01, so a bad
# LR is clearly worse at every step (parameters LR, EPOCHS, PAUSE).
LOSS_CURVE = """\
import math, time, nbbatch
for step in range(1, EPOCHS + 1):
    nbbatch.record(step=step, loss=abs(math.log10(LR) + 2) + 1.0 / step)
    time.sleep(PAUSE)
"""
SEARCH = {"metric": "loss", "mode": "min", "trials": 6, "sampler": "random", "seed": 3,
          "pruner": {"median": {"startup_trials": 2, "warmup_steps": 2}}, "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}}


PARAMETERS = """\
EPOCHS = 2
LR = 0.1
SEED = 0
SHIFT = 0.0
FAIL = False
"""

BODY = """\
import math, time
import nbbatch
t0 = time.perf_counter()
# a stand-in for training: accuracy rises with epochs and peaks near LR=0.05 (log scale)
base = {base!r}
accuracy = min(0.999, base + 0.02 * EPOCHS - 0.05 * abs(math.log10(LR) - math.log10(0.05)) + SHIFT)
train_seconds = {speed!r} * EPOCHS
loss = 1.0 - accuracy
print(f"epochs={{EPOCHS}} lr={{LR}} accuracy={{accuracy:.4f}}")
"""

RECORD = """\
nbbatch.record(accuracy=accuracy, loss=loss, train_seconds=train_seconds)
"""

MAYBE_FAIL = """\
if FAIL:
    raise RuntimeError("diverged: loss is nan")
nbbatch.record(finished=True)
"""

# two "frameworks": different base accuracy and speed, so plots and groups have something to show
FRAMEWORKS = {"pytorch": (0.80, 1.5), "keras": (0.76, 2.5)}


def training_notebook(folder: Path, framework: str) -> Path:
    """Write ``<Framework>_CIFAR.ipynb`` (parameters cell tagged ``parameters``) and return its path."""
    base, speed = FRAMEWORKS[framework]
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"# {framework} on a stand-in for CIFAR-10"),
        nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(BODY.format(base=base, speed=speed)),
        nbformat.v4.new_code_cell(RECORD),
        nbformat.v4.new_code_cell(MAYBE_FAIL),
    ]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{framework.capitalize()}_CIFAR.ipynb"
    nbformat.write(nb, path)
    return path


def execute(notebook: Path, output: Path, parameters: dict[str, Any]) -> bool:
    """Execute with papermill in the ``python3`` kernel; return whether it succeeded (output written either way)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        papermill.execute_notebook(
            str(notebook), str(output), parameters=parameters, kernel_name=KERNEL,
            progress_bar=False, log_output=False, cwd=str(notebook.parent),
        )
    except PapermillExecutionError:
        return False
    return True


def make_run(share: Path, experiment: str, framework: str, parameters: dict[str, Any], notebooks: Path,
             telemetry: dict[str, Any] | None = None, write_record: bool = True) -> Path:
    """Execute one run into ``<share>/<experiment>/<run id>/`` and write its run.json; return the run folder."""
    notebook = training_notebook(notebooks, framework)
    run_id = run_id_for(framework, notebook.read_bytes(), parameters, "test-lock")
    folder = share / experiment / run_id
    started = utc_now()
    ok = execute(notebook, folder / OUTPUT_NOTEBOOK, parameters)
    nb = nbformat.read(folder / OUTPUT_NOTEBOOK, as_version=4)
    if write_record:
        error = None
        if not ok:
            for index, cell in enumerate(nb["cells"]):
                for out in cell.get("outputs", []):
                    if out.get("output_type") == "error":
                        error = RunError(ename=out["ename"], evalue=out["evalue"], cell_index=cell_number(nb.cells, index),
                                         cell_source=cell["source"].splitlines()[0])
        record = RunRecord(
            run_id=run_id, experiment=experiment, notebook=str(notebook), kernel=KERNEL, framework=framework,
            parameters=parameters, status="succeeded" if ok else "failed", attempts=1,
            started_at=started, ended_at=utc_now(), duration_s=nb["metadata"]["papermill"]["duration"],
            host=socket.gethostname(), gpu_ids=[], error=error, metrics=metrics_from_notebook(nb),
            telemetry=telemetry or {},
        )
        (folder / RUN_RECORD).write_bytes(record.to_json())
    return folder


def build_share(root: Path) -> dict[str, Path]:
    """A share and a plain papermill folder made of real executions (about ten kernels).

    ``share/sweep``: pytorch and keras × LR 0.01, 0.1 (succeeded) plus keras LR 0.03 failing part-way
    (after it recorded its metrics); ``share/drift``: pytorch × LR 0.01, 0.1 with accuracy 0.05 lower;
    ``share/empty``: an experiment folder with nothing in it. ``plain``: papermill outputs without
    run.json (two at the top, one failing in ``sub/``).
    """
    share, notebooks, plain = root / "share", root / "notebooks", root / "plain"
    for framework in ("pytorch", "keras"):
        for lr in (0.01, 0.1):
            make_run(share, "sweep", framework, {"LR": lr, "EPOCHS": 2}, notebooks)
    make_run(share, "sweep", "keras", {"LR": 0.03, "EPOCHS": 2, "FAIL": True}, notebooks)
    for lr in (0.01, 0.1):
        make_run(share, "drift", "pytorch", {"LR": lr, "EPOCHS": 2, "SHIFT": -0.05}, notebooks)
    (share / "empty").mkdir(parents=True)
    execute(training_notebook(notebooks, "pytorch"), plain / "pytorch_lr0.01.ipynb", {"LR": 0.01})
    execute(training_notebook(notebooks, "keras"), plain / "keras_lr0.1.ipynb", {"LR": 0.1, "EPOCHS": 3})
    execute(training_notebook(notebooks, "keras"), plain / "sub" / "keras_fail.ipynb", {"LR": 0.1, "FAIL": True})
    return {"share": share, "plain": plain, "notebooks": notebooks}
