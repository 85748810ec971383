"""The Jupyter front's models and its text fallback: no browser, no frontend.

The models (:class:`JobsSummaryModel`, :class:`SubmissionModel`, :class:`SummaryRefresher`,
:class:`Cluster`) are driven with run records; the widgets are built with ipywidgets but never
displayed (their buttons are clicked from Python); the text mode is what a plain process prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from support.waiting import wait_until

from nbbatch import widgets
from nbbatch.backends.base import Compute
from nbbatch.backends.ray import RayBackend
from nbbatch.errors import NbbatchError, SpecError
from nbbatch.spec.experiment import Experiment
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunError, RunRecord
from nbbatch.store.share import FileShare
from nbbatch.store.sync import FileEntry
from nbbatch.ui.widgets import (
    Cluster,
    JobsSummary,
    JobsSummaryModel,
    NotebookLinks,
    SubmissionModel,
    SummaryRefresher,
    format_duration,
)
from nbbatch.ui.widgets import cluster as widget_cluster
from nbbatch.ui.widgets import display as widget_display
from nbbatch.ui.widgets import links as widget_links
from nbbatch.ui.widgets import submission as widget_submission


def record(run_id: str, status: str = "queued", **fields) -> RunRecord:
    values = {"experiment": "exp", "notebook": "notebooks/Tiny.ipynb", "kernel": "python3", "framework": "pytorch",
              "parameters": {"EPOCHS": 1, "LR": 0.01}}
    values.update(fields)
    return RunRecord(run_id=run_id, status=status, **values)


@pytest.fixture
def project(widget_project: Path) -> Path:
    return widget_project


# --------------------------------------------------------------------------------------------------
# imports stay light


def test_importing_nbbatch_and_its_widgets_module_does_not_import_ipywidgets() -> None:
    code = ("import sys, nbbatch, nbbatch.widgets; "
            "print(json.dumps([m for m in ('ipywidgets', 'IPython', 'papermill') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_display_mode_is_text_outside_a_kernel_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NBBATCH_WIDGETS", raising=False)
    assert widgets.display_mode() == "text"
    monkeypatch.setenv("NBBATCH_WIDGETS", "1")
    assert widgets.display_mode() == "text"  # no kernel: nothing could show a widget
    monkeypatch.setenv("NBBATCH_WIDGETS", "0")
    assert widgets.display_mode() == "text"


def test_a_headless_executor_means_text_and_an_interactive_frontend_means_widgets() -> None:
    class Kernel:
        def __init__(self, allow_stdin: bool):
            self.parent = {"content": {"allow_stdin": allow_stdin}}

        def get_parent(self, channel: str = "shell") -> dict:
            return self.parent

    assert widget_display._frontend_is_interactive(Kernel(True))
    assert not widget_display._frontend_is_interactive(Kernel(False))  # papermill / nbclient


# --------------------------------------------------------------------------------------------------
# the jobs table model


def test_model_records_each_status_transition_once() -> None:
    model = JobsSummaryModel("exp")
    assert model.update(record("a"))
    assert not model.update(record("a"))  # same record: nothing changed
    assert model.update(record("a", "running", attempts=1, cells_done=1, cells_total=4))
    assert model.update(record("a", "running", attempts=1, cells_done=2, cells_total=4))  # progress, same status
    assert model.update(record("a", "succeeded", attempts=1, duration_s=12.5, metrics={"accuracy": 0.9}))
    assert model.transitions == [("a", None, "queued"), ("a", "queued", "running"), ("a", "running", "succeeded")]
    assert model.all_final


def test_model_is_not_final_while_expected_runs_have_no_record() -> None:
    model = JobsSummaryModel("exp", expected=["a", "b"])
    assert not model.all_final  # nothing yet
    model.update(record("a", "succeeded"))
    assert not model.all_final and model.missing == ["b"] and model.active == ["b"]
    assert model.counts() == {"succeeded": 1, "queued": 1}
    model.update(record("b", "failed", error=RunError("ValueError", "bad LR", cell_index=3)))
    assert model.all_final
    assert model.headline() == "exp: 2 runs — 1 failed, 1 succeeded"


def test_model_with_no_runs_is_never_final() -> None:
    assert not JobsSummaryModel("exp").all_final


def test_model_rows_show_what_tells_runs_apart_and_the_key_metrics() -> None:
    model = JobsSummaryModel("exp")
    model.update(record("a", "succeeded", parameters={"EPOCHS": 1, "LR": 0.01}, duration_s=75,
                        metrics={"accuracy": 0.91234, "loss": 0.3, "train_seconds": 70.0}, gpu_ids=[0]))
    model.update(record("b", "succeeded", parameters={"EPOCHS": 1, "LR": 0.1}, duration_s=3.25, metrics={"loss": 0.5}))
    rows = {r["run_id"]: r for r in model.rows()}
    assert model.varying_parameters() == ["LR"]
    assert rows["a"]["parameters_shown"] == "LR=0.01" and rows["a"]["parameters_all"] == "EPOCHS=1, LR=0.01"
    assert rows["a"]["metrics_shown"] == "accuracy=0.9123, train_seconds=70"
    assert rows["b"]["metrics_shown"] == "loss=0.5"  # no key metric: the numeric ones
    assert rows["a"]["duration_text"] == "1m 15s" and rows["b"]["duration_text"] == "3.2s"
    assert rows["a"]["gpu_text"] == "0" and rows["b"]["gpu_text"] == "cpu"


def test_a_running_run_shows_its_elapsed_time() -> None:
    from datetime import datetime, timedelta, timezone

    now = datetime(2025, 1, 1, 12, 0, 30, tzinfo=timezone.utc)
    model = JobsSummaryModel("exp")
    model.update(record("a", "running", started_at=(now - timedelta(seconds=30)).isoformat()))
    assert model.rows(now)[0]["duration_text"] == "30.0s…"


def test_text_table_lists_every_run_and_its_error() -> None:
    model = JobsSummaryModel("exp", links=lambda r: NotebookLinks(Path.cwd() / "results" / r.run_id / "output.ipynb"))
    model.update(record("pytorch-1", "succeeded", duration_s=4.0, metrics={"accuracy": 0.9}))
    model.update(record("pytorch-2", "failed", parameters={"EPOCHS": 1, "LR": 0.1},
                        error=RunError("RuntimeError", "diverged: loss is nan", cell_index=4)))
    text = model.to_text()
    lines = text.splitlines()
    assert lines[0] == "exp: 2 runs — 1 failed, 1 succeeded"
    assert lines[1].split() == ["run", "framework", "parameters", "status", "try", "duration", "GPU", "metrics", "notebook"]
    assert "pytorch-1" in text and "accuracy=0.9" in text and "results/pytorch-1/output.ipynb" in text
    assert "pytorch-2: cell 4: RuntimeError: diverged: loss is nan" in text


def test_html_table_has_a_row_per_run_with_its_status_and_escapes_values() -> None:
    model = JobsSummaryModel("exp", expected=["c"])
    model.update(record("a", "succeeded", parameters={"NAME": "<script>x</script>"}))
    model.update(record("b", "failed", parameters={"NAME": "y"}, error=RunError("E", "<b>boom</b>")))
    page = model.to_html()
    assert "data-run='a' data-status='succeeded'" in page
    assert "data-run='b' data-status='failed'" in page
    assert "data-run='c' data-status='queued'" in page  # expected, not recorded yet
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;b&gt;boom" in page
    assert "data-state='live'" in page
    assert "color:#2e7d32" in page  # succeeded in green, from results.STATUS_STYLE


def test_status_css_follows_the_terminal_styles() -> None:
    assert widgets.status_css("failed") == "font-weight:600;color:#c62828"
    assert widgets.status_css("queued") == "opacity:0.65"
    assert widgets.status_css("unknown") == ""


def test_format_duration() -> None:
    assert [format_duration(s) for s in (None, 0.04, 59.94, 61, 3725)] == ["", "0.0s", "59.9s", "1m 01s", "1h 02m"]


# --------------------------------------------------------------------------------------------------
# refreshing


def test_refresher_polls_until_every_run_is_final_then_stops() -> None:
    states = [
        [record("a"), record("b")],
        [record("a", "running"), record("b")],
        [record("a", "succeeded"), record("b", "running")],
        [record("a", "succeeded"), record("b", "failed")],
    ]
    loads, renders = [], []

    def load() -> list[RunRecord]:
        loads.append(1)
        return states[min(len(loads), len(states)) - 1]

    model = JobsSummaryModel("exp")
    refresher = SummaryRefresher(model, load, lambda m: renders.append(m.counts()), interval=0.01)
    refresher.start()
    assert refresher.join(timeout=5)
    assert len(loads) == 4  # stopped at the first poll where every run was final
    assert renders[-1] == {"succeeded": 1, "failed": 1}
    assert model.all_final
    assert [t for t in model.transitions if t[0] == "b"] == [("b", None, "queued"), ("b", "queued", "running"),
                                                            ("b", "running", "failed")]


def test_refresher_keeps_going_while_a_submission_may_add_runs() -> None:
    model = JobsSummaryModel("exp")
    planning = [True, True, False]
    refresher = SummaryRefresher(model, lambda: [record("a", "succeeded")], lambda m: None,
                                 keep_going=lambda: planning.pop(0) if planning else False)
    assert refresher.poll_once() and refresher.poll_once()
    assert not refresher.poll_once()


def test_refresher_shows_errors_and_gives_up_when_nothing_ever_appears() -> None:
    model = JobsSummaryModel("exp")

    def load() -> list[RunRecord]:
        raise NbbatchError("experiment `exp` has no runs")

    refresher = SummaryRefresher(model, load, lambda m: None, idle_timeout=0.05)
    assert refresher.poll_once()
    assert model.message == "experiment `exp` has no runs"
    time.sleep(0.06)
    assert not refresher.poll_once()


def test_refresher_can_be_stopped() -> None:
    model = JobsSummaryModel("exp")
    refresher = SummaryRefresher(model, lambda: [record("a", "running")], lambda m: None, interval=0.01).start()
    wait_until(lambda: "a" in model.records, 10, "the refresher's first poll")
    assert refresher.running
    refresher.stop()
    assert refresher.join(timeout=2)


# --------------------------------------------------------------------------------------------------
# the submission model


def test_submission_model_counts_skipped_runs_as_finished() -> None:
    from nbbatch.api import SubmitResult

    model = SubmissionModel("exp")
    assert model.label() == "exp: planning and validating…" and model.active
    model.planned(["a", "b", "c"])
    model.update(record("a", "running"))
    assert model.counts() == {"running": 1, "queued": 2} and model.finished_count == 0
    assert model.bar_style() == "info"
    model.update(record("a", "failed"))
    assert model.bar_style() == "danger"
    model.finished(SubmitResult("exp", "share", "local", started=["a", "b"], skipped=["c"],
                                records=[record("a", "failed"), record("b", "succeeded"), record("c", "succeeded")]))
    assert not model.active and model.finished_count == 3
    assert model.label() == ("exp: done, 3/3 finished — 1 failed, 2 succeeded (1 skipped: already succeeded)")


def test_submission_model_reports_a_failed_submission() -> None:
    model = SubmissionModel("exp")
    model.failed(NbbatchError("parameter `EPCHS` is not in Tiny.ipynb's parameters cell"))
    assert model.state == "error" and model.bar_style() == "danger"
    assert model.label() == "exp: submission failed: parameter `EPCHS` is not in Tiny.ipynb's parameters cell"


def test_overrides_match_the_shared_parameters_without_case(tmp_path: Path) -> None:
    spec = Experiment(name="exp", frameworks=["pytorch"], parameters={"LR": 0.1}, sweep={"grid": {"SEED": [0, 1]}},
                      base_dir=tmp_path)
    changed = widget_submission._apply_overrides(spec, {"epochs": 10, "lr": 0.5, "CUSTOM": True})
    assert changed.parameters == {"LR": 0.5, "EPOCHS": 10, "CUSTOM": True}
    with pytest.raises(SpecError, match="`SEED` is varied by sweep.grid"):
        widget_submission._apply_overrides(spec, {"seed": 3})


# --------------------------------------------------------------------------------------------------
# the cluster


def test_cluster_applies_its_backend_and_scheduling_to_an_experiment(tmp_path: Path) -> None:
    spec = Experiment(name="exp", frameworks=["pytorch"], backend="azureml", backend_settings={"workspace": "ws"},
                      base_dir=tmp_path)
    same = Cluster("azureml", {"compute": "gpu"}, max_parallel=4).apply(spec)
    assert same.backend_settings == {"workspace": "ws", "compute": "gpu"} and same.resources.max_parallel == 4
    other = Cluster("local", runs_per_gpu=2).apply(spec)
    assert other.backend == "local" and other.backend_settings == {} and other.resources.runs_per_gpu == 2


def test_cluster_concurrency_and_description() -> None:
    gpus = Compute("local", gpus=[{"index": 0, "name": "A"}, {"index": 1, "name": "B"}], slots=8)
    assert Cluster(runs_per_gpu=3).concurrency(gpus) == 6
    assert Cluster(runs_per_gpu=3, max_parallel=4).concurrency(gpus) == 4
    assert Cluster().concurrency(Compute("local", slots=2)) == 2
    text = Cluster("azureml", {"compute": "c", "client_secret": "s3cret"}).describe(
        Compute("azureml", details={"provisioning_state": "Succeeded"}))
    assert "compute: c" in text and "provisioning_state: Succeeded" in text and "s3cret" not in text


def test_setup_cluster_prints_the_local_compute_in_text_mode(project: Path, capsys: pytest.CaptureFixture) -> None:
    cluster = widgets.setup_cluster("local", runs_per_gpu=2, max_parallel=3)
    assert (cluster.backend, cluster.runs_per_gpu, cluster.max_parallel, cluster.settings) == ("local", 2, 3, {})
    out = capsys.readouterr().out
    assert out.startswith("backend: local") and "runs at once:" in out


def test_setup_cluster_names_unknown_backends() -> None:
    with pytest.raises(NbbatchError, match=r"unknown backend `azurml` \(did you mean `azureml`\?\)"):
        widgets.setup_cluster("azurml")


def test_azureml_form_creates_resizes_and_deletes_the_cluster() -> None:
    """The form against the real azureml backend and MLClient, answered by the fake control plane."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("azure.ai.ml")
    from fakes.azureml_transport import FakeAzureML

    from nbbatch.backends.azureml import AzureMLBackend

    aml = FakeAzureML()
    fields = AzureMLBackend.form_settings()
    settings = {key: setting.default for key, setting in fields.items()}
    settings.update(compute="gpu-t4", ml_client=aml.ml_client())
    cluster = Cluster("azureml", settings)
    form = widgets.ClusterForm(cluster)
    assert set(form.fields) == set(fields)
    assert "ml_client" not in form.message.value  # only plain settings are shown
    form._refresh()
    assert "cluster gpu-t4: does not exist" in form.state.value
    form.fields["max_nodes"].value = 3
    form.fields["tier"].value = "low_priority"
    assert cluster.settings["max_nodes"] == 3 and cluster.settings["tier"] == "low_priority"
    form._provision()
    props = aml.computes["gpu-t4"]["properties"]["properties"]
    assert props["scaleSettings"]["maxNodeCount"] == 3 and props["vmPriority"] == "LowPriority"
    assert props["vmSize"] == fields["vm_size"].default
    assert "provisioning Succeeded" in form.state.value and not form.message.value
    form.fields["max_nodes"].value = 5  # an existing cluster: resized
    form._provision()
    assert aml.computes["gpu-t4"]["properties"]["properties"]["scaleSettings"]["maxNodeCount"] == 5
    form.fields["vm_size"].value = "Standard_NC6s_v3"  # cannot change on an existing cluster: said so
    form._provision()
    assert "only its node range changes" in form.message.value
    assert cluster.delete() and "gpu-t4" not in aml.computes
    assert not cluster.delete()


