"""Inputs, outputs and checkpoints of runs: bound, listed, kept across attempts, fetched (real kernels, local share)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import nbformat
import pytest
from support.machine import REPO
from support.notebooks import make_notebook
from support.processes import kernels_of

from nbbatch.api import submit
from nbbatch.errors import SpecError, ValidationError
from nbbatch.store.fetch import fetch
from nbbatch.store.runjson import AttemptEntry, InputBinding
from nbbatch.store.share import FileShare
from nbbatch.store.sync import FileEntry

pytestmark = pytest.mark.timeout(180)

# A stand-in for training: 5 epochs, a checkpoint after each (written atomically), the model saved at the end.
# The first attempt kills its own kernel after epoch 3, as an OOM kill or a lost node would.
TRAIN = """\
import json, os, signal
from nbbatch import record
from nbbatch.artifacts import atomic_path, checkpoint_path, output_dir
ckpt = checkpoint_path('state.json')
state = json.loads(ckpt.read_text()) if ckpt is not None and ckpt.exists() else {'epoch': 0, 'weights': 0}
if state['epoch']:
    print(f"resuming from epoch {state['epoch']}")
    record(resumed_from_epoch=state['epoch'])
trained = 0
for epoch in range(state['epoch'], EPOCHS):
    state = {'epoch': epoch + 1, 'weights': state['weights'] + epoch + 1}
    trained += 1
    with atomic_path(ckpt) as tmp:
        tmp.write_text(json.dumps(state))
    if epoch + 1 == KILL_AFTER and not os.path.exists('killed-once'):  # beside the notebook: not a checkpoint
        open('killed-once', 'w').close()
        os.kill(os.getpid(), signal.SIGKILL)
with atomic_path(output_dir() / 'model.json') as tmp:
    tmp.write_text(json.dumps({'weights': state['weights']}))
