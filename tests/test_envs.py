"""Framework environments for real: a venv, a project-local kernel with the framework's variables,
ready/stale/missing by pins fingerprint, and submit refusing (or building) what is not ready."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.backends.local import backend as local
from nbbatch.backends.local.gpus import GpuInfo
from nbbatch.errors import EnvironmentNotReady
from nbbatch.execute.envs import build_env, env_status, remove_env
from nbbatch.spec.frameworks import get_framework

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_env_lifecycle_kernel_and_framework_variables(project, monkeypatch):
    make_notebook(project / "notebooks" / "Toy.ipynb", [
        "import os, sys\nprint('VAR=' + os.environ.get('TOY_VAR', '') + ';ALLOC=' + os.environ.get('TOY_ALLOC', 'unset')"
        " + ';CUDA=' + os.environ['CUDA_VISIBLE_DEVICES'] + ';PY=' + sys.prefix)",
        "import nbbatch; nbbatch.record(ok=True)",
    ], kernel="nbbatch-toy")
    fw = project / "frameworks" / "toy"
    fw.mkdir()
    (fw / "framework.yaml").write_text(
        "title: Toy\nnotebook: notebooks/Toy.ipynb\ngpu: true\nkernel_env: {TOY_VAR: hello}\n"
        "shared_gpu_env: {TOY_ALLOC: grow}\n")
    (fw / "requirements.txt").write_text("# nothing but the kernel\n")
    framework = get_framework("toy")
    assert env_status(framework).state == "missing"

    status = build_env(framework)
    assert status.state == "ready" and status.path == project / ".nbbatch" / "envs" / "toy"
    spec = json.loads((project / ".nbbatch/jupyter/kernels/nbbatch-toy/kernel.json").read_text())
    assert spec["env"] == {"TOY_VAR": "hello"} and spec["argv"][0].startswith(str(project))

    monkeypatch.setattr(local, "detect_gpus", lambda: [GpuInfo(0, "Fake", 1)])
    (project / "exp.yaml").write_text("experiment: toy\nframeworks: [toy]\n"
                                      "resources: {gpus: 1, runs_per_gpu: 2}\n")
    result = submit(project / "exp.yaml", progress=False)
    (record,) = result.records
    assert record.status == "succeeded" and record.framework == "toy" and record.run_id.startswith("toy-")
    log = (project / "results/toy" / record.run_id / "log.txt").read_text()
    assert f"VAR=hello;ALLOC=grow;CUDA=0;PY={project / '.nbbatch/envs/toy'}" in log
    assert "ipykernel" in record.environment

    (fw / "requirements.txt").write_text("six\n")
    assert env_status(framework).state == "stale"
    with pytest.raises(EnvironmentNotReady, match="nbbatch envs create toy"):
        submit(project / "exp.yaml", progress=False, force=True)
    (project / "exp.yaml").write_text("experiment: toy\nframeworks: [toy]\n")  # a subprocess sees no fake GPU
    done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", "exp.yaml", "--build-envs", "-q"],
                          cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert env_status(get_framework("toy")).state == "ready"
    new_id = json.loads((project / "results/toy/experiment.json").read_text())["runs"][0]
    assert new_id != record.run_id  # the pins are part of the run id

    remove_env(get_framework("toy"))
    assert env_status(get_framework("toy")).state == "missing"


def test_failed_build_names_its_log(project):
    fw = project / "frameworks" / "broken"
    fw.mkdir()
    (fw / "framework.yaml").write_text("notebook: x.ipynb\n")
    (fw / "requirements.txt").write_text("this-package-does-not-exist-nbbatch==0.0.1\n")
    done = subprocess.run([sys.executable, "-m", "nbbatch", "envs", "create", "broken"], cwd=project,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "broken.log" in done.stderr and "Traceback" not in done.stderr
    # tried twice (a network hiccup gets a second chance), and pip's own reason is in the message
    assert "2 tries" in done.stderr and "this-package-does-not-exist-nbbatch" in done.stderr.split("broken.log", 1)[1]
    assert "trying again (2 of 2)" in (project / ".nbbatch/envs/broken.log").read_text()
