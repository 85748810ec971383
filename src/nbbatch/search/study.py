"""Optuna behind an experiment's ``search:``: the study of one notebook, its journal, its sampler and pruner.

Optuna is imported in these functions only (``pip install nbbatch[search]``): nothing else of nbbatch needs it. The
study lives in a journal file on the driver's disk (:class:`optuna.storages.JournalStorage`), beside the experiment
file, so a driver started again finds every trial it asked for and told, and goes on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError
from nbbatch.spec.search import SEED_LIMIT, Search
from nbbatch.store.runjson import RunRecord, cell_label

JOURNAL_FOLDER = ".nbbatch-search"  # beside the experiment file: <folder>/<experiment>/<notebook label>.journal
RUN_ID = "run_id"  # the trial's user attribute naming its run
REBUILD_FIX = ("submit with --rebuild-search to rebuild the study from its runs' records (`trial:` in run.json; the "
               "journal is kept beside it)")
FAILURE = "failure"  # a failed trial's user attribute: how its run failed (see failure_of)
METRIC_MISSING = "the metric was never recorded"


class SearchError(NbbatchError):
    """The search cannot go on (a metric never recorded, a journal of another search)."""


def optuna_module() -> Any:
    """Optuna, or an error saying how to install it."""
    try:
        import optuna
    except ImportError as exc:
        raise SearchError("`search:` runs on Optuna, which is not installed here: pip install 'nbbatch[search]' "
                          "(or pip install optuna)") from exc
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # nbbatch says what happens, once
    return optuna


def study_label(template_run_id: str) -> str:
    """A study's label in its experiment: its template run's id less the hash (``nb`` of ``nb-1a2b3c4d5e``); the study
    is ``<experiment>/<label>``, and its trials' records say so."""
    return template_run_id.rsplit("-", 1)[0]


def journal_path(base_dir: Path, experiment: str, label: str) -> Path:
    """Where the study of ``label`` (a framework or notebook) of ``experiment`` keeps its journal."""
    return Path(base_dir) / JOURNAL_FOLDER / experiment / f"{label}.journal"


def search_fingerprint(search: Search, template_run_id: str, with_budget: bool = False) -> str:
    """What a study was started for: the search block, less its budget (``trials`` may grow or shrink in the same
    study), and the notebook with its fixed parameters (the template run's id). A journal written for another
    fingerprint is not resumed. ``with_budget``: the fingerprint as earlier nbbatch wrote it, budget included."""
    block = search.to_dict()
    if not with_budget:
        del block["trials"]
    text = json.dumps(block, sort_keys=True, default=str)
    return hashlib.sha256(f"{text}\0{template_run_id}".encode()).hexdigest()[:16]


def sampler_of(search: Search, asked: int = 0) -> Any:
    """The search's sampler. Its seed moves on by the trials ``asked`` before (a study resumed by a new driver): the
    same seed again would draw the first trials' parameters again."""
    optuna = optuna_module()
    samplers = optuna.samplers
    seed = None if search.seed is None else (search.seed + asked) % SEED_LIMIT  # numpy's range of seeds
    if search.sampler == "grid":
        return _grid_sampler(samplers.GridSampler)({p.name: list(p.args) for p in search.params}, seed=seed)
    if search.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    if search.sampler == "cmaes":
        if importlib.util.find_spec("cmaes") is None:  # Optuna's CMA-ES sampler needs it
            raise SearchError("sampler cmaes needs the `cmaes` package: pip install cmaes")
        return samplers.CmaEsSampler(seed=seed)
    if search.sampler == "qmc":
        return samplers.QMCSampler(seed=seed)
    if search.sampler == "nsga2":
        return samplers.NSGAIISampler(seed=seed)
    return samplers.TPESampler(seed=seed)


def _grid_sampler(base: type) -> type:
    class Grid(base):  # type: ignore[misc, valid-type]
        """Optuna's grid sampler, less its Study.stop() once every point was drawn: that works only inside
        ``study.optimize``, and here the budget (search.trials, no more than the grid's points) ends the search."""

        def after_trial(self, *args: Any) -> None:
            return None

    return Grid


def pruner_of(search: Search) -> Any:
    """The study's pruner. A promoting search's trials end at their rungs and its schedule decides which continue
    (:mod:`nbbatch.search.rungs`): Optuna prunes none of them itself."""
    pruners = optuna_module().pruners
    s = search.pruner_settings
    if search.promotes:
        return pruners.NopPruner()
    if search.pruner == "median":
        return pruners.MedianPruner(n_startup_trials=int(s["startup_trials"]), n_warmup_steps=int(s["warmup_steps"]),
                                    interval_steps=int(s["interval_steps"]))
    if search.pruner == "percentile":
        return pruners.PercentilePruner(float(s["percentile"]), n_startup_trials=int(s["startup_trials"]),
                                        n_warmup_steps=int(s["warmup_steps"]), interval_steps=int(s["interval_steps"]))
    if search.pruner == "asha":
        return pruners.SuccessiveHalvingPruner(min_resource=int(s["min_resource"]),
                                               reduction_factor=int(s["reduction_factor"]),
                                               min_early_stopping_rate=int(s["min_early_stopping_rate"]))
    if search.pruner == "hyperband":
        return pruners.HyperbandPruner(min_resource=int(s["min_resource"]), max_resource=int(s["max_resource"]),
                                       reduction_factor=int(s["reduction_factor"]))
    return pruners.NopPruner()


