"""The launch contract of ``nbbatch run-one`` (nbbatch.execute.launch): one typed value, one command."""

from __future__ import annotations

import json

import pytest

from nbbatch.errors import NbbatchError
from nbbatch.execute.launch import LAUNCH_VERSION, LaunchSpec, launch_command, launch_shell_command, read_launch
from nbbatch.execute.placement import NodePlacement
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution
from nbbatch.store.runjson import ContainerInfo, GpuSharing
from nbbatch.ui.cli import build_parser


def _run(**fields) -> Run:
    return Run("r1", "e", "/proj/nb.ipynb", "nb.ipynb", "python3", parameters={"A": 1}, env={"LABEL": "x"}, **fields)


def test_every_field_survives_the_file(tmp_path):
    launch = LaunchSpec(
        run=_run(distribution=Distribution("torch", nodes=2, processes_per_node=2, gpus_per_node=1)), share="/share",
        backend="slurm", project="/proj", gpus=(2, 3), gpus_from_env=("SLURM_JOB_GPUS",), shared_gpu=True,
        inputs={"DATA": "/mnt/data"}, container_images={"toy": "localhost/nbbatch/toy:abc"}, container_engine="docker",
        host_gpu_ids=(5, 7), gpu_share=GpuSharing(runs_per_gpu=2, shared=True), container=ContainerInfo("podman", "i"),
        node=NodePlacement(1, ("10.0.0.4:7000", "10.0.0.5:7001"), (2, 3)), fresh_ports=True)
    (tmp_path / "launch.json").write_text(launch.to_json())
    assert read_launch(str(tmp_path / "launch.json")) == launch == read_launch(launch.to_json())
    assert json.loads(launch.to_json())["launch_version"] == LAUNCH_VERSION
    assert LaunchSpec.from_json(LaunchSpec(_run(), "/share").to_json()) == LaunchSpec(_run(), "/share")


def test_a_launch_may_leave_its_run_in_a_file_beside_it(tmp_path, monkeypatch):
    """A job's command holds the launch; the run (unbounded parameters) is a file where run-one starts."""
    launch = LaunchSpec(_run(), "${{outputs.share}}", backend="azureml", gpus=(0,))
    small = json.dumps(launch.to_dict(run_file="runs/r1.json"))
    assert "run" not in json.loads(small) and '"A"' not in small
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NbbatchError, match=r"^run-one: the launch JSON on its command line names the run file "
                                           r"runs/r1.json, which cannot be read here"):
        read_launch(small)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1.json").write_text(launch.run_json())
    assert read_launch(small) == launch


def test_the_command_is_run_one_and_the_launch():
    assert launch_command(["python", "-m", "nbbatch"], "/tmp/l.json") == ["python", "-m", "nbbatch", "run-one",
                                                                           "/tmp/l.json"]
    assert launch_shell_command("python -m nbbatch", "/s/specs/$(( SLURM_ARRAY_TASK_ID + 2 )).json") == \
        "python -m nbbatch run-one /s/specs/$(( SLURM_ARRAY_TASK_ID + 2 )).json"
    assert build_parser().parse_args(launch_command([], "/tmp/l.json")).launch == "/tmp/l.json"


def test_the_gpus_come_from_the_launch_or_the_first_variable_set():
    assert LaunchSpec(_run(), "/s", gpus=(1,), gpus_from_env=("CUDA_VISIBLE_DEVICES",)).gpu_ids({}) == [1]
    from_env = LaunchSpec(_run(), "/s", gpus_from_env=("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"))
    assert from_env.gpu_ids({"SLURM_JOB_GPUS": "", "CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 1]
    assert from_env.gpu_ids({}) == [] and LaunchSpec(_run(), "/s").gpu_ids({"CUDA_VISIBLE_DEVICES": "3"}) == []
    with pytest.raises(NbbatchError, match="are not indices"):
        from_env.gpu_ids({"CUDA_VISIBLE_DEVICES": "GPU-5d1c"})


@pytest.mark.parametrize("secret", [
    {"share": "https://user:pw@files.example/share"},
    {"inputs": {"DATA": "https://acct.file.core.windows.net/d?sv=2024&sig=abcdef"}},
    {"project": "postgres://u:pw@host/db"},
])
def test_no_secret_is_written_into_a_launch(secret):
    launch = LaunchSpec(**{"run": _run(), "share": "/s", **secret})
    with pytest.raises(NbbatchError, match="looks like a credential") as caught:
        launch.to_json()
    assert "pw@" not in str(caught.value) and "sig=" not in str(caught.value)
