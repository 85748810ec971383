"""Submitting an experiment from a notebook: a background thread, its state, and its progress bar; cancelling runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import nbbatch.ui.widgets.display as display
from nbbatch import api
from nbbatch.errors import NbbatchError
from nbbatch.spec.experiment import Experiment, load_experiment, with_parameters
from nbbatch.store.runfiles import load_records
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import Share, open_share

if TYPE_CHECKING:
    from nbbatch.api import SubmitResult
    from nbbatch.ui.widgets.cluster import Cluster

#: The parameters every framework notebook shares (DESIGN.md); ``submit_all(epochs=3)`` means ``EPOCHS=3``.
SHARED_PARAMETERS = ("EPOCHS", "N_CLASSES", "BATCHSIZE", "LR", "MOMENTUM", "GPU", "SEED", "DATASET", "DATA_DIR",
                     "MAX_SAMPLES")


class SubmissionModel:
    """The state of one submission: planned runs, their records as they change, and the outcome."""

    def __init__(self, experiment: str):
        self.experiment = experiment
        self.state = "planning"  # planning | running | done | error
        self.run_ids: list[str] = []
        self.skipped: list[str] = []
        self.records: dict[str, RunRecord] = {}
        self.error: str | None = None
        self.result: SubmitResult | None = None
        self.budget = 0  # a search: the runs it will make at most (its trials appear as they start)
        self._lock = threading.Lock()

    def planned(self, run_ids: Iterable[str]) -> None:
        """The plan is known: these runs will be submitted (or skipped)."""
        with self._lock:
            self.run_ids = list(run_ids)
            self.state = "running"

    def update(self, record: RunRecord) -> None:
        """A run changed (what :func:`nbbatch.api.submit` reports through its ``progress`` callback)."""
        with self._lock:
            self.records[record.run_id] = record
            if record.run_id not in self.run_ids:
                self.run_ids.append(record.run_id)

    def finished(self, result: SubmitResult) -> None:
        """The submission returned."""
        with self._lock:
            self.result = result
            self.skipped = list(result.skipped)
            for record in result.records:
                self.records[record.run_id] = record
                if record.run_id not in self.run_ids:
                    self.run_ids.append(record.run_id)
            self.state = "done"

    def failed(self, error: BaseException) -> None:
        """The submission raised ``error`` (a plan error, a locked experiment…)."""
        with self._lock:
            self.error = str(error) if isinstance(error, NbbatchError) else f"{type(error).__name__}: {error}"
            self.state = "error"

    @property
    def total(self) -> int:
        """How many runs the submission covers (skipped ones included; a search's budget of trials)."""
        return max(len(self.run_ids), self.budget if self.state != "done" else 0)

    def counts(self) -> dict[str, int]:
        """Runs per status (runs not reported yet count as ``queued``)."""
        with self._lock:
            counts: dict[str, int] = {}
            for run_id in self.run_ids:
                record = self.records.get(run_id)
                status = record.status if record else ("succeeded" if run_id in self.skipped else "queued")
                counts[status] = counts.get(status, 0) + 1
            return counts

    @property
    def finished_count(self) -> int:
        """Runs that are final (skipped ones count as succeeded)."""
        counts = self.counts()
        return sum(n for s, n in counts.items() if s not in ("queued", "running"))

    @property
    def active(self) -> bool:
        """Whether the submission is still planning or running."""
        return self.state in ("planning", "running")

    def bar_style(self) -> str:
        """The progress bar's style: ``success``, ``danger`` (a run failed), ``warning`` or ``info``."""
        counts = self.counts()
        if self.state == "error" or counts.get("failed") or counts.get("timed_out"):
            return "danger"
        if counts.get("cancelled"):
            return "warning"
        return "success" if self.state == "done" else "info"

    def label(self) -> str:
        """One line: what the submission is doing."""
        if self.state == "planning":
            return f"{self.experiment}: planning and validating…"
        if self.state == "error":
            return f"{self.experiment}: submission failed: {self.error}"
        counts = self.counts()
        detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        skipped = f" ({len(self.skipped)} skipped: already succeeded)" if self.skipped else ""
        verb = "done" if self.state == "done" else "running"
        return f"{self.experiment}: {verb}, {self.finished_count}/{self.total} finished — {detail}{skipped}"


_SUBMISSIONS: dict[str, Submission] = {}  # the latest submission of each experiment made in this process


class Submission:
    """A submission running in a background thread: what :func:`submit_all` returns."""

    def __init__(self, experiment: Experiment, force: bool = False, only: list[str] | None = None,
                 build_envs: bool = False):
        self.experiment = experiment
        self.force, self.only, self.build_envs = force, only, build_envs
        self.model = SubmissionModel(experiment.name)
        self.widget: Any = None
        self._planned = threading.Event()
        self._done = threading.Event()
        self._exception: BaseException | None = None
        self._render_lock = threading.Lock()
        self._printed: set[str] = set()
        self.thread = threading.Thread(target=self._work, name=f"nbbatch-submit-{experiment.name}", daemon=True)

    @property
    def name(self) -> str:
        """The experiment's name."""
        return self.experiment.name

    @property
    def share(self) -> str:
        """The share the runs write to."""
        return self.experiment.share

    @property
    def done(self) -> bool:
        """Whether the submission has returned (every run final, or an error)."""
        return self._done.is_set()

    def start(self) -> Submission:
        """Start the background thread (once)."""
        _SUBMISSIONS[self.name] = self
        self.thread.start()
        return self

    def _work(self) -> None:
        try:
            the_plan, _backend, _share = api.prepare(self.experiment, build_envs=self.build_envs, progress=False)
            runs = the_plan.runs
            if self.only:
                runs = [r for r in runs if any(r.run_id.startswith(o) for o in self.only)]
            search = the_plan.experiment.search
            if search is not None:  # the plan's runs are its notebooks; each trial is a run of its own
                self.model.budget = search.trials * len(runs)
            self.model.planned(r.run_id for r in runs if search is None)
            self._planned.set()
            self._render()
            result = api.submit(self.experiment, force=self.force, build_envs=False, wait=True, progress=self._on_update,
                                only=self.only)
            self.model.finished(result)
        except BaseException as exc:  # noqa: BLE001 - shown in the widget and raised again by wait()
            self._exception = exc
            self.model.failed(exc)
        finally:
            self._planned.set()
            try:
                self._render(force=True)  # before done: wait() returns with the widget showing the outcome
            finally:
                self._done.set()

    def _on_update(self, record: RunRecord) -> None:
        self.model.update(record)
        self._render()

    def _render(self, force: bool = False) -> None:
        if self.widget is None:
            return
        with self._render_lock:
            label, bar, details = self.widget.children
            bar.max = max(self.model.total, 1)
            bar.value = self.model.finished_count
            bar.bar_style = self.model.bar_style()
            label.value = display.message_html(self.model.label(), "error" if self.model.state == "error" else "plain")
            if self.model.state == "done" and self.model.result is not None:
                warnings = self.model.result.warnings
                details.value = display.message_html("", "warnings", lines=warnings[:5])

    def planned_runs(self, timeout: float | None = 300) -> list[str]:
        """The ids of the submitted runs, once planning is done (waits up to ``timeout`` seconds)."""
        self._planned.wait(timeout)
        if self._exception is not None and not self.model.run_ids:
            raise self._exception
        return list(self.model.run_ids)

    def wait(self, timeout: float | None = None, quiet: bool = False) -> SubmitResult | None:
        """Block until every run is final; return the :class:`~nbbatch.api.SubmitResult`.

        In text mode print one line per run as it ends (unless ``quiet``). Re-raises the
        submission's error (e.g. a parameter the notebook lacks). Returns None on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        text = self.widget is None and not quiet
        while not self._done.wait(0.5):
            if text:
                self._print_finished()
            if deadline is not None and time.monotonic() > deadline:
                return None
        if text:
            self._print_finished()
        if self._exception is not None:
            raise self._exception
        if text:
            print(self.model.label())
        return self.model.result

    def _print_finished(self) -> None:
        for run_id in list(self.model.run_ids):
            record = self.model.records.get(run_id)
            if record is None or not record.final or run_id in self._printed:
                continue
            self._printed.add(run_id)
            took = f" in {display.format_duration(record.duration_s)}" if record.duration_s else ""
            why = f" ({record.error_summary()})" if record.error else ""
            print(f"{run_id}: {record.status}{took}{why}", flush=True)

    def cancel(self, runs: Sequence[str] | None = None) -> list[str]:
        """Cancel runs of this submission (all unfinished ones by default)."""
        return cancel_all(self.name, share=self.share) if not runs else cancel_job(self.name, list(runs), self.share)

    def _ipython_display_(self) -> None:
        """Already shown by :func:`submit_all`: a cell ending with the call shows it once."""

    def __repr__(self) -> str:
        return f"<Submission {self.model.label()}>"


def experiment_from(experiment: Any) -> Experiment:
    """An :class:`~nbbatch.spec.Experiment` from one, its dict, its YAML file or a :class:`Submission` of it."""
    if isinstance(experiment, Submission):
        return experiment.experiment
    if isinstance(experiment, Experiment):
        return experiment
    if isinstance(experiment, dict):
        return Experiment.from_dict(experiment)
    return load_experiment(experiment)


def _apply_overrides(experiment: Experiment, overrides: dict[str, Any]) -> Experiment:
    known = {name.upper(): name for name in (*SHARED_PARAMETERS, *experiment.parameters)}
    named = {key if key in experiment.parameters else known.get(key.upper(), key): value for key, value in overrides.items()}
    return with_parameters(experiment, named, given_as="submit_all()")


def submit_all(experiment: Any, cluster: Cluster | None = None, *, force: bool = False, only: list[str] | None = None,
               build_envs: bool = False, **overrides: Any) -> Submission:
    """Submit every run of an experiment in a background thread, with a progress bar; return at once.

    ``experiment`` is an :class:`~nbbatch.spec.Experiment`, an experiment YAML path or its dict.
    ``cluster`` (from :func:`setup_cluster`) picks the backend. ``overrides`` set notebook
    parameters for every run: ``epochs=10`` is ``EPOCHS=10`` (the shared parameters are matched
    without case, as deep_bait's ``submit_all(epochs=10)`` did). Runs that already succeeded are
    skipped unless ``force``. Call :meth:`Submission.wait` to block until every run is final.
    """
    spec = _apply_overrides(experiment_from(experiment), overrides)
    if cluster is not None:
        spec = cluster.apply(spec)
    submission = Submission(spec, force=force, only=only, build_envs=build_envs)
    if display.display_mode() == "widgets":
        import ipywidgets as w

        label = w.HTML(display.message_html(submission.model.label()))
        bar = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="60%"))
        details = w.HTML("")
        submission.widget = w.VBox([label, bar, details])
        submission.widget.add_class("nbbatch-submission")
        display.show(display.WithText(submission.widget, submission.model.label))
    else:
        print(f"submitting {spec.name} to the {spec.backend} backend (results in {spec.share})")
    return submission.start()


def experiment_name(experiment: Any) -> str:
    """The experiment's name (a ``str`` is taken as one)."""
    if isinstance(experiment, Submission):
        return experiment.name
    if isinstance(experiment, str):
        return experiment
    return experiment_from(experiment).name


def resolve(experiment: Any, share: str | Share | None) -> tuple[str, Share, Submission | None]:
    """The experiment's name, share and (when this process submitted it) its submission."""
    submission = experiment if isinstance(experiment, Submission) else None
    if submission is None and not isinstance(experiment, str):
        spec = experiment_from(experiment)
        return spec.name, open_share(share or spec.share), _SUBMISSIONS.get(spec.name)
    if submission is not None:
        return submission.name, open_share(share or submission.share), submission
    name = experiment
    submission = _SUBMISSIONS.get(name)
    if submission is not None and not share:
        return name, open_share(submission.share), submission
    name, the_share = api.open_experiment_share(name, share)
    return name, the_share, _SUBMISSIONS.get(name)


def cancel_job(experiment: Any, runs: str | Sequence[str], share: str | Share | None = None) -> list[str]:
    """Cancel one run (or several): they end as ``cancelled`` with their partial output; return those asked."""
    name, the_share, _ = resolve(experiment, share)
    return api.cancel(name, [runs] if isinstance(runs, str) else list(runs), share=the_share)


def cancel_all(experiment: Any, share: str | Share | None = None) -> list[str]:
    """Cancel every unfinished run of an experiment (deep_bait's ``delete_all_jobs``); return those asked.

    The unfinished runs are named one by one (every backend cancels named runs the same way).
    """
    name, the_share, _ = resolve(experiment, share)
    records, _problems = load_records(the_share, name)
    unfinished = [r.run_id for r in records if not r.final]
    return api.cancel(name, unfinished, share=the_share) if unfinished else []

