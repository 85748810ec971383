"""GPU slots: unit-tested on a given GPU list, then for real with kernels that print their devices."""

from __future__ import annotations

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.backends import get_backend
from nbbatch.backends.local.gpus import GpuInfo, SlotPool, detect_gpus
from nbbatch.errors import ValidationError


def _ids(lease):
    return None if lease is None else lease.gpu_ids


def test_one_run_per_gpu():
    pool = SlotPool([0, 1], runs_per_gpu=1)
    first = pool.acquire(1)
    assert first.gpu_ids == [0] and _ids(pool.acquire(1)) == [1] and pool.acquire(1) is None
    assert not pool.shared(first)
    pool.release(first)
    assert _ids(pool.acquire(1)) == [0]


def test_runs_per_gpu_shares_least_loaded_first():
    pool = SlotPool([0, 1], runs_per_gpu=2)
    got = [pool.acquire(1) for _ in range(4)]
    assert sorted(g.gpu_ids[0] for g in got) == [0, 0, 1, 1] and got[0].gpu_ids != got[1].gpu_ids
    assert pool.acquire(1) is None and pool.shared(got[0])


def test_multi_gpu_runs_take_distinct_gpus():
    pool = SlotPool([0, 1, 2, 3])
    assert _ids(pool.acquire(2)) == [0, 1] and pool.acquire(3) is None and _ids(pool.acquire(2)) == [2, 3]


def test_cpu_runs_need_no_slot():
    assert SlotPool([]).acquire(0).gpu_ids == []


def test_no_gpu_machine_detects_none_without_error(monkeypatch):
    monkeypatch.setenv("NBBATCH_GPUS", "none")
    assert detect_gpus() == []


FAKE = [GpuInfo(0, "Fake A", 1000), GpuInfo(1, "Fake B", 1000)]
PRINT_DEVICES = ("import os; print('DEVICES=' + os.environ['CUDA_VISIBLE_DEVICES']"
                 " + ';ALLOC=' + os.environ.get('TOY_ALLOC', 'unset'))")


def _devices(project, result):
    seen = {}
    for record in result.records:
        log = (project / "results" / record.experiment / record.run_id / "log.txt").read_text()
        line = next(x for x in log.splitlines() if x.startswith("DEVICES="))
        seen[record.run_id] = (line.split(";")[0].removeprefix("DEVICES="), line.split(";")[1], record.gpu_ids)
    return seen


@pytest.fixture
def fake_gpus(monkeypatch):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: list(FAKE))


@pytest.mark.kernel
def test_two_runs_get_different_gpus(project, write_experiment, fake_gpus):
    make_notebook(project / "nb.ipynb", [PRINT_DEVICES, "import time; time.sleep(1.5)"])
    exp = write_experiment("experiment: pin\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2]}}\nresources: {gpus: 1}\n")
    seen = _devices(project, submit(exp, progress=False))
    assert sorted(d for d, _, _ in seen.values()) == ["0", "1"]
    assert all(d == ",".join(map(str, ids)) for d, _, ids in seen.values())


@pytest.mark.kernel
def test_four_runs_share_two_gpus_and_the_memory_settings(project, write_experiment, fake_gpus):
    make_notebook(project / "nb.ipynb", [PRINT_DEVICES, "import time; time.sleep(2)"])
    exp = write_experiment("experiment: share\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                           "resources: {gpus: 1, runs_per_gpu: 2}\n")
    seen = _devices(project, submit(exp, progress=False))
    assert sorted(d for d, _, _ in seen.values()) == ["0", "0", "1", "1"]


@pytest.mark.kernel
def test_cpu_runs_see_no_gpu(project, write_experiment, fake_gpus):
    make_notebook(project / "nb.ipynb", [PRINT_DEVICES])
    seen = _devices(project, submit(write_experiment("experiment: cpu\nnotebooks: [nb.ipynb]\n"), progress=False))
    assert [d for d, _, _ in seen.values()] == [""]


def test_gpu_runs_refused_without_gpus(project, write_experiment, monkeypatch):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [])
    make_notebook(project / "nb.ipynb", ["pass"])
    with pytest.raises(ValidationError, match="no NVIDIA GPU"):
        submit(write_experiment("experiment: nogpu\nnotebooks: [nb.ipynb]\nresources: {gpus: 1}\n"), progress=False)
    assert not (project / "results" / "nogpu").exists()


def test_local_compute_reports_cpus_and_gpus():
    compute = get_backend("local", gpus=list(FAKE)).compute()
    assert compute.backend == "local" and len(compute.gpus) == 2 and compute.nodes[0]["cpus"] >= 1


@pytest.mark.kernel
@pytest.mark.gpu
def test_real_gpus_are_pinned(project, write_experiment):
    gpus = detect_gpus()
    make_notebook(project / "nb.ipynb", [PRINT_DEVICES, "import time; time.sleep(2)"])
    n = min(len(gpus), 2) * 2
    exp = write_experiment(f"experiment: realgpu\nnotebooks: [nb.ipynb]\nsweep: {{grid: {{A: {list(range(n))}}}}}\n"
                           "resources: {gpus: 1, runs_per_gpu: 2}\n")
    seen = _devices(project, submit(exp, progress=False))
    assert len({d for d, _, _ in seen.values()}) == min(len(gpus), 2)