(output_dir() / 'figures').mkdir(exist_ok=True)
(output_dir() / 'figures' / 'curve.txt').write_text('1 2 3')
record(weights=state['weights'], epochs_this_attempt=trained)
"""


def _train_notebook(project):
    return make_notebook(project / "train.ipynb", [TRAIN], parameters="EPOCHS = 5\nKILL_AFTER = 3")


def _run_folder(project, experiment, record):
    return project / "results" / experiment / record.run_id


@pytest.mark.kernel
def test_a_killed_kernel_resumes_from_its_checkpoint_and_the_outputs_land(project, write_experiment, tmp_path):
    _train_notebook(project)
    exp = write_experiment("experiment: resume\nnotebooks: [train.ipynb]\nretries: 1\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded" and record.attempts == 2
    # the second attempt went on from epoch 3: two epochs, and the same weights as an uninterrupted run
    assert record.metrics["resumed_from_epoch"] == 3 and record.metrics["epochs_this_attempt"] == 2
    assert record.metrics["weights"] == 1 + 2 + 3 + 4 + 5
    first, second = record.attempt_log
    assert first.status == "failed" and first.kind == "kernel_died" and first.resumed_from is None
    assert second.status == "succeeded" and second.resumed_from.latest == "state.json"
    folder = _run_folder(project, "resume", record)
    log = (folder / "log.txt").read_text()
    assert "attempt 2" in log and "resuming from state.json" in log and "resuming from epoch 3" in log
    assert not (folder / "checkpoints").exists()  # a run that succeeded needs them no more
    # outputs: on the share, listed in run.json with their size and checksum
    model = folder / "outputs" / "model.json"
    listed = {entry.name: entry for entry in record.outputs}
    assert set(listed) == {"model.json", "figures/curve.txt"}
    assert listed["model.json"] == FileEntry(name="model.json", bytes=model.stat().st_size,
                                             sha256=hashlib.sha256(model.read_bytes()).hexdigest())
    assert json.loads((folder / "run.json").read_text())["outputs"] == [e.to_dict() for e in record.outputs]
    # `nbbatch fetch` brings them (the checkpoints stay on the share)
    dest = tmp_path / "fetched"
    fetch(FileShare(project / "results"), "resume", dest)
    assert json.loads((dest / "resume" / record.run_id / "outputs" / "model.json").read_text()) == {"weights": 15}
    assert (dest / "resume" / record.run_id / "outputs" / "figures" / "curve.txt").read_text() == "1 2 3"
    assert not (dest / "resume" / record.run_id / "checkpoints").exists()
    assert kernels_of("resume") == []


@pytest.mark.kernel
def test_a_cell_error_is_never_retried_and_a_resubmission_resumes(project, write_experiment):
    make_notebook(project / "nb.ipynb", [
        "from nbbatch.artifacts import checkpoint_path\np = checkpoint_path('n')\n"
        "n = int(p.read_text()) if p.exists() else 0\np.write_text(str(n + 1))\nprint('attempt number', n + 1)",
        "assert n >= 1, 'fails the first time'",
    ])
    exp = write_experiment("experiment: again\nnotebooks: [nb.ipynb]\nretries: 3\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "failed" and record.attempts == 1  # a notebook's exception is not retried
    assert record.attempt_log[0].kind == "cell_error"
    (record,) = submit(exp, progress=False).records  # a failed run resubmitted continues from its checkpoints
    assert record.status == "succeeded" and record.attempt_log[0].resumed_from.latest == "n"
    (record,) = submit(exp, progress=False, force=True).records  # forced: from scratch again
    assert record.status == "failed" and record.attempt_log[0].resumed_from is None


@pytest.mark.kernel
def test_an_input_folder_is_bound_to_its_parameter(project, write_experiment, capsys):
    (project / "data").mkdir()
    (project / "data" / "x.txt").write_text("41")
    make_notebook(project / "nb.ipynb", ["import os, nbbatch\n"
                                         "x = int(open(os.path.join(DATA_DIR, 'x.txt')).read())\n"
                                         "nbbatch.record(x=x + 1, where=DATA_DIR)"], parameters="DATA_DIR = 'nowhere'")
    exp = write_experiment("experiment: inp\nnotebooks: [nb.ipynb]\ninputs: {DATA_DIR: ./data}\n")
    from nbbatch.ui.cli import main

    assert main(["plan", str(exp)]) == 0
    assert f"input DATA_DIR ← {project / 'data'}" in capsys.readouterr().out
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded" and record.metrics["x"] == 42
    assert record.metrics["where"] == str(project / "data")
    assert record.inputs == {"DATA_DIR": InputBinding(source=str(project / "data"), path=str(project / "data"))}
    nb = nbformat.read(_run_folder(project, "inp", record) / "output.ipynb", as_version=4)
    assert nb.metadata.papermill.parameters == {"DATA_DIR": str(project / "data")}


def test_a_missing_input_is_refused_before_anything_runs(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["print(DATA_DIR)"], parameters="DATA_DIR = 'data'")
    exp = write_experiment("experiment: miss\nnotebooks: [nb.ipynb]\ninputs: {DATA_DIR: ./data}\n")
    with pytest.raises(ValidationError, match=r"input `DATA_DIR`: there is no folder .*data.*make data"):
        submit(exp, progress=False)
    assert not (project / "results" / "miss").exists()
    (project / "data").write_text("a file")
    with pytest.raises(ValidationError, match="is a file, not a folder"):
        submit(exp, progress=False)


def test_an_input_that_is_not_a_parameter_or_is_also_one_is_refused(project, write_experiment):
    (project / "data").mkdir()
    make_notebook(project / "nb.ipynb", ["print(1)"], parameters="DATA_DIR = 'data'")
    exp = write_experiment("experiment: bad\nnotebooks: [nb.ipynb]\ninputs: {DATA_DIRS: ./data}\n")
    with pytest.raises(ValidationError, match="parameter `DATA_DIRS` is not in nb.ipynb's parameters cell.*DATA_DIR"):
        submit(exp, progress=False)
    exp = write_experiment("experiment: bad\nnotebooks: [nb.ipynb]\ninputs: {DATA_DIR: ./data}\n"
                           "parameters: {DATA_DIR: other}\n")
    with pytest.raises(SpecError, match="`DATA_DIR` is both an input and a parameter"):
        submit(exp, progress=False)


def test_inputs_enter_the_run_id_by_their_place_in_the_project(project, write_experiment):
    from nbbatch.plan.runs import plan
    from nbbatch.spec.experiment import load_experiment

    for name in ("a", "b"):
        (project / name).mkdir()
    make_notebook(project / "nb.ipynb", ["print(1)"], parameters="DATA_DIR = 'data'")
    plain = plan(load_experiment(write_experiment("experiment: ids\nnotebooks: [nb.ipynb]\n"))).runs[0].run_id
    with_a = plan(load_experiment(write_experiment("experiment: ids\nnotebooks: [nb.ipynb]\ninputs: {DATA_DIR: a}\n")))
    with_b = plan(load_experiment(write_experiment("experiment: ids\nnotebooks: [nb.ipynb]\ninputs: {DATA_DIR: b}\n")))
    assert len({plain, with_a.runs[0].run_id, with_b.runs[0].run_id}) == 3
    assert with_a.runs[0].inputs == {"DATA_DIR": str(project / "a")}


@pytest.mark.azure  # the Azure Files share needs the azure extra
@pytest.mark.kernel
def test_on_a_remote_share_a_lost_attempt_resumes_and_inputs_and_outputs_travel(project, monkeypatch, tmp_path):
    """An Azure File share (the fake): the run's node was lost mid-run (its record says running); the attempt that
    starts again pulls the checkpoints, pulls the input from its share URL, and uploads the outputs at the end."""
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    from nbbatch.execute.attempts import AttemptContext, execute_run
    from nbbatch.plan.runs import Run
    from nbbatch.store.azfiles import AzureFileShare
    from nbbatch.store.runfiles import write_record
    from nbbatch.store.runjson import RunRecord
    from nbbatch.store.sync import push

    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        share = AzureFileShare(f"azfiles://{ACCOUNT}/results")
        data = tmp_path / "data"
        data.mkdir()
        (data / "x.txt").write_text("41")
        push(data, AzureFileShare(f"azfiles://{ACCOUNT}/datasets/digits"))
        notebook = make_notebook(project / "train.ipynb", [
            TRAIN, "import os\nrecord(x=int(open(os.path.join(DATA_DIR, 'x.txt')).read()) + 1)",
            "assert not FAIL_AT_END, 'fails after training'"],
            parameters="EPOCHS = 5\nKILL_AFTER = 0\nDATA_DIR = 'data'\nFAIL_AT_END = False")
        run = Run(run_id="train-remote", experiment="far", notebook=str(notebook), notebook_rel="train.ipynb",
                  kernel="python3", inputs={"DATA_DIR": f"azfiles://{ACCOUNT}/datasets/digits"})
        # what the lost node left: a running record of attempt 1, and its checkpoint of epoch 2 on the share
        write_record(share, RunRecord(run_id=run.run_id, experiment="far", notebook="train.ipynb", kernel="python3",
                                      status="running", attempts=1, host="lost-node", started_at="2026-01-01T00:00:00"))
        share.write_bytes("far/train-remote/checkpoints/state.json", json.dumps({"epoch": 2, "weights": 3}).encode())
        record = execute_run(run, share, AttemptContext(project_root=project, backend="azureml"))
        assert record.status == "succeeded", record.error
        assert record.metrics["resumed_from_epoch"] == 2 and record.metrics["weights"] == 15
        assert record.metrics["x"] == 42  # the input, pulled from its share into the project's cache
        assert record.inputs["DATA_DIR"].source == f"azfiles://{ACCOUNT}/datasets/digits"
        assert not share.exists("far/train-remote/checkpoints")  # removed once the run succeeded
        lost, resumed = record.attempt_log
        assert lost == AttemptEntry(attempt=1, host="lost-node", started_at="2026-01-01T00:00:00", status="lost",
                                    kind="infra")
        assert resumed.attempt == 2 and resumed.resumed_from.latest == "state.json"
        assert json.loads(share.read_bytes("far/train-remote/outputs/model.json")) == {"weights": 15}
        assert {e.name for e in record.outputs} == {"model.json", "figures/curve.txt"}
        dest = tmp_path / "fetched"
        fetch(share, "far", dest)
        assert (dest / "far" / "train-remote" / "outputs" / "figures" / "curve.txt").read_text() == "1 2 3"
        # given a mount (Azure ML's ro_mount), the input is that folder and nothing is pulled
        requests = len(server.requests)
        again = execute_run(dataclasses.replace(run, run_id="train-mounted", parameters={"FAIL_AT_END": True}),
                            share, AttemptContext(project_root=project, input_paths={"DATA_DIR": str(data)}))
        assert again.status == "failed" and again.inputs["DATA_DIR"].path == str(data)
        assert not any("/datasets/" in r.path for r in server.requests[requests:])
        # a run that did not succeed keeps its checkpoints on the share, pushed after the attempt
        assert json.loads(share.read_bytes("far/train-mounted/checkpoints/state.json")) == {"epoch": 5, "weights": 15}


@pytest.mark.slow
@pytest.mark.azure  # the Azure Files share needs the azure extra
def test_the_pytorch_notebook_trains_on_cifar_pushed_to_a_share_and_its_model_comes_back(
        pytorch_env, project, monkeypatch, tmp_path, capsys):
    """What a user does for a cluster: `nbbatch data push` CIFAR-10 (here a small synthetic one, same format) to an
    Azure File share (the fake), name its URL as the input, and get the trained model back with `nbbatch fetch`."""
    import subprocess

    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    from nbbatch.data import write_cifar10_batches
    from nbbatch.ui.cli import main

    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
        write_cifar10_batches(tmp_path / "data", n_train_per_batch=40, n_test=20)  # data/cifar-10-batches-py/
        url = f"azfiles://{ACCOUNT}/datasets/cifar10"
        assert main(["data", "push", str(tmp_path / "data"), url, "-q"]) == 0
        assert "pushed 6 file(s)" in capsys.readouterr().out  # 5 training batches and the test batch
        exp = tmp_path / "cifar.yaml"
        exp.write_text("experiment: cifar-in\nframeworks: [pytorch]\n"
                       "parameters: {DATASET: cifar10, EPOCHS: 1, MAX_SAMPLES: 64}\n"
                       f"inputs: {{DATA_DIR: '{url}'}}\nshare: results\n")
        assert main(["submit", str(exp), "-q"]) == 0
        assert main(["fetch", str(exp), str(tmp_path / "fetched")]) == 0
    (run,) = (tmp_path / "fetched" / "cifar-in").iterdir()
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "succeeded" and record["inputs"]["DATA_DIR"]["source"] == url
    shapes = subprocess.run(  # the saved state dict, loaded by the framework's own torch
        [str(pytorch_env.path / "bin" / "python"), "-c", "import sys, torch; state = torch.load(sys.argv[1]); "
         "print([tuple(t.shape) for t in state.values()])", str(run / "outputs" / "model.pt")],
        capture_output=True, text=True, check=True).stdout
    assert "(10, 512)" in shapes  # the last layer: N_CLASSES × 512
    assert {e["name"] for e in record["outputs"]} >= {"model.pt"}


def test_an_input_url_with_a_token_is_refused(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["print(DATA_DIR)"], parameters="DATA_DIR = 'data'")
    exp = write_experiment("experiment: tok\nnotebooks: [nb.ipynb]\n"
                           "inputs: {DATA_DIR: 'azfiles://acct/share/data?sv=2024&sig=abc'}\n")
    with pytest.raises(SpecError, match="SAS token.*never from the experiment file"):
        submit(exp, progress=False)


def test_atomic_path_replaces_files_and_folders_whole_and_leaves_nothing_on_failure(tmp_path):
    from nbbatch.artifacts import atomic_path

    target = tmp_path / "model.keras"
    with atomic_path(target) as tmp:
        assert tmp.suffix == ".keras" and tmp.parent == tmp_path and not tmp.exists()
        tmp.write_text("v1")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-save")
    assert target.read_text() == "v1"
    for version in ("v1", "v2"):  # a SavedModel folder, saved twice
        with atomic_path(tmp_path / "saved") as tmp:
            tmp.mkdir()
            (tmp / "weights").write_text(version)
    assert (tmp_path / "saved" / "weights").read_text() == "v2"
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "saved") as tmp:
        tmp.mkdir()
        raise RuntimeError("killed mid-save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras", "saved"]  # no temporary left


def test_background_writer_writes_in_order_one_at_a_time_and_reports_a_failed_write(tmp_path):
    import threading

    from nbbatch.artifacts import BackgroundWriter

    target, release, seen = tmp_path / "checkpoint.pt", threading.Event(), []

    def slow(version):
        def write(tmp):
            release.wait(30)  # held until the caller has asked for the next write
            assert not tmp.exists() and tmp.parent == tmp_path
            tmp.write_text(version)
            seen.append(version)
        return write

    writer = BackgroundWriter()
    writer.write(target, slow("epoch 1"))
    assert not target.exists()  # the call returned while the write waits: training would go on meanwhile
    release.set()
    writer.write(target, slow("epoch 2"))  # waits for epoch 1's write first
    writer.wait()
    assert seen == ["epoch 1", "epoch 2"] and target.read_text() == "epoch 2"

    def broken(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    writer.write(target, broken)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    assert target.read_text() == "epoch 2"  # the failed write left the last checkpoint whole, and no temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    writer.wait()  # the failure was reported once
