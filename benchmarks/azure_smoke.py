"""``make azure-smoke``: what only a live Azure ML workspace can answer, asked of one, each answer held to a threshold.

Prints a cost estimate first, then runs two phases one after the other (so that the one-node and two-node clusters
never hold nodes at once: a default T4 quota may not fit both), and prints a table of verdicts; exits 1 when any
probe failed (a skipped one, where the service gave no occasion to ask, is no failure). The probes, the experiments
and the thresholds are in ``azure_smoke_checks.py`` beside this file (tested offline); docs/azure.md says how to read
the table.

* Phase 1, cluster ``nbbatch-probe`` (one node): ``azure-probe`` (the probe notebook with ``tracking: mlflow``, a
  read-only input, a logged line the driver times on the share, the driver's cancel marker, a hold so that jobs queue
  behind it, and a 2 GiB output as its last act); ``azure-probe-names`` (its share folder and its input named with a
  space and non-ASCII characters); two raw jobs: one with a short ``limits.timeout`` queued behind the first run
  (what the limit counts), one the driver cancels while it runs. The driver also cancels a job it sees finalizing
  and the finished first job, and records each answer. Then the cluster is deleted.
* Phase 2, cluster ``nbbatch-probe2`` (two nodes): ``azure-probe-2node``, the notebook as a 2-node MPI job writing to
  the share's root (``paths/./``): node 1 writes a file, node 0 waits for it.

Refuses to start without ``AZURE_SUBSCRIPTION_ID``, ``AZURE_RESOURCE_GROUP``, ``AZUREML_WORKSPACE`` and
``NBBATCH_AZURE_SHARE``. ``--cost-only`` prints the estimate and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its checks, beside it, however this module is loaded
import azure_smoke_checks as checks  # noqa: E402

REQUIRED = ("AZURE_SUBSCRIPTION_ID", "AZURE_RESOURCE_GROUP", "AZUREML_WORKSPACE", "NBBATCH_AZURE_SHARE")
PHASE_DEADLINE_S = 5400.0  # image builds and node allocation included
POLL_S = 5.0
PROBE_EXPERIMENT = "nbbatch-smoke-raw-jobs"  # the Azure ML experiment of the two raw jobs


def missing_variables(environ: Mapping[str, str]) -> list[str]:
    """The workspace variables the smoke test needs and ``environ`` lacks."""
    return [name for name in REQUIRED if not environ.get(name)]


def write_probe(path: Path) -> Path:
    """Write the probe notebook (nbformat 4, the ``parameters`` cell first) to ``path``."""
    import nbformat

    cells = [nbformat.v4.new_code_cell(checks.PROBE_PARAMETERS, metadata={"tags": ["parameters"]})]
    cells += [nbformat.v4.new_code_cell(source) for source in checks.PROBE_CELLS]
    notebook = nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    return path


def raw_job(kind: str, environment: str, compute: str) -> Any:
    """A command job of no nbbatch run, on ``compute`` in ``environment``: ``limit`` sleeps 10 s under a limit of
    ``LIMIT_PROBE_S`` (created while the one-node run holds the cluster's only node, it queues past its limit);
    ``cancel`` sleeps half an hour, to be cancelled while it runs."""
    from azure.ai.ml import command

    sleep_s, limit_s = (10, checks.LIMIT_PROBE_S) if kind == "limit" else (1800, 3600)
    return command(name=f"nbbatch-smoke-{kind}-{uuid.uuid4().hex[:8]}", display_name=f"nbbatch smoke: {kind} probe",
                   experiment_name=PROBE_EXPERIMENT, command=f"echo started; sleep {sleep_s}",
                   environment=environment, compute=compute, timeout=limit_s)


def cancel_job(ml_client: Any, job_name: str) -> str:
    """Ask the service to cancel ``job_name``; what it answered, in one line (``accepted …`` or ``refused: …``)."""
    from nbbatch.backends.azureml.workspace import error_text

    try:
        ml_client.jobs.begin_cancel(job_name).result()
    except Exception as exc:  # noqa: BLE001 - the service's answer is the finding
        status = getattr(exc, "status_code", None)
        return f"refused: {type(exc).__name__}" + (f" (HTTP {status})" if status else "") + f": {error_text(exc)[:400]}"
    return f"accepted (job now {ml_client.jobs.get(job_name).status})"


def big_file_on_share(share: Any, outputs: str, record: Any, size: int = checks.BIG_FILE_BYTES) -> str:
    """``ok`` when the run's big output is on the share whole (its size and its last MiB), else what is wrong."""
    path, count = f"{outputs}/{checks.BIG_FILE}", min(size, 1 << 20)
    listed = {entry.name: entry.bytes for entry in record.outputs}
    if listed.get(checks.BIG_FILE) != size:
        return f"run.json lists {checks.BIG_FILE} with {listed.get(checks.BIG_FILE)} bytes, not {size}"
    try:
        tail = share.read_range(path, size - count)
    except FileNotFoundError:
        return f"{path} is not on the share"
    if len(tail) != count:
        return f"{path} holds {size - count + len(tail)} bytes, not {size}"
    return "ok" if tail == checks.big_file_tail(size, count) else f"the end of {path} is not what was written"


def _seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


@dataclass
class Phase:
    """One phase's experiments, followed until their runs (and the raw jobs) are final, probing as they go."""

    api: Any
    shares: dict[str, Any]  # experiment -> its share
    files: dict[str, Path]
    obs: checks.Observations
    log: Callable[[str], None]
    backend: Any = None
    raw: dict[str, tuple[str, float]] = field(default_factory=dict)  # kind -> (job name, created at)
    raw_status: dict[str, str] = field(default_factory=dict)
    marked: bool = False
    cancelled_at: float | None = None  # when the driver cancelled the running probe job
    records: dict[str, list[Any]] = field(default_factory=dict)

    def follow(self) -> None:
        deadline = time.monotonic() + PHASE_DEADLINE_S
        while time.monotonic() < deadline:
            self.records = {name: self.api.status(str(path)) for name, path in self.files.items()
                            if name not in self.obs.refused}
            for name, runs in self.records.items():
                for record in runs:
                    self._probe(name, record)
            self._raw_jobs()
            runs_done = all(r.final for rs in self.records.values() for r in rs) and all(self.records.values())
            if runs_done and all(s in ("Completed", "Failed", "Canceled") for s in self.raw_status.values()):
                return
            time.sleep(POLL_S)
        self.log(f"the phase did not end within {PHASE_DEADLINE_S:g} s: the table says what is missing")

    def _probe(self, name: str, record: Any) -> None:
        from nbbatch.store.layout import run_paths

        paths, share = run_paths(name, record.run_id), self.shares[name]
        state = self.backend.job_state(share, name, record.run_id)
        status = str(state.job_status) if state else ""
        if name == checks.ONE_NODE:
            if not self.marked and share.exists(f"{paths.outputs}/{checks.WAITING_FILE}"):
                share.write_bytes(f"{paths.outputs}/{checks.MARKER_FILE}", b"written as nbbatch cancel writes")
                self.marked = True
                self.log("the probe waits: marker written")
            if self.obs.log_delay_s is None and not record.final:
                self._log_line(share, paths.log)
            if status == "Running" and not self.raw and state is not None:
                environment = str(self.backend.ml_client.jobs.get(state.job_name).environment)
                for kind in ("limit", "cancel"):
                    job = self.backend.ml_client.jobs.create_or_update(raw_job(kind, environment,
                                                                               checks.ONE_NODE_CLUSTER))
                    self.raw[kind] = (job.name, time.monotonic())
                    self.log(f"{kind} probe job {job.name} created")
        elif status == "Finalizing" and "finalizing" not in self.obs.cancel and state is not None:
            self.obs.cancel = {**self.obs.cancel, "finalizing": cancel_job(self.backend.ml_client, state.job_name)}

    def _log_line(self, share: Any, log_path: str) -> None:
        try:
            text = share.read_bytes(log_path).decode("utf-8", "replace")
        except FileNotFoundError:
            return
        for line in text.splitlines():
            if line.startswith(checks.LOG_LINE):
                self.obs.log_delay_s = max(0.0, time.time() - float(line[len(checks.LOG_LINE):].split()[0]))

    def _raw_jobs(self) -> None:
        client = self.backend.ml_client if self.raw else None
        for kind, (name, created) in self.raw.items():
            job_status = client.jobs.get(name).status
            status = str(getattr(job_status, "value", job_status))
            ended = status in ("Completed", "Failed", "Canceled")
            if kind == "limit" and status not in ("NotStarted", "Queued", "Preparing", "Provisioning"):
                if self.obs.limit_probe_queued_s is None:
                    self.obs.limit_probe_queued_s = time.monotonic() - created
                self.obs.limit_probe = status if ended else None
            if kind == "cancel" and status == "Running" and "running" not in self.obs.cancel:
                self.obs.cancel = {**self.obs.cancel, "running": cancel_job(client, name)}
                self.cancelled_at = time.monotonic()
            if kind == "cancel" and ended and self.raw_status.get(kind) != status and self.cancelled_at is not None:
                took = time.monotonic() - self.cancelled_at
                answer = self.obs.cancel["running"]
                if status != "Canceled" or took > checks.CANCEL_WITHIN_S:
                    answer = f"not honoured: the job ended {status} {took:.0f} s after the cancel ({answer})"
                self.obs.cancel = {**self.obs.cancel, "running": f"{answer}; {status} after {took:.0f} s"}
            self.raw_status[kind] = status


def submit(api: Any, folder: Path, specs: Mapping[str, dict[str, Any]], obs: checks.Observations,
           log: Callable[[str], None]) -> dict[str, Path]:
    """Write and submit each experiment (without waiting); one nbbatch refuses is noted in ``obs.refused``."""
    from nbbatch.errors import NbbatchError

    files = {}
    for name, spec in specs.items():
        if name in obs.refused:
            continue
        files[name] = folder / f"{name}.yaml"
        files[name].write_text("# written by benchmarks/azure_smoke.py\n" + yaml.safe_dump(spec, sort_keys=False))
        log(f"submitting {name} ({files[name]})")
        try:
            api.submit(str(files[name]), force=True, wait=False, progress=False)
        except NbbatchError as exc:
            obs.refused = {**obs.refused, name: str(exc).splitlines()[0][:300]}
            log(f"{name} refused: {obs.refused[name]}")
    return files


def prepare_shares(specs: Mapping[str, dict[str, Any]], obs: checks.Observations) -> dict[str, Any]:
    """Each experiment's share, its probe input written beside it; an experiment whose share or input nbbatch refuses
    (the odd folder name, should its rules refuse one) is noted in ``obs.refused`` and not submitted."""
    from nbbatch.errors import NbbatchError
    from nbbatch.store.share import open_share

    shares = {}
    for name, spec in specs.items():
        try:
            shares[name] = open_share(spec["share"])
            for url in spec.get("inputs", {}).values():
                folder = url[len(specs[checks.ONE_NODE]["share"]):].strip("/")
                shares[checks.ONE_NODE].write_bytes(f"{folder}/{checks.INPUT_FILE}", checks.INPUT_TEXT.encode())
        except NbbatchError as exc:
            if name != checks.NAMES:  # the smoke test's own share: nothing can be asked without it
                raise
            obs.refused = {**obs.refused, name: str(exc).splitlines()[0][:300]}
    return shares


def run_smoke(folder: Path, share_url: str, vm_size: str, api: Any, log: Callable[[str], None] = print) -> list[Any]:
    """Both phases, then the verdicts (:func:`azure_smoke_checks.evaluate`)."""
    from nbbatch.backends.azureml import AzureMLBackend
    from nbbatch.backends.azureml.rules import QUEUE_AND_BUILD_SLACK_S
    from nbbatch.store.layout import run_paths

    notebook = write_probe(folder / "probe.ipynb")
    specs = checks.smoke_experiments(share_url, vm_size, notebook.name)
    obs = checks.Observations()
    shares = prepare_shares(specs, obs)
    share = shares[checks.ONE_NODE]
    backend = AzureMLBackend()
    first = {name: specs[name] for name in (checks.ONE_NODE, checks.NAMES)}
    phase = Phase(api, shares, submit(api, folder, first, obs, log), obs, log, backend)
    phase.follow()
    records = dict(phase.records)
    one_node = records.get(checks.ONE_NODE) or []
    if one_node:
        state = backend.job_state(share, checks.ONE_NODE, one_node[0].run_id)
        if state is not None:
            obs.cancel = {**obs.cancel, "finished": cancel_job(backend.ml_client, state.job_name)}
            obs.setup_s = _seconds_between(state.submitted_at, one_node[0].started_at)
        if one_node[0].final:
            obs.big_file = big_file_on_share(share, run_paths(checks.ONE_NODE, one_node[0].run_id).outputs,
                                             one_node[0])
    log(f"deleting cluster {checks.ONE_NODE_CLUSTER} before the two-node phase")
    AzureMLBackend(compute=checks.ONE_NODE_CLUSTER).cluster.delete()
    second = {checks.TWO_NODES: specs[checks.TWO_NODES]}
    phase = Phase(api, shares, submit(api, folder, second, obs, log), obs, log, backend)
    phase.follow()
    obs.records = {**records, **phase.records}
    return checks.evaluate(obs, QUEUE_AND_BUILD_SLACK_S)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vm-size", default="Standard_NC4as_T4_v3")
    parser.add_argument("--folder", default=".nbbatch/azure-smoke", help="where the probe and experiments are written")
    parser.add_argument("--cost-only", action="store_true", help="print the cost estimate and exit")
    args = parser.parse_args(argv)
    print(checks.cost_estimate(args.vm_size), flush=True)
    if args.cost_only:
        return 0
    environ = os.environ if environ is None else environ
    missing = missing_variables(environ)
    if missing:
        print(f"azure-smoke: set {', '.join(missing)} (see docs/azure.md, `make azure-smoke`)", file=sys.stderr)
        return 2
    from nbbatch import api

    rows = run_smoke(Path(args.folder), environ["NBBATCH_AZURE_SHARE"], args.vm_size, api)
    print(checks.format_table(rows))
    return checks.exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
