"""Pipelines: a file of stages, each an ordinary experiment, chained by references to what earlier stages made.

::

    pipeline: digits-study
    share: ./results
    backend: local                      # every stage's, unless the stage names its own
    stages:
      prep:  {notebooks: [prep.ipynb], parameters: {N: 1500}}
      train: {frameworks: [pytorch], inputs: {DATA_DIR: "${prep.outputs}"}, sweep: {grid: {LR: [0.01, 0.1]}},
              select: {metric: accuracy, mode: max}}
      final: {notebooks: [evaluate.ipynb], parameters: {LR: "${train.best.parameters.LR}"},
              inputs: {MODEL_DIR: "${train.best.outputs}"}}

A reference names a stage and what of it: ``outputs`` (the outputs/ folder of a stage of one run),
``best.outputs``, ``best.parameters.NAME``, ``best.metrics.NAME``, ``best.framework``, ``best.run_id`` (the best run
by the stage's ``select:`` or its search's metric), or ``runs`` (every succeeded run: its id, framework, parameters,
metrics and outputs folder). References go in a stage's ``parameters``, ``inputs`` and ``env``, and imply ``needs``.
This module reads and checks the file (:func:`load_pipeline`); :mod:`nbbatch.drivers.pipeline` runs it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError, SpecError, did_you_mean
from nbbatch.spec.experiment import Experiment
from nbbatch.spec.notify import NotifySpec, parse_notify
from nbbatch.spec.yaml_loader import read_spec_file

REFERENCE = re.compile(r"\$\{([^}]*)\}")
STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,49}$")
PIPELINE_KEYS = ("pipeline", "share", "backend", "notify", "stages")
STAGE_ONLY_KEYS = ("needs", "select", "allow_failures")  # a stage's own keys; the rest is its experiment's
REFERENCE_KEYS = ("parameters", "inputs", "env", "frameworks")  # where references may stand
WHOLE_KEY = ""  # the "name" of a reference that stands for a whole key's value (frameworks: "${train.best.framework}")
BEST_FIELDS = ("outputs", "parameters", "metrics", "framework", "run_id")
MODES = ("max", "min")


@dataclass(frozen=True)
class Reference:
    """One ``${stage.what}`` of a stage file: the stage it reads and the path of what it reads there."""

    text: str  # as written, with its ${ }
    stage: str
    path: tuple[str, ...]  # ("outputs",), ("runs",), ("best", "parameters", "LR"), ...

    @property
    def of_best(self) -> bool:
        return self.path[0] == "best"


@dataclass(frozen=True)
class Select:
    """What ``best`` means for a stage: the metric, whether more (max) or less (min) is better, and bounds a run's
    other metrics must keep to count (``where``: ``{train_seconds: {max: 60}}``: the most accurate run under a
    minute, a rule that weighs one objective of a search against another)."""

    metric: str
    mode: str
    where: dict[str, dict[str, float]] = field(default_factory=dict)  # metric → {min: x, max: y} (one or both)

    def admits(self, metrics: Mapping[str, Any]) -> bool:
        """Whether a run's ``metrics`` keep to every bound of :attr:`where` (a metric missing, or no number, does not)."""
        for name, bounds in self.where.items():
            value = metrics.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return False
            if value < bounds.get("min", -math.inf) or value > bounds.get("max", math.inf):
                return False
        return True

    def describe(self) -> str:
        """The rule for people: ``max accuracy where train_seconds ≤ 60``."""
        bounds = [f"{low} ≤ {name}" if high is None else f"{name} ≤ {high}" if low is None else f"{low} ≤ {name} ≤ {high}"
                  for name, b in self.where.items() for low, high in [(b.get("min"), b.get("max"))]]
        return f"{self.mode} {self.metric}" + (f" where {' and '.join(bounds)}" if bounds else "")


@dataclass(frozen=True)
class Stage:
    """One stage: its experiment as the file gives it (references unresolved), what it needs, how its best is chosen."""

    name: str
    data: Mapping[str, Any]  # the experiment's keys (a file's), without the stage's own
    needs: tuple[str, ...]
    select: Select | None
    allow_failures: bool
    references: Mapping[tuple[str, str], tuple[Reference, ...]]  # (key, name) → the references in its value