def open_study(search: Search, path: Path, name: str, fingerprint: str, fresh: bool = False,
               say: Callable[[str], None] = print, earlier: Collection[str] = ()) -> Any:
    """The study ``name`` in the journal at ``path`` (created, or resumed when it was started for the same search);
    ``fresh``: an earlier journal is set aside first (``submit --force``). A journal's damaged end is dropped, saying
    so with ``say`` (:func:`repair_journal`). A study started under one of the ``earlier`` fingerprints (the same
    search, as an older nbbatch fingerprinted it) is resumed, and its fingerprint brought up to date."""
    optuna = optuna_module()
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh and (path.exists() or path.is_symlink()):
        path.replace(path.with_suffix(".journal.old"))
    repair_journal(path, say)
    storage = JournalStorage(JournalFileBackend(str(path)))
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler_of(search), pruner=pruner_of(search),
                                directions=directions(search), load_if_exists=True)
    asked = len(study.get_trials(deepcopy=False))
    if asked:
        study.sampler = sampler_of(search, asked=asked)
    started_for = study.user_attrs.get("fingerprint")
    if started_for is None or started_for != fingerprint and started_for in earlier:
        study.set_user_attr("fingerprint", fingerprint)
    elif started_for != fingerprint:
        raise SearchError(f"the journal {path} holds study `{name}` of another search (its search block besides "
                          "trials, notebook or fixed parameters changed since): submit with --force to start this one "
                          "afresh (the old journal is kept as .journal.old), or give the experiment another name")
    return study


def directions(search: Search) -> list[str]:
    """The study's directions, one per objective (Optuna's words)."""
    return ["minimize" if mode == "min" else "maximize" for mode in search.modes]


def repair_journal(path: Path, say: Callable[[str], None]) -> None:
    """Make the journal at ``path`` readable by Optuna, or raise :class:`SearchError` naming it and the fix.

    A journal is appended one line per operation. A driver killed mid-write, or a full disk, leaves a half-written
    last line: it is dropped (the operation never happened), as is any other damage after the last good line.
    Damage before a good line is refused: an operation lost in the middle would shift what the later ones mean."""
    if not path.exists() and not path.is_symlink():
        return
    fix = ("submit with --force to start the search afresh (the journal is kept as .journal.old; the runs already on "
           f"the share stay, and a trial that draws the same parameters reuses its run), or {REBUILD_FIX}")
    if not path.is_file():
        raise SearchError(f"the search journal {path} is not a file: move it aside, or {fix}")
    try:
        data = path.read_bytes()
        writable = os.access(path, os.W_OK)
    except OSError as exc:
        raise SearchError(f"the search journal {path} cannot be read ({exc.strerror}): {fix}") from exc
    if not writable:
        raise SearchError(f"the search journal {path} cannot be written (read-only): make it writable "
                          f"(chmod u+w), or {fix}")
    lines = data.split(b"\n")  # the last piece is what follows the last newline: b"" when the journal is whole
    good = [_journal_line(line) for line in lines[:-1]]
    damaged = [number for number, ok in enumerate(good, 1) if not ok] + ([len(lines)] if lines[-1] else [])
    if not damaged:
        return
    first = damaged[0]
    if any(good[first:]):
        raise SearchError(f"the search journal {path} is damaged at line {first} (not an Optuna journal record), "
                          f"before records that depend on it, so its study cannot be read: {fix}")
    keep = sum(len(line) + 1 for line in lines[:first - 1])
    with path.open("r+b") as journal:
        journal.truncate(keep)
    say(f"the search journal {path} ended in {len(damaged)} damaged line(s) (a driver stopped mid-write, or a full "
        f"disk): dropped them, keeping its first {first - 1} record(s)")


def _journal_line(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError):
        return False


def suggest(trial: Any, search: Search) -> dict[str, Any]:
    """The parameters ``trial`` draws from the search's space."""
    drawn: dict[str, Any] = {}
    for p in search.params:
        if p.kind == "choice":
            drawn[p.name] = trial.suggest_categorical(p.name, list(p.args))
        elif p.kind == "randint":
            drawn[p.name] = trial.suggest_int(p.name, p.args[0], p.args[1])
        else:
            drawn[p.name] = trial.suggest_float(p.name, p.args[0], p.args[1], log=p.kind == "loguniform")
    return drawn


def report(trial: Any, value: float, step: int) -> None:
    """Tell the study ``trial``'s ``value`` at ``step``; a step reported before (its run attempted again: a retry, or
    a trial run again on resume) takes the new attempt's value, so the study holds the values of the attempt that
    ends the trial.

    Optuna's ``Trial.report`` keeps a step's first value (warning once per step reported again); its storages'
    ``set_trial_intermediate_value`` overwrites (documented on ``BaseStorage``). The trial's cached copy is what
    ``should_prune`` judges, so it is updated as ``Trial.report`` does."""
    held = trial._cached_frozen_trial.intermediate_values
    if step not in held:
        trial.report(value, step)
    elif held[step] != value:
        trial.storage.set_trial_intermediate_value(trial._trial_id, step, value)
        held[step] = value


def trial_of(study: Any, number: int) -> Any:
    """The live trial ``number`` of ``study`` (to report to and ask whether to prune), also one a previous driver
    asked for."""
    from optuna.trial import Trial

    frozen = study.get_trials(deepcopy=False)[number]
    return Trial(study, frozen._trial_id)


def failure_of(record: RunRecord) -> str:
    """How a run failed, to tell a notebook that fails whatever the parameters: its exception and cell."""
    error = record.error
    if error is None:
        return f"its run {record.status}"
    cell = cell_label(error.cell_index, error.cell_source)
    return f"{error.ename} in {cell}" if cell else f"{error.ename} ({error.kind})"
