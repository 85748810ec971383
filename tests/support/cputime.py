"""CPU time per test, listed after pytest's durations: CI's two cores are busy from the first test to the last
(docs/benchmarks.md), so what makes the suite long is the CPU each test takes, not its wall-clock time.

A test's CPU time is that of the process running it (a pytest-xdist worker: the test and its threads) plus that of
the child processes it reaped (kernels, the CLI, pip). What runs outside that tree (containers under conmon, the
Slurm and Ray daemons) and children reaped by a later test are not counted.
"""

from __future__ import annotations

import resource

import pytest

CPU_PROPERTY = "cpu_seconds"  # in each test's teardown report (pytest-xdist sends it to the controller)
SHOWN = 30
_STARTED = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


class CpuTimes:
    """Measures each test (setup to teardown) where it runs, and lists the SHOWN costliest where the run ends."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        item.stash[_STARTED] = _cpu_seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if call.when == "teardown" and _STARTED in item.stash:
            report.user_properties.append((CPU_PROPERTY, round(_cpu_seconds() - item.stash[_STARTED], 2)))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == CPU_PROPERTY and report.when == "teardown":
                self.seconds[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        total, shown = sum(self.seconds.values()), min(SHOWN, len(self.seconds))
        terminalreporter.write_sep("=", f"most CPU: {shown} of {len(self.seconds)} tests ({total:.0f} CPU-s in all, "
                                        "each test's process and the children it reaped)")
        for nodeid, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:8.2f}s  {nodeid}")