@dataclass
class Pipeline:
    """A pipeline: its stages in the file's order, each an experiment named ``<pipeline>.<stage>`` on one share."""

    name: str
    share: str
    backend: Any
    stages: dict[str, Stage]
    notify: NotifySpec | None = None
    base_dir: Path = field(default_factory=Path.cwd)
    source: Path | None = None

    def experiment_name(self, stage: str) -> str:
        """The experiment a stage's runs belong to (a folder of the share)."""
        return f"{self.name}.{stage}"

    def order(self) -> list[str]:
        """The stages in dependency order (the file's order among stages that could go either way)."""
        done: list[str] = []
        while len(done) < len(self.stages):
            done.append(next(n for n, s in self.stages.items() if n not in done and set(s.needs) <= set(done)))
        return done

    def dependents(self, stage: str) -> list[str]:
        """The stages that need ``stage``, directly or through others (in order)."""
        found = {stage}
        for name in self.order():
            if set(self.stages[name].needs) & found:
                found.add(name)
        return [n for n in self.order() if n in found and n != stage]

    def experiment(self, stage: str, values: Mapping[tuple[str, str], Any] | None = None) -> Experiment:
        """A stage's experiment with its references replaced by ``values`` (by (key, name), as
        :func:`substitute` makes them); references without a value must not remain (:meth:`placeholder_values`)."""
        spec = self.stages[stage]
        data = {key: value for key, value in spec.data.items()}
        for (key, name), value in (values or {}).items():
            data[key] = value if name == WHOLE_KEY else {**data[key], name: value}
        data.update(experiment=self.experiment_name(stage), share=self.share,
                     backend=spec.data.get("backend", self.backend))
        try:
            return Experiment.from_dict(data, base_dir=self.base_dir)
        except NbbatchError as exc:
            raise SpecError(f"stage `{stage}`: {exc}") from exc


def substitute(value: Any, refs: tuple[Reference, ...], resolved: Mapping[str, Any]) -> Any:
    """``value`` with each reference replaced: a value that is one reference becomes what it resolved to (any type);
    references inside a longer text are written into it; a list's items each."""
    if isinstance(value, list):
        return [substitute(item, refs, resolved) for item in value]
    if isinstance(value, str) and len(refs) == 1 and value.strip() == refs[0].text:
        return resolved[refs[0].text]
    return REFERENCE.sub(lambda m: str(resolved.get(m.group(0), m.group(0))), value)


def load_pipeline(path: str | os.PathLike[str]) -> Pipeline:
    """Read and check a pipeline file: its shape, every stage's experiment, every reference and the graph."""
    path = Path(path)
    data = read_spec_file(path, "pipeline")
    return pipeline_from_dict(data, base_dir=path.resolve().parent, source=path.resolve())


def is_pipeline_file(path: str | os.PathLike[str]) -> bool:
    """Whether a YAML file is a pipeline (it has a top-level ``pipeline:``), not an experiment."""
    try:
        data = read_spec_file(Path(path), "pipeline")
    except SpecError:
        return False
    return isinstance(data, Mapping) and "pipeline" in data


def pipeline_from_dict(data: Any, base_dir: Path | None = None, source: Path | None = None) -> Pipeline:
    """Build and check a pipeline from its file's structure; every mistake is one :class:`SpecError`."""
    if not isinstance(data, Mapping):
        raise SpecError("a pipeline file is a mapping with `pipeline:` (its name) and `stages:`")
    for key in data:
        if key not in PIPELINE_KEYS:
            hint = did_you_mean(str(key), PIPELINE_KEYS)
            raise SpecError(f"pipeline key `{key}` is not known{hint}; a pipeline has {', '.join(PIPELINE_KEYS)}; "
                            "every experiment key goes in a stage")
    name = data.get("pipeline")
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,49}$", name):
        raise SpecError(f"pipeline name {name!r} must be 1-50 letters, digits, '-' or '_', starting with a letter "
                        "or digit (its stages' experiments are named <pipeline>.<stage>)")
    stages = data.get("stages")
    if not isinstance(stages, Mapping) or not stages:
        raise SpecError(f"pipeline `{name}` has no stages: give `stages:` a mapping of stage name → experiment keys")
    base = base_dir or Path.cwd()
    share = str(data.get("share", "results"))
    pipeline = Pipeline(
        name=name, share=share if "://" in share else str((base / share).resolve()),
        backend=data.get("backend", "local"), stages={}, base_dir=base, source=source,
        notify=parse_notify(data["notify"], "notify") if data.get("notify") is not None else None)
    for stage_name, stage_data in stages.items():
        pipeline.stages[str(stage_name)] = _stage(str(stage_name), stage_data)
    _check_graph(pipeline)
    for stage in pipeline.order():
        _check_references(pipeline, stage)
        pipeline.experiment(stage, placeholder_values(pipeline, stage))  # every experiment key, checked now
    return pipeline


