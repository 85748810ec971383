"""The submission driver: a planned batch of runs, started once and waited for as asked.

It skips the runs that already succeeded (unless forced) and leaves those still in flight alone
(:meth:`~nbbatch.backends.base.Backend.triage`), writes the manifest, launches the rest through the backend
(:meth:`~nbbatch.backends.base.Backend.launch`, with a live table in a terminal) and, when it waits, also waits for
the runs it found in flight.
"""

from __future__ import annotations

from collections.abc import Collection

from nbbatch.backends.base import Backend
from nbbatch.drivers.base import Driver, Progress
from nbbatch.errors import NbbatchError
from nbbatch.plan.runs import Plan
from nbbatch.results.progress import live_progress
from nbbatch.store.lease import Halt
from nbbatch.store.share import Share


class SubmissionDriver(Driver):
    """Runs the experiment's planned runs (those ``only`` names: run ids or their prefixes) on its backend."""

    def __init__(self, plan: Plan, backend: Backend, share: Share, *, source: object = None, force: bool = False,
                 wait: bool | None = None, progress: Progress = True, only: list[str] | None = None) -> None:
        super().__init__(plan, backend, share, source=source, force=force, wait=wait, progress=progress)
        self.runs = plan.runs
        if only:
            self.runs = [r for r in plan.runs if any(r.run_id.startswith(o) for o in only)]
            if not self.runs:
                raise NbbatchError(f"--only {', '.join(only)} matches none of the {len(plan.runs)} planned runs")

    def run(self, halt: Halt) -> Collection[str]:
        """Triage, manifest, launch, and wait for runs found in flight; every selected run is reported."""
        backend, share, result = self.backend, self.share, self.result
        outcome = backend.triage(self.runs, share, force=self.force)
        result.skipped = outcome.skipped
        result.warnings.extend(outcome.notes)
        result.started = [*outcome.started, *outcome.in_flight]
        self.write_manifest([r.run_id for r in self.plan.runs])
        options = self.submit_options(wait=self.wait, force=self.force, on_update=self.on_update(), halt=halt)
        limit = backend.parallel_limit(options)
        if limit is not None and not backend.capabilities.parallel_limit:
            result.warnings.append(f"max_parallel {limit} is not applied on backend `{backend.name}`: it starts every "
                                   "run at once and its compute runs as many as it has room for; to run fewer at "
                                   "once, make the compute smaller")
        starting = set(outcome.started)
        todo = [r for r in self.runs if r.run_id in starting]
        if todo and self.progress is True:
            with live_progress(share, self.experiment, [r.run_id for r in self.runs]) as on_update:
                options.on_update = on_update
                backend.launch(todo, share, options)
        elif todo:
            backend.launch(todo, share, options)
        if outcome.in_flight and self.wait and backend.capabilities.detached:
            backend.wait(self.experiment, share, outcome.in_flight, options.on_update)
        return [r.run_id for r in self.runs]