class FakeRay(RayBackend):
    """Answers compute() the way the ray backend does (nodes, GPUs, total/available resources)."""

    def __init__(self, address: str = "auto", num_cpus: float = 1, **_settings):
        self.address, self.num_cpus = address, num_cpus

    def compute(self) -> Compute:
        if self.address != "10.0.0.1:6379":
            raise NbbatchError(f"cannot connect to the Ray cluster at `{self.address}`")
        return Compute("ray", gpus=[{"index": 0, "name": "A100", "memory_mb": None, "node": "head"}],
                       nodes=[{"name": "head", "state": "alive", "cpus": 8.0, "gpus": 1.0}], slots=8,
                       details={"address": self.address, "total": {"CPU": 8.0, "GPU": 1.0, "memory": 8 * 2**30,
                                                                    "node:10.0.0.1": 1.0}})


def test_ray_form_connects_to_the_address_and_shows_the_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ipywidgets")
    from nbbatch import backends

    monkeypatch.setitem(backends._REGISTRY, "ray", FakeRay)
    cluster = Cluster("ray", {"num_cpus": 2.0})
    form = widgets.ClusterForm(cluster)
    assert cluster.settings == {"num_cpus": 2.0, "address": "auto"}
    assert type(form.fields["num_cpus"]).__name__ == "FloatText"
    form._refresh()
    assert "cannot connect to the Ray cluster at `auto`" in form.state.value
    form.fields["address"].value = "10.0.0.1:6379"
    form.apply_button.click()  # Connect: asks in a background thread
    wait_until(lambda: "head" in form.state.value, 10, "the cluster's nodes in the form")
    assert "A100" in form.state.value and "CPU 8, GPU 1, memory 8.0 GB" in form.state.value
    assert "node:" not in form.state.value
    assert cluster.settings["address"] == "10.0.0.1:6379"


