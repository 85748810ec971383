"""Every framework notebook, executed by papermill in its own kernel at its defaults, learns the digits.

Slow: needs the framework environments (built once per session by the ``framework_envs`` fixture
of tests/conftest_frameworks.py). The defaults train on scikit-learn's bundled digits, so no data is
downloaded; each notebook records its metrics with ``nbbatch.record``, read back here from the
executed notebook, and one point of its history per epoch (``nbbatch.record(step=epoch, loss=...,
train_accuracy=...)``; the points of one cell update one output, so the executed notebook holds the last).
"""

from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import nbformat
import papermill
import pytest
from conftest_frameworks import selected_frameworks

from nbbatch.record import HISTORY_MIME, METRICS_MIME, metrics_from_notebook

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = selected_frameworks(p.name for p in (ROOT / "frameworks").iterdir() if (p / "framework.yaml").exists())
MIN_ACCURACY = 0.9


def default_parameter(nb, name: str):
    """The value the notebook's ``parameters`` cell gives ``name`` (a literal)."""
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"the parameters cell does not set {name}")


def recorded(nb, mime: str) -> list[dict]:
    """What the notebook's outputs hold under ``mime``, in order."""
    return [out["data"][mime] for cell in nb.cells for out in cell.get("outputs", []) or []
            if mime in (out.get("data") or {})]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def kernel_environment(monkeypatch, home: Path) -> None:
    """Keep what frameworks write at import (``~/.keras``, caches) out of the user's home."""
    monkeypatch.setenv("KERAS_HOME", str(home / "keras"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("MPLCONFIGDIR", str(home / "matplotlib"))


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_notebook_reaches_accuracy_on_digits(framework, framework_envs, tmp_path, monkeypatch, record_property):
    fw = framework_envs.framework(framework)
    kernel_environment(monkeypatch, tmp_path)
    output = tmp_path / f"{fw.notebook.stem}.out.ipynb"
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(fw.notebook), str(output), kernel_name=fw.kernel_name, cwd=str(tmp_path),
            progress_bar=False, log_output=False,
        )
    except papermill.PapermillExecutionError as exc:
        pytest.fail(f"{fw.notebook.name} failed in cell {exc.exec_count}: {exc.ename}: {exc.evalue}")
    seconds = time.perf_counter() - start
    executed = nbformat.read(output, as_version=4)
    metrics = metrics_from_notebook(executed)
    record_property("notebook_seconds", round(seconds, 1))
    record_property("metrics", metrics)
    assert {"accuracy", "train_seconds", "images_per_second", "framework", "framework_version", "device"} <= set(metrics)
    assert metrics["device"] == "cpu"
    assert metrics["accuracy"] >= MIN_ACCURACY, (
        f"{fw.notebook.name} reached only {metrics['accuracy']:.3f} test accuracy on digits "
        f"(train {metrics['train_seconds']:.1f} s, notebook {seconds:.0f} s)"
    )

    # The history: one point per epoch, numbered from 1; the last epoch's point is in the outputs.
    epochs = default_parameter(executed, "EPOCHS")
    points = recorded(executed, HISTORY_MIME)
    last = next((p for p in points if p.get("step") == epochs), None)
    record_property("last_history_point", last)
    assert last is not None, f"{fw.notebook.name} recorded no history point with step={epochs} (EPOCHS): {points}"
    assert is_number(last.get("loss")) and last["loss"] > 0, f"loss of the last epoch: {last}"
    assert is_number(last.get("train_accuracy")) and 0 <= last["train_accuracy"] <= 1, f"last epoch: {last}"
    # The test accuracy is the run's accuracy (the history has its own name for the training accuracy).
    assert metrics["accuracy"] == recorded(executed, METRICS_MIME)[-1]["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_gpu_true_without_a_gpu_fails_loudly(framework, framework_envs, tmp_path, monkeypatch):
    """Where the environment has no GPU, GPU=True stops with a clear error instead of using the CPU."""
    fw = framework_envs.framework(framework)
    kernel_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, also on a machine that has one
    output = tmp_path / "gpu.out.ipynb"
    with pytest.raises(papermill.PapermillExecutionError) as failed:
        papermill.execute_notebook(
            str(fw.notebook), str(output), kernel_name=fw.kernel_name, cwd=str(tmp_path),
            parameters={"GPU": True, "MAX_SAMPLES": 64, "EPOCHS": 1}, progress_bar=False, log_output=False,
        )
    assert failed.value.ename == "RuntimeError"
    assert "GPU=True" in failed.value.evalue
    assert not metrics_from_notebook(nbformat.read(output, as_version=4)), "no metrics may be recorded"
