"""Every framework notebook, executed by papermill in its own kernel at its defaults, learns the digits.

Slow: needs the framework environments (built once per session by the ``framework_envs`` fixture
of tests/support/frameworks.py). The defaults train on scikit-learn's bundled digits, so no data is
downloaded; each notebook records its metrics with ``nbbatch.record``, read back here from the
executed notebook, and one point of its history per epoch (``nbbatch.record(step=epoch, loss=...,
train_accuracy=...)``; the points of one cell update one output, so the executed notebook holds the last).

Each notebook saves its trained model into ``NBBATCH_OUTPUT_DIR`` (``nbbatch.artifacts.output_dir()``), and five of
them checkpoint every epoch into ``NBBATCH_CHECKPOINT_DIR`` and resume from it: papermill starts the kernel with
this process's environment, so the tests set both variables as nbbatch does for a run. The accuracy run of those
five is the first attempt that two later attempts resume from.

The JAX notebooks (JAX + Flax, Keras on JAX) train data parallel over all the devices of their process when there are
several: ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` in the kernel's environment splits the CPU into two
devices, and one kernel takes that path (several processes, one per rank, are nbbatch's to start: tests/test_distributed.py).
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from pathlib import Path

import nbformat
import papermill
import pytest
from support.frameworks import one_thread_each, selected_frameworks

from nbbatch.metrics import HISTORY_MIME, METRICS_MIME, metrics_from_notebook

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = selected_frameworks(p.name for p in (ROOT / "frameworks").iterdir() if (p / "framework.yaml").exists())
MIN_ACCURACY = 0.9
# What each notebook saves in output_dir(), in its framework's own format (a path relative to output_dir()).
MODEL_FILES = {
    "chainer": "model.npz",  # chainer.serializers.save_npz
    "gluon": "model.params",  # HybridSequential.save_parameters
    "jax-flax": "model.msgpack",  # flax.serialization.to_bytes of the parameters
    "keras-jax": "model.keras",
    "keras-tf": "model.keras",
    "lightning": "model.ckpt",  # Trainer.save_checkpoint(weights_only=True)
    "mxnet": "model.params",  # Module.save_params
    "pytorch": "model.pt",  # the state_dict
    "tensorflow": "saved_model/saved_model.pb",  # a SavedModel folder
}
# The notebooks that checkpoint every epoch into checkpoint_dir() and resume from there.
CHECKPOINTING = [name for name in FRAMEWORKS if name in {"jax-flax", "keras-jax", "keras-tf", "lightning", "pytorch"}]
# The notebooks whose one process trains data parallel over all the devices it sees (a mesh, keras.distribution).
MULTI_DEVICE = [name for name in FRAMEWORKS if name in {"jax-flax", "keras-jax"}]
# What nbbatch sets for the ranks of a distributed run (as torchrun does, plus JAX's and TensorFlow's own).
DISTRIBUTED_ENV = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                   "JAX_COORDINATOR_ADDRESS", "TF_CONFIG"]


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
    """Keep what frameworks write at import (``~/.keras``, caches) out of the user's home, and the notebook's
    outputs (its model) in ``home/outputs``; no checkpoints unless a test asks for them. One thread per kernel
    (:func:`support.frameworks.one_thread_each`): several kernels share CI's two cores."""
    for name, value in one_thread_each().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KERAS_HOME", str(home / "keras"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("MPLCONFIGDIR", str(home / "matplotlib"))
    monkeypatch.setenv("NBBATCH_OUTPUT_DIR", str(home / "outputs"))
    monkeypatch.delenv("NBBATCH_CHECKPOINT_DIR", raising=False)
    for name in DISTRIBUTED_ENV:  # one process, as a run that is not distributed
        monkeypatch.delenv(name, raising=False)


def run_notebook(fw, folder: Path, name: str, **parameters):
    """Execute ``fw``'s notebook with papermill in ``folder`` (its working directory); the executed notebook."""
    output = folder / f"{name}.out.ipynb"
    try:
        papermill.execute_notebook(
            str(fw.notebook), str(output), kernel_name=fw.kernel_name, cwd=str(folder), parameters=parameters,
            progress_bar=False, log_output=False,
        )
    except papermill.PapermillExecutionError as exc:
        pytest.fail(f"{fw.notebook.name} failed in cell {exc.exec_count}: {exc.ename}: {exc.evalue}")
    return nbformat.read(output, as_version=4)


