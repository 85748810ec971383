"""``make azure-smoke``: what only a live Azure ML workspace can answer, asked of one, printed as a table.

Two experiments go to the workspace (``backend: azureml``, the framework image of PyTorch):

* ``azure-probe``: one run of a probe notebook on one node, with ``tracking: mlflow``. It answers, from
  inside the job: rename, ``O_EXCL`` and ``pwrite`` on the share's ``rw_mount``; whether ``uv`` runs in the
  built image; the job's user and ``HOME``; whether MLflow's URI and the run token reach a kernel that asked
  for tracking. It then waits for a file this driver writes to the share the way ``nbbatch cancel`` writes its
  marker (``Share.write_bytes``), and reports how long it took to appear in the job.
* ``azure-probe-2node``: the same notebook over two nodes (``distribution: torch``) without tracking: node 1
  writes a file to the run's outputs, node 0 waits for it; and whether the run token reached node 0's kernel.

Afterwards the driver cancels the finished job of the first run and reports what the service answered, and
looks for a low-priority preemption (a lost attempt in any run's record): it cannot provoke one.

Refuses to start without ``AZURE_SUBSCRIPTION_ID``, ``AZURE_RESOURCE_GROUP``, ``AZUREML_WORKSPACE`` and
``NBBATCH_AZURE_SHARE``. Billed: two small clusters' worth of node time (see docs/azure.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REQUIRED = ("AZURE_SUBSCRIPTION_ID", "AZURE_RESOURCE_GROUP", "AZUREML_WORKSPACE", "NBBATCH_AZURE_SHARE")
ONE_NODE, TWO_NODES = "azure-probe", "azure-probe-2node"
WAITING_FILE, MARKER_FILE, NODE1_FILE = "probe-waiting", "driver-marker", "from-node-1"
DEADLINE_S = 5400.0  # image builds and node allocation included
POLL_S = 15.0

# The probe notebook's cells. `import torch` makes it a PyTorch notebook (its image and kernel) where the project
# has that framework; elsewhere (the tests) it runs in the notebook's own kernel. Only names and yes/no are
# recorded, never a variable's value.
PROBE_PARAMETERS = "MARKER_WAIT_S = 900\nNODE_WAIT_S = 600"
PROBE_CELLS = [
    """\
import errno, getpass, os, shutil, subprocess, time
from pathlib import Path
import nbbatch
from nbbatch.artifacts import output_dir
try:
    import torch  # noqa: F401  (only so that the notebook is recognised as a PyTorch one)
except ImportError:
    pass
out = output_dir()
rank = int(os.environ.get("NBBATCH_RANK", "0"))
world = int(os.environ.get("NBBATCH_WORLD_SIZE", "1"))""",
    """\
def attempt(step):
    try:
        return step()
    except OSError as exc:
        return f"error: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}"

def rename_over():
    (out / "a.tmp").write_bytes(b"new"); (out / "a").write_bytes(b"old")
    os.rename(out / "a.tmp", out / "a")
    return "replaces an existing file" if (out / "a").read_bytes() == b"new" else "kept the old file"

def exclusive():
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    os.close(os.open(out / "excl", flags))
    try:
        os.close(os.open(out / "excl", flags))
    except FileExistsError:
        return "second create refused (EEXIST)"
    return "second create succeeded: O_EXCL not honoured"

def pwrite():
    fd = os.open(out / "pw", os.O_CREAT | os.O_RDWR | os.O_TRUNC)
    try:
        os.pwrite(fd, b"0123456789", 0); os.pwrite(fd, b"AB", 4)
        return "in place" if os.pread(fd, 10, 0) == b"0123AB6789" else f"wrong bytes {os.pread(fd, 10, 0)!r}"
    finally:
        os.close(fd)