def test_local_form_follows_runs_per_gpu_and_concurrency() -> None:
    pytest.importorskip("ipywidgets")
    cluster = Cluster("local", runs_per_gpu=1, max_parallel=2)
    form = widgets.ClusterForm(cluster)
    form._refresh()
    form.fields["max_parallel"].value = 1
    assert cluster.max_parallel == 1
    assert "runs at once: <b>1</b>" in form.state.value


def _label_fits(field) -> bool:
    """Whether ``field``'s label shows in full: its characters (each narrower than a ``ch``) within its label width."""
    width = field.style.description_width
    return width.endswith("ch") and len(field.description) < float(width[:-2])


def test_local_form_labels_show_in_full_and_runs_per_gpu_says_auto() -> None:
    """The labels are not cut ("runs per GPU (0: a…"), and the field shows `auto`, the experiments' default, rather
    than a number whose meaning a cut label hid."""
    pytest.importorskip("ipywidgets")
    form = widgets.ClusterForm(Cluster("local"))
    assert all(_label_fits(field) for field in form.fields.values()), \
        {k: (f.description, f.style.description_width) for k, f in form.fields.items()}
    per_gpu = form.fields["runs_per_gpu"]
    assert per_gpu.description == "runs per GPU" and per_gpu.value == "auto" and 1 in per_gpu.options
    form.start()
    assert form.cluster.runs_per_gpu == "auto"
    per_gpu.value = 2
    assert form.cluster.runs_per_gpu == 2
    assert widgets.ClusterForm(Cluster("local", runs_per_gpu=12)).fields["runs_per_gpu"].value == 12  # kept, added
    assert widgets.ClusterForm(Cluster("local", runs_per_gpu=0)).fields["runs_per_gpu"].value == "auto"