def printed(nb) -> str:
    """What the notebook's cells printed (their stream outputs), in order."""
    return "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []) or []
                   if out.get("output_type") == "stream")


def partial_files(folder: Path) -> list[str]:
    """Names in ``folder`` that ``atomic_path`` leaves only when a write did not finish (hidden ``.<stem>.*.part*``)."""
    return [p.name for p in folder.iterdir() if p.name.startswith(".") and ".part" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_notebook_reaches_accuracy_on_digits(framework, framework_envs, tmp_path, monkeypatch, record_property):
    """At its defaults the notebook learns the digits, records its history and saves its model; its sanity cells
    print nothing (what nbval's ``nbval-check-output`` tag asks). The five that checkpoint do so every epoch, as
    under nbbatch, and later attempts resume from there (:func:`check_later_attempts_resume`)."""
    fw = framework_envs.framework(framework)
    kernel_environment(monkeypatch, tmp_path)
    checkpoints = tmp_path / "checkpoints"
    if framework in CHECKPOINTING:
        monkeypatch.setenv("NBBATCH_CHECKPOINT_DIR", str(checkpoints))
    start = time.perf_counter()
    executed = run_notebook(fw, tmp_path, fw.notebook.stem)
    seconds = time.perf_counter() - start
    metrics = metrics_from_notebook(executed)
    record_property("notebook_seconds", round(seconds, 1))
    record_property("metrics", json.loads(json.dumps(metrics)))  # plain values: pytest-xdist sends them between processes
    assert {"accuracy", "train_seconds", "images_per_second", "framework", "framework_version", "device"} <= set(metrics)
    assert metrics["device"] == "cpu"
    assert metrics["accuracy"] >= MIN_ACCURACY, (
        f"{fw.notebook.name} reached only {metrics['accuracy']:.3f} test accuracy on digits "
        f"(train {metrics['train_seconds']:.1f} s, notebook {seconds:.0f} s)"
    )
    noisy = [i for i, cell in enumerate(executed.cells)
             if "nbval-check-output" in cell.metadata.get("tags", []) and cell.get("outputs")]
    assert not noisy, f"{fw.notebook.name}: the silent sanity cells {noisy} printed {executed.cells[noisy[0]].outputs}"

    # The history: one point per epoch, numbered from 1; the last epoch's point is in the outputs.
    epochs = default_parameter(executed, "EPOCHS")
    points = recorded(executed, HISTORY_MIME)
    last = next((p for p in points if p.get("step") == epochs), None)
    record_property("last_history_point", json.loads(json.dumps(last)))
    assert last is not None, f"{fw.notebook.name} recorded no history point with step={epochs} (EPOCHS): {points}"
    assert is_number(last.get("loss")) and last["loss"] > 0, f"loss of the last epoch: {last}"
    assert is_number(last.get("train_accuracy")) and 0 <= last["train_accuracy"] <= 1, f"last epoch: {last}"
    # The test accuracy is the run's accuracy (the history has its own name for the training accuracy).
    assert metrics["accuracy"] == recorded(executed, METRICS_MIME)[-1]["accuracy"]
    assert "resumed_from_epoch" not in metrics, "nothing to resume from on a first attempt"
    assert "resuming from epoch" not in printed(executed)

    # The trained model, in the framework's own format, in NBBATCH_OUTPUT_DIR (and nothing half-written beside it).
    outputs = tmp_path / "outputs"
    model = outputs / MODEL_FILES[framework]
    assert model.is_file() and model.stat().st_size > 0, f"{fw.notebook.name} saved no {model.relative_to(tmp_path)}"
    assert not partial_files(outputs)
    if framework in CHECKPOINTING:
        check_later_attempts_resume(fw, tmp_path, checkpoints, epochs)


def check_later_attempts_resume(fw, folder: Path, checkpoints: Path, done: int) -> None:
    """A later attempt of a run finds the checkpoint of the one before and trains only the epochs left.

    As nbbatch does across the attempts of one run, the executions share NBBATCH_CHECKPOINT_DIR: after the first
    (``done`` epochs, at the defaults), one more epoch (resumes after ``done``, trains only the last), then the same
    again (all done, as when the kernel died during the evaluation: no training, the evaluation and the record still).
    A quick data set for these two: what is resumed is the model, the optimizer and the epochs' count and times.
    """
    assert any(checkpoints.iterdir()), f"{fw.notebook.name} wrote no checkpoint into NBBATCH_CHECKPOINT_DIR"
    assert not partial_files(checkpoints)
    epochs, quick = done + 1, {"MAX_SAMPLES": 256}

    second = run_notebook(fw, folder, "second", EPOCHS=epochs, **quick)
    metrics = metrics_from_notebook(second)
    assert metrics.get("resumed_from_epoch") == done, metrics
    assert f"resuming from epoch {done} (checkpoint " in printed(second)
    steps = {point["step"] for point in recorded(second, HISTORY_MIME)}
    assert steps == {epochs}, f"history points of the resumed run: {steps}"
    assert re.search(rf"(?i)\bepoch {epochs}/{epochs}\b", printed(second)), "the last epoch was trained"
    assert not re.search(rf"(?i)\bepoch {done}/{epochs}\b", printed(second)), "an epoch done was trained again"
    assert metrics["train_seconds"] > 0 and metrics["images_per_second"] > 0
    assert not partial_files(checkpoints)

    # All epochs done: the checkpoint the second attempt left holds the last epoch; training is skipped, the rest runs.
    third = run_notebook(fw, folder, "third", EPOCHS=epochs, **quick)
    resumed = metrics_from_notebook(third)
    assert resumed.get("resumed_from_epoch") == epochs, resumed
    assert not recorded(third, HISTORY_MIME), "no epoch is left to train"
    assert is_number(resumed.get("accuracy")) and 0 <= resumed["accuracy"] <= 1, resumed
    assert resumed["train_seconds"] > 0 and resumed["images_per_second"] > 0, resumed
    assert resumed["train_seconds"] == pytest.approx(metrics["train_seconds"]), "the times of the epochs, as saved"


@pytest.mark.slow
@pytest.mark.parametrize("framework", MULTI_DEVICE)
def test_notebook_trains_data_parallel_over_two_devices(framework, framework_envs, tmp_path, monkeypatch):
    """One kernel that sees two devices trains on both: each batch split over them, the same weights on each.

    XLA_FLAGS in the kernel's environment makes JAX see the CPU as two devices; BATCHSIZE is per device, so the steps
    take 32 images. The notebook records how many devices trained together and a checksum of its weights before and
    after training (nbbatch's distributed tests compare the checksums of the ranks), and saves the model once.
    """
    fw = framework_envs.framework(framework)
    kernel_environment(monkeypatch, tmp_path)
    # JAX's asynchronous dispatch on the CPU can leave the two devices' all-reduces waiting on each other for good
    # (jax-ml/jax#25861; CI hung here once): run each step to its end before the next. With that alone, CI's kernel
    # still died once, the way XLA's terminate timeout below ends a stuck rendezvous: on a loaded 2-core machine the
    # devices' shared Eigen thread pool can wedge (PyAutoLabs/PyAutoFit#1530 measured 14 hangs in 16 with it, none in
    # 12 without), so the devices' ops run single-threaded here. If a rendezvous still waits, XLA gives up after 300 s
    # with its own message rather than at pytest's timeout.
    monkeypatch.setenv("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
    monkeypatch.setenv("XLA_FLAGS", f"{one_thread_each()['XLA_FLAGS']} --xla_force_host_platform_device_count=2 "
                       "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=300")
    executed = run_notebook(fw, tmp_path, "two-devices", MAX_SAMPLES=512, EPOCHS=2, BATCHSIZE=16)
    metrics = metrics_from_notebook(executed)
    assert "data parallel over 2 devices in 1 process" in printed(executed)
    assert metrics.get("world_size") == 2 and metrics.get("processes") == 1, metrics
    assert is_number(metrics.get("weights_checksum")) and is_number(metrics.get("initial_weights_checksum")), metrics
    assert metrics["weights_checksum"] != metrics["initial_weights_checksum"], "the weights did not train"
    assert metrics["accuracy"] >= 0.7, f"{fw.notebook.name} on two devices reached only {metrics['accuracy']:.3f}"
    assert metrics["train_seconds"] > 0 and metrics["images_per_second"] > 0, metrics
    last = next((p for p in recorded(executed, HISTORY_MIME) if p.get("step") == 2), None)
    assert last is not None and is_number(last.get("loss")), "the history's last epoch"
    outputs = tmp_path / "outputs"
    model = outputs / MODEL_FILES[framework]
    assert model.is_file() and model.stat().st_size > 0, f"{fw.notebook.name} saved no {model.relative_to(tmp_path)}"
    assert not partial_files(outputs)


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
