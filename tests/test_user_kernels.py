"""`nbbatch envs create --user` registers a framework's kernel for the user, as `ipykernel install --user` does, so a
plain `jupyter lab` lists it; `envs remove` unregisters only what starts this project's env. The user's Jupyter data
dir is a temporary JUPYTER_DATA_DIR: no real home is touched."""

from __future__ import annotations

import json
import sys

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from nbbatch.errors import NbbatchError
from nbbatch.execute.envs import _write_kernel, register_user_kernel, registered_user_kernel
from nbbatch.spec.environments import MARKER, env_path, env_python
from nbbatch.spec.frameworks import get_framework
from nbbatch.spec.project import find_project
from nbbatch.ui.cli import main


@pytest.fixture
def built_toy(project, tmp_path, monkeypatch):
    """A framework `toy` whose env looks built (marker, python, kernelspec), and an empty user Jupyter data dir."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user-jupyter"))
    monkeypatch.delenv("JUPYTER_PATH", raising=False)  # a plain `jupyter lab`: not the project's kernels
    fw = project / "frameworks" / "toy"
    fw.mkdir()
    (fw / "framework.yaml").write_text("title: Toy\nnotebook: notebooks/Toy.ipynb\n")
    (fw / "requirements.txt").write_text("# nothing\n")
    framework, proj = get_framework("toy"), find_project()
    python = env_python(env_path(framework, proj))
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    (env_path(framework, proj) / MARKER).write_text(json.dumps({"fingerprint": framework.fingerprint()}))
    _write_kernel(framework, proj, python)
    return framework


def _user_kernels() -> dict[str, str]:
    return KernelSpecManager().find_kernel_specs()


def test_create_user_registers_the_kernel_and_remove_unregisters_it(built_toy, tmp_path, capsys):
    assert "nbbatch-toy" not in _user_kernels()
    assert main(["envs", "create", "toy"]) == 0
    out = capsys.readouterr().out
    assert "JUPYTER_PATH=" in out and "nbbatch envs create toy --user" in out, out  # how to see it, said once
    assert out.count("JUPYTER_PATH=") == 1

    assert main(["envs", "create", "toy", "--user"]) == 0
    assert "registered for your user" in capsys.readouterr().out
    found = _user_kernels()
    assert found["nbbatch-toy"] == str(tmp_path / "user-jupyter" / "kernels" / "nbbatch-toy")
    spec = KernelSpecManager().get_kernel_spec("nbbatch-toy")
    assert spec.argv[0] == str(env_python(env_path(built_toy, find_project())))
    assert main(["envs", "create", "toy"]) == 0
    assert "jupyter lab" not in capsys.readouterr().out  # registered: nothing more to say

    assert main(["envs", "remove", "toy"]) == 0
    assert "its copy in" in capsys.readouterr().out
    assert "nbbatch-toy" not in _user_kernels()


def test_remove_keeps_another_projects_registration(built_toy, tmp_path):
    other = tmp_path / "user-jupyter" / "kernels" / "nbbatch-toy"
    other.mkdir(parents=True)
    (other / "kernel.json").write_text(json.dumps({"argv": ["/elsewhere/bin/python", "-m", "ipykernel_launcher"],
                                                   "display_name": "nbbatch Toy", "language": "python"}))
    assert registered_user_kernel(built_toy) is None
    assert main(["envs", "remove", "toy"]) == 0
    assert (other / "kernel.json").exists()  # not ours: left alone


def test_user_registration_of_an_env_not_built_says_how(project, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user-jupyter"))
    fw = project / "frameworks" / "toy"
    fw.mkdir()
    (fw / "framework.yaml").write_text("title: Toy\nnotebook: notebooks/Toy.ipynb\n")
    (fw / "requirements.txt").write_text("# nothing\n")
    with pytest.raises(NbbatchError, match="nbbatch envs create toy"):
        register_user_kernel(get_framework("toy"))