def uv():
    found = shutil.which("uv")
    if not found:
        return "not on PATH"
    done = subprocess.run([found, "--version"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[:200]}"

if rank == 0:
    nbbatch.record(rename=attempt(rename_over), o_excl=attempt(exclusive), pwrite=attempt(pwrite), uv=attempt(uv),
                   user=f"{getpass.getuser()} (uid {os.getuid()})", home=os.environ.get("HOME", "(unset)"),
                   mlflow_uri_in_kernel="MLFLOW_TRACKING_URI" in os.environ,
                   run_token_in_kernel="AZUREML_RUN_TOKEN" in os.environ)""",
    """\
def wait_for(path, limit):
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if path.exists():
            return f"seen after {time.monotonic() - start:.0f} s"
        time.sleep(2)
    return f"not seen within {limit:g} s"

if world > 1:
    if rank == 1:
        (out / "from-node-1").write_text("written on node 1")
    elif rank == 0:
        nbbatch.record(node1_file_on_node0=wait_for(out / "from-node-1", NODE_WAIT_S))
elif rank == 0:
    (out / "probe-waiting").write_text("waiting for the driver's marker")
    nbbatch.record(driver_marker=wait_for(out / "driver-marker", MARKER_WAIT_S))""",
]

QUESTIONS = [  # (question, experiment, metric)
    ("rename over an existing file on the rw_mount", ONE_NODE, "rename"),
    ("O_CREAT|O_EXCL on the rw_mount", ONE_NODE, "o_excl"),
    ("pwrite at an offset on the rw_mount", ONE_NODE, "pwrite"),
    ("a driver-written marker (as `nbbatch cancel`'s) seen in the job", ONE_NODE, "driver_marker"),
    ("a file written on node 1 seen on node 0", TWO_NODES, "node1_file_on_node0"),
    ("`uv --version` in the built image", ONE_NODE, "uv"),
    ("the job's user", ONE_NODE, "user"),
    ("the job's HOME", ONE_NODE, "home"),
    ("MLflow's URI reaches a kernel with `tracking: mlflow`", ONE_NODE, "mlflow_uri_in_kernel"),
    ("the run token reaches a kernel with `tracking: mlflow`", ONE_NODE, "run_token_in_kernel"),
    ("the run token reaches a kernel without `tracking:`", TWO_NODES, "run_token_in_kernel"),
]


def missing_variables(environ: Mapping[str, str]) -> list[str]:
    """The workspace variables the smoke test needs and ``environ`` lacks."""
    return [name for name in REQUIRED if not environ.get(name)]


def smoke_experiments(share: str, vm_size: str, notebook: str) -> dict[str, dict[str, Any]]:
    """The two experiments (as experiment-file dicts), each on a cluster of its own, deleted afterwards."""
    backend = {"name": "azureml", "vm_size": vm_size, "min_nodes": 0, "idle_time_before_scale_down": 300}
    return {
        ONE_NODE: {"experiment": ONE_NODE, "notebooks": [notebook], "resources": {"gpus": 1}, "tracking": "mlflow",
                   "timeout": {"run": 2700}, "share": share,
                   "backend": {**backend, "compute": "nbbatch-probe", "max_nodes": 1}},
        TWO_NODES: {"experiment": TWO_NODES, "notebooks": [notebook], "distribution": {"type": "torch"},
                    "resources": {"nodes": 2, "processes_per_node": 1, "gpus_per_node": 1},
                    "timeout": {"run": 2700}, "share": share,
                    "backend": {**backend, "compute": "nbbatch-probe2", "max_nodes": 2}},
    }


def answers(records: Mapping[str, Sequence[Any]], cancel_answer: str) -> list[tuple[str, str]]:
    """The table's rows: each question and the live answer (``records``: experiment -> its run records)."""
    rows = []
    for question, experiment, metric in QUESTIONS:
        runs = records.get(experiment) or []
        if not runs:
            rows.append((question, "no answer: the run never started"))
            continue
        record = runs[0]
        value = (record.metrics or {}).get(metric)
        if value is None:
            why = record.error.summary() if record.error else record.status
            value = f"no answer ({why})"
        rows.append((question, "yes" if value is True else "no" if value is False else str(value)))
    rows.append(("cancelling a finished job", cancel_answer))
    lost = [f"{r.run_id} attempt {e.attempt}" for rs in records.values() for r in rs
            for e in r.attempt_log if e.status == "lost"]
    rows.append(("a low-priority preemption", f"observed: {', '.join(lost)} lost" if lost
                 else "not observed (it cannot be provoked from here)"))
    return rows


def cancel_finished_job(ml_client: Any, job_name: str) -> str:
    """Ask the service to cancel ``job_name`` (already finished); return what it answered, in one line."""
    from nbbatch.backends.azureml.workspace import error_text

    try:
        ml_client.jobs.begin_cancel(job_name).result()
    except Exception as exc:  # noqa: BLE001 - the service's answer is the finding
        status = getattr(exc, "status_code", None)
        return f"refused: {type(exc).__name__}" + (f" (HTTP {status})" if status else "") + f": {error_text(exc)[:400]}"
    return f"accepted (job now {ml_client.jobs.get(job_name).status})"


def format_table(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(q) for q, _ in rows)
    lines = [f"{'question'.ljust(width)} | live answer", f"{'-' * width}-+-{'-' * 40}"]
    return "\n".join([*lines, *(f"{q.ljust(width)} | {a}" for q, a in rows)])


def write_probe(path: Path) -> Path:
    """Write the probe notebook (nbformat 4, the ``parameters`` cell first) to ``path``."""
    import nbformat

    cells = [nbformat.v4.new_code_cell(PROBE_PARAMETERS, metadata={"tags": ["parameters"]})]
    cells += [nbformat.v4.new_code_cell(source) for source in PROBE_CELLS]
    notebook = nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    return path


def run_smoke(folder: Path, share_url: str, vm_size: str, api: Any, log: Callable[[str], None] = print) -> str:
    """Submit both experiments, answer the probe's marker, wait for both, ask the rest; return the table."""
    from nbbatch.backends.azureml import AzureMLBackend
    from nbbatch.store.layout import run_paths
    from nbbatch.store.share import open_share

    notebook = write_probe(folder / "probe.ipynb")
    files = {}
    for name, spec in smoke_experiments(share_url, vm_size, notebook.name).items():
        files[name] = folder / f"{name}.yaml"
        files[name].write_text("# written by benchmarks/azure_smoke.py\n" + yaml.safe_dump(spec, sort_keys=False))
        log(f"submitting {name} ({files[name]})")
        api.submit(str(files[name]), force=True, wait=False, progress=False)
    share = open_share(share_url)
    deadline, marked = time.monotonic() + DEADLINE_S, False
    records: dict[str, list[Any]] = {}
    while time.monotonic() < deadline:
        records = {name: api.status(str(path)) for name, path in files.items()}
        for record in records[ONE_NODE] if not marked else []:
            outputs = run_paths(ONE_NODE, record.run_id).outputs
            if share.exists(f"{outputs}/{WAITING_FILE}"):
                share.write_bytes(f"{outputs}/{MARKER_FILE}", b"written by the smoke driver")  # as cancel markers
                marked = True
                log("the probe waits: marker written")
        if all(r.final for rs in records.values() for r in rs) and all(records.values()):
            break
        time.sleep(POLL_S)
    cancel_answer = "not asked: the one-node run has no job"
    if records.get(ONE_NODE):
        backend = AzureMLBackend()
        state = backend.job_state(share, ONE_NODE, records[ONE_NODE][0].run_id)
        if state is not None:
            cancel_answer = cancel_finished_job(backend.ml_client, state.job_name)
    return format_table(answers(records, cancel_answer))


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vm-size", default="Standard_NC4as_T4_v3")
    parser.add_argument("--folder", default=".nbbatch/azure-smoke", help="where the probe and experiments are written")
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    missing = missing_variables(environ)
    if missing:
        print(f"azure-smoke: set {', '.join(missing)} (see docs/azure.md, `make azure-smoke`)", file=sys.stderr)
        return 2
    from nbbatch import api

    print(run_smoke(Path(args.folder), environ["NBBATCH_AZURE_SHARE"], args.vm_size, api))
    return 0


if __name__ == "__main__":
    sys.exit(main())
