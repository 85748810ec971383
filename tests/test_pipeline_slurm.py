"""A pipeline whose stages run on different backends, on the real two-node Slurm cluster (tests/support/slurm.py):
prep on the local backend, a small sweep of train on Slurm, final on Slurm from train's best run. Tiny notebooks in
the test venv's ``python3`` kernel; both nodes are this host, so the share (a folder of the test's temp dir) is seen
by every node. Submitting again starts no Slurm job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.notebooks import make_notebook
from support.waiting import wait_until

from nbbatch import api
from nbbatch.backends.slurm import SlurmJob
from nbbatch.store.share import FileShare

pytestmark = [pytest.mark.slurm, pytest.mark.kernel, pytest.mark.timeout(600)]

PREP = ["import json, os\n"
        "json.dump({'n': N}, open(os.path.join(os.environ['NBBATCH_OUTPUT_DIR'], 'data.json'), 'w'))"]
TRAIN = ["import json, os, nbbatch\n"
         "n = json.load(open(os.path.join(DATA_DIR, 'data.json')))['n']\n"
         "open(os.path.join(os.environ['NBBATCH_OUTPUT_DIR'], 'model.txt'), 'w').write(str(LR))\n"
         "nbbatch.record(accuracy=1 - abs(LR - 0.01) + n / 1e6, node=os.environ.get('SLURMD_NODENAME', ''))"]
FINAL = ["import os, nbbatch\n"
         "assert open(os.path.join(MODEL_DIR, 'model.txt')).read() == str(LR)\n"
         "assert os.environ.get('SLURM_JOB_ID'), 'not in a Slurm job'\n"
         "nbbatch.record(final=LR)"]
SLURM = {"name": "slurm", "cpus": 1, "memory": "256M", "cancel_grace_s": 5}


def _pipeline(share: Path) -> dict:
    return {
        "pipeline": "mixed", "share": str(share), "backend": SLURM,
        "stages": {
            "prep": {"backend": "local", "notebooks": [{"path": "prep.ipynb", "kernel": "python3"}],
                     "parameters": {"N": 10}},
            "train": {"notebooks": [{"path": "train.ipynb", "kernel": "python3"}],
                      "inputs": {"DATA_DIR": "${prep.outputs}"}, "sweep": {"grid": {"LR": [0.001, 0.01, 0.1]}},
                      "select": {"metric": "accuracy", "mode": "max"}},
            "final": {"notebooks": [{"path": "final.ipynb", "kernel": "python3"}],
                      "parameters": {"LR": "${train.best.parameters.LR}"},
                      "inputs": {"MODEL_DIR": "${train.best.outputs}"}},
        },
    }


def _records(share: Path, experiment: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((share / experiment).glob("*/run.json"))]


def _jobs(share: Path, experiment: str) -> dict[str, str | None]:
    """Each run's Slurm job (None: it ran elsewhere), as the slurm backend noted it on the share."""
    return {r["run_id"]: job.job_id if (job := SlurmJob.read(FileShare(share), experiment, r["run_id"])) else None
            for r in _records(share, experiment)}


def test_a_pipeline_across_local_and_slurm_resolves_the_best_run_and_resubmits_nothing(slurm_cluster, project):
    make_notebook(project / "prep.ipynb", PREP, parameters="N = 1")
    make_notebook(project / "train.ipynb", TRAIN, parameters="DATA_DIR = ''\nLR = 0.1")
    make_notebook(project / "final.ipynb", FINAL, parameters="LR = 0.0\nMODEL_DIR = ''")
    share = project / "share"
    path = project / "mixed.yaml"
    path.write_text(yaml.safe_dump(_pipeline(share), sort_keys=False))

    result = api.submit_pipeline(path, progress=False)
    assert result.ok, {n: (s.state, s.reason) for n, s in result.stages.items()}
    assert {n: (s.state, s.backend) for n, s in result.stages.items()} == {
        "prep": ("succeeded", "local"), "train": ("succeeded", "slurm"), "final": ("succeeded", "slurm")}
    train = result.stages["train"]
    assert train.counts == {"succeeded": 3} and train.best["parameters"] == {"LR": 0.01}

    [prep] = _records(share, "mixed.prep")
    assert prep["backend"] == "local" and list(_jobs(share, "mixed.prep").values()) == [None]
    trained = _records(share, "mixed.train")
    assert {r["backend"] for r in trained} == {"slurm"} and all(_jobs(share, "mixed.train").values())
    assert {r["metrics"]["node"] for r in trained} <= {"node1", "node2"}
    [final] = _records(share, "mixed.final")
    assert final["status"] == "succeeded" and final["backend"] == "slurm" and final["metrics"]["final"] == 0.01
    origin = final["origins"]["parameters.LR"]
    assert origin["stage"] == "train" and origin["run"] == train.best["run_id"] and origin["value"] == 0.01
    assert final["origins"]["inputs.MODEL_DIR"]["run"] == train.best["run_id"]

    # submitted again: every stage is unchanged; no run reruns and no job is submitted (none queued, none ended)
    def runs() -> dict[str, list[tuple[str, str, str | None]]]:
        return {e: [(r["run_id"], r["ended_at"], _jobs(share, e)[r["run_id"]]) for r in _records(share, e)]
                for e in ("mixed.prep", "mixed.train", "mixed.final")}

    def queued() -> str:
        return slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.strip()

    wait_until(lambda: not queued(), timeout=60, message="the first submission's jobs out of the queue")
    before, ended_jobs = runs(), slurm_cluster.jobcomp.read_text()
    again = api.submit_pipeline(path, progress=False)
    assert again.ok and {s.state for s in again.stages.values()} == {"succeeded"}
    assert runs() == before
    assert queued() == ""
    assert slurm_cluster.jobcomp.read_text() == ended_jobs
