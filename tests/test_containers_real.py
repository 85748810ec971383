"""Framework images built and run for real, with Podman (``-m container``).

What CI proves: ``nbbatch images build`` builds the Chainer image from the one template (on a Debian
base made by mmdebstrap, since no registry is reachable there) and the CPU image of a GPU framework
(MXNet); ``nbbatch submit`` with ``backend: {name: local, container: true}`` runs digits notebooks
inside them, their run.json, log and executed notebook land on the share, owned by the invoking user;
a timeout, ``nbbatch cancel`` and Ctrl-C (SIGTERM) end runs and leave no container and no kernel.
What it cannot prove: CUDA base images and GPU passthrough (docs/containers.md).

Needs root, podman, runc and mmdebstrap (``.ci/run`` installs them); skipped with the reason otherwise.
Podman's settings for such a machine (runc; ulimits it may set) go in a private CONTAINERS_CONF.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.containers import BASE
from support.containers import nbbatch_cli as _nbbatch
from support.containers import podman as _podman
from support.processes import kernels_of

from nbbatch.containers.images import image_spec
from nbbatch.spec.frameworks import list_frameworks
from nbbatch.spec.project import Project

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]


def _experiment(tmp_path: Path, name: str, framework: str = "chainer", extra: str = "", **parameters) -> Path:
    params = {"DATASET": "digits", "EPOCHS": 1, "MAX_SAMPLES": 200, **parameters}
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"experiment: {name}\nframeworks: [{framework}]\nparameters: {json.dumps(params)}\n{extra}"
                    f"backend: {{name: local, container: true, engine: podman, base_image: '{BASE}'}}\n"
                    f"share: {tmp_path / 'share'}\n")
    return path


def _records(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "share" / name).glob("*/run.json"))]


def _containers_of(name: str) -> list[str]:
    return _podman("ps", "--all", "--filter", f"label=nbbatch.experiment={name}", "--format", "{{.Names}}").stdout.split()


def test_images_are_built_once_and_listed(chainer_image):
    log = ROOT / ".nbbatch" / "images" / "chainer.log"
    before = log.stat().st_mtime_ns if log.exists() else None
    again = _nbbatch("images", "build", "chainer", "--base", BASE, "--engine", "podman")
    assert again.returncode == 0 and "chainer: ready" in again.stdout, again.stderr
    assert (log.stat().st_mtime_ns if log.exists() else None) == before, "a ready image was built again"
    listed = _nbbatch("images", "list", "chainer", "--base", BASE, "--engine", "podman")
    assert listed.returncode == 0 and "ready" in listed.stdout and chainer_image.fingerprint in listed.stdout


def test_runs_execute_inside_the_image_and_land_on_the_share(chainer_image, tmp_path):
    data = tmp_path / "elsewhere"  # a path a parameter names, outside project and share: mounted read-only
    data.mkdir()
    exp = _experiment(tmp_path, "ctr-ok", extra="sweep: {grid: {LR: [0.01, 0.05]}}\n", DATA_DIR=str(data))
    done = _nbbatch("submit", str(exp), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    records = _records(tmp_path, "ctr-ok")
    image_id = _podman("image", "inspect", "--format", "{{.Id}}", chainer_image.ref).stdout.strip()
    assert [r["status"] for r in records] == ["succeeded", "succeeded"]
    for record in records:
        assert record["container"]["image"] == chainer_image.ref and record["container"]["image_id"] == image_id
        assert record["container"]["engine"] == "podman"
        assert record["environment"]["chainer"] == "7.8.1" and record["metrics"]["accuracy"] > 0
        folder = tmp_path / "share" / "ctr-ok" / record["run_id"]
        assert "in podman image " + chainer_image.ref in (folder / "log.txt").read_text()
        notebook = json.loads((folder / "output.ipynb").read_text())
        assert any("accuracy" in json.dumps(c.get("outputs", [])) for c in notebook["cells"])
        assert {p.stat().st_uid for p in folder.iterdir()} == {os.getuid()}
    assert _containers_of("ctr-ok") == [] and kernels_of("ctr-ok") == []


def _wait_running(tmp_path: Path, name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = _records(tmp_path, name)
        if records and all(r["status"] == "running" and r["cells_done"] >= 2 for r in records):
            return
        time.sleep(0.5)
    raise AssertionError(f"{name}: the run did not start: {_records(tmp_path, name)}")


def test_timeout_cancel_and_ctrl_c_leave_nothing_running(chainer_image, tmp_path):
    long = {"EPOCHS": 500, "MAX_SAMPLES": 1000}
    timed = _nbbatch("submit", str(_experiment(tmp_path, "ctr-timeout", extra="timeout: {run: 20}\n", **long)), "-q")
    assert timed.returncode != 0
    [record] = _records(tmp_path, "ctr-timeout")
    assert record["status"] == "timed_out", record["error"]

    for name, stop in (("ctr-cancel", "cancel"), ("ctr-sigterm", "sigterm")):
        submit = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", str(_experiment(tmp_path, name, **long)),
                                   "-q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_running(tmp_path, name)
            assert len(_containers_of(name)) == 1
            if stop == "cancel":
                assert _nbbatch("cancel", name, "--share", str(tmp_path / "share")).returncode == 0
            else:
                submit.send_signal(signal.SIGTERM)
            submit.wait(timeout=120)
        finally:
            if submit.poll() is None:
                submit.kill()
        [record] = _records(tmp_path, name)
        assert record["status"] == "cancelled", (stop, record["error"], submit.stdout.read() if submit.stdout else "")

    deadline = time.monotonic() + 30  # podman removes a killed --rm container just after it exits
    while time.monotonic() < deadline and any(_containers_of(n) for n in ("ctr-timeout", "ctr-cancel", "ctr-sigterm")):
        time.sleep(0.5)
    for name in ("ctr-timeout", "ctr-cancel", "ctr-sigterm"):
        assert _containers_of(name) == [] and kernels_of(name) == [], name


def test_the_cpu_image_of_a_gpu_framework(podman_env, tmp_path):
    """MXNet is a GPU framework (its image installs mxnet-cu112 on a CUDA base); --cpu builds its pins as the
    venv has them, on any base: here the Debian one, so CI builds and runs a GPU framework's image too."""
    spec = image_spec(list_frameworks(Project(ROOT))["mxnet"], ROOT / "dockerfiles", gpu=False, base=BASE)
    assert spec.args["GPU"] == "0"
    built = _nbbatch("images", "build", "mxnet", "--cpu", "--base", BASE, "--engine", "podman", "-q")
    assert built.returncode == 0, built.stdout + built.stderr
    exp = _experiment(tmp_path, "ctr-mxnet", framework="mxnet")
    text = exp.read_text().replace("container: true,", "container: true, cpu_image: true,")
    exp.write_text(text)
    done = _nbbatch("submit", str(exp), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    [record] = _records(tmp_path, "ctr-mxnet")
    assert record["status"] == "succeeded" and record["container"]["image"] == spec.ref
    assert record["environment"].get("mxnet") == "1.9.1" and "mxnet-cu112" not in record["environment"]
