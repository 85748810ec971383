"""The cluster form for the slurm backend: its fields come from SlurmSettings' labelled settings, and what the form
holds becomes an experiment's backend settings that the backend accepts.

The form is built with ipywidgets but never displayed (no browser); the compute shown is a real two-node Slurm
cluster's (tests/support/slurm.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nbbatch import widgets
from nbbatch.backends import get_backend
from nbbatch.backends.slurm import SlurmBackend
from nbbatch.backends.slurm.script import JobShape, job_options
from nbbatch.spec.experiment import Experiment
from nbbatch.ui.widgets import Cluster

FORM_LABELS = {"partition": "partition", "account": "account", "qos": "QOS", "constraint": "constraint",
               "time_limit": "time limit", "cpus": "CPUs per run", "memory": "memory per run", "gpu_type": "GPU type",
               "max_parallel": "max parallel"}


@pytest.fixture(autouse=True)
def _text_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBBATCH_WIDGETS", "0")


def slurm_experiment(tmp_path: Path, **settings) -> Experiment:
    return Experiment(name="exp", frameworks=["pytorch"], backend="slurm", backend_settings=settings, base_dir=tmp_path)


@pytest.mark.slurm
def test_text_mode_prints_the_settings_nodes_and_partitions(slurm_cluster, capsys: pytest.CaptureFixture) -> None:
    slurm_cluster.clear()  # the nodes are shown idle: no job of an earlier test may still hold one
    cluster = widgets.setup_cluster("slurm", partition="gpu", memory="1G", max_parallel=3)
    assert (cluster.backend, cluster.settings, cluster.max_parallel) == ("slurm", {"partition": "gpu", "memory": "1G"}, 3)
    out = capsys.readouterr().out
    assert out.startswith("backend: slurm\n  partition: gpu\n  memory: 1G\n"), out
    for node in ("node1", "node2"):
        assert f"node {node}: idle, 2 CPUs, 2 GPUs" in out, out
    assert "partitions: debug, gpu" in out and "node1/0: GPU" in out, out
    assert "runs at once: 3" in out, out


def test_the_form_has_slurms_labelled_settings_and_edits_reach_the_experiment(tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets")
    assert {k: s.label for k, s in SlurmBackend.form_settings().items()} == FORM_LABELS
    cluster = Cluster("slurm", {"partition": "debug"})
    form = widgets.ClusterForm(cluster)
    assert set(form.fields) == set(FORM_LABELS)
    assert {key: field.description for key, field in form.fields.items()} == FORM_LABELS
    assert form.fields["partition"].value == "debug" and form.fields["memory"].value == ""  # fitted to the cluster
    assert type(form.fields["cpus"]).__name__ == "BoundedIntText" and form.fields["cpus"].min == 1
    edits = {"partition": "gpu", "account": "lab", "qos": "high", "constraint": "a100", "time_limit": "90",
             "cpus": 4, "memory": "16G", "gpu_type": "a100", "max_parallel": "3"}
    for key, value in edits.items():
        form.fields[key].value = value
    expected = {**edits, "max_parallel": 3}  # a number typed into a text field is the number the setting takes
    assert {key: cluster.settings[key] for key in FORM_LABELS} == expected
    spec = cluster.apply(slurm_experiment(tmp_path, python="/shared/venv/bin/python"))
    assert spec.backend == "slurm" and spec.backend_settings == {"python": "/shared/venv/bin/python", **expected}
    backend = get_backend(spec.backend, **spec.backend_settings)
    options = job_options(backend.settings, _shape(), "nbbatch-exp")
    for option in ("--partition=gpu", "--account=lab", "--qos=high", "--constraint=a100", "--time=90",
                   "--cpus-per-task=4", "--mem=16G", "--gpus-per-node=a100:1"):
        assert option in options, options


def test_empty_text_fields_leave_the_settings_unset(tmp_path: Path) -> None:
    """A form's empty text field is "" (partition, time limit) or nothing typed (max parallel): the backend takes
    them as unset, never as a partition called "" or a refused value."""
    pytest.importorskip("ipywidgets")
    cluster = Cluster("slurm", {"partition": "gpu", "time_limit": 30})  # max_parallel unset: a text field
    form = widgets.ClusterForm(cluster)
    for key in ("partition", "time_limit", "gpu_type", "max_parallel"):
        form.fields[key].value = "4"  # edited, then cleared
        form.fields[key].value = ""
    assert cluster.settings["partition"] == "" and cluster.settings["max_parallel"] is None
    spec = cluster.apply(slurm_experiment(tmp_path))
    backend = get_backend(spec.backend, **spec.backend_settings)
    assert (backend.settings.partition, backend.settings.time_limit, backend.settings.gpu_type) == (None, None, None)
    assert backend.settings.max_parallel is None
    options = job_options(backend.settings, _shape(gpus=0), "nbbatch-exp")
    assert not [o for o in options if o.startswith(("--partition", "--time", "--gpus"))], options


def test_resources_cpus_is_the_jobs_cpus_per_task_over_the_backends_cpus() -> None:
    backend = get_backend("slurm", cpus=4)
    assert "--cpus-per-task=4" in job_options(backend.settings, _shape(), "nbbatch-exp")
    assert "--cpus-per-task=6" in job_options(backend.settings, JobShape(1, 1, None, cpus=6), "nbbatch-exp")


@pytest.mark.slurm
def test_the_forms_compute_shows_the_clusters_nodes_and_partitions(slurm_cluster) -> None:
    pytest.importorskip("ipywidgets")
    cluster = Cluster("slurm", {"cpus": 1, "memory": "256M"})
    form = widgets.ClusterForm(cluster)
    form._refresh()
    html = form.state.value
    assert "node1" in html and "node2" in html and "<b>partitions</b>: debug, gpu" in html, html
    form.fields["max_parallel"].value = "1"
    assert "runs at once: <b>1</b>" in form.state.value
    form.fields["partition"].value = "nosuch"  # compute() lists the cluster, whatever the partition
    form._refresh()
    assert "node1" in form.state.value


def _shape(gpus: int = 1) -> JobShape:
    return JobShape(nodes=1, gpus=gpus, time_minutes=None)