def _stage(name: str, data: Any) -> Stage:
    if not STAGE_NAME.match(name):
        raise SpecError(f"stage name `{name}` must be 1-50 letters, digits, '-' or '_' (no '.'), starting with a "
                        "letter or digit")
    if not isinstance(data, Mapping):
        raise SpecError(f"stage `{name}` must be a mapping of experiment keys (notebooks:, frameworks:, "
                        "parameters:, sweep: …)")
    for key in ("experiment", "share", "notify"):
        if key in data:
            raise SpecError(f"stage `{name}`: `{key}:` belongs to the pipeline, not a stage (its experiment is "
                            f"named <pipeline>.{name}, on the pipeline's share)")
    needs = data.get("needs") or []
    if isinstance(needs, str):
        needs = [needs]
    if not isinstance(needs, list) or not all(isinstance(n, str) for n in needs):
        raise SpecError(f"stage `{name}`: `needs:` is a list of stage names")
    references: dict[tuple[str, str], tuple[Reference, ...]] = {}
    for key, value in data.items():
        if key in STAGE_ONLY_KEYS:
            continue
        found = _references_in(value)
        if found and key not in REFERENCE_KEYS:
            raise SpecError(f"stage `{name}`: `{key}:` holds {found[0]}; references go in "
                            f"{', '.join(REFERENCE_KEYS)} only")
        if found and key == "frameworks":  # the framework of a best run, e.g. to train it again on all the data
            refs = tuple(_parse_reference(name, text) for text in found)
            if any(ref.path != ("best", "framework") for ref in refs) or not (
                    isinstance(value, str) or (isinstance(value, list) and len(value) == 1)):
                raise SpecError(f"stage `{name}`: `frameworks:` takes one reference, ${{STAGE.best.framework}} "
                                f"(the framework of a stage's best run), as `frameworks: \"${{train.best.framework}}\"`")
            references[(key, WHOLE_KEY)] = refs
        elif found:
            for item, inner in value.items():
                if refs := _references_in(inner):
                    references[(key, str(item))] = tuple(_parse_reference(name, text) for text in refs)
    implied = [r.stage for refs in references.values() for r in refs]
    allow = data.get("allow_failures", False)
    if not isinstance(allow, bool):
        raise SpecError(f"stage `{name}`: `allow_failures:` is true or false")
    return Stage(name=name, data={k: v for k, v in data.items() if k not in STAGE_ONLY_KEYS},
                 needs=tuple(dict.fromkeys([*needs, *implied])), select=_select(name, data), allow_failures=allow,
                 references=references)


def _references_in(value: Any) -> list[str]:
    """Every ``${…}`` in a value, nested values included (``${env:…}`` is the notifications', not a stage's)."""
    if isinstance(value, str):
        return [m.group(0) for m in REFERENCE.finditer(value)]
    if isinstance(value, Mapping):
        return [ref for inner in value.values() for ref in _references_in(inner)]
    if isinstance(value, list):
        return [ref for inner in value for ref in _references_in(inner)]
    return []


def _parse_reference(stage: str, text: str) -> Reference:
    body = text[2:-1].strip()
    if body.startswith("env:"):
        raise SpecError(f"stage `{stage}`: {text}: `${{env:NAME}}` is for secrets in `notify:`; a stage's "
                        "environment variable goes in its `env:` as a value")
    parts = tuple(body.split("."))
    wrong = f"stage `{stage}`: reference {text} is not one nbbatch knows;"
    forms = ("${STAGE.outputs}, ${STAGE.runs}, ${STAGE.best.outputs}, ${STAGE.best.parameters.NAME}, "
             "${STAGE.best.metrics.NAME}, ${STAGE.best.framework}, ${STAGE.best.run_id}")
    if len(parts) < 2 or not all(parts):
        raise SpecError(f"{wrong} write one of {forms}")
    what = parts[1:]
    if what in (("outputs",), ("runs",)):
        return Reference(text, parts[0], what)
    if what[0] != "best":
        raise SpecError(f"{wrong} `{what[0]}`{did_you_mean(what[0], ('outputs', 'runs', 'best'))} is not one of "
                        f"outputs, runs, best ({forms})")
    if len(what) < 2 or what[1] not in BEST_FIELDS:
        given = what[1] if len(what) > 1 else ""
        raise SpecError(f"{wrong} after `best.` comes one of {', '.join(BEST_FIELDS)}{did_you_mean(given, BEST_FIELDS)}")
    if what[1] in ("parameters", "metrics") and len(what) != 3:
        raise SpecError(f"{wrong} name one {what[1][:-1]}: ${{{parts[0]}.best.{what[1]}.NAME}}")
    if what[1] not in ("parameters", "metrics") and len(what) != 2:
        raise SpecError(f"{wrong} ${{{parts[0]}.best.{what[1]}}} ends there")
    return Reference(text, parts[0], what)