def test_setup_cluster_takes_runs_per_gpu_0_as_auto(project: Path) -> None:
    assert widgets.setup_cluster("local", runs_per_gpu=0).runs_per_gpu == "auto"
    assert widgets.setup_cluster("local", runs_per_gpu="auto").runs_per_gpu == "auto"


def test_control_notebook_passes_runs_per_gpu_as_the_form_shows_it() -> None:
    """The control notebook's RUNS_PER_GPU is the experiments' default (auto), a value the form shows as it is."""
    from nbbatch.spec.resources import Resources

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / "ExploringBatchAI.ipynb", as_version=4)
    namespace: dict[str, object] = {}
    exec(next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", [])), namespace)
    assert namespace["RUNS_PER_GPU"] == Resources().runs_per_gpu == "auto"
    assert namespace["RUNS_PER_GPU"] in widget_cluster.RUNS_PER_GPU_CHOICES


def test_backend_form_labels_show_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend's labelled settings, and a plain setting with a long name, fit their form's label width."""
    pytest.importorskip("ipywidgets")
    from nbbatch import backends

    monkeypatch.setitem(backends._REGISTRY, "ray", FakeRay)
    form = widgets.ClusterForm(Cluster("ray", {"num_cpus": 2.0, "object_store_memory_bytes": 10}))
    assert all(_label_fits(field) for field in form.fields.values())
    for name in ("slurm", "azureml"):
        if widget_cluster._backend_class(name) is None:
            continue
        fields = widget_cluster.form_settings(name)
        labels = [setting.label for setting in fields.values()]
        width = widget_cluster._label_style(labels)["description_width"]
        assert all(len(label) < float(width[:-2]) for label in labels), (name, labels, width)


# --------------------------------------------------------------------------------------------------
# links


def test_links_point_at_the_jupyter_server_that_serves_the_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    root = tmp_path / "root"
    notebook = root / "results" / "exp" / "run 1" / "output.ipynb"
    notebook.parent.mkdir(parents=True)
    notebook.write_text("{}")
    (runtime / "jpserver-1.json").write_text(json.dumps({"pid": os.getpid(), "root_dir": str(tmp_path),
                                                         "base_url": "/user/me/"}))
    (runtime / "jpserver-2.json").write_text(json.dumps({"pid": os.getpid(), "root_dir": str(root), "base_url": "/"}))
    (runtime / "jpserver-3.json").write_text(json.dumps({"pid": 2**22 + 7, "root_dir": str(root / "results")}))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.setitem(widget_links._SERVERS_CACHE, "at", 0.0)
    links = widget_links.notebook_links_for(FileShare(root / "results"), "exp", "run 1")
    assert links.open_url == "/lab/tree/results/exp/run%201/output.ipynb"  # the deepest live server's root
    assert links.download_url == "/files/results/exp/run%201/output.ipynb?download=1"
    assert 'href="/lab/tree/results/exp/run%201/output.ipynb"' in links.html()
    assert widget_links.notebook_links_for(FileShare(root / "results"), "exp", "missing").html() == ""
    # the run's outputs: a download link each (the first three, then how many more)
    outputs = notebook.parent / "outputs"
    (outputs / "figs").mkdir(parents=True)
    names = ["model.pt", "figs/curve.png", "a.txt", "b.txt"]
    for name in names:
        (outputs / name).write_text("x")
    links = widget_links.notebook_links_for(FileShare(root / "results"), "exp", "run 1", [FileEntry(n, 1, "") for n in names])
    assert links.outputs[0] == ("model.pt", "/files/results/exp/run%201/outputs/model.pt?download=1")
    html = links.html()
    assert 'href="/files/results/exp/run%201/outputs/figs/curve.png?download=1" download>figs/curve.png</a>' in html
    assert "b.txt" not in html and "+1" in html


# --------------------------------------------------------------------------------------------------
# the widgets, built without a frontend


def test_jobs_widget_shows_cancel_buttons_for_active_runs_and_they_cancel(project: Path) -> None:
    pytest.importorskip("ipywidgets")
    share = FileShare(project / "results")
    for rec in (record("a", "running", pid=os.getpid()), record("b", "queued"), record("c", "succeeded")):
        write_record(share, rec)
    model = JobsSummaryModel("exp")
    summary = JobsSummary(model, share)
    model.replace_all(summary.load())
    summary.build_widget()
    descriptions = [b.description for b in summary.actions.children]
    assert descriptions == ["Cancel all", "Cancel a", "Cancel b"]
    summary.actions.children[1].click()
    assert (project / "results" / "exp" / ".cancel" / "a").exists()
    assert "asked to stop: a" in summary.notice.value
    summary.cancel_all_button.click()
    assert (project / "results" / "exp" / ".cancel" / "b").exists()
    model.replace_all([record("a", "cancelled"), record("b", "cancelled")])
    summary.render(model)
    assert summary.actions.layout.display == "none" and "data-state='final'" in summary.table.value


def test_jobs_table_asks_the_backend_too_so_a_dead_driver_shows_as_failed(project: Path) -> None:
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    share = FileShare(project / "results")
    write_record(share, record("a", "running", host=socket.gethostname(), pid=gone.pid, backend="local"))
    summary = JobsSummary(JobsSummaryModel("exp"), share, backend_refresh_s=3600)
    assert [r.status for r in summary.load()] == ["running"]  # the share alone
    summary.backend_refresh_s = 0
    records = summary.load()
    assert [r.status for r in records] == ["failed"] and records[0].error.ename == "DriverDied"


def test_job_log_keeps_the_tail_and_shows_the_status(project: Path) -> None:
    pytest.importorskip("ipywidgets")
    import ipywidgets as w

    share = FileShare(project / "results")
    job = widgets.JobLog("exp", "a", share, max_chars=10)
    job.widget = w.VBox([w.HTML(), w.Output()])
    job.append("0123456789abc")
    job.push()
    assert job.widget.children[1].outputs[0]["text"] == "3456789abc"
    job.record = record("a", "failed", duration_s=2.0, error=RunError("E", "boom"))
    job.push()
    assert "data-status='failed'" in job.widget.children[0].value and "E: boom" in job.widget.children[0].value


def test_live_summary_refreshes_until_final_then_stops(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ipywidgets")
    shown: list = []
    monkeypatch.setattr(widget_display, "display_mode", lambda: "widgets")
    monkeypatch.setattr(widget_display, "show", shown.append)
    share = FileShare(project / "results")
    write_record(share, record("a", "running"))
    write_record(share, record("b", "queued"))
    summary = widgets.print_jobs_summary("exp", share=str(project / "results"), interval=0.05)
    assert len(shown) == 1 and summary.refresher is not None and summary.refresher.running
    assert "data-status='running'" in summary.table.value
    bundle = shown[0]._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "exp: 2 runs" in bundle["text/plain"]
    write_record(share, record("a", "succeeded"))
    write_record(share, record("b", "running"))
    # both new states seen (a refresh may fall between the two writes) before b ends
    wait_until(lambda: "data-run='a' data-status='succeeded'" in summary.table.value
               and "data-run='b' data-status='running'" in summary.table.value, 10, "runs a's and b's new statuses")
    assert summary.refresher.running
    write_record(share, record("b", "succeeded"))
    assert summary.wait(timeout=5)  # the thread ended by itself
    assert "data-state='final'" in summary.table.value and summary.actions.layout.display == "none"
    assert ("b", "queued", "running") in summary.model.transitions


# --------------------------------------------------------------------------------------------------
# text mode, for real: a tiny notebook executed in the python3 kernel


TINY = ("EPOCHS = 1\nLR = 0.01\nSECONDS = 0.2\n",
        "import time\nimport nbbatch\nfor epoch in range(EPOCHS):\n    print(f'epoch {epoch + 1}/{EPOCHS}', flush=True)\n"
        "    time.sleep(SECONDS)\nnbbatch.record(accuracy=0.9 - LR)\n")


def tiny_notebook(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(TINY[0], metadata={"tags": ["parameters"]}), nbformat.v4.new_code_cell(TINY[1])]
    path = folder / "Tiny.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.kernel
def test_text_mode_flow_submits_waits_and_prints_tables(project: Path, capsys: pytest.CaptureFixture) -> None:
    tiny_notebook(project)
    spec = Experiment.from_dict({"experiment": "textflow", "notebooks": ["Tiny.ipynb"],
                                 "sweep": {"grid": {"LR": [0.01, 0.1]}}}, base_dir=project)
    cluster = widgets.setup_cluster("local", max_parallel=2)
    submission = widgets.submit_all(spec, cluster, epochs=2)
    run_ids = submission.planned_runs(timeout=60)
    assert len(run_ids) == 2 and all(r.startswith("tiny-") for r in run_ids)
    job = widgets.wait_for_job("textflow", run_ids[0])
    assert job.record is not None and job.record.status == "succeeded"
    result = submission.wait(timeout=120)
    assert result is not None and result.ok
    summary = widgets.print_jobs_summary("textflow")
    assert summary.model.all_final and summary.refresher is None and summary.widget is None
    out = capsys.readouterr().out
    assert "submitting textflow to the local backend" in out
    assert "epoch 2/2" in out  # the followed log, EPOCHS overridden by epochs=2
    assert f"{run_ids[1]}: succeeded" in out
    assert "textflow: 2 runs — 2 succeeded" in out
    assert out.count("results/textflow/tiny-") == 2  # the notebook column
    assert widgets.cancel_all("textflow") == []
    links = widgets.open_notebook("textflow", run_ids[0])
    assert links.path == project / "results" / "textflow" / run_ids[0] / "output.ipynb"
    written = widgets.download_files("textflow", dest=project / "downloads", names=["output.ipynb"])
    assert sorted(p.parent.name for p in written) == sorted(run_ids)


@pytest.mark.kernel
def test_widget_mode_progress_bar_fills_as_runs_finish(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ipywidgets")
    monkeypatch.setattr(widget_display, "display_mode", lambda: "widgets")
    monkeypatch.setattr(widget_display, "show", lambda obj: None)
    tiny_notebook(project)
    spec = Experiment.from_dict({"experiment": "bar", "notebooks": ["Tiny.ipynb"],
                                 "sweep": {"grid": {"LR": [0.01, 0.1]}}}, base_dir=project)
    submission = widgets.submit_all(spec)
    assert submission.wait(timeout=120).ok
    label, bar, _details = submission.widget.children
    assert (bar.value, bar.max, bar.bar_style) == (2, 2, "success")
    assert "bar: done, 2/2 finished — 2 succeeded" in label.value
    again = widgets.submit_all(spec)  # everything succeeded already: skipped, still a full bar
    assert again.wait(timeout=120).skipped and again.widget.children[1].value == 2


def test_text_mode_reports_a_plan_error_from_the_background_thread(project: Path) -> None:
    tiny_notebook(project)
    spec = Experiment.from_dict({"experiment": "bad", "notebooks": ["Tiny.ipynb"]}, base_dir=project)
    submission = widgets.submit_all(spec, EPCHS=3)
    with pytest.raises(NbbatchError, match="parameter `EPCHS` is not in Tiny.ipynb's parameters cell"):
        submission.wait(timeout=60)
    assert submission.model.state == "error"


def test_print_jobs_summary_without_runs_says_how_to_submit(project: Path, capsys: pytest.CaptureFixture) -> None:
    summary = widgets.print_jobs_summary("nothing")
    out = capsys.readouterr().out
    assert out.startswith("nothing: 0 runs — no runs yet")
    assert "submit it with submit_all()" in out
    assert not summary.model.all_final


def test_a_failed_runs_tooltip_has_its_traceback_and_a_cancel_its_one_line() -> None:
    model = JobsSummaryModel("exp")
    model.update(record("b", "failed", error=RunError("ValueError", "bad", cell_index=5, cell_source="x = 1",
                                                      traceback="Cell In[4], line 2\n----> 2 raise ValueError('bad')")))
    model.update(record("c", "cancelled", error=RunError("cancelled", "", kind="cancelled", stopped_by="`nbbatch cancel`",
                                                         reason="cancelled before it started")))
    page = model.to_html()
    assert "title='cell 5 (&#34;x = 1&#34;): ValueError: bad\n\nCell In[4], line 2\n----&gt; 2 raise ValueError(" in page
    assert "cancelled by `nbbatch cancel` (before it started)" in page and "traceback" not in page
