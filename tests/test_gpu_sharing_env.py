"""GPU sharing for any notebook: every run that shares a GPU gets the sharing variables whatever it imports, and a
notebook given by path is recognised as a framework (its kernel, else its imports) whose settings then apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.backends.local.gpus import GpuInfo
from nbbatch.errors import ValidationError
from nbbatch.plan.notebook import inspect_notebook
from nbbatch.plan.runs import plan
from nbbatch.spec.experiment import load_experiment
from nbbatch.spec.frameworks import BUNDLED_FRAMEWORKS_DIR, bundled_frameworks, list_frameworks
from nbbatch.spec.gpu_sharing import recognise, sharing_defaults

REPO = Path(__file__).resolve().parents[1]
SHARING = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _framework(project, name, imports, *, kernel_env="", extra=""):
    folder = project / "frameworks" / name
    folder.mkdir(parents=True)
    make_notebook(project / "notebooks" / f"{name}.ipynb", ["pass"], kernel=f"nbbatch-{name}")
    (folder / "framework.yaml").write_text(f"notebook: notebooks/{name}.ipynb\ngpu: true\nimports: {imports}\n"
                                           f"preload: {imports}\n{kernel_env}{extra}")
    (folder / "requirements.txt").write_text("")


@pytest.fixture
def frameworks(project):
    _framework(project, "torchy", "[torch]", extra="gpu_memory_mb: 1500\n"
               "shared_gpu_env: {PYTORCH_CUDA_ALLOC_CONF: 'expandable_segments:True,max_split_size_mb:64'}\n")
    _framework(project, "lightly", "[torch, pytorch_lightning]", extra="gpu_memory_mb: 2000\n")
    _framework(project, "jaxy", "[jax, flax]", extra="gpu_memory_mb: 3250\n"
               "shared_gpu_env: {XLA_PYTHON_CLIENT_MEM_FRACTION: '0.2'}\n")
    _framework(project, "mx", "[mxnet]")
    _framework(project, "gluony", "[mxnet, mxnet.gluon]")
    return list_frameworks()


def test_a_notebooks_imports_are_read_from_every_code_cell(project):
    make_notebook(project / "nb.ipynb", [
        "%matplotlib inline\n!pip list\nimport os, numpy as np",
        "from mxnet import gluon\nfrom jax.numpy import *\n",
        "def f():\n    import pytorch_lightning.callbacks as cb\n    return cb",
        "this is not python",  # skipped, not an error
        "from . import sibling",  # relative: not a module name
    ])
    imports = inspect_notebook(project / "nb.ipynb").imports
    assert {"os", "numpy", "mxnet", "mxnet.gluon", "jax", "jax.numpy", "pytorch_lightning",
            "pytorch_lightning.callbacks"} <= imports
    assert "sibling" not in imports and "." not in imports


def test_recognised_by_kernel_else_by_the_most_specific_imports(frameworks):
    assert recognise("nbbatch-jaxy", set(), frameworks).name == "jaxy"  # the kernel says it, whatever it imports
    assert recognise("python3", {"torch", "numpy"}, frameworks).name == "torchy"
    assert recognise("python3", {"torch", "pytorch_lightning"}, frameworks).name == "lightly"
    assert recognise("python3", {"mxnet"}, frameworks).name == "mx"
    assert recognise("python3", {"mxnet", "mxnet.gluon"}, frameworks).name == "gluony"
    assert recognise("python3", {"jax"}, frameworks) is None  # jaxy needs flax too
    assert recognise("python3", {"numpy"}, frameworks) is None


def test_a_tie_recognises_none(frameworks, project):
    _framework(project, "torchy2", "[torch]")
    assert recognise("python3", {"torch"}, list_frameworks()) is None


def test_bad_imports_key_is_refused(project):
    _framework(project, "bad", "torch")  # a string, not a list
    with pytest.raises(ValidationError, match=r"`imports` must be a list of Python module names"):
        list_frameworks()


def _runs(project, notebook_cells, resources="resources: {gpus: 1, runs_per_gpu: auto}\n", env=""):
    make_notebook(project / "mine.ipynb", notebook_cells, kernel="python3")
    (project / "exp.yaml").write_text(f"experiment: mine\nnotebooks: [{{path: mine.ipynb, kernel: python3}}]\n{resources}{env}")
    return plan(load_experiment(project / "exp.yaml"), check_kernels=False).runs


def test_a_notebook_given_by_path_gets_its_recognised_frameworks_settings(frameworks, project):
    (run,) = _runs(project, ["import jax\nfrom flax import linen as nn"])
    assert run.recognised_as == "jaxy" and run.framework is None  # results still group it by its own name
    assert run.gpu_memory_mb == 3250 and tuple(run.preload) == ("jax", "flax")
    assert run.shared_gpu_env == {**SHARING, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"}

    (run,) = _runs(project, ["import torch"])
    assert run.recognised_as == "torchy" and run.gpu_memory_mb == 1500
    assert run.shared_gpu_env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"  # its own wins


def test_a_notebook_in_any_folder_is_recognised_against_the_bundled_frameworks(project):
    """No frameworks/ of its own (the fixture's is empty): the frameworks nbbatch ships recognise it."""
    shipped = yaml.safe_load((BUNDLED_FRAMEWORKS_DIR / "pytorch" / "framework.yaml").read_text())
    (run,) = _runs(project, ["import torch"])
    assert run.recognised_as == "pytorch" and run.framework is None
    assert run.gpu_memory_mb == shipped["gpu_memory_mb"] and tuple(run.preload) == tuple(shipped["preload"])
    (run,) = _runs(project, ["import torch\nimport pytorch_lightning as pl"])
    assert run.recognised_as == "lightning"
    (run,) = _runs(project, ["import jax\nimport flax.linen as nn"])
    assert run.recognised_as == "jax-flax" and run.shared_gpu_env["XLA_PYTHON_CLIENT_MEM_FRACTION"]


def test_a_projects_own_frameworks_win_over_the_bundled_ones(frameworks, project):
    _framework(project, "pytorch", "[torch]", extra="gpu_memory_mb: 111\n")  # same name as a bundled one
    assert "pytorch" not in bundled_frameworks(list_frameworks()) and "lightning" in bundled_frameworks(list_frameworks())
    (run,) = _runs(project, ["import torch\nimport pytorch_lightning"])
    assert run.recognised_as == "lightly"  # the project's fit, before the bundled Lightning
    (project / "frameworks" / "lightly" / "framework.yaml").unlink()
    (run,) = _runs(project, ["import torch\nimport pytorch_lightning"])
    assert run.recognised_as == "lightning"  # now only a bundled one fits


def test_the_bundled_frameworks_ship_with_the_package():
    """The package's frameworks/ is the project's own (a link in a checkout) and is package data of the wheel."""
    assert sorted(p.name for p in BUNDLED_FRAMEWORKS_DIR.iterdir()) == sorted(
        p.name for p in (REPO / "frameworks").iterdir() if (p / "framework.yaml").exists())
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nbbatch"]
    assert {"frameworks/*/framework.yaml", "frameworks/*/requirements.txt"} <= set(package_data)


def test_an_unrecognised_notebook_still_gets_every_sharing_variable(project):
    (run,) = _runs(project, ["import os"])
    assert run.recognised_as is None and run.gpu_memory_mb is None and tuple(run.preload) == ()
    assert run.shared_gpu_env == SHARING == sharing_defaults()


def test_framework_runs_get_the_sharing_variables_under_their_own(frameworks, project):
    (project / "exp.yaml").write_text("experiment: f\nframeworks: [jaxy]\nresources: {gpus: 1}\n")
    (run,) = plan(load_experiment(project / "exp.yaml"), check_kernels=False).runs
    assert run.framework == "jaxy" and run.recognised_as is None
    assert run.shared_gpu_env == {**SHARING, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"}


PRINT_SHARING = ("import os, json; print('SHARING=' + json.dumps({k: os.environ.get(k) for k in "
                 "['XLA_PYTHON_CLIENT_PREALLOCATE', 'TF_FORCE_GPU_ALLOW_GROWTH', 'PYTORCH_CUDA_ALLOC_CONF']}))")


def _kernel_sharing(project, record) -> dict:
    log = (project / "results" / record.experiment / record.run_id / "log.txt").read_text()
    return json.loads(next(x for x in log.splitlines() if x.startswith("SHARING=")).removeprefix("SHARING="))


@pytest.mark.kernel
@pytest.mark.parametrize(("resources", "shared"), [("{gpus: 1, runs_per_gpu: auto}", True),
                                                   ("{gpus: 1, runs_per_gpu: 2}", True),
                                                   ("{gpus: 1, runs_per_gpu: 1}", False)])
def test_the_kernel_of_any_notebook_sharing_a_gpu_gets_them(project, monkeypatch, resources, shared):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [GpuInfo(0, "Fake", 8000)])
    make_notebook(project / "mine.ipynb", [PRINT_SHARING], kernel="python3")
    (project / "exp.yaml").write_text("experiment: env\nnotebooks: [{path: mine.ipynb, kernel: python3}]\n"
                                      f"resources: {resources}\nenv: {{TF_FORCE_GPU_ALLOW_GROWTH: 'false'}}\n")
    (record,) = submit(project / "exp.yaml", progress=False).records
    seen = _kernel_sharing(project, record)
    assert seen["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"  # the experiment's own env wins
    if shared:
        assert seen["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    else:
        assert seen["XLA_PYTHON_CLIENT_PREALLOCATE"] is None and seen["PYTORCH_CUDA_ALLOC_CONF"] is None


def test_plan_says_what_a_notebook_was_recognised_as(frameworks, project):
    make_notebook(project / "mine.ipynb", ["import torch"], kernel="python3")
    (project / "exp.yaml").write_text("experiment: mine\nnotebooks: [{path: mine.ipynb, kernel: python3}]\n")
    done = subprocess.run([sys.executable, "-m", "nbbatch", "plan", "exp.yaml"], cwd=project, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "mine.ipynb: recognised as framework `torchy` (by its kernel or imports)" in done.stdout
    done = subprocess.run([sys.executable, "-m", "nbbatch", "plan", "exp.yaml", "--json"], cwd=project,
                          capture_output=True, text=True)
    (run,) = json.loads(done.stdout)
    assert run["recognised_as"] == "torchy" and run["preload"] == ["torch"] and run["gpu_memory_mb"] == 1500


@pytest.mark.kernel
def test_run_json_says_what_the_notebook_was_recognised_as(frameworks, project):
    make_notebook(project / "mine.ipynb", ["import os"], kernel="python3")
    (project / "exp.yaml").write_text("experiment: rec\nnotebooks: [{path: mine.ipynb, kernel: nbbatch-torchy}]\n")
    (run,) = plan(load_experiment(project / "exp.yaml"), check_kernels=False).runs
    assert run.recognised_as == "torchy"  # by its kernel
    (project / "exp.yaml").write_text("experiment: rec\nnotebooks: [{path: mine.ipynb, kernel: python3}]\n")
    (record,) = submit(project / "exp.yaml", progress=False).records
    assert record.recognised_as is None
    make_notebook(project / "mine.ipynb", ["import json  # torch is not needed to be recognised\n"
                                           "if False:\n    import torch"], kernel="python3")
    (record,) = submit(project / "exp.yaml", progress=False).records
    assert record.status == "succeeded" and record.recognised_as == "torchy"
    saved = json.loads((project / "results/rec" / record.run_id / "run.json").read_text())
    assert saved["recognised_as"] == "torchy"