def _select(stage: str, data: Mapping[str, Any]) -> Select | None:
    select = data.get("select")
    if select is None:
        search = data.get("search")
        if isinstance(search, Mapping) and isinstance(search.get("metric"), str):  # a search has its own metric
            return Select(search["metric"], str(search.get("mode", "max")))
        return None
    if not isinstance(select, Mapping) or set(select) - {"metric", "mode", "where"} or not isinstance(
            select.get("metric"), str):
        raise SpecError(f"stage `{stage}`: `select:` is {{metric: NAME, mode: max|min}} (what `best` means), with "
                        "`where: {OTHER_METRIC: {max: N}}` to count only the runs within bounds")
    if select.get("mode") not in MODES:
        raise SpecError(f"stage `{stage}`: `select:` needs `mode: max` or `mode: min` for metric "
                        f"`{select['metric']}` (is more better, or less?)")
    return Select(select["metric"], select["mode"], _where(stage, select.get("where") or {}))


def _where(stage: str, where: Any) -> dict[str, dict[str, float]]:
    """``select.where``: each metric's bounds, ``{min: x}``, ``{max: y}`` or both, finite numbers with min ≤ max."""
    example = "e.g. where: {train_seconds: {max: 60}}"
    if not isinstance(where, Mapping):
        raise SpecError(f"stage `{stage}`: select.where maps metrics to bounds ({example}); got {where!r}")
    checked: dict[str, dict[str, float]] = {}
    for name, bounds in where.items():
        if not isinstance(bounds, Mapping) or not bounds or set(bounds) - {"min", "max"} or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in bounds.values()):
            raise SpecError(f"stage `{stage}`: select.where.{name} is {{min: NUMBER}}, {{max: NUMBER}} or both "
                            f"({example}); got {bounds!r}")
        if bounds.get("min", -math.inf) > bounds.get("max", math.inf):
            raise SpecError(f"stage `{stage}`: select.where.{name} has min {bounds['min']} above max {bounds['max']}: "
                            "no run could count")
        checked[str(name)] = {k: float(v) for k, v in bounds.items()}
    return checked


def _objectives(stage: Stage) -> int:
    """How many objectives the stage's search has (0 for a stage that searches nothing)."""
    search = stage.data.get("search")
    metric = search.get("metric") if isinstance(search, Mapping) else None
    return len(metric) if isinstance(metric, list) else int(metric is not None)


def _check_graph(pipeline: Pipeline) -> None:
    names = list(pipeline.stages)
    for stage in pipeline.stages.values():
        for need in stage.needs:
            if need not in pipeline.stages:
                raise SpecError(f"stage `{stage.name}` needs stage `{need}`, which the pipeline does not have"
                                f"{did_you_mean(need, names)}; its stages: {', '.join(names)}")
            if need == stage.name:
                raise SpecError(f"stage `{stage.name}` needs itself (a reference to its own results?)")
    cycle = _cycle(pipeline)
    if cycle:
        raise SpecError(f"stages {' → '.join(cycle)} form a cycle: each waits for the next; drop one of these "
                        "`needs:` or references")


