"""The share layout: the one place that composes paths inside a share.

::

    <experiment>/experiment.json         the manifest of the last submission
    <pipeline>/pipeline.json             a pipeline's stages: their states, best runs and resolved values (each
                                         stage's runs are the experiment <pipeline>.<stage>)
    <experiment>/CANCEL                  cancels every run of the experiment
    <experiment>/.cancel/<run id>        cancels that run (one listing finds every request)
    <experiment>/.lease                  the driver's lease, on the share itself
    <experiment>/.lock                   the driver's lock (folder shares)
    <experiment>/<run id>/output.ipynb   the executed notebook (also when it failed)
    <experiment>/<run id>/run.json       the run record
    <experiment>/<run id>/log.txt        the kernel's stdout/stderr as it ran
    <experiment>/<run id>/metrics.jsonl  the metric history (``record(step=…)``), streamed as the run goes
    <experiment>/<run id>/telemetry.jsonl GPU samples, streamed as the run goes
    <experiment>/<run id>/outputs/       what the notebook wrote to NBBATCH_OUTPUT_DIR (a model, figures)
    <experiment>/<run id>/checkpoints/   NBBATCH_CHECKPOINT_DIR: kept across the attempts of the run, until it succeeds
    <experiment>/<run id>/ranks/<rank>/  a distributed run's rank: its output.ipynb, log.txt, run.json (rank 0's
                                         are also the run's own, above)
    <experiment>/<run id>/ranks/stop-<n> the first rank that failed in the gang's attempt n: every node stops its ranks
    <experiment>/<run id>/<backend file> what a backend keeps about the run (e.g. azureml.json)

Paths are ``/``-separated and relative to the share's root; every other module asks here.
"""

from __future__ import annotations

from dataclasses import dataclass

OUTPUT_NOTEBOOK = "output.ipynb"
RUN_RECORD = "run.json"
LOG_FILE = "log.txt"
METRICS_FILE = "metrics.jsonl"
TELEMETRY_FILE = "telemetry.jsonl"
OLD_TELEMETRY_FILE = "telemetry.json"  # one JSON document, written by nbbatch before the series was streamed
CANCEL_MARKER = "CANCEL"
MANIFEST = "experiment.json"
PIPELINE_STATE = "pipeline.json"  # a pipeline's folder: its stages' states and resolved values
LOCK_FILE = ".lock"
CANCEL_FOLDER = ".cancel"
LEASE_FILE = ".lease"
OUTPUTS_FOLDER = "outputs"
CHECKPOINTS_FOLDER = "checkpoints"
RANKS_FOLDER = "ranks"


@dataclass(frozen=True)
class ExperimentPaths:
    """Where an experiment's files are in a share."""

    experiment: str

    @property
    def folder(self) -> str:
        return self.experiment

    @property
    def cancel(self) -> str:
        """The marker that cancels every run of the experiment."""
        return f"{self.experiment}/{CANCEL_MARKER}"

    @property
    def cancel_folder(self) -> str:
        """The folder of per-run cancel markers (named by run id)."""
        return f"{self.experiment}/{CANCEL_FOLDER}"

    @property
    def lease(self) -> str:
        """The lease a driving process keeps on the share (see :mod:`nbbatch.store.lease`)."""
        return f"{self.experiment}/{LEASE_FILE}"

    @property
    def manifest(self) -> str:
        return f"{self.experiment}/{MANIFEST}"

    @property
    def lock(self) -> str:
        return f"{self.experiment}/{LOCK_FILE}"

    @property
    def pipeline_state(self) -> str:
        """A pipeline's state (its folder is named as the pipeline; its stages' experiments as <pipeline>.<stage>)."""
        return f"{self.experiment}/{PIPELINE_STATE}"

    def run(self, run_id: str) -> RunPaths:
        return RunPaths(self.experiment, run_id)


@dataclass(frozen=True)
class RunPaths:
    """Where one run's files are in a share."""

    experiment: str
    run_id: str
    rank: int | None = None  # the files of one rank of a distributed run (its notebook, log, record)

    @property
    def folder(self) -> str:
        run = f"{self.experiment}/{self.run_id}"
        return run if self.rank is None else f"{run}/{RANKS_FOLDER}/{self.rank}"

    @property
    def run_folder(self) -> str:
        """The run's folder (also for one rank's paths)."""
        return f"{self.experiment}/{self.run_id}"

    def of_rank(self, rank: int | None) -> RunPaths:
        """The paths of one rank of this run (``None``: the run's own)."""
        return RunPaths(self.experiment, self.run_id, rank)

    @property
    def ranks(self) -> str:
        """The folder of a distributed run's ranks."""
        return f"{self.run_folder}/{RANKS_FOLDER}"

    def gang_stop(self, attempt: int) -> str:
        """The marker naming the first rank that failed in attempt ``attempt`` of the gang: every node stops its ranks."""
        return f"{self.ranks}/stop-{attempt}.json"

    def gang_decision(self, attempt: int) -> str:
        """Node 0's word on whether the gang runs again after attempt ``attempt``; the other nodes wait for it."""
        return f"{self.ranks}/decision-{attempt}.json"

    def file(self, name: str) -> str:
        """A file in the run's folder (a backend's own file, or one of the names below)."""
        return f"{self.folder}/{name}"

    @property
    def notebook(self) -> str:
        return self.file(OUTPUT_NOTEBOOK)

    @property
    def record(self) -> str:
        return self.file(RUN_RECORD)

    @property
    def log(self) -> str:
        return self.file(LOG_FILE)

    @property
    def metrics(self) -> str:
        return self.file(METRICS_FILE)

    @property
    def telemetry(self) -> str:
        return self.file(TELEMETRY_FILE)

    @property
    def outputs(self) -> str:
        """The folder of what the notebook wrote to ``NBBATCH_OUTPUT_DIR``."""
        return f"{self.run_folder}/{OUTPUTS_FOLDER}"

    @property
    def checkpoints(self) -> str:
        """The folder behind ``NBBATCH_CHECKPOINT_DIR``, kept across the run's attempts."""
        return f"{self.run_folder}/{CHECKPOINTS_FOLDER}"

    @property
    def cancel(self) -> str:
        """The marker that cancels this run (kept outside the run folder: one listing finds them all)."""
        return f"{ExperimentPaths(self.experiment).cancel_folder}/{self.run_id}"

    @property
    def cancel_markers(self) -> tuple[str, str]:
        """Both markers that stop this run: the experiment's and its own."""
        return ExperimentPaths(self.experiment).cancel, self.cancel


def run_paths(experiment: str, run_id: str, rank: int | None = None) -> RunPaths:
    """The paths of run ``run_id`` of ``experiment`` (with ``rank``: of that rank of a distributed run)."""
    return RunPaths(experiment, run_id, rank)


def experiment_paths(experiment: str) -> ExperimentPaths:
    """The paths of ``experiment``."""
    return ExperimentPaths(experiment)
