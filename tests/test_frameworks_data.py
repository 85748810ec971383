"""The nine framework folders and their notebooks agree with each other (no environment needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

from nbbatch.spec.frameworks import list_frameworks
from nbbatch.spec.project import Project

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {
    "pytorch": "PyTorch_CIFAR.ipynb",
    "lightning": "Lightning_CIFAR.ipynb",
    "tensorflow": "Tensorflow_CIFAR.ipynb",
    "keras-tf": "Keras_TF_CIFAR.ipynb",
    "keras-jax": "Keras_JAX_CIFAR.ipynb",
    "jax-flax": "JAX_Flax_CIFAR.ipynb",
    "mxnet": "MXNet_CIFAR.ipynb",
    "gluon": "Gluon_CIFAR.ipynb",
    "chainer": "Chainer_CIFAR.ipynb",
}
PARAMETER_NAMES = ["EPOCHS", "N_CLASSES", "BATCHSIZE", "LR", "MOMENTUM", "GPU", "SEED", "DATASET", "DATA_DIR",
                   "MAX_SAMPLES"]


@pytest.fixture(scope="module")
def frameworks():
    with pytest.MonkeyPatch.context() as patch:  # the repository's own frameworks/, whatever the environment says
        patch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
        return list_frameworks(Project(ROOT))


def _read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "notebooks" / EXPECTED[name], as_version=4)


def _parameters_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"expected exactly one cell tagged `parameters`, found {len(tagged)}"
    return tagged[0]


def test_all_nine_frameworks_load(frameworks):
    assert set(EXPECTED) <= set(frameworks), f"missing: {sorted(set(EXPECTED) - set(frameworks))}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_framework_points_at_its_notebook(frameworks, name):
    fw = frameworks[name]
    assert fw.notebook == (ROOT / "notebooks" / EXPECTED[name]).resolve()
    assert fw.notebook.exists()
    assert fw.kernel_name == f"nbbatch-{name}"
    assert fw.image and fw.base_image, "framework.yaml should name its image and the image's base"
    assert fw.description


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_requirements_are_exact_pins_with_numpy_and_scikit_learn(frameworks, name):
    pins = frameworks[name].pinned()
    for line in pins:
        assert "==" in line and not any(op in line for op in (">", "<", "~=", "!=")), f"{name}: `{line}` is not an exact pin"
    names = {line.split("==")[0].strip().lower() for line in pins}
    assert {"numpy", "scikit-learn"} <= names, f"{name} must pin numpy and scikit-learn explicitly"


def test_parameters_cell_is_identical_in_all_nine():
    sources = {name: _parameters_cell(_read(name)).source for name in EXPECTED}
    reference = sources["pytorch"]
    different = [name for name, source in sources.items() if source != reference]
    assert not different, f"parameters cell differs from PyTorch_CIFAR.ipynb's in: {different}"


def test_parameters_cell_holds_the_shared_parameters_as_literals():
    tree = ast.parse(_parameters_cell(_read("pytorch")).source)
    values = {}
    for node in tree.body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, "only plain assignments"
        values[node.targets[0].id] = ast.literal_eval(node.value)
    assert list(values) == PARAMETER_NAMES
    assert values["GPU"] is False
    assert values["N_CLASSES"] == 10
    assert values["DATASET"] == "digits" and values["DATA_DIR"] == "data" and values["MAX_SAMPLES"] is None
    assert isinstance(values["EPOCHS"], int) and isinstance(values["BATCHSIZE"], int)
    assert isinstance(values["LR"], float) and isinstance(values["MOMENTUM"], float)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_metadata_names_its_kernel(name):
    nb = _read(name)
    assert nb.metadata["kernelspec"]["name"] == f"nbbatch-{name}"
    assert nb.metadata["kernelspec"]["language"] == "python"
    assert nb.metadata["language_info"]["name"] == "python"
    nbformat.validate(nb)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_is_committed_without_outputs(name):
    for cell in _read(name).cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "clear the outputs before committing"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_records_metrics_and_has_nbval_checks(name):
    nb = _read(name)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "nbbatch.record(" in code
    assert "record(step=" in code and "train_accuracy=" in code, f"{name} must record loss and train_accuracy every epoch"
    for metric in ("accuracy=", "train_seconds=", "images_per_second=", "framework=", "framework_version=",
                   "device="):
        assert metric in code, f"{name} does not record {metric.rstrip('=')}"
    assert "load_dataset(DATASET, DATA_DIR" in code
    assert "if GPU" in code and "raise RuntimeError" in code, "GPU=True must fail loudly where there is no GPU"
    checked = [c for c in nb.cells if "nbval-check-output" in c.get("metadata", {}).get("tags", [])]
    assert checked, "mark the cells whose (empty) output nbval must check"
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= 6, "explain each step in markdown"