def _cycle(pipeline: Pipeline) -> list[str] | None:
    """A cycle of the ``needs`` graph (its stages, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "visiting"
        path.append(name)
        for need in pipeline.stages[name].needs:
            if state.get(need) == "visiting":
                return [*path[path.index(need):], need]
            if need not in state and (found := visit(need)):
                return found
        state[name] = "done"
        path.pop()
        return None

    for name in pipeline.stages:
        if name not in state and (found := visit(name)):
            return found
    return None


def _check_references(pipeline: Pipeline, stage: str) -> None:
    for (key, item), refs in pipeline.stages[stage].references.items():
        for ref in refs:
            upstream = pipeline.stages[ref.stage]
            where = f"stage `{stage}`, {key}.{item}: {ref.text}"
            if ref.of_best and upstream.select is None and _objectives(upstream) > 1:
                raise SpecError(f"{where}: stage `{ref.stage}` searches {_objectives(upstream)} objectives, so its "
                                "best run depends on which one decides: add `select: {metric: NAME, mode: max|min}` "
                                f"to stage `{ref.stage}` (one of its search.metric)")
            if ref.of_best and upstream.select is None:
                raise SpecError(f"{where}: stage `{ref.stage}` has no `select:` (nor a search's metric), so it has "
                                f"no best run; add `select: {{metric: NAME, mode: max}}` to stage `{ref.stage}`")
            if ref.path == ("outputs",) and (count := _run_count(pipeline, ref.stage)) != 1:
                raise SpecError(f"{where}: stage `{ref.stage}` has {count} runs, so it has no single outputs "
                                f"folder; use ${{{ref.stage}.best.outputs}} (with `select:`) or ${{{ref.stage}.runs}}")
            if ref.path == ("runs",) and key == "inputs":
                raise SpecError(f"{where}: every run of a stage is a list, not one folder; pass it as a parameter "
                                f"(parameters: {{{item}: \"{ref.text}\"}})")
            if ref.path[:2] == ("best", "parameters") and ref.path[2] not in (names := _set_parameters(pipeline, ref.stage)):
                raise SpecError(f"{where}: stage `{ref.stage}` sets no parameter `{ref.path[2]}`"
                                f"{did_you_mean(ref.path[2], names)}; it sets {', '.join(sorted(names)) or 'none'}")
            if key == "inputs" and not ref.path[-1] == "outputs":
                raise SpecError(f"{where}: an input is a folder: use ${{{ref.stage}.outputs}} or "
                                f"${{{ref.stage}.best.outputs}}, or set a parameter instead")


def _set_parameters(pipeline: Pipeline, stage: str) -> set[str]:
    """The parameters a stage's runs record: its fixed, swept and searched ones."""
    spec = pipeline.experiment(stage, placeholder_values(pipeline, stage))
    return set(spec.combinations()[0]) | ({p.name for p in spec.search.params} if spec.search else set())


def _run_count(pipeline: Pipeline, stage: str) -> int | str:
    """How many runs a stage plans (``a search`` for a search: its trials are drawn as it goes)."""
    spec = pipeline.experiment(stage, placeholder_values(pipeline, stage))
    if spec.search is not None:
        return "a search's"
    return (len(spec.frameworks) + len(spec.notebooks)) * len(spec.combinations())


def placeholder_values(pipeline: Pipeline, stage: str) -> dict[tuple[str, str], Any]:
    """Stand-ins for a stage's references, of the type each will resolve to, for checking the stage before its
    upstream stages have run: an upstream parameter's first value, a folder that exists, a number for a metric."""
    values: dict[tuple[str, str], Any] = {}
    for (key, item), refs in pipeline.stages[stage].references.items():
        stand_ins = {ref.text: _stand_in(pipeline, ref, key) for ref in refs}
        values[(key, item)] = substitute(referring_value(pipeline.stages[stage], key, item), refs, stand_ins)
    return values


def referring_value(stage: Stage, key: str, item: str) -> Any:
    """The value as the file writes it, references and all, of ``key`` (``key.item`` for a mapping's)."""
    return stage.data[key] if item == WHOLE_KEY else stage.data[key][item]


def _stand_in(pipeline: Pipeline, ref: Reference, key: str) -> Any:
    if ref.path == ("best", "framework"):
        upstream = pipeline.experiment(ref.stage, placeholder_values(pipeline, ref.stage))
        return upstream.frameworks[0] if upstream.frameworks else "x"
    if ref.path[-1] == "outputs":
        return str(pipeline.base_dir) if key == "inputs" else "outputs"
    if ref.path == ("runs",):
        return []
    if ref.path[:2] == ("best", "parameters"):
        upstream = pipeline.experiment(ref.stage, placeholder_values(pipeline, ref.stage))
        combos = upstream.combinations()
        if ref.path[2] in combos[0]:
            return combos[0][ref.path[2]]
        searched = {p.name: p for p in upstream.search.params} if upstream.search else {}
        if ref.path[2] in searched:
            return searched[ref.path[2]].examples()[0]
    if ref.path[:2] == ("best", "metrics"):
        return 0.5
    return "x"
